"""The NNX Llama against transformers' LlamaForCausalLM, plus its cache, remat, config and axis names."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import tiny
from sweet_jax.models import Llama, LlamaConfig, load_hf, positions_from_mask

STYLES = ["llama2", "llama31", "llama32"]
B, T, VOCAB = 3, 12, 256


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {style: tiny.make_hf_llama(root / style, style, seed=i) for i, style in enumerate(STYLES)}


def padded_batch(padding: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB, (B, T)).astype(np.int32)
    lengths = np.array([T, 7, 1])  # full row, partial row, a single real token
    mask = np.zeros((B, T), np.int32)
    for b, n in enumerate(lengths):
        if padding == "right":
            mask[b, :n] = 1
        else:
            mask[b, T - n:] = 1
    return input_ids, mask


def torch_logits(model, input_ids, mask, positions):
    with torch.no_grad():
        return model(input_ids=torch.tensor(input_ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()


def rel_max_diff(ours, theirs, valid=None):
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    if valid is not None:
        ours, theirs = ours[valid], theirs[valid]
    return np.abs(ours - theirs).max() / np.abs(theirs).max()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_match_transformers_with_padding(checkpoints, style, padding):
    model = load_hf(checkpoints[style])
    reference = tiny.load_torch(checkpoints[style])
    input_ids, mask = padded_batch(padding)
    positions = np.asarray(positions_from_mask(mask))
    logits = np.asarray(model(input_ids, mask))
    assert logits.shape == (B, T, VOCAB) and logits.dtype == np.float32
    assert np.isfinite(logits).all(), "fully-masked padding query rows must stay finite"
    valid = mask.astype(bool)
    assert rel_max_diff(logits, torch_logits(reference, input_ids, mask, positions), valid) < 1e-4


def test_logits_without_mask_match_transformers(checkpoints):
    model = load_hf(checkpoints["llama31"])
    reference = tiny.load_torch(checkpoints["llama31"])
    input_ids, _ = padded_batch("right")
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(input_ids, dtype=torch.long)).logits.numpy()
    assert rel_max_diff(model(input_ids), theirs) < 1e-4


def test_positions_from_mask_counts_real_tokens():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)
    np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]])


@pytest.mark.parametrize("padding", ["right", "left"])
def test_kv_cache_prefill_then_decode_matches_full_forward(checkpoints, padding):
    model = load_hf(checkpoints["llama31"])
    input_ids, mask = padded_batch(padding)
    full_hidden = np.asarray(model.hidden_states(input_ids, mask))

    # Prefill the first 8 tokens, then feed the remaining ones one at a time (as a sampler would).
    max_len, prefill = 16, 8
    slot_mask = np.zeros((B, max_len), np.int32)
    slot_mask[:, :T] = mask
    positions = np.asarray(positions_from_mask(mask))
    cache = model.init_cache(B, max_len)
    step = jax.jit(lambda m, ids, sm, pos, c, cp: m.hidden_states(ids, sm, pos, cache=c, cache_pos=cp))
    hidden, cache = step(model, input_ids[:, :prefill], slot_mask, positions[:, :prefill], cache, 0)
    pieces = [np.asarray(hidden)]
    for t in range(prefill, T):
        hidden, cache = step(model, input_ids[:, t:t + 1], slot_mask, positions[:, t:t + 1], cache, t)
        pieces.append(np.asarray(hidden))
    cached_hidden = np.concatenate(pieces, axis=1)
    assert len(cache) == 2 and cache[0]["k_BKHS"].shape == (B, 2, 16, max_len)  # heads-major: [B, K, H, S]
    assert cache[0]["v_BKSH"].shape == (B, 2, max_len, 16)
    valid = mask.astype(bool)
    assert rel_max_diff(cached_hidden, full_hidden, valid) < 1e-5


def test_kv_cache_default_positions_follow_slot_mask(checkpoints):
    model = load_hf(checkpoints["llama2"])
    input_ids, mask = padded_batch("left")
    cache = model.init_cache(B, T)
    hidden, _ = model.hidden_states(input_ids, mask, cache=cache, cache_pos=0)
    assert rel_max_diff(hidden, model.hidden_states(input_ids, mask), mask.astype(bool)) < 1e-6


def tiny_grads(remat: str):
    """Gradients of a small loss of a tiny model, and the jaxpr they came from."""
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, remat=remat)
    graphdef, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    input_ids, mask = padded_batch("right")

    def loss(state):
        logits = nnx.merge(graphdef, state)(input_ids, mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return jax.tree.leaves(jax.jit(jax.grad(loss))(state)), str(jax.make_jaxpr(jax.grad(loss))(state))


@pytest.fixture(scope="module")
def grads_without_remat():
    grads, jaxpr = tiny_grads("none")
    assert "remat" not in jaxpr
    return grads


@pytest.mark.parametrize("remat", ["full", "dots_saveable"])
def test_remat_changes_no_gradient(grads_without_remat, remat):
    grads, jaxpr = tiny_grads(remat)
    assert "remat" in jaxpr  # the decoder layers really are checkpointed
    for g, rg in zip(grads_without_remat, grads):
        np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_keeps_float32_params_and_logits(checkpoints):
    model = load_hf(checkpoints["llama31"], config_overrides={"dtype": "bfloat16"})
    reference = load_hf(checkpoints["llama31"])
    assert model.embedder.embedding[...].dtype == jnp.float32
    input_ids, mask = padded_batch("right")
    logits = model(input_ids, mask)
    assert logits.dtype == jnp.float32
    assert model.hidden_states(input_ids, mask).dtype == jnp.bfloat16
    assert model.unembedding().dtype == jnp.bfloat16
    assert rel_max_diff(logits, reference(input_ids, mask), mask.astype(bool)) < 5e-2


def test_unembedding_matches_logits(checkpoints):
    for style in ("llama31", "llama32"):  # untied lm_head, tied embeddings
        model = load_hf(checkpoints[style])
        input_ids, mask = padded_batch("right")
        logits = model.hidden_states(input_ids, mask) @ model.unembedding()
        np.testing.assert_allclose(logits, model(input_ids, mask), rtol=1e-5, atol=1e-5)


def test_every_parameter_has_logical_axes_of_its_rank():
    model = Llama(LlamaConfig.preset("tiny", vocab_size=VOCAB, attention_bias=True, mlp_bias=True), rngs=nnx.Rngs(0))
    allowed = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm"}
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(params) == 3 + 2 * 16  # embedding, lm_head, final norm; per layer 2 norms, 7 kernels, 7 biases
    for path, var in params:
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var[...].ndim and set(names) <= allowed, (path, names)
    spec = nnx.get_partition_spec(nnx.state(model))["layers"][0]["attn"]["q_proj"]["kernel"]
    assert tuple(spec.get_value()) == ("embed", "heads", "head_dim")


def test_num_params_counts_the_parameters():
    for kw in (dict(), dict(tie_word_embeddings=True), dict(attention_bias=True, mlp_bias=True)):
        config = LlamaConfig.preset("tiny", vocab_size=VOCAB, **kw)
        model = Llama(config, rngs=nnx.Rngs(0))
        actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert config.num_params() == actual


def test_presets_have_published_sizes():
    # Parameter counts of the released checkpoints.
    assert LlamaConfig.preset("llama3_1b").num_params() == 1_235_814_400
    assert LlamaConfig.preset("llama3_8b").num_params() == 8_030_261_248
    assert LlamaConfig.preset("llama3_70b").num_params() == 70_553_706_496
    config = LlamaConfig.preset("llama3_8b")
    n_matmul = config.num_params() - config.vocab_size * config.hidden_size
    assert config.flops_per_token(4096) == 6 * n_matmul + 12 * 32 * 32 * 128 * 4096


def test_config_round_trips_through_hf_dict(checkpoints):
    import json
    hf = json.loads((checkpoints["llama31"] / "config.json").read_text())
    config = LlamaConfig.from_hf(hf)
    assert config.rope_type == "llama3" and config.num_kv_heads == 2 and config.eos_token_id == (2, 3)
    assert LlamaConfig.from_hf(config.to_hf()) == config
    assert LlamaConfig.from_hf(LlamaConfig.preset("llama3_8b").to_hf()) == LlamaConfig.preset("llama3_8b")


def attention_grads(attention_impl: str, padding: str | None, **overrides):
    """Logits and parameter gradients of a tiny GQA model (4 query heads over 2 kv heads), float32."""
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, attention_impl=attention_impl, **overrides)
    graphdef, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    input_ids, mask = padded_batch(padding or "right")
    mask = None if padding is None else mask

    def loss(state):
        logits = nnx.merge(graphdef, state)(input_ids, mask)
        valid = jnp.ones((B, T)) if mask is None else mask
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * valid) / valid.sum(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, jax.tree.leaves(grads), str(jax.make_jaxpr(jax.grad(lambda s: loss(s)[0]))(state))


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("chunk", [4, 5])  # T=12: 3 whole blocks; 3 blocks with 3 padded query rows
def test_chunked_attention_matches_xla_in_values_and_gradients(padding, chunk):
    logits, grads, _ = attention_grads("xla", padding)
    chunked_logits, chunked_grads, jaxpr = attention_grads("chunked", padding, attention_chunk_size=chunk)
    assert "scan" in jaxpr and "remat" in jaxpr  # really scanned over checkpointed query blocks
    valid = slice(None) if padding is None else padded_batch(padding)[1].astype(bool)
    assert rel_max_diff(chunked_logits, logits, valid) < 1e-6
    for g, cg in zip(grads, chunked_grads):
        np.testing.assert_allclose(cg, g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("block", [4, 5])  # T=12: key ranges 4, 8, 12; 5, 10, 12 (a ragged last block)
def test_blocked_attention_matches_xla_in_values_and_gradients(padding, block):
    logits, grads, _ = attention_grads("xla", padding)
    blocked_logits, blocked_grads, jaxpr = attention_grads("blocked", padding, attention_block_size=block)
    assert "12,12]" not in jaxpr.replace(" ", "") and f"{block},{block}]" in jaxpr.replace(" ", "")  # triangle skipped
    valid = slice(None) if padding is None else padded_batch(padding)[1].astype(bool)
    assert rel_max_diff(blocked_logits, logits, valid) < 1e-6
    for g, bg in zip(grads, blocked_grads):
        np.testing.assert_allclose(bg, g, rtol=1e-5, atol=1e-7)


def test_chunked_attention_matches_transformers(checkpoints):
    model = load_hf(checkpoints["llama31"], config_overrides={"attention_impl": "chunked",
                                                              "attention_chunk_size": 5})
    reference = tiny.load_torch(checkpoints["llama31"])
    input_ids, mask = padded_batch("left")
    positions = np.asarray(positions_from_mask(mask))
    theirs = torch_logits(reference, input_ids, mask, positions)
    assert rel_max_diff(model(input_ids, mask), theirs, mask.astype(bool)) < 1e-4


def test_auto_attention_blocks_long_sequences_on_cpu():
    from sweet_jax.models.attention import resolve_attention_impl
    config = LlamaConfig.preset("tiny")
    assert config.attention_impl == "auto" and jax.default_backend() == "cpu"
    assert resolve_attention_impl(config, 128) == "xla"
    assert resolve_attention_impl(config, 512) == "blocked"
    assert resolve_attention_impl(config, None) == "xla"
    assert resolve_attention_impl(dataclasses.replace(config, attention_impl="xla"), 4096) == "xla"
    with pytest.raises(ValueError):
        LlamaConfig.preset("tiny", attention_impl="flash")


def test_causal_mask_from_iota_matches_tril_with_offset_and_padding():
    from sweet_jax.models.attention import causal_mask
    key_valid = np.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    np.testing.assert_array_equal(causal_mask(6, 6), np.tril(np.ones((6, 6), bool))[None, None])
    np.testing.assert_array_equal(causal_mask(3, 6, key_valid, query_offset=2),
                                  np.tril(np.ones((6, 6), bool))[None, None, 2:5] & key_valid[:, None, None, :])


@pytest.mark.parametrize("dtype, custom", [("float32", True), ("bfloat16", False)])
def test_the_mlp_uses_the_hand_written_backward_for_float32_compute_only(dtype, custom):
    """bf16 compute (TPU) keeps autodiff's backward: XLA plans it in less memory there (the 8B policy step on
    v5p-8: 61.1 vs 79.0 GiB of temps per chip)."""
    from sweet_jax.models.llama import MLP
    mlp = MLP(LlamaConfig.preset("tiny", dtype=dtype), rngs=nnx.Rngs(0))
    x = jnp.ones((1, 4, mlp.gate_proj.kernel.shape[0]), dtype)
    assert ("custom_vjp_call" in str(jax.make_jaxpr(mlp)(x))) == custom


def test_swiglu_backward_equals_autodiff_of_the_plain_formula():
    """The MLP's hand-written backward: values and all four gradients equal autodiff of the plain expression
    (float64, so only a wrong formula can fail), and in float32 and bfloat16 within rounding."""
    from sweet_jax.models.llama import swiglu

    def plain(x, g, u, d):
        h = jax.nn.silu(jnp.einsum("BTD,DF->BTF", x, g)) * jnp.einsum("BTD,DF->BTF", x, u)
        return jnp.einsum("BTF,FD->BTD", h, d)

    rng = np.random.default_rng(3)
    B, T, D, F = 2, 5, 8, 12
    args = [rng.normal(size=s) for s in ((B, T, D), (D, F), (D, F), (F, D))]
    w = rng.normal(size=(B, T, D))
    with jax.enable_x64(True):
        a64 = [jnp.asarray(x, jnp.float64) for x in args]
        for f in (plain, swiglu):
            np.testing.assert_allclose(f(*a64), plain(*a64), rtol=1e-12)
        want = jax.grad(lambda *a: jnp.sum(w * plain(*a)), argnums=(0, 1, 2, 3))(*a64)
        got = jax.grad(lambda *a: jnp.sum(w * swiglu(*a)), argnums=(0, 1, 2, 3))(*a64)
        for name, g1, g2 in zip(("x", "gate", "up", "down"), got, want):
            np.testing.assert_allclose(g1, g2, rtol=1e-10, atol=1e-12, err_msg=name)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        a = [jnp.asarray(x, dtype) for x in args]
        got = jax.grad(lambda *a: jnp.sum(w * swiglu(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))(*a)
        assert all(g.dtype == dtype for g in got)
        for name, g1, g2 in zip(("x", "gate", "up", "down"), got, want):
            scale = float(np.max(np.abs(g2)))
            np.testing.assert_allclose(np.asarray(g1, np.float64), np.asarray(g2), atol=tol * scale, err_msg=name)


@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_fused_causal_attention_with_key_lengths_matches_the_dense_mask(padding):
    # The cuDNN path's logic (causal flag + per-row key lengths for right padding, the dense mask otherwise)
    # through the same jax.nn.dot_product_attention call on XLA: equal values and gradients on real rows; an
    # all-padding row stays finite.
    from sweet_jax.models.attention import causal_mask, fused_causal_attention
    rng = np.random.default_rng(0)
    Bq, T, N, K, H = 3, 12, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((Bq, T, n, H)), jnp.float32) for n in (N, K, K))
    lengths = np.array([12, 7, 0])
    valid = np.arange(T)[None] < lengths[:, None]
    if padding == "left":
        valid = valid[:, ::-1]
    key_valid = None if padding is None else jnp.asarray(valid)

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=causal_mask(T, T, key_valid), implementation="xla")

    def fused(q, k, v):
        return fused_causal_attention(q, k, v, key_valid, implementation="xla")

    real = np.ones((Bq, T), bool) if padding is None else valid
    weights = jnp.asarray(rng.standard_normal((Bq, T, N, H)), jnp.float32) * real[..., None, None]
    out, grads = jax.value_and_grad(lambda *a: jnp.sum(fused(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    ref, ref_grads = jax.value_and_grad(lambda *a: jnp.sum(dense(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fused(q, k, v))[real], np.asarray(dense(q, k, v))[real], rtol=1e-5,
                               atol=1e-6)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(fused(q, k, v))).all()
    jaxpr = str(jax.make_jaxpr(fused)(q, k, v))
    assert ("cond" in jaxpr) == (padding is not None)
