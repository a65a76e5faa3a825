"""sweet_jax.train.losses against independent numpy implementations, on hand-built turns with padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest


from sweet_jax.train import losses

NORMS = ("turn_mean", "trajectory_mean", "sum")


# ---- numpy references (loops, written from the paper's formulas, no shared code) ----

def np_logsumexp(x):
    m = x.max()
    return m + np.log(np.exp(x - m).sum())


def np_token_logprobs(logits_BTV, ids_BT):
    B, T, _ = logits_BTV.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(1, T):
            row = logits_BTV[b, t - 1].astype(np.float64)
            out[b, t] = row[ids_BT[b, t]] - np_logsumexp(row)
    return out


def np_turn_advantages(logp, ref, turns, num_turns, norm):
    B = logp.shape[0]
    out = np.zeros((B, num_turns))
    for b in range(B):
        n_action = sum(1 for t in turns[b] if t > 0)
        for k in range(1, num_turns + 1):
            deltas = [logp[b, t] - ref[b, t] for t in range(len(turns[b])) if turns[b][t] == k]
            if not deltas:
                continue
            if norm == "turn_mean":
                out[b, k - 1] = sum(deltas) / len(deltas)
            elif norm == "trajectory_mean":
                out[b, k - 1] = sum(deltas) / n_action
            else:
                out[b, k - 1] = sum(deltas)
    return out


def np_log_sigmoid(x):
    return -np.log1p(np.exp(-x))


# ---- hand-built batch: 3 rows, several uneven turns, left and right padding ----

TURNS = np.array([
    # right padded, 3 turns of lengths 2, 3, 1 separated by user tokens (0)
    [0, 0, 1, 1, 0, 0, 2, 2, 2, 0, 3, 0, 0, 0],
    # left padded, 2 turns of lengths 4 and 1
    [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 2, 0, 0],
    # a single long turn, no padding
    [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
], np.int32)


def random_logps(seed, shape=TURNS.shape):
    rng = np.random.default_rng(seed)
    return -rng.uniform(0.1, 5.0, shape).astype(np.float32), -rng.uniform(0.1, 5.0, shape).astype(np.float32)


@pytest.mark.parametrize("norm", NORMS)
def test_turn_advantages_match_numpy(norm):
    logp, ref = random_logps(0)
    got = losses.turn_advantages(logp, ref, TURNS, num_turns=4, norm=norm)
    want = np_turn_advantages(logp, ref, TURNS, 4, norm)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[:, 3] == 0)  # no 4th turn anywhere


@pytest.mark.parametrize("norm", NORMS)
def test_trajectory_advantage_is_sum_of_turns_and_matches_official_trajectory_mean(norm):
    logp, ref = random_logps(1)
    got = losses.trajectory_advantage(logp, ref, TURNS, norm=norm)  # no bound on turns needed
    want = np_turn_advantages(logp, ref, TURNS, 3, norm).sum(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if norm == "trajectory_mean":  # official code: one mean over all action tokens
        for b in range(3):
            m = TURNS[b] > 0
            np.testing.assert_allclose(got[b], (logp[b][m] - ref[b][m]).mean(), rtol=1e-5)


def test_unknown_advantage_norm_is_rejected():
    logp, ref = random_logps(2)
    with pytest.raises(losses.LossConfigError, match="advantage_norm"):
        losses.turn_advantages(logp, ref, TURNS, num_turns=3, norm="mean")
    with pytest.raises(losses.LossConfigError, match="advantage_norm"):
        losses.trajectory_advantage(logp, ref, TURNS, norm="mean")


@pytest.mark.parametrize("norm", NORMS)
def test_turn_advantages_invariant_to_padding_side_and_amount(norm):
    logp, ref = random_logps(3, (1, 9))
    turns = np.array([[0, 1, 1, 0, 2, 2, 2, 0, 3]], np.int32)
    base = losses.turn_advantages(logp, ref, turns, num_turns=3, norm=norm)
    for left, right in [(0, 5), (5, 0), (3, 7)]:
        # padding positions carry garbage log-probs: they must not count
        pad = lambda x, fill: np.concatenate(  # noqa: E731
            [np.full((1, left), fill, np.float32), x, np.full((1, right), fill, np.float32)], 1)
        t = np.concatenate([np.zeros((1, left), np.int32), turns, np.zeros((1, right), np.int32)], 1)
        got = losses.turn_advantages(pad(logp, -9.0), pad(ref, 7.0), t, num_turns=3, norm=norm)
        np.testing.assert_allclose(got, base, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", ("turn_mean", "sum"))
def test_turn_advantages_of_sequences_packed_in_one_row(norm):
    # Two sequences side by side in one row; the second one's turns are numbered after the first's.
    logp, ref = random_logps(4, (2, 7))
    turns = np.array([[0, 1, 1, 0, 2, 0, 0], [0, 0, 1, 0, 2, 2, 0]], np.int32)
    single = losses.turn_advantages(logp, ref, turns, num_turns=2, norm=norm)
    packed_turns = np.concatenate([turns[0], np.where(turns[1] > 0, turns[1] + 2, 0)])[None]
    packed = losses.turn_advantages(logp.reshape(1, -1), ref.reshape(1, -1), packed_turns,
                                    num_turns=4, norm=norm)
    np.testing.assert_allclose(packed.reshape(2, 2), single, rtol=1e-6)


@pytest.mark.slow
def test_chunked_logprobs_match_numpy_and_naive_values_and_gradients():
    rng = np.random.default_rng(5)
    B, T, D, V = 2, 23, 8, 37
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    unembed = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)

    naive = lambda h, w: losses.token_logprobs_naive(jnp.einsum("btd,dv->btv", h, w), ids)  # noqa: E731
    want = np_token_logprobs(np.asarray(hidden @ unembed), np.asarray(ids))
    np.testing.assert_allclose(naive(hidden, unembed), want, rtol=1e-5, atol=1e-5)
    for chunk in (1, 5, 22, 64):  # uneven last chunk, exact fit, one chunk larger than T
        got = losses.token_logprobs(hidden, unembed, ids, chunk_size=chunk)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(got)[:, 0] == 0)

        g_chunk = jax.grad(lambda h, w: jnp.sum(weights * losses.token_logprobs(h, w, ids, chunk_size=chunk)),
                           argnums=(0, 1))(hidden, unembed)
        g_naive = jax.grad(lambda h, w: jnp.sum(weights * naive(h, w)), argnums=(0, 1))(hidden, unembed)
        for a, b in zip(g_chunk, g_naive):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_never_build_full_float32_logits():
    B, T, D, V, chunk = 1, 2048, 16, 4096, 128
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))

    def temp_bytes(fn):
        f = jax.jit(jax.grad(lambda h, w, i: fn(h, w, i).sum(), argnums=(0, 1)))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    full_logits = B * T * V * 4
    chunked = temp_bytes(lambda h, w, i: losses.token_logprobs(h, w, i, chunk_size=chunk))
    naive = temp_bytes(lambda h, w, i: losses.token_logprobs_naive(jnp.einsum("btd,dv->btv", h, w), i))
    assert naive >= full_logits
    assert chunked < full_logits / 4, (chunked, full_logits)


def test_chunks_are_cut_over_the_whole_batch_not_per_sequence():
    # 32 sequences of 64 positions: each fits one 128-position chunk, the batch does not; cutting per sequence
    # would hold all [32, 63, V] float32 logits (and their cotangent) at once.
    B, T, D, V, chunk = 32, 64, 16, 4096, 128
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    grad = jax.jit(jax.grad(lambda h, w, i: losses.token_logprobs(h, w, i, chunk_size=chunk).sum(), argnums=(0, 1)))
    temps = grad.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temps < B * (T - 1) * V * 4 / 4, temps


def test_default_chunk_holds_a_fixed_budget_of_logits():
    assert losses.logits_chunk_positions(49152) * 49152 * 4 <= losses.LOGITS_CHUNK_BYTES
    assert losses.logits_chunk_positions(49152) == losses.LOGITS_CHUNK_BYTES // (4 * 49152)
    assert losses.logits_chunk_positions(49152, 7) == 7
    with pytest.raises(losses.LossConfigError):
        losses.logits_chunk_positions(49152, 0)


def test_single_chunk_logprobs_keep_logits_for_backward_instead_of_recomputing():
    # One chunk holds all the logits anyway, so the backward reuses them: 3 unembedding matmuls, not 4.
    B, T, D, V = 1, 65, 16, 4096
    args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
            jax.ShapeDtypeStruct((B, T), jnp.int32))
    grad = jax.jit(jax.grad(lambda h, w, i: losses.token_logprobs(h, w, i, chunk_size=T).sum(), argnums=(0, 1)))
    cost = grad.lower(*args).compile().cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    matmul = 2 * B * (T - 1) * D * V
    assert 3 * matmul <= flops < 3.5 * matmul, flops / matmul


def test_bf16_logprob_gradients_keep_dtypes_and_match_naive():
    rng = np.random.default_rng(12)
    h = jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(8, 11)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 11, (2, 9)), jnp.int32)
    naive = lambda h, w: losses.token_logprobs_naive(  # noqa: E731
        jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), ids).sum()
    want = jax.grad(naive, argnums=(0, 1))(h, w)
    for chunk in (3, 64):
        got = jax.grad(lambda h, w: losses.token_logprobs(h, w, ids, chunk_size=chunk).sum(), argnums=(0, 1))(h, w)
        for g, n in zip(got, want):
            assert g.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(n, np.float32), rtol=0.02, atol=0.02)


def test_bt_loss_matches_numpy_with_padding_examples():
    rng = np.random.default_rng(6)
    s_pos, s_neg = rng.normal(size=5).astype(np.float32), rng.normal(size=5).astype(np.float32)
    weight = np.array([1, 1, 1, 1, 0], np.float32)
    loss, m = losses.bt_loss(s_pos, s_neg, beta=0.1, weight_B=weight)
    real = slice(0, 4)
    want = np.mean(-np_log_sigmoid(0.1 * (s_pos[real].astype(np.float64) - s_neg[real])))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(m["accuracy"], np.mean(s_pos[real] > s_neg[real]), rtol=1e-6)
    np.testing.assert_allclose(m["margin"], np.mean(s_pos[real] - s_neg[real]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["chosen_score"], np.mean(s_pos[real]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["rejected_score"], np.mean(s_neg[real]), rtol=1e-5, atol=1e-6)


def test_bt_loss_with_split_denominator_adds_up_to_full_batch():
    rng = np.random.default_rng(7)
    s_pos, s_neg = rng.normal(size=6), rng.normal(size=6)
    full, m_full = losses.bt_loss(s_pos, s_neg, beta=0.5)
    parts = [losses.bt_loss(s_pos[i:i + 2], s_neg[i:i + 2], beta=0.5, denom=6.0) for i in (0, 2, 4)]
    np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-5)
    np.testing.assert_allclose(sum(p[1]["accuracy"] for p in parts), m_full["accuracy"], rtol=1e-6)


@pytest.mark.parametrize("label_smoothing", (0.0, 0.2))
def test_dpo_loss_on_reply_tokens_matches_numpy(label_smoothing):
    rng = np.random.default_rng(8)
    B, T = 3, 10
    logp = -rng.uniform(0.1, 3, (B, 2, T)).astype(np.float32)
    ref = -rng.uniform(0.1, 3, (B, 2, T)).astype(np.float32)
    turns = np.zeros((B, 2, T), np.int32)
    reply_lengths = [(3, 5), (1, 2), (6, 4)]  # uneven chosen / rejected lengths, replies at the end
    for b, (lc, lr) in enumerate(reply_lengths):
        turns[b, 0, T - lc:] = 1
        turns[b, 1, T - lr:] = 1
    (sc, nc), (sr, _) = (losses.reply_logprobs(logp[:, i], turns[:, i]) for i in (0, 1))
    (rc, _), (rr, _) = (losses.reply_logprobs(ref[:, i], turns[:, i]) for i in (0, 1))
    loss, m = losses.dpo_loss(sc, sr, rc, rr, beta=0.1, label_smoothing=label_smoothing,
                              chosen_nll_B=-sc / nc, nll_coef=0.01)
    want, accs, nlls, chosen_logps = [], [], [], []
    for b, (lc, lr) in enumerate(reply_lengths):
        pc, pr = logp[b, 0, T - lc:].sum(), logp[b, 1, T - lr:].sum()
        chosen_logps.append(pc)
        qc, qr = ref[b, 0, T - lc:].sum(), ref[b, 1, T - lr:].sum()
        h = 0.1 * ((pc - qc) - (pr - qr))
        nll = -logp[b, 0, T - lc:].mean()
        want.append(-(1 - label_smoothing) * np_log_sigmoid(h) - label_smoothing * np_log_sigmoid(-h)
                    + 0.01 * nll)
        accs.append(h > 0)
        nlls.append(nll)
    np.testing.assert_allclose(loss, np.mean(want), rtol=1e-5)
    np.testing.assert_allclose(m["accuracy"], np.mean(accs))
    np.testing.assert_allclose(m["nll"], np.mean(nlls), rtol=1e-5)
    np.testing.assert_allclose(m["chosen_logp"], np.mean(chosen_logps), rtol=1e-5)


def test_sft_loss_is_token_mean_nll_over_action_tokens_of_real_examples():
    logp, _ = random_logps(9)
    weight = np.array([1, 0, 1], np.float32)
    loss, _ = losses.sft_loss(logp, TURNS, weight_B=weight)
    toks = np.concatenate([logp[0][TURNS[0] > 0], logp[2][TURNS[2] > 0]])
    np.testing.assert_allclose(loss, -toks.mean(), rtol=1e-5)


def test_gradients_of_critic_and_dpo_losses_match_finite_differences():
    rng = np.random.default_rng(10)
    turns = np.array([[0, 1, 1, 0, 2], [0, 0, 1, 1, 1]], np.int32)
    with jax.enable_x64(True):
        ref = jnp.asarray(-rng.uniform(0.1, 2, (2, 2, 5)))
        x0 = jnp.asarray(-rng.uniform(0.1, 2, (2, 2, 5)))

        def critic(logp):
            s = [losses.trajectory_advantage(logp[:, i], ref[:, i], turns, norm="turn_mean")
                 for i in (0, 1)]
            return losses.bt_loss(s[0], s[1], beta=0.7)[0]

        def dpo(logp):
            (sc, nc), (sr, _) = (losses.reply_logprobs(logp[:, i], turns) for i in (0, 1))
            (rc, _), (rr, _) = (losses.reply_logprobs(ref[:, i], turns) for i in (0, 1))
            return losses.dpo_loss(sc, sr, rc, rr, beta=0.3, label_smoothing=0.1,
                                   chosen_nll_B=-sc / nc, nll_coef=0.5)[0]

        for fn in (critic, dpo):
            g = np.asarray(jax.grad(fn)(x0))
            assert np.all(np.isfinite(g)) and np.abs(g).sum() > 0
            eps = 1e-6
            for idx in np.ndindex(x0.shape):
                e = np.zeros(x0.shape)
                e[idx] = eps
                fd = (fn(x0 + e) - fn(x0 - e)) / (2 * eps)
                np.testing.assert_allclose(g[idx], fd, rtol=1e-5, atol=1e-8)
            # non-action tokens get exactly zero gradient
            assert np.all(g[:, :, 0] == 0)


@pytest.mark.slow
def test_token_logprobs_gradient_matches_finite_differences():
    rng = np.random.default_rng(11)
    with jax.enable_x64(True):
        h = jnp.asarray(rng.normal(size=(1, 5, 3)))
        w = jnp.asarray(rng.normal(size=(3, 6)))
        ids = jnp.asarray(rng.integers(0, 6, (1, 5)), jnp.int32)
        fn = lambda h, w: jnp.sum(jnp.arange(5) * losses.token_logprobs(h, w, ids, chunk_size=2))  # noqa
        gh, gw = jax.grad(fn, argnums=(0, 1))(h, w)
        eps = 1e-6
        for x, g, which in ((h, gh, 0), (w, gw, 1)):
            for idx in np.ndindex(x.shape):
                e = np.zeros(x.shape)
                e[idx] = eps
                args_p = (h + e, w) if which == 0 else (h, w + e)
                args_m = (h - e, w) if which == 0 else (h, w - e)
                np.testing.assert_allclose(g[idx], (fn(*args_p) - fn(*args_m)) / (2 * eps), rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_logprobs_at_positions_equal_the_full_sequence_ones_read_there():
    """token_logprobs_at(positions) == token_logprobs(...)[positions] (0 at padding -1 and at position 0), values
    and gradients, single chunk and several."""
    rng = np.random.default_rng(11)
    B, T, D, V, S = 3, 29, 8, 41, 12
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    unembed = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    pos = np.full((B, S), -1, np.int32)
    pos[0, :5] = [0, 3, 4, 5, 28]          # position 0 predicts nothing
    pos[1, :S] = np.arange(10, 10 + S)     # full
    pos[2, :2] = [1, 2]
    pos = jnp.asarray(pos)
    weights = jnp.asarray(rng.normal(size=(B, S)), jnp.float32)

    def full_at(h, w, chunk):
        logp = losses.token_logprobs(h, w, ids, chunk_size=chunk)
        return jnp.where(pos >= 0, jnp.take_along_axis(logp, jnp.maximum(pos, 0), axis=1), 0.0)

    for chunk in (4, 64):
        got = losses.token_logprobs_at(hidden, unembed, ids, pos, chunk_size=chunk)
        np.testing.assert_allclose(got, full_at(hidden, unembed, chunk), rtol=1e-5, atol=1e-6)
        assert np.asarray(got)[0, 0] == 0 and np.all(np.asarray(got)[2, 2:] == 0)
        g_at = jax.grad(lambda h, w: jnp.sum(weights * losses.token_logprobs_at(h, w, ids, pos, chunk_size=chunk)),
                        argnums=(0, 1))(hidden, unembed)
        g_full = jax.grad(lambda h, w: jnp.sum(weights * full_at(h, w, chunk)), argnums=(0, 1))(hidden, unembed)
        for a, b in zip(g_at, g_full):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
