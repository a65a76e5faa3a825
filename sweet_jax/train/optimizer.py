"""The optimiser of every training run: AdamW with warm-up and cosine decay (make_optimizer, from config.optim), its
moments optionally stored in bfloat16, and the layer-wise update that applies it one stacked layer at a time (the
optimiser state of a scanned model offloaded to host memory, each layer's slice brought to the device in turn)."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sweet_jax.config_utils import setting, train_default
from sweet_jax.errors import SweetJaxError

HOST_MEMORY = "pinned_host"


class StepConfigError(SweetJaxError):
    """A step factory got options that cannot work (unknown kind, batch not divisible into micro-batches)."""


def make_schedule(lr: float, total_steps: int, *, warmup_ratio: float = train_default("optim.warmup_ratio"),
                  final_ratio: float = train_default("optim.final_ratio")) -> optax.Schedule:
    """Linear warm-up over warmup_ratio of the steps, then cosine down to final_ratio * lr (official trainer)."""
    total_steps = max(int(total_steps), 1)
    warmup = min(int(math.ceil(warmup_ratio * total_steps)), total_steps - 1)
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warmup,
                                              decay_steps=total_steps, end_value=final_ratio * lr)


MOMENTS_DTYPES = ("float32", "bfloat16")


class LayerwiseOptimizer(NamedTuple):
    """clip_by_global_norm(clip) then `inner`, an optax transformation that is elementwise per parameter (AdamW on
    a schedule). Used as a plain optax transformation (init / update) it is exactly that chain; the train step
    (`_apply_grads`) instead runs `inner` on the stacked decoder layers of a scan_layers model one layer at a time
    (`layerwise_update`), so the update's working set, and an offloaded optimiser state's trip to the device,
    is one layer's instead of the whole stack's. The state is the chain's: checkpoints do not change."""
    init: Callable
    update: Callable
    clip: float
    inner: optax.GradientTransformation


def make_optimizer(lr: float, total_steps: int, *, warmup_ratio: float = train_default("optim.warmup_ratio"),
                   final_ratio: float = train_default("optim.final_ratio"), b1: float = train_default("optim.b1"),
                   b2: float = train_default("optim.b2"), weight_decay: float = train_default("optim.weight_decay"),
                   clip: float = train_default("optim.clip"), moments_dtype: str = train_default("optim.moments_dtype"),
                   layerwise: bool = train_default("optim.layerwise_update")) -> optax.GradientTransformation:
    """clip_by_global_norm(clip) then AdamW on the warm-up + cosine schedule.

    moments_dtype 'bfloat16' stores both Adam moments in bfloat16 (half the optimiser state: 4 instead of 8 bytes
    per parameter); they are updated in float32 and rounded once per step (`_moments_stored_in`; optax's own
    mu_dtype covers the first moment only, and computes b1 * mu in bfloat16).
    layerwise: a LayerwiseOptimizer (the same update, stacked layers one at a time in the train step)."""
    if moments_dtype not in MOMENTS_DTYPES:
        raise StepConfigError(f"optim.moments_dtype={moments_dtype!r} is not one of {MOMENTS_DTYPES}.")
    schedule = make_schedule(lr, total_steps, warmup_ratio=warmup_ratio, final_ratio=final_ratio)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    if moments_dtype != "float32":
        adamw = _moments_stored_in(jnp.dtype(moments_dtype), adamw)
    chain = optax.chain(optax.clip_by_global_norm(clip), adamw)
    if layerwise:
        return LayerwiseOptimizer(chain.init, chain.update, float(clip), adamw)
    return chain


def _moments_stored_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with the moments (mu, nu) of every optax.ScaleByAdamState in it stored in `dtype`: read back as
    float32 for the update, rounded after it (this step's update uses the unrounded values, as optax's mu_dtype
    does). Elementwise, so XLA fuses the casts into the update (no float32 copy of the whole state). bfloat16 keeps
    8 significant bits: with b2 = 0.95 each step's (1 - b2) g^2 term is well above the rounding of nu; with b2
    close to 1 (0.999) small increments would round away."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731

    def cast(state, to):
        # (not every leaf is an array: optax.tree_utils.tree_map_params inits with a placeholder tree)
        as_ = lambda tree: jax.tree.map(lambda v: v.astype(to) if hasattr(v, "astype") else v, tree)  # noqa: E731
        return jax.tree.map(lambda s: s._replace(mu=as_(s.mu), nu=as_(s.nu)) if is_adam(s) else s, state,
                            is_leaf=is_adam)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def optimizer_from_config(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, lr schedule) from the config's `optim` section."""
    kw = dict(warmup_ratio=optim.warmup_ratio, final_ratio=optim.final_ratio)
    return (make_optimizer(optim.lr, total_steps, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay,
                           clip=optim.clip, moments_dtype=setting(optim, "moments_dtype", "optim"),
                           layerwise=setting(optim, "layerwise_update", "optim"), **kw),
            make_schedule(optim.lr, total_steps, **kw))


def stacked_layer_mask(params):
    """True for the leaves of a scan_layers model's stacked decoder layers (path 'layers' then a name, leading
    axis = layer), False elsewhere (embeddings, final norm, and per-layer modules: 'layers' then an index)."""
    def stacked(path, _):
        return (len(path) > 1 and getattr(path[0], "key", None) == "layers"
                and not isinstance(getattr(path[1], "key", getattr(path[1], "idx", 0)), int))
    return jax.tree_util.tree_map_with_path(stacked, params)


def _slice_sharding(sharding, memory_kind):
    """The sharding of one layer of a stacked leaf (its leading layer axis dropped), in memory_kind."""
    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]), memory_kind=memory_kind)


def layerwise_update(optimizer: LayerwiseOptimizer, grads, opt_state, params, opt_device_sh=None):
    """(new params, new optimiser state) of optimizer's chain, with its elementwise part run over the stacked
    decoder layers one layer at a time (jax.lax.map): the global-norm clip sees every gradient, then the other
    parameters are updated at once and each layer's slices of gradients, moments and weights are updated and
    written back in turn. opt_device_sh (an offloaded state's device shardings): every other leaf comes to the
    device whole, a stacked leaf one layer at a time, and goes back to host memory the same way."""
    clip_state, inner_state = opt_state
    grads, clip_state = optax.clip_by_global_norm(optimizer.clip).update(grads, clip_state)
    mask = stacked_layer_mask(grads)
    # Each leaf of the inner state: a copy of a stacked parameter, of another parameter, or neither (a count).
    kinds = optax.tree_utils.tree_map_params(optimizer.inner, lambda _, m: "stacked" if m else "param",
                                             inner_state, mask, transform_non_params=lambda _: "other")
    offloaded = opt_device_sh is not None
    device_sh = opt_device_sh[1] if offloaded else jax.tree.map(lambda _: None, inner_state)
    empty = lambda x: jnp.zeros((0,), x.dtype)  # noqa: E731 - a leaf the pass leaves alone
    # Offloaded stacked matrices travel a layer at a time; stacked vectors (norm scales: [L, D]) come over whole
    # (a few KiB a layer, and the TPU compiler cannot slice one row of a packed bf16 host array).
    streamed = jax.tree.map(lambda x, kind: offloaded and kind == "stacked" and x.ndim >= 3, inner_state, kinds)
    if offloaded:  # every leaf but the streamed ones comes to the device whole
        inner_state = jax.tree.map(lambda x, sh, st: x if st or sh is None else jax.device_put(x, sh),
                                   inner_state, device_sh, streamed)

    # The other parameters, at once.
    rest_state = jax.tree.map(lambda x, kind: empty(x) if kind == "stacked" else x, inner_state, kinds)
    not_stacked = lambda tree: jax.tree.map(lambda x, m: empty(x) if m else x, tree, mask)  # noqa: E731
    rest_updates, rest_state = optimizer.inner.update(not_stacked(grads), rest_state, not_stacked(params))
    rest_params = optax.apply_updates(not_stacked(params), rest_updates)

    # The stacked layers, one at a time.
    num_layers = next(x.shape[0] for x, m in zip(jax.tree.leaves(grads), jax.tree.leaves(mask)) if m)

    def one_layer(i):
        take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
        only_stacked = lambda tree: jax.tree.map(lambda x, m: take(x) if m else empty(x), tree, mask)  # noqa: E731

        def state_leaf(x, kind, sh, st):
            if kind == "other":
                return x
            if kind == "param":
                return empty(x)
            return jax.device_put(take(x), _slice_sharding(sh, "device")) if st else take(x)
        layer_state = jax.tree.map(state_leaf, inner_state, kinds, device_sh, streamed)
        p = only_stacked(params)
        updates, layer_state = optimizer.inner.update(only_stacked(grads), layer_state, p)
        # each layer's streamed moments back to host memory as they are made
        layer_state = jax.tree.map(lambda x, sh, st: jax.device_put(x, _slice_sharding(sh, HOST_MEMORY)) if st else x,
                                   layer_state, device_sh, streamed)
        return optax.apply_updates(p, updates), layer_state

    stacked_params, stacked_state = jax.lax.map(one_layer, jnp.arange(num_layers))
    new_params = jax.tree.map(lambda m, a, b: b if m else a, mask, rest_params, stacked_params)
    new_inner = jax.tree.map(lambda kind, a, b: b if kind == "stacked" else a, kinds, rest_state, stacked_state)
    return new_params, (clip_state, new_inner)
