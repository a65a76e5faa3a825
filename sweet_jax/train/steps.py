"""Jitted SWEET-RL training steps: critic (Bradley-Terry), policy (DPO + NLL, trajectory DPO, SFT), scoring.

Each factory returns a function compiled once per batch shape with explicit in/out shardings; the train
state is donated so parameters and optimiser moments are updated in place. Steps are pure: (state, batch)
-> (new_state, metrics), metrics being float32 scalars.

Reference log-probs come from the frozen reference model. By default they are computed once, before
training, by `make_ref_logp_fn` and stored in batch['ref_logp']: the step then runs one model instead of
two (half the FLOPs and activation memory). `ref_in_step=True` instead passes the reference parameters to
the step and computes them under stop_gradient.

Batches are dicts of [B, P, T] arrays (P = 2 for chosen/rejected pairs, 1 for SFT), see CONTRACTS.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from sweet_jax import sharding
from sweet_jax.config_utils import setting, train_default
from sweet_jax.data import batching
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import cpu_matmul
from sweet_jax.train import losses
from sweet_jax.train.optimizer import (HOST_MEMORY, LayerwiseOptimizer, StepConfigError, layerwise_update,
                                       stacked_layer_mask)

POLICY_KINDS = ("dpo", "mtdpo", "sft", "rft")
LOSS_SPEC_KINDS = ("critic", "dpo", "mtdpo", "sft")  # rft trains with the sft loss
BATCH_AXES = ("data", "fsdp")


# ---------------------------------------------------------------------------------------------------------
# Optimiser


# ---------------------------------------------------------------------------------------------------------
# Train state


@struct.dataclass
class TrainState:
    """What one optimiser step reads and writes. The model is nnx.merge(graphdef, params, rest)."""
    graphdef: Any = struct.field(pytree_node=False)
    params: Any       # nnx.State of the trained nnx.Param variables
    opt_state: Any    # optax state, sharded like params
    step: jax.Array   # int32 scalar: optimiser steps taken
    rest: Any         # nnx.State of non-parameter variables (usually empty)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.rest)


def _sharding_module():
    return sharding


def state_shardings(graphdef, params, rest, optimizer, mesh, *, offload_opt_state: bool = False) -> TrainState:
    """NamedShardings for every leaf of the train state (params and the frozen rest, e.g. a LoRA run's base
    weights, by the logical rules; moments like params).

    offload_opt_state: the optimiser state lives in host memory (memory kind 'pinned_host', where the devices
    have it: TPU, GPU, and the CPU backend, where it is the same RAM); the step brings it to the device for the
    update and writes it back (`_train_step`), so it takes no HBM between steps."""
    sh = _sharding_module()
    params_sh = sh.param_shardings(params, mesh)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_sh = sh.opt_state_shardings(opt_shapes, params_sh, mesh)
    if offload_opt_state and _has_host_memory(mesh):
        # Matrices only: the norms' vectors and the step counts are a few KiB, and the TPU compiler does not
        # update such small host arrays in place ("Lane slice updating is not supported").
        opt_sh = jax.tree.map(lambda s, x: s.with_memory_kind(HOST_MEMORY) if x.ndim >= 2 else s, opt_sh, opt_shapes)
    repl = NamedSharding(mesh, PartitionSpec())
    return TrainState(graphdef=graphdef, params=params_sh, opt_state=opt_sh, step=repl,
                      rest=sh.param_shardings(rest, mesh))


def _has_host_memory(mesh) -> bool:
    device = mesh.devices.flat[0]
    try:
        return any(m.kind == HOST_MEMORY for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - abstract devices of a compile-only topology list no memories
        return device.platform == "tpu"


def create_train_state(model: nnx.Module, optimizer: optax.GradientTransformation,
                       mesh: jax.sharding.Mesh | None = None, *, trainable=nnx.Param,
                       offload_opt_state: bool = False) -> TrainState:
    """Split the model, place params (and freshly initialised optimiser moments) on their shardings.
    trainable: the variables that are trained and held by the optimiser (nnx.LoRAParam: LoRA's adapters only;
    the rest, frozen, is in state.rest). offload_opt_state: the moments in host memory, see state_shardings."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    if mesh is None:
        return TrainState(graphdef=graphdef, params=params, opt_state=optimizer.init(params),
                          step=jnp.zeros((), jnp.int32), rest=rest)
    shardings = state_shardings(graphdef, params, rest, optimizer, mesh, offload_opt_state=offload_opt_state)
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(graphdef=graphdef, params=params, opt_state=opt_state, step=step,
                      rest=jax.device_put(rest, shardings.rest))


def abstract_train_state(model_fn: Callable[[], nnx.Module], optimizer: optax.GradientTransformation,
                         mesh: jax.sharding.Mesh, *, trainable=nnx.Param,
                         offload_opt_state: bool = False) -> TrainState:
    """The train state as sharded jax.ShapeDtypeStructs, without allocating anything (for AOT compiles)."""
    abstract_model = nnx.eval_shape(model_fn)
    graphdef, params, rest = nnx.split(abstract_model, trainable, ...)
    shardings = state_shardings(graphdef, params, rest, optimizer, mesh, offload_opt_state=offload_opt_state)
    opt_shapes = jax.eval_shape(optimizer.init, params)

    def sds(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return TrainState(
        graphdef=graphdef, params=jax.tree.map(sds, params, shardings.params),
        opt_state=jax.tree.map(sds, opt_shapes, shardings.opt_state),
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step),
        rest=jax.tree.map(sds, rest, shardings.rest))


def shardings_of(tree):
    """The .sharding of every leaf: works on placed arrays and on sharded ShapeDtypeStructs alike."""
    return jax.tree.map(lambda x: x.sharding, tree)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (example) dimension over ('data', 'fsdp'), the rest replicated; a prefix for any batch leaf."""
    return sharding.batch_sharding(mesh)


# ---------------------------------------------------------------------------------------------------------
# Forward pieces


def sequence_logprobs(graphdef, params, rest, input_ids_NT, attention_mask_NT, *, chunk_size: int | None,
                      positions_NS=None, temperature: float = 1.0):
    """Per-token label log-probs [N, T] float32 from the model's hidden states (chunked unembedding); with
    positions_NS [N, S] (-1 = padding), only at those positions: [N, S] (losses.token_logprobs_at).
    temperature: log softmax(logits / temperature) (the official ranking reads vLLM's at 0.5).
    Under a mesh the chunked backward keeps the unembedding's gradient sharded like the unembedding
    (unembed_grad_spec; losses.label_logprobs)."""
    model = nnx.merge(graphdef, params, rest)
    with cpu_matmul.unembedding(model.config.matmul):
        return _sequence_logprobs(model, input_ids_NT, attention_mask_NT, chunk_size=chunk_size,
                                  positions_NS=positions_NS, temperature=temperature)


def _unembedding(model, temperature: float):
    """(the [D, V] unembedding scaled by 1 / temperature, its gradient's PartitionSpec: unembed_grad_spec)."""
    unembed = model.unembedding()
    if temperature != 1.0:
        unembed = unembed / jnp.asarray(temperature, unembed.dtype)  # logits are linear in the unembedding
    return unembed, unembed_grad_spec(unembed.shape)


def _sequence_logprobs(model, input_ids_NT, attention_mask_NT, *, chunk_size, positions_NS, temperature):
    hidden_NTD = model.hidden_states(input_ids_NT, attention_mask_NT)
    unembed, grad_spec = _unembedding(model, temperature)
    if positions_NS is not None:
        return losses.token_logprobs_at(hidden_NTD, unembed, input_ids_NT, positions_NS, chunk_size=chunk_size,
                                        unembed_grad_spec=grad_spec)
    return losses.token_logprobs(hidden_NTD, unembed, input_ids_NT, chunk_size=chunk_size,
                                 unembed_grad_spec=grad_spec)


def unembed_grad_spec(shape_DV):
    """The [D, V] unembedding's PartitionSpec on the ambient mesh (jax.set_mesh: the trainer and the planner
    trace their steps under it), for its gradient in the chunked log-prob backward; None without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sh = _sharding_module()
    return sh.spec_for_shape(shape_DV, sh.logical_to_spec(("embed", "vocab")), mesh)


def _pair_logprobs(graphdef, params, rest, batch, chunk_size, temperature: float = 1.0):
    """Label log-probs [B, P, T]; with batch['score_pos'] [B, P, S] (the action tokens' positions, -1 = padding,
    from BatchIterator(score_positions=True)), only there: [B, P, S], the unembedding run on S positions.
    A packed batch (batching.pack_shared_prefix's arrays beside the [B, P, T] ones) runs one row an example."""
    if "packed_ids" in batch:
        return _packed_pair_logprobs(graphdef, params, rest, batch, chunk_size, temperature)
    B, P, T = batch["input_ids"].shape
    positions = batch.get("score_pos")
    logp = sequence_logprobs(graphdef, params, rest, batch["input_ids"].reshape(B * P, T),
                             batch["attention_mask"].reshape(B * P, T), chunk_size=chunk_size,
                             positions_NS=None if positions is None else positions.reshape(B * P, -1),
                             temperature=temperature)
    return logp.reshape(B, P, -1)


def _packed_pair_logprobs(graphdef, params, rest, batch, chunk_size, temperature: float = 1.0):
    """`_pair_logprobs` of a packed batch: one forward over each example's row (its P sequences behind their
    shared prefix, batching.pack_shared_prefix). Sequence p's log-prob at position t is its label token t read
    from the hidden state of its token t - 1, wherever the row holds that token; the attention's segments keep
    every sequence from seeing another's tokens, so the values are those of the P rows run side by side."""
    model = nnx.merge(graphdef, params, rest)
    B, P, T = batch["input_ids"].shape
    positions_BPS = batch.get("score_pos")
    if positions_BPS is None:
        positions_BPS = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, P, T))
    S = positions_BPS.shape[-1]
    prev_BPS = jnp.take_along_axis(batch["packed_index"], jnp.maximum(positions_BPS - 1, 0), axis=-1)
    labels_BPS = jnp.take_along_axis(batch["input_ids"], jnp.maximum(positions_BPS, 0), axis=-1)
    with cpu_matmul.unembedding(model.config.matmul):
        hidden_BLD = model.hidden_states(batch["packed_ids"], positions=batch["packed_positions"],
                                         segments=batch["packed_segments"])
        hidden_BXD = jnp.take_along_axis(hidden_BLD, prev_BPS.reshape(B, P * S)[..., None], axis=1)
        unembed, grad_spec = _unembedding(model, temperature)
        logp_BX = losses.label_logprobs(hidden_BXD, unembed, labels_BPS.reshape(B, P * S), chunk_size=chunk_size,
                                        unembed_grad_spec=grad_spec)
    return jnp.where(positions_BPS > 0, logp_BX.reshape(B, P, S), 0.0)  # position 0 predicts nothing


def pair_loss(spec: "LossSpec", graphdef, params, rest, batch, ref_params, denom):
    """(loss, metrics) of one (micro-)batch: the policy's log-probs, the reference's (batch['ref_logp'], or a
    frozen forward of ref_params with no gradient through it), then spec's loss. With batch['score_pos'] every
    per-token array is read at the scored positions; the loss is the same (it sums over action tokens only).
    nll_scope='sequence' needs every position's log-prob, so score_pos is ignored there."""
    if spec.nll_scope == "sequence":
        batch = {k: v for k, v in batch.items() if k != "score_pos"}
    logp = _pair_logprobs(graphdef, params, rest, batch, spec.chunk_size)
    ref = None
    if spec.needs_ref:
        if ref_params is not None:
            ref = jax.lax.stop_gradient(_pair_logprobs(graphdef, ref_params, rest, batch, spec.chunk_size))
        else:
            ref = _at_scored(batch["ref_logp"], batch)
    if "score_pos" in batch:
        batch = dict(batch, turn_ids=jnp.where(batch["score_pos"] >= 0, _at_scored(batch["turn_ids"], batch), 0))
    return spec.loss(logp, ref, batch, denom)


def _at_scored(x_BPT, batch):
    """A per-token array at the batch's scored positions ([B, P, S]; padding reads position 0), or as it is."""
    if "score_pos" not in batch:
        return x_BPT
    return jnp.take_along_axis(x_BPT, jnp.maximum(batch["score_pos"], 0), axis=-1)


def _weight(batch):
    B = batch["input_ids"].shape[0]
    return batch["weight"].astype(jnp.float32) if "weight" in batch else jnp.ones((B,), jnp.float32)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Which loss a step optimises, with its hyper-parameters (static under jit)."""
    kind: str                      # 'critic' | 'dpo' | 'mtdpo' | 'sft'
    beta: float = train_default("loss.beta")              # the other fields' defaults: the train config's
    advantage_norm: str = train_default("loss.advantage_norm")
    nll_coef: float = train_default("loss.nll_coef")
    label_smoothing: float = train_default("loss.label_smoothing")
    chunk_size: int | None = None  # unembedding positions per chunk (losses.label_logprobs; None: by bytes)
    nll_scope: str = train_default("loss.nll_scope")  # reply (the paper) | sequence (official: prompt included)

    def __post_init__(self):
        if self.kind not in LOSS_SPEC_KINDS:
            raise StepConfigError(f"loss kind {self.kind!r} is not one of {LOSS_SPEC_KINDS} (config loss.kind: "
                                  f"critic, {', '.join(POLICY_KINDS)})")
        losses._check_norm(self.advantage_norm)
        if self.nll_scope not in losses.NLL_SCOPES:
            raise StepConfigError(f"loss.nll_scope={self.nll_scope!r} is not one of {losses.NLL_SCOPES}")

    def denominator(self, batch) -> jax.Array:
        """The full batch's normaliser, so micro-batch losses add up to the full-batch loss."""
        w = _weight(batch)
        if self.kind == "sft":
            return jnp.maximum(((batch["turn_ids"][:, 0] > 0) * w[:, None]).sum(), 1.0)
        return jnp.maximum(w.sum(), 1e-8)

    def loss(self, logp_BPT, ref_logp_BPT, batch, denom):
        turn_ids, w = batch["turn_ids"], _weight(batch)
        if self.kind == "sft":
            return losses.sft_loss(logp_BPT[:, 0], turn_ids[:, 0], weight_B=w, denom=denom)
        if self.kind == "critic":
            B, P, T = logp_BPT.shape
            score_BP = losses.trajectory_advantage(
                logp_BPT.reshape(B * P, T), ref_logp_BPT.reshape(B * P, T), turn_ids.reshape(B * P, T),
                norm=self.advantage_norm).reshape(B, P)
            return losses.bt_loss(score_BP[:, 0], score_BP[:, 1], beta=self.beta, weight_B=w, denom=denom)
        # dpo (step-level pairs) and mtdpo (trajectory pairs): the same DPO over all action tokens.
        (chosen, n_chosen), (rejected, _) = (losses.reply_logprobs(logp_BPT[:, i], turn_ids[:, i]) for i in (0, 1))
        (ref_chosen, _), (ref_rejected, _) = (losses.reply_logprobs(ref_logp_BPT[:, i], turn_ids[:, i])
                                              for i in (0, 1))
        if self.nll_scope == "sequence":
            chosen_nll = losses.sequence_nll(logp_BPT[:, 0], batch["attention_mask"][:, 0])
        else:
            chosen_nll = -chosen / jnp.maximum(n_chosen, 1.0)
        return losses.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta,
                               label_smoothing=self.label_smoothing, chosen_nll_B=chosen_nll,
                               nll_coef=self.nll_coef, weight_B=w, denom=denom)

    @property
    def needs_ref(self) -> bool:
        return self.kind != "sft"


def _constrain(x, mesh, spec):
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# What the activations of one micro-batch may take when micro_batch_size is 0 (automatic) on CPU, per device.
ACTIVATION_BUDGET_BYTES = 1 << 30


def activation_bytes_per_token(config) -> int:
    """Bytes a training forward keeps per token for its backward pass (estimate, LlamaConfig `config`): per
    decoder layer the inputs of its norms, projections and SwiGLU (hidden, K/V, [tokens, F] gate and up; the
    attention logits are recomputed, models/llama.py), or with remat only the layer's input."""
    c = config
    itemsize = jnp.dtype(c.dtype).itemsize
    if c.remat != "none":
        return c.num_layers * c.hidden_size * itemsize
    return c.num_layers * (8 * c.hidden_size + 4 * c.num_kv_heads * c.head_dim + 3 * c.intermediate_size) * itemsize


def auto_micro_batch_size(config, batch_shape, *, batch_devices: int = 1, budget_bytes: int | None = None) -> int:
    """The largest micro-batch (examples, a divisor of the batch and a multiple of the batch-sharded devices)
    whose activations (activation_bytes_per_token) fit budget_bytes (default ACTIVATION_BUDGET_BYTES) per
    device; the smallest such one if none fits. batch_shape: [B, P, T] of the step's batch."""
    budget_bytes = ACTIVATION_BUDGET_BYTES if budget_bytes is None else budget_bytes
    B, P, T = batch_shape
    per_example = P * T * activation_bytes_per_token(config)
    fitting = [m for m in range(B, 0, -1) if B % m == 0 and m % batch_devices == 0]
    if not fitting:
        return B
    return next((m for m in fitting if m // batch_devices * per_example <= budget_bytes), fitting[-1])


def _grads_and_metrics(spec: LossSpec, graphdef, params, rest, batch, ref_params, *, micro_batch_size, mesh):
    """Sum of micro-batch gradients and metrics; equal to the full batch's (losses share one denominator).
    micro_batch_size 0: on CPU auto_micro_batch_size for this batch's shape and the model, elsewhere the batch."""
    denom = spec.denominator(batch)

    B = batch["input_ids"].shape[0]
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    if micro_batch_size:
        mb = micro_batch_size
    elif platform == "cpu":  # host memory; an accelerator's batch is sized by its preset (docs/tpu.md)
        batch_devices = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        mb = auto_micro_batch_size(nnx.merge(graphdef, params, rest).config, batch["input_ids"].shape,
                                   batch_devices=batch_devices)
    else:
        mb = B
    if mb >= B:
        return _micro_grads(spec, graphdef, params, rest, batch, ref_params, denom)
    if B % mb:
        raise StepConfigError(f"batch size {B} is not a multiple of train.micro_batch_size={mb}.")
    n = B // mb
    # Micro-batch i takes examples i, i+n, i+2n, ...: with the batch dimension sharded in contiguous blocks,
    # every device then keeps its own examples in every micro-batch (no resharding).
    micro_batches = jax.tree.map(lambda x: x.reshape(mb, n, *x.shape[1:]).swapaxes(0, 1), batch)

    def body(sums, micro):
        micro = jax.tree.map(lambda x: _constrain(x, mesh, PartitionSpec(BATCH_AXES)), micro)
        return _accumulate_grads(spec, graphdef, sums, params, rest, micro, ref_params, denom), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    (grads, metrics), _ = jax.lax.scan(body, _zero_sums(spec, graphdef, params, rest, first, ref_params, denom),
                                       micro_batches)
    return grads, metrics


def _train_step(spec, optimizer, lr_schedule, micro_batch_size, mesh, opt_device_sh, state: TrainState, batch,
                ref_params=None):
    grads, metrics = _grads_and_metrics(spec, state.graphdef, state.params, state.rest, batch, ref_params,
                                        micro_batch_size=micro_batch_size, mesh=mesh)
    metrics = dict(metrics, num_tokens=jnp.sum(batch["attention_mask"].sum(axis=(1, 2)) * _weight(batch)))
    return _apply_grads(optimizer, lr_schedule, opt_device_sh, state, grads, metrics)


def _apply_grads(optimizer, lr_schedule, opt_device_sh, state: TrainState, grads, metrics):
    """The optimiser update of the summed micro-batch gradients; the step's metrics (float32 scalars)."""
    if isinstance(optimizer, LayerwiseOptimizer) and any(jax.tree.leaves(stacked_layer_mask(grads))):
        params, opt_state = layerwise_update(optimizer, grads, state.opt_state, state.params, opt_device_sh)
    else:
        opt_state = state.opt_state
        if opt_device_sh is not None:  # offloaded: to the device for the update; out_shardings put it back
            opt_state = jax.device_put(opt_state, opt_device_sh)
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics)
    metrics["grad_norm"] = optax.tree.norm(grads)
    if lr_schedule is not None:
        metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    return new_state, metrics


def _micro_grads(spec, graphdef, params, rest, micro, ref_params, denom):
    """(gradients, metrics) of one micro-batch; denom is the whole batch's, so micro-batches add up."""
    (_, metrics), grads = jax.value_and_grad(
        lambda p: pair_loss(spec, graphdef, p, rest, micro, ref_params, denom), has_aux=True)(params)
    return grads, metrics


def _accumulate_grads(spec, graphdef, sums, params, rest, micro, ref_params, denom):
    """sums + (gradients, metrics) of one micro-batch: the scan body of the one-program step, HostLoopStep's
    jitted call."""
    grads, metrics = _micro_grads(spec, graphdef, params, rest, micro, ref_params, denom)
    return jax.tree.map(jnp.add, sums[0], grads), jax.tree.map(jnp.add, sums[1], metrics)


def _zero_sums(spec, graphdef, params, rest, micro, ref_params, denom):
    """Zero (gradients, metrics), the start of _accumulate_grads (the metrics' structure from one micro-batch)."""
    metric_shapes = jax.eval_shape(lambda: _micro_grads(spec, graphdef, params, rest, micro, ref_params, denom)[1])
    return jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes)


class HostLoopStep:
    """step(state, batch[, ref_params]) -> (state, metrics) on one CPU device: the micro-batches run one after
    another from the host, each cut to the length of its own longest sequence (rounded up to a multiple of
    `length_multiple`), instead of one program scanning micro-batches all padded to the batch's longest.

    On a CPU host a real model's automatic micro-batches are small (one pair for SmolLM2-135M at 512 tokens,
    auto_micro_batch_size), and the batch's T is the bucket of its longest sequence, so most micro-batches
    would be mostly padding. Examples are grouped by length (a sum of gradients does not depend on the order);
    each micro-batch shape compiles once (T / length_multiple lengths, x 2 with score positions). Loss, metrics
    and gradients equal the one-program step's up to float32 summation order."""

    def __init__(self, spec: LossSpec, optimizer, lr_schedule=None, *, micro_batch_size: int,
                 length_multiple: int, score_positions: bool, share_prefix: bool = True,
                 state: TrainState | None = None, mesh=None):
        self.spec, self.micro_batch_size = spec, micro_batch_size
        self.length_multiple, self.score_positions = length_multiple, score_positions
        self.share_prefix = share_prefix
        self._accumulate = jax.jit(functools.partial(_accumulate_grads, spec), static_argnums=0, donate_argnums=1)
        if mesh is None or state is None:
            self._update = jax.jit(functools.partial(_apply_grads, optimizer, lr_schedule, None), donate_argnums=0)
        else:  # the state keeps its shardings (and an offloaded optimiser state its host memory) across steps
            state_sh = shardings_of(state)
            opt_device_sh = _opt_device_shardings(state_sh)
            self._update = jax.jit(functools.partial(_apply_grads, optimizer, lr_schedule, opt_device_sh),
                                   out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
        self._metric_zeros = None
        self._config = None   # the model's LlamaConfig (auto_micro_batch_size), read at the first call
        self.last_micro_shapes: list[tuple[int, ...]] = []   # [mb, P, T] (packed: [mb, L]) of the last call's
        self.last_run_tokens = 0   # the real tokens the last call's forwards ran (a shared prefix counted once)

    def micro_batches(self, batch: dict, mb: int) -> list[dict]:
        """The batch (host arrays, [B, P, T] per token) as micro-batches of mb examples of similar length, each
        cut to its own length; score_pos recomputed for that length (collate's rule: T/2 positions if they hold
        every sequence's action tokens). With share_prefix, a micro-batch of pairs also carries its packed rows
        (batching.pack_shared_prefix, when they are shorter): the step then runs each pair's prefix once."""
        mask = batch["attention_mask"]
        B, P, T = mask.shape
        lengths_B = mask.sum(axis=-1).max(axis=-1)
        order = np.argsort(lengths_B, kind="stable")
        per_token = [k for k, v in batch.items() if k != "score_pos" and v.ndim == 3 and v.shape[-1] == T]
        out = []
        for first in range(0, B, mb):
            idx = order[first:first + mb]
            cut = batching.real_window(mask[idx], self.length_multiple)
            L = cut.stop - cut.start
            micro = {k: v[idx] for k, v in batch.items() if k != "score_pos" and k not in per_token}
            micro.update({k: batch[k][idx][..., cut] for k in per_token})
            if self.score_positions or "score_pos" in batch:
                most = int((micro["turn_ids"] > 0).sum(axis=-1).max())
                if most <= L // 2:
                    micro["score_pos"] = batching.score_positions(micro["turn_ids"], L // 2)
            if self.share_prefix and P > 1:
                micro.update(batching.pack_shared_prefix(micro["input_ids"], micro["attention_mask"],
                                                         length_multiple=self.length_multiple) or {})
            out.append(micro)
        return out

    def __call__(self, state: TrainState, batch, ref_params=None):
        batch = {k: np.asarray(v) for k, v in batch.items()}
        B = batch["input_ids"].shape[0]
        if self._config is None:
            self._config = state.model().config
        mb = self.micro_batch_size or auto_micro_batch_size(self._config, batch["input_ids"].shape)
        if B % mb:
            raise StepConfigError(f"batch size {B} is not a multiple of train.micro_batch_size={mb}.")
        denom = self.spec.denominator(batch)
        micros = self.micro_batches(batch, mb)
        if self._metric_zeros is None:  # host arrays: each call's sums are donated to the first accumulation
            zeros = _zero_sums(self.spec, state.graphdef, state.params, state.rest, micros[0], ref_params, denom)[1]
            self._metric_zeros = jax.tree.map(np.asarray, zeros)
        sums = (jax.tree.map(jnp.zeros_like, state.params), self._metric_zeros)
        for micro in micros:
            sums = self._accumulate(state.graphdef, sums, state.params, state.rest, micro, ref_params, denom)
        self.last_micro_shapes = [micro.get("packed_ids", micro["input_ids"]).shape for micro in micros]
        self.last_run_tokens = sum(int(np.count_nonzero(micro["packed_segments"])) if "packed_ids" in micro
                                   else int(micro["attention_mask"].sum()) for micro in micros)
        num_tokens = np.float32((batch["attention_mask"].sum(axis=(1, 2)) * _weight(batch)).sum())
        return self._update(state, sums[0], dict(sums[1], num_tokens=num_tokens))


def _opt_device_shardings(state_sh: TrainState):
    """Device-memory shardings for an optimiser state offloaded to host memory (None when it is not): the step
    brings it over for the update and its out_shardings put it back."""
    if not any(s.memory_kind == HOST_MEMORY for s in jax.tree.leaves(state_sh.opt_state)):
        return None
    return jax.tree.map(lambda s: s.with_memory_kind("device"), state_sh.opt_state)


def uses_host_loop(mesh) -> bool:
    """Whether make_step runs micro-batches from the host (HostLoopStep): on a single CPU device."""
    if mesh is None:
        return jax.default_backend() == "cpu"
    return mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"


def loss_spec(loss, *, chunk_size: int | None = None) -> LossSpec:
    """The LossSpec of a training config's `loss` section (kind critic | dpo | mtdpo | rft), validated once:
    what train, plan and the benchmarks build their steps from. chunk_size: unembedding positions per chunk
    (None: by bytes, losses.label_logprobs)."""
    kind = loss.kind
    if kind != "critic" and kind not in POLICY_KINDS:
        raise StepConfigError(f"loss.kind={kind!r} is not one of critic, {', '.join(POLICY_KINDS)}")
    return LossSpec("critic" if kind == "critic" else "sft" if kind == "rft" else kind, beta=float(loss.beta),
                    advantage_norm=loss.advantage_norm, nll_coef=float(loss.nll_coef),
                    label_smoothing=float(loss.label_smoothing), nll_scope=setting(loss, "nll_scope", "loss"),
                    chunk_size=chunk_size)


def make_step(spec: LossSpec, state: TrainState, optimizer, mesh=None, *,
              micro_batch_size: int = train_default("train.micro_batch_size"),
              lr_schedule=None, ref_in_step: bool = False, host_loop: bool | None = None,
              length_multiple: int = train_default("data.bucket"),
              score_positions: bool = train_default("loss.score_positions"),
              share_prefix: bool = train_default("data.share_prefix")):
    """step(state, batch[, ref_params]) -> (state, metrics): one optimiser step on the LossSpec's loss.

    critic: Bradley-Terry over [B, 2, T] trajectory pairs (chosen first); dpo: step-level DPO on [B, 2, T]
    candidate pairs + nll_coef x the chosen NLL (over the reply, or the whole chosen sequence with
    nll_scope='sequence'); mtdpo: the same DPO over all action tokens of trajectory pairs; sft: NLL of the
    action tokens of [B, 1, T] successful trajectories (no reference). batch: input_ids / attention_mask /
    turn_ids, ref_logp [B, P, T] unless ref_in_step (then the reference params are the third argument),
    optional weight [B] and score_pos. `state` may be concrete or abstract (ShapeDtypeStructs): only its
    shardings are read. Metrics: the loss's (loss, accuracy, margin, ...), grad_norm, lr (with lr_schedule),
    num_tokens.

    host_loop (None: uses_host_loop(mesh), i.e. one CPU device): a HostLoopStep, whose micro-batches each run at
    their own length (a multiple of length_multiple; score_positions as the trainer's loss.score_positions;
    share_prefix as data.share_prefix: each pair's sequences as one row, their shared prefix once); else one jitted
    program over the whole batch (what plan.py compiles for a TPU slice)."""
    if host_loop is None:
        host_loop = uses_host_loop(mesh)
    if host_loop:
        return HostLoopStep(spec, optimizer, lr_schedule, micro_batch_size=micro_batch_size,
                            length_multiple=length_multiple, score_positions=score_positions,
                            share_prefix=share_prefix, state=state, mesh=mesh)
    if mesh is None:
        return jax.jit(functools.partial(_train_step, spec, optimizer, lr_schedule, micro_batch_size, mesh, None),
                       donate_argnums=0)
    state_sh = shardings_of(state)
    opt_device_sh = _opt_device_shardings(state_sh)
    fn = functools.partial(_train_step, spec, optimizer, lr_schedule, micro_batch_size, mesh, opt_device_sh)
    in_sh = (state_sh, batch_sharding(mesh)) + ((state_sh.params,) if ref_in_step and spec.needs_ref else ())
    out_sh = (state_sh, NamedSharding(mesh, PartitionSpec()))
    return jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=0)


def make_eval_step(spec: LossSpec, state: TrainState, mesh=None, *, ref_in_step: bool = False):
    """eval_step(rest, params, batch[, ref_params]) -> the LossSpec's metrics (float32 scalars), no gradient: the
    train step's loss on held-out batches. rest: the train state's current non-trained variables (a LoRA run's
    frozen base): an argument, not a closure, since a closed-over array is compiled in as a constant and the train
    step donates the state it was in. `state` may be concrete or abstract: only its shardings are read."""
    graphdef = state.graphdef

    def fn(rest, params, batch, ref_params=None):
        _, metrics = pair_loss(spec, graphdef, params, rest, batch, ref_params, spec.denominator(batch))
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    if mesh is None:
        return jax.jit(fn)
    params_sh = shardings_of(state.params)
    in_sh = ((shardings_of(state.rest), params_sh, batch_sharding(mesh))
             + ((params_sh,) if ref_in_step and spec.needs_ref else ()))
    return jax.jit(fn, in_shardings=in_sh, out_shardings=NamedSharding(mesh, PartitionSpec()))


def make_ref_logp_fn(graphdef, params_shardings=None, mesh=None, *, rest=None, chunk_size: int | None = None):
    """ref_logp(params, batch) -> [B, P, T] float32 label log-probs of the frozen reference model.

    No gradients, nothing donated: call it once per batch before training and store the result in
    batch['ref_logp'].
    """
    rest = nnx.State({}) if rest is None else rest

    # rest (a LoRA run's frozen base) is an argument: a closed-over array would be compiled in as a constant.
    def fn(rest, params, batch):
        return _pair_logprobs(graphdef, params, rest, batch, chunk_size)

    if mesh is None:
        jitted = jax.jit(fn)
    else:
        jitted = jax.jit(fn, in_shardings=(shardings_of(rest), params_shardings, batch_sharding(mesh)),
                         out_shardings=batch_sharding(mesh))
    return lambda params, batch: jitted(rest, params, batch)


def make_packed_logp_fn(graphdef, *, rest=None, temperature: float = 1.0, chunk_size: int | None = None):
    """logp(params, arrays) -> [B, X] float32 label log-probs of sequences packed behind the prefixes they share
    (batching.pack_rows' arrays: ids, segments, positions [B, L]; before, labels [B, X]): label x is read from
    the hidden state at row index before[x], the unembedding run on those X positions only. One device; the
    values are those of each sequence run alone (the attention's segments), up to float rounding."""
    rest = nnx.State({}) if rest is None else rest
    fn = _packed_logp_program(graphdef, temperature, chunk_size)
    return lambda params, arrays: fn(rest, params, arrays)


@functools.lru_cache(maxsize=16)
def _packed_logp_program(graphdef, temperature: float, chunk_size: int | None):
    """make_packed_logp_fn's jitted program, one per (architecture, temperature, chunk size): models of one graph
    (a critic and pi_ref, the reference passes of a pipeline's stages) share its compiled shapes."""

    @jax.jit
    def fn(rest, params, arrays):
        model = nnx.merge(graphdef, params, rest)
        hidden_BLD = model.hidden_states(arrays["ids"], positions=arrays["positions"], segments=arrays["segments"])
        hidden_BXD = jnp.take_along_axis(hidden_BLD, arrays["before"][..., None], axis=1)
        with cpu_matmul.unembedding(model.config.matmul):
            unembed, _ = _unembedding(model, temperature)
            return losses.label_logprobs(hidden_BXD, unembed, arrays["labels"], chunk_size=chunk_size)

    return fn


def make_score_step(graphdef, params_shardings=None, mesh=None, *, num_turns: int = 1,
                    advantage_norm: str = train_default("loss.advantage_norm"), rest=None,
                    chunk_size: int | None = None, ref_in_step: bool = False, temperature: float = 1.0):
    """score(params, batch[, ref_params]) -> per-turn critic advantages [B, P, num_turns] float32.

    For ranking policy candidates (P = 1, the reply has turn id 1): A(o_t, a, c) = mean over the reply's
    tokens of log pi_critic - ref. The reference is batch['ref_logp'] (pi_ref with c, or the sampler's
    log-probs: config rank_reference) or, with ref_in_step, the reference params passed as third argument.
    temperature scales both models' logits (log softmax(logits / temperature)).
    """
    losses._check_norm(advantage_norm)
    rest = nnx.State({}) if rest is None else rest

    def fn(params, batch, ref_params=None):
        B, P, T = batch["input_ids"].shape
        logp = _pair_logprobs(graphdef, params, rest, batch, chunk_size, temperature)
        ref = batch["ref_logp"] if ref_params is None else _pair_logprobs(graphdef, ref_params, rest, batch,
                                                                          chunk_size, temperature)
        adv = losses.turn_advantages(logp.reshape(B * P, T), ref.reshape(B * P, T),
                                     batch["turn_ids"].reshape(B * P, T), num_turns=num_turns,
                                     norm=advantage_norm)
        return adv.reshape(B, P, num_turns)

    if mesh is None:
        return jax.jit(fn)
    in_sh = (params_shardings, batch_sharding(mesh)) + ((params_shardings,) if ref_in_step else ())
    return jax.jit(fn, in_shardings=in_sh, out_shardings=batch_sharding(mesh))
