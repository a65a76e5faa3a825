"""Flax NNX Llama family and its Hugging Face import/export."""
from sweet_jax.models.hf import HFCheckpointError, load_hf, save_hf
from sweet_jax.models.llama import Llama, LlamaConfig, positions_from_mask

__all__ = ["Llama", "LlamaConfig", "positions_from_mask", "load_hf", "save_hf", "HFCheckpointError", "load_gguf",
           "load_gguf_tokenizer"]


def __getattr__(name):
    if name in ("load_gguf", "load_gguf_tokenizer"):
        from sweet_jax.models import gguf  # on first use: `python -m sweet_jax.models.gguf` must find it not yet imported
        return getattr(gguf, name)
    raise AttributeError(f"module 'sweet_jax.models' has no attribute {name!r}")
