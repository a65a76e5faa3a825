"""Where a process's seconds go: named timers and counters that the hot paths add to (sampling's prefill and
decode, sandbox scoring, scoring passes, reference log-prob passes, train steps, and the real and padded tokens of
their batches), and JAX's compile time from its monitoring events. The pipeline resets them at each stage's start
and keeps a snapshot in the stage's done.json (`costs`), so a seed's cost table says what each stage spent its
minutes on, not only how many (bench/bench_stages.py).

Timers nest: a pass's seconds include the compilations it triggered (compile_s counts them again on its own).
Counters are plain sums. Nothing here synchronises the device except where a caller says so (sampling blocks on
the prefill's result once per batch, which the first decode step waits for anyway).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time

from jax import monitoring

_lock = threading.Lock()
_totals: collections.Counter = collections.Counter()

# JAX's compile events (jax._src.dispatch, jax._src.compiler): tracing, lowering to MLIR, the backend's compile
# (a persistent-cache read included); a cache hit is also counted on its own.
_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                   "/jax/core/compile/backend_compile_duration": "backend_compile_s"}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_listening = False


def add(name: str, value: float = 1.0) -> None:
    with _lock:
        _totals[name] += value


@contextlib.contextmanager
def timed(name: str):
    """Adds the block's wall seconds to `name`_s and one to `name`_calls."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        with _lock:
            _totals[name + "_s"] += time.perf_counter() - t0
            _totals[name + "_calls"] += 1


def tokens(name: str, real: int, padded: int) -> None:
    """A batch's real tokens and its padded size (rows x length): `name`_tokens, `name`_padded_tokens."""
    with _lock:
        _totals[name + "_tokens"] += int(real)
        _totals[name + "_padded_tokens"] += int(padded)


def _on_duration(event: str, duration: float, **_) -> None:
    name = _COMPILE_EVENTS.get(event)
    if name is not None:
        add("compile_" + name, duration)
        if name == "backend_compile_s":
            add("compiles")


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        add("compile_cache_hits")


def listen_to_compiles() -> None:
    """Count JAX's compilations from now on (idempotent)."""
    global _listening
    if _listening:
        return
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)
    _listening = True


def reset() -> None:
    with _lock:
        _totals.clear()


def snapshot() -> dict:
    """The totals since the last reset, sorted by name; compile_s = trace + lower + backend compile."""
    with _lock:
        out = dict(_totals)
    parts = [out.get("compile_" + n, 0.0) for n in _COMPILE_EVENTS.values()]
    if any(parts):
        out["compile_s"] = sum(parts)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sorted(out.items())}
