"""Causal attention implementations for the Llama model, and its KV cache (one layout: heads-major).

Shape letters as in llama.py: B batch, T query tokens, S key/value slots, N query heads, K kv heads,
G = N // K query heads per kv head, H head_dim.

Self-attention (training, scoring, a sampler's prefill), chosen per call by `resolve_attention_impl`:
  "xla"      jax.nn.dot_product_attention's XLA path: materialises float32 [B, N, T, S] logits.
  "chunked"  the same per block of queries under jax.checkpoint: one block's logits alive (TPU, long T).
  "blocked"  query blocks unrolled, each attending only keys before its end: skips the masked upper triangle.
  "cudnn"    GPU fused attention (16-bit compute only), causal flag + key lengths for right padding.
Cached decoding (few queries over a long cache): `cached_attention`, over the heads-major cache below.
Fully masked (padding) query rows differ between implementations; real rows agree.

The key mask of self-attention is either key-valid flags [B, T] bool (padding) or segment ids [B, T] int32:
sequences packed into one row behind the prefix they share (batching.pack_shared_prefix). Segment 0 is padding,
1 the shared prefix, s >= 2 one sequence's own tokens; a query sees the prefix's keys and its own segment's
(causally), never another sequence's, so each sequence's values are those it has run alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "chunked", "blocked")
AUTO_CHUNKED_MIN_LEN = 2048  # "auto" switches from "xla" to "chunked" (TPU) above this many query tokens

# The KV cache, per layer a dict of two arrays; the logical axis names of each (None: the cache slots).
# Keys are stored transposed, [B, K, H, S], so that both decode products are plain [Q, H] x [H, S] and
# [Q, S] x [S, H] matmuls: against keys stored [S, H], XLA:CPU's Q.K^T took 6-7x the time of P.V over the same
# bytes (1.8 ms of an 8.3 ms decode step of the 24M bench model; BENCHMARKS.md, "Sampler"). Each (row, kv head)
# reads its slots as one contiguous matrix; with [B, S, K, H], XLA:CPU transposes the whole cache at every
# decode step (1.4x a step's time on the 24M bench model).
HEADS_MAJOR_CACHE = {"k_BKHS": ("batch", "kv_heads", "head_dim", None),
                     "v_BKSH": ("batch", "kv_heads", None, "head_dim")}
KVCache = list  # list over layers of {'k_BKHS': [B, K, H, S], 'v_BKSH': [B, K, S, H]} (HEADS_MAJOR_CACHE)


def init_kv_cache(num_layers: int, batch_size: int, slots: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty (zero) heads-major KV cache of `slots` slots for every layer."""
    B, K, H = batch_size, num_kv_heads, head_dim
    return [{"k_BKHS": jnp.zeros((B, K, H, slots), dtype), "v_BKSH": jnp.zeros((B, K, slots, H), dtype)}
            for _ in range(num_layers)]


def cache_slot_axis(name: str) -> int:
    """The slots axis of a cache array (see HEADS_MAJOR_CACHE)."""
    return HEADS_MAJOR_CACHE[name].index(None)


def cache_slots(cache: KVCache) -> int:
    """S, the number of slots of a KV cache."""
    return cache[0]["v_BKSH"].shape[cache_slot_axis("v_BKSH")]


def write_kv_cache(layer_cache: dict, k_BTKH: jax.Array, v_BTKH: jax.Array, cache_pos) -> dict:
    """The layer's cache with this step's K/V written at slots [cache_pos, cache_pos + T)."""
    k_BKHS, v_BKSH = layer_cache["k_BKHS"], layer_cache["v_BKSH"]
    return {"k_BKHS": jax.lax.dynamic_update_slice(k_BKHS, k_BTKH.transpose(0, 2, 3, 1).astype(k_BKHS.dtype),
                                                   (0, 0, 0, cache_pos)),
            "v_BKSH": jax.lax.dynamic_update_slice(v_BKSH, v_BTKH.swapaxes(1, 2).astype(v_BKSH.dtype),
                                                   (0, 0, cache_pos, 0))}


# ----------------------------------------------------------------------------------------------------------
# Masks and implementations
# ----------------------------------------------------------------------------------------------------------

def is_segments(key_mask) -> bool:
    """Whether a self-attention key mask is segment ids (int) rather than key-valid flags (bool); module note."""
    return key_mask is not None and jnp.issubdtype(key_mask.dtype, jnp.integer)


def causal_mask(T: int, S: int, key_valid_BS: jax.Array | None = None, query_offset=0,
                query_segments_BT: jax.Array | None = None) -> jax.Array:
    """[B or 1, 1, T, S] bool: query row i (at slot query_offset + i) sees key slots j <= query_offset + i
    that are valid. Built from iota comparisons, so XLA never constant-folds a [T, S] table.

    key_valid_BS as segment ids (is_segments): a key is valid when its segment is > 0, and a query sees it when
    it is the shared prefix (1) or the query's own segment: query_segments_BT [B, T], by default the keys' ids
    at the query slots (a Python int query_offset)."""
    rows_TS = jax.lax.broadcasted_iota(jnp.int32, (T, S), 0) + query_offset
    cols_TS = jax.lax.broadcasted_iota(jnp.int32, (T, S), 1)
    mask_11TS = (cols_TS <= rows_TS)[None, None]
    if key_valid_BS is None:
        return mask_11TS
    if not is_segments(key_valid_BS):
        return mask_11TS & key_valid_BS[:, None, None, :]
    if query_segments_BT is None:
        query_segments_BT = key_valid_BS[:, query_offset:query_offset + T]
    keys_B11S, queries_B1T1 = key_valid_BS[:, None, None, :], query_segments_BT[:, None, :, None]
    return mask_11TS & (keys_B11S > 0) & ((keys_B11S == 1) | (keys_B11S == queries_B1T1))


def chunked_attention(q_BTNH, k_BSKH, v_BSKH, key_valid_BS=None, *, chunk_size: int = 512) -> jax.Array:
    """Causal (+ key padding) attention scanned over blocks of chunk_size queries, each block under
    jax.checkpoint: only one [B, N, C, S] block of float32 logits is alive in the forward and the backward.
    Softmax rows are independent, so values and gradients equal the unchunked XLA attention. T that is not a
    multiple of chunk_size is padded with zero queries (their rows are dropped)."""
    B, T, N, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    C = min(chunk_size, T)
    if C == T:
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=causal_mask(T, S, key_valid_BS),
                                            implementation="xla")
    n = -(-T // C)
    if n * C != T:
        q_BTNH = jnp.pad(q_BTNH, ((0, 0), (0, n * C - T), (0, 0), (0, 0)))
    q_nBCNH = q_BTNH.reshape(B, n, C, N, H).swapaxes(0, 1)
    # Segment ids (self-attention: S == T): each block's queries' own ids travel with it.
    seg_BT = key_valid_BS if is_segments(key_valid_BS) else jnp.zeros((B, T), jnp.int32)
    seg_nBC = jnp.pad(seg_BT, ((0, 0), (0, n * C - T))).reshape(B, n, C).swapaxes(0, 1)

    @jax.checkpoint
    def block(q_BCNH, start, seg_BC):
        mask_B1CS = causal_mask(C, S, key_valid_BS, query_offset=start,
                                query_segments_BT=seg_BC if is_segments(key_valid_BS) else None)
        return jax.nn.dot_product_attention(q_BCNH, k_BSKH, v_BSKH, mask=mask_B1CS, implementation="xla")

    _, out_nBCNH = jax.lax.scan(lambda _, xs: (None, block(*xs)), None,
                                (q_nBCNH, jnp.arange(n, dtype=jnp.int32) * C, seg_nBC))
    return out_nBCNH.swapaxes(0, 1).reshape(B, n * C, N, H)[:, :T]


def blocked_causal_attention(q_BTNH, k_BSKH, v_BSKH, key_valid_BS=None, *, block_size: int = 128) -> jax.Array:
    """Causal (+ key padding) self-attention (S == T) over query blocks unrolled in Python: block [a, b)
    attends keys [0, b) only, so the fully masked upper triangle is never computed (T = 4 blocks: 10/16 of
    the logits). Real query rows equal the XLA attention; a query row that sees no valid key averages the
    values of its block's key range instead of all keys (padding rows only)."""
    T = q_BTNH.shape[1]
    outs = []
    for start in range(0, T, block_size):
        end = min(start + block_size, T)
        kv = None if key_valid_BS is None else key_valid_BS[:, :end]
        outs.append(jax.nn.dot_product_attention(
            q_BTNH[:, start:end], k_BSKH[:, :end], v_BSKH[:, :end],
            mask=causal_mask(end - start, end, kv, query_offset=start), implementation="xla"))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def heads_major_attention(q_BTNH, k_BKHS, v_BKSH, mask_B1TS) -> jax.Array:
    """Attention of T queries over a heads-major KV cache: [B, T, N, H] out. The G = N // K query heads sharing a
    kv head are stacked with the T queries into one [G*T, H] block per (row, kv head), so both products are
    plain batched matmuls over (B, K) with the cache as stored: XLA moves no cache bytes besides reading them.
    Same math as jax.nn.dot_product_attention's XLA path (scale after the product, float32 softmax, masked
    logits at a large finite negative: a row that sees no slot averages them, as there)."""
    B, T, N, H = q_BTNH.shape
    K = k_BKHS.shape[1]
    G = N // K
    q_BKQH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)  # Q = (g, t)
    logits_BKQS = jnp.einsum("BKQH,BKHS->BKQS", q_BKQH, k_BKHS)
    logits_BKQS = logits_BKQS * jnp.asarray(H ** -0.5, logits_BKQS.dtype)
    S = k_BKHS.shape[3]
    mask_B1QS = jnp.broadcast_to(mask_B1TS[:, :, None], (B, 1, G, T, S)).reshape(B, 1, G * T, S)
    logits_BKQS = jnp.where(mask_B1QS, logits_BKQS.astype(jnp.float32),
                            jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
    probs_BKQS = jax.nn.softmax(logits_BKQS, axis=-1).astype(v_BKSH.dtype)
    out_BKQH = jnp.einsum("BKQS,BKSH->BKQH", probs_BKQS, v_BKSH)
    return out_BKQH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


# ----------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------

def resolve_attention_impl(config, seq_len: int | None = None) -> str:
    """The attention implementation used for seq_len query tokens (no cache). config: a LlamaConfig."""
    if config.attention_impl != "auto":
        return config.attention_impl
    # cuDNN's fused attention takes 16-bit inputs only; XLA's is the portable path (TPU, fp32 GPU), chunked
    # once the [B, N, T, T] float32 logits get large (64 MiB per head per sequence at T = 4096).
    if jax.default_backend() == "gpu" and config.dtype in ("bfloat16", "float16"):
        return "cudnn"
    if seq_len is None:
        return "xla"
    if jax.default_backend() == "cpu":  # memory is plentiful: skip the masked half of the logits instead
        # 0.64x the XLA attention's fwd+bwd time at B=4, T=512, 8 heads, blocks of 128 (2-core CPU).
        return "blocked" if seq_len >= 2 * config.attention_block_size else "xla"
    return "chunked" if seq_len > AUTO_CHUNKED_MIN_LEN else "xla"


def self_attention(q_BTNH, k_BTKH, v_BTKH, key_valid_BT, config) -> jax.Array:
    """Causal self-attention of T tokens (+ key padding mask [B, T] or None, or segment ids: module note) ->
    [B, T, N, H], by the implementation `resolve_attention_impl` picks for T. config: a LlamaConfig."""
    T = q_BTNH.shape[1]
    impl = resolve_attention_impl(config, T)
    if impl == "chunked":
        return chunked_attention(q_BTNH, k_BTKH, v_BTKH, key_valid_BT, chunk_size=config.attention_chunk_size)
    if impl == "blocked":
        # Under jax.checkpoint: the backward recomputes the blocks' logits and softmax from q, k, v instead of
        # keeping them (float32, heads x ~T/2 keys per token per layer: more than the rest of a SmolLM2 layer's
        # activations at T = 512) for ~3% more step FLOPs; without differentiation nothing changes.
        return jax.checkpoint(functools.partial(blocked_causal_attention, block_size=config.attention_block_size))(
            q_BTNH, k_BTKH, v_BTKH, key_valid_BT)
    if impl == "cudnn" and not is_segments(key_valid_BT):  # packed segments take the XLA path's dense mask
        return fused_causal_attention(q_BTNH, k_BTKH, v_BTKH, key_valid_BT, implementation="cudnn")
    # A padding query row may see no key at all; XLA's attention then averages uniformly (finite).
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=causal_mask(T, T, key_valid_BT),
                                        implementation="xla" if impl == "cudnn" else impl)


def fused_causal_attention(q_BTNH, k_BTKH, v_BTKH, key_valid_BT, *, implementation: str) -> jax.Array:
    """jax.nn.dot_product_attention with its causal flag, so a fused kernel (cuDNN) skips the masked half. Key
    padding on the right (every training batch) goes in as per-row key lengths; any other padding (a sampler's
    left-padded prompts) falls back to the dense [B, 1, T, T] mask, chosen at run time."""
    attend = functools.partial(jax.nn.dot_product_attention, q_BTNH, k_BTKH, v_BTKH, implementation=implementation)
    if key_valid_BT is None:
        return attend(is_causal=True)
    T = key_valid_BT.shape[1]
    lengths_B = jnp.sum(key_valid_BT, axis=1, dtype=jnp.int32)
    right_padded = jnp.all(key_valid_BT == (jnp.arange(T)[None, :] < lengths_B[:, None]))
    # An all-padding row keeps one key: its output is garbage either way (see the module note), never NaN.
    return jax.lax.cond(right_padded,
                        lambda: attend(is_causal=True, key_value_seq_lengths=jnp.maximum(lengths_B, 1)),
                        lambda: attend(mask=causal_mask(T, T, key_valid_BT)))


def cached_attention(q_BTNH, k_BTKH, v_BTKH, layer_cache: dict, cache_pos, mask_B1TS, config):
    """Attention of this step's T queries with the KV cache: (out [B, T, N, H], the updated layer cache).
    Writes this step's K/V at slots [cache_pos, cache_pos + T), then attends over every slot; mask_B1TS is the
    full mask over the cache slots."""
    layer_cache = write_kv_cache(layer_cache, k_BTKH, v_BTKH, cache_pos)
    k_BKHS, v_BKSH = layer_cache["k_BKHS"], layer_cache["v_BKSH"]
    if v_BKSH.shape[2] == q_BTNH.shape[1]:
        # The new tokens fill the whole cache (a prefill, cache_pos 0): causal self-attention over them with the
        # no-cache implementations (on CPU "blocked" skips the masked half: 1.7x at 64 x 256 tokens). The last
        # query row of the mask is the key-valid mask.
        out_BTNH = self_attention(q_BTNH, k_BTKH, v_BTKH, mask_B1TS[:, 0, -1, :], config)
    elif config.attention_impl == "cudnn":  # otherwise few queries over a long, partly empty cache: XLA
        out_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BKHS.transpose(0, 3, 1, 2).astype(q_BTNH.dtype),
            v_BKSH.swapaxes(1, 2).astype(q_BTNH.dtype), mask=mask_B1TS, implementation="cudnn")
    else:
        out_BTNH = heads_major_attention(q_BTNH, k_BKHS.astype(q_BTNH.dtype), v_BKSH.astype(q_BTNH.dtype), mask_B1TS)
    return out_BTNH, layer_cache
