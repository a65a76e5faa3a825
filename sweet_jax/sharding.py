"""Device mesh, the logical-axis rule table, and shardings for parameters, optimiser state and batches.

Every parameter names its axes logically ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'norm',
and 'layers' for the stacked layers of a scan_layers=True model);
LOGICAL_RULES maps those names onto the mesh axes ('data', 'fsdp', 'tensor'). Changing the layout is
changing this one table.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sweet_jax.errors import SweetJaxError

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),   # scan_layers=True stack axis: not split; each layer is sharded by its own axes
    ("sequence", "tensor"),  # tokens of the residual stream between layers, when sequence parallel
)


class MeshError(SweetJaxError):
    pass


# ----------------------------------------------------------------------------------------------------------
# Mesh
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape over ('data', 'fsdp', 'tensor'); one entry may be -1 = all remaining devices."""
    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def make(self, devices=None) -> Mesh:
        return make_mesh(self.shape, devices)


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices=None) -> Mesh:
    """A Mesh with axes ('data', 'fsdp', 'tensor'). -1 takes the devices left over; a shape using fewer
    devices than available takes the first ones."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(MESH_AXES):
        raise MeshError(f"mesh shape {tuple(shape)}: expected {len(MESH_AXES)} sizes for axes {MESH_AXES}.")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshError(f"mesh shape {tuple(shape)}: sizes must be positive, with at most one -1.")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise MeshError(f"mesh shape {tuple(shape)}: {len(devices)} devices are not divisible by {known}.")
        shape[shape.index(-1)] = len(devices) // known
    needed = math.prod(shape)
    if needed > len(devices):
        raise MeshError(f"mesh shape {tuple(shape)} ({dict(zip(MESH_AXES, shape))}) needs {needed} devices, "
                        f"but only {len(devices)} are available ({devices[0].platform}).")
    devices = devices[:needed]
    try:
        device_array = mesh_utils.create_device_mesh(shape, devices)  # topology-aware on TPU
    except Exception:  # CPU / partial device sets: plain order is as good as any
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with the -1 filled in from num_devices (MeshError when the sizes cannot fill them)."""
    shape = [int(s) for s in shape]
    if len(shape) != len(MESH_AXES) or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshError(f"mesh shape {tuple(shape)}: expected {len(MESH_AXES)} positive sizes for {MESH_AXES}, "
                        "at most one -1.")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshError(f"mesh shape {tuple(shape)}: {num_devices} devices are not divisible by {known}.")
        shape[shape.index(-1)] = num_devices // known
    return tuple(shape)


def choose_mesh_shape(shape: Sequence[int], num_devices: int, batch_size: int,
                      micro_batch_size: int = 0) -> tuple[tuple[int, int, int], str]:
    """The (data, fsdp, tensor) mesh a training step runs on, and why: `shape` (the config's, -1 = the rest)
    when every (micro-)batch splits evenly over its batch shards (data x fsdp), else a valid one.

    The batch dimension is split over data x fsdp, so those must divide the examples per forward pass
    (micro_batch_size, or batch_size when 0). When the configured mesh's do not (the 8B presets' FSDP over
    every chip with batch 8 on 16 chips), the batch shards shrink to the largest divisor of the chips they
    may use that divides those examples, and the freed factor moves to 'tensor': every chip still holds a
    1/num_devices share of the parameters and optimiser state (fsdp x tensor shards them) and computes on
    its batch shard's examples. The configured 'tensor' size and, where it still divides, 'data' are kept.
    Returns (shape, reason); reason is '' when the configured mesh is used as it is."""
    data, fsdp, tensor = resolve_mesh_shape(shape, num_devices)
    per_pass = int(micro_batch_size) or int(batch_size)
    if per_pass < 1 or (micro_batch_size and batch_size % micro_batch_size):
        raise MeshError(f"batch_size={batch_size}, micro_batch_size={micro_batch_size}: the micro-batch must be "
                        "a positive divisor of the batch (0 = the whole batch).")
    if per_pass % (data * fsdp) == 0:
        return (data, fsdp, tensor), ""
    free = data * fsdp                   # chips the batch may be split over; the rest stay in 'tensor'
    shards = max(k for k in range(1, free + 1) if free % k == 0 and per_pass % k == 0)
    new_data = data if shards % data == 0 else 1
    chosen = (new_data, shards // new_data, tensor * free // shards)
    what = f"micro-batch {per_pass}" if micro_batch_size else f"batch {per_pass}"
    return chosen, (f"{what} does not split evenly over data x fsdp = {data * fsdp} of mesh {(data, fsdp, tensor)}; "
                    f"using {chosen} (data, fsdp, tensor): the batch over {shards}, 'tensor' x{free // shards}")


# ----------------------------------------------------------------------------------------------------------
# Logical names -> PartitionSpec -> NamedSharding
# ----------------------------------------------------------------------------------------------------------

def logical_to_spec(names: Sequence[str | None] | None, rules=LOGICAL_RULES) -> PartitionSpec:
    """('embed', 'mlp') -> P('fsdp', 'tensor'). A mesh axis is used at most once (later uses replicate)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names or ():
        axes = table.get(name) if name is not None else None
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if any(a in used for a in axes_tuple):
            axes_tuple = ()
        used.update(axes_tuple)
        spec.append(None if not axes_tuple else axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple)
    return PartitionSpec(*spec)


def spec_for_shape(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide (e.g. 2 kv heads over tensor=4): those replicate."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = []
        for axis in axes_tuple:
            size = math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]
            if dim % size == 0:
                kept.append(axis)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def variable_sharding(var: nnx.Variable, mesh: Mesh, rules=LOGICAL_RULES) -> NamedSharding:
    names = var.get_metadata().get("out_sharding")
    return NamedSharding(mesh, spec_for_shape(var.shape, logical_to_spec(names, rules), mesh))


def param_shardings(model_or_state, mesh: Mesh, rules=LOGICAL_RULES):
    """NamedShardings with the structure of nnx.state(model) (Variables holding shardings, like
    nnx.get_named_sharding), usable as jit in/out_shardings for that state. Works on abstract states."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    return jax.tree.map(lambda v: v.replace(variable_sharding(v, mesh, rules)), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=LOGICAL_RULES) -> nnx.Module:
    """Move every variable of `model` onto its NamedSharding (in place); returns the model."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh, rules)
    nnx.update(model, jax.device_put(state, shardings))
    return model


def batch_sharding(mesh: Mesh, ndim: int | None = None, *, axis: int = 0) -> NamedSharding:
    """Leading (batch) dimension over ('data', 'fsdp'), the rest replicated; `axis`: the batch dimension where it
    is not the first (given ndim). Without ndim the spec names the leading dimension only: a prefix that fits a
    batch leaf of any rank."""
    batch = logical_to_spec(["batch"])[0]
    if ndim is None:
        return NamedSharding(mesh, PartitionSpec(batch))
    return NamedSharding(mesh, PartitionSpec(*([None] * axis), batch, *([None] * (ndim - axis - 1))))


def residual_sharding(*, sequence_parallel: bool, rules=LOGICAL_RULES) -> tuple:
    """LlamaConfig.residual_sharding for these rules: the [B, T, D] residual stream with its batch over
    ('data', 'fsdp') and, sequence parallel, its tokens over 'tensor' (the layer inputs that remat saves then
    take 1/tensor of the memory: 20 GiB per 16384-token sequence for Llama-3.1-70B otherwise)."""
    return tuple(logical_to_spec(("batch", "sequence" if sequence_parallel else None, None), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(opt_state_shapes, params_shardings, mesh: Mesh):
    """Shardings for an optimiser state: a leaf whose tree path ends with a parameter's path (Adam's mu/nu
    mirror the params) and has that parameter's rank takes its sharding; everything else (counts, scalars)
    is replicated."""
    by_path = {}
    for path, sharding in jax.tree_util.tree_flatten_with_path(
            params_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]:
        by_path[_path_keys(path)] = sharding

    def for_leaf(path, leaf):
        keys = _path_keys(path)
        ndim = len(getattr(leaf, "shape", ()))
        for start in range(len(keys)):
            sharding = by_path.get(keys[start:])
            if sharding is not None and len(sharding.spec) <= ndim and ndim > 0:
                return sharding
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(for_leaf, opt_state_shapes)


def _path_keys(path) -> tuple:
    keys = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if key in ("value", "raw_value"):  # Variable wrappers
            continue
        keys.append(str(key))
    return tuple(keys)


# ----------------------------------------------------------------------------------------------------------
# Multi-host
# ----------------------------------------------------------------------------------------------------------

def initialize_distributed(**kwargs) -> bool:
    """jax.distributed.initialize() when this looks like one process of several (JAX_NUM_PROCESSES > 1 with
    JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID, a TPU pod slice with several hosts, an explicit coordinator,
    SLURM / Open MPI with >1 task); a no-op otherwise.
    Call before any other JAX work. Returns whether distributed mode was initialised."""
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    num = int(env.get("JAX_NUM_PROCESSES", "1") or 1)
    if num > 1 and not kwargs:  # explicit: JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (any machines)
        if env.get("JAX_PLATFORMS", "").startswith("cpu"):
            # CPU cross-process collectives need an implementation; gloo ships with jaxlib.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=num,
                                   process_id=int(env["JAX_PROCESS_ID"]))
        return True
    multi_host_tpu = "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env
    multi_task = any(int(env.get(k, "1") or 1) > 1 for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if not (kwargs or multi_host_tpu or multi_task or "JAX_COORDINATOR_ADDRESS" in env):
        return False
    jax.distributed.initialize(**kwargs)
    return True
