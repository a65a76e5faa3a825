"""Batching: bucketed shapes, padding sides, deterministic epochs, exact resume, per-host shards."""
import json

import numpy as np
import pytest

from sweet_jax.data import Rendered
from sweet_jax.data.batching import BatchError, BatchIterator, bucket_lengths, collate, example_lengths, host_range


def make_examples(n=37, P=2, seed=0, max_len=300):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        seqs = []
        for _ in range(P):
            T = int(rng.integers(5, max_len))
            ids = rng.integers(3, 100, size=T).astype(np.int32)
            ids[0] = i + 1000  # identifies the example
            turns = np.zeros(T, np.int32)
            turns[T // 2:] = 1
            seqs.append(Rendered(ids, turns, (T // 2,)))
        out.append(tuple(seqs))
    return out


def example_ids(batch):
    return [int(x) - 1000 for x in batch["input_ids"][:, 0, 0]]


def test_bucket_lengths_are_few_and_cover_max_len():
    assert bucket_lengths(1000, 128) == (128, 256, 512, 1024)
    assert bucket_lengths(8192, 128) == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert bucket_lengths(100, 128) == (128,)


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_pads_and_masks(side):
    ex = make_examples(n=3, P=2)
    batch = collate(ex, length=512, pad_id=7, padding_side=side)
    assert {k: v.shape for k, v in batch.items()} == {"input_ids": (3, 2, 512), "attention_mask": (3, 2, 512),
                                                      "turn_ids": (3, 2, 512), "weight": (3,)}
    assert batch["input_ids"].dtype == np.int32 and batch["weight"].dtype == np.float32
    for b in range(3):
        for p in range(2):
            seq, n = ex[b][p], len(ex[b][p])
            sl = slice(0, n) if side == "right" else slice(512 - n, 512)
            np.testing.assert_array_equal(batch["input_ids"][b, p, sl], seq.input_ids)
            np.testing.assert_array_equal(batch["turn_ids"][b, p, sl], seq.turn_ids)
            assert batch["attention_mask"][b, p].sum() == n and batch["attention_mask"][b, p, sl].all()
            assert (batch["input_ids"][b, p][batch["attention_mask"][b, p] == 0] == 7).all()
            assert (batch["turn_ids"][b, p][batch["attention_mask"][b, p] == 0] == 0).all()


def test_each_epoch_covers_every_example_once_with_bucketed_shapes():
    ex = make_examples()
    it = BatchIterator(ex, batch_size=8, seed=3, max_len=300, bucket_size=64, num_epochs=2)
    assert it.steps_per_epoch == 5 and it.filler_rows_per_epoch == 3  # 37 = 5 * 8 - 3
    epochs = [[], []]
    for e in (0, 0, 0, 0, 0, 1, 1, 1, 1, 1):  # 5 batches per epoch
        batch = next(it)
        assert batch["input_ids"].shape[-1] in (64, 128, 256, 320)
        longest = batch["attention_mask"].sum(-1).max()
        assert batch["input_ids"].shape[-1] == min(b for b in (64, 128, 256, 320) if b >= longest)
        epochs[e] += [i for i, w in zip(example_ids(batch), batch["weight"]) if w == 1]
    with pytest.raises(StopIteration):
        next(it)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(37))
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    # Fillers: weight 0, a single pad token each (attention on it only, no trained token).
    fillers = [(s, r) for s in range(5) for r in range(8) if it.batch_ids(0, s)[r] < 0]
    assert len(fillers) == 3
    for s, r in fillers:
        batch = it.batch_at(0, s)
        assert batch["weight"][r] == 0 and batch["attention_mask"][r].sum() == 2  # P = 2 sequences
        assert batch["turn_ids"][r].sum() == 0


def test_order_depends_only_on_seed_and_epoch():
    ex = make_examples()
    a = BatchIterator(ex, batch_size=8, seed=5)
    b = BatchIterator(ex, batch_size=8, seed=5)
    c = BatchIterator(ex, batch_size=8, seed=6)
    assert [example_ids(next(a)) for _ in range(5)] == [example_ids(next(b)) for _ in range(5)]
    assert not np.array_equal(a.epoch_table(0), c.epoch_table(0))
    # Unshuffled: row r walks chunk r (a contiguous slice of the list) in order.
    table = BatchIterator(ex, batch_size=8, shuffle=False).epoch_table(3)
    assert table[:, 0].tolist() == [0, 1, 2, 3, -1] and table[:, 1].tolist() == [4, 5, 6, 7, 8]
    longest = BatchIterator(ex, batch_size=8, shuffle=False, longest_first=True)
    lengths = [max(len(s) for s in ex[i]) for i in longest.epoch_table(0)[:, 1]]
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("stop_after", [1, 4, 5, 7])
def test_resume_yields_exactly_the_remaining_batches(stop_after):
    ex = make_examples()
    kwargs = dict(batch_size=8, seed=11, max_len=300, num_epochs=2)
    uninterrupted = list(BatchIterator(ex, **kwargs))
    first = BatchIterator(ex, **kwargs)
    seen = [next(first) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state()))  # goes through a checkpoint as JSON
    resumed = BatchIterator(ex, **kwargs)
    resumed.restore(state)
    rest = list(resumed)
    assert len(seen) + len(rest) == len(uninterrupted) == 10
    for got, want in zip(seen + rest, uninterrupted):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_restore_refuses_a_different_dataset():
    it = BatchIterator(make_examples(), batch_size=8, seed=1)
    next(it)
    other = BatchIterator(make_examples(n=20), batch_size=8, seed=1)
    with pytest.raises(BatchError, match="num_examples"):
        other.restore(it.state())


def simulated_hosts(examples, n, *, drop=(), **kwargs):
    """n hosts in one process: each holds only its host_range slice (minus `drop`, the examples its length
    policy dropped) and is told every host's lengths, as gather_lengths would."""
    N, B = len(examples), kwargs["batch_size"]
    kept = [[i for i in host_range(N, B, p, n) if i not in drop] for p in range(n)]
    ids = np.concatenate([np.array(k, np.int64) for k in kept])
    lengths = example_lengths([examples[i] for i in ids], scored=kwargs.get("score_positions", False))
    return [BatchIterator([examples[i] for i in kept[p]], example_ids=kept[p], num_global=N, process_index=p,
                          process_count=n, global_lengths=(ids, lengths), **kwargs) for p in range(n)]


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_slices_are_disjoint_and_cover_the_examples(hosts):
    for N in (37, 5, 8, 0):
        slices = [set(host_range(N, 8, p, hosts)) for p in range(hosts)]
        assert set().union(*slices) == set(range(N))
        assert sum(len(s) for s in slices) == N  # disjoint
        # Contiguous: neighbouring examples (pairs of one task) stay on one host.
        assert all(s == set(range(min(s), max(s) + 1)) for s in slices if s)


@pytest.mark.parametrize("hosts, score_positions", [(2, False), (4, False), (2, True)])
def test_hosts_build_the_single_host_batches_from_their_own_slices(hosts, score_positions):
    """Each host holds only its slice; the rows of all hosts make exactly the single-host batch, every host
    with the same T (and S) and number of steps, also when the length policy dropped examples on some host."""
    ex = make_examples()
    kwargs = dict(batch_size=8, seed=2, max_len=300, num_epochs=2, score_positions=score_positions)
    for drop in ((), (3, 20, 36)):
        keep = [i for i in range(len(ex)) if i not in drop]
        single = BatchIterator([ex[i] for i in keep], example_ids=keep, num_global=len(ex), **kwargs)
        parts = simulated_hosts(ex, hosts, drop=drop, **kwargs)
        assert {h.steps_per_epoch for h in parts} == {single.steps_per_epoch}
        assert {h.filler_rows_per_epoch for h in parts} == {single.filler_rows_per_epoch} == {3 + len(drop)}
        steps = 0
        for want in single:
            got = [next(h) for h in parts]
            assert all(g["input_ids"].shape == (8 // hosts, 2, want["input_ids"].shape[-1]) for g in got)
            for k in want:
                np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k])
            steps += 1
        assert steps == 2 * single.steps_per_epoch
        for h in parts:
            with pytest.raises(StopIteration):
                next(h)


def test_resume_on_hosts_is_exact_and_needs_no_host_count():
    """A position saved by a 2-host run resumes a 4-host run (or one host) at exactly the next batch."""
    ex = make_examples()
    kwargs = dict(batch_size=8, seed=7, max_len=300, num_epochs=2)
    want = list(BatchIterator(ex, **kwargs))
    two = simulated_hosts(ex, 2, **kwargs)
    for _ in range(6):
        [next(h) for h in two]
    state = json.loads(json.dumps(two[0].state()))
    assert state == two[1].state()
    four = simulated_hosts(ex, 4, **kwargs)
    for h in four:
        h.restore(state)
    rest = [[next(h) for h in four] for _ in range(len(want) - 6)]
    for got, expected in zip(rest, want[6:]):
        for k in expected:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), expected[k])


def test_a_host_without_examples_still_builds_filler_rows():
    ex = make_examples(n=3)
    hosts = simulated_hosts(ex, 4, batch_size=8, num_sequences=2)  # 3 examples over 8 rows: host 0 holds none
    assert [len(h.examples) for h in hosts] == [0, 1, 1, 1]
    batches = [next(h) for h in hosts]
    assert [b["weight"].tolist() for b in batches] == [[0, 0], [1, 0], [0, 1], [0, 1]]
    assert len({b["input_ids"].shape for b in batches}) == 1


def test_drop_last_counts_the_examples_it_leaves_out():
    it = BatchIterator(make_examples(), batch_size=8, seed=0, drop_last=True)  # chunk sizes 4 and 5
    assert it.steps_per_epoch == 4 and it.filler_rows_per_epoch == 0 and it.unused_per_epoch == 5
    used = [int(i) for s in range(4) for i in it.batch_ids(0, s)]
    assert -1 not in used and len(set(used)) == 32


def test_extras_travel_with_their_tokens():
    """Per-token arrays (e.g. reference log-probs) are padded and placed like the tokens they belong to."""
    ex = make_examples(n=5)
    ref = [tuple(np.arange(len(s), dtype=np.float32) + 1 for s in e) for e in ex]
    for side in ("right", "left"):
        it = BatchIterator(ex, batch_size=4, seed=0, padding_side=side, extras={"ref_logp": ref})
        for step in range(it.steps_per_epoch):
            batch = it.batch_at(0, step)
            assert batch["ref_logp"].dtype == np.float32 and batch["ref_logp"].shape == batch["input_ids"].shape
            for row, i in enumerate(it.local_indices(0, step)):
                for p in range(2):
                    mask = batch["attention_mask"][row, p] == 1
                    want = ref[i][p] if i >= 0 else np.zeros(1, np.float32)
                    np.testing.assert_array_equal(batch["ref_logp"][row, p][mask], want)
                    assert (batch["ref_logp"][row, p][~mask] == 0).all()
    with pytest.raises(BatchError, match="ref_logp"):
        collate(ex[:1], length=512, extras={"ref_logp": [(np.zeros(3), np.zeros(3))]})


def test_bad_configs_are_explained():
    ex = make_examples(n=4)
    with pytest.raises(BatchError, match="multiple of process_count"):
        BatchIterator(ex, batch_size=6, process_count=4)
    with pytest.raises(BatchError, match="no examples"):
        BatchIterator([], batch_size=2)
    with pytest.raises(BatchError, match="exceeds the largest bucket"):
        BatchIterator(ex, batch_size=2, buckets=(64,)).batch_at(0, 0)
    with pytest.raises(BatchError, match="holds examples"):  # host 1 of 2 given host 0's slice
        BatchIterator(ex[:2], batch_size=2, example_ids=[0, 1], num_global=4, process_index=1, process_count=2,
                      global_lengths=([0, 1], [5, 5]))


def test_score_positions_list_the_action_tokens_of_each_row():
    """score_pos holds each sequence's action-token positions (either padding side), then -1, over T // 2 slots
    when every row of the batch has at most T // 2 action tokens; it is left out otherwise."""
    ex = make_examples(n=16, max_len=300)
    for i in (2, 5):  # two examples whose action tokens fill more than half of their bucket
        ex[i] = tuple(Rendered(s.input_ids, np.ones_like(s.turn_ids), s.reply_starts) for s in ex[i])
    it = BatchIterator(ex, batch_size=4, max_len=300, shuffle=False, score_positions=True, padding_side="left")
    kinds = set()
    for _ in range(it.steps_per_epoch):
        batch = next(it)
        T = batch["input_ids"].shape[-1]
        most = int((batch["turn_ids"] > 0).sum(-1).max())
        kinds.add("score_pos" in batch)
        if "score_pos" not in batch:
            assert most > T // 2
            continue
        S = batch["score_pos"].shape[-1]
        assert S == T // 2 and most <= S
        for row_turns, row_pos in zip(batch["turn_ids"].reshape(-1, T), batch["score_pos"].reshape(-1, S)):
            n = int((row_turns > 0).sum())
            np.testing.assert_array_equal(row_pos[:n], np.flatnonzero(row_turns > 0))
            assert np.all(row_pos[n:] == -1)
    assert kinds == {True, False}
    with pytest.raises(BatchError, match="score_length"):
        collate([ex[0]], length=300, score_length=2)
    with pytest.raises(BatchError, match="action-token count"):
        BatchIterator(ex, batch_size=4, score_positions=True,
                      global_lengths=(np.arange(len(ex)), example_lengths(ex)))
