"""Will a training step fit on a TPU slice? The step compiled ahead of time for a topology (jax.experimental
.topologies; no TPU needed) and its per-chip memory and FLOPs read from the compiled program; the search over memory
layouts (fit_layouts, cheapest first). The command line: sweet_jax.commands.plan (`python -m sweet_jax.plan`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import topologies

from sweet_jax import sharding
from sweet_jax.config_utils import model_overrides, setting
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import Llama, LlamaConfig
from sweet_jax.models.attention import resolve_attention_impl
from sweet_jax.models.hf import read_hf_config
from sweet_jax.models.llama import PRESETS
from sweet_jax.models.lora import LoRAConfig, add_adapters
from sweet_jax.train import steps
from sweet_jax.train.optimizer import optimizer_from_config

GiB = 1024 ** 3
LOCAL = "local"   # --topology local: compile for the devices attached to this host (e.g. a GPU)
# Per-chip HBM and how a slice name counts chips (v4 / v5p names count TensorCores, 2 per chip).
CHIPS = {
    "v4": dict(hbm=32 * GiB, cores_per_chip=2, dims=3),
    "v5e": dict(hbm=16 * GiB, cores_per_chip=1, dims=2),
    "v5p": dict(hbm=95 * GiB, cores_per_chip=2, dims=3),
    "v6e": dict(hbm=32 * GiB, cores_per_chip=1, dims=2),
}
_SLICE_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SLICE_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8"}


class PlanError(SweetJaxError):
    """The plan cannot be made: unknown topology, a mesh that does not match it, an unknown step kind."""


@dataclasses.dataclass(frozen=True)
class Topology:
    chip: str     # 'v4' | 'v5e' | 'v5p' | 'v6e', or LOCAL: the devices attached to this host
    shape: str    # chip grid, e.g. '4x4' or '2x2x1'; for LOCAL the device count
    device_kind: str = ""   # LOCAL: e.g. 'NVIDIA H100 80GB HBM3'
    local_bytes: int = 0    # LOCAL: the memory XLA may use on each device

    @property
    def name(self) -> str:
        return f"{self.device_kind} x{self.shape}" if self.chip == LOCAL else f"{self.chip}:{self.shape}"

    @property
    def num_chips(self) -> int:
        n = 1
        for d in self.shape.split("x"):
            n *= int(d)
        return n

    @property
    def slice_name(self) -> str:
        if self.chip == LOCAL:
            return f"{self.shape}x {self.device_kind}"
        return f"{self.chip}-{self.num_chips * CHIPS[self.chip]['cores_per_chip']}"

    @property
    def hbm_bytes(self) -> int:
        return self.local_bytes if self.chip == LOCAL else CHIPS[self.chip]["hbm"]


def no_compilation_cache() -> None:
    """A program compiled for a TPU topology from a CPU host cannot be stored in or loaded from JAX's persistent
    compilation cache (no TPU client to deserialise it): every command line turns the cache on (cli.run), plan
    turns it off."""
    jax.config.update("jax_enable_compilation_cache", False)


def parse_topology(text: str) -> Topology:
    """'v5e-16' (a Cloud TPU slice name), 'v5e:4x4' (the chip grid) or 'local' (this host's devices) -> Topology."""
    text = text.strip().lower()
    if text == LOCAL:
        return local_topology()
    m = re.fullmatch(r"(v4|v5e|v5p|v6e|v5litepod)[-:](.+)", text)
    if not m:
        raise PlanError(f"--topology={text!r}: expected e.g. v5e-16, v4-8, v5p-8, v6e-8 or v5e:4x4, v4:2x2x1 "
                        f"(chips: {', '.join(CHIPS)}).")
    chip, rest = m.group(1).replace("v5litepod", "v5e"), m.group(2)
    info = CHIPS[chip]
    if re.fullmatch(r"\d+(x\d+)+", rest):
        if rest.count("x") + 1 != info["dims"]:
            raise PlanError(f"--topology={text!r}: {chip} grids have {info['dims']} dimensions, e.g. "
                            f"{'4x4' if info['dims'] == 2 else '2x2x1'}.")
        return Topology(chip, rest)
    if not rest.isdigit() or int(rest) % info["cores_per_chip"]:
        raise PlanError(f"--topology={text!r}: the slice size must be a number of "
                        f"{'TensorCores (2 per chip)' if info['cores_per_chip'] == 2 else 'chips'}.")
    chips = int(rest) // info["cores_per_chip"]
    table = _SLICE_2D if info["dims"] == 2 else _SLICE_3D
    if chips not in table:
        raise PlanError(f"--topology={text!r}: no standard {chip} slice with {chips} chips; "
                        f"give the grid instead, e.g. {chip}:{next(iter(table.values()))}.")
    return Topology(chip, table[chips])


def local_topology() -> Topology:
    """The devices JAX sees on this host, with the memory XLA may use on each (the host's RAM on a CPU)."""
    devices = jax.local_devices()
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Topology(LOCAL, str(len(devices)), device_kind=devices[0].device_kind, local_bytes=int(limit))


def topology_devices(topology: Topology):
    """Abstract TPU devices of the slice (needs libtpu; no TPU attached), or this host's devices for LOCAL."""
    if topology.chip == LOCAL:
        return jax.local_devices()
    # Several processes on one host may load libtpu; we only compile, so its lock file is not needed.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM libtpu probes the metadata server and prints warnings and an INVALID_ARGUMENT error about
    # the host; describing this host as one worker of the slice keeps the output to the plan.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.slice_name.replace("v5e-", "v5litepod-"))
    kwargs = {"chip_config_name": "megacore"} if CHIPS[topology.chip]["cores_per_chip"] == 2 else {}
    try:
        return topologies.get_topology_desc(topology.name, "tpu", **kwargs).devices
    except Exception as e:  # noqa: BLE001 - libtpu raises plain RuntimeErrors
        raise PlanError(f"cannot describe TPU topology {topology.name} ({e}); is libtpu installed "
                        "(pip install 'jax[tpu]')?") from None


# ------------------------------------------------------------------------------------------------------
# From the config


def llama_config(config, *, for_tpu: bool = True):
    """The LlamaConfig the run would train: model.path's config.json if there, else model.preset."""
    # The compile targets a TPU from a CPU host, where "auto" would resolve for the CPU: resolve it for the TPU
    # here (chunked past 2048 tokens, as the model does on a TPU); cuDNN is GPU only. For this host's own
    # devices (LOCAL) the model resolves it as it will when training.
    impl = config.model.attention_impl
    if for_tpu and impl in ("auto", "cudnn", "blocked"):
        impl = "chunked" if config.data.max_len > 2048 else "xla"
    overrides = model_overrides(config, attention_impl=impl)
    if config.model.path and (pathlib.Path(config.model.path) / "config.json").is_file():
        return LlamaConfig.from_hf(read_hf_config(config.model.path), **overrides)
    if config.model.preset not in PRESETS:
        raise PlanError(f"config.model.preset={config.model.preset!r} is not a model preset: use one of "
                        f"{', '.join(PRESETS)}.")
    return LlamaConfig.preset(config.model.preset, **overrides)


def step_kind(config) -> str:
    kind = config.loss.kind
    if kind not in ("critic", "dpo", "mtdpo", "rft", "sft"):
        raise PlanError(f"config.loss.kind={kind!r}: expected critic, dpo, mtdpo or rft.")
    return kind


@dataclasses.dataclass
class Plan:
    topology: Topology
    step: str
    seq_len: int
    batch_size: int
    micro_batch_size: int
    mesh_shape: tuple
    remat: str
    dtype: str
    num_params: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float      # XLA's cost analysis: counts a jax.lax.scan body once (scan_layers: one layer's worth)
    model_flops: float = 0.0  # 6 x matmul params + attention per token (LlamaConfig.flops_per_token), per chip
    layout: str = ""  # layers stacked under scan or unrolled, sequence parallel, attention implementation
    estimated: bool = False  # True: extrapolated from shallower compiles (extrapolated_plan)
    compile_error: str = ""  # the TPU compiler's out-of-memory message when it refused the program
    mesh_note: str = ""      # why the mesh differs from config.mesh.shape (sharding.choose_mesh_shape), or ''
    host_bytes: int = 0      # arguments in host memory (optim.offload_state), not counted in HBM

    @property
    def total_bytes(self) -> int:
        # Donated outputs alias their arguments: count them once.
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        return not self.compile_error and self.total_bytes <= self.topology.hbm_bytes

    def row(self) -> str:
        g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
        return (f"| {self.topology.slice_name} ({self.topology.name}) | {self.step} | {self.seq_len} | "
                f"{self.batch_size}/{self.micro_batch_size or self.batch_size} | {self.mesh_shape} | {self.remat} | "
                f"{self.layout} | "
                f"{g(self.argument_bytes)} | {g(self.temp_bytes)} | {g(self.total_bytes)} / "
                f"{self.topology.hbm_bytes / GiB:.0f} | {self.model_flops / 1e12:.1f} | "
                f"{'yes' if self.fits else 'NO'}{' (est.)' if self.estimated else ''} |")


TABLE_HEADER = ("| slice | step | seq | batch/micro | mesh (data, fsdp, tensor) | remat | layout | args GiB | "
                "temps GiB | total GiB / HBM | model TFLOP/step/chip | fits |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def make_plan(config, topology: Topology, *, verbose: bool = True, num_layers: int | None = None) -> Plan:
    """AOT-compile the configured train step for the topology and read its per-chip memory and FLOPs.

    num_layers overrides the model's depth (used by `extrapolated_plan`)."""
    # Shapes
    kind = step_kind(config)
    mcfg = llama_config(config, for_tpu=topology.chip != LOCAL)
    if num_layers is not None:
        mcfg = dataclasses.replace(mcfg, num_layers=num_layers)
    B, T = int(config.train.batch_size), int(config.data.max_len)
    P = 1 if kind in ("rft", "sft") else 2
    micro = int(config.train.micro_batch_size)

    # Topology -> mesh: the config's, or (when its batch shards do not split the batch) a valid one, said so.
    devices = topology_devices(topology)
    try:
        shape, why = sharding.choose_mesh_shape(tuple(config.mesh.shape), len(devices), B, micro)
        mesh = sharding.make_mesh(shape, devices=devices)
    except SweetJaxError as e:
        raise PlanError(f"config.mesh.shape={tuple(config.mesh.shape)} on {topology.name}: {e}") from None
    if why and verbose:
        print(f"mesh: {why}", file=sys.stderr, flush=True)

    # Sharded abstract state and batch
    optimizer, lr_schedule = optimizer_from_config(config.optim, 1000)
    lora = LoRAConfig.from_config(config.get("lora"))  # rank > 0: adapters trained, the base frozen
    state = steps.abstract_train_state(lambda: add_adapters(Llama(mcfg, rngs=nnx.Rngs(0)), lora), optimizer, mesh,
                                       trainable=nnx.LoRAParam if lora.enabled else nnx.Param,
                                       offload_opt_state=setting(config, "optim.offload_state"))
    bsh = steps.batch_sharding(mesh)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=bsh)  # noqa: E731
    batch = {"input_ids": sds((B, P, T), jnp.int32), "attention_mask": sds((B, P, T), jnp.int32),
             "turn_ids": sds((B, P, T), jnp.int32), "weight": sds((B,), jnp.float32)}
    # No score_pos: the full-sequence log-prob path, which the trainer also runs for a batch whose action tokens
    # fill the bucket T (loss.score_positions uses S < T positions otherwise): the worst case.
    ref_in_step = config.train.ref_logp == "in_step"
    if kind != "rft" and not ref_in_step:
        batch["ref_logp"] = sds((B, P, T), jnp.float32)

    # Lower and compile
    attention = resolve_attention_impl(mcfg, T)
    step = steps.make_step(steps.loss_spec(config.loss), state, optimizer, mesh, micro_batch_size=micro,
                           ref_in_step=ref_in_step, lr_schedule=lr_schedule, host_loop=False)
    args = (state, batch) + ((state.params,) if ref_in_step and kind != "rft" else ())
    if verbose:
        print(f"compiling the {kind} step of a {mcfg.num_params() / 1e9:.2f}B-parameter Llama, batch {B}x{P}x{T}"
              f" (micro {micro or B}), mesh {dict(mesh.shape)} for {topology.name} ...", file=sys.stderr, flush=True)
    with jax.set_mesh(mesh):  # the model's residual_sharding constraints name mesh axes
        lowered = step.lower(*args)
    plan = Plan(topology=topology, step=kind, seq_len=T, batch_size=B, micro_batch_size=micro,
                mesh_shape=tuple(mesh.shape.values()), remat=mcfg.remat, dtype=mcfg.dtype,
                mesh_note=why, num_params=mcfg.num_params(), argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
                code_bytes=0, flops=0.0,
                model_flops=mcfg.flops_per_token(T) * B * P * T / mesh.devices.size,
                layout=", ".join([("scan" if mcfg.scan_layers else "unrolled"), attention
                                  + (f" {mcfg.attention_chunk_size}" if attention == "chunked" else "")]
                                 + (["SP"] if setting(config, "model.sequence_parallel") else [])
                                 + ([f"LoRA r{lora.rank}"] if lora.enabled else [])
                                 + (["bf16 moments"] if setting(config, "optim.moments_dtype") == "bfloat16" else [])
                                 + (["opt state on host"] if setting(config, "optim.offload_state") else [])
                                 + (["layerwise update"] if setting(config, "optim.layerwise_update") else [])))
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - the TPU compiler refuses programs that exceed HBM
        over = _parse_out_of_memory(str(e))
        if over is None:
            raise
        # What the compiler reports before giving up: the temporaries it needed; arguments are estimated from
        # the sharded input shapes (params, optimiser state, batch).
        arg_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(args)
                        if getattr(x.sharding, "memory_kind", None) != steps.HOST_MEMORY)
        return dataclasses.replace(plan, argument_bytes=arg_bytes, temp_bytes=over, compile_error=str(e).strip()
                                   .splitlines()[0][:300])
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dataclasses.replace(
        plan, argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        host_bytes=int(getattr(mem, "host_argument_size_in_bytes", 0) or 0),
        code_bytes=int(mem.generated_code_size_in_bytes), flops=float((cost or {}).get("flops", 0.0)))


def _parse_out_of_memory(message: str) -> int | None:
    """Bytes of temporaries from the TPU compiler's 'Ran out of memory in memory space hbm' error, else None."""
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
        return None
    m = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", message)
    if not m:
        return 0
    return int(float(m.group(1)) * 1024 ** (" KMGT".index(m.group(2))))


def _shard_bytes(x) -> int:
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return int(np.prod(shape)) * np.dtype(x.dtype).itemsize


def extrapolated_plan(config, topology: Topology, *, layers=(2, 4), verbose: bool = True) -> Plan:
    """A quick estimate: compile the step with two small depths and extend every memory figure and the FLOPs
    linearly to the model's real depth (decoder layers are identical, so each adds the same parameters,
    optimiser state and saved activations). Minutes instead of the full compile's tens of minutes on a small
    host; confirm a borderline fit with the full compile."""
    real = llama_config(config).num_layers
    a, b = (make_plan(config, topology, verbose=verbose, num_layers=n) for n in layers)
    k = (real - layers[0]) / (layers[1] - layers[0])
    lin = lambda x, y: int(round(x + k * (y - x)))  # noqa: E731
    return dataclasses.replace(
        a, num_params=llama_config(config).num_params(), argument_bytes=lin(a.argument_bytes, b.argument_bytes),
        output_bytes=lin(a.output_bytes, b.output_bytes), alias_bytes=lin(a.alias_bytes, b.alias_bytes),
        temp_bytes=lin(a.temp_bytes, b.temp_bytes), code_bytes=lin(a.code_bytes, b.code_bytes),
        flops=a.flops + k * (b.flops - a.flops), model_flops=llama_config(config).flops_per_token(a.seq_len)
        * a.batch_size * (1 if a.step in ("rft", "sft") else 2) * a.seq_len / math.prod(a.mesh_shape), estimated=True)


def report(plan: Plan) -> str:
    g = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
    t = plan.topology
    lines = [
        f"topology   {t.slice_name} ({t.name}, {t.num_chips} chips, {t.hbm_bytes / GiB:.0f} GiB HBM each)",
        f"step       {plan.step}: {plan.num_params / 1e9:.2f}B params, batch {plan.batch_size} "
        f"(micro {plan.micro_batch_size or plan.batch_size}) x seq {plan.seq_len}, compute {plan.dtype}, "
        f"remat {plan.remat}, mesh (data, fsdp, tensor) = {plan.mesh_shape}",
    ] + ([f"mesh       chosen: {plan.mesh_note}"] if plan.mesh_note else []) + [
        "per chip:",
        f"  arguments {g(plan.argument_bytes)}   (params, optimiser state, batch)",
    ] + ([f"  host      {g(plan.host_bytes)}   (optimiser state offloaded to host memory, not in HBM)"]
         if plan.host_bytes else []) + [
        f"  outputs   {g(plan.output_bytes)}   ({plan.alias_bytes / GiB:.2f} GiB aliased to donated arguments)",
        f"  temps     {g(plan.temp_bytes)}   (activations, gradients, workspace)",
        f"  code      {g(plan.code_bytes)}",
        f"  total     {g(plan.total_bytes)}   of {t.hbm_bytes / GiB:.0f} GiB "
        f"({100 * plan.total_bytes / t.hbm_bytes:.0f}%)",
        f"  FLOPs     {plan.model_flops / 1e12:8.1f} TFLOP per step per chip (model: 6 x params + attention, "
        f"per token); XLA cost analysis {plan.flops / 1e12:.1f}"
        + (" (counts the scanned layer once)" if plan.layout.startswith("scan") else " (incl. remat recompute)"),
        f"layout     {plan.layout}",
    ] + ([f"  the TPU compiler refused the program: {plan.compile_error}",
          "  (temps = what it needed; arguments estimated from the sharded input shapes)"]
         if plan.compile_error else []) + [
        f"fits       {'yes' if plan.fits else 'NO'}"
        + (" (estimate: linear extrapolation from 2- and 4-layer compiles)" if plan.estimated else ""),
        "table row:",
        TABLE_HEADER,
        plan.row(),
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# --fit: the cheapest layout that fits

# What each memory option costs in step time, roughly (a relative slow-down; for ordering the search, not a
# prediction): stacking layers under scan costs nothing at run time, rounding Adam's moments to bf16 little,
# recomputing every layer's forward (remat) about a third more FLOPs, each halving of the micro-batch some matmul
# efficiency, each doubling of the 'tensor' axis (sequence parallelism) its collectives, and offloading the
# optimiser state a host round trip of it every step.
FIT_COSTS = {"scan": 0.01, "moments": 0.02, "remat": 0.30, "micro": 0.05, "tensor": 0.10, "offload": 0.15}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: config overrides and what they cost (FIT_COSTS)."""
    overrides: tuple      # ((field, value), ...), in a stable order
    cost: float

    @property
    def flags(self) -> list[str]:
        return [f"--config.{field}={_flag_value(value)}" for field, value in self.overrides]

    def describe(self) -> str:
        return ", ".join(f"{field}={_flag_value(value)}" for field, value in self.overrides) or "as configured"


def _flag_value(value) -> str:
    if isinstance(value, tuple):
        return "'(" + ",".join(str(v) for v in value) + ")'"
    return str(value)


def fit_layouts(config, topology: Topology) -> list[Layout]:
    """Every combination of the memory options the config does not already use, cheapest first (FIT_COSTS; ties:
    fewer changes first): scan_layers, bf16 moments, remat of every layer, micro-batches (halvings of the batch),
    sequence parallelism over a 'tensor' axis of 2, 4, 8 (with the batch over the rest of the chips), and the
    optimiser state in host memory (not on a CPU: the same RAM)."""
    n = topology.num_chips
    mcfg = llama_config(config, for_tpu=topology.chip != LOCAL)
    B = int(config.train.batch_size)
    groups = []
    if not config.model.scan_layers:
        groups.append([(), ((("model.scan_layers", True),), FIT_COSTS["scan"])])
    if config.optim.get("moments_dtype", "float32") != "bfloat16":
        groups.append([(), ((("optim.moments_dtype", "bfloat16"),), FIT_COSTS["moments"])])
    if config.model.remat != "full":
        groups.append([(), ((("model.remat", "full"),), FIT_COSTS["remat"])])
    micro, halvings = [()], 0
    m = int(config.train.micro_batch_size) or B
    while m % 2 == 0 and m > 1:
        m, halvings = m // 2, halvings + 1
        micro.append(((("train.micro_batch_size", m),), FIT_COSTS["micro"] * halvings))
    groups.append(micro)
    tensor = [()]
    for t in (2, 4, 8):
        if n % t == 0 and n > t and mcfg.num_kv_heads % t == 0 and not setting(config, "model.sequence_parallel"):
            tensor.append(((("mesh.shape", (1, n // t, t)), ("model.sequence_parallel", True)),
                           FIT_COSTS["tensor"] * math.log2(t)))
    groups.append(tensor)
    if not setting(config, "optim.offload_state") and not (topology.chip == LOCAL and "cpu" in
                                                             topology.device_kind.lower()):
        groups.append([(), ((("optim.offload_state", True),), FIT_COSTS["offload"])])
    layouts = []
    for combo in itertools.product(*groups):
        chosen = [c for c in combo if c]
        layouts.append(Layout(tuple(kv for overrides, _ in chosen for kv in overrides),
                              round(sum(cost for _, cost in chosen), 6)))
    return sorted(layouts, key=lambda layout: (layout.cost, len(layout.overrides), layout.describe()))


def with_overrides(config, overrides):
    """A copy of the (locked) config with `overrides` ((dotted field, value), ...) set."""
    out = ml_collections.ConfigDict(config.to_dict())
    for field, value in overrides:
        *sections, name = field.split(".")
        node = out
        for section in sections:
            node = node[section]
        node[name] = value
    return out


def fit(config, topology: Topology, *, estimate: bool = False, max_tries: int = 24, budget_bytes: int | None = None,
        verbose: bool = True, log=print) -> tuple[Layout | None, Plan | None, list[tuple[Layout, Plan]]]:
    """Compile the layouts of fit_layouts in order until one fits (budget_bytes per chip, default the chip's
    HBM): (that layout, its plan, every (layout, plan) tried). (None, None, tried) when none of the first
    max_tries fits."""
    if max_tries < 1:
        raise PlanError(f"fit: max_tries={max_tries}: compile at least 1 layout")
    if budget_bytes is not None and budget_bytes <= 0:
        raise PlanError(f"fit: a memory budget of {budget_bytes} bytes a chip: expected > 0 (None = the chip's HBM)")
    budget = budget_bytes if budget_bytes is not None else topology.hbm_bytes
    tried = []
    for layout in fit_layouts(config, topology)[:max_tries]:
        candidate = with_overrides(config, layout.overrides)
        result = (extrapolated_plan(candidate, topology, verbose=verbose) if estimate
                  else make_plan(candidate, topology, verbose=verbose))
        fits = not result.compile_error and result.total_bytes <= budget
        tried.append((layout, result))
        log(f"try {len(tried)} (cost +{100 * layout.cost:.0f}%): {layout.describe()}: "
            f"{_size(result.total_bytes)} of {_size(budget)} per chip: {'fits' if fits else 'no'}")
        if fits:
            return layout, result, tried
    return None, None, tried


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------------


def user_config_args(argv) -> list[str]:
    """The --config FILE:PRESET and --config.FIELD=VALUE arguments of a command line (both spellings joined)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            out.append(f"--config={argv[i + 1]}")
            i += 1
        elif arg.startswith("--config=") or arg.startswith("--config."):
            out.append(arg)
        i += 1
    return out



def fit_commands(argv, layout: Layout, topology_text: str) -> tuple[str, str]:
    """(the train command, the plan command that checks it) with the user's config arguments and the layout's
    overrides (which replace the user's own values of those fields)."""
    fields = {f"--config.{field}" for field, _ in layout.overrides}
    args = [a for a in user_config_args(argv) if a.split("=", 1)[0] not in fields] + layout.flags
    shown = " ".join(args)
    return (f"python -m sweet_jax.train {shown} --workdir WORKDIR",
            f"python -m sweet_jax.plan {shown} --topology {topology_text}")
