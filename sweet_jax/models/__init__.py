"""Flax NNX Llama family and its Hugging Face import/export."""
from sweet_jax.models.llama import Llama, LlamaConfig, positions_from_mask
from sweet_jax.models.hf import load_hf, save_hf, HFCheckpointError

__all__ = ["Llama", "LlamaConfig", "positions_from_mask", "load_hf", "save_hf", "HFCheckpointError", "load_gguf",
           "load_gguf_tokenizer"]


def __getattr__(name):  # gguf.py on first use, so `python -m sweet_jax.models.gguf` finds it not yet imported
    if name in ("load_gguf", "load_gguf_tokenizer"):
        from sweet_jax.models import gguf
        return getattr(gguf, name)
    raise AttributeError(f"module 'sweet_jax.models' has no attribute {name!r}")
