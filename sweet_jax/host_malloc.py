"""The host allocator for the command lines: XLA's per-step host buffers without a page fault per 4 KiB page.

XLA:CPU allocates the temporaries of every execution as one block (1.5 GiB for the critic step of the 58M bench
model, 3.4 GiB for SmolLM2's with bf16 matmuls) with posix_memalign and frees it when the step ends. glibc
serves a block that large with mmap and gives it back with munmap, so every step first-touches fresh 4 KiB
pages: ~400,000 page faults and 0.8-4 s of kernel time a step on a 2-core machine, a third of the bench step and
most of its run-to-run spread (BENCHMARKS.md). The allocator is chosen when the process starts, so the command
lines re-execute themselves once with the environment set, before jax is imported. SWEET_JAX_MALLOC picks it:

  (unset)    on a host that computes on its CPU: hugepages where glibc and the kernel allow it, else tcmalloc
             where installed, else the system allocator; the system allocator where a TPU or a GPU is present
             or JAX_PLATFORMS names no cpu (there the step's temporaries live in device memory).
  hugepages  GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc asks for transparent huge pages on its mmap'd blocks
             (glibc >= 2.35, THP `always` or `madvise`): ~500x fewer faults, and each block still goes back to
             the kernel when freed, so the process holds what the system allocator holds (SmolLM2's critic
             stage with bf16 matmuls: 5.94 GiB peak against 9.05 under tcmalloc; steps 1.07x faster than the
             system allocator's, tcmalloc's 1.17x; BENCHMARKS.md "Host allocator").
  tcmalloc   LD_PRELOAD of libtcmalloc_minimal (Debian/Ubuntu: libtcmalloc-minimal4): freed blocks are kept and
             reused, no page faults after the first step: the fastest steps, but the kept blocks fragment (the
             step's outputs land in a freed block, the next block needs fresh memory): ~1.5x the peak memory
             of the other modes.
  system     leave the allocator alone.

Where the mode cannot apply (tcmalloc not installed, no THP, glibc too old) the process goes on with the system
allocator and says so once (the automatic choice falls back quietly).
"""
from __future__ import annotations

import ctypes.util
import logging
import os
import pathlib
import sys

MODE_VAR = "SWEET_JAX_MALLOC"
DONE_VAR = "SWEET_JAX_MALLOC_APPLIED"  # set in the re-executed process: never re-execute twice
MODES = ("tcmalloc", "hugepages", "system")
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
# TPU v4+, TPU v5e/v6e, NVIDIA GPU, AMD GPU (ROCm)
ACCELERATOR_DEVICES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_present(dev: str = "/") -> bool:
    """Whether a TPU or GPU device node exists (`dev`: the root to look under, for tests)."""
    root = pathlib.Path(dev)
    return any(any(root.glob(pattern.lstrip("/"))) for pattern in ACCELERATOR_DEVICES)


def computes_on_cpu(environ: dict[str, str], dev: str = "/") -> bool:
    """Whether jax will run this process's steps on the CPU: JAX_PLATFORMS says so, or no TPU/GPU device node
    exists (`dev`: the root to look under, for tests)."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_present(dev)


def glibc_version() -> tuple[int, int] | None:
    try:
        _, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, OSError, ValueError):  # not glibc (musl, macOS) or no confstr
        return None


def thp_mode(path: pathlib.Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), None where there is no THP."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def allocator_env(mode: str, environ: dict[str, str], *, glibc: tuple[int, int] | None,
                  thp: str | None, tcmalloc: str | None) -> tuple[dict[str, str], str | None]:
    """(the environment variables to set for `mode`, what prevents it or None): ({}, None) when nothing needs
    to change (`system`, or the mode is already on), ({}, why) when the mode cannot apply on this machine."""
    if mode not in MODES:
        raise ValueError(f"{MODE_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "system":
        return {}, None
    if mode == "hugepages":
        tunables = environ.get("GLIBC_TUNABLES", "")
        if HUGETLB_TUNABLE in tunables.split(":"):
            return {}, None
        if glibc is None or glibc < (2, 35):
            return {}, f"huge pages need glibc >= 2.35 (this is {glibc or 'not glibc'}): system allocator"
        if thp not in ("always", "madvise"):
            return {}, f"transparent huge pages are {thp or 'absent'} on this kernel: system allocator"
        return {"GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGETLB_TUNABLE]))}, None
    preload = environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return {}, None
    if tcmalloc is None:
        return {}, "tcmalloc not found (apt-get install libtcmalloc-minimal4): system allocator"
    return {"LD_PRELOAD": " ".join(filter(None, [tcmalloc, preload]))}, None


def allocator_env_here(mode: str, environ: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """allocator_env with this machine's glibc, THP mode and tcmalloc library."""
    return allocator_env(mode, environ, glibc=glibc_version(), thp=thp_mode(),
                         tcmalloc=ctypes.util.find_library("tcmalloc_minimal"))


def default_mode(environ: dict[str, str], dev: str = "/") -> tuple[str, dict[str, str], str | None]:
    """(mode, its environment changes, why not) of the automatic choice: on a CPU host the first of hugepages
    and tcmalloc that applies here, else system; on an accelerator host system."""
    if not computes_on_cpu(environ, dev):
        return "system", {}, None
    for mode in ("hugepages", "tcmalloc"):
        changes, problem = allocator_env_here(mode, environ)
        if problem is None:
            return mode, changes, None
    return "system", {}, problem


def active() -> str:
    """The allocator this process started with, for the logs."""
    mode = os.environ.get(DONE_VAR)
    if mode:
        return f"{mode} ({MODE_VAR}=system to turn off)"
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return "tcmalloc (LD_PRELOAD)"
    if HUGETLB_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        return "hugepages (GLIBC_TUNABLES)"
    return "system"


def reexec_with_allocator() -> None:
    """Re-execute this command line once with the allocator of SWEET_JAX_MALLOC (see above) set up.

    Call first thing under `if __name__ == "__main__":` of a command line, before jax is imported; never from
    library code (it replaces the process)."""
    if os.environ.get(DONE_VAR) or not sys.platform.startswith("linux"):  # LD_PRELOAD and glibc: Linux only
        return
    asked, environ = os.environ.get(MODE_VAR), dict(os.environ)
    try:
        mode, changes, problem = (asked, *allocator_env_here(asked, environ)) if asked else default_mode(environ)
    except ValueError as e:  # an unknown mode: one line, not a traceback
        sys.exit(f"error: {e}")
    if problem and asked:  # the automatic choice falls back quietly (the training log names the allocator)
        logging.getLogger(__name__).warning("%s=%s: %s", MODE_VAR, mode, problem)
    if not changes:
        return
    env = {**os.environ, **changes, DONE_VAR: mode}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
