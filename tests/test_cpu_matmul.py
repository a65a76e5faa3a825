"""model.cpu_matmul: the projections as bfloat16 matmuls on oneDNN (models/cpu_matmul.py) track float32 at tiny
size (forward, gradients, a train step, the sampler), and the fallback keeps today's XLA path."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sweet_jax import config_utils
from sweet_jax.sampling import generate
from sweet_jax.train import steps
from sweet_jax.models import Llama, LlamaConfig, cpu_matmul

CFG = LlamaConfig.preset("tiny", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, cpu_matmul="onednn")
REASON = cpu_matmul.unavailable_reason(single_device=False)
needs_onednn = pytest.mark.skipif(REASON is not None, reason=f"the oneDNN bf16 path cannot run here: {REASON}")


def model_pair(seed=0, **overrides):
    """The same weights as a oneDNN model and an XLA float32 one."""
    fast = Llama(dataclasses.replace(CFG, **overrides), rngs=nnx.Rngs(seed))
    ref = Llama(dataclasses.replace(CFG, **{**overrides, "cpu_matmul": "xla"}), rngs=nnx.Rngs(seed))
    return fast, ref


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


BACKENDS = [pytest.param("xla_bf16"), pytest.param("onednn", marks=needs_onednn)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_equals_the_float32_product_of_bfloat16_rounded_operands(backend):
    x = jax.random.normal(jax.random.key(0), (37, 64))
    w = jax.random.normal(jax.random.key(1), (64, 48))
    y = jax.jit(cpu_matmul.matmul, static_argnums=2)(x, w, backend)
    ref = x.astype(jnp.bfloat16).astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32)
    assert y.dtype == jnp.float32 and y.shape == (37, 48)
    assert rel_err(y, ref) < 1e-5  # float32 accumulation: only the summation order differs


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_activations_round_the_weights_only(backend):
    """Within split_activations() (the sampler's programs), x goes in as two bf16 halves: the product is x's
    float32 values times the bf16-rounded weights to ~2^-16, ten times closer than with x rounded too."""
    x = jax.random.normal(jax.random.key(0), (37, 64))
    w = jax.random.normal(jax.random.key(1), (64, 48))
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    def split(x, w):
        with cpu_matmul.split_activations():
            return cpu_matmul.matmul(x, w, backend)

    y = jax.jit(split)(x, w)
    plain = jax.jit(cpu_matmul.matmul, static_argnums=2)(x, w, backend)
    assert y.dtype == jnp.float32 and y.shape == (37, 48)
    assert rel_err(y, ref) < 5e-5
    assert rel_err(plain, ref) > 10 * rel_err(y, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_gradients_are_the_transposed_products_in_the_operands_dtypes(backend):
    x = jax.random.normal(jax.random.key(0), (20, 32))
    w = jax.random.normal(jax.random.key(1), (32, 24))
    dy = jax.random.normal(jax.random.key(2), (20, 24))
    _, vjp = jax.vjp(lambda x, w: cpu_matmul.matmul(x, w, backend), x, w)
    dx, dw = vjp(dy)
    bf = lambda a: np.asarray(a.astype(jnp.bfloat16), np.float32)  # noqa: E731
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert rel_err(dx, bf(dy) @ bf(w).T) < 1e-5
    assert rel_err(dw, bf(x).T @ bf(dy)) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tied", [False, True])
def test_model_logits_track_float32(backend, tied):
    fast, ref = model_pair(tie_word_embeddings=tied, cpu_matmul=backend)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, 20))
    logits, ref_logits = jax.jit(lambda m, i: m(i))(fast, ids), jax.jit(lambda m, i: m(i))(ref, ids)
    assert logits.dtype == jnp.float32
    assert rel_err(logits, ref_logits) < 2e-2
    assert rel_err(logits, ref_logits) > 0  # bf16 rounding: the bf16 path really ran


def pair_batch(B=4, T=16, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (B, 2, T)).astype(np.int32)
    turns = np.zeros((B, 2, T), np.int32)
    turns[:, :, 6:10], turns[:, :, 11:15] = 1, 2
    return dict(input_ids=ids, attention_mask=np.ones((B, 2, T), np.int32), turn_ids=turns,
                ref_logp=(-rng.uniform(1, 5, (B, 2, T))).astype(np.float32))


def train(model, kind, batch, num_steps):
    optimizer = optax.adamw(1e-3)
    state = steps.create_train_state(model, optimizer)
    loss = config_utils.base_config().loss
    loss.update(kind=kind, beta=0.5)
    step = steps.make_step(steps.loss_spec(loss, chunk_size=8), state, optimizer)
    history = []
    for _ in range(num_steps):
        state, metrics = step(state, batch)
        history.append(float(metrics["loss"]))
    return state, history


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_of_a_pair_loss_track_float32(backend):
    fast, ref = model_pair(cpu_matmul=backend)
    batch = pair_batch()
    spec = steps.LossSpec("critic", beta=0.5, chunk_size=8)

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return jax.jit(jax.grad(lambda p: steps.pair_loss(spec, graphdef, p, rest, batch, None, 4)[0]))(params)

    g, g_ref = jax.tree.leaves(grads(fast)), jax.tree.leaves(grads(ref))
    assert all(a.dtype == jnp.float32 for a in g)  # float32 master weights get float32 gradients
    flat, flat_ref = np.concatenate([np.ravel(a) for a in g]), np.concatenate([np.ravel(a) for a in g_ref])
    cos = flat @ flat_ref / np.linalg.norm(flat) / np.linalg.norm(flat_ref)
    assert cos > 0.99 and 0.95 < np.linalg.norm(flat) / np.linalg.norm(flat_ref) < 1.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["critic", "dpo", "sft"])
def test_train_steps_track_float32(kind, backend):
    fast, ref = model_pair(cpu_matmul=backend)
    batch = pair_batch()
    if kind == "sft":
        batch = {k: v[:, :1] for k, v in batch.items() if k != "ref_logp"}
    state, history = train(fast, kind, batch, 5)
    ref_state, ref_history = train(ref, kind, batch, 5)
    assert history[-1] < history[0]
    np.testing.assert_allclose(history, ref_history, rtol=2e-2, atol=2e-3)
    assert jax.tree.leaves(state.params)[0].dtype == jnp.float32  # master weights stay float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_greedy_tokens_match_the_float32_sampler(backend):
    fast, ref = model_pair(cpu_matmul=backend)
    prompts = [list(np.random.default_rng(i).integers(3, CFG.vocab_size, 5 + i % 8)) for i in range(32)]

    def greedy(model):
        out = generate.Sampler(model, None, max_batch_size=32).generate(prompts, max_new_tokens=24, temperature=0.0)
        return [list(g[0].token_ids) for g in out]

    tokens = greedy(fast)
    same = sum(a == b for a, b in zip(tokens, greedy(ref)))
    assert same >= 28, same  # bf16 weights may flip a near-tie on a random tiny model (29 of 32 rows here)
    # What the sampler computes: float32 activations against bf16-rounded weights (split_activations). With the
    # activations rounded too (no split), one of these 32 rows differs from it.
    graphdef, state = nnx.split(ref)
    rounded = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32),
                                                         generate._bf16_kernels(state)))
    assert tokens == greedy(rounded)


@pytest.fixture
def fresh_choice():
    """bf16_backend and sampler_backend decide once per process: forget them before and after a test that fakes
    the machine."""
    def forget():
        cpu_matmul._load.cache_clear(), cpu_matmul.bf16_backend.cache_clear(), cpu_matmul.sampler_backend.cache_clear()
    forget()
    yield
    forget()


def fake_machine(monkeypatch, flags, *, compiler=True):
    monkeypatch.setattr(cpu_matmul, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    if not compiler:
        monkeypatch.setattr(cpu_matmul, "_compiler", lambda: None)


BF16_UNITS = [pytest.param(("amx_bf16", "avx512_bf16"), id="amx"), pytest.param(("avx512_bf16",), id="avx512_bf16")]


@pytest.mark.parametrize("flags", BF16_UNITS)
def test_auto_without_a_compiler_uses_xla_bf16_and_says_why_in_one_line(monkeypatch, caplog, fresh_choice, flags):
    fake_machine(monkeypatch, flags, compiler=False)
    with caplog.at_level(logging.INFO, logger="sweet_jax.models.cpu_matmul"):
        assert cpu_matmul.bf16_backend("auto") == "xla_bf16"
        assert cpu_matmul.bf16_backend("auto") == "xla_bf16"  # decided once per process
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and flags[0] in lines[0] and "compiler" in lines[0], lines
    with pytest.raises(cpu_matmul.CpuMatmulError, match="compiler"):
        cpu_matmul.bf16_backend("onednn")


@needs_onednn
@pytest.mark.parametrize("flags", BF16_UNITS)
def test_auto_with_bf16_units_uses_onednn(monkeypatch, fresh_choice, flags):
    fake_machine(monkeypatch, flags)
    assert cpu_matmul.bf16_backend("auto") == "onednn"


@pytest.mark.parametrize("flags", BF16_UNITS)
def test_auto_samples_in_bf16_only_on_amx_and_says_so_in_one_line(monkeypatch, caplog, fresh_choice, flags):
    """On AVX512-BF16 without AMX, auto trains in bf16 but samples in float32: the sampler's tokens and log-probs
    are the float32 model's, bit for bit; on AMX the sampler runs the bf16 matmuls (its log-probs differ)."""
    fake_machine(monkeypatch, flags, compiler=False)  # xla_bf16: runs on any host
    fast, ref = model_pair(cpu_matmul="auto", hidden_size=cpu_matmul.AUTO_MIN_HIDDEN, head_dim=64)
    prompts = [list(np.random.default_rng(i).integers(3, CFG.vocab_size, 5 + i % 4)) for i in range(4)]

    def sample(model):
        out = generate.Sampler(model, None, max_batch_size=4).generate(prompts, max_new_tokens=6, temperature=1.0,
                                                                       seed=3, ignore_eos=True)
        return [list(g[0].token_ids) for g in out], np.array([g[0].logprobs for g in out])

    with caplog.at_level(logging.INFO, logger="sweet_jax.models.cpu_matmul"):
        tokens, logprobs = sample(fast)
        assert cpu_matmul.bf16_backend("auto") == "xla_bf16"  # training's choice either way
    ref_tokens, ref_logprobs = sample(ref)
    sampler_lines = [r.getMessage() for r in caplog.records if "sampler" in r.getMessage()]
    if "amx_bf16" in flags:
        assert cpu_matmul.sampler_backend("auto") == "xla_bf16" and not sampler_lines
        assert not np.array_equal(logprobs, ref_logprobs)
    else:
        assert cpu_matmul.sampler_backend("auto") is None
        assert len(sampler_lines) == 1 and "float32" in sampler_lines[0], sampler_lines
        assert tokens == ref_tokens
        np.testing.assert_array_equal(logprobs, ref_logprobs)
    assert cpu_matmul.sampler_backend("xla_bf16") == "xla_bf16"  # an explicit mode samples in bf16


def test_auto_keeps_today_s_float32_path_where_the_processor_has_no_bf16_units(monkeypatch, fresh_choice):
    fake_machine(monkeypatch, ())
    assert cpu_matmul.bf16_backend("auto") is None
    assert "amx_bf16" in cpu_matmul.unavailable_reason(single_device=False)
    fast, ref = model_pair(cpu_matmul="auto")
    ids = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(fast(ids), ref(ids))  # bit for bit


def test_auto_keeps_today_s_path_on_a_multi_device_process(fresh_choice):
    assert jax.device_count() > 1  # tests/conftest.py: 8 host devices
    assert cpu_matmul.bf16_backend("auto") is None
    assert "devices" in cpu_matmul.unavailable_reason()


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ValueError, match="cpu_matmul='amx'"):
        LlamaConfig.preset("tiny", cpu_matmul="amx")


def test_training_config_declares_the_field_and_passes_it_to_the_model():
    c = config_utils.base_config()
    assert c.model.cpu_matmul == "auto"
    c.model.cpu_matmul = "xla"
    assert config_utils.model_overrides(c)["cpu_matmul"] == "xla"


def test_auto_keeps_float32_for_models_too_narrow_for_bf16_to_pay():
    narrow = dataclasses.replace(CFG, cpu_matmul="auto", hidden_size=cpu_matmul.AUTO_MIN_HIDDEN // 2)
    wide = dataclasses.replace(CFG, cpu_matmul="auto", hidden_size=cpu_matmul.AUTO_MIN_HIDDEN)
    assert narrow.matmul == "xla" and wide.matmul == "auto"
    assert dataclasses.replace(narrow, cpu_matmul="onednn").matmul == "onednn"  # an explicit choice stands


def test_loaded_models_and_samplers_take_the_configured_mode(tmp_path):
    """The pipeline's samplers load Hugging Face checkpoints with its model.cpu_matmul (a user's 'xla' keeps
    float32 in every stage), also when a loaded sampler is reused for the next policy; without one, the default."""
    import tiny
    from sweet_jax.data import demo_paths
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.train.model_loading import load_model

    tok_dir = demo_paths().tokenizer
    hf_dir = tiny.make_hf_llama(tmp_path / "hf", vocab_size=len(load_tokenizer(str(tok_dir))))
    assert load_model(str(hf_dir))[0].config.cpu_matmul == LlamaConfig.cpu_matmul
    assert load_model(str(hf_dir), cpu_matmul="xla")[0].config.cpu_matmul == "xla"
    sampler = generate.load_sampler(str(hf_dir), str(tok_dir), cpu_matmul="xla_bf16")
    assert sampler.model.config.cpu_matmul == "xla_bf16"
    again = generate.load_sampler(str(hf_dir), str(tok_dir), cpu_matmul="xla_bf16", reuse=sampler)
    assert again is sampler and again.model.config.cpu_matmul == "xla_bf16"
