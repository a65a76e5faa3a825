"""The command-line programs: each module here is one entry point (`python -m sweet_jax.NAME`, `sweet-jax NAME`)
and holds its `main`, its flags and nothing else; the work is done by the library packages below.

    train                 train the critic or the policy (sweet_jax.train.trainer)
    export                a training run's checkpoint as an HF directory (sweet_jax.train.export)
    plan                  compile a training step for a TPU slice ahead of time (sweet_jax.train.plan)
    rollout               play ColBench episodes with a policy (sweet_jax.rl.episodes)
    rank                  score candidate replies with the critic into DPO pairs (sweet_jax.rl.ranking)
    serve                 an OpenAI-compatible server over the sampler (sweet_jax.sampling.server)
    evaluate              score saved answers with the sandbox (sweet_jax.sandbox)
    pipeline              the whole SWEET-RL comparison (sweet_jax.pipeline.stages)
    pipeline_report       a pipeline run's results table (sweet_jax.rl.results)
    pipeline_diagnostics  a pipeline run's diagnostics and probes (sweet_jax.rl.diagnostics, sweet_jax.rl.probes)
    gguf                  a GGUF file as an HF directory (sweet_jax.models.gguf)
    synthetic             write synthetic tasks and scripted demonstrations (sweet_jax.envs.synthetic)

Every command module defines `main(argv)`, `define_flags` (absl flags with a config, or None when main parses
argv with cli.ArgumentParser) and `HELP_CONFIGS` (the configs whose presets --help lists), and ends in
`launch(NAME)`. launch prepares the process before the command module is imported. A command module imports
only the flags' layer at its top (absl, ml_collections, cli, config_utils); its main checks what it was given and
then imports the library (and with it jax, Flax, transformers): --help, a misspelt flag and a missing file answer
in about a second (bench/bench_help.py).
"""
from __future__ import annotations

import importlib
import os
import sys

from sweet_jax import cli, host_malloc

# Commands that compute: re-executed with the host allocator first (huge pages or tcmalloc: XLA's step buffers).
COMPUTE = ("train", "export", "rollout", "rank", "serve", "pipeline")


def plan_environment(argv) -> None:
    """plan compiles only: jax's own backend stays on the host CPU even where a TPU is attached, unless the plan
    is for this host's own devices (--topology local)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # A program compiled for a TPU topology from a CPU host cannot be stored in or loaded from JAX's persistent
    # compilation cache (no TPU client to deserialise it): every other command line turns the cache on.
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    if not any(a.lower() in ("--topology=local", "local") for a in argv):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def launch(name: str) -> None:
    """Run the command NAME: the environment, the allocator's re-execution, then the command module's import (the
    one place where a command is imported by name) and cli.run of its main."""
    if name == "plan":
        plan_environment(sys.argv[1:])
    cli.quiet_environment()
    cli.compile_cache_environment()
    if name in COMPUTE and not any(a in ("-h", "--help", "-help", "--helpshort") for a in sys.argv[1:]):
        host_malloc.reexec_with_allocator()  # before jax starts (--help computes nothing: no second start)
    command = importlib.import_module(f"{__name__}.{name}")
    cli.run(command.main, define_flags=command.define_flags, allocator=False, help_configs=command.HELP_CONFIGS,
            module_name=command.__name__)
