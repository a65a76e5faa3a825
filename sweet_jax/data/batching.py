"""Examples -> batches of [B, P, T] arrays, with bucketed T, deterministic shuffling, exact resume and
host-sharded data.

A batch (CONTRACTS.md): input_ids, attention_mask, turn_ids int32 [B, P, T]; weight float32 [B]
(1 = real example, 0 = filler); plus any per-token extras handed in (e.g. ref_logp float32 [B, P, T] from the
reference pass). T is the smallest bucket holding the longest sequence of the *global* batch, so every host
of a multi-host run builds the same shape.

Row shards. Every host agrees on one global list of N examples (e.g. the critic pairs, which every host can
list cheaply from the rewards), cut into B contiguous chunks, one per row of the global batch: row r of every
batch comes from chunk r, in a per-epoch order drawn from (seed, epoch, r). Host p of n holds rows
[p*B/n, (p+1)*B/n), so it renders and tokenises only `host_range(N, B, p, n)`, its chunks, a contiguous slice
of the list (neighbouring pairs share a task, so a task's best trajectory is rendered on one host, not many).
Batches are therefore the same whatever the number of hosts (any n dividing B): a run resumes exactly on
another slice size. Only per-example lengths cross hosts (`gather_lengths`, a small allgather), so that all
hosts pick the same T and the same number of steps.

An epoch has max(chunk sizes) steps (min with drop_last). A chunk that has run out (the length policy dropped
some of its examples, or N is not a multiple of B) gives a filler row: one pad token, weight 0. Fillers per
epoch (or examples left out per epoch with drop_last) are counted and logged, never silent.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from sweet_jax.data.render import Rendered
from sweet_jax.errors import SweetJaxError

log = logging.getLogger(__name__)

Extras = Mapping[str, Sequence[tuple[np.ndarray, ...]]]  # name -> per example, P per-token arrays


class BatchError(SweetJaxError):
    """Bad batching configuration or a resume state that does not match the data."""


def bucket_lengths(max_len: int, bucket_size: int = 128) -> tuple[int, ...]:
    """bucket_size * 2^k below max_len, then max_len (rounded up to a multiple of bucket_size)."""
    if max_len <= 0 or bucket_size <= 0:
        raise BatchError(f"max_len and bucket_size must be positive, got {max_len}, {bucket_size}")
    top = -(-max_len // bucket_size) * bucket_size
    out, b = [], bucket_size
    while b < top:
        out.append(b)
        b *= 2
    out.append(top)
    return tuple(out)


def bucket_prompt(n: int, minimum: int = 16) -> int:
    """The prefill's width for prompts of up to n tokens: powers of two up to 32, then steps of a quarter of the
    octave (40, 48, 56, 64, 80, 96, 112, 128, 160, ...; at most 1024): under 25% padding for four shapes an
    octave, where powers of two pad up to half (a turn's new tokens, with the prompt cache, are often 20-50). The
    sampler's decode keeps generate.bucket_length's coarser widths (decode_windows)."""
    n = max(int(n), minimum)
    if n <= 32:
        return 1 << (n - 1).bit_length()
    step = min(1 << ((n - 1).bit_length() - 3), 1024)
    return -(-n // step) * step


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    raise BatchError(f"a sequence of {length} tokens exceeds the largest bucket {buckets[-1]}; apply the "
                     "length policy (max_len) when building examples, or raise max_len")


def example_lengths(examples: Sequence[tuple[Rendered, ...]], *, scored: bool = False) -> np.ndarray:
    """[N] int: the longest of each example's P sequences (what decides its bucket T). scored=True: [N, 2], the
    second column the most action tokens (turn id > 0) in one of its sequences (what decides S, see collate)."""
    longest = np.array([max(len(s) for s in ex) for ex in examples], np.int64)
    if not scored:
        return longest
    most = np.array([max(int(np.count_nonzero(s.turn_ids)) for s in ex) for ex in examples], np.int64)
    return np.stack([longest, most], axis=1)


def collate(examples: Sequence[tuple[Rendered, ...] | None], *, length: int, pad_id: int = 0,
            padding_side: str = "right", weights: Sequence[float] | None = None,
            extras: Extras | None = None, num_sequences: int | None = None,
            score_length: int | None = None) -> dict[str, np.ndarray]:
    """Stack B examples of P sequences into [B, P, length] arrays.

    None in `examples` is a filler row: one pad token (so no query is left without a key), weight 0.
    extras: name -> per example (aligned with `examples`, None for fillers) a tuple of P per-token arrays as
    long as the sequences, e.g. reference log-probs; padded with 0 like turn_ids.
    score_length S: when S < length, also `score_pos` int32 [B, P, S], the positions of each sequence's action
    tokens (turn id > 0) in its row, in order, then -1: the losses need log-probs there only (steps.pair_loss).
    """
    if padding_side not in ("right", "left"):
        raise BatchError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    real = [ex for ex in examples if ex is not None]
    if num_sequences is None and not real:
        raise BatchError("collate: only filler rows and no num_sequences: cannot tell P")
    B, P = len(examples), (num_sequences if num_sequences is not None else len(real[0]))
    extras = extras or {}
    input_ids = np.full((B, P, length), pad_id, np.int32)
    mask = np.zeros((B, P, length), np.int32)
    turn_ids = np.zeros((B, P, length), np.int32)
    extra_out = {}
    for name, values in extras.items():
        first = next((v for v in values if v is not None), None)
        extra_out[name] = np.zeros((B, P, length), np.float32 if first is None else first[0].dtype)
    for b, ex in enumerate(examples):
        if ex is None:
            mask[b, :, 0 if padding_side == "right" else length - 1] = 1
            continue
        if len(ex) != P:
            raise BatchError(f"example {b} has {len(ex)} sequences, the batch has {P}")
        for p, seq in enumerate(ex):
            n = len(seq)
            if n > length:
                raise BatchError(f"sequence of {n} tokens does not fit T={length}")
            sl = slice(0, n) if padding_side == "right" else slice(length - n, length)
            input_ids[b, p, sl] = seq.input_ids
            mask[b, p, sl] = 1
            turn_ids[b, p, sl] = seq.turn_ids
            for name, values in extras.items():
                if values[b] is None or len(values[b][p]) != n:
                    raise BatchError(f"extra {name!r} of example {b}, sequence {p}: expected {n} per-token values, "
                                     f"got {None if values[b] is None else len(values[b][p])}")
                extra_out[name][b, p, sl] = values[b][p]
    if weights is None:
        w = np.array([ex is not None for ex in examples], np.float32)
    else:
        w = np.asarray(weights, np.float32)
    if score_length is not None and score_length < length:  # S = T: the full-sequence path is as cheap
        extra_out["score_pos"] = score_positions(turn_ids, score_length)
    return {"input_ids": input_ids, "attention_mask": mask, "turn_ids": turn_ids, "weight": w, **extra_out}


def score_positions(turn_ids: np.ndarray, length: int) -> np.ndarray:
    """[..., T] turn ids -> [..., length] int32: the positions with turn id > 0 in order, then -1."""
    flat = turn_ids.reshape(-1, turn_ids.shape[-1])
    out = np.full((len(flat), length), -1, np.int32)
    for row, ids in enumerate(flat):
        where = np.flatnonzero(ids > 0)
        if len(where) > length:
            raise BatchError(f"a sequence has {len(where)} action tokens, more than score_length={length}")
        out[row, :len(where)] = where
    return out.reshape(*turn_ids.shape[:-1], length)


def real_window(attention_mask: np.ndarray, length_multiple: int) -> slice:
    """The window of the last axis that holds every real token of [..., T] rows, its length rounded up to a
    multiple of length_multiple (at most T): [0, L) when right-padded, [T - L, T) when left-padded (positions
    come from the mask, so the cut shifts nothing); rows padded on both sides keep all of T."""
    T = attention_mask.shape[-1]
    real_T = np.flatnonzero(attention_mask.reshape(-1, T).any(axis=0))
    lo, hi = (int(real_T[0]), int(real_T[-1]) + 1) if len(real_T) else (0, 1)
    L = min(T, -(-(hi - lo) // length_multiple) * length_multiple)
    start = min(lo, T - L)
    return slice(start, start + L)


def pack_shared_prefix(input_ids_BPT: np.ndarray, attention_mask_BPT: np.ndarray, *,
                       length_multiple: int) -> dict[str, np.ndarray] | None:
    """Each example's P right-padded sequences as one row: the prefix all P share, once, then each sequence's
    remaining tokens. A critic or DPO pair shares its task prompt (and c), a step-level pair its whole turn prompt,
    so the row holds fewer tokens than the two sequences side by side (discovery seed 0's pairs: 0.57x for
    step-level pairs, 0.71x for critic pairs).

    Returns packed_ids, packed_segments (attention.py's segment ids: 0 padding, 1 the prefix, p + 2 sequence p's
    own tokens) and packed_positions int32 [B, L], each token at its position in its own sequence; and
    packed_index int32 [B, P, T], where sequence p's token t sits in the row (0 past its end). L is the longest
    row rounded up to length_multiple. None when a sequence is not right-padded, or when packing would not run
    fewer tokens than the P x T side by side."""
    B, P, T = input_ids_BPT.shape
    lengths_BP = attention_mask_BPT.sum(axis=-1)
    if not np.array_equal(attention_mask_BPT > 0, np.arange(T) < lengths_BP[..., None]):
        return None
    shared_B = np.array([shared_length([input_ids_BPT[b, p, :lengths_BP[b, p]] for p in range(P)])
                         for b in range(B)], np.int64)
    row_lengths = shared_B + (lengths_BP - shared_B[:, None]).sum(axis=1)
    L = -(-int(row_lengths.max()) // length_multiple) * length_multiple
    if L >= P * T:
        return None
    ids = np.zeros((B, L), np.int32)
    segments = np.zeros((B, L), np.int32)
    positions = np.zeros((B, L), np.int32)
    index = np.zeros((B, P, T), np.int32)
    for b in range(B):
        k = int(shared_B[b])
        ids[b, :k], segments[b, :k], positions[b, :k] = input_ids_BPT[b, 0, :k], 1, np.arange(k)
        index[b, :, :k] = np.arange(k)
        start = k
        for p in range(P):
            n = int(lengths_BP[b, p])
            end = start + n - k
            ids[b, start:end], segments[b, start:end] = input_ids_BPT[b, p, k:n], p + 2
            positions[b, start:end] = np.arange(k, n)
            index[b, p, k:n] = np.arange(start, end)
            start = end
    return {"packed_ids": ids, "packed_segments": segments, "packed_positions": positions, "packed_index": index}


# ----------------------------------------------------------------------------------------------------------
# Sequences behind the prefixes they share, for label log-probs (rank scoring, the reference pass)

def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if len(differs) else n


def prefix_groups(seqs: Sequence[np.ndarray], *, max_tokens: int, max_sequences: int,
                  min_shared: int = 32) -> list[list[int]]:
    """Indices of `seqs` in groups that run as one packed row each (pack_rows). The sequences are sorted by their
    tokens, so that those sharing a prefix are neighbours, and a group grows while its members share at least
    `min_shared` leading tokens, number at most `max_sequences` and their row (the prefix once, each member's
    rest) stays within `max_tokens` (or one sequence's length). A sequence that shares less with its neighbours
    is a row of its own."""
    groups: list[list[int]] = []
    total = shared = 0
    for i in sorted(range(len(seqs)), key=lambda i: np.asarray(seqs[i]).tolist()):
        n = len(seqs[i])
        if groups:
            group = groups[-1]
            k = min(shared, common_prefix(seqs[group[0]], seqs[i]))  # sorted: the group's first and last decide
            if k >= min_shared and len(group) < max_sequences and total + n - len(group) * k <= max_tokens:
                group.append(i)
                total, shared = total + n, k
                continue
        groups.append([i])
        total, shared = n, n
    return groups


def shared_length(seqs: Sequence[np.ndarray]) -> int:
    """How many leading tokens all of `seqs` share."""
    return min([len(s) for s in seqs] + [common_prefix(seqs[0], s) for s in seqs[1:]])


def packed_length(seqs: Sequence[np.ndarray]) -> int:
    """The tokens of pack_rows' row of `seqs`: their common prefix once, then each one's rest."""
    return sum(len(s) for s in seqs) - (len(seqs) - 1) * shared_length(seqs)


def pack_rows(groups: Sequence[Sequence[np.ndarray]], *, width, pad: int = 0,
              scored: Sequence[Sequence[np.ndarray]] | None = None):
    """Each group's sequences as one row: the prefix they all share once (segment 1), then each sequence's own
    tokens (segment p + 2), every token at its position in its own sequence (attention.py's segments keep a
    sequence to the prefix and itself). The label log-probs to compute: token t of a sequence is read from the
    hidden state of its token t - 1, wherever the row holds it; a (hidden state, label) the sequences share (the
    prefix's) is computed once.

    width(n): the padded length L of the longest row's n tokens. scored: per group, per sequence, the token
    positions wanted (default: every token but the first).
    Returns (arrays, where): arrays ids, segments, positions int32 [B, L] (padding: `pad`, segment 0) and before,
    labels int32 [B, X = L] (padding 0: a row of n tokens has at most n - 1 distinct reads, and one width keeps the
    compiled shapes few); where[b][p] the index into X of each wanted token's log-prob, in the order of
    scored[b][p]."""
    packed, reads, where = [], [], []
    for b, seqs in enumerate(groups):
        seqs = [np.asarray(s, np.int32) for s in seqs]
        k = shared_length(seqs)
        ids, segments, positions = [seqs[0][:k]], [np.ones(k, np.int32)], [np.arange(k, dtype=np.int32)]
        read: dict[tuple[int, int], int] = {}
        at_b = []
        start = k
        for p, s in enumerate(seqs):
            own = len(s) - k
            ids.append(s[k:])
            segments.append(np.full(own, p + 2, np.int32))
            positions.append(np.arange(k, len(s), dtype=np.int32))
            row_index = np.concatenate([np.arange(k), start + np.arange(own)])  # token t of s sits at row_index[t]
            want = np.arange(1, len(s)) if scored is None else np.asarray(scored[b][p], np.int64)
            at_b.append(np.array([read.setdefault((int(row_index[t - 1]), int(s[t])), len(read)) for t in want],
                                 np.int64))
            start += own
        packed.append((np.concatenate(ids), np.concatenate(segments), np.concatenate(positions)))
        reads.append(read)
        where.append(at_b)
    L = width(max(len(r[0]) for r in packed))  # a row of n tokens holds n - 1 distinct reads, at most
    shape = (len(packed), L)
    arrays = {"ids": np.full(shape, pad, np.int32), "segments": np.zeros(shape, np.int32),
              "positions": np.zeros(shape, np.int32), "before": np.zeros(shape, np.int32),
              "labels": np.zeros(shape, np.int32)}
    for b, ((ids, segments, positions), read) in enumerate(zip(packed, reads)):
        arrays["ids"][b, :len(ids)], arrays["segments"][b, :len(ids)] = ids, segments
        arrays["positions"][b, :len(ids)] = positions
        for (before, label), x in read.items():
            arrays["before"][b, x], arrays["labels"][b, x] = before, label
    return arrays, where


# ----------------------------------------------------------------------------------------------------------
# Which host holds which examples

def chunk_bounds(num_examples: int, num_chunks: int) -> np.ndarray:
    """[num_chunks + 1] boundaries of `num_chunks` contiguous chunks of near-equal size (sizes differ by <= 1)."""
    return np.array([c * num_examples // num_chunks for c in range(num_chunks + 1)], np.int64)


def host_range(num_examples: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> range:
    """The slice of the global example list that host `process_index` of `process_count` renders: the chunks
    of its rows of the global batch. The slices of all hosts are disjoint and cover the list."""
    _check_hosts(batch_size, process_index, process_count)
    bounds = chunk_bounds(num_examples, batch_size)
    rows = batch_size // process_count
    return range(int(bounds[process_index * rows]), int(bounds[(process_index + 1) * rows]))


def _check_hosts(batch_size: int, process_index: int, process_count: int) -> None:
    if batch_size <= 0 or process_count <= 0 or batch_size % process_count:
        raise BatchError(f"global batch_size {batch_size} must be a positive multiple of process_count "
                         f"{process_count}")
    if not 0 <= process_index < process_count:
        raise BatchError(f"process_index {process_index} not in [0, {process_count})")


def gather_lengths(example_ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every host's (global example ids, lengths), from each host's own: one small allgather over processes.
    Ids that several processes hold (replicas of the same batch rows) are kept once."""
    ids, lengths = np.asarray(example_ids, np.int32), np.asarray(lengths, np.int32)
    if jax.process_count() == 1:
        return ids, lengths

    columns = lengths if lengths.ndim == 2 else lengths[:, None]  # [N] or [N, k] (example_lengths(scored=True))
    counts = np.asarray(multihost_utils.process_allgather(np.array([len(ids)], np.int32))).reshape(-1)
    padded = np.full((int(counts.max(initial=0)) or 1, 1 + columns.shape[1]), -1, np.int32)
    padded[:len(ids)] = np.concatenate([ids[:, None], columns], axis=1)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, padded.shape[1])
    every = every[every[:, 0] >= 0]
    all_ids, first = np.unique(every[:, 0], return_index=True)
    return all_ids, every[first, 1:].reshape(len(all_ids), *lengths.shape[1:])


# ----------------------------------------------------------------------------------------------------------
# The iterator

@dataclasses.dataclass
class BatchIterator:
    """Iterates this host's part of the global batches, epoch after epoch; `state()` / `restore(state)` give
    exact resume (see the module docstring for the row-shard layout).

    examples: this host's examples (all of them on one host); example_ids: their indices in the global list
    (default 0..N-1 on one host, the host_range slice on several; the length policy may have dropped some);
    num_global: the global list's length before any drop (default: len(examples) on one host).
    global_lengths: (ids, lengths) of every host's examples; None = gathered with `gather_lengths` when there
    are several hosts (tests pass it to simulate hosts in one process).
    extras: per-token arrays that travel with the examples (see collate); may be set after construction.
    score_positions: batches whose sequences (over all hosts) have at most T // 2 action tokens also carry
    `score_pos` [B, P, T // 2] (collate, batch_score_length); global_lengths then needs
    example_lengths(scored=True) columns.
    shuffle=False walks each chunk in list order, or longest first with longest_first=True (a pass for
    inference that pads least). num_epochs=None iterates forever.
    """
    examples: Sequence[tuple[Rendered, ...]]
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    pad_id: int = 0
    padding_side: str = "right"
    max_len: int | None = None
    bucket_size: int = 128
    buckets: tuple[int, ...] | None = None
    drop_last: bool = False
    num_epochs: int | None = None
    process_index: int = 0
    process_count: int = 1
    example_ids: Sequence[int] | None = None
    num_global: int | None = None
    global_lengths: tuple[Sequence[int], Sequence[int]] | None = None
    extras: Extras | None = None
    num_sequences: int | None = None
    longest_first: bool = False
    score_positions: bool = False

    def __post_init__(self):
        _check_hosts(self.batch_size, self.process_index, self.process_count)
        local_lengths = example_lengths(self.examples, scored=self.score_positions)
        if self.example_ids is None:
            if self.process_count > 1 and self.num_global is None:
                raise BatchError("several hosts: pass num_global (the global example list's length) and example_ids")
            start = host_range(self.num_global, self.batch_size, self.process_index, self.process_count).start \
                if self.num_global is not None else 0
            self.example_ids = np.arange(start, start + len(self.examples))
        ids = np.asarray(self.example_ids, np.int64)
        if len(ids) != len(self.examples):
            raise BatchError(f"{len(self.examples)} examples but {len(ids)} example_ids")
        if self.num_global is None:
            self.num_global = int(ids.max(initial=-1)) + 1
        mine = host_range(self.num_global, self.batch_size, self.process_index, self.process_count)
        if len(ids) and (ids.min() < mine.start or ids.max() >= mine.stop):
            raise BatchError(f"host {self.process_index} of {self.process_count} holds examples "
                             f"[{mine.start}, {mine.stop}) of {self.num_global} (host_range), got ids "
                             f"{int(ids.min())}..{int(ids.max())}")
        self._local = {int(g): i for i, g in enumerate(ids)}
        if self.global_lengths is not None:
            all_ids, all_lengths = (np.asarray(a, np.int64) for a in self.global_lengths)
        elif self.process_count > 1:
            all_ids, all_lengths = gather_lengths(ids, local_lengths)
        else:
            all_ids, all_lengths = ids, local_lengths
        order = np.argsort(all_ids, kind="stable")
        all_lengths = np.asarray(all_lengths, np.int64)
        all_lengths = (all_lengths if all_lengths.ndim == 2 else all_lengths[:, None])[order]
        if self.score_positions and all_lengths.shape[1] < 2:
            raise BatchError("score_positions=True: global_lengths must hold each example's action-token count "
                             "too (batching.example_lengths(examples, scored=True))")
        self._ids, self._lengths = np.asarray(all_ids, np.int64)[order], all_lengths[:, 0]
        self._scored = all_lengths[:, 1] if all_lengths.shape[1] > 1 else None
        if len(self._ids) == 0:
            raise BatchError("no examples to batch (did the length policy drop them all?)")
        if self.num_sequences is None:
            if not len(self.examples):
                raise BatchError("this host holds no examples: pass num_sequences (P) so it can build filler rows")
            self.num_sequences = len(self.examples[0])
        if self.buckets is None:
            self.buckets = bucket_lengths(self.max_len or int(self._lengths.max()), self.bucket_size)
        self.buckets = tuple(sorted(self.buckets))
        # Row r of every batch comes from chunk r: the global ids in it.
        chunk_of = np.searchsorted(chunk_bounds(self.num_global, self.batch_size), self._ids, side="right") - 1
        self._chunks = [np.nonzero(chunk_of == r)[0] for r in range(self.batch_size)]  # positions in _ids
        sizes = np.array([len(c) for c in self._chunks])
        if self.drop_last and sizes.min() == 0:
            raise BatchError(f"drop_last with {len(self._ids)} examples over batch_size {self.batch_size} rows "
                             "leaves no batch; use drop_last=False or a smaller batch")
        self._steps = int(sizes.min() if self.drop_last else sizes.max())
        self.filler_rows_per_epoch = int(np.maximum(self._steps - sizes, 0).sum())
        self.unused_per_epoch = int(np.maximum(sizes - self._steps, 0).sum())
        if self.filler_rows_per_epoch or self.unused_per_epoch:  # passes for inference are rebuilt often: quieter
            log.log(logging.INFO if self.shuffle else logging.DEBUG,
                    "batching: %d examples in %d row chunks (sizes %d..%d): %d steps per epoch, %d filler rows "
                    "(weight 0) and %d examples left out per epoch", len(self._ids), self.batch_size,
                    sizes.min(), sizes.max(), self._steps, self.filler_rows_per_epoch, self.unused_per_epoch)
        self._table: tuple[int, np.ndarray] | None = None
        self._epoch, self._step = 0, 0

    @property
    def num_examples(self) -> int:
        """Examples over all hosts (after the length policy)."""
        return len(self._ids)

    @property
    def steps_per_epoch(self) -> int:
        return self._steps

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def epoch_table(self, epoch: int) -> np.ndarray:
        """[steps_per_epoch, batch_size] global example ids of every batch of `epoch` (-1 = filler)."""
        if self._table is not None and self._table[0] == epoch:
            return self._table[1]
        table = np.full((self._steps, self.batch_size), -1, np.int64)
        for r, chunk in enumerate(self._chunks):
            if self.shuffle:
                chunk = chunk[np.random.default_rng([self.seed, epoch, r]).permutation(len(chunk))]
            elif self.longest_first:
                chunk = chunk[np.argsort(-self._lengths[chunk], kind="stable")]
            chunk = chunk[:self._steps]
            table[:len(chunk), r] = self._ids[chunk]
        self._table = (epoch, table)
        return table

    def batch_ids(self, epoch: int, step: int) -> np.ndarray:
        """[batch_size] global example ids of global batch `step` of `epoch` (-1 = filler)."""
        return self.epoch_table(epoch)[step]

    def local_indices(self, epoch: int, step: int) -> np.ndarray:
        """[local_batch_size] indices into `examples` of this host's rows of that batch (-1 = filler)."""
        lo = self.process_index * self.local_batch_size
        rows = self.batch_ids(epoch, step)[lo:lo + self.local_batch_size]
        return np.array([self._local[int(g)] if g >= 0 else -1 for g in rows], np.int64)

    def batch_length(self, epoch: int, step: int) -> int:
        """T of that batch: the bucket of its longest sequence over all hosts (the same on every host)."""
        ids = self.batch_ids(epoch, step)
        real = ids[ids >= 0]
        longest = int(self._lengths[np.searchsorted(self._ids, real)].max(initial=1))
        return bucket_for(longest, self.buckets)

    def batch_score_length(self, epoch: int, step: int) -> int:
        """S of that batch (score_positions): T // 2 when every sequence of the batch (all hosts) has at most
        that many action tokens, else T (then collate adds no score_pos). So a length bucket compiles at most
        two programs (on TPU an 8B step compiles for minutes), and a batch that has them runs the unembedding
        on half the positions or fewer."""
        T = self.batch_length(epoch, step)
        ids = self.batch_ids(epoch, step)
        real = ids[ids >= 0]
        most = int(self._scored[np.searchsorted(self._ids, real)].max(initial=0))
        return T // 2 if most <= T // 2 else T

    def real_rows(self, epoch: int, step: int) -> int:
        """Real (weight-1) examples in that global batch, over all hosts."""
        return int((self.batch_ids(epoch, step) >= 0).sum())

    def batch_at(self, epoch: int, step: int) -> dict[str, np.ndarray]:
        """This host's rows of global batch `step` of `epoch` (pure: no iterator state)."""
        idx = self.local_indices(epoch, step)
        rows = [self.examples[i] if i >= 0 else None for i in idx]
        extras = {name: [values[i] if i >= 0 else None for i in idx] for name, values in (self.extras or {}).items()}
        score_length = self.batch_score_length(epoch, step) if self.score_positions else None
        return collate(rows, length=self.batch_length(epoch, step), pad_id=self.pad_id,
                       padding_side=self.padding_side, extras=extras, num_sequences=self.num_sequences,
                       score_length=score_length)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        batch = self.batch_at(self._epoch, self._step)
        self._step += 1
        return batch

    @property
    def epoch(self) -> int:
        return self._epoch

    def state(self) -> dict:
        """JSON-serialisable position: store it with the checkpoint. It holds no host count: the batches do
        not depend on it, so a run resumes exactly on any number of hosts dividing the batch."""
        return {"epoch": int(self._epoch), "step": int(self._step), "seed": int(self.seed),
                "num_examples": self.num_examples, "batch_size": int(self.batch_size),
                "shuffle": bool(self.shuffle)}

    def restore(self, state: dict) -> None:
        """Continue from a position saved by state(); the data and batching settings must be the same."""
        if "step" not in state:
            raise BatchError(f"cannot resume: the checkpoint's data position {state!r} comes from an older "
                             "sweet_jax whose batches were ordered differently; start a new --workdir")
        for key in ("seed", "num_examples", "batch_size", "shuffle"):
            mine = self.state()[key]
            if key in state and state[key] != mine:
                raise BatchError(f"cannot resume: the checkpoint's data position has {key}={state[key]!r} but "
                                 f"this run has {key}={mine!r}; resume with the run's own config "
                                 "(workdir/config.json) and data, or use a new --workdir")
        self._epoch, self._step = int(state["epoch"]), int(state["step"])
