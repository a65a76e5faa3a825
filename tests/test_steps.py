"""sweet_jax.train.steps on a tiny Llama: sharded == single device, accumulation == full batch, the critic learns."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sweet_jax import config_utils, sharding
from sweet_jax.train import losses, steps
from sweet_jax.train.optimizer import LayerwiseOptimizer, make_optimizer, make_schedule, stacked_layer_mask
from sweet_jax.models import Llama, LlamaConfig

CFG = LlamaConfig.preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
MESHES = [(8, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2)]


def make_model(seed=0):
    return Llama(CFG, rngs=nnx.Rngs(seed))


def pair_batch(B=8, T=24, P_=2, seed=0, side="mixed"):
    """Pairs with several uneven turns; side 'mixed': even rows right-padded, odd rows left-padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CFG.vocab_size, (B, P_, T)).astype(np.int32)
    mask = np.zeros((B, P_, T), np.int32)
    turns = np.zeros((B, P_, T), np.int32)
    for b in range(B):
        for p in range(P_):
            n = int(rng.integers(T // 2, T + 1))
            left = side == "left" or (side == "mixed" and b % 2 == 1)
            start = T - n if left else 0
            mask[b, p, start:start + n] = 1
            pos, k = start + 2, 1
            while pos < start + n - 1:
                length = int(rng.integers(1, 5))
                turns[b, p, pos:min(pos + length, start + n)] = k
                pos, k = pos + length + 2, k + 1
    ids = np.where(mask > 0, ids, 0)
    return dict(input_ids=ids, attention_mask=mask, turn_ids=turns,
                ref_logp=(-rng.uniform(1, 5, (B, P_, T))).astype(np.float32))


def loss_spec(kind, **fields):
    """The LossSpec of a training config's loss section (kind as the config names it: critic, dpo, mtdpo, rft)."""
    loss = config_utils.base_config().loss
    loss.update(kind=kind, **fields)
    return steps.loss_spec(loss, chunk_size=8)


def run_step(kind, mesh_shape, batch, *, optimizer=None, micro_batch_size=0, num_steps=1, host_loop=None,
             length_multiple=128):
    optimizer = optimizer or optax.sgd(0.1)
    mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape)
    state = steps.create_train_state(make_model(), optimizer, mesh)
    step = steps.make_step(loss_spec(kind, beta=0.5, nll_coef=0.0 if kind == "critic" else 0.1), state, optimizer,
                           mesh, micro_batch_size=micro_batch_size, host_loop=host_loop,
                           length_multiple=length_multiple)
    for _ in range(num_steps):
        state, metrics = step(state, batch)
    return state, jax.device_get(metrics)


def flat_params(state):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state.params)}


@pytest.fixture(scope="module")
def single_device_results():
    batch = pair_batch()
    return batch, {kind: run_step(kind, None, batch) for kind in ("critic", "dpo")}


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("kind", ["critic", "dpo"])
def test_sharded_step_equals_single_device(single_device_results, kind, mesh_shape):
    batch, results = single_device_results
    ref_state, ref_metrics = results[kind]
    state, metrics = run_step(kind, mesh_shape, batch)
    for name in ("loss", "accuracy", "margin", "chosen_score", "grad_norm", "num_tokens"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=2e-5, atol=1e-6, err_msg=name)
    want = flat_params(ref_state)
    for name, value in flat_params(state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert int(state.step) == 1

    # parameters really follow the logical rules on this mesh
    mesh = sharding.make_mesh(mesh_shape)
    lm_head = state.params["lm_head"]["kernel"][...]
    assert lm_head.sharding.spec == sharding.spec_for_shape(lm_head.shape, P("fsdp", "tensor"), mesh)
    gate = state.params["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    assert gate.addressable_shards[0].data.shape == (CFG.hidden_size // fsdp, CFG.intermediate_size // tensor)
    embedding = state.params["embedder"]["embedding"][...]
    assert embedding.addressable_shards[0].data.shape == (CFG.vocab_size // tensor, CFG.hidden_size // fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("host_loop", [False, True])
@pytest.mark.parametrize("kind", ["critic", "dpo", "rft"])
def test_gradient_accumulation_equals_full_batch(kind, host_loop):
    batch = pair_batch(P_=1 if kind == "rft" else 2, seed=1)
    batch["weight"] = np.array([1, 1, 1, 1, 1, 1, 0, 1], np.float32)  # a padding example is ignored in both
    full_state, full = run_step(kind, None, batch, host_loop=False)
    micro_state, micro = run_step(kind, None, batch, micro_batch_size=2, host_loop=host_loop)
    for name in full:
        np.testing.assert_allclose(micro[name], full[name], rtol=1e-5, atol=1e-6, err_msg=name)
    want = flat_params(full_state)
    for name, value in flat_params(micro_state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_auto_micro_batch_fits_the_activation_budget():
    big = dataclasses.replace(CFG, num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                              num_kv_heads=3, head_dim=64)  # SmolLM2-135M's layers
    per_pair = 2 * 512 * steps.activation_bytes_per_token(big)
    assert steps.auto_micro_batch_size(big, (8, 2, 512), budget_bytes=4 * per_pair) == 4
    assert steps.auto_micro_batch_size(big, (8, 2, 512), budget_bytes=3 * per_pair) == 2  # a divisor of 8
    assert steps.auto_micro_batch_size(big, (8, 2, 512), budget_bytes=per_pair // 2) == 1  # none fits: smallest
    assert steps.auto_micro_batch_size(big, (8, 2, 512), budget_bytes=per_pair, batch_devices=4) == 4  # per device
    remat = dataclasses.replace(big, remat="full")  # only each layer's input is kept
    assert steps.activation_bytes_per_token(remat) == 30 * 576 * 4
    assert steps.auto_micro_batch_size(CFG, (8, 2, 24)) == 8  # a small model: the whole batch at once


def test_automatic_micro_batches_equal_the_full_batch(monkeypatch):
    """micro_batch_size=0 with a batch over the activation budget accumulates micro-batches (a scan in the step)
    and gives the full batch's loss and parameters."""
    batch = pair_batch(seed=3)
    full_state, full = run_step("critic", None, batch, micro_batch_size=8)
    per_pair = 2 * 24 * steps.activation_bytes_per_token(CFG)
    monkeypatch.setattr(steps, "ACTIVATION_BUDGET_BYTES", 2 * per_pair)
    assert steps.auto_micro_batch_size(CFG, (8, 2, 24)) == 2
    optimizer = optax.sgd(0.1)
    state = steps.create_train_state(make_model(), optimizer)
    step = steps.make_step(steps.LossSpec("critic", beta=0.5, chunk_size=8), state, optimizer, host_loop=False)
    assert "scan" in str(jax.make_jaxpr(step)(state, batch))
    auto_state, auto = step(state, batch)
    np.testing.assert_allclose(auto["loss"], full["loss"], rtol=1e-5)
    want = flat_params(full_state)
    for name, value in flat_params(auto_state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["critic", "dpo", "rft"])
def test_host_loop_runs_each_micro_batch_at_its_own_length_with_the_same_step(kind, side):
    """On one CPU device the micro-batches run from the host, grouped by length and each cut to its own
    longest sequence (rounded up to length_multiple): the same loss, metrics and parameters as one program
    over the batch padded to its longest."""
    batch = pair_batch(P_=1 if kind == "rft" else 2, seed=4, side=side)
    full_state, full = run_step(kind, None, batch, host_loop=False)
    optimizer = optax.sgd(0.1)
    state = steps.create_train_state(make_model(), optimizer)
    step = steps.make_step(loss_spec(kind, beta=0.5, nll_coef=0.0 if kind == "critic" else 0.1), state, optimizer,
                           micro_batch_size=1, length_multiple=8, share_prefix=False)
    assert isinstance(step, steps.HostLoopStep)   # the default on one CPU device
    state, metrics = step(state, batch)
    lengths = [shape[-1] for shape in step.last_micro_shapes]
    assert lengths == sorted(lengths) and min(lengths) < 24 and set(lengths) <= {16, 24}
    for name in full:
        np.testing.assert_allclose(metrics[name], full[name], rtol=1e-5, atol=1e-6, err_msg=name)
    want = flat_params(full_state)
    for name, value in flat_params(state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_micro_batches_on_a_sharded_mesh_equal_full_batch_single_device():
    batch = pair_batch(B=16, seed=2)
    _, full = run_step("critic", None, batch)
    _, micro = run_step("critic", (2, 2, 2), batch, micro_batch_size=8)
    np.testing.assert_allclose(micro["loss"], full["loss"], rtol=1e-5)
    np.testing.assert_allclose(micro["grad_norm"], full["grad_norm"], rtol=1e-4)


def test_batch_not_divisible_into_micro_batches_is_an_error():
    with pytest.raises(steps.StepConfigError, match="micro_batch_size"):
        run_step("critic", None, pair_batch(B=6), micro_batch_size=4)


def test_ref_logp_pass_matches_model_logits_and_in_step_reference():
    model = make_model()
    batch = pair_batch(B=4, seed=3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_fn = steps.make_ref_logp_fn(graphdef, rest=rest, chunk_size=8)
    ref_logp = np.asarray(ref_fn(params, batch))
    ids, mask = batch["input_ids"].reshape(8, -1), batch["attention_mask"].reshape(8, -1)
    want = losses.token_logprobs_naive(model(ids, mask), ids).reshape(ref_logp.shape)
    np.testing.assert_allclose(ref_logp, want, rtol=1e-5, atol=1e-5)

    # Precomputed reference in the batch == reference params passed to the step (stop_gradient'ed).
    optimizer = optax.sgd(0.1)
    frozen = jax.tree.map(jnp.copy, params)
    results = []
    for in_step in (False, True):
        state = steps.create_train_state(make_model(), optimizer)
        step = steps.make_step(steps.LossSpec("critic", chunk_size=8), state, optimizer, ref_in_step=in_step)
        b = dict(batch, ref_logp=ref_logp)
        if in_step:
            del b["ref_logp"]
            state, metrics = step(state, b, frozen)
        else:
            state, metrics = step(state, b)
        results.append((flat_params(state), jax.device_get(metrics)))
    np.testing.assert_allclose(results[0][1]["loss"], results[1][1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(results[0][1]["loss"], np.log(2), rtol=1e-6)  # critic == reference at start
    for name, value in results[1][0].items():
        np.testing.assert_allclose(value, results[0][0][name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_score_step_returns_per_turn_advantages():
    batch = pair_batch(B=4, P_=1, seed=4)
    critic = make_model(seed=1)
    graphdef, params, rest = nnx.split(critic, nnx.Param, ...)
    ref_params = nnx.split(make_model(seed=0), nnx.Param, ...)[1]
    mesh = sharding.make_mesh((1, 4, 2))
    score = steps.make_score_step(graphdef, sharding.param_shardings(params, mesh), mesh, num_turns=6, rest=rest,
                                  ref_in_step=True, chunk_size=8)
    adv = np.asarray(score(params, batch, ref_params))
    assert adv.shape == (4, 1, 6)
    ids, mask = batch["input_ids"][:, 0], batch["attention_mask"][:, 0]
    logp = losses.token_logprobs_naive(critic(ids, mask), ids)
    ref = losses.token_logprobs_naive(nnx.merge(graphdef, ref_params, rest)(ids, mask), ids)
    want = losses.turn_advantages(logp, ref, batch["turn_ids"][:, 0], num_turns=6, norm="turn_mean")
    np.testing.assert_allclose(adv[:, 0], want, rtol=1e-4, atol=1e-5)
    assert np.abs(adv).max() > 0
    # Scoring against a precomputed reference gives the same advantages.
    score_ref = steps.make_score_step(graphdef, num_turns=6, rest=rest, chunk_size=8)
    np.testing.assert_allclose(score_ref(params, dict(batch, ref_logp=np.asarray(ref)[:, None])), adv,
                               rtol=1e-4, atol=1e-5)


def test_schedule_warms_up_then_decays_to_a_tenth():
    schedule = make_schedule(1.0, 100)
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(3)), 1.0, rtol=1e-6)  # 3% warm-up
    assert float(schedule(50)) < 1.0
    np.testing.assert_allclose(float(schedule(100)), 0.1, rtol=1e-6)


def test_optimizer_clips_the_global_gradient_norm():
    optimizer = make_optimizer(1.0, 10, warmup_ratio=0.0, b1=0.0, b2=0.0, clip=1.0)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # norm 50 -> clipped to 1, then adam with b2=0 normalises
    clipped = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]
    np.testing.assert_allclose(optax.tree.norm(clipped), 1.0, rtol=1e-6)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"][:2], [-1.0, -1.0], rtol=1e-5)


def test_policy_kinds_run_and_unknown_kind_is_rejected():
    for kind, P_ in (("mtdpo", 2), ("rft", 1)):
        state, metrics = run_step(kind, None, pair_batch(B=2, P_=P_, seed=5))
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    with pytest.raises(steps.StepConfigError, match="kind"):
        loss_spec("ppo")
    with pytest.raises(steps.StepConfigError, match="kind"):
        steps.LossSpec("rft")  # the config's rft trains with the sft loss
    with pytest.raises(steps.StepConfigError, match="nll_scope"):
        loss_spec("dpo", nll_scope="prompt")


def test_critic_learns_a_fixed_set_of_pairs():
    # Chosen trajectories answer with tokens from one half of the vocabulary, rejected with the other: the
    # critic must learn to raise the chosen answers' log-probs relative to the frozen reference.
    rng = np.random.default_rng(6)
    B, T = 8, 16
    ids = rng.integers(3, CFG.vocab_size, (B, 2, T)).astype(np.int32)
    ids[:, 1, :8] = ids[:, 0, :8]  # same prompt
    ids[:, 0, 8:] = rng.integers(3, 32, (B, 8))
    ids[:, 1, 8:] = rng.integers(32, 64, (B, 8))
    turns = np.zeros((B, 2, T), np.int32)
    turns[:, :, 8:12], turns[:, :, 13:16] = 1, 2
    batch = dict(input_ids=ids, attention_mask=np.ones((B, 2, T), np.int32), turn_ids=turns)
    optimizer = make_optimizer(3e-3, 30)
    state = steps.create_train_state(make_model(), optimizer)
    ref_fn = steps.make_ref_logp_fn(state.graphdef, rest=state.rest, chunk_size=8)
    batch["ref_logp"] = ref_fn(state.params, batch)
    step = steps.make_step(steps.LossSpec("critic", beta=1.0, chunk_size=8), state, optimizer,
                           lr_schedule=make_schedule(3e-3, 30))
    history = []
    for _ in range(31):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    assert history[0]["accuracy"] <= 0.5 + 1e-6  # starts as the reference: no preference
    assert history[-1]["accuracy"] > 0.9, [h["accuracy"] for h in history]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["margin"] > 0


def test_adam_moments_are_sharded_like_their_parameters():
    mesh = sharding.make_mesh((1, 4, 2))
    optimizer = make_optimizer(1e-3, 10)
    state = steps.create_train_state(make_model(), optimizer, mesh)
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
    param_specs = jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, state.params))
    for moments in (adam.mu, adam.nu):
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, moments)) == param_specs
    gate = adam.mu["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    assert gate.addressable_shards[0].data.shape == (CFG.hidden_size // 4, CFG.intermediate_size // 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind, P_", [("critic", 2), ("dpo", 2), ("mtdpo", 2), ("rft", 1)])
def test_scored_positions_give_the_same_step_as_every_position(kind, P_):
    """batch['score_pos'] (log-probs at the action tokens only) changes the work, not the loss: the same metrics
    and the same parameters after two steps, with micro-batches and on a sharded mesh too."""
    from sweet_jax.data import batching
    batch = pair_batch(B=8, P_=P_, seed=7)
    most = int((batch["turn_ids"] > 0).sum(-1).max())
    S = most + 3  # padded with -1
    assert S < batch["input_ids"].shape[-1]
    scored = dict(batch, score_pos=batching.score_positions(batch["turn_ids"], S))
    full_state, full_metrics = run_step(kind, None, batch, num_steps=2)
    for mesh_shape, micro in ((None, 0), (None, 4), ((2, 2, 2), 0)):
        state, metrics = run_step(kind, mesh_shape, scored, num_steps=2, micro_batch_size=micro)
        for key in full_metrics:
            np.testing.assert_allclose(metrics[key], full_metrics[key], rtol=2e-5, atol=1e-6, err_msg=key)
        for (k, a), b in zip(flat_params(full_state).items(), flat_params(state).values()):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=k)


def test_bfloat16_moments_follow_adamw_with_moments_rounded_each_step():
    """Independent numpy AdamW (clip, bias correction, decoupled weight decay) whose two moments are stored
    rounded to bfloat16 after every step: the optimiser's updates and stored moments match it; float32 moments differ."""
    import ml_dtypes

    lr, b1, b2, eps, wd, clip = 1e-2, 0.9, 0.95, 1e-8, 0.1, 1.0
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64,)).astype(np.float32)}
    grads = [{"w": (rng.normal(size=(64,)) * 10 ** rng.uniform(-3, 0, 64)).astype(np.float32)} for _ in range(5)]
    tx = make_optimizer(lr, 10, warmup_ratio=0.0, final_ratio=1.0, b1=b1, b2=b2, weight_decay=wd,
                              clip=clip, moments_dtype="bfloat16")
    state = tx.init(params)
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.bfloat16

    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    p, mu, nu = params["w"].astype(np.float64), np.zeros(64), np.zeros(64)
    jp = params
    for t, g in enumerate(grads, start=1):
        gn = g["w"].astype(np.float64)
        gn = gn * min(1.0, clip / np.linalg.norm(gn))
        mu, nu = b1 * mu + (1 - b1) * gn, b2 * nu + (1 - b2) * gn ** 2  # this step's update reads them unrounded
        update = -lr * ((mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t)) + eps) + wd * p)
        mu, nu = bf16(mu).astype(np.float64), bf16(nu).astype(np.float64)  # ... and stores them rounded
        p = p + update
        updates, state = tx.update(g, state, jp)
        jp = optax.apply_updates(jp, updates)
        np.testing.assert_allclose(np.asarray(updates["w"]), update, rtol=2e-3, atol=1e-7, err_msg=f"step {t}")
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    np.testing.assert_array_equal(np.asarray(adam.nu["w"], np.float32), nu.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(adam.mu["w"], np.float32), mu.astype(np.float32))
    # float32 moments give a different trajectory: the rounding is what the numpy reference models.
    tx32 = make_optimizer(lr, 10, warmup_ratio=0.0, final_ratio=1.0, b1=b1, b2=b2, weight_decay=wd, clip=clip)
    s32, p32 = tx32.init(params), params
    for g in grads:
        u, s32 = tx32.update(g, s32, p32)
        p32 = optax.apply_updates(p32, u)
    assert np.abs(np.asarray(p32["w"]) - np.asarray(jp["w"])).max() > 1e-6


@pytest.mark.slow
def test_bfloat16_moments_halve_the_optimiser_state_and_train_sharded():
    batch = pair_batch()
    opt32 = make_optimizer(1e-3, 10, warmup_ratio=0.0)
    opt16 = make_optimizer(1e-3, 10, warmup_ratio=0.0, moments_dtype="bfloat16")
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    params = nnx.state(make_model(), nnx.Param)
    assert nbytes(jax.eval_shape(opt16.init, params)) * 2 == pytest.approx(nbytes(jax.eval_shape(opt32.init, params)),
                                                                            rel=1e-3)
    single, m1 = run_step("critic", None, batch, optimizer=opt16, num_steps=3)
    sharded, m8 = run_step("critic", (1, 4, 2), batch, optimizer=opt16, num_steps=3)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-4)
    for name, value in flat_params(sharded).items():
        np.testing.assert_allclose(value, flat_params(single)[name], rtol=1e-3, atol=1e-5, err_msg=name)
    with pytest.raises(steps.StepConfigError, match="moments_dtype"):
        make_optimizer(1e-3, 10, moments_dtype="float16")


@pytest.mark.slow
def test_sharded_unembedding_gradient_gives_the_same_step(monkeypatch):
    """Under the trainer's jax.set_mesh the chunked log-prob backward accumulates the unembedding gradient
    sharded like the unembedding (losses._chunked_label_logprobs); it gives the same update as XLA's own
    layout of the autodiff scan (steps.unembed_grad_spec -> None) on a (1, 4, 2) mesh of 8 devices."""
    batch = pair_batch()
    mesh = sharding.make_mesh((1, 4, 2))
    results = {}
    for name in ("sharded", "xla"):
        if name == "xla":
            monkeypatch.setattr(steps, "unembed_grad_spec", lambda shape: None)
        with jax.set_mesh(mesh):
            results[name] = run_step("dpo", (1, 4, 2), batch, num_steps=2)  # SGD: the update is the gradient
    (state, metrics), (ref_state, ref_metrics) = results["sharded"], results["xla"]
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    want = flat_params(ref_state)
    for name, value in flat_params(state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_sharded_unembedding_gradient_is_sharded_and_exact():
    """losses.label_logprobs with unembed_grad_spec: the same gradients as the autodiff scan, and the compiled
    backward holds less than the whole float32 [D, V] accumulator of the other per device."""
    D, V, N = 64, 4096, 256
    rng = np.random.default_rng(0)
    mesh = sharding.make_mesh((1, 4, 2))
    hidden = jax.device_put(rng.normal(size=(8, N, D)).astype(np.float32), sharding.batch_sharding(mesh, 3))
    unembed = jax.device_put((rng.normal(size=(D, V)) / 8).astype(np.float32),
                             jax.sharding.NamedSharding(mesh, P("fsdp", "tensor")))
    labels = jax.device_put(rng.integers(0, V, (8, N)).astype(np.int32), sharding.batch_sharding(mesh, 2))
    compiled, grads = {}, {}
    for name, spec in (("sharded", P("fsdp", "tensor")), ("xla", None)):
        fn = jax.jit(jax.grad(lambda h, w: (losses.label_logprobs(h, w, labels, chunk_size=128,
                                                                  unembed_grad_spec=spec) ** 2).sum(), (0, 1)))
        with jax.set_mesh(mesh):
            compiled[name] = fn.lower(hidden, unembed).compile()
            grads[name] = fn(hidden, unembed)
    for a, b in zip(grads["sharded"], grads["xla"]):  # float32 sums in another order: ~1e-7 of the largest entry
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6 * np.abs(np.asarray(b)).max())
    assert grads["sharded"][1].sharding.spec == P("fsdp", "tensor")
    temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temps["sharded"] < temps["xla"], temps


@pytest.mark.slow
def test_offloaded_optimiser_state_trains_like_the_device_one():
    """optim.offload_state: the moments live in host memory between steps (on the CPU backend its
    'pinned_host' memory kind is the same RAM) and the step gives the same parameters and moments."""
    batch = pair_batch()
    mesh = sharding.make_mesh((1, 4, 2))
    optimizer = make_optimizer(1e-2, 10, warmup_ratio=0.0)
    results = {}
    for offload in (False, True):
        state = steps.create_train_state(make_model(), optimizer, mesh, offload_opt_state=offload)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2}
        assert kinds == ({steps.HOST_MEMORY} if offload else {"device"})
        step = steps.make_step(steps.LossSpec("critic", beta=0.5, chunk_size=8), state, optimizer, mesh)
        for _ in range(3):
            state, metrics = step(state, batch)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2} == kinds
        results[offload] = state, jax.device_get(metrics)
    (off, m_off), (dev, m_dev) = results[True], results[False]
    np.testing.assert_array_equal(m_off["loss"], m_dev["loss"])
    for name, value in flat_params(off).items():
        np.testing.assert_array_equal(value, flat_params(dev)[name], err_msg=name)
    for a, b in zip(jax.tree.leaves(off.opt_state), jax.tree.leaves(dev.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("moments, offload", [("float32", False), ("bfloat16", True)])
def test_layerwise_update_of_stacked_layers_equals_the_whole_stack_update(moments, offload):
    """optim.layerwise_update: the train step runs AdamW over a scan_layers model's stacked layers one layer at a
    time (jax.lax.map), offloaded moments a layer at a time too; the parameters and moments after three steps
    are the chain's, with the same state structure (checkpoints do not change)."""
    batch = pair_batch()
    mesh = sharding.make_mesh((1, 4, 2))
    model_config = dataclasses.replace(CFG, scan_layers=True)
    results = {}
    for layerwise in (False, True):
        optimizer = make_optimizer(1e-2, 10, warmup_ratio=0.0, weight_decay=0.1, clip=0.5,
                                         moments_dtype=moments, layerwise=layerwise)
        assert isinstance(optimizer, LayerwiseOptimizer) == layerwise
        state = steps.create_train_state(Llama(model_config, rngs=nnx.Rngs(0)), optimizer, mesh,
                                         offload_opt_state=offload)
        step = steps.make_step(steps.LossSpec("critic", beta=0.5, chunk_size=8), state, optimizer, mesh)
        if layerwise and not offload:  # really a loop over the layers, the stacked leaves sliced inside it
            jaxpr = str(jax.make_jaxpr(functools.partial(steps._apply_grads, optimizer, None, None))(
                state, state.params, {}))
            assert "scan" in jaxpr and "dynamic_slice" in jaxpr
        for _ in range(3):
            state, metrics = step(state, batch)
        results[layerwise] = state, jax.device_get(metrics)
    (lw, m_lw), (whole, m_whole) = results[True], results[False]
    np.testing.assert_allclose(m_lw["loss"], m_whole["loss"], rtol=1e-6)
    for name, value in flat_params(lw).items():
        np.testing.assert_allclose(value, flat_params(whole)[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert jax.tree.structure(lw.opt_state) == jax.tree.structure(whole.opt_state)
    for a, b in zip(jax.tree.leaves(lw.opt_state), jax.tree.leaves(whole.opt_state)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-9)
        assert a.sharding.memory_kind == b.sharding.memory_kind


def test_stacked_layer_mask_marks_scanned_layers_only():
    for scan in (True, False):
        params = nnx.state(Llama(dataclasses.replace(CFG, scan_layers=scan), rngs=nnx.Rngs(0)), nnx.Param)
        marked = {jax.tree_util.keystr(k): m for k, m in jax.tree_util.tree_leaves_with_path(
            stacked_layer_mask(params))}
        assert any(marked.values()) == scan
        assert all(m == (scan and k.startswith("['layers']")) for k, m in marked.items())


# ---------------------------------------------------------------------------------------------------------
# A pair's shared prefix run once


def prefix_pair_batch(seed=0, T=24):
    """Right-padded pairs whose sequences share a prefix of 0 to all of the shorter one's tokens: rows 0-4 a
    prefix of 0, 1, 5, 9 and 11 tokens, row 5 a rejected sequence that is the chosen one's prefix, row 6 two
    identical sequences, row 7 a filler (one pad token, weight 0)."""
    batch = pair_batch(B=8, T=T, seed=seed, side="right")   # every sequence has >= T / 2 tokens
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = mask.sum(-1)
    for b, k in enumerate((0, 1, 5, 9, 11)):
        ids[b, 1, :k] = ids[b, 0, :k]
        ids[b, 1, k] = 3 + (ids[b, 0, k] - 2) % (CFG.vocab_size - 3)   # and differ right after it
    shorter = int(n[5].min())
    ids[5, 1, :shorter] = ids[5, 0, :shorter]
    mask[5, 1] = np.arange(T) < shorter
    mask[5, 0] = np.arange(T) < T
    for key in ("input_ids", "attention_mask", "turn_ids"):
        batch[key][6, 1] = batch[key][6, 0]
    batch["input_ids"][7], batch["attention_mask"][7], batch["turn_ids"][7] = 0, 0, 0
    batch["attention_mask"][7, :, 0] = 1
    batch["weight"] = np.array([1] * 7 + [0], np.float32)
    batch["input_ids"] = np.where(batch["attention_mask"] > 0, ids, 0).astype(np.int32)
    batch["turn_ids"] = np.where(batch["attention_mask"] > 0, batch["turn_ids"], 0).astype(np.int32)
    return batch


def test_a_packed_row_holds_the_shared_prefix_once_and_each_sequence_at_its_positions():
    from sweet_jax.data import batching
    batch = prefix_pair_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    packed = batching.pack_shared_prefix(ids, mask, length_multiple=8)
    n = mask.sum(-1)
    shared = [0, 1, 5, 9, 11, int(n[5].min()), int(n[6, 0]), 1]
    for b in range(8):
        k = shared[b]
        assert np.all(ids[b, 0, :k] == ids[b, 1, :k]) and (k == n[b].min() or ids[b, 0, k] != ids[b, 1, k])
        segments = packed["packed_segments"][b]
        assert np.count_nonzero(segments == 1) == k
        assert np.count_nonzero(segments) == k + (n[b] - k).sum()   # the prefix once, then each one's rest
        for p in range(2):
            where = packed["packed_index"][b, p, :n[b, p]]
            np.testing.assert_array_equal(packed["packed_ids"][b, where], ids[b, p, :n[b, p]])
            np.testing.assert_array_equal(packed["packed_positions"][b, where], np.arange(n[b, p]))
            np.testing.assert_array_equal(segments[where], np.where(np.arange(n[b, p]) < k, 1, p + 2))
    assert packed["packed_ids"].shape[1] % 8 == 0
    left = pair_batch(B=2, side="left")
    assert batching.pack_shared_prefix(left["input_ids"], left["attention_mask"], length_multiple=8) is None
    assert batching.pack_shared_prefix(ids, mask, length_multiple=48) is None   # not fewer tokens than 2 x 24


@pytest.mark.parametrize("impl", ["xla", "blocked", "chunked"])
@pytest.mark.parametrize("scored", [False, True])
def test_packed_pairs_give_the_log_probs_of_each_sequence_run_alone(impl, scored):
    """The attention's segments keep each sequence from the other's tokens: every label log-prob of a packed row
    equals the one of its sequence run alone, for each attention implementation (blocks and chunks of 8 queries,
    so the segments cross block edges)."""
    from sweet_jax.data import batching
    cfg = dataclasses.replace(CFG, attention_impl=impl, attention_block_size=8, attention_chunk_size=8)
    model = Llama(cfg, rngs=nnx.Rngs(3))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = prefix_pair_batch(seed=5)
    if scored:
        batch["score_pos"] = batching.score_positions(batch["turn_ids"], 12)
    packed = dict(batch, **batching.pack_shared_prefix(batch["input_ids"], batch["attention_mask"],
                                                       length_multiple=8))
    alone = steps._pair_logprobs(graphdef, params, rest, batch, None)
    together = steps._pair_logprobs(graphdef, params, rest, packed, None)
    scored_mask = (batch["score_pos"] > 0) if scored else (batch["attention_mask"] > 0)
    np.testing.assert_allclose(np.where(scored_mask, together, 0), np.where(scored_mask, alone, 0),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["critic", "dpo", "mtdpo"])
def test_a_shared_prefix_step_equals_the_side_by_side_step(kind):
    """HostLoopStep(share_prefix=True) runs each pair as one packed row (fewer tokens) and takes the same two
    steps as the pairs side by side: the same metrics and parameters."""
    batch = prefix_pair_batch(seed=9)
    results = {}
    for share in (False, True):
        optimizer = optax.sgd(0.1)
        state = steps.create_train_state(make_model(), optimizer)
        step = steps.make_step(loss_spec(kind, beta=0.5, nll_coef=0.0 if kind == "critic" else 0.1), state,
                               optimizer, micro_batch_size=2, length_multiple=8, share_prefix=share)
        for _ in range(2):
            state, metrics = step(state, batch)
        results[share] = (state, jax.device_get(metrics), list(step.last_micro_shapes), step.last_run_tokens)
    (side_state, side, side_shapes, side_tokens), (state, packed, shapes, tokens) = results[False], results[True]
    # [mb, P, T] side by side; [mb, L] packed, where that runs fewer tokens (not for the pairs with no prefix)
    assert all(len(s) == 3 for s in side_shapes) and sum(len(s) == 2 for s in shapes) >= 3
    assert tokens < side_tokens == int(batch["attention_mask"].sum())
    for name in side:
        np.testing.assert_allclose(packed[name], side[name], rtol=2e-5, atol=1e-6, err_msg=name)
    want = flat_params(side_state)
    for name, value in flat_params(state).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
