"""LoRA (Hu et al., 2021) for the Llama model: low-rank adapters on the projections, the base frozen.

A targeted projection y = x @ W computes y = x @ W + (alpha / rank) * (x @ A) @ B with
  A [in..., rank]  ('embed' or ('heads', 'head_dim') or 'mlp', 'lora_rank'), init uniform(+-1/sqrt(fan_in))
  B [rank, out...] ('lora_rank', the kernel's output axes), init zeros,
as PEFT's LoraLayer (same init, same alpha / rank scaling) and flax.nnx.LoRA (the adapters are nnx.LoRAParam
variables, so `nnx.split(model, nnx.LoRAParam, ...)` separates what is trained from the frozen base). With
scan_layers the adapters are stacked [L, ...] like the kernels. B = 0 at the start, so the model with fresh
adapters IS the base model: its log-probs are the reference's, with no second copy of the weights
(`adapters_off` zeroes a trained adapter state for the same purpose).

Targets by short name: q k v o (attention projections), gate up down (MLP). Export: `merge` folds the adapters
into the kernels (W + alpha/rank * A @ B, then a plain Llama for save_hf); `save_peft` writes them in PEFT's
format (adapter_config.json + adapter_model.safetensors, PEFT's tensor names) for `PeftModel.from_pretrained`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from sweet_jax.errors import SweetJaxError
from sweet_jax.models.hf import hf_name_for
from sweet_jax.models.llama import Dense, Llama

TARGETS = {"q": ("attn", "q_proj"), "k": ("attn", "k_proj"), "v": ("attn", "v_proj"), "o": ("attn", "o_proj"),
           "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj")}
ALL_TARGETS = tuple(TARGETS)


class LoRAConfigError(SweetJaxError):
    """LoRA settings that cannot work (rank < 0, alpha <= 0, an unknown target module)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0                          # 0: LoRA off (full fine-tuning)
    alpha: float = 16.0                    # the update is scaled by alpha / rank (PEFT's lora_alpha)
    targets: tuple[str, ...] = ALL_TARGETS  # short names of TARGETS

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise LoRAConfigError(f"lora.rank={self.rank}: expected 0 (off) or a positive rank")
        if self.rank and self.alpha <= 0:
            raise LoRAConfigError(f"lora.alpha={self.alpha}: expected > 0")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or (self.rank and not self.targets):
            raise LoRAConfigError(f"lora.targets={','.join(self.targets)!r}: expected a non-empty subset of "
                                  f"{','.join(ALL_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section) -> "LoRAConfig":
        """From a training config's `lora` section (rank, alpha, targets as 'q,k,v' or a sequence); None: off."""
        if section is None:
            return cls()
        targets = section.get("targets", ALL_TARGETS)
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        return cls(rank=int(section.get("rank", 0)), alpha=float(section.get("alpha", 16.0)), targets=tuple(targets))


def _target_denses(model: Llama, targets: Sequence[str]) -> list[tuple[str, Dense]]:
    """(module path without the leaf, Dense) of every targeted projection, layers in order."""
    layers = [("layers", model.layers)] if model.config.scan_layers else \
        [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    return [(f"{prefix}.{block}.{name}", getattr(getattr(layer, block), name))
            for prefix, layer in layers for block, name in (TARGETS[t] for t in targets)]


def add_adapters(model: Llama, lora: LoRAConfig, *, seed: int = 0) -> Llama:
    """Attach fresh adapters (A random from `seed`, B zero) to the targeted projections of `model`, in place;
    returns it."""
    if not lora.enabled:
        return model
    denses = _target_denses(model, lora.targets)
    for (_, dense), key in zip(denses, jax.random.split(jax.random.key(seed), len(denses))):
        dense.add_lora(lora.rank, lora.scale, key, stacked=model.config.scan_layers)
    return model


def adapters_off(adapters: nnx.State) -> nnx.State:
    """The adapter state with every A and B zeroed: the model computes exactly the base model's outputs
    (x @ W + scale * (x @ 0) @ 0). For reference log-probs from a model whose adapters were trained."""
    return jax.tree.map(jnp.zeros_like, adapters)


def merge(model: Llama) -> Llama:
    """A plain Llama (no adapters) whose kernels are W + alpha/rank * A @ B, computed in float32 and stored in the
    parameter dtype: the same function as the adapted model up to rounding (what save_hf exports)."""
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # a copy: `model` keeps its adapters
    for _, dense in _target_denses(merged, ALL_TARGETS):
        if dense.lora_a is not None:
            dense.merge_lora()
    return merged


def has_adapters(model: Llama) -> bool:
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


# ----------------------------------------------------------------------------------------------------------
# PEFT format
# ----------------------------------------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."


def peft_tensors(model: Llama) -> dict[str, np.ndarray]:
    """PEFT's adapter_model.safetensors entries: for a projection with HF weight `<m>.weight` [out, in],
    `base_model.model.<m>.lora_A.weight` [rank, in] and `base_model.model.<m>.lora_B.weight` [out, rank]."""
    tensors = {}
    for path, dense in _target_denses(model, ALL_TARGETS):
        if dense.lora_a is None:
            continue
        a, b = np.asarray(jax.device_get(dense.lora_a[...])), np.asarray(jax.device_get(dense.lora_b[...]))
        per_layer = ([(path.replace("layers", f"layers.{i}", 1), a[i], b[i]) for i in range(a.shape[0])]
                     if model.config.scan_layers else [(path, a, b)])
        for layer_path, a_in_r, b_r_out in per_layer:
            hf_weight, _ = hf_name_for(f"{layer_path}.kernel")
            module = PEFT_PREFIX + hf_weight[:-len(".weight")]
            rank = a_in_r.shape[-1]
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a_in_r.reshape(-1, rank).T)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b_r_out.reshape(rank, -1).T)
    return tensors


def save_peft(model: Llama, lora: LoRAConfig, path, *, base_model: str = "", dtype=None) -> pathlib.Path:
    """Write the adapters as a PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(<the base model>, path)` loads."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(model)
    if not tensors:
        raise LoRAConfigError("save_peft: the model has no LoRA adapters (lora.rank is 0)")
    out_dtype = np.dtype(dtype or model.config.param_dtype)
    save_file({k: v.astype(out_dtype) for k, v in tensors.items()}, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(TARGETS[t][1] for t in lora.targets), "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
