"""sweet_jax: SWEET-RL and ColBench in JAX/Flax.

The packages, bottom to top (an arrow only points down; tests/test_layers.py asserts it):
    errors, jsonl, host_malloc, http_bounds, cli, sharding, costs   the bottom layer (this directory)
    sandbox          the code-execution sandbox that scores answers
    models           the Llama family (Flax NNX), its HF / GGUF import and export, LoRA, CLIP
    data             ColBench records, tokenizers, chat rendering, training pairs, batching
    envs             the environments, human simulators and task generators
    config_utils     the training config schema (this directory: configs/*.py import it)
    train            the training loop, steps, losses, optimiser, checkpoints, metrics, run directories
    sampling         the sampler interface, the in-process sampler, the engine backends, the server
    rl               episodes, ranking into pairs, diagnostics, probes, results
    pipeline         the whole comparison as a graph of stages
    commands         the command-line programs (`python -m sweet_jax.NAME`, `sweet-jax NAME`)
"""
import os
import sys

from sweet_jax import host_malloc, old_names

__version__ = "0.1.0"


def _cpu_only_host() -> None:
    """On a Linux host without a TPU or GPU device node, JAX_PLATFORMS=cpu before jax is imported (unless the user
    set it): with libtpu installed (the planner's extra) jax would otherwise probe for TPU chips at its first use
    and print libtpu's INVALID_ARGUMENT lines. The command lines do the same (cli.quiet_environment); this covers
    `import sweet_jax` in a notebook or a script. Without a device node the CPU is all jax can use anyway."""
    if sys.platform.startswith("linux") and "JAX_PLATFORMS" not in os.environ and "jax" not in sys.modules:
        if not host_malloc.accelerator_present():
            os.environ["JAX_PLATFORMS"] = "cpu"


_cpu_only_host()
if old_names.FINDER not in sys.meta_path:  # `python -m sweet_jax.rank` and the other old command names
    sys.meta_path.insert(0, old_names.FINDER)
