"""sweet_jax: SWEET-RL and ColBench in JAX/Flax."""

__version__ = "0.1.0"


def _cpu_only_host() -> None:
    """On a Linux host without a TPU or GPU device node, JAX_PLATFORMS=cpu before jax is imported (unless the user
    set it): with libtpu installed (the planner's extra) jax would otherwise probe for TPU chips at its first use
    and print libtpu's INVALID_ARGUMENT lines. The command lines do the same (cli.quiet_environment); this covers
    `import sweet_jax` in a notebook or a script. Without a device node the CPU is all jax can use anyway."""
    import os
    import sys

    if sys.platform.startswith("linux") and "JAX_PLATFORMS" not in os.environ and "jax" not in sys.modules:
        from sweet_jax import host_malloc
        if not host_malloc.accelerator_present():
            os.environ["JAX_PLATFORMS"] = "cpu"


_cpu_only_host()
