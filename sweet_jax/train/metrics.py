"""Training metrics: peak FLOP/s per device (for MFU), a JSONL + TensorBoard writer, the PNG plot.

MFU = model FLOPs per second actually achieved / peak FLOP/s of the devices used. Peaks of TPUs and
GPUs are the vendors' dense bf16 numbers, looked up by `device.device_kind`; a CPU has no published
number, so its float32 matmul peak is measured once at start-up (a short jitted matmul benchmark).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import pathlib
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from sweet_jax import jsonl, lazy
from sweet_jax.config_utils import writer_names
from sweet_jax.jsonl import write_atomic

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device (per chip for TPUs; v4/v5p chips count as one device each).
# Matched by substring of device_kind, lower-cased, first match wins (order: specific before generic).
PEAK_FLOPS = (
    ("tpu v6", 918e12),          # Trillium / v6e ("TPU v6 lite")
    ("tpu v5p", 459e12),
    ("tpu v5 lite", 197e12),     # v5e
    ("tpu v5e", 197e12),
    ("tpu v5", 459e12),
    ("tpu v4", 275e12),
    ("tpu v3", 123e12),
    ("tpu v2", 45e12),
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),            # SXM
    ("gh200", 989e12),
    ("b200", 2250e12),
    ("a100", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),
    ("a10g", 70e12),
    ("v100", 125e12),
)


def known_peak_flops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for key, peak in PEAK_FLOPS:
        if key in kind:
            return peak
    return None


def measure_cpu_matmul_peak(n: int = 1024, seconds: float = 0.5) -> float:
    """Best observed float32 matmul FLOP/s of this host (all its cores), from a short benchmark.

    Runs on one device: XLA's CPU matmul already uses every core, and fake CPU devices share them.
    """
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = math.inf
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2.0 * n**3 / best


def peak_flops_total(devices: Iterable[jax.Device] | None = None) -> tuple[float, str]:
    """(peak FLOP/s of all devices of the run, how it was obtained)."""
    devices = list(devices if devices is not None else jax.devices())
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        # Fake CPU devices share one host's cores: the peak is per host, not per device.
        hosts = len({d.process_index for d in devices})
        per_host = measure_cpu_matmul_peak()
        return per_host * hosts, f"measured float32 matmul peak {per_host / 1e9:.1f} GFLOP/s per host x {hosts}"
    peak = known_peak_flops(kind)
    if peak is None:
        log.warning("unknown device kind %r: MFU is not reported (add it to sweet_jax.train.metrics.PEAK_FLOPS)", kind)
        return math.nan, f"unknown device kind {kind!r}"
    return peak * len(devices), f"{kind}: {peak / 1e12:.0f} TFLOP/s bf16 x {len(devices)}"


PEAK_FILE = "mfu_peak.json"


def run_peak_flops(logdir, devices) -> tuple[float, str]:
    """The run's MFU peak: measured (or looked up) at its first start and kept in LOGDIR/mfu_peak.json, so that
    every resume divides by the same number (a CPU's measured peak varies by tens of percent between starts).
    A run moved to other devices gets a new peak (and says so). logdir None: look up without recording."""
    devices = list(devices)
    kind = f"{devices[0].device_kind} x {len(devices)}"
    path = pathlib.Path(logdir) / PEAK_FILE if logdir is not None else None
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("devices") == kind:
            return float(saved["peak_flops"]), saved["how"] + f" (recorded at the run's first start, {PEAK_FILE})"
        log.warning("the run's MFU peak was recorded on %s, this start runs on %s: MFU from here on uses a new "
                    "peak", saved.get("devices"), kind)
    peak, how = peak_flops_total(devices)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"peak_flops": peak, "how": how, "devices": kind}) + "\n")
    return peak, how


class TensorBoardWriter:
    """Event files in LOGDIR/tensorboard (tensorboardX): `tensorboard --logdir DIR` reads every run below DIR."""

    def __init__(self, logdir: pathlib.Path, **_):
        self._tb = lazy.tensorboard_writer()(str(logdir / "tensorboard"))

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        self._tb.close()


class WandbWriter:
    """Weights & Biases, offline unless metrics.wandb_mode says otherwise: the run is written under LOGDIR/wandb
    with no network (upload later with `wandb sync LOGDIR/wandb/offline-run-*`). Its id is derived from the
    logdir, so a resumed run continues the same W&B run. Any failure of W&B is one warning, then W&B is off for
    the rest of the run: tracking never stops training."""

    def __init__(self, logdir: pathlib.Path, *, project: str = "sweet_jax", mode: str = "offline", group: str = "",
                 name: str = "", config: dict | None = None):
        run_id = hashlib.sha1(str(logdir.resolve()).encode()).hexdigest()[:16]
        self._run = lazy.wandb().init(  # ImportError: the caller says so and goes on without W&B
            project=project or "sweet_jax", mode=mode or "offline", group=group or None, name=name or logdir.name,
            id=run_id, resume="allow", dir=str(logdir), config=config or {}, reinit=True)

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        self._run.log({f"{split}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsWriter:
    """Appends one JSON line per record to workdir/metrics.jsonl and mirrors the finite scalars to the writers
    named in metrics.writers (TensorBoard by default; W&B when named and installed).

    Only process 0 writes (every process calls it). Resuming appends to the same files; records from
    steps after the resume point are dropped first so the log shows one value per step. A writer that cannot
    start or fails later (W&B not installed, no network for online mode) is one warning; the others go on.
    """

    def __init__(self, workdir, *, resume_step: int = 0, enabled: bool | None = None,
                 writers: str | tuple = "tensorboard", group: str = "", name: str = "",
                 wandb_project: str = "sweet_jax", wandb_mode: str = "offline", config: dict | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.writers: dict[str, object] = {}
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._written: set[tuple[int, str]] = set()  # (step, split): a rerun never logs a step twice
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self._written = {(int(r.get("step", 0)), r.get("split", "train")) for r in kept}
        names = writer_names(writers) if isinstance(writers, str) else tuple(writers)
        kinds = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter}
        for kind in names:
            try:
                self.writers[kind] = kinds[kind](self.path.parent, project=wandb_project, mode=wandb_mode,
                                                 group=group, name=name, config=config)
            except ImportError:
                log.warning("metrics.writers names %s but it is not installed (pip install %s): logging to "
                            "metrics.jsonl%s only", kind, kind, "".join(f", {k}" for k in names if k != kind))
            except Exception as e:  # noqa: BLE001 - tracking must never stop a run
                log.warning("metrics writer %s could not start (%s: %s); the others go on", kind, type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "")

    def write(self, step: int, scalars: dict, *, split: str = "train") -> None:
        if not self.enabled:
            return
        if (int(step), split) in self._written:
            return
        self._written.add((int(step), split))
        record = {"step": int(step), "split": split}
        record.update({k: _to_float(v) for k, v in scalars.items()})
        jsonl.append(self.path, [record])
        finite = {k: v for k, v in record.items()
                  if k not in ("step", "split") and isinstance(v, float) and math.isfinite(v)}
        for kind, writer in list(self.writers.items()):
            try:
                writer.write(int(step), split, finite)
            except Exception as e:  # noqa: BLE001 - tracking must never stop a run
                log.warning("metrics writer %s failed at step %d (%s: %s); it is off for the rest of the run",
                            kind, step, type(e).__name__, e)
                self.writers.pop(kind)

    def close(self) -> None:
        for kind, writer in self.writers.items():
            try:
                writer.close()
            except Exception as e:  # noqa: BLE001
                log.warning("metrics writer %s did not close cleanly (%s: %s)", kind, type(e).__name__, e)
        self.writers = {}


def _to_float(v):
    if isinstance(v, (str, bool)) or v is None:
        return v
    return float(np.asarray(v))


def read_metrics(path) -> list[dict]:
    """The metrics lines so far ([] before the first); a half-written last line of a killed run is left out."""
    return jsonl.read(path, partial="drop")


PLOTTED = ("loss", "pair_accuracy", "margin", "chosen_score", "rejected_score", "dpo_loss", "nll", "chosen_logp",
           "rejected_logp", "grad_norm", "lr", "tokens_per_s", "mfu")
# The y axis of each panel: what the number is and its unit.
Y_LABELS = {
    "loss": "loss (nats per pair)", "pair_accuracy": "fraction of pairs ranked right",
    "margin": "chosen - rejected (nats)", "chosen_score": "score of chosen (nats)",
    "rejected_score": "score of rejected (nats)", "dpo_loss": "DPO term (nats per pair)",
    "nll": "chosen NLL (nats per token)", "chosen_logp": "log-prob of chosen (nats)",
    "rejected_logp": "log-prob of rejected (nats)", "grad_norm": "global L2 norm", "lr": "learning rate",
    "tokens_per_s": "tokens / s", "mfu": "fraction of peak FLOP/s",
}
FEW_POINTS = 40  # a series with at most this many points is drawn with markers: each value is visible


def smoothed(ys, window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start): the trend under a noisy per-batch series."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(metrics_path, png_path, *, title: str = "", loss_label: str = Y_LABELS["loss"]) -> pathlib.Path:
    """One PNG with a panel per metric: the train series (with a smoothed pair accuracy), eval points marked.
    `loss_label`: the loss axis's unit (pair losses are per pair, SFT / RFT's NLL is per action token)."""
    plt = lazy.pyplot()
    records = read_metrics(metrics_path)
    keys = [k for k in PLOTTED if any(k in r for r in records)]
    cols = 3
    rows = max(1, math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.1 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for split in ("train", "eval"):
            pts = [(r["step"], r[key]) for r in records
                   if r.get("split") == split and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if not pts:
                continue
            xs, ys = zip(*pts)
            marker = "o" if split == "eval" or len(pts) <= FEW_POINTS else None
            smooth = split == "train" and key == "pair_accuracy" and len(pts) >= 5
            ax.plot(xs, ys, "-", marker=marker, markersize=3, label=f"{split} (per batch)" if smooth else split,
                    alpha=0.45 if smooth else 1.0, color="C0" if split == "train" else "C1")
            if smooth:
                window = max(3, len(pts) // 10)
                ax.plot(xs, smoothed(list(ys), window), "-", color="C0", linewidth=2,
                        label=f"train (mean of last {window})")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(loss_label if key == "loss" else Y_LABELS.get(key, key), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = pathlib.Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
