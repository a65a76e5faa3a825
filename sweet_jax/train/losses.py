"""SWEET-RL losses as pure jnp functions: label log-probs, per-turn advantages, Bradley-Terry, DPO + NLL.

No model code here. Every loss takes per-example values plus an optional example `weight_B` (0 = padding
example) and an optional `denom`: the loss and metrics are `sum(weight * value) / denom` with `denom =
sum(weight)` by default. Passing the full batch's denominator to each micro-batch makes micro-batch losses,
metrics and gradients add up exactly to the full-batch ones (gradient accumulation in steps.py).

Shapes: B batch, T tokens, D hidden, V vocabulary, K turns.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sweet_jax.config_utils import ADVANTAGE_NORMS
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import cpu_matmul

NLL_SCOPES = ("reply", "sequence")


class LossConfigError(SweetJaxError):
    """A loss was called with an invalid option (unknown advantage_norm, missing num_turns, bad chunk)."""


def _at_least_f32(x):
    # Upcast bf16 log-probs for the reductions; keep float64 when a caller runs in x64 (gradient checks).
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ---------------------------------------------------------------------------------------------------------
# Label log-probs


def token_logprobs_naive(logits_BTV: jax.Array, input_ids_BT: jax.Array) -> jax.Array:
    """logp_BT[:, t] = log p(input_ids[:, t] | logits at t-1); logp_BT[:, 0] = 0. Materialises everything."""
    logits = _at_least_f32(logits_BTV[:, :-1])
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, input_ids_BT[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(logp, ((0, 0), (1, 0)))


def _chunk_logits(hidden_BCD, unembed_DV):
    bf16 = cpu_matmul.unembedding_backend()
    if bf16:  # bf16 operands, float32 logits (model.cpu_matmul)
        return cpu_matmul.contract(hidden_BCD, unembed_DV, 1, bf16)
    acc_dtype = jnp.promote_types(hidden_BCD.dtype, jnp.float32)
    return jnp.einsum("bcd,dv->bcv", hidden_BCD, unembed_DV, preferred_element_type=acc_dtype)


def _is_label_BCV(labels_BC, shape):
    # A comparison with an iota instead of a gather keeps a vocab-sharded logits tensor sharded (no all-gather).
    return jax.lax.broadcasted_iota(jnp.int32, shape, 2) == labels_BC[..., None]


def _chunk_label_logprobs(hidden_BCD, labels_BC, unembed_DV):
    """Label log-probs of one chunk (float32 [B, C, V] logits for this chunk only) -> [B, C]; plain autodiff."""
    return _label_logprobs_fwd(hidden_BCD, labels_BC, unembed_DV)[0]


@jax.custom_vjp
def _label_logprobs_keep_logits(hidden_BCD, labels_BC, unembed_DV):
    """`_chunk_label_logprobs` whose backward reuses the forward's logits in one fused pass."""
    return _chunk_label_logprobs(hidden_BCD, labels_BC, unembed_DV)


def _label_logprobs_fwd(hidden_BCD, labels_BC, unembed_DV):
    logits_BCV = _chunk_logits(hidden_BCD, unembed_DV)
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    label_logit_BC = jnp.sum(jnp.where(_is_label_BCV(labels_BC, logits_BCV.shape), logits_BCV, 0.0), axis=-1)
    return label_logit_BC - lse_BC, (hidden_BCD, labels_BC, unembed_DV, lse_BC, logits_BCV)


def _label_logprobs_bwd(residuals, g_BC, grad_dtype=None):
    # d logp / d logits = onehot(label) - softmax(logits): one fused pass over [B, C, V] instead of autodiff's
    # separate logsumexp and masked-sum cotangents plus a transposed copy of them.
    hidden_BCD, labels_BC, unembed_DV, lse_BC, logits_BCV = residuals
    g_BC = g_BC.astype(logits_BCV.dtype)
    dlogits_BCV = g_BC[..., None] * (_is_label_BCV(labels_BC, logits_BCV.shape).astype(logits_BCV.dtype)
                                     - jnp.exp(logits_BCV - lse_BC[..., None]))
    # The two contractions run in the compute dtype with float32 accumulation, like the forward: a float32
    # cotangent against bf16 weights would make XLA upcast the whole [D, V] unembedding and run an f32 matmul.
    # Float32 models are unaffected.
    dlogits_BCV = dlogits_BCV.astype(hidden_BCD.dtype)
    acc = logits_BCV.dtype
    d_hidden = jax.lax.dot_general(dlogits_BCV, unembed_DV, (((2,), (1,)), ((), ())), preferred_element_type=acc)
    d_unembed = jax.lax.dot_general(hidden_BCD, dlogits_BCV, (((0, 1), (0, 1)), ((), ())),
                                    preferred_element_type=acc)
    return d_hidden.astype(hidden_BCD.dtype), None, d_unembed.astype(grad_dtype or unembed_DV.dtype)


_label_logprobs_keep_logits.defvjp(_label_logprobs_fwd, _label_logprobs_bwd)


def _check_chunk(chunk_size: int) -> None:
    if chunk_size is not None and chunk_size < 1:
        raise LossConfigError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}.")


LOGITS_CHUNK_BYTES = 256 << 20  # float32 logits of one chunk when chunk_size is None: 1,365 positions at V = 49152


def logits_chunk_positions(vocab_size: int, chunk_size: int | None = None) -> int:
    """Positions per chunk of the unembedding: chunk_size, or (None) as many as fit LOGITS_CHUNK_BYTES of float32
    logits, so the transient [chunk, V] block (and its cotangent) stays the same size for any vocabulary."""
    if chunk_size is None:
        return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))
    _check_chunk(chunk_size)
    return chunk_size


def label_logprobs(hidden_BND: jax.Array, unembed_DV: jax.Array, labels_BN: jax.Array, *,
                   chunk_size: int | None = None, unembed_grad_spec=None) -> jax.Array:
    """log softmax(hidden @ unembed)[label] per position -> [B, N] float32, `chunk_size` positions at a time,
    counted over the whole batch (B x N positions; None: LOGITS_CHUNK_BYTES of logits, logits_chunk_positions).

    [B, N, V] float32 logits never exist when B x N > chunk_size: the forward keeps one [chunk, V] block at a
    time, and each chunk is rematerialised in the backward pass (jax.checkpoint), so the scan saves only its
    [chunk, D] inputs. Chunks are cut from the flattened positions, not per sequence: at 16 sequences of 512
    tokens and V = 49152 one 512-token chunk per sequence would be 1.6 GB of logits plus as much again for
    their cotangent. When everything fits in one chunk, remat would save no peak memory, so the logits are
    kept for a fused backward (d logp / d logits = onehot - softmax in one pass; 0.87x the time of a whole CPU
    critic step).

    unembed_grad_spec (a PartitionSpec of the ambient mesh, jax.set_mesh; the unembedding's own sharding): the
    chunked backward accumulates the unembedding's gradient in float32 under that sharding, chunk by chunk
    (`_chunked_label_logprobs`), instead of leaving XLA a whole [D, V] accumulator on every chip (2 GiB for
    Llama-3.1-8B's vocabulary). Each chunk's partial gradient is then reduce-scattered as it is made.
    """
    B, n, D = hidden_BND.shape
    if n == 0:
        return jnp.zeros((B, 0), jnp.float32)
    chunk = logits_chunk_positions(unembed_DV.shape[1], chunk_size)
    total = B * n
    if total <= chunk:
        return _label_logprobs_keep_logits(hidden_BND, labels_BN, unembed_DV)
    num_chunks = -(-total // chunk)
    pad = num_chunks * chunk - total
    # [num_chunks, 1, chunk, ...]: scan over the leading axis, one [1, chunk, D] block per step.
    hidden_N1CD = jnp.pad(hidden_BND.reshape(total, D), ((0, pad), (0, 0))).reshape(num_chunks, 1, chunk, D)
    labels_N1C = jnp.pad(labels_BN.reshape(total), (0, pad)).reshape(num_chunks, 1, chunk)

    if unembed_grad_spec is not None:
        logp_N1C = _chunked_label_logprobs(unembed_grad_spec, hidden_N1CD, labels_N1C, unembed_DV)
    else:
        chunk_fn = jax.checkpoint(_chunk_label_logprobs)

        def body(_, xs):
            h, y = xs
            return None, chunk_fn(h, y, unembed_DV)

        _, logp_N1C = jax.lax.scan(body, None, (hidden_N1CD, labels_N1C))
    return logp_N1C.reshape(num_chunks * chunk)[:total].reshape(B, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_label_logprobs(unembed_grad_spec, hidden_N1CD, labels_N1C, unembed_DV):
    """Label log-probs of [num_chunks, 1, C, D] chunks -> [num_chunks, 1, C]: the scan of `label_logprobs`
    with a hand-written backward that keeps the unembedding's gradient sharded (unembed_grad_spec)."""
    def body(_, xs):
        h, y = xs
        return None, _chunk_label_logprobs(h, y, unembed_DV)

    return jax.lax.scan(body, None, (hidden_N1CD, labels_N1C))[1]


def _chunked_label_logprobs_fwd(unembed_grad_spec, hidden_N1CD, labels_N1C, unembed_DV):
    # Residuals: the inputs only; each chunk's logits are recomputed in the backward (as jax.checkpoint would).
    return (_chunked_label_logprobs(unembed_grad_spec, hidden_N1CD, labels_N1C, unembed_DV),
            (hidden_N1CD, labels_N1C, unembed_DV))


def _chunked_label_logprobs_bwd(unembed_grad_spec, residuals, g_N1C):
    hidden_N1CD, labels_N1C, unembed_DV = residuals
    shard = lambda x: jax.lax.with_sharding_constraint(x, unembed_grad_spec)  # noqa: E731

    def body(d_unembed_DV, xs):
        h, y, g = xs
        d_h, _, d_u = _label_logprobs_bwd(_label_logprobs_fwd(h, y, unembed_DV)[1], g, grad_dtype=jnp.float32)
        # Constrained before the add: each chunk's [D, V] partial sum is reduce-scattered to the shards at once.
        return shard(d_unembed_DV + shard(d_u)), d_h

    init = shard(jnp.zeros(unembed_DV.shape, jnp.float32))
    d_unembed_DV, d_hidden_N1CD = jax.lax.scan(body, init, (hidden_N1CD, labels_N1C, g_N1C))
    return d_hidden_N1CD, None, d_unembed_DV.astype(unembed_DV.dtype)


_chunked_label_logprobs.defvjp(_chunked_label_logprobs_fwd, _chunked_label_logprobs_bwd)


def token_logprobs(hidden_BTD: jax.Array, unembed_DV: jax.Array, input_ids_BT: jax.Array, *,
                   chunk_size: int | None = None, unembed_grad_spec=None) -> jax.Array:
    """Label log-probs of every position from final hidden states: logp_BT[:, t] = log p(input_ids[:, t] |
    hidden at t-1), logp_BT[:, 0] = 0. Same values and gradients as `token_logprobs_naive(hidden @ unembed,
    ids)`, computed by `label_logprobs` (chunked)."""
    logits_chunk_positions(1, chunk_size)  # a bad chunk_size fails here, whatever T is
    B, T, _ = hidden_BTD.shape
    if T <= 1:
        return jnp.zeros((B, T), jnp.float32)
    logp = label_logprobs(hidden_BTD[:, :-1], unembed_DV, input_ids_BT[:, 1:], chunk_size=chunk_size,
                          unembed_grad_spec=unembed_grad_spec)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def token_logprobs_at(hidden_BTD: jax.Array, unembed_DV: jax.Array, input_ids_BT: jax.Array,
                      positions_BS: jax.Array, *, chunk_size: int | None = None,
                      unembed_grad_spec=None) -> jax.Array:
    """`token_logprobs(...)` read at `positions_BS` only ([B, S] int, -1 = padding, which gets 0) -> [B, S].

    The losses need the log-probs of the action tokens alone, so the trainer passes their positions (the
    batch's `score_pos`): the unembedding, the log-softmax over the vocabulary and their backward then run
    on S positions instead of T (the critic's dialogue or the policy's history is mostly not scored).
    Position 0 predicts nothing and gets 0, as in token_logprobs.
    """
    valid_BS = positions_BS > 0
    prev_BS = jnp.maximum(positions_BS - 1, 0)
    hidden_BSD = jnp.take_along_axis(hidden_BTD, prev_BS[..., None], axis=1)
    labels_BS = jnp.take_along_axis(input_ids_BT, jnp.maximum(positions_BS, 0), axis=1)
    logp = label_logprobs(hidden_BSD, unembed_DV, labels_BS, chunk_size=chunk_size,
                          unembed_grad_spec=unembed_grad_spec)
    return jnp.where(valid_BS, logp, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Advantages


def _check_norm(norm: str) -> None:
    if norm not in ADVANTAGE_NORMS:
        raise LossConfigError(
            f"advantage_norm={norm!r} is not one of {ADVANTAGE_NORMS} (config field loss.advantage_norm).")


def turn_advantages(logp_BT: jax.Array, ref_logp_BT: jax.Array, turn_ids_BT: jax.Array, *,
                    num_turns: int, norm: str) -> jax.Array:
    """Per-turn advantages A_k = f(sum over turn k's tokens of (logp - ref_logp)) -> [B, num_turns].

    turn_ids: 0 = not an action token, k = k-th assistant turn (ids above num_turns are ignored).
    norm: 'turn_mean' divides by the turn's token count L_k (the paper), 'trajectory_mean' by the total
    number of action tokens (so the turns sum to the official code's trajectory mean), 'sum' not at all.
    Turns that do not occur get 0.
    """
    _check_norm(norm)
    delta_BT = _at_least_f32(logp_BT - ref_logp_BT)
    turn_BTK = (turn_ids_BT[..., None] == jnp.arange(1, num_turns + 1, dtype=turn_ids_BT.dtype))
    turn_BTK = turn_BTK.astype(delta_BT.dtype)
    sum_BK = jnp.einsum("bt,btk->bk", delta_BT, turn_BTK)
    if norm == "sum":
        return sum_BK
    if norm == "turn_mean":
        count_BK = turn_BTK.sum(axis=1)
        return sum_BK / jnp.maximum(count_BK, 1.0)
    count_B = (turn_ids_BT > 0).astype(jnp.float32).sum(axis=1)
    return sum_BK / jnp.maximum(count_B, 1.0)[:, None]


def trajectory_advantage(logp_BT: jax.Array, ref_logp_BT: jax.Array, turn_ids_BT: jax.Array, *,
                         norm: str, num_turns: int | None = None) -> jax.Array:
    """The critic's trajectory score S = sum_t A(o_t, a_t, c) -> [B].

    Needs no bound on the number of turns: per-turn sums are a segment sum keyed by (row, turn id).
    `num_turns`, if given, only drops turns above it (as turn_advantages does).
    """
    _check_norm(norm)
    mask_BT = turn_ids_BT > 0
    if num_turns is not None:
        mask_BT &= turn_ids_BT <= num_turns
    delta_BT = jnp.where(mask_BT, _at_least_f32(logp_BT - ref_logp_BT), 0.0)
    if norm == "sum":
        return delta_BT.sum(axis=1)
    if norm == "trajectory_mean":
        return delta_BT.sum(axis=1) / jnp.maximum(mask_BT.sum(axis=1).astype(delta_BT.dtype), 1.0)
    # turn_mean: every token weighs 1 / (its turn's length); a turn id is < T+1, so (row, id) -> row*(T+1)+id.
    B, T = turn_ids_BT.shape
    segment_BT = jnp.where(mask_BT, turn_ids_BT, 0) + (T + 1) * jnp.arange(B, dtype=turn_ids_BT.dtype)[:, None]
    counts = jax.ops.segment_sum(mask_BT.astype(delta_BT.dtype).ravel(), segment_BT.ravel(),
                                 num_segments=B * (T + 1))
    length_BT = counts[segment_BT]
    return jnp.sum(delta_BT / jnp.maximum(length_BT, 1.0), axis=1)


def reply_logprobs(logp_BT: jax.Array, turn_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of log-probs over action tokens [B], number of action tokens [B]) — DPO's sequence log-prob."""
    mask = turn_ids_BT > 0
    return (jnp.where(mask, _at_least_f32(logp_BT), 0.0).sum(axis=1),
            mask.astype(jnp.float32).sum(axis=1))


def sequence_nll(logp_BT: jax.Array, attention_mask_BT: jax.Array) -> jax.Array:
    """Mean NLL per token over the whole sequence, prompt included -> [B]: every real token but the first (it
    has no prediction). The official DPO trainer's NLL term (loss.nll_scope='sequence')."""
    mask_BT = attention_mask_BT > 0
    mask_BT &= jnp.cumsum(mask_BT, axis=1) > 1  # drop each row's first real token (left or right padding)
    mask_BT = mask_BT.astype(jnp.float32)
    return -jnp.sum(mask_BT * _at_least_f32(logp_BT), axis=1) / jnp.maximum(mask_BT.sum(axis=1), 1.0)


# ---------------------------------------------------------------------------------------------------------
# Losses


def _weights(n: int, weight_B, denom):
    w = jnp.ones((n,), jnp.float32) if weight_B is None else weight_B.astype(jnp.float32)
    d = jnp.maximum(w.sum(), 1e-8) if denom is None else denom
    return w, d


def bt_loss(score_chosen_B: jax.Array, score_rejected_B: jax.Array, *, beta: float,
            weight_B: jax.Array | None = None, denom=None) -> tuple[jax.Array, dict]:
    """Bradley-Terry critic loss J = -log sigmoid(beta * S+ - beta * S-), averaged over real pairs."""
    w, d = _weights(score_chosen_B.shape[0], weight_B, denom)
    margin = score_chosen_B - score_rejected_B
    per_pair = -jax.nn.log_sigmoid(beta * margin)
    mean = lambda x: jnp.sum(w * x) / d  # noqa: E731
    loss = mean(per_pair)
    metrics = {
        "loss": loss,
        "accuracy": mean((margin > 0).astype(jnp.float32)),
        "margin": mean(margin),
        "chosen_score": mean(score_chosen_B),
        "rejected_score": mean(score_rejected_B),
    }
    return loss, metrics


def dpo_loss(logp_chosen_B: jax.Array, logp_rejected_B: jax.Array, ref_logp_chosen_B: jax.Array,
             ref_logp_rejected_B: jax.Array, *, beta: float, label_smoothing: float = 0.0,
             chosen_nll_B: jax.Array | None = None, nll_coef: float = 0.0,
             weight_B: jax.Array | None = None, denom=None) -> tuple[jax.Array, dict]:
    """DPO on summed reply log-probs, plus nll_coef x the chosen reply's per-token NLL.

    logp_*: log-probs summed over the reply tokens only. chosen_nll_B: the chosen reply's mean NLL per
    token (needed when nll_coef > 0). label_smoothing eps gives the conservative DPO loss
    -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    """
    if nll_coef and chosen_nll_B is None:
        raise LossConfigError("dpo_loss: nll_coef > 0 needs chosen_nll_B (per-token NLL of the chosen reply).")
    w, d = _weights(logp_chosen_B.shape[0], weight_B, denom)
    chosen_reward = beta * (logp_chosen_B - ref_logp_chosen_B)
    rejected_reward = beta * (logp_rejected_B - ref_logp_rejected_B)
    h = chosen_reward - rejected_reward
    dpo = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)
    nll = jnp.zeros_like(dpo) if chosen_nll_B is None else chosen_nll_B
    mean = lambda x: jnp.sum(w * x) / d  # noqa: E731
    loss = mean(dpo + nll_coef * nll)
    metrics = {
        "loss": loss,
        "dpo_loss": mean(dpo),
        "nll": mean(nll),
        "accuracy": mean((h > 0).astype(jnp.float32)),
        "margin": mean(h),
        "chosen_score": mean(chosen_reward),
        "rejected_score": mean(rejected_reward),
        # the policy's own summed log-probs: DPO can widen the margin while both fall (likelihood displacement)
        "chosen_logp": mean(logp_chosen_B),
        "rejected_logp": mean(logp_rejected_B),
    }
    return loss, metrics


def sft_loss(logp_BT: jax.Array, turn_ids_BT: jax.Array, *, weight_B: jax.Array | None = None,
             denom=None) -> tuple[jax.Array, dict]:
    """Rejection fine-tuning: NLL per action token, averaged over all action tokens of the real examples.

    The default denom is the number of action tokens of real examples (pass the full batch's count when
    summing micro-batches).
    """
    w = jnp.ones(logp_BT.shape[:1], jnp.float32) if weight_B is None else weight_B.astype(jnp.float32)
    mask_BT = (turn_ids_BT > 0).astype(jnp.float32) * w[:, None]
    d = jnp.maximum(mask_BT.sum(), 1.0) if denom is None else denom
    loss = -jnp.sum(mask_BT * _at_least_f32(logp_BT)) / d
    return loss, {"loss": loss, "nll": loss}
