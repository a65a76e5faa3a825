"""KV-cache sampler: one jitted prefill per prompt batch, then a compiled decode loop.

    sampler = Sampler(model, tokenizer, mesh=None)
    samples = sampler.generate(["def f(x):"], max_new_tokens=64, temperature=1.0, n=4, seed=0)
    samples[0][2].text, .token_ids, .logprobs, .finish_reason

How a batch runs:
1. Prompts are tokenized. A prefix common to all of them (S tokens, a multiple of 16: the system prompt, an
   agent's rules; shared_prefix_length) is set apart; the rest of each prompt is left-padded to a bucketed
   length W (few distinct shapes, few compiles; bucket_prompt). The decode's prompt width P >= S + W is coarser
   (bucket_length: fewer decode programs); the slots between are masked.
2. Prefill (jit): the prompts fill a fresh heads-major cache (keys [B, kv_heads, head_dim, slots], values
   [B, kv_heads, slots, head_dim]; Llama.init_cache) of S + W slots: the shared prefix runs once, on one row, and
   its K/V are copied to every row; the rest runs on all rows, attending to it. The logits of each prompt's
   last token are kept. The prompt rows are then gathered into sample rows (n per prompt), so n samples of
   one prompt share its prefill.
3. Decode (jit, `lax.while_loop`, the cache donated and updated in place): sample a token from the current
   logits, record its log-prob, stop the row on a stop token id or its max_new_tokens, run the model on the
   new token. The loop leaves as soon as every row is done. The new tokens' slots are cut into up to 4
   windows (`decode_windows`): each window is one compiled loop attending over the cache up to its end, the
   cache grown between windows, so a step reads the filled part of the cache rather than all of it. The
   windows are dispatched back to back without a host sync. Stop *strings* need decoded text, so when a
   request has any, the loop also stops every `stop_check_every` tokens and Python checks the text (output
   truncated before the stop string).
4. Compaction: every `compact_every` steps the loop stops and, once the rows still decoding fit a batch of half
   the size or less (a power of two, at least `min_compact_rows`), gathers them into it (_take_rows); the rows
   that ended keep their outputs on the host. A step's time follows its rows, and in an agent's turns most rows
   end long before the longest one (short questions beside long answers). A row's draws depend only on its own
   key and step (fold_in), so it samples the same tokens in the smaller batch; its log-probs agree to float32
   rounding (a matmul over fewer rows may sum in another order).
5. Prompt cache (`prompt_cache_mb`, off by default): after each prefill the prompts' K/V are copied to the host
   (PromptCache, least recently used out). A later prompt that extends a stored one, as a dialogue's next turn
   extends the previous turn's prompt with the reply and the user's answer, starts from it: the stored K/V fill
   the first slots of its row (left-padded, their positions' RoPE already applied) and only the new tokens run
   (_prefill_rows). A batch takes this way when every prompt has a stored prefix and it makes the prefill
   narrower. The samples are those of the whole prefill (log-probs to float rounding).

Where a decode step's time goes (CPU, batch 8, the 24M bench model): reading the weights (64 MB a step, half
of it the unembedding) and the attended K/V; see BENCHMARKS.md "Sampler" for the roofline. Hence: no cache
transpose per step (heads-major layout, keys stored transposed so that Q.K^T is a plain matmul), vocabulary-wide
work limited to one matmul plus max / sum reductions (first_argmax, token_logprob, inverse_cdf_draw: no argmax
reduction, no [N, V] log-softmax or random numbers), and the unembedding split in column blocks that run on
all cores (_split_unembedding, made once per batch).

Log-probs: `Sample.logprobs[i]` is log p_model(token_i | prefix): the log-softmax of the model's raw logits,
i.e. the model's distribution at temperature 1.0 with no top-k / top-p filtering, whatever temperature was
used to *sample*. This is what SWEET-RL's ranking needs (the paper samples at temperature 1.0, where the two
coincide), and it equals a teacher-forced forward pass over prompt + sample.

Per-row sampling settings (temperature, top_p, top_k, max_new_tokens, stop ids, seed) are arrays, so the
server can batch requests with different settings into one compiled call.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from sweet_jax import costs, sharding
from sweet_jax.data.batching import bucket_prompt
from sweet_jax.data.tokenizers import apply_chat_template, check_vocab
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import cpu_matmul, positions_from_mask
from sweet_jax.models.attention import HEADS_MAJOR_CACHE, cache_slot_axis
from sweet_jax.sampling.base import BaseSampler, Sample, mix_seed
from sweet_jax.sharding import batch_sharding, logical_to_spec, spec_for_shape
from sweet_jax.train.model_loading import is_hf_checkpoint, is_training_run, load_model, load_tokenizer_for
from sweet_jax.train.rundir import read_config


class GenerateError(SweetJaxError):
    """Bad input to the sampler (prompt too long, no tokenizer for text prompts, bad sampling setting)."""


# ----------------------------------------------------------------------------------------------------------
# Requests and results
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt. temperature 0 = greedy; top_k 0 and top_p 1.0 = no filtering."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()            # stop strings: output text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()  # added to the model's end-of-sequence ids
    ignore_eos: bool = False              # do not stop on the model's end-of-sequence ids (benchmarks)
    seed: int | None = None               # None: drawn from the sampler's own seeded stream
    top_logprobs: int = 0                 # per token, also the top N alternatives' log-probs (Sample.top_logprobs)

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerateError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if not self.temperature >= 0:
            raise GenerateError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerateError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise GenerateError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if self.n < 1:
            raise GenerateError(f"n (samples per prompt) must be >= 1, got {self.n}.")
        if any(not s for s in self.stop):
            raise GenerateError(f"stop strings must be non-empty, got {list(self.stop)!r}.")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise GenerateError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}.")


MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API; a decode program that reports them keeps this many per token


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams


# ----------------------------------------------------------------------------------------------------------
# Pure pieces (jit-able)
# ----------------------------------------------------------------------------------------------------------

def bucket_length(n: int, minimum: int = 16) -> int:
    """Smallest bucket >= n: powers of two up to 1024, then multiples of 1024 (few shapes, bounded padding)."""
    n = max(int(n), minimum)
    if n <= 1024:
        return 1 << (n - 1).bit_length()
    return -(-n // 1024) * 1024


def shared_prefix_length(prompts: Sequence[Sequence[int]], minimum: int, multiple: int = 16) -> int:
    """Tokens every prompt of a batch starts with, computed once by the prefill (a system prompt, an agent's
    rules): the common prefix rounded down to a multiple of `multiple` (few distinct prompt widths, few
    compiles), leaving each prompt at least one token of its own; 0 (no sharing) below `minimum` tokens, for a
    batch of one distinct prompt (nothing to share), or when minimum <= 0."""
    if minimum <= 0 or len({tuple(p) for p in prompts}) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for other in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], other[:n])) if a != b), n)
    n -= n % multiple
    return n if n >= minimum else 0


def decode_windows(prompt_width: int, new_width: int, *, min_window: int = 64, max_windows: int = 4) -> list[int]:
    """Cache sizes the decode loop steps through as it fills: up to max_windows equal spans of the new tokens
    (each >= min_window tokens), the last one the whole cache. A step attends over its window only, so the
    cache bytes read per step track the filled prefix (a compiled loop per window, a handful per shape)."""
    n = max(1, min(max_windows, new_width // min_window))
    return [prompt_width + -(-new_width * (i + 1) // n) for i in range(n)]


def bucket_rows(n: int, multiple: int = 1) -> int:
    """Batch rows: a power of two, and a multiple of the number of batch shards."""
    rows = 1 << (max(n, 1) - 1).bit_length()
    return -(-rows // multiple) * multiple


def filter_logits(logits_NV: jax.Array, top_p_N: jax.Array, top_k_N: jax.Array) -> jax.Array:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus (ties kept)."""
    V = logits_NV.shape[-1]
    sorted_NV = -jnp.sort(-logits_NV, axis=-1)  # descending
    k_N = jnp.where(top_k_N > 0, jnp.minimum(top_k_N, V), V)
    kth_N = jnp.take_along_axis(sorted_NV, (k_N - 1)[:, None], axis=-1)[:, 0]
    probs_NV = jax.nn.softmax(sorted_NV, axis=-1)
    # Keep a token while the mass strictly before it is < top_p: the nucleus always holds the top token.
    mass_before_NV = jnp.cumsum(probs_NV, axis=-1) - probs_NV
    keep_NV = mass_before_NV < top_p_N[:, None]
    n_keep_N = jnp.maximum(jnp.sum(keep_NV, axis=-1), 1)
    pth_N = jnp.take_along_axis(sorted_NV, (n_keep_N - 1)[:, None], axis=-1)[:, 0]
    threshold_N = jnp.maximum(kth_N, pth_N)
    return jnp.where(logits_NV >= threshold_N[:, None], logits_NV, -jnp.inf)


def first_argmax(x_NV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum), int32, built from a max and a min
    reduction: XLA:CPU vectorises those, not argmax's (value, index) reduction (3 ms of a 11 ms decode step
    over a 32k vocabulary at batch 8)."""
    max_N1 = jnp.max(x_NV, axis=-1, keepdims=True)
    index_NV = jax.lax.broadcasted_iota(jnp.int32, x_NV.shape, x_NV.ndim - 1)
    V = x_NV.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(x_NV == max_N1, index_NV, V), axis=-1), V - 1)  # all-NaN row: V - 1


def _logsumexp(logits_NV: jax.Array) -> jax.Array:
    max_N = jax.lax.stop_gradient(jnp.max(logits_NV, axis=-1))
    return max_N + jnp.log(jnp.sum(jnp.exp(logits_NV - max_N[:, None]), axis=-1))


def token_logprob(logits_NV: jax.Array, token_N: jax.Array) -> jax.Array:
    """log_softmax(logits)[token] without materialising the [N, V] log-softmax."""
    return jnp.take_along_axis(logits_NV, token_N[:, None], axis=-1)[:, 0] - _logsumexp(logits_NV)


def top_logprobs(logits_NV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row and their log_softmax(logits): ids [N, k], log-probs [N, k]."""
    if k == 1:  # the policy engine's logprobs=1: a max reduction, no top-k over the vocabulary
        ids_NK, values_NK = first_argmax(logits_NV)[:, None], jnp.max(logits_NV, axis=-1, keepdims=True)
        return ids_NK, values_NK - _logsumexp(logits_NV)[:, None]
    values_NK, ids_NK = jax.lax.top_k(logits_NV, k)
    return ids_NK.astype(jnp.int32), values_NK - _logsumexp(logits_NV)[:, None]


def sample_tokens(logits_NV: jax.Array, keys_N2: jax.Array, temperature_N: jax.Array, top_p_N: jax.Array,
                  top_k_N: jax.Array) -> jax.Array:
    """One token per row: argmax where temperature == 0, else a draw from softmax(filtered logits / T)."""
    greedy_N = first_argmax(logits_NV)

    def draw():
        scaled_NV = logits_NV / jnp.where(temperature_N > 0, temperature_N, 1.0)[:, None]
        # Sorting the vocabulary is skipped (at run time, one compiled program) when no row filters.
        use_filter = jnp.any(top_k_N > 0) | jnp.any(top_p_N < 1.0)
        scaled_NV = jax.lax.cond(use_filter, filter_logits, lambda x, *_: x, scaled_NV, top_p_N, top_k_N)
        # One uniform per row (in (0, 1): u = 0 could pick a zero-probability token).
        u_N = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32, jnp.finfo(jnp.float32).tiny, 1.0))(
            keys_N2)
        drawn_N = inverse_cdf_draw(scaled_NV, u_N)
        return jnp.where(temperature_N > 0, drawn_N, greedy_N)

    # An all-greedy batch skips the exponentials over the whole vocabulary.
    return jax.lax.cond(jnp.any(temperature_N > 0), draw, lambda: greedy_N)


def inverse_cdf_draw(logits_NV: jax.Array, u_N: jax.Array, *, block: int = 128) -> jax.Array:
    """The token whose softmax(logits) CDF interval holds u, per row: an exact categorical draw from one
    uniform per row. A Gumbel-max draw needs V random numbers per row (threefry over [N, V] was 5 ms a step at
    64 x 4096); here the vocabulary is cut into blocks: one cumsum over the block sums picks the block, a
    cumsum inside that block alone picks the token. -inf logits (filtered out) have zero mass, never drawn."""
    N, V = logits_NV.shape
    n_blocks = -(-V // block)
    weights_NV = jnp.exp(logits_NV - jnp.max(logits_NV, axis=-1, keepdims=True))
    weights_NBC = jnp.pad(weights_NV, ((0, 0), (0, n_blocks * block - V))).reshape(N, n_blocks, block)
    cum_NB = jnp.cumsum(jnp.sum(weights_NBC, axis=-1), axis=-1)
    target_N = u_N * cum_NB[:, -1]
    # The first block whose cumulative mass reaches the target (zero-mass blocks never do first).
    block_N = jnp.minimum(jnp.sum(cum_NB < target_N[:, None], axis=-1), n_blocks - 1)
    before_N = jnp.where(block_N > 0, jnp.take_along_axis(cum_NB, jnp.maximum(block_N - 1, 0)[:, None], -1)[:, 0],
                         0.0)
    cum_NC = jnp.cumsum(jnp.take_along_axis(weights_NBC, block_N[:, None, None], axis=1)[:, 0], axis=-1)
    # Rounding can leave the rest a hair above the block's own total: clamp, so the last real token is taken.
    rest_N = jnp.minimum(target_N - before_N, cum_NC[:, -1])
    index_N = jnp.minimum(jnp.sum(cum_NC < rest_N[:, None], axis=-1), block - 1)
    return (block_N * block + index_N).astype(jnp.int32)


def _last_logits(model, hidden_BTD: jax.Array, unembed_parts=None) -> jax.Array:
    """float32 logits of each row's last position: [B, V] (never [B, T, V]), from the unembedding or from its
    column blocks (`unembed_parts`, see _split_unembedding)."""
    parts = unembed_parts if unembed_parts is not None else [model.unembedding()]
    bf16 = cpu_matmul.active_backend(model.config.matmul)
    if bf16:
        return jnp.concatenate([cpu_matmul.matmul(hidden_BTD[:, -1], u_DV, bf16) for u_DV in parts], axis=-1)
    h_BD = hidden_BTD[:, -1].astype(parts[0].dtype)
    logits = [jnp.dot(h_BD, u_DV, preferred_element_type=jnp.float32).astype(jnp.float32) for u_DV in parts]
    return logits[0] if len(logits) == 1 else jnp.concatenate(logits, axis=-1)


def _split_unembedding(graphdef, state, mesh) -> list[jax.Array]:
    """The [D, V] unembedding as column blocks, one per core, made once per batch by its own compiled program
    (inside the decode program XLA sinks the slices into the loop: a 33 MB copy at every step of the 24M bench
    model, 0.4 ms of an 8 ms step). XLA:CPU runs a matmul on one thread at about one core's read bandwidth, and
    the unembedding is half of the bytes a small model's decode step reads (the 24M bench model: 33 of 64 MB);
    the blocks' dots run on all the cores at once. Also materialises a tied embedding's transpose once, not at
    every step. On a mesh or an accelerator it stays one array. (Cutting the decoder layers' kernels the same
    way made the 24M model's step slower: 9.1 -> 10.3-11.6 ms.)"""
    model = nnx.merge(graphdef, state)
    unembed_DV = model.unembedding()
    bf16 = cpu_matmul.sampler_backend(model.config.matmul)
    if bf16 == "onednn":  # one block: oneDNN runs it on every core
        return [unembed_DV.astype(jnp.bfloat16)]
    if mesh is not None or jax.default_backend() != "cpu":
        return [unembed_DV]
    unembed_DV = unembed_DV.astype(jnp.bfloat16) if bf16 else unembed_DV
    V = unembed_DV.shape[1]
    n = max(1, min(os.cpu_count() or 1, 8, V // 1024))
    bounds = [V * i // n for i in range(n + 1)]
    return [unembed_DV[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@jax.jit
def _bf16_kernels(state):
    """The state with every Dense kernel in bfloat16 (the bf16 matmuls of model.cpu_matmul round them anyway)."""
    def cast(path, x):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return x.astype(jnp.bfloat16) if "kernel" in names[-2:] and x.ndim >= 2 else x
    return jax.tree_util.tree_map_with_path(cast, state)


def _constrain_batch(tree, mesh, rows: int):
    """Pin every array whose leading dim is the batch: rows over the batch axes and, for the K/V caches
    (HEADS_MAJOR_CACHE), heads over 'tensor' like the k/v projections that write them."""
    if mesh is None:
        return tree

    def constrain(path, x):
        if not hasattr(x, "ndim") or x.ndim == 0 or x.shape[0] != rows:
            return x
        key = getattr(path[-1], "key", None) if path else None
        names = HEADS_MAJOR_CACHE.get(key, ("batch",) + (None,) * (x.ndim - 1))
        spec = spec_for_shape(x.shape, logical_to_spec(names), mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(constrain, tree)


def _sampler_matmuls(program):
    """The program traced under cpu_matmul.sampling(): its projections take cpu_matmul.sampler_backend's matmul
    (float32 under model.cpu_matmul=auto where bf16 sampling does not pay), and with bf16 ones the sampler rounds
    the weights to bfloat16 (half the bytes each decode step reads) but not the activations, so that its greedy
    tokens stay those of the float32 sampler (BENCHMARKS.md)."""
    @functools.wraps(program)
    def traced(*args, **kwargs):
        with cpu_matmul.sampling():
            return program(*args, **kwargs)
    return traced


@_sampler_matmuls
def _prefill(graphdef, state, prefix_ids_1S, input_ids_BW, prompt_mask_BW, sample_row_N, *, max_len: int,
             width: int, gap: int, mesh):
    """Fill a heads-major cache of `width` slots (the decode windows grow it) with the prompts, then gather
    prompt rows into sample rows (prefill shared by n samples).

    A prefix common to every prompt of the batch (prefix_ids [1, S], S may be 0) runs once, on one row, and its
    K/V are copied to every row's slots [0, S); the rest of each prompt (input_ids [B, W], left-padded) then
    runs at slots [S, S + W), attending to the prefix. `gap` slots after the prompt stay masked: the decode's
    new tokens start at slot S + W + gap (its coarser prompt width, shared by more prompt lengths)."""
    model = nnx.merge(graphdef, state)
    S = prefix_ids_1S.shape[1]
    B, W = input_ids_BW.shape
    # Slots past the prompt and its gap are marked valid up front: causality (slot <= cache_pos + i) hides them
    # until they are written, so the same mask serves prefill and every decode step.
    cache_mask_BL = jnp.concatenate([jnp.ones((B, S), prompt_mask_BW.dtype), prompt_mask_BW,
                                     jnp.zeros((B, gap), prompt_mask_BW.dtype),
                                     jnp.ones((B, max_len - S - W - gap), prompt_mask_BW.dtype)], axis=1)
    if S:
        cache = model.init_cache(1, width)
        positions_1S = jnp.arange(S, dtype=jnp.int32)[None]
        _, cache = model.hidden_states(prefix_ids_1S, cache_mask_BL[:1, :width], positions_1S, cache=cache,
                                       cache_pos=jnp.int32(0))
        cache = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (B,) + x.shape[1:]), cache)
        cache = _constrain_batch(cache, mesh, B)
    else:
        cache = _constrain_batch(model.init_cache(B, width), mesh, B)
    return _prefill_rest(model, cache, input_ids_BW, prompt_mask_BW, cache_mask_BL, jnp.full((B,), S, jnp.int32),
                         sample_row_N, width=width, mesh=mesh)


def _prefill_rest(model, cache, input_ids_BW, prompt_mask_BW, cache_mask_BL, start_B, sample_row_N, *, width: int,
                  mesh):
    """The prefills' common end: each prompt's own tokens (left-padded) run at the slots after the first C ones the
    cache already holds (C = width - W), from position start; then prompt rows are gathered into sample rows."""
    B, W = input_ids_BW.shape
    N = sample_row_N.shape[0]
    positions_BW = start_B[:, None] + positions_from_mask(prompt_mask_BW)
    hidden_BWD, cache = model.hidden_states(input_ids_BW, cache_mask_BL[:, :width], positions_BW, cache=cache,
                                            cache_pos=jnp.int32(width - W))
    logits_BV = _last_logits(model, hidden_BWD)  # left padding: column W-1 is every prompt's last token
    take = lambda x: x[sample_row_N] if hasattr(x, "ndim") and x.ndim and x.shape[0] == B else x
    cache = _constrain_batch(jax.tree_util.tree_map(take, cache), mesh, N)
    prompt_len_N = (start_B + jnp.sum(prompt_mask_BW, axis=1).astype(jnp.int32))[sample_row_N]
    return cache, logits_BV[sample_row_N], prompt_len_N, cache_mask_BL[sample_row_N]


@_sampler_matmuls
def _prefill_rows(graphdef, state, prefix_k_LBKHC, prefix_v_LBKCH, prefix_mask_BC, prefix_len_B, input_ids_BW,
                  prompt_mask_BW, sample_row_N, *, max_len: int, width: int, gap: int, mesh):
    """_prefill where each prompt row starts with K/V it already has (PromptCache: an earlier prompt of the same
    dialogue): those fill slots [0, C) left-padded (prefix_mask), and only the rest of each prompt (input_ids,
    left-padded) runs, at slots [C, C + W), from position prefix_len. The stored keys carry their positions' RoPE,
    so a prompt continues exactly where its stored part ended."""
    model = nnx.merge(graphdef, state)
    B, W = input_ids_BW.shape
    C = prefix_mask_BC.shape[1]
    cache_mask_BL = jnp.concatenate([prefix_mask_BC, prompt_mask_BW, jnp.zeros((B, gap), prompt_mask_BW.dtype),
                                     jnp.ones((B, max_len - C - W - gap), prompt_mask_BW.dtype)], axis=1)
    dtype = model.config.dtype   # the cache's (Llama.init_cache)
    cache = _grow_cache([{"k_BKHS": k.astype(dtype), "v_BKSH": v.astype(dtype)}
                         for k, v in zip(prefix_k_LBKHC, prefix_v_LBKCH)], width=width, mesh=mesh)
    return _prefill_rest(model, cache, input_ids_BW, prompt_mask_BW, cache_mask_BL, prefix_len_B, sample_row_N,
                         width=width, mesh=mesh)


def _cache_rows(cache, rows_R):
    """Rows of a cache stacked over layers: keys [layers, R, K, H, S], values [layers, R, K, S, H]."""
    return (jnp.stack([layer["k_BKHS"][rows_R] for layer in cache]),
            jnp.stack([layer["v_BKSH"][rows_R] for layer in cache]))


def _grow_cache(cache, *, width: int, mesh):
    """The heads-major cache padded to `width` slots (once per decode window, between the windows' loops)."""
    def grow(x, axis):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - x.shape[axis])
        return jnp.pad(x, pad)
    grown = [{name: grow(x, cache_slot_axis(name)) for name, x in layer.items()} for layer in cache]
    return _constrain_batch(grown, mesh, cache[0]["v_BKSH"].shape[0])


def _take_rows(carry, rows, index_M, idle_M, *, mesh):
    """The decode state of batch rows `index` as a batch of its own (compaction: the rows still decoding, the
    finished ones left out). idle rows repeat a live one and are marked done (they fill the batch to a bucketed
    size). A row's next tokens depend only on its own cache, logits, settings and key (fold_in(key, step)), so it
    decodes on as it would have in the bigger batch."""
    take = lambda x: x[index_M] if hasattr(x, "ndim") and x.ndim else x
    taken = {name: take(value) for name, value in carry.items() if name != "cache"}
    taken["done"] = taken["done"] | idle_M
    cache = _constrain_batch(jax.tree_util.tree_map(take, carry["cache"]), mesh, index_M.shape[0])
    return dict(taken, cache=cache), {name: take(value) for name, value in rows.items()}


@_sampler_matmuls
def _decode(graphdef, state, carry, rows, step_limit, unembed_parts, *, prompt_width: int, width: int, pad_id: int,
            mesh, top_n: int = 0):
    """Run the decode loop from carry['step'] until step_limit or until every row is done, attending over the
    first `width` cache slots (the caller keeps prompt_width + step_limit <= width).

    carry: cache (heads-major, `width` slots), logits [N,V], step (), done [N], stopped [N],
           length [N], tokens [N,T], logprobs [N,T]; with top_n > 0 also top_ids [N,T,top_n], top_logprobs [N,T,top_n]
    rows:  prompt_len [N], cache_mask [N,L], temperature [N], top_p [N], top_k [N], max_new [N],
           stop_ids [N,S] (-1 = unused), keys [N,2]
    unembed_parts: the unembedding's column blocks (_split_unembedding)
    """
    model = nnx.merge(graphdef, state)
    cache_mask_NW = rows["cache_mask"][:, :width]

    def cond(c):
        return (c["step"] < step_limit) & ~jnp.all(c["done"])

    def body(c):
        step = c["step"]
        keys_N2 = jax.vmap(jax.random.fold_in, in_axes=(0, None))(rows["keys"], step)
        token_N = sample_tokens(c["logits"], keys_N2, rows["temperature"], rows["top_p"], rows["top_k"])
        logp_N = token_logprob(c["logits"], token_N)
        live_N = ~c["done"]
        token_N = jnp.where(live_N, token_N, pad_id)
        hit_stop_N = live_N & jnp.any(token_N[:, None] == rows["stop_ids"], axis=-1)
        tokens = c["tokens"].at[:, step].set(token_N)
        logprobs = c["logprobs"].at[:, step].set(jnp.where(live_N, logp_N, 0.0))
        length_N = jnp.where(live_N, step + 1, c["length"])
        done_N = c["done"] | hit_stop_N | (step + 1 >= rows["max_new"])
        positions_N1 = (rows["prompt_len"] + step)[:, None]
        extra = {}
        if top_n:
            top_ids_NK, top_lp_NK = top_logprobs(c["logits"], top_n)
            extra = dict(top_ids=c["top_ids"].at[:, step].set(top_ids_NK),
                         top_logprobs=c["top_logprobs"].at[:, step].set(top_lp_NK))
        hidden_N1D, cache = model.hidden_states(token_N[:, None], cache_mask_NW, positions_N1,
                                                cache=c["cache"], cache_pos=prompt_width + step)
        return dict(cache=_constrain_batch(cache, mesh, token_N.shape[0]), logits=_last_logits(model, hidden_N1D, unembed_parts),
                    step=step + 1, done=done_N, stopped=c["stopped"] | hit_stop_N, length=length_N,
                    tokens=tokens, logprobs=logprobs, **extra)

    return jax.lax.while_loop(cond, body, carry)


# ----------------------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------------------

class Sampler(BaseSampler):
    """Batched KV-cache sampling from an NNX Llama (sweet_jax.models) with a Hugging Face tokenizer.

    model:      sweet_jax.models.Llama (call `sweet_jax.models.load_hf(dir, mesh=mesh)` to get one)
    tokenizer:  a transformers tokenizer, or None when prompts are token ids (then Sample.text is None)
    mesh:       optional jax Mesh ('data', 'fsdp', 'tensor'): params are sharded by sweet_jax.sharding's
                rules, sample rows over ('data', 'fsdp')
    max_batch_size: most sample rows decoded together; bigger calls are split into several batches
    min_shared_prefix: a prefix of at least this many tokens common to a batch's prompts runs once in the
                prefill (shared_prefix_length); 0 turns the sharing off
    compact_every: every this many decode steps, the rows still decoding move into a smaller batch when they fit
                one (a power of two, at least min_compact_rows rows); 0 turns compaction off
    prompt_cache_mb: keep the K/V of prefilled prompts on the host, up to this many MB (PromptCache), so that a
                prompt extending one of them (a dialogue's next turn) prefills only its new tokens; 0 = off
    min_cached_prefix: the shortest stored prompt worth reusing (tokens)
    prefill_identical_once: a batch's identical prompts run one prefill row (False: a row each, as before)
    """

    def __init__(self, model, tokenizer=None, mesh=None, *, max_batch_size: int = 64, seed: int = 0,
                 stop_check_every: int = 32, eos_token_ids: Iterable[int] | None = None,
                 min_shared_prefix: int = 32, compact_every: int = 16, min_compact_rows: int = 4,
                 prompt_cache_mb: int = 0, min_cached_prefix: int = 64, prefill_identical_once: bool = True):
        if tokenizer is not None:
            check_vocab(model.config.vocab_size, tokenizer, where=f"its tokenizer ({getattr(tokenizer, 'name_or_path', '')})")
        self.tokenizer = tokenizer
        # HF fast tokenizers are not safe to call from several threads at once (the server does).
        self._tokenizer_lock = threading.RLock()
        self._token_texts: dict[int, str] = {}   # token id -> its text decoded alone (token_texts)
        self.mesh = mesh
        if mesh is not None:
            model = sharding.shard_model(model, mesh) or model
        self.model = model
        self.config = model.config
        self.max_batch_size = max_batch_size
        self.stop_check_every = stop_check_every
        self.min_shared_prefix = min_shared_prefix
        self.compact_every = compact_every
        self.min_compact_rows = min_compact_rows
        self.prompt_cache = PromptCache(prompt_cache_mb << 20) if prompt_cache_mb > 0 else None
        self.min_cached_prefix = min_cached_prefix
        self.prefill_identical_once = prefill_identical_once
        self._seeds = np.random.default_rng(seed)
        self._batch_shards = 1 if mesh is None else int(mesh.shape["data"] * mesh.shape["fsdp"])  # 'batch' axes
        self.eos_token_ids = tuple(sorted(set(eos_token_ids))) if eos_token_ids is not None else \
            self._default_eos_ids()
        self.pad_id = self._pad_id()
        self._prefill_fns: dict[tuple, Any] = {}
        self._decode_fns: dict[tuple[int, int, int], Any] = {}
        self._grow_fns: dict[int, Any] = {}
        self._take_fn = jax.jit(functools.partial(_take_rows, mesh=mesh))
        self._cache_rows_fn = jax.jit(_cache_rows)
        self._unembed_fn = jax.jit(functools.partial(_split_unembedding, mesh=mesh))

    @property
    def local_model(self):
        return self.model

    @property
    def graphdef(self):
        return nnx.graphdef(self.model)

    @property
    def state(self):
        """The model's current state; assigning one updates the model's arrays in place (e.g. a new policy
        of the same architecture reuses the compiled prefill/decode programs)."""
        return nnx.state(self.model)

    @state.setter
    def state(self, state) -> None:
        nnx.update(self.model, state)
        if self.prompt_cache is not None:   # K/V of other weights
            self.prompt_cache.clear()

    def set_params(self, params, *, seed: int | None = None) -> None:
        """Swap in new weights of the same architecture, keeping the compiled prefill/decode programs.

        params: a sweet_jax.models.Llama (e.g. `load_hf(new_policy_dir)`) or its `nnx.state(...)`; every array
        must have the current model's shape and dtype (a mismatch raises GenerateError and changes nothing).
        With a mesh, the new arrays are placed onto the same shardings. seed: restart the sampler's seed
        stream (what a fresh Sampler(model, seed=seed) would draw); None keeps it going.
        """
        state = nnx.state(params) if isinstance(params, nnx.Module) else params
        if isinstance(params, nnx.Module) and nnx.graphdef(params) != self.graphdef:
            raise GenerateError("set_params: the new model's structure differs from the sampler's (another "
                                "architecture or config); build a new Sampler for it.")
        current = nnx.state(self.model)
        cur_leaves, cur_tree = jax.tree_util.tree_flatten_with_path(current)
        new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(state)
        if cur_tree != new_tree:
            raise GenerateError("set_params: the new parameters' tree differs from the sampler's model (missing "
                                "or extra variables); pass a model or state of the same architecture.")
        for (path, old), (_, new) in zip(cur_leaves, new_leaves):
            if np.shape(old) != np.shape(new) or jnp.result_type(old) != jnp.result_type(new):
                raise GenerateError(
                    f"set_params: {jax.tree_util.keystr(path)} is {jnp.result_type(new)}{list(np.shape(new))}, "
                    f"the sampler's model has {jnp.result_type(old)}{list(np.shape(old))}; same shapes and dtypes "
                    f"are needed to reuse the compiled programs (build a new Sampler otherwise).")
        if self.mesh is not None:
            state = jax.device_put(state, jax.tree_util.tree_map(lambda x: x.sharding, current))
        nnx.update(self.model, state)
        if self.prompt_cache is not None:   # K/V of other weights
            self.prompt_cache.clear()
        if seed is not None:
            self._seeds = np.random.default_rng(seed)

    # -- public API ------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int = 256,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, n: int = 1,
                 stop: Sequence[str] | str | None = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, seed: int | None = None,
                 add_special_tokens: bool = True, progress: bool = False) -> list[list[Sample]]:
        """Sample n continuations of each prompt (text, or token ids). Returns samples[prompt][i].

        A `seed` makes the call reproducible (prompt j's i-th sample uses seed, j, i); None draws from the
        sampler's seeded stream.
        """
        if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise GenerateError("prompts must be a list of prompts (list[str] or list[list[int]]), "
                                "not a single prompt; wrap it in a list.")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        base_seed = seed if seed is not None else int(self._seeds.integers(2**31))
        requests = [
            Request(self.encode(p, add_special_tokens=add_special_tokens),
                    SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, n=n, stop=stop, stop_token_ids=tuple(stop_token_ids),
                                   ignore_eos=ignore_eos, seed=mix_seed(base_seed, j)))
            for j, p in enumerate(prompts)]
        return self.generate_requests(requests, progress=progress)

    def chat(self, messages_list: Sequence[Sequence[dict]], **kwargs) -> list[list[Sample]]:
        """Sample replies to chat dialogues: each is rendered with the tokenizer's chat template plus the
        assistant header (add_generation_prompt=True). kwargs as for `generate`."""
        return self.generate([self.chat_prompt_ids(m) for m in messages_list], **kwargs)

    def chat_prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        tok = self._need_tokenizer("chat")
        if not getattr(tok, "chat_template", None):
            raise GenerateError("the tokenizer has no chat_template; set one in tokenizer_config.json or "
                                "pass rendered prompts to generate().")
        with self._tokenizer_lock:
            text = apply_chat_template(tok, messages, add_generation_prompt=True)
            # The template writes the BOS itself, so encode without adding special tokens again.
            return list(tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            tok = self._need_tokenizer("text prompts")
            with self._tokenizer_lock:
                ids = list(tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise GenerateError("empty prompt: give at least one token (e.g. the BOS token).")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise GenerateError(f"prompt token ids {bad[:5]} are outside the model's vocabulary "
                                f"[0, {self.config.vocab_size}); is the tokenizer the model's?")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def check_request(self, request: Request) -> None:
        """Raise GenerateError if the request cannot run (bad settings, too long for the model)."""
        request.params.check()
        limit = self.config.max_position_embeddings
        if len(request.prompt_ids) + request.params.max_new_tokens > limit:
            raise GenerateError(
                f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens={request.params.max_new_tokens} "
                f"exceeds the model's max_position_embeddings={limit}; shorten the prompt or max_new_tokens.")
        if not request.prompt_ids:
            raise GenerateError("empty prompt: give at least one token (e.g. the BOS token).")
        if request.params.stop and self.tokenizer is None:
            raise GenerateError("stop strings need a tokenizer to decode text; pass stop_token_ids instead or "
                                "build the Sampler with a tokenizer.")

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (the `tokens` of OpenAI log-prob responses). A token's text alone does
        not depend on its neighbours, so each id is decoded once and kept (the server answers every request's
        N x max_tokens tokens with these)."""
        tok = self._need_tokenizer("token texts")
        ids = [int(t) for t in token_ids]
        cache = self._token_texts
        missing = set(ids).difference(cache)
        if missing:
            with self._tokenizer_lock:
                for t in missing:
                    cache[t] = tok.decode([t])
        return [cache[t] for t in ids]

    def generate_requests(self, requests: Sequence[Request], *, progress: bool = False,
                          on_batch: Callable[[list[int], list[list[Sample]]], None] | None = None,
                          on_chunk: Callable[[list[int], list[list[Sample]]], None] | None = None,
                          chunk_steps: int = 32, cancelled: Callable[[int], bool] | None = None
                          ) -> list[list[Sample]]:
        """Sample every request with its own settings; batches of <= max_batch_size sample rows.
        `on_batch(indices, samples)` is called as each compiled batch finishes (a server answers those
        requests while the next batch runs).

        Streaming: with `on_chunk`, the decode loop stops after 1, 2, 4, ... then every `chunk_steps` steps and
        `on_chunk(indices, partial)` gets each request's samples so far (text None, finish_reason None until the
        row is done); the tokens and log-probs are those of the unchunked loop (the same compiled step, run in
        pieces). `cancelled(i)`, asked before request i's batch starts and at each of those stops, drops a
        request whose answer nobody waits for any more (its rows stop; its samples end with 'cancelled')."""
        for r in requests:
            self.check_request(r)
        results: list[list[Sample] | None] = [None] * len(requests)
        groups, group, rows = [], [], 0
        # Similar prompt lengths batch together (less padding, fewer distinct bucket shapes), identical prompts
        # side by side (prefilled once).
        for i in sorted(range(len(requests)), key=lambda i: (len(requests[i].prompt_ids), tuple(requests[i].prompt_ids))):
            n = requests[i].params.n
            if group and rows + n > self.max_batch_size:
                groups.append(group)
                group, rows = [], 0
            group.append(i)
            rows += n
        if group:
            groups.append(group)
        bar = None
        if progress:
            bar = tqdm(total=len(requests), desc="generate", unit="prompt")
        for group in groups:
            if cancelled is not None:
                for i in [i for i in group if cancelled(i)]:
                    results[i] = []
                group = [i for i in group if results[i] is None]
                if not group:
                    continue
            report = None if on_chunk is None else functools.partial(on_chunk, group)
            gone = None if cancelled is None else (lambda j, group=group: cancelled(group[j]))
            batch = self._generate_batch([requests[i] for i in group], chunk_steps=chunk_steps, on_chunk=report,
                                         cancelled=gone)
            for i, samples in zip(group, batch):
                results[i] = samples
            if on_batch is not None:
                on_batch(group, batch)
            if bar is not None:
                bar.update(len(group))
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]

    # -- one compiled batch ----------------------------------------------------------------------------

    def _generate_batch(self, requests: Sequence[Request], *, chunk_steps: int = 32,
                        on_chunk: Callable[[list[list[Sample]]], None] | None = None,
                        cancelled: Callable[[int], bool] | None = None) -> list[list[Sample]]:
        # Identical prompts (an evaluation plays each task twice, the offline stage four times) are prefilled once:
        # one prompt row, read by every sample row of every request that asks it.
        asked = [tuple(r.prompt_ids) if self.prefill_identical_once else j for j, r in enumerate(requests)]
        first_asked: dict[Any, int] = {}   # a prompt -> the first request that asks it
        for j, key in enumerate(asked):
            first_asked.setdefault(key, j)
        prompts = [requests[j] for j in first_asked.values()]   # one a prompt row
        row_of_key = {key: row for row, key in enumerate(first_asked)}
        request_row = [row_of_key[key] for key in asked]
        B = bucket_rows(len(prompts), self._batch_shards)
        S = shared_prefix_length([r.prompt_ids for r in prompts], self.min_shared_prefix)
        longest = max(len(r.prompt_ids) for r in prompts) - S
        W = bucket_prompt(longest)       # the prefill's width
        P = S + bucket_length(longest)   # the decode's prompt width (its new tokens start at slot P)
        # Prompts that extend prompts prefilled before (PromptCache) start from their stored K/V when that makes
        # the prefill narrower: slots [0, C) hold each row's stored part, left-padded, and the decode's prompt
        # width stays a power of two (few decode programs)
        stored = self._stored_prefixes(prompts)
        if stored is not None:
            C = bucket_prompt(max(n for n, _, _ in stored))
            new_longest = max(len(r.prompt_ids) - n for r, (n, _, _) in zip(prompts, stored))
            if bucket_prompt(new_longest) < W:
                W = bucket_prompt(new_longest)
                P = bucket_length(C + W)
            else:
                stored = None
        n_rows = sum(r.params.n for r in requests)
        N = bucket_rows(n_rows, self._batch_shards)
        max_new = max(r.params.max_new_tokens for r in requests)
        T = bucket_length(max_new)
        L = P + T

        prefix_ids = np.asarray(requests[0].prompt_ids[:S], np.int32)[None]
        input_ids = np.full((B, W), self.pad_id, np.int32)
        prompt_mask = np.zeros((B, W), np.int32)
        starts = [S] * B if stored is None else [stored[b if b < len(prompts) else 0][0] for b in range(B)]
        for b in range(B):  # padding rows repeat the first prompt: an all-padding row would attend nothing
            ids = prompts[b if b < len(prompts) else 0].prompt_ids[starts[b]:]
            input_ids[b, W - len(ids):] = ids
            prompt_mask[b, W - len(ids):] = 1

        stop_sets = [self._stop_ids(r.params) for r in requests]
        stop_width = max(4, 1 << (max(len(s) for s in stop_sets) - 1).bit_length()) if any(stop_sets) else 4
        sample_row = np.zeros(N, np.int32)
        temperature = np.zeros(N, np.float32)
        top_p = np.ones(N, np.float32)
        top_k = np.zeros(N, np.int32)
        max_new_rows = np.ones(N, np.int32)  # padding rows finish after one step
        stop_ids = np.full((N, stop_width), -1, np.int32)
        keys = np.zeros((N, 2), np.uint32)
        owner: list[tuple[int, int]] = []  # sample row -> (request, sample index)
        first_row: list[int] = []   # request -> its first sample row
        row = 0
        for j, r in enumerate(requests):
            p = r.params
            seed = p.seed if p.seed is not None else int(self._seeds.integers(2**31))
            first_row.append(row)
            for i in range(p.n):
                sample_row[row], temperature[row], top_p[row] = request_row[j], p.temperature, p.top_p
                top_k[row] = p.top_k
                max_new_rows[row] = p.max_new_tokens
                stop_ids[row, :len(stop_sets[j])] = stop_sets[j]
                keys[row] = (0, mix_seed(seed, i))  # == jax.random.PRNGKey(seed) (threefry), built on host
                owner.append((j, i))
                row += 1

        put = self._put
        graphdef, state = nnx.split(self.model)  # each call: params updated in place (training) are seen
        unembed_parts = self._unembed_fn(graphdef, state)
        if cpu_matmul.sampler_backend(self.model.config.matmul):
            state = _bf16_kernels(state)  # once per batch: each decode step reads half the bytes
        windows = decode_windows(P, T)
        # The prefill's cache holds exactly the prompt (its attention is then plain causal self-attention); it
        # grows to the first window before the first decode loop.
        with costs.timed("sample_prefill"):  # blocks on the prefill once a batch: the decode waits for it anyway
            if stored is None:
                pre = S
                cache, logits, prompt_len, cache_mask = jax.block_until_ready(self._prefill_fn(L, S + W, P - S - W)(
                    graphdef, state, put(prefix_ids, replicated=True), put(input_ids), put(prompt_mask),
                    put(sample_row)))
                run = prefix_ids.shape[1] + B * W
            else:
                pre = C
                prefix_k, prefix_v, prefix_mask = self._stored_rows(stored, B, C)
                cache, logits, prompt_len, cache_mask = jax.block_until_ready(self._prefill_rows_fn(
                    L, C + W, P - C - W)(graphdef, state, put(prefix_k, axis=1), put(prefix_v, axis=1),
                                         put(prefix_mask), put(np.asarray(starts, np.int32)), put(input_ids),
                                         put(prompt_mask), put(sample_row)))
                run = B * W
            if self.prompt_cache is not None:
                self._store_prompts(prompts, [first_row[j] for j in first_asked.values()], cache, starts, pre, W)
        reused = 0 if stored is None else sum(n for n, _, _ in stored)
        costs.tokens("sample_prompt", sum(len(r.prompt_ids) for r in prompts) - reused, run)
        costs.add("sample_prompt_reused_tokens", reused)   # their K/V taken from the PromptCache, not run
        costs.add("sample_prompt_repeated_tokens", sum(len(r.prompt_ids) for r in requests)
                  - sum(len(r.prompt_ids) for r in prompts))   # prompts of the batch asked again: run once
        decode_start = time.perf_counter()
        rows = dict(prompt_len=prompt_len, cache_mask=cache_mask, temperature=put(temperature),
                    top_p=put(top_p), top_k=put(top_k), max_new=put(max_new_rows), stop_ids=put(stop_ids),
                    keys=put(keys))
        carry = dict(cache=cache, logits=logits, step=put(np.int32(0), replicated=True), done=put(np.zeros(N, bool)),
                     stopped=put(np.zeros(N, bool)), length=put(np.zeros(N, np.int32)),
                     tokens=put(np.full((N, T), self.pad_id, np.int32)), logprobs=put(np.zeros((N, T), np.float32)))
        # Top alternatives cost a top-k over the vocabulary a step: only a batch that asks for them runs a
        # program that keeps them (the most any of its requests asks for; each is cut to its own on the host).
        top_n = max(r.params.top_logprobs for r in requests)
        if top_n:
            carry.update(top_ids=put(np.zeros((N, T, top_n), np.int32)),
                         top_logprobs=put(np.zeros((N, T, top_n), np.float32)))

        def samples_of(fields, final: bool) -> list[list[Sample]]:
            tokens, logprobs, length, stopped, done = (fields[k] for k in ("tokens", "logprobs", "length",
                                                                           "stopped", "done"))
            out: list[list[Sample]] = [[None] * r.params.n for r in requests]  # type: ignore[misc]
            for row, (j, i) in enumerate(owner):
                kept = int(length[row])
                text, reason = None, None
                if row in string_stop_at:
                    kept, text = string_stop_at[row]
                    reason = "stop"
                elif row in cancelled_rows:
                    reason = "cancelled"
                elif stopped[row] or done[row] or final:
                    reason = "stop" if stopped[row] else "length"
                ids = tokens[row, :kept].tolist()
                if final and text is None:
                    text = self.decode(ids[:-1] if stopped[row] else ids)
                top = None
                if top_n and requests[j].params.top_logprobs:
                    k = requests[j].params.top_logprobs
                    top = [list(zip(a[:k].tolist(), b[:k].tolist()))
                           for a, b in zip(fields["top_ids"][row, :kept], fields["top_logprobs"][row, :kept])]
                out[j][i] = Sample(text=text, token_ids=ids, logprobs=logprobs[row, :kept].tolist(),
                                   finish_reason=reason,
                                   prompt_token_ids=list(requests[j].prompt_ids), top_logprobs=top)
            return out

        def fetch(names):
            return dict(zip(names, jax.device_get(tuple(carry[k] for k in names))))

        has_stop_strings = any(r.params.stop for r in requests) and self.tokenizer is not None
        chunk = self.stop_check_every if has_stop_strings else max_new
        # A stream's first tokens come after 1, 2, 4, ... steps; only looking for cancelled requests, every
        # chunk_steps steps (and only the done flags cross to the host).
        reports = on_chunk is not None or cancelled is not None
        string_stop_at: dict[int, tuple[int, str]] = {}  # row -> (tokens kept, text)
        cancelled_rows: set[int] = set()
        step, checked, report_at = 0, 0, 1 if on_chunk is not None else chunk_steps
        outputs = ["tokens", "logprobs", "length", "stopped", "done"] + (["top_ids", "top_logprobs"] if top_n else [])
        # Compaction: every compact_every steps (the same steps whether or not the loop also stops for reports),
        # the rows still decoding move into a smaller batch once they fit one; the rows that left keep their
        # outputs on the host (batch_rows). A step's time follows its rows, and most rows of a batch end early.
        batch_rows = _BatchRows(N)
        min_rows = bucket_rows(self.min_compact_rows, self._batch_shards)
        compact_every = self.compact_every if N > min_rows else 0
        compact_at = compact_every or max_new
        row_steps, segment_start = 0, 0
        while step < max_new:
            # The window holding this step's slot (P + step); its loop stops at the window's end, the next
            # stop-string check, report or compaction. Otherwise the windows run back to back with no host sync:
            # a window whose rows are all done exits at once.
            width = next(w for w in windows if P + step < w)
            step = min(width - P, checked + chunk, max_new, report_at if reports else max_new, compact_at)
            if _cache_width(carry["cache"]) < width:
                carry["cache"] = self._grow_fn(width)(carry["cache"])
            carry = self._decode_fn(P, width, top_n)(graphdef, state, carry, rows, jnp.int32(step), unembed_parts)
            check_stops = has_stop_strings and step >= min(checked + chunk, max_new)
            report = reports and step >= min(report_at, max_new)
            compact = step >= compact_at and step < max_new
            if not (check_stops or report or compact):
                continue
            fields = batch_rows.full(fetch(outputs if check_stops or on_chunk is not None else ["done"]))
            done = fields["done"]
            newly_done = np.zeros(N, bool)
            if check_stops:
                checked = step
                for row, (j, _) in enumerate(owner):
                    if row in string_stop_at or not requests[j].params.stop:
                        continue
                    hit = self._find_stop_string(fields["tokens"][row, :fields["length"][row]],
                                                 requests[j].params.stop)
                    if hit is not None:
                        string_stop_at[row] = hit
                        newly_done[row] = not done[row]
            if report:
                report_at = step + (min(max(step, 1), chunk_steps) if on_chunk is not None else chunk_steps)
                if on_chunk is not None and step < max_new:
                    on_chunk(samples_of(fields, final=False))
                if cancelled is not None:
                    for row, (j, _) in enumerate(owner):
                        if not done[row] and not newly_done[row] and cancelled(j):
                            cancelled_rows.add(row)
                            newly_done[row] = True
            if newly_done.any():
                carry["done"] = carry["done"] | put(batch_rows.batch(newly_done))
            if bool(np.all(done | newly_done)):
                break
            if compact:
                compact_at = step + compact_every
                still = batch_rows.decoding(done | newly_done)
                rows_now = len(batch_rows.live)
                M = max(bucket_rows(len(still), self._batch_shards), min_rows)
                if M < rows_now:   # fetched again: the done flags set just above are in the outputs kept
                    index, idle = batch_rows.shrink(fetch(outputs), still, M)
                    carry, rows = self._take_fn(carry, rows, put(index), put(idle))
                    row_steps, segment_start = row_steps + rows_now * (step - segment_start), step
        final = batch_rows.full(fetch(outputs + ["step"]))
        row_steps += len(batch_rows.live) * (int(final["step"]) - segment_start)
        costs.add("sample_decode_s", time.perf_counter() - decode_start)
        costs.tokens("sample_new", int(final["length"][:len(owner)].sum()), row_steps)
        return samples_of(final, final=True)

    def _find_stop_string(self, token_ids: np.ndarray, stops: Sequence[str]) -> tuple[int, str] | None:
        """(tokens up to and including the one completing the earliest stop string, text cut before it)."""
        text = self.decode(token_ids.tolist())
        cuts = [text.find(s) for s in stops if s in text]
        if not cuts:
            return None
        cut = min(cuts)
        end = min(cut + len(s) for s in stops if text.find(s) == cut)
        # Shortest token prefix whose text already spells the stop string (binary search on decoded length).
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(token_ids[:mid].tolist())) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo, text[:cut]

    # -- helpers --------------------------------------------------------------------------------------

    def _prefill_fn(self, max_len: int, width: int, gap: int):
        if (max_len, width, gap) not in self._prefill_fns:
            self._prefill_fns[max_len, width, gap] = jax.jit(
                functools.partial(_prefill, max_len=max_len, width=width, gap=gap, mesh=self.mesh))
        return self._prefill_fns[max_len, width, gap]

    def _prefill_rows_fn(self, max_len: int, width: int, gap: int):
        if ("rows", max_len, width, gap) not in self._prefill_fns:
            self._prefill_fns["rows", max_len, width, gap] = jax.jit(
                functools.partial(_prefill_rows, max_len=max_len, width=width, gap=gap, mesh=self.mesh))
        return self._prefill_fns["rows", max_len, width, gap]

    def _grow_fn(self, width: int):
        if width not in self._grow_fns:
            self._grow_fns[width] = jax.jit(functools.partial(_grow_cache, width=width, mesh=self.mesh))
        return self._grow_fns[width]

    def _decode_fn(self, prompt_width: int, width: int, top_n: int = 0):
        if (prompt_width, width, top_n) not in self._decode_fns:
            self._decode_fns[prompt_width, width, top_n] = jax.jit(
                functools.partial(_decode, prompt_width=prompt_width, width=width, pad_id=self.pad_id,
                                  mesh=self.mesh, top_n=top_n),
                donate_argnums=(2,))
        return self._decode_fns[prompt_width, width, top_n]

    def _stored_prefixes(self, requests: Sequence[Request]):
        """Each request's longest stored prompt (PromptCache.longest), or None unless every request has one."""
        if self.prompt_cache is None:
            return None
        stored = []
        for r in requests:
            hit = self.prompt_cache.longest(r.prompt_ids, self.min_cached_prefix)
            if hit is None:
                return None
            stored.append(hit)
        return stored

    def _stored_rows(self, stored, B: int, C: int):
        """The stored K/V as the prefill's first C slots, each row left-padded: keys [layers, B, K, H, C], values
        [layers, B, K, C, H], and the slots' mask [B, C]. Padding rows repeat the first request's."""
        n0, k0, v0 = stored[0]
        keys = np.zeros(k0.shape[:1] + (B,) + k0.shape[1:3] + (C,), k0.dtype)
        values = np.zeros(v0.shape[:1] + (B,) + v0.shape[1:2] + (C,) + v0.shape[3:], v0.dtype)
        mask = np.zeros((B, C), np.int32)
        for b in range(B):
            n, k, v = stored[b] if b < len(stored) else stored[0]
            keys[:, b, :, :, C - n:] = k
            values[:, b, :, C - n:, :] = v
            mask[b, C - n:] = 1
        return keys, values, mask

    def _store_prompts(self, requests: Sequence[Request], first: Sequence[int], cache, starts: Sequence[int],
                       pre: int, W: int) -> None:
        """Keep each prompt's K/V (PromptCache.put): from `first`, a sample row that reads it, the slots holding the
        prompt: the part it started with (slots [pre - start, pre), or the shared prefix [0, S)) then its own tokens."""
        keys, values = jax.device_get(self._cache_rows_fn(cache, self._put(np.asarray(first, np.int32),
                                                                           replicated=True)))
        for j, r in enumerate(requests):
            own = len(r.prompt_ids) - starts[j]
            slots = np.concatenate([np.arange(pre - starts[j], pre), np.arange(pre + W - own, pre + W)])
            self.prompt_cache.put(r.prompt_ids, np.ascontiguousarray(keys[:, j][..., slots]),
                                  np.ascontiguousarray(values[:, j][:, :, slots, :]))

    def _put(self, x: np.ndarray, *, replicated: bool = False, axis: int = 0) -> jax.Array:
        """x on the mesh: rows over the batch axes, or (replicated) whole on every device. Without a mesh, placed
        on the device: a decode loop run in chunks gets its own (placed) outputs back, and a placed array is
        another signature to jit than an unplaced one (a second compile of every decode program)."""
        if self.mesh is None:
            return jax.device_put(x, jax.local_devices()[0])
        sharding = NamedSharding(self.mesh, jax.sharding.PartitionSpec()) if replicated else \
            batch_sharding(self.mesh, x.ndim, axis=axis)   # axis: the stored K/V's batch follows their layers
        return jax.device_put(x, sharding)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= set(self.eos_token_ids)
        return sorted(ids)

    def _default_eos_ids(self) -> tuple[int, ...]:
        eos = self.config.eos_token_id
        ids = set(eos if isinstance(eos, (tuple, list)) else ([] if eos is None else [eos]))
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(int(i) for i in ids))

    def _pad_id(self) -> int:
        tok = self.tokenizer
        if tok is not None and getattr(tok, "pad_token_id", None) is not None:
            return int(tok.pad_token_id)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise GenerateError(f"{what} need a tokenizer: build the Sampler with tokenizer=AutoTokenizer."
                                f"from_pretrained(DIR), or pass token ids.")
        return self.tokenizer


class PromptCache:
    """The K/V of prompts the sampler prefilled, kept on the host so that a later prompt that extends one (the
    next turn of a dialogue: the previous prompt, the reply, the next user message) prefills only its new
    tokens. At most max_bytes, the least recently used prompt leaves first; cleared when the parameters change.

    Looked up by token ids: the longest stored prompt that is a proper prefix of the new one (rolling hashes of
    the new prompt's prefixes, checked token for token on a hit)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.entries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # (len, hash) -> ids, k, v
        self.lengths: dict[int, int] = {}   # stored prompt length -> how many entries
        self.hits = self.lookups = 0

    @staticmethod
    def prefix_hashes(ids: Sequence[int]) -> list[int]:
        h, out = 0, [0]
        for t in ids:
            h = (h * 1_000_003 + int(t) + 1) & 0xFFFFFFFFFFFF
            out.append(h)
        return out

    def longest(self, ids: Sequence[int], minimum: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """(length, keys [layers, K, H, length], values [layers, K, length, H]) of the longest stored prompt that
        ids extends by at least one token, at least `minimum` long; None if there is none."""
        self.lookups += 1
        hashes = self.prefix_hashes(ids)
        for n in sorted((n for n in self.lengths if minimum <= n < len(ids)), reverse=True):
            key = (n, hashes[n])
            entry = self.entries.get(key)
            if entry is not None and np.array_equal(entry[0], np.asarray(ids[:n])):
                self.entries[key] = self.entries.pop(key)   # most recently used: last
                self.hits += 1
                return n, entry[1], entry[2]
        return None

    def put(self, ids: Sequence[int], k_LKHT: np.ndarray, v_LKTH: np.ndarray) -> None:
        key = (len(ids), self.prefix_hashes(ids)[-1])
        size = k_LKHT.nbytes + v_LKTH.nbytes
        if key in self.entries or size > self.max_bytes:
            return
        self.entries[key] = (np.asarray(ids, np.int32), k_LKHT, v_LKTH)
        self.lengths[len(ids)] = self.lengths.get(len(ids), 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:   # the least recently used first (dicts keep insertion order)
            (n, h), (_, k, v) = next(iter(self.entries.items()))
            del self.entries[n, h]
            self.bytes -= k.nbytes + v.nbytes
            self.lengths[n] -= 1
            if not self.lengths[n]:
                del self.lengths[n]

    def clear(self) -> None:
        self.entries.clear()
        self.lengths.clear()
        self.bytes = 0


class _BatchRows:
    """The sample rows a decode batch holds as compaction shrinks it, and the outputs of the rows it let go.

    live[b] is the sample row in batch row b (-1: an idle filler). Outputs fetched from the batch are [batch, ...];
    `full` gives them over every sample row (a row that left: its outputs as they were when it left, all final)."""

    def __init__(self, n: int):
        self.live = np.arange(n)
        self.left: dict[str, np.ndarray] = {}

    def full(self, fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.left:
            return fields
        real = self.live >= 0
        out = dict(fields)
        for name in self.left.keys() & fields.keys():
            out[name] = self.left[name].copy()
            out[name][self.live[real]] = fields[name][real]
        return out

    def batch(self, flags: np.ndarray) -> np.ndarray:
        """Per-sample-row flags as the batch's rows (False for fillers)."""
        return (self.live >= 0) & flags[np.maximum(self.live, 0)]

    def decoding(self, done: np.ndarray) -> np.ndarray:
        """Batch rows whose sample row is not done (done: per sample row)."""
        return np.flatnonzero(self.batch(~done))

    def shrink(self, fields: dict[str, np.ndarray], keep: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch becomes `keep` (batch rows) and fillers up to `rows`; fields: the batch's outputs now, kept for
        the rows that leave. Returns the gather index and the idle (filler) flags of the new batch."""
        self.left = self.full(fields)
        index = np.concatenate([keep, np.full(rows - len(keep), keep[0])]).astype(np.int32)
        idle = np.arange(rows) >= len(keep)
        self.live = np.where(idle, -1, self.live[index])
        return index, idle


def _cache_width(cache) -> int:
    return cache[0]["v_BKSH"].shape[cache_slot_axis("v_BKSH")]


def load_sampler(path: str, tokenizer: str | None = None, *, dtype: str | None = None, mesh=None, seed: int = 0,
                 max_batch_size: int = 64, chat_template: bool = True, reuse=None, cpu_matmul: str | None = None,
                 prompt_cache_mb: int = 0):
    """A Sampler for a model path, with the model's tokenizer (or `tokenizer`, a directory). cpu_matmul: the
    model.cpu_matmul of a Hugging Face checkpoint (None: LlamaConfig's default; a training run keeps its own).

    reuse: a Sampler to load a Hugging Face checkpoint of the same architecture into: only its parameters are
    swapped, so its compiled prefill/decode programs (one per shape) serve the new model too instead of being
    compiled again (the pipeline samples from several policies of one architecture). Another architecture
    gets a new Sampler. prompt_cache_mb: Sampler's (a reused one takes it too)."""
    if reuse is not None and is_hf_checkpoint(path):
        try:
            reuse.set_params(load_model(path, dtype=dtype, cpu_matmul=cpu_matmul)[0], seed=seed)
            reuse.prompt_cache = PromptCache(prompt_cache_mb << 20) if prompt_cache_mb > 0 else None
            return reuse
        except GenerateError:  # another architecture: a new Sampler (and new compilations)
            pass

    run_config = read_config(path) if path and is_training_run(path) else None
    tok = load_tokenizer_for(path, tokenizer, run_config, chat_template=chat_template)
    model, _ = load_model(path, dtype=dtype, mesh=mesh if run_config is None else None, tokenizer=tok, seed=seed,
                          cpu_matmul=cpu_matmul)
    if run_config is not None and mesh is None:
        mesh = sharding.make_mesh((1, -1, 1))  # restore_model placed the parameters on this mesh
    return Sampler(model, tok, mesh, max_batch_size=max_batch_size, seed=seed, prompt_cache_mb=prompt_cache_mb)
