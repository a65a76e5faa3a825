"""The model's projections as bfloat16 matmuls with float32 accumulation on the CPU's bf16 units.

XLA's CPU backend (jax 0.10) does not run a bfloat16 dot on AMX tiles; oneDNN's matmul does. On AVX512-BF16
without AMX, XLA's bf16 dot matches oneDNN's on a plain [tokens, D] x [D, F] product but takes twice its time on
the backward's weight gradients (x^T @ dy, a contraction over the 1024 tokens of a micro-batch) and is slower on
decode shapes (BENCHMARKS.md, "bfloat16 matmuls on the CPU"). `matmul(x, w, backend)` rounds the operands to
bfloat16 and accumulates and returns float32, with a custom VJP whose dx = dy @ w^T and dw = x^T @ dy run the
same bf16 kernel (dy rounded too; dw returned in float32 for float32 master weights). Backends: "xla_bf16"
(XLA's dot_general) and "onednn" (an XLA FFI custom call into oneDNN, cpu_matmul.cc).

`model.cpu_matmul` (LlamaConfig.cpu_matmul) picks the path of every Dense projection and the unembedding:
  "xla"       XLA's einsum in the compute dtype (the float32 reference, and today's path);
  "xla_bf16"  bf16 operands on XLA's dot;
  "onednn"    bf16 operands on oneDNN; an error if its kernel cannot run here;
  "auto"      on a single CPU device with bf16 units (AMX or AVX512-BF16): onednn (xla_bf16 if its kernel does
              not build); otherwise (TPU, GPU, several devices, no bf16 units) xla. One log line says which and why.
              The sampler's programs (traced under `sampling()`) keep xla where the units are AVX512-BF16 without
              AMX: there bf16 sampling, with its split activations, is no faster (sampler_backend).
The oneDNN kernel is compiled at first use with the C++ compiler ($CXX, else g++ or c++) against oneDNN's
headers and library (the onednn-devel-cpu-gomp wheel installs them under the environment's prefix; $ONEDNN_ROOT
names another install) into $XDG_CACHE_HOME/sweet_jax/cpu_matmul (default ~/.cache), keyed by the source,
jax and oneDNN, so later processes only load it.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import jax
import jax.numpy as jnp

from sweet_jax.errors import SweetJaxError

log = logging.getLogger(__name__)

MODES = ("auto", "xla", "xla_bf16", "onednn")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of the units oneDNN's bf16 matmul runs on
# "auto" leaves models narrower than this on float32: their matmuls are too small for bf16 to pay (the demo
# critic, hidden 64, measured 5.4k tokens/s on oneDNN against 6.0k on XLA float32).
AUTO_MIN_HIDDEN = 256
_SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
_TARGET = "sweet_jax_bf16_matmul"


class CpuMatmulError(SweetJaxError):
    """model.cpu_matmul='onednn' where the oneDNN kernel cannot run; the message says why."""


def cpu_bf16_flags() -> tuple[str, ...]:
    """The processor's bf16 matrix flags of BF16_FLAGS (empty off Linux or without them)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return tuple(f for f in BF16_FLAGS if f in flags)


def _onednn_root() -> pathlib.Path | None:
    """A prefix holding include/oneapi/dnnl/dnnl.hpp and lib/libdnnl.so (oneDNN 3.x)."""
    candidates = [os.environ.get("ONEDNN_ROOT", ""), sysconfig.get_paths()["data"], sys.prefix, sys.base_prefix,
                  "/usr/local", "/usr"]
    for root in filter(None, candidates):
        root = pathlib.Path(root)
        if (root / "include/oneapi/dnnl/dnnl.hpp").is_file() and (root / "lib/libdnnl.so").exists():
            return root
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "sweet_jax" / "cpu_matmul"


def _build(compiler: str, root: pathlib.Path) -> pathlib.Path:
    """The compiled kernel, from the cache or compiled now (written under a temporary name, then renamed)."""
    lib = (root / "lib/libdnnl.so").resolve()
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), jax.__version__.encode(), str(lib).encode(),
                                     str(lib.stat().st_mtime_ns).encode(), compiler.encode()])).hexdigest()[:16]
    out = _cache_dir() / f"cpu_matmul-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = pathlib.Path(tmp) / out.name
        cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", str(_SOURCE), "-o", str(tmp_out),
               f"-I{jax.ffi.include_dir()}", f"-I{root / 'include'}", str(lib), f"-Wl,-rpath,{lib.parent}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {first}")
        os.replace(tmp_out, out)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Build and register the kernel once per process: None when it is ready, else why it is not."""
    root, compiler = _onednn_root(), _compiler()
    if root is None:
        return ("oneDNN 3.x is not installed (pip install onednn-devel-cpu-gomp, or set ONEDNN_ROOT to a prefix "
                "with include/oneapi/dnnl/dnnl.hpp and lib/libdnnl.so)")
    if compiler is None:
        return "no C++ compiler (g++, c++ or $CXX) to build the oneDNN kernel"
    try:
        so = _build(compiler, root)
        # GNU OpenMP threads that sleep when idle: spinning ones lose whole time slices on a shared, busy host
        # (a [64, 576] x [576, 1536] product: ~7 -> ~190 GFLOP/s at load 8 on 2 cores). Read when libgomp loads.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        handler = ctypes.cdll.LoadLibrary(str(so)).SweetJaxBf16Matmul
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return f"the oneDNN kernel could not be built or loaded: {e}"
    return None


def _host_reason(*, single_device: bool = True) -> str | None:
    """Why this process cannot run bf16 matmuls on the CPU's units (None: it can): not the cpu backend, several
    devices (with single_device: XLA would replicate a custom call's operands across a mesh), no bf16 units."""
    backend = jax.default_backend()
    if backend != "cpu":
        return f"the JAX backend is {backend}, not cpu"
    if single_device and jax.device_count() != 1:
        return f"JAX sees {jax.device_count()} devices; the kernel runs on one"
    if not cpu_bf16_flags():
        return f"the processor has none of {', '.join(BF16_FLAGS)} in /proc/cpuinfo"
    return None


def unavailable_reason(*, single_device: bool = True) -> str | None:
    """Why the oneDNN kernel cannot run in this process (None: it can). single_device: also require that JAX sees
    one device (XLA would replicate the custom call's operands across a multi-device mesh)."""
    return _host_reason(single_device=single_device) or _load()


def model_mode(mode: str, hidden_size: int) -> str:
    """The mode a model of this hidden size runs: "auto" is "xla" below AUTO_MIN_HIDDEN."""
    return "xla" if mode == "auto" and hidden_size < AUTO_MIN_HIDDEN else mode


@functools.lru_cache(maxsize=None)
def bf16_backend(mode: str) -> str | None:
    """Which bfloat16 matmul the projections of a model.cpu_matmul=`mode` model run in this process: "onednn",
    "xla_bf16", or None for today's XLA matmuls in the compute dtype. "auto" says why in one log line;
    "onednn" raises CpuMatmulError where its kernel cannot run."""
    if mode not in MODES:
        raise CpuMatmulError(f"model.cpu_matmul={mode!r}: expected one of {MODES}")
    if mode in ("xla", "xla_bf16"):
        return None if mode == "xla" else mode
    if mode == "onednn":
        reason = unavailable_reason(single_device=False)
        if reason is not None:
            raise CpuMatmulError(f"model.cpu_matmul='onednn' cannot run here: {reason}; set it to 'auto' or 'xla'")
        return "onednn"
    why = _host_reason()
    if why is not None:
        log.info("model.cpu_matmul=auto: XLA's matmuls in the compute dtype (%s)", why)
        return None
    # AMX: XLA's own bf16 dot does not use the tiles, oneDNN does. AVX512-BF16 only: oneDNN's kernel runs the
    # backward's x^T @ dy in half XLA's time (idle, SmolLM2: a critic step 1.19x, a DPO step 1.09x faster).
    units = ", ".join(cpu_bf16_flags())
    reason = _load()
    if reason is None:
        log.info("model.cpu_matmul=auto: projections as bfloat16 matmuls on oneDNN (%s), float32 accumulation", units)
        return "onednn"
    log.warning("model.cpu_matmul=auto: XLA's bfloat16 dot (%s) instead of oneDNN's kernel, because %s", units, reason)
    return "xla_bf16"


@functools.lru_cache(maxsize=None)
def sampler_backend(mode: str) -> str | None:
    """Which bfloat16 matmul the sampler's programs run for a model.cpu_matmul=`mode` model: bf16_backend's,
    except that "auto" samples with XLA's float32 matmuls where the processor's bf16 units are AVX512-BF16
    without AMX. There bf16 matmuls run at about twice float32's rate, and the sampler's split activations (what
    keeps its greedy tokens those of float32) double their rows: on SmolLM2-135M bf16 sampling was no faster
    than float32 in any measurement (BENCHMARKS.md), and float32's tokens are exact. Explicit modes stand."""
    backend = bf16_backend(mode)
    if mode == "auto" and backend is not None and "amx_bf16" not in cpu_bf16_flags():
        log.info("model.cpu_matmul=auto: the sampler keeps XLA's float32 matmuls (AVX512-BF16 without AMX: bf16 "
                 "sampling is no faster here); model.cpu_matmul=onednn samples in bf16")
        return None
    return backend


def active_backend(mode: str) -> str | None:
    """The bfloat16 matmul a projection traced now runs: sampler_backend's within `sampling()`, else
    bf16_backend's (None: XLA's matmul in the compute dtype)."""
    return sampler_backend(mode) if _sampling.get() else bf16_backend(mode)


def _call(a, b, backend: str, *, transpose_a: bool = False, transpose_b: bool = False):
    """float32 [M, N] = op(a) @ op(b) for 2-D bfloat16 a, b (op = transpose where asked) on `backend`."""
    M, K = a.shape[::-1] if transpose_a else a.shape
    N = b.shape[0] if transpose_b else b.shape[1]
    if backend == "xla_bf16":
        return jax.lax.dot_general(a, b, (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    if K == 0:
        return jnp.zeros((M, N), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")(
        a, b, transpose_a=transpose_a, transpose_b=transpose_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(x_MK, w_KN, backend, x_dtype, w_dtype):
    return _call(x_MK.astype(jnp.bfloat16), w_KN.astype(jnp.bfloat16), backend)


def _matmul_fwd(x_MK, w_KN, backend, x_dtype, w_dtype):
    x_bf, w_bf = x_MK.astype(jnp.bfloat16), w_KN.astype(jnp.bfloat16)
    return _call(x_bf, w_bf, backend), (x_bf, w_bf)  # bfloat16 residuals: half the memory of float32 ones


def _matmul_bwd(backend, x_dtype, w_dtype, residuals, dy_MN):
    # dy in bfloat16 too: against a float32 cotangent XLA would upcast the operand and run a float32 matmul.
    x_bf, w_bf = residuals
    dy_bf = dy_MN.astype(jnp.bfloat16)
    dx_MK = _call(dy_bf, w_bf, backend, transpose_b=True)
    dw_KN = _call(x_bf, dy_bf, backend, transpose_a=True)
    return dx_MK.astype(x_dtype), dw_KN.astype(w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x_MK: jax.Array, w_KN: jax.Array, backend: str = "onednn") -> jax.Array:
    """float32 [M, N] = bf16(x) @ bf16(w), accumulated in float32 on `backend` (a bf16_backend() answer);
    differentiable, the cotangents in x's and w's dtypes. Within `split_activations()`: x in two bf16 halves."""
    if backend == "onednn" and _load() is not None:
        raise CpuMatmulError(f"cpu_matmul.matmul: {_load()}")
    if _split.get():
        hi_MK = x_MK.astype(jnp.bfloat16)
        lo_MK = (x_MK.astype(jnp.float32) - hi_MK.astype(jnp.float32)).astype(jnp.bfloat16)
        y_2MN = _call(jnp.concatenate([hi_MK, lo_MK]), w_KN.astype(jnp.bfloat16), backend)
        return y_2MN[:x_MK.shape[0]] + y_2MN[x_MK.shape[0]:]
    return _matmul(x_MK, w_KN, backend, jnp.dtype(x_MK.dtype).name, jnp.dtype(w_KN.dtype).name)


_split = contextvars.ContextVar("sweet_jax_cpu_matmul_split_activations", default=False)
_sampling = contextvars.ContextVar("sweet_jax_cpu_matmul_sampling", default=False)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value):
    """`var` set to value within the block (what the traced matmuls read: see split_activations, unembedding)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def split_activations():
    """Within it (the sampler's compiled programs trace under it), a bf16 matmul rounds the weights only: x goes
    in as two bfloat16 halves, hi = bf16(x) and lo = bf16(x - hi), stacked into one matmul (the weight is read
    once; the rows double), so the product carries ~16 of x's mantissa bits. Rounding the activations, not the
    weights, is what flips greedy tokens: on SmolLM2-135M, 32 greedy tokens of 64 chat prompts matched the
    float32 sampler on 60 rows with bf16 activations, 63 with bf16-rounded weights and float32 activations
    (BENCHMARKS.md). Forward only (not differentiable)."""
    with _set(_split, True):
        yield


@contextlib.contextmanager
def sampling():
    """Within it (the sampler's compiled programs trace under it): the projections take sampler_backend's
    matmul, and bf16 ones split the activations (split_activations)."""
    with _set(_sampling, True), split_activations():
        yield


def contract(x, kernel, contracted: int, backend: str) -> jax.Array:
    """float32 x @ kernel over x's trailing and the kernel's leading `contracted` axes (a Dense einsum such as
    'BTNH,NHD->BTD'), flattened to one 2-D matmul on `backend`."""
    K = math.prod(kernel.shape[:contracted])
    y_MN = matmul(x.reshape(-1, K), kernel.reshape(K, -1), backend)
    return y_MN.reshape(x.shape[:x.ndim - contracted] + kernel.shape[contracted:])


_unembedding_mode = contextvars.ContextVar("sweet_jax_cpu_matmul_unembedding", default="xla")


@contextlib.contextmanager
def unembedding(mode: str):
    """Within it, the chunked log-prob functions (losses.py) trace the [D, V] unembedding's matmul under
    model.cpu_matmul=`mode` (steps.sequence_logprobs sets it to its model's): they take no model config."""
    with _set(_unembedding_mode, mode):
        yield


def unembedding_backend() -> str | None:
    """The active_backend of the unembedding traced now (see `unembedding`)."""
    return active_backend(_unembedding_mode.get())
