"""Hugging Face Llama checkpoints <-> sweet_jax Llama: one declarative name table for import and export.

Import reads config.json and the safetensors files directly (no torch): one tensor at a time is read from
disk and each device receives only its own slice, so host memory stays near the largest tensor.
Export streams one tensor at a time into sharded safetensors files plus the index, config.json,
generation_config.json and the tokenizer files.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shutil
import warnings
from typing import Callable, Iterable, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from sweet_jax import sharding as sharding_lib
from sweet_jax.errors import SweetJaxError
from sweet_jax.models.llama import Llama, LlamaConfig, ROPE_TYPES


class HFCheckpointError(SweetJaxError):
    """A Hugging Face checkpoint directory that cannot be read as a supported Llama."""


class MissingConfigError(HFCheckpointError):
    pass


class UnsupportedModelError(HFCheckpointError):
    pass


class MissingTensorError(HFCheckpointError):
    pass


class TensorShapeError(HFCheckpointError):
    pass


# ----------------------------------------------------------------------------------------------------------
# The name table. A row: HF tensor name <-> module path ({i} = layer index), and how the array changes.
# HF Linear weights are [out, in]; ours are [in..., out...] with heads split out, e.g. q: [N*H, D] <-> [D, N, H].
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Transform:
    name: str
    hf_shape: Callable[[tuple], tuple]              # our shape -> expected HF shape
    to_nnx: Callable[[np.ndarray, tuple], np.ndarray]  # HF array, our shape -> our array (a view when possible)
    to_hf: Callable[[np.ndarray], np.ndarray]       # our array -> HF array


def _linear(in_ndim: int) -> Transform:
    """HF [out, in] <-> ours [in axes..., out axes...] where the first `in_ndim` of our axes are the input."""
    return Transform(
        name=f"linear{in_ndim}",
        hf_shape=lambda s: (math.prod(s[in_ndim:]), math.prod(s[:in_ndim])),
        to_nnx=lambda x, s: x.T.reshape(s),
        to_hf=lambda x: x.reshape(math.prod(x.shape[:in_ndim]), -1).T,
    )


SAME = Transform("same", lambda s: tuple(s), lambda x, s: x, lambda x: x)
FLAT = Transform("flat", lambda s: (math.prod(s),), lambda x, s: x.reshape(s), lambda x: x.reshape(-1))
LINEAR = _linear(1)       # [D, F], [D, N, H], ...
LINEAR_HEADS_IN = _linear(2)   # o_proj: [N, H, D]

NAME_TABLE: tuple[tuple[str, str, Transform], ...] = (
    # HF name                                          module path                            transform
    ("model.embed_tokens.weight",                      "embedder.embedding",                  SAME),
    ("model.layers.{i}.input_layernorm.weight",        "layers.{i}.input_norm.scale",         SAME),
    ("model.layers.{i}.self_attn.q_proj.weight",       "layers.{i}.attn.q_proj.kernel",       LINEAR),
    ("model.layers.{i}.self_attn.q_proj.bias",         "layers.{i}.attn.q_proj.bias",         FLAT),
    ("model.layers.{i}.self_attn.k_proj.weight",       "layers.{i}.attn.k_proj.kernel",       LINEAR),
    ("model.layers.{i}.self_attn.k_proj.bias",         "layers.{i}.attn.k_proj.bias",         FLAT),
    ("model.layers.{i}.self_attn.v_proj.weight",       "layers.{i}.attn.v_proj.kernel",       LINEAR),
    ("model.layers.{i}.self_attn.v_proj.bias",         "layers.{i}.attn.v_proj.bias",         FLAT),
    ("model.layers.{i}.self_attn.o_proj.weight",       "layers.{i}.attn.o_proj.kernel",       LINEAR_HEADS_IN),
    ("model.layers.{i}.self_attn.o_proj.bias",         "layers.{i}.attn.o_proj.bias",         SAME),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_norm.scale", SAME),
    ("model.layers.{i}.mlp.gate_proj.weight",          "layers.{i}.mlp.gate_proj.kernel",     LINEAR),
    ("model.layers.{i}.mlp.gate_proj.bias",            "layers.{i}.mlp.gate_proj.bias",       SAME),
    ("model.layers.{i}.mlp.up_proj.weight",            "layers.{i}.mlp.up_proj.kernel",       LINEAR),
    ("model.layers.{i}.mlp.up_proj.bias",              "layers.{i}.mlp.up_proj.bias",         SAME),
    ("model.layers.{i}.mlp.down_proj.weight",          "layers.{i}.mlp.down_proj.kernel",     LINEAR),
    ("model.layers.{i}.mlp.down_proj.bias",            "layers.{i}.mlp.down_proj.bias",       SAME),
    ("model.norm.weight",                              "final_norm.scale",                    SAME),
    ("lm_head.weight",                                 "lm_head.kernel",                      LINEAR),
)
# HF tensors that carry no parameters (old checkpoints stored the RoPE buffer).
IGNORED_HF_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")

_PATH_RULES = [(re.compile("^" + re.escape(path).replace(r"\{i\}", r"(\d+)") + "$"), hf, transform)
               for hf, path, transform in NAME_TABLE]


def hf_name_for(module_path: str) -> tuple[str, Transform]:
    """'layers.3.attn.q_proj.kernel' -> ('model.layers.3.self_attn.q_proj.weight', LINEAR)."""
    for pattern, hf, transform in _PATH_RULES:
        if match := pattern.match(module_path):
            return hf.replace("{i}", match.group(1)) if match.groups() else hf, transform
    raise KeyError(f"no row of NAME_TABLE maps module path {module_path!r}")


def _module_path(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _param_items(model_or_state) -> list[tuple[str, nnx.Variable]]:
    """(module path, Variable) for every parameter, in a stable order (layers by index)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return [(_module_path(path), var) for path, var in nnx.to_flat_state(state)]


def _tensor_entries(state, config: LlamaConfig) -> list[tuple[str, str, Transform, nnx.Variable, int | None, tuple]]:
    """(module path, HF name, transform, variable, layer index, tensor shape) per HF tensor. With scan_layers
    the decoder layers are one module whose variables are stacked [L, ...]: each stacked variable stands for L
    HF tensors ('layers.attn.q_proj.kernel'[i] is the table's 'layers.{i}.attn.q_proj.kernel'); layer index is
    None for a variable that is one HF tensor."""
    entries = []
    for module_path, var in _param_items(state):
        if config.scan_layers and module_path.startswith("layers."):
            rest = module_path[len("layers."):]
            for i in range(var.shape[0]):
                hf_name, transform = hf_name_for(f"layers.{i}.{rest}")
                entries.append((f"{module_path}[{i}]", hf_name, transform, var, i, tuple(var.shape[1:])))
        else:
            hf_name, transform = hf_name_for(module_path)
            entries.append((module_path, hf_name, transform, var, None, tuple(var.shape)))
    return entries


def _sharded_zeros(shape, dtype, sharding) -> jax.Array:
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stack_L, value, i):
    """stack_L[i] = value in place (the stack is donated): a stacked variable is filled one layer at a time."""
    return jax.lax.dynamic_update_index_in_dim(stack_L, value.astype(stack_L.dtype), i, 0)


# ----------------------------------------------------------------------------------------------------------
# Config checks
# ----------------------------------------------------------------------------------------------------------

def read_hf_config(path) -> dict:
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise MissingConfigError(
            f"{config_file}: not found. load_hf expects a Hugging Face model directory "
            f"(config.json + *.safetensors), e.g. one written by save_pretrained or save_hf.")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{config_file}:{e.lineno}: not valid JSON ({e.msg}).") from None
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type != "llama" or any(a != "LlamaForCausalLM" for a in architectures):
        raise UnsupportedModelError(
            f"{config_file}: model_type={model_type!r}, architectures={architectures}: only Llama models "
            f"(model_type 'llama', LlamaForCausalLM: Llama 2, 3, 3.1, 3.2) are supported.")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{config_file}: rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}).")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{config_file}: hidden_act={hf['hidden_act']!r}; only 'silu' is supported.")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise HFCheckpointError(f"{config_file}: field {key!r} is missing.")
    try:  # sizes (llama.SIZE_LIMITS) and their consistency, before any reader builds anything from them
        LlamaConfig.from_hf(hf)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise HFCheckpointError(f"{config_file}: {e}; the config is damaged or not a Llama's.") from None
    return hf


# ----------------------------------------------------------------------------------------------------------
# safetensors without torch: the format is an 8-byte header length, a JSON header, then raw little-endian data.
# ----------------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


def _read_safetensors_header(file: pathlib.Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data section), validated as the
    safetensors library validates it: a header length within the file and its limit, a JSON object, each tensor's
    dtype known, shape of non-negative integers and offsets [begin, end] with end - begin its byte size, and the
    tensors tiling the data section from 0 to its end (no overlap, no gap, nothing past the file)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise HFCheckpointError(f"{file}: not a safetensors file (header length {n} for a {size}-byte file; "
                                    f"at most {MAX_HEADER_BYTES}).")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HFCheckpointError(f"{file}: not a safetensors file (unreadable header).") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{file}: not a safetensors file (the header is not a JSON object).")
    header.pop("__metadata__", None)
    spans = []
    for name, info in header.items():
        def bad(why):
            return HFCheckpointError(f"{file}: tensor {name!r}: {why}; the file is damaged or not a safetensors "
                                     "checkpoint (re-download or re-export it).")
        if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
            raise bad(f"dtype {info.get('dtype') if isinstance(info, dict) else info!r} is not a safetensors dtype "
                      f"({', '.join(_ST_DTYPES)})")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"shape {shape!r} is not a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
        nbytes = int(np.prod(shape, dtype=object)) * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its shape {shape} x "
                      f"{info['dtype']} needs {nbytes}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise HFCheckpointError(f"{file}: tensor {name!r} starts at byte {begin} of the data, but the tensor "
                                    f"before it ends at {end}: the tensors {'overlap' if begin < end else 'leave a gap'}"
                                    "; the file is damaged or not a safetensors checkpoint.")
        end = stop
    if 8 + n + end != size:
        raise HFCheckpointError(f"{file}: the header describes {end} bytes of tensor data, the file holds "
                                f"{size - 8 - n}; the file is truncated or damaged (re-download or re-export it).")
    return header, 8 + n


def _model_file(path: pathlib.Path, name, where) -> pathlib.Path:
    """`name` (from the index) as a file of the model directory: a relative path that stays inside it."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or \
            os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise HFCheckpointError(f"{where}: names the file {name!r}, which is not inside the model directory {path}; "
                                "an index may only name files beside it.")
    return path / name


class TensorSource(Protocol):
    """Tensors under their HF names, in HF layout, read one at a time: what the import loop reads from.
    Safetensors files are one source; a GGUF file (sweet_jax.models.gguf) is another."""

    config_name: str  # where the config came from, for error messages: 'config.json', 'the GGUF metadata'

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple: ...

    def read(self, name: str) -> np.ndarray: ...

    def where(self, name: str) -> str:
        """The tensor as the user would find it, e.g. 'model-00001-of-00002.safetensors: tensor "lm_head.weight"'."""
        ...


class _SafetensorsDir:
    """The tensors of a checkpoint directory, each read on demand with one file read."""

    config_name = "config.json"

    def __init__(self, path: pathlib.Path):
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise HFCheckpointError(f"{index_file}: not a safetensors index (JSON with a weight_map of tensor "
                                        "name -> file name).") from None
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise HFCheckpointError(f"{path}: no *.safetensors files (and no model.safetensors.index.json). "
                                        f"Convert .bin checkpoints with transformers' save_pretrained first.")
        self.entries: dict[str, tuple[pathlib.Path, dict, int]] = {}
        for name in files:
            file = _model_file(path, name, index_file)
            if not file.is_file():
                raise HFCheckpointError(f"{index_file}: lists {name}, which does not exist in {path}.")
            header, data_start = _read_safetensors_header(file)
            for tensor, info in header.items():
                self.entries[tensor] = (file, info, data_start)

    def names(self) -> Iterable[str]:
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name][1]["shape"])

    def where(self, name: str) -> str:
        return f"{self.entries[name][0]}: tensor {name!r}"

    def read(self, name: str) -> np.ndarray:
        file, info, data_start = self.entries[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise HFCheckpointError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}.")
        begin, end = info["data_offsets"]
        out = np.empty(tuple(info["shape"]), dtype)
        with open(file, "rb") as f:
            f.seek(data_start + begin)
            if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != end - begin:
                raise HFCheckpointError(f"{file}: tensor {name} is truncated (file shorter than its header says).")
        return out


# ----------------------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------------------

def load_hf(path, *, dtype=None, mesh=None, config_overrides=None) -> Llama:
    """A Llama with the weights of the HF checkpoint at `path`.

    dtype: parameter dtype (default float32). mesh: place every tensor onto its NamedSharding (per
    sweet_jax.sharding.LOGICAL_RULES) as it is read; without a mesh, onto the default device.
    config_overrides: LlamaConfig fields to set, e.g. {'dtype': 'bfloat16', 'remat': 'full'}.
    """
    path = pathlib.Path(path)
    hf = read_hf_config(path)
    overrides = dict(config_overrides or {})
    overrides["param_dtype"] = np.dtype(dtype or overrides.get("param_dtype", "float32")).name
    config = LlamaConfig.from_hf(hf, **overrides)
    return load_params(config, _SafetensorsDir(path), where=path, mesh=mesh)


def load_params(config: LlamaConfig, tensors: TensorSource, *, where, mesh=None) -> Llama:
    """A Llama of `config` whose every parameter is read from `tensors` through NAME_TABLE, one tensor at a time,
    each device receiving only its own slice (per sweet_jax.sharding.LOGICAL_RULES when `mesh` is given).
    `where` names the checkpoint in messages."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    device_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    param_dtype = np.dtype(config.param_dtype)

    available = set(tensors.names())
    used = set()
    stacks = {}  # id(stacked variable) -> its device array being filled layer by layer
    entries = _tensor_entries(state, config)
    for module_path, hf_name, transform, var, layer, shape in tqdm(entries, desc=f"load {pathlib.Path(where).name}",
                                                                   unit="tensor", leave=False):
        if hf_name not in available:
            raise MissingTensorError(
                f"{where}: tensor {hf_name!r} (for {module_path}) is missing, but {tensors.config_name} "
                f"needs it (tie_word_embeddings={config.tie_word_embeddings}, "
                f"attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias}).")
        expected = transform.hf_shape(shape)
        if tensors.shape(hf_name) != expected:
            raise TensorShapeError(
                f"{tensors.where(hf_name)} has shape {list(tensors.shape(hf_name))}, but {tensors.config_name} "
                f"implies {list(expected)}. Check that {tensors.config_name} belongs to these weights.")
        used.add(hf_name)
        hf_array = tensors.read(hf_name)
        ours = transform.to_nnx(hf_array, shape)  # a view: each device copies only its slice below
        sharding = sharding_lib.variable_sharding(var, mesh) if mesh is not None else device_sharding
        if layer is None:
            value = jax.make_array_from_callback(
                shape, sharding, lambda index: np.asarray(ours[index], dtype=param_dtype))
            var.set_value(value)
        else:
            # One layer of a stacked variable: place it with the layer's own sharding, then write it into the
            # [L, ...] device array in place; the host never holds more than this one tensor.
            if id(var) not in stacks:
                stacks[id(var)] = _sharded_zeros(var.shape, param_dtype, sharding)
            layer_sharding = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
                              if mesh is not None else device_sharding)
            value = jax.make_array_from_callback(
                shape, layer_sharding, lambda index: np.asarray(ours[index], dtype=param_dtype))
            stacks[id(var)] = _write_layer(stacks[id(var)], value, np.int32(layer))
            if layer == var.shape[0] - 1:
                var.set_value(stacks.pop(id(var)))
        del hf_array, ours

    unused = [n for n in available if n not in used and not IGNORED_HF_TENSORS.match(n)]
    if unused and not (config.tie_word_embeddings and unused == ["lm_head.weight"]):
        warnings.warn(f"{where}: {len(unused)} tensors were not used, e.g. {sorted(unused)[:3]}.")
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def parse_size(size) -> int:
    """'5GB' -> 5 * 10**9, '5GiB' -> 5 * 2**30, ints as is (as transformers reads max_shard_size)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise SweetJaxError(f"max_shard_size={size!r}: expected bytes or a size like '5GB' / '500MB'.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def _host_array(value: jax.Array) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))


def save_hf(model: Llama, path, *, tokenizer_dir=None, max_shard_size="5GB", dtype=None) -> pathlib.Path:
    """Write `model` as a HF checkpoint that transformers' AutoModelForCausalLM.from_pretrained loads.

    dtype: tensor dtype on disk (default: the parameter dtype). Tensors are streamed one at a time into
    shards of at most max_shard_size; tokenizer files (and generation_config.json) found in tokenizer_dir are
    copied. In multi-process runs every process must call this (gathers are collective); process 0 writes.
    """
    path = pathlib.Path(path)
    config: LlamaConfig = model.config
    out_dtype = np.dtype(dtype or config.param_dtype)
    limit = parse_size(max_shard_size)
    writer = jax.process_index() == 0

    # Plan: HF name, HF shape, variable, transform; then greedy shards in table order.
    plan = []
    for _, hf_name, transform, var, layer, shape in _tensor_entries(nnx.state(model, nnx.Param), config):
        plan.append((hf_name, transform.hf_shape(shape), (var, layer), transform))
    shards, size = [[]], 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * out_dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes

    if writer:
        path.mkdir(parents=True, exist_ok=True)
    weight_map, total_size = {}, 0
    progress = tqdm(total=len(plan), desc=f"save_hf {path.name}", unit="tensor", leave=False)
    for shard_index, shard in enumerate(shards):
        file_name = f"model-{shard_index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for hf_name, hf_shape, _, _ in shard:
            nbytes = math.prod(hf_shape) * out_dtype.itemsize
            header[hf_name] = {"dtype": _ST_NAMES[out_dtype], "shape": list(hf_shape),
                               "data_offsets": [offset, offset + nbytes]}
            weight_map[hf_name] = file_name
            offset += nbytes
        total_size += offset
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)  # data section 8-byte aligned, as safetensors writes
        f = open(path / file_name, "wb") if writer else None
        try:
            if f:
                f.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
            for hf_name, hf_shape, (var, layer), transform in shard:
                value = var[...] if layer is None else var[...][layer]  # one layer of a stacked variable
                hf_array = np.ascontiguousarray(transform.to_hf(_host_array(value)).astype(out_dtype))
                assert hf_array.shape == tuple(hf_shape), (hf_name, hf_array.shape, hf_shape)
                if f:
                    f.write(memoryview(hf_array.reshape(-1).view(np.uint8)))
                progress.update()
        finally:
            if f:
                f.close()
    progress.close()
    if not writer:
        return path

    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n")
    hf_config = config.to_hf(torch_dtype=out_dtype.name)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    tokenizer_dir = pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer_dir is not None:
        if not tokenizer_dir.is_dir():
            raise SweetJaxError(f"tokenizer_dir={tokenizer_dir}: not a directory.")
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, path / name)
    if tokenizer_dir is not None and (tokenizer_dir / "generation_config.json").is_file():
        shutil.copy2(tokenizer_dir / "generation_config.json", path / "generation_config.json")
    else:
        eos = config.eos_token_id
        (path / "generation_config.json").write_text(json.dumps({
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        }, indent=2) + "\n")
    return path
