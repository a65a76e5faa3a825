"""A Llama-family causal LM (Llama 2, 3, 3.1, 3.2) in Flax NNX, standalone: jax + flax + numpy only.

Shape letters used in names:
  B batch, T query tokens, S key/value slots, D hidden (embed), V vocab, F mlp (intermediate),
  N query heads, K key/value heads, G = N // K query heads per kv head, H head_dim.

Parameter layout (module path: shape, logical axes) -- the HF name table lives in hf.py:
  embedder.embedding                 [V, D]     ('vocab', 'embed')
  layers[i].input_norm.scale         [D]        ('norm',)
  layers[i].attn.q_proj.kernel       [D, N, H]  ('embed', 'heads', 'head_dim')      (+ bias [N, H])
  layers[i].attn.k_proj.kernel       [D, K, H]  ('embed', 'kv_heads', 'head_dim')   (+ bias [K, H])
  layers[i].attn.v_proj.kernel       [D, K, H]  ('embed', 'kv_heads', 'head_dim')   (+ bias [K, H])
  layers[i].attn.o_proj.kernel       [N, H, D]  ('heads', 'head_dim', 'embed')      (+ bias [D])
  layers[i].post_attention_norm.scale[D]        ('norm',)
  layers[i].mlp.gate_proj.kernel     [D, F]     ('embed', 'mlp')                    (+ bias [F])
  layers[i].mlp.up_proj.kernel       [D, F]     ('embed', 'mlp')                    (+ bias [F])
  layers[i].mlp.down_proj.kernel     [F, D]     ('mlp', 'embed')                    (+ bias [D])
  final_norm.scale                   [D]        ('norm',)
  lm_head.kernel                     [D, V]     ('embed', 'vocab')   (absent when embeddings are tied)
With scan_layers=True, layers[i].X is instead one layers.X of shape [L, ...] with axes ('layers', ...).

Logical axis names are stored as the Variable's `out_sharding` metadata (flax 0.12 NNX); eager sharding is
off because they are logical names, not mesh axes: sweet_jax.sharding maps them onto a mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sweet_jax.models import cpu_matmul
from sweet_jax.models.attention import (ATTENTION_IMPLS, KVCache, cache_slots, cached_attention, causal_mask,
                                        init_kv_cache, self_attention)

ROPE_TYPES = ("default", "linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable", "nothing_saveable")
# The largest size a config may ask for, each well above any Llama (405B: hidden 16384, FFN 53248, 126 layers,
# 128 heads): a config file past one is hostile or damaged, and is refused before anything is built.
SIZE_LIMITS = {"vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_layers": 1024,
               "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24}


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # HF rope parameters without rope_theta, as sorted (key, value) pairs so the config stays hashable,
    # e.g. (('factor', 8.0), ('high_freq_factor', 4.0), ..., ('rope_type', 'llama3')). None = plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 128000
    eos_token_id: int | tuple[int, ...] | None = 128001
    param_dtype: str = "float32"
    dtype: str = "float32"          # compute dtype; logits are always float32
    remat: str = "none"             # per decoder layer: one of REMAT_POLICIES
    # "xla": jax.nn.dot_product_attention's XLA path, materialises float32 [B, N, T, S] logits.
    # "chunked": the same per block of attention_chunk_size queries under jax.checkpoint (one block's logits
    #   alive, forward and backward; same values, same FLOPs). "cudnn": GPU fused attention (16-bit only).
    # "blocked": query blocks of attention_block_size, unrolled, block i attending only keys before its end:
    #   skips the masked upper triangle ((n+1)/2n of the logits for n blocks), no remat; fastest on CPU.
    # "auto": cuDNN on GPU for 16-bit compute; on CPU blocked when T spans >= 2 blocks; elsewhere (TPU,
    #   fp32 GPU) chunked when T > AUTO_CHUNKED_MIN_LEN; else XLA.
    # Fully masked (padding) query rows differ between implementations; real rows agree.
    attention_impl: str = "auto"
    attention_chunk_size: int = 512
    attention_block_size: int = 128
    # True: the decoder layers are one module whose parameters are stacked on a leading 'layers' axis, run by
    # jax.lax.scan: XLA compiles one layer instead of num_layers (minutes instead of tens for 8B/70B) and
    # keeps one layer's all-gathered weights alive at a time. Training only: the KV-cache path needs False.
    scan_layers: bool = False
    # PartitionSpec entries for the [B, T, D] residual stream between decoder layers, applied when a mesh is set
    # (jax.set_mesh) and ignored otherwise, e.g. (('data', 'fsdp'), 'tensor', None): sequence-parallel layer
    # inputs, so the ones remat saves take 1/tensor of the memory (XLA gathers T inside each layer).
    residual_sharding: tuple | None = None
    # The Dense projections' and the unembedding's matmuls (models/cpu_matmul.py): "xla" (the compute dtype),
    # bfloat16 operands with float32 accumulation as "xla_bf16" (XLA's dot) or "onednn" (oneDNN's kernel, which
    # uses AMX), "auto" (on a single CPU device with bf16 units, AMX or AVX512-BF16: onednn, xla_bf16 where its
    # kernel does not build; else xla).
    cpu_matmul: str = "auto"

    def __post_init__(self):
        for field, limit in SIZE_LIMITS.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= limit:
                raise ValueError(f"{field}={value!r}: expected an integer in [1, {limit}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}: expected one of {REMAT_POLICIES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}: expected one of {ATTENTION_IMPLS}")
        if min(self.attention_chunk_size, self.attention_block_size) < 1:
            raise ValueError("attention_chunk_size and attention_block_size must be >= 1")
        if self.cpu_matmul not in cpu_matmul.MODES:
            raise ValueError(f"cpu_matmul={self.cpu_matmul!r}: expected one of {cpu_matmul.MODES}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))

    # --- derived -------------------------------------------------------------------------------------------
    @property
    def matmul(self) -> str:
        """cpu_matmul as this model runs it: "auto" keeps XLA's float32 matmuls below cpu_matmul.AUTO_MIN_HIDDEN."""
        return cpu_matmul.model_mode(self.cpu_matmul, self.hidden_size)

    @property
    def rope_type(self) -> str:
        scaling = dict(self.rope_scaling or ())
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def num_params(self) -> int:
        """Number of parameters (the embedding table counted once when tied)."""
        D, F, V, N, K, H = (self.hidden_size, self.intermediate_size, self.vocab_size,
                            self.num_heads, self.num_kv_heads, self.head_dim)
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.attention_bias:
            attn += N * H + 2 * K * H + D
        mlp = 3 * D * F + ((2 * F + D) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * D
        return V * D + self.num_layers * per_layer + D + (0 if self.tie_word_embeddings else D * V)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B convention:
        6 * (matmul parameters) + 12 * layers * heads * head_dim * seq_len (attention scores and values,
        causal mask not discounted). Matmul parameters = all but the embedding lookup, plus the unembedding
        (counted even when tied, since it is a real [D, V] matmul)."""
        matmul_params = self.num_params() - self.vocab_size * self.hidden_size
        if self.tie_word_embeddings:
            matmul_params += self.vocab_size * self.hidden_size
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * matmul_params + attention

    # --- HF config.json ------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "LlamaConfig":
        """From a HF LlamaConfig dict (config.json). Accepts both the transformers>=5 `rope_parameters`
        layout and the older top-level `rope_theta` + `rope_scaling`."""
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        num_heads = hf["num_attention_heads"]
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope.items())) or None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self, torch_dtype: str | None = None) -> dict:
        """A config.json dict that transformers' LlamaForCausalLM (and vLLM) load. Rope settings are written
        in the older top-level form, which every reader understands."""
        rope_scaling = dict(self.rope_scaling) if self.rope_scaling else None
        eos = self.eos_token_id
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
            "torch_dtype": torch_dtype or self.param_dtype,
        }

    # --- presets (the PRESETS table below) ------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "LlamaConfig":
        """The named architecture of PRESETS with `overrides` (dtypes, remat, ...; vocab_size for tiny)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}: expected one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _LLAMA3_ROPE(factor: float, original_max_position_embeddings: int) -> tuple:
    return tuple(sorted(dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=original_max_position_embeddings).items()))


_LLAMA3 = dict(vocab_size=128256, num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, bos_token_id=128000, eos_token_id=(128001, 128008, 128009))

# Model sizes by name (config `model.preset`, LlamaConfig.preset): the LlamaConfig fields of each.
PRESETS: dict[str, dict[str, Any]] = {
    # A few-hundred-K-parameter model for tests and the CPU demo (GQA, llama3 rope like 3.1); its vocab_size is
    # usually replaced by the tokenizer's.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE(8.0, 64), max_position_embeddings=2048,
                 bos_token_id=None, eos_token_id=None),
    # meta-llama/Llama-3.2-1B(-Instruct) config.json
    "llama3_1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, head_dim=64,
                      rope_scaling=_LLAMA3_ROPE(32.0, 8192), tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B(-Instruct) config.json
    "llama3_8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, head_dim=128,
                      rope_scaling=_LLAMA3_ROPE(8.0, 8192), tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B(-Instruct) config.json
    "llama3_70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       head_dim=128, rope_scaling=_LLAMA3_ROPE(8.0, 8192), tie_word_embeddings=False),
}


# ----------------------------------------------------------------------------------------------------------
# RoPE: inverse frequencies are static (from the config); cos/sin computed once per forward from positions.
# ----------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """[H/2] float32, as transformers computes it (float32 throughout) for default / linear / llama3."""
    H = config.head_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, H, 2, dtype=np.float32) / np.float32(H)))
    inv_freq = inv_freq.astype(np.float32)
    scaling = dict(config.rope_scaling or ())
    if config.rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif config.rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions_BT: jax.Array, config: LlamaConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H/2] in the compute dtype (the 1 broadcasts over heads)."""
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    return jnp.cos(angles_BTh)[:, :, None, :].astype(dtype), jnp.sin(angles_BTh)[:, :, None, :].astype(dtype)


def apply_rope(x_BTnH: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half convention: the two halves of each head are the (real, imaginary) parts."""
    x1, x2 = jnp.split(x_BTnH, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions of real tokens counted from the first real token (left or right padding): cumsum - 1, >= 0."""
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal_init(key, shape, dtype):  # one compiled op per shape: eager model construction stays quick
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # HF initializer_range


def _param(rngs: nnx.Rngs, shape, axes: tuple[str, ...], dtype, init: str) -> nnx.Param:
    shape, dtype = tuple(shape), jnp.dtype(dtype)
    if init == "normal":
        value = _normal_init(rngs.params(), shape, dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Dense(nnx.Module):
    """x @ kernel (+ bias), written as an einsum over named axes, e.g. 'BTD,DNH->BTNH'."""

    def __init__(self, shape, axes, *, einsum: str, bias: bool, param_dtype, dtype, rngs: nnx.Rngs,
                 matmul: str = "xla"):
        self.einsum_str = einsum
        self.dtype = dtype
        self.matmul = matmul  # LlamaConfig.matmul
        self.kernel = _param(rngs, shape, axes, param_dtype, "normal")
        x_sub, rest = einsum.split(",")
        kernel_sub, out_sub = rest.split("->")
        contracted = "".join(d for d in kernel_sub if d not in out_sub)
        # Contracted axes trailing x and leading the kernel, in the same order: one axis with flat_contraction.
        self.contracted = len(contracted) if x_sub.endswith(contracted) and kernel_sub.startswith(contracted) else 0
        self.flat_einsum = (einsum if self.contracted < 2 else
                            f"{x_sub[:-self.contracted]}Z,Z{kernel_sub[self.contracted:]}->{out_sub}")
        out_dims = [i for i, d in enumerate(kernel_sub) if d in out_sub]  # the bias covers the output axes
        self.bias = (_param(rngs, tuple(shape[i] for i in out_dims), tuple(axes[i] for i in out_dims),
                            param_dtype, "zeros") if bias else None)
        # LoRA adapters (models/lora.py add_adapters): none by default; data attributes, so they can become Variables.
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)
        self.lora_scale = 0.0

    def _lora_einsums(self) -> tuple[str, str, str]:
        """(x @ A, (x @ A) @ B, A @ B) as einsums over the kernel's axes; R is the adapter rank."""
        x_sub, rest = self.einsum_str.split(",")
        kernel_sub, out_sub = rest.split("->")
        in_sub = "".join(d for d in kernel_sub if d not in out_sub)
        out_k = "".join(d for d in kernel_sub if d in out_sub)
        x_left = "".join(d for d in x_sub if d not in in_sub)
        return f"{x_sub},{in_sub}R->{x_left}R", f"{x_left}R,R{out_k}->{out_sub}", f"{in_sub}R,R{out_k}->{kernel_sub}"

    def add_lora(self, rank: int, scale: float, key, *, stacked: bool = False):
        """Attach adapters A [in..., rank] (uniform +-1/sqrt(fan_in), PEFT's init) and B [rank, out...] (zeros) as
        nnx.LoRAParam, with the kernel's logical axes; stacked: the kernel is a scanned stack [L, ...] and so are
        the adapters. At least float32 (the trained copy) whatever the frozen kernel's dtype."""
        kernel_sub = self.einsum_str.split("->")[0].split(",")[1]
        out_sub = self.einsum_str.split("->")[1]
        n_lead = 1 if stacked else 0
        shape, axes = self.kernel.shape, tuple(self.kernel.get_metadata().get("out_sharding"))
        ins = [n_lead + i for i, d in enumerate(kernel_sub) if d not in out_sub]
        outs = [n_lead + i for i, d in enumerate(kernel_sub) if d in out_sub]
        pick = lambda t, idx: tuple(t[:n_lead]) + tuple(t[i] for i in idx)  # noqa: E731
        bound = 1.0 / math.sqrt(math.prod(shape[i] for i in ins))
        dtype = jnp.promote_types(self.kernel.dtype, jnp.float32)
        a = jax.random.uniform(key, pick(shape, ins) + (rank,), jnp.float32, -bound, bound).astype(dtype)
        self.lora_a = nnx.LoRAParam(a, out_sharding=pick(axes, ins) + ("lora_rank",), eager_sharding=False)
        b_shape = pick(shape, outs)[:n_lead] + (rank,) + pick(shape, outs)[n_lead:]
        self.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, dtype), eager_sharding=False,
                                    out_sharding=pick(axes, outs)[:n_lead] + ("lora_rank",) + pick(axes, outs)[n_lead:])
        self.lora_scale = float(scale)

    def merge_lora(self):
        """Fold the adapters into the kernel (W + scale * A @ B, in float32) and drop them."""
        merge = self._lora_einsums()[2]
        if self.lora_a[...].ndim > len(merge.split(",")[0]):  # a scanned stack: one more leading axis
            merge = "L" + merge.replace(",", ",L").replace("->", "->L")
        delta = jnp.einsum(merge, self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32))
        self.kernel.set_value((self.kernel[...].astype(jnp.float32) + self.lora_scale * delta).astype(self.kernel.dtype))
        self.lora_a = self.lora_b = None
        self.lora_scale = 0.0

    def __call__(self, x, *, flat_contraction: bool = False):
        """flat_contraction: contract the kernel's leading axes (o_proj's heads and head_dim) as one flattened
        axis. The same product; in the decode loop XLA:CPU otherwise copies the kernel into another axis order at
        every step, but in the training step the flat form costs TPU memory (+5.4 GiB of temps per chip on the
        v5p-8 8B policy step), so only the sampler's cached path asks for it."""
        bf16 = self.contracted and cpu_matmul.active_backend(self.matmul)
        if bf16:  # the kernel is cast to bfloat16 inside
            y = cpu_matmul.contract(x, self.kernel[...], self.contracted, bf16).astype(self.dtype)
        elif not (flat_contraction and self.contracted > 1):
            kernel = self.kernel[...].astype(self.dtype)
            y = jnp.einsum(self.einsum_str, x, kernel)
        else:
            kernel = self.kernel[...].astype(self.dtype)
            y = jnp.einsum(self.flat_einsum, x.reshape(x.shape[:-self.contracted] + (-1,)),
                           kernel.reshape((-1,) + kernel.shape[self.contracted:]))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_a is not None:  # LoRA: + scale * (x @ A) @ B, after the bias as PEFT adds it
            to_rank, from_rank, _ = self._lora_einsums()
            x_R = jnp.einsum(to_rank, x, self.lora_a[...].astype(self.dtype))
            y = y + jnp.einsum(from_rank, x_R, self.lora_b[...].astype(self.dtype)) * jnp.asarray(self.lora_scale,
                                                                                              self.dtype)
        return y


class RMSNorm(nnx.Module):
    def __init__(self, size: int, *, eps: float, param_dtype, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.dtype = dtype
        self.scale = _param(rngs, (size,), ("norm",), param_dtype, "ones")

    def __call__(self, x_BTD):
        # Variance in float32 as in HF, then back to the compute dtype before the scale.
        x32 = x_BTD.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)
class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        kw = dict(bias=c.attention_bias, param_dtype=c.param_dtype, dtype=c.dtype, rngs=rngs, matmul=c.matmul)
        self.q_proj = Dense((D, N, H), ("embed", "heads", "head_dim"), einsum="BTD,DNH->BTNH", **kw)
        self.k_proj = Dense((D, K, H), ("embed", "kv_heads", "head_dim"), einsum="BTD,DKH->BTKH", **kw)
        self.v_proj = Dense((D, K, H), ("embed", "kv_heads", "head_dim"), einsum="BTD,DKH->BTKH", **kw)
        self.o_proj = Dense((N, H, D), ("heads", "head_dim", "embed"), einsum="BTNH,NHD->BTD", **kw)
        self.config = c

    def __call__(self, x_BTD, cos, sin, mask, kv_cache=None, cache_pos=None):
        """mask: without a cache, key_valid [B, T] bool or None (all valid), causal by index, or segment ids
        [B, T] int32 (attention.py's module note);
        with a cache (attention.KVCache, one layer's), the full [B, 1, T, S] bool mask over cache slots.
        Returns (out [B, T, D], the layer's updated cache or None)."""
        q_BTNH = apply_rope(self.q_proj(x_BTD), cos, sin)
        k_BTKH = apply_rope(self.k_proj(x_BTD), cos, sin)
        v_BTKH = self.v_proj(x_BTD)
        if kv_cache is None:
            return self.o_proj(self_attention(q_BTNH, k_BTKH, v_BTKH, mask, self.config)), None
        out_BTNH, kv_cache = cached_attention(q_BTNH, k_BTKH, v_BTKH, kv_cache, cache_pos, mask, self.config)
        return self.o_proj(out_BTNH, flat_contraction=True), kv_cache


@jax.custom_vjp
def swiglu(x_BTD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array, down_FD: jax.Array) -> jax.Array:
    """Llama's MLP, (silu(x @ gate) * (x @ up)) @ down, with a hand-written backward pass.

    Same values and gradients as autodiff; faster on XLA:CPU, where autodiff's backward fuses the SiLU
    derivative into transposing copies of the [tokens, F] activations (14% of a CPU critic step's op time, at
    under 1 GB/s): here every gradient is a plain 2-D matmul over flattened tokens and the elementwise part is
    one fusion (fwd + bwd of the bench MLP, 4 x 512 tokens x 512 x 1536: 296 -> 199 ms). Saves x, x @ gate and
    x @ up, like autodiff; silu(g) * u is recomputed in the backward. MLP uses it for float32 compute only.
    """
    return _swiglu_fwd(x_BTD, gate_DF, up_DF, down_FD)[0]


def _swiglu_fwd(x_BTD, gate_DF, up_DF, down_FD):
    g_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, gate_DF)
    u_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, up_DF)
    y_BTD = jnp.einsum("BTF,FD->BTD", jax.nn.silu(g_BTF) * u_BTF, down_FD)
    return y_BTD, (x_BTD, g_BTF, u_BTF, gate_DF, up_DF, down_FD)


def _swiglu_bwd(residuals, dy_BTD):
    x_BTD, g_BTF, u_BTF, gate_DF, up_DF, down_FD = residuals
    dtype = x_BTD.dtype
    x_ND, dy_ND = x_BTD.reshape(-1, x_BTD.shape[-1]), dy_BTD.astype(dtype).reshape(-1, dy_BTD.shape[-1])
    f32 = jnp.promote_types(dtype, jnp.float32)  # the elementwise part in float32 (float64 under x64)
    g_NF = g_BTF.reshape(-1, g_BTF.shape[-1]).astype(f32)
    u_NF = u_BTF.reshape(g_NF.shape).astype(f32)
    sig_NF = jax.nn.sigmoid(g_NF)
    silu_NF = g_NF * sig_NF
    dh_NF = (dy_ND @ down_FD.T).astype(f32)
    dg_NF = (dh_NF * u_NF * sig_NF * (1.0 + g_NF * (1.0 - sig_NF))).astype(dtype)
    du_NF = (dh_NF * silu_NF).astype(dtype)
    d_down = (silu_NF * u_NF).astype(dtype).T @ dy_ND
    d_gate, d_up = x_ND.T @ dg_NF, x_ND.T @ du_NF
    dx_ND = dg_NF @ gate_DF.T + du_NF @ up_DF.T
    return (dx_ND.reshape(x_BTD.shape).astype(dtype), d_gate.astype(gate_DF.dtype), d_up.astype(up_DF.dtype),
            d_down.astype(down_FD.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        D, F = c.hidden_size, c.intermediate_size
        kw = dict(bias=c.mlp_bias, param_dtype=c.param_dtype, dtype=c.dtype, rngs=rngs, matmul=c.matmul)
        self.gate_proj = Dense((D, F), ("embed", "mlp"), einsum="BTD,DF->BTF", **kw)
        self.up_proj = Dense((D, F), ("embed", "mlp"), einsum="BTD,DF->BTF", **kw)
        self.down_proj = Dense((F, D), ("mlp", "embed"), einsum="BTF,FD->BTD", **kw)

    def __call__(self, x_BTD):
        # The hand-written backward only for 32/64-bit compute (the CPU): with bf16 compute on a TPU, autodiff's
        # backward keeps the elementwise part in bf16 and XLA plans it in less memory (the 8B policy step at
        # 16384 on v5p-8: 61.1 GiB of temps per chip, 79.0 with `swiglu`, which then no longer fits).
        dense = (self.gate_proj, self.up_proj, self.down_proj)
        if (self.gate_proj.bias is None and jnp.finfo(self.gate_proj.dtype).bits >= 32  # Llama: no MLP bias
                and all(d.lora_a is None for d in dense)  # LoRA adapters: the plain formula below
                and not cpu_matmul.active_backend(self.gate_proj.matmul)):  # bf16 matmuls: Dense's own
            return swiglu(x_BTD, *(d.kernel[...].astype(d.dtype) for d in dense))
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        kw = dict(eps=config.rms_norm_eps, param_dtype=config.param_dtype, dtype=config.dtype, rngs=rngs)
        self.input_norm = RMSNorm(config.hidden_size, **kw)
        self.attn = Attention(config, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, **kw)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_BTD, cos, sin, mask, kv_cache=None, cache_pos=None):
        attn_BTD, new_cache = self.attn(self.input_norm(x_BTD), cos, sin, mask, kv_cache, cache_pos)
        x_BTD = x_BTD + attn_BTD
        x_BTD = x_BTD + self.mlp(self.post_attention_norm(x_BTD))
        return x_BTD, new_cache


class Embedder(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                                config.param_dtype, "normal")


class LMHead(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.kernel = _param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                             config.param_dtype, "normal")


def stacked_decoder_layers(config: LlamaConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """num_layers decoder layers as ONE DecoderLayer whose parameters carry a leading [L] axis (logical name
    'layers'), each layer initialised from its own split of the rng streams."""
    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, axis_size=config.num_layers, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return DecoderLayer(config, rngs=rngs)
    return make(rngs)


def _remat_policy(name: str):
    return None if name in ("full", "nothing_saveable") else getattr(jax.checkpoint_policies, name)


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------

class Llama(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        self.embedder = Embedder(c, rngs=rngs)
        if c.scan_layers:
            self.layers = stacked_decoder_layers(c, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=c.param_dtype,
                                  dtype=c.dtype, rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = LMHead(c, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, positions=None) -> jax.Array:
        """Logits [B, T, V] float32."""
        hidden_BTD = self.hidden_states(input_ids, attention_mask, positions)
        dtype = self.config.dtype
        bf16 = cpu_matmul.active_backend(self.config.matmul)
        if bf16:
            unembed_DV = (self.embedder.embedding[...].T if self.config.tie_word_embeddings
                          else self.lm_head.kernel[...])
            return cpu_matmul.contract(hidden_BTD, unembed_DV, 1, bf16)
        if self.config.tie_word_embeddings:  # contract against [V, D] directly: no transpose
            return jnp.einsum("BTD,VD->BTV", hidden_BTD, self.embedder.embedding[...].astype(dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("BTD,DV->BTV", hidden_BTD, self.lm_head.kernel[...].astype(dtype),
                          preferred_element_type=jnp.float32)

    def unembedding(self) -> jax.Array:
        """[D, V] in the compute dtype: the lm_head kernel, or the embedding table transposed when tied."""
        if self.config.tie_word_embeddings:
            return self.embedder.embedding[...].astype(self.config.dtype).T
        return self.lm_head.kernel[...].astype(self.config.dtype)

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache of max_len slots in the compute dtype (or dtype): per layer {'k_BKHS', 'v_BKSH'}
        (attention.HEADS_MAJOR_CACHE)."""
        c = self.config
        return init_kv_cache(c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype or c.dtype)

    def _constrain_residual(self, x_BTD):
        spec = self.config.residual_sharding
        if spec is None or jax.sharding.get_abstract_mesh().empty:
            return x_BTD
        return jax.lax.with_sharding_constraint(x_BTD, jax.sharding.PartitionSpec(*spec))

    def hidden_states(self, input_ids, attention_mask=None, positions=None, *, cache=None, cache_pos=None,
                      segments=None):
        """Final-norm hidden states [B, T, D] (compute dtype); with a cache, (hidden, new_cache).

        Without a cache: attention_mask [B, T] (1 real, 0 pad), causal by index; or segments [B, T] int32 with
        positions: sequences packed behind a shared prefix (attention.py's module note; no attention_mask).
        With a cache: attention_mask [B, S=max_len] marks valid slots (including the T being written now),
        the new K/V land at slots [cache_pos, cache_pos + T) and query i sees valid slots j <= cache_pos + i.
        """
        c = self.config
        input_ids = jnp.asarray(input_ids, jnp.int32)
        B, T = input_ids.shape
        if cache is not None:
            cache_pos = jnp.asarray(0 if cache_pos is None else cache_pos, jnp.int32)
            S = cache_slots(cache)
            slot_valid_BS = (jnp.ones((B, S), bool) if attention_mask is None
                             else jnp.asarray(attention_mask).astype(bool))
            if positions is None:
                positions = jax.lax.dynamic_slice_in_dim(
                    positions_from_mask(slot_valid_BS.astype(jnp.int32)), cache_pos, T, axis=1)
            mask = causal_mask(T, S, slot_valid_BS, query_offset=cache_pos)  # [B, 1, T, S]
        elif segments is not None:
            if positions is None or attention_mask is not None:
                raise ValueError("packed segments need their positions, and no attention_mask")
            mask = jnp.asarray(segments, jnp.int32)  # segment ids [B, T]; the attention reads them as its mask
        elif attention_mask is not None:
            mask = jnp.asarray(attention_mask).astype(bool)  # key_valid [B, T]; causal built in attention
            if positions is None:
                positions = positions_from_mask(attention_mask)
        else:
            mask = None  # plain causal
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

        cos, sin = rope_cos_sin(jnp.asarray(positions), c, c.dtype)
        x_BTD = jnp.take(self.embedder.embedding[...], input_ids, axis=0).astype(c.dtype)
        if cache is None:
            x_BTD = self._constrain_residual(x_BTD)
        x_BTD, new_cache = self._run_layers(x_BTD, cos, sin, mask, cache, cache_pos)
        hidden_BTD = self.final_norm(x_BTD)
        return hidden_BTD if cache is None else (hidden_BTD, new_cache)

    def _run_layers(self, x_BTD, cos, sin, mask, cache, cache_pos):
        """The decoder layers -> (x [B, T, D], the updated cache or None). One pure layer function, under the
        config's remat policy, runs both stacks: scanned over the stacked parameters (scan_layers: XLA compiles
        one layer; a cache is stacked over the layers for the scan and handed back as a list) or called once per
        layer module (unrolled: the sampler's layout, whose decode steps would copy a stacked cache each step)."""
        c = self.config

        def layer_body(x_BTD, layer_state, kv_cache, cos, sin, mask, cache_pos):  # one layer; state: its params
            x_BTD, kv_cache = nnx.merge(graphdef, layer_state)(x_BTD, cos, sin, mask, kv_cache, cache_pos)
            return (x_BTD if kv_cache is not None else self._constrain_residual(x_BTD)), kv_cache

        if c.remat != "none":
            layer_body = jax.checkpoint(layer_body, policy=_remat_policy(c.remat))
        if c.scan_layers:
            graphdef, layers_state = nnx.split(self.layers)
            stacked = None if cache is None else jax.tree.map(lambda *xs: jnp.stack(xs), *cache)
            x_BTD, stacked = jax.lax.scan(lambda x_BTD, xs: layer_body(x_BTD, *xs, cos, sin, mask, cache_pos),
                                          x_BTD, (layers_state, stacked))
            return x_BTD, None if cache is None else [jax.tree.map(lambda x: x[i], stacked)
                                                      for i in range(c.num_layers)]
        graphdef = nnx.graphdef(self.layers[0])  # every layer has the same structure
        new_cache = []
        for i, layer in enumerate(self.layers):
            x_BTD, layer_cache = layer_body(x_BTD, nnx.state(layer), None if cache is None else cache[i],
                                            cos, sin, mask, cache_pos)
            new_cache.append(layer_cache)
        return x_BTD, None if cache is None else new_cache
