"""Flax NNX Llama family and its Hugging Face import/export."""
from sweet_jax.models.llama import Llama, LlamaConfig, positions_from_mask
from sweet_jax.models.hf import load_hf, save_hf, HFCheckpointError
from sweet_jax.models.gguf import load_gguf, load_gguf_tokenizer

__all__ = ["Llama", "LlamaConfig", "positions_from_mask", "load_hf", "save_hf", "HFCheckpointError", "load_gguf",
           "load_gguf_tokenizer"]
