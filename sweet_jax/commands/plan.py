r"""Will this training step fit on that TPU slice? Compile it ahead of time and read the per-chip memory.

    python -m sweet_jax.plan --config configs/critic.py:llama3_8b --topology v5e-16
    python -m sweet_jax.plan --config configs/critic.py:llama3_8b --topology local   # this host's GPU(s)
    python -m sweet_jax.plan --config configs/critic.py:llama3_8b --topology v5e-16 --fit --estimate
    python -m sweet_jax.plan --config configs/policy.py:llama3_8b --config.data.max_len=16384 --topology v5p-8
    python -m sweet_jax.plan --config configs/policy.py:llama3_8b --config.model.preset=llama3_70b \
        --config.data.max_len=16384 --topology v5p-64 --config.mesh.shape='(1,8,4)' \
        --config.train.micro_batch_size=8 --config.model.scan_layers=True --config.model.sequence_parallel=True

Layout switches read from config.model (see configs/policy.py): scan_layers (stacked layers under jax.lax.scan:
one layer compiled, so 8B/70B compile in minutes; XLA then keeps more float32 copies of the stacked gradients),
sequence_parallel (the residual stream between layers split over 'tensor' along tokens), attention_chunk_size.

No TPU needed: `jax.experimental.topologies` describes the slice and libtpu compiles for it on this host.
`--topology local` compiles for the devices attached to this host instead (e.g. one GPU under jax[cuda]) and
compares with the memory XLA may use on each (its `bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION of the card).
The story: config -> model shapes -> topology -> mesh -> sharded abstract state and batch -> lower ->
compile -> memory / FLOPs report. Exit status 1 when the step does not fit the chip's HBM, 2 on bad input.
--fit compiles the layouts of `fit_layouts` cheapest first (FIT_COSTS) and prints the first that fits, with the
train and plan commands that use it (exit 1 when none of the first --fit_max_tries does).
"""
from __future__ import annotations

import math
import sys

from absl import flags
from ml_collections import config_flags

from sweet_jax import cli
from sweet_jax.commands import launch


def main(argv):
    del argv
    # Compiling runs in a worker thread: XLA holds the main thread for minutes, and Ctrl-C must stop it at once.
    return cli.interruptible(lambda: compile_plan(flags.FLAGS))


def compile_plan(FLAGS) -> int:
    from sweet_jax.config_utils import check_config  # after the flags (--help answers in a second)
    from sweet_jax.train.plan import (extrapolated_plan, make_plan, no_compilation_cache, parse_topology,  # (same)
                                      report)
    no_compilation_cache()
    check_flags(FLAGS)
    check_config(FLAGS.config)
    topology = parse_topology(FLAGS.topology)
    if FLAGS.fit:
        return main_fit(FLAGS, topology)
    plan = extrapolated_plan(FLAGS.config, topology) if FLAGS.estimate else make_plan(FLAGS.config, topology)
    print(report(plan))
    return 0 if plan.fits else 1


def check_flags(FLAGS) -> None:
    """plan's own numeric flags, before anything is compiled (the config's are check_config's)."""
    from sweet_jax.train.plan import PlanError  # after the flags (as in compile_plan)
    if FLAGS.fit_max_tries < 1:
        raise PlanError(f"--fit_max_tries={FLAGS.fit_max_tries}: compile at least 1 layout (default 24)")
    if not math.isfinite(FLAGS.hbm_gib) or FLAGS.hbm_gib < 0:
        raise PlanError(f"--hbm_gib={FLAGS.hbm_gib}: expected a chip's memory in GiB, a finite number > 0 "
                        "(0 = the chip's HBM)")


def main_fit(FLAGS, topology) -> int:
    """--fit: the cheapest layout that fits, its report and the exact commands; exit 1 when none does."""
    from sweet_jax.train.plan import GiB, fit, fit_commands, report  # after the flags (as in compile_plan)
    argv = sys.argv[1:]
    budget = max(1, int(FLAGS.hbm_gib * GiB)) if FLAGS.hbm_gib else None
    layout, result, tried = fit(FLAGS.config, topology, estimate=FLAGS.estimate, max_tries=FLAGS.fit_max_tries,
                                budget_bytes=budget, log=lambda line: print(line, flush=True))
    if layout is None:
        print(f"no layout of the first {len(tried)} fits {topology.slice_name}"
              f"{'' if budget is None else f' within {FLAGS.hbm_gib} GiB a chip'}; the closest: "
              f"{min(tried, key=lambda t: t[1].total_bytes)[0].describe()}. Try a larger slice, a shorter "
              "--config.data.max_len, LoRA (--config.lora.rank=16), or --fit_max_tries")
        return 1
    print(report(result))
    train, check = fit_commands(argv, layout, FLAGS.topology)
    print(f"\nthe cheapest layout that fits: {layout.describe()}\n  train: {train}\n  check: {check}")
    return 0


def define_flags():
    config_flags.DEFINE_config_file("config", None, "a training config with preset: configs/critic.py:llama3_8b",
                                    lock_config=True)
    flags.DEFINE_string("topology", None, "TPU slice: v5e-16, v4-8, v5p-8, v6e-8, or a grid like v5e:4x4; or "
                        "'local': the devices attached to this host (e.g. a GPU)")
    flags.DEFINE_bool("estimate", False, "compile 2- and 4-layer versions and extrapolate linearly to the real "
                      "depth (fast; the default compiles the full model)")
    flags.DEFINE_bool("fit", False, "search the memory options (scan_layers, bf16 moments, remat, micro-batches, "
                      "sequence parallelism over a tensor axis, offloaded optimiser state) cheapest first and print "
                      "the cheapest layout that fits, with the exact command")
    flags.DEFINE_integer("fit_max_tries", 24, "--fit: compile at most this many layouts")
    flags.DEFINE_float("hbm_gib", 0.0, "--fit: the memory a chip may use, in GiB (default: the chip's HBM; less "
                       "leaves headroom)")
    flags.mark_flags_as_required(["config", "topology"])


HELP_CONFIGS = ("configs/critic.py:llama3_8b", "configs/policy.py:llama3_8b")

if __name__ == "__main__":
    launch("plan")
