"""CLIP's vision tower and image projection (ViT-B/32 by default) in Flax NNX, loaded from a Hugging Face CLIP
checkpoint (config.json + safetensors) through one declarative name table.

ColBench's frontend reward is the cosine between the CLIP image features of two screenshots, so only the image
side is built: patch embedding -> [CLS] + patches + positions -> pre-norm -> pre-LN transformer blocks ->
post-norm of the [CLS] token -> linear projection (no bias). Images are [batch, height, width, channels].
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open


class CLIPCheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a CLIP vision model."""


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    image_size: int = 224
    patch_size: int = 32
    num_channels: int = 3
    projection_dim: int = 512
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def vit_b32(cls) -> "CLIPVisionConfig":
        """openai/clip-vit-base-patch32, the reward model of ColBench's frontend track."""
        return cls()

    @classmethod
    def tiny(cls) -> "CLIPVisionConfig":
        """A few thousand parameters at the real 224x224 input: for tests and the CPU demo."""
        return cls(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, projection_dim=16)

    @classmethod
    def from_hf(cls, hf: dict) -> "CLIPVisionConfig":
        """From a CLIPModel config.json dict (the vision part lives under 'vision_config'; absent keys take
        transformers' defaults, which are ViT-B/32's)."""
        vision = hf.get("vision_config") or {}
        default = cls()
        return cls(
            hidden_size=vision.get("hidden_size", default.hidden_size),
            intermediate_size=vision.get("intermediate_size", default.intermediate_size),
            num_layers=vision.get("num_hidden_layers", default.num_layers),
            num_heads=vision.get("num_attention_heads", default.num_heads),
            image_size=vision.get("image_size", default.image_size),
            patch_size=vision.get("patch_size", default.patch_size),
            num_channels=vision.get("num_channels", default.num_channels),
            projection_dim=hf.get("projection_dim", default.projection_dim),
            layer_norm_eps=vision.get("layer_norm_eps", default.layer_norm_eps),
            hidden_act=vision.get("hidden_act", default.hidden_act),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


ACTIVATIONS: dict[str, Callable] = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),   # what OpenAI's CLIP was trained with
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


class Attention(nnx.Module):
    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj = nnx.Linear(d, d, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, rngs=rngs)
        self.out_proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        b, s, d = x_BSD.shape
        heads = lambda y: y.reshape(b, s, self.num_heads, d // self.num_heads)  # noqa: E731
        q, k, v = heads(self.q_proj(x_BSD)), heads(self.k_proj(x_BSD)), heads(self.v_proj(x_BSD))
        out_BSNH = jax.nn.dot_product_attention(q, k, v)  # no mask: every patch sees every patch
        return self.out_proj(out_BSNH.reshape(b, s, d))


class Block(nnx.Module):
    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.layer_norm2 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.fc1 = nnx.Linear(d, config.intermediate_size, rngs=rngs)
        self.fc2 = nnx.Linear(config.intermediate_size, d, rngs=rngs)
        self.act = ACTIVATIONS[config.hidden_act]

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attn(self.layer_norm1(x_BSD))
        return x_BSD + self.fc2(self.act(self.fc1(self.layer_norm2(x_BSD))))


class CLIPVision(nnx.Module):
    """pixels [B, image_size, image_size, C] (normalised as CLIPProcessor does) -> image features [B, projection_dim]."""

    def __init__(self, config: CLIPVisionConfig, *, rngs: nnx.Rngs):
        if config.hidden_act not in ACTIVATIONS:
            raise CLIPCheckpointError(f"hidden_act {config.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        self.config = config
        d, p = config.hidden_size, config.patch_size
        self.patch_embedding = nnx.Conv(config.num_channels, d, kernel_size=(p, p), strides=(p, p),
                                        padding="VALID", use_bias=False, rngs=rngs)
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (d,)) * 0.02)
        self.position_embedding = nnx.Param(jax.random.normal(rngs.params(), (config.num_patches + 1, d)) * 0.02)
        self.pre_layernorm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.post_layernorm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, rngs=rngs)
        self.visual_projection = nnx.Linear(d, config.projection_dim, use_bias=False, rngs=rngs)

    def __call__(self, pixels_BHWC: jax.Array) -> jax.Array:
        patches = self.patch_embedding(pixels_BHWC)            # [B, H/p, W/p, D]
        b, d = patches.shape[0], patches.shape[-1]
        cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, d))
        x_BSD = jnp.concatenate([cls, patches.reshape(b, -1, d)], axis=1) + self.position_embedding[...]
        x_BSD = self.pre_layernorm(x_BSD)
        for layer in self.layers:
            x_BSD = layer(x_BSD)
        return self.visual_projection(self.post_layernorm(x_BSD[:, 0]))


# ----------------------------------------------------------------------------------------------------------
# The name table: HF tensor name <-> module path ({i} = layer index), and how the array changes.
# ----------------------------------------------------------------------------------------------------------

SAME = ("same", lambda x: x)
LINEAR = ("linear", lambda x: x.T)                        # HF [out, in] -> ours [in, out]
CONV = ("conv", lambda x: x.transpose(2, 3, 1, 0))        # HF [out, in, kh, kw] -> ours [kh, kw, in, out]

_V = "vision_model."
_L = _V + "encoder.layers.{i}."
NAME_TABLE: tuple[tuple[str, str, tuple], ...] = (
    # HF name                                      module path                        transform
    (_V + "embeddings.patch_embedding.weight",     "patch_embedding.kernel",          CONV),
    (_V + "embeddings.class_embedding",            "class_embedding",                 SAME),
    (_V + "embeddings.position_embedding.weight",  "position_embedding",              SAME),
    (_V + "pre_layrnorm.weight",                   "pre_layernorm.scale",             SAME),  # sic: HF's name
    (_V + "pre_layrnorm.bias",                     "pre_layernorm.bias",              SAME),
    (_L + "layer_norm1.weight",                    "layers.{i}.layer_norm1.scale",    SAME),
    (_L + "layer_norm1.bias",                      "layers.{i}.layer_norm1.bias",     SAME),
    (_L + "self_attn.q_proj.weight",               "layers.{i}.attn.q_proj.kernel",   LINEAR),
    (_L + "self_attn.q_proj.bias",                 "layers.{i}.attn.q_proj.bias",     SAME),
    (_L + "self_attn.k_proj.weight",               "layers.{i}.attn.k_proj.kernel",   LINEAR),
    (_L + "self_attn.k_proj.bias",                 "layers.{i}.attn.k_proj.bias",     SAME),
    (_L + "self_attn.v_proj.weight",               "layers.{i}.attn.v_proj.kernel",   LINEAR),
    (_L + "self_attn.v_proj.bias",                 "layers.{i}.attn.v_proj.bias",     SAME),
    (_L + "self_attn.out_proj.weight",             "layers.{i}.attn.out_proj.kernel", LINEAR),
    (_L + "self_attn.out_proj.bias",               "layers.{i}.attn.out_proj.bias",   SAME),
    (_L + "layer_norm2.weight",                    "layers.{i}.layer_norm2.scale",    SAME),
    (_L + "layer_norm2.bias",                      "layers.{i}.layer_norm2.bias",     SAME),
    (_L + "mlp.fc1.weight",                        "layers.{i}.fc1.kernel",           LINEAR),
    (_L + "mlp.fc1.bias",                          "layers.{i}.fc1.bias",             SAME),
    (_L + "mlp.fc2.weight",                        "layers.{i}.fc2.kernel",           LINEAR),
    (_L + "mlp.fc2.bias",                          "layers.{i}.fc2.bias",             SAME),
    (_V + "post_layernorm.weight",                 "post_layernorm.scale",            SAME),
    (_V + "post_layernorm.bias",                   "post_layernorm.bias",             SAME),
    ("visual_projection.weight",                   "visual_projection.kernel",        LINEAR),
)
_PATH_RULES = [(re.compile("^" + re.escape(path).replace(r"\{i\}", r"(\d+)") + "$"), hf, transform)
               for hf, path, transform in NAME_TABLE]


def hf_name_for(module_path: str) -> tuple[str, tuple]:
    """'layers.3.attn.q_proj.kernel' -> ('vision_model.encoder.layers.3.self_attn.q_proj.weight', LINEAR)."""
    for pattern, hf, transform in _PATH_RULES:
        if match := pattern.match(module_path):
            return (hf.replace("{i}", match.group(1)) if match.groups() else hf), transform
    raise KeyError(f"no row of NAME_TABLE maps module path {module_path!r}")


def load_clip_hf(path, *, dtype="float32") -> CLIPVision:
    """The vision tower and projection of the HF CLIP checkpoint at `path` (a CLIPModel directory:
    config.json + model.safetensors or sharded safetensors with their index). Text-tower tensors are ignored."""
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CLIPCheckpointError(f"{path}: no config.json; expected a Hugging Face CLIP checkpoint directory")
    hf = json.loads(config_file.read_text())
    if hf.get("model_type") != "clip":
        raise CLIPCheckpointError(f"{config_file}: model_type is {hf.get('model_type')!r}, expected 'clip'")
    config = CLIPVisionConfig.from_hf(hf)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CLIPCheckpointError(f"{path}: no *.safetensors file (a pytorch_model.bin checkpoint must be "
                                  "re-saved with safe_serialization=True)")
    where = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            where.update({name: file for name in f.keys()})

    model = nnx.eval_shape(lambda: CLIPVision(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    for key_path, var in nnx.to_flat_state(state):
        module_path = ".".join(str(getattr(k, "key", k)) for k in key_path)
        hf_name, (_, to_ours) = hf_name_for(module_path)
        if hf_name not in where:
            raise CLIPCheckpointError(f"{path}: tensor {hf_name!r} (for {module_path}) is in no safetensors file")
        with safe_open(where[hf_name], framework="numpy") as f:
            value = to_ours(f.get_tensor(hf_name))
        if value.shape != tuple(var.shape):
            raise CLIPCheckpointError(f"{where[hf_name]}: tensor {hf_name!r} has shape {list(value.shape)} after "
                                      f"conversion, config.json implies {list(var.shape)}")
        var.set_value(jnp.asarray(np.ascontiguousarray(value), dtype=dtype))
    return nnx.merge(graphdef, state)
