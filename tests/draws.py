"""Comparing token draws made by the in-process sampler with draws made through an inference engine.

Both draw a token from one uniform per row through the softmax CDF (generate.inverse_cdf_draw), with the same
seeds. An engine batches concurrent requests its own way, so a row's logits can differ from the in-process ones in
the last bits (another batch shape, another matmul blocking). Rarely the uniform then lands on the other side of
one CDF boundary: the neighbouring token id (no top-k/top-p filtering, so no zero-mass token lies between), and
from there the sequence goes its own way. Anything else (another seed, a lost or shifted token, wrong ids) shows up
as a first difference that is not a neighbour, or as many sequences that differ.
"""
from __future__ import annotations


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where the two sequences differ (the shorter one's length if one is a prefix), or None."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


MIN_IDENTICAL = 0.75  # the share of sequences (or of records built from them) that must come out identical


def assert_mostly_identical(got: list, want: list, *, what: str = "records") -> None:
    """Records built from draws (episodes, pairs): as many, and at least MIN_IDENTICAL of them identical (a flipped
    draw changes the record it lands in, nothing else)."""
    assert len(got) == len(want), (what, len(got), len(want))
    same = sum(g == w for g, w in zip(got, want))
    assert same >= MIN_IDENTICAL * len(want), f"{what}: only {same} of {len(want)} identical"


def assert_same_draws(got: list[list[int]], want: list[list[int]], *,
                      min_identical: float = MIN_IDENTICAL) -> list[bool]:
    """Each sequence is identical, or identical up to one CDF-boundary flip (the neighbouring token id) after which
    it is free; at least `min_identical` of them are identical throughout. Returns which ones are identical."""
    assert len(got) == len(want), (len(got), len(want))
    identical = []
    for j, (g, w) in enumerate(zip(got, want)):
        i = first_difference(g, w)
        identical.append(i is None)
        if i is not None:
            assert i < min(len(g), len(w)) and abs(g[i] - w[i]) == 1, (
                f"sequence {j} differs at token {i}, not by a CDF-boundary flip: {g[max(0, i - 3):i + 3]} vs "
                f"{w[max(0, i - 3):i + 3]}")
    assert sum(identical) >= min_identical * len(got), f"only {sum(identical)} of {len(got)} sequences identical"
    return identical
