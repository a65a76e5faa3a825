"""Whole-split passes on the mesh, shared by the trainer's setup and its evaluations: the frozen reference's
label log-probs of every example (attached to a data.datasets.Dataset before its batches are built) and the
held-out metrics; and how this host's batch rows become global arrays on the mesh and come back.
"""
from __future__ import annotations

import dataclasses
from typing import Collection

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from sweet_jax import costs
from sweet_jax.config_utils import TrainConfigError
from sweet_jax.data import batching
from sweet_jax.data.datasets import Dataset



def data_shard(sharding, batch_size: int) -> tuple[int, int]:
    """(index, count) of the slice of global batch rows this process feeds (data.batching's process_index /
    process_count): (process_index, process_count) when the batch is split over processes, fewer slices when
    processes hold replicas of the same rows (a tensor axis across hosts)."""
    if jax.process_count() == 1:
        return 0, 1
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(*index[0].indices(batch_size)))
    lo, n = min(rows), len(rows)
    if max(rows) - lo + 1 != n or lo % n or batch_size % n:
        raise TrainConfigError(f"this process's devices hold batch rows {sorted(rows)} of {batch_size}, not one "
                               "aligned contiguous slice; set --config.mesh.shape so that each host's devices "
                               "are neighbours on the (data, fsdp) axes")
    return lo // n, batch_size // n


def to_global(batch: dict[str, np.ndarray], sharding) -> dict:
    """This process's rows of a batch -> global jax.Arrays (rows of all processes, in process order)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def to_host(x) -> np.ndarray:
    """A global jax.Array as one numpy array on every host (gathered when other hosts hold parts of it)."""
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def one_pass(dataset: Dataset, make_batches, **kwargs):
    """(iterator, steps) over every example once, longest first (little padding, few shapes to compile)."""
    it = make_batches(dataset, shuffle=False, longest_first=True, num_epochs=1, **kwargs)
    return it, range(it.steps_per_epoch)


def distinct_sequences(dataset: Dataset, only: Collection[int] | None = None
                       ) -> tuple[Dataset, list[tuple[tuple[int, int], ...] | None]]:
    """The split's distinct sequences as a Dataset of the same shape (P sequences an example, longest first, the
    last example filled with a repeat), and where each example's sequences are in it ((example, position) per
    sequence). Pairs repeat sequences: a critic task's best trajectory is the chosen side of a pair with each worse
    one, and a turn prompt's 4 DPO pairs are drawn with replacement from its 16 candidates (40% of a SmolLM2
    seed's DPO sequences are repeats); each is then run once. Sequences of one example have similar lengths.
    only: the examples to cover (indices into dataset.examples); the others' place is None."""
    P = dataset.num_sequences
    first: dict[tuple[bytes, bytes], int] = {}
    order: list = []
    for i, example in enumerate(dataset.examples):
        if only is not None and i not in only:
            continue
        for seq in example:
            key = (np.asarray(seq.input_ids).tobytes(), np.asarray(seq.turn_ids).tobytes())
            if key not in first:
                first[key] = len(order)
                order.append(seq)
    rank = sorted(range(len(order)), key=lambda j: -len(order[j]))   # stable: ties keep their first-seen order
    slot = {j: divmod(r, P) for r, j in enumerate(rank)}
    seqs = [order[j] for j in rank]
    seqs += [seqs[-1]] * (-len(seqs) % P)
    examples = [tuple(seqs[i:i + P]) for i in range(0, len(seqs), P)]
    distinct = dataclasses.replace(dataset, examples=examples, ids=list(range(len(examples))),
                                   num_global=len(examples), extras={}, lengths=None)
    if examples:
        distinct.gather_lengths()
    where = [None if only is not None and i not in only else
             tuple(slot[first[(np.asarray(seq.input_ids).tobytes(), np.asarray(seq.turn_ids).tobytes())]]
                   for seq in example) for i, example in enumerate(dataset.examples)]
    return distinct, where


def trained_examples(batches, num_steps: int) -> set[int]:
    """Indices into a BatchIterator's examples (this host's) that its first num_steps batches hold."""
    per_epoch = batches.steps_per_epoch
    return {int(i) for step in range(num_steps) for i in batches.local_indices(*divmod(step, per_epoch)) if i >= 0}


def reference_pass(ref_logp_fn, params, dataset: Dataset, make_batches, sharding, padding_side: str, *,
                   deduplicate: bool = True, only: Collection[int] | None = None,
                   length_multiple: int | None = None, packed=None, pad_id: int = 0) -> list:
    """Label log-probs of the frozen reference model for every example of this host, one tuple of [L] arrays
    (one per sequence) per example; Dataset.with_extras(ref_logp=...) attaches them before the batches exist.
    deduplicate (one process): each distinct sequence is run once (distinct_sequences); the same values up to
    float rounding (a sequence's batch neighbours and padded length differ). only (one process): the examples
    that need them (a run that stops before an epoch ends trains on a part of its split); None for the others.
    length_multiple (one process): each batch cut to its own longest sequence rounded up to it
    (batching.real_window), not run at its bucket (buckets double: a 300-token batch would run 512).
    packed (one process): steps.make_packed_logp_fn's function of the same model; then each distinct sequence
    runs once, behind the prefix it shares with others (packed_reference_pass) instead of ref_logp_fn's batches."""
    if packed is not None and jax.process_count() == 1:
        return packed_reference_pass(packed, params, dataset, only=only, pad_id=pad_id)
    if (deduplicate or only is not None) and jax.process_count() == 1 and len(dataset):
        distinct, where = distinct_sequences(dataset, only)
        refs = reference_pass(ref_logp_fn, params, distinct, make_batches, sharding, padding_side,
                              deduplicate=False, length_multiple=length_multiple) if distinct.examples else []
        return [None if at is None else tuple(refs[e][p] for e, p in at) for at in where]
    it, batch_steps = one_pass(dataset, make_batches, score_positions=False)  # the reference covers every token
    refs: list = [None] * len(dataset)
    lo = it.process_index * it.local_batch_size
    for step in tqdm(batch_steps, desc="reference log-probs", unit="batch", disable=jax.process_index() != 0):
        batch = {k: v for k, v in it.batch_at(0, step).items() if k in ("input_ids", "attention_mask", "turn_ids")}
        if length_multiple and jax.process_count() == 1:
            cut = batching.real_window(batch["attention_mask"], length_multiple)
            batch = {k: v[..., cut] for k, v in batch.items()}
        with costs.timed("ref_logp_pass"):
            logp_BPT = to_host(ref_logp_fn(params, to_global(batch, sharding)))
        costs.tokens("ref_logp", batch["attention_mask"].sum(), batch["attention_mask"].size)
        T = batch["input_ids"].shape[-1]
        for row, i in enumerate(it.local_indices(0, step)):
            if i >= 0:
                refs[i] = tuple(logp_BPT[lo + row, p, :len(seq)] if padding_side == "right"
                                else logp_BPT[lo + row, p, T - len(seq):] for p, seq in enumerate(dataset.examples[i]))
    return refs


def packed_reference_pass(packed_logp_fn, params, dataset: Dataset, *, only: Collection[int] | None = None,
                          pad_id: int = 0, max_sequences: int = 16, min_shared: int = 32,
                          max_tokens: int = 2048) -> list:
    """reference_pass's result (its `only` too) with every distinct sequence run once, in rows of sequences that
    share a prefix (batching.prefix_groups: at least min_shared tokens, up to max_sequences and max_tokens a row,
    or one sequence): a turn prompt's candidates share the whole prompt, a task's trajectories their statement and
    c. Each row is a call of its own at batching.bucket_prompt's width of it (under 25% padding past 32 tokens),
    longest first. The rows are drawn over all of the dataset's sequences and a row runs whole when any of its
    sequences is wanted, so that a sequence's value does not depend on `only` (a run stopped at a step computes
    what the whole run computed). The same values as ref_logp_fn's up to float rounding (each sequence sees only
    the prefix and itself: the attention's segments)."""
    index: dict[bytes, int] = {}
    seqs: list[np.ndarray] = []
    at: list[list[int]] = []   # each example's sequences in seqs
    for example in dataset.examples:
        at.append([])
        for seq in example:
            ids = np.asarray(seq.input_ids, np.int32)
            if index.setdefault(ids.tobytes(), len(seqs)) == len(seqs):
                seqs.append(ids)
            at[-1].append(index[ids.tobytes()])
    wanted = [i for i in range(len(dataset)) if only is None or i in only]
    needed = {j for i in wanted for j in at[i]}
    longest = max((len(s) for s in seqs), default=1)
    groups = [g for g in batching.prefix_groups(seqs, max_tokens=max(longest, max_tokens),
                                                max_sequences=max_sequences, min_shared=min_shared)
              if needed.intersection(g)]
    groups.sort(key=lambda g: batching.packed_length([seqs[j] for j in g]), reverse=True)
    logp: list[np.ndarray | None] = [None] * len(seqs)
    with tqdm(total=sum(map(len, groups)), desc="reference log-probs", unit="seq",
              disable=jax.process_index() != 0) as bar:
        for group in groups:
            arrays, where = batching.pack_rows([[seqs[j] for j in group]], width=batching.bucket_prompt, pad=pad_id)
            with costs.timed("ref_logp_pass"):
                logp_BX = to_host(packed_logp_fn(params, arrays))
            costs.tokens("ref_logp", int(np.count_nonzero(arrays["segments"])), arrays["ids"].size)
            for j, x in zip(group, where[0]):
                logp[j] = np.concatenate([[0.0], logp_BX[0, x]]).astype(np.float32)  # token 0: nothing before it
            bar.update(len(group))
    refs: list = [None] * len(dataset)
    for i in wanted:
        refs[i] = tuple(logp[j] for j in at[i])
    return refs


def evaluate(eval_fn, params, dataset: Dataset, make_batches, sharding, ref_params=None) -> dict:
    """Metrics over the whole held-out set (each batch's means weighted by its number of real examples)."""
    totals: dict[str, float] = {}
    count = 0
    it, batch_steps = one_pass(dataset, make_batches)
    for step in batch_steps:
        args = (params, to_global(it.batch_at(0, step), sharding)) + ((ref_params,) if ref_params is not None else ())
        with costs.timed("train_eval"):
            metrics = jax.device_get(eval_fn(*args))
        rows = it.real_rows(0, step)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * rows
        count += rows
    return {k: v / count for k, v in totals.items()} if count else {}


def rename_metrics(m: dict) -> dict:
    """Metric names as the logs and plot show them."""
    return {("pair_accuracy" if k == "accuracy" else k): v for k, v in m.items()}
