"""Training examples from trajectories: critic pairs, multi-turn DPO pairs, RFT examples, policy pairs.

An example is a tuple of P Rendered sequences: (chosen, rejected) for pairs, (sequence,) for SFT; the
batcher stacks them into [B, P, T] arrays.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from sweet_jax.data.render import (LengthStats, OFFICIAL_INFO_TEMPLATE, RenderError, Rendered, end_of_turn_token,
                                   fit_all, render_official_text, render_trajectory, reply_from_tokens)
from sweet_jax.data.schema import DataError, Trajectory
from sweet_jax.data.tokenizers import end_of_turn_ids

log = logging.getLogger(__name__)

Example = tuple  # tuple[Rendered, ...] of length P


class Examples(list):
    """A list of examples plus `indices`: for each, the position of its source (pair, trajectory) in the input,
    so callers know which ones the length policy dropped."""

    def __init__(self, items=(), indices=()):
        super().__init__(items)
        self.indices = list(indices)

    def append_from(self, index: int, example) -> None:
        if example is not None:
            self.append(example)
            self.indices.append(index)


@dataclasses.dataclass(frozen=True)
class TrajectoryPair:
    chosen: Trajectory
    rejected: Trajectory
    task_key: str


def group_by_task(trajectories: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    """Trajectories grouped by task content (problem + ground truth), groups in first-seen order."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.task.key, []).append(t)
    return groups


def _require_rewards(trajectories: Sequence[Trajectory]):
    missing = [i for i, t in enumerate(trajectories) if t.reward is None]
    if missing:
        raise DataError(f"{len(missing)} trajectories have no reward (first: index {missing[0]}); score them "
                        "first: python -m sweet_jax.evaluate TRAJ.jsonl --out SCORED.jsonl", field="reward")


def critic_pairs(trajectories: Sequence[Trajectory], *, min_gap: float = 0.0,
                 success_reward: float = 1.0) -> list[TrajectoryPair]:
    """The official rule: per task, if its best trajectory has reward >= success_reward (1.0), pair it (chosen)
    with every trajectory of the task whose reward is strictly lower, and lower by at least min_gap.
    Tasks are grouped by content (Task.key), not by file position; the best is the first trajectory reaching
    the task's maximum reward, in input order (as the official argmax)."""
    _require_rewards(trajectories)
    pairs = []
    for key, group in group_by_task(trajectories).items():
        rewards = np.array([t.reward for t in group])
        best = int(np.argmax(rewards))
        if rewards[best] < success_reward:
            continue
        for t, r in zip(group, rewards):
            if r < rewards[best] and rewards[best] - r >= min_gap:
                pairs.append(TrajectoryPair(group[best], t, key))
    log.info("critic_pairs: %d pairs from %d trajectories over %d tasks", len(pairs), len(trajectories),
             len(group_by_task(trajectories)))
    return pairs


def gap_pairs(trajectories: Sequence[Trajectory], *, min_gap: float = 0.1) -> list[TrajectoryPair]:
    """The official frontend rule (rewards are CLIP cosines, never exactly 1.0): per task, every two trajectories
    whose rewards differ by at least min_gap make a pair, the higher one chosen; in input order."""
    _require_rewards(trajectories)
    pairs = []
    for key, group in group_by_task(trajectories).items():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if abs(a.reward - b.reward) >= min_gap:
                    pairs.append(TrajectoryPair(a, b, key) if a.reward > b.reward else TrajectoryPair(b, a, key))
    log.info("gap_pairs: %d pairs (gap >= %g) from %d trajectories", len(pairs), min_gap, len(trajectories))
    return pairs


def trajectory_pairs(trajectories: Sequence[Trajectory], *, rule: str = "best_success",
                     min_gap: float = 0.0) -> list[TrajectoryPair]:
    """Critic / multi-turn DPO pairs by rule: 'best_success' (backend: critic_pairs) or 'all_gaps' (frontend:
    gap_pairs; min_gap 0 means the official 0.1)."""
    if rule == "best_success":
        return critic_pairs(trajectories, min_gap=min_gap)
    if rule == "all_gaps":
        return gap_pairs(trajectories, min_gap=min_gap or 0.1)
    raise ValueError(f"pair rule {rule!r}: use best_success (backend) or all_gaps (frontend)")


def mtdpo_pairs(trajectories: Sequence[Trajectory], *, min_gap: float = 0.0,
                success_reward: float = 1.0) -> list[TrajectoryPair]:
    """Trajectory-level pairs for the multi-turn DPO baseline: the same pairs as the critic's, rendered
    without training-time information (pass with_info=False to pair_examples)."""
    return critic_pairs(trajectories, min_gap=min_gap, success_reward=success_reward)


def rft_examples(trajectories: Sequence[Trajectory], *, success_reward: float = 1.0) -> list[Trajectory]:
    """Rejection fine-tuning data: the successful trajectories (reward >= success_reward)."""
    _require_rewards(trajectories)
    return [t for t in trajectories if t.reward >= success_reward]


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    """How trajectories become token sequences (shared by critic, MT-DPO and RFT)."""
    max_len: int | None = None
    overflow: str = "truncate"  # "truncate" | "drop" | "cut_right" (the official trainer's)
    info_template: str = OFFICIAL_INFO_TEMPLATE
    info_placement: str = "system"  # "system" | "first_user" | "raw_prefix"
    use_prerendered: bool = True
    mask_style: str = "turns"  # "turns" | "official" (render.render_official_text)

    def render(self, tokenizer, trajectory: Trajectory, *, with_info: bool) -> Rendered:
        return render_trajectory(tokenizer, trajectory, with_info=with_info, info_template=self.info_template,
                                 info_placement=self.info_placement, use_prerendered=self.use_prerendered,
                                 mask_style=self.mask_style)


def pair_examples(tokenizer, pairs: Sequence[TrajectoryPair], *, with_info: bool,
                  options: RenderOptions = RenderOptions(), progress: bool = False
                  ) -> tuple[Examples, LengthStats]:
    """(chosen, rejected) sequences for each pair; with_info=True gives the critic c (the ground truth)."""
    stats = LengthStats()
    cache: dict[int, Rendered] = {}  # the best trajectory appears in many pairs: render it once

    def render(t: Trajectory) -> Rendered:
        if id(t) not in cache:
            cache[id(t)] = options.render(tokenizer, t, with_info=with_info)
        return cache[id(t)]

    out = Examples()
    for i, p in enumerate(_progress(pairs, progress, "rendering pairs")):
        out.append_from(i, fit_all((render(p.chosen), render(p.rejected)), options.max_len,
                                   overflow=options.overflow, stats=stats))
    stats.log("pair examples", options.max_len)
    return out, stats


def sft_examples(tokenizer, trajectories: Sequence[Trajectory], *, options: RenderOptions = RenderOptions(),
                 progress: bool = False) -> tuple[Examples, LengthStats]:
    """(sequence,) examples with every reply labelled, for rejection fine-tuning (P = 1)."""
    stats = LengthStats()
    out = Examples()
    for i, t in enumerate(_progress(trajectories, progress, "rendering trajectories")):
        r = options.render(tokenizer, t, with_info=False)
        out.append_from(i, fit_all((r,), options.max_len, overflow=options.overflow, stats=stats))
    stats.log("sft examples", options.max_len)
    return out, stats


# ----------------------------------------------------------------------------------------------------
# Policy pairs from ranked candidates.

@dataclasses.dataclass(frozen=True)
class PairPick:
    """One pair policy_pairs picked from a group of scored candidates (the record written to JSONL is
    data.schema.PolicyPair)."""
    group: int            # which turn prefix (index into candidates)
    chosen_index: int     # index of the chosen candidate within its group
    rejected_index: int
    chosen: Any
    rejected: Any
    chosen_score: float
    rejected_score: float


class PolicyPairs(list):
    """A list of PairPick plus `skipped_groups`: groups with no pair (fewer than 2 candidates, or all tied)."""

    def __init__(self, items=(), skipped_groups=()):
        super().__init__(items)
        self.skipped_groups = list(skipped_groups)


PAIRINGS = ("strict", "official")


def policy_pairs(candidates: Sequence[Sequence[Any]], scores: Sequence[Sequence[float]], *, num_pairs: int = 4,
                 seed: int = 0, pairing: str = "strict") -> PolicyPairs:
    """Step-level preference pairs: for each group (one turn prefix) of N scored candidates, chosen uniformly
    from the top half by score, rejected uniformly from the bottom half, num_pairs per group.

    Halves: candidates sorted by score (ties in random, seeded order), top = the first N//2, bottom = the
    last N//2 (the middle one of an odd N is in neither). Ties: a pair is only formed when the chosen
    candidate scores strictly higher, so ties straddling the halves never pair; pairs are drawn uniformly
    without replacement from the valid (top, bottom) combinations, all of them if fewer than num_pairs.
    Groups with no valid pair are skipped and listed in `.skipped_groups`. Deterministic in (seed, group).

    pairing="official" (the official pair script's rule): num_pairs draws *with replacement*, each a chosen
    uniformly from the top half and a rejected uniformly from the bottom half (halves by descending score,
    ties in input order), ties between them allowed. The draws follow that rule from our own seeded stream,
    not the official script's random numbers.
    """
    if pairing not in PAIRINGS:
        raise DataError(f"policy_pairs: pairing must be one of {PAIRINGS}, got {pairing!r}")
    if num_pairs < 1:
        raise DataError(f"policy_pairs: num_pairs must be >= 1, got {num_pairs}")
    if len(candidates) != len(scores):
        raise DataError(f"policy_pairs: {len(candidates)} candidate groups but {len(scores)} score groups")
    out, skipped = [], []
    for g, (cands, sc) in enumerate(zip(candidates, scores)):
        sc = np.asarray(sc, np.float64)
        if len(cands) != len(sc):
            raise DataError(f"policy_pairs: group {g} has {len(cands)} candidates but {len(sc)} scores")
        if not np.all(np.isfinite(sc)):
            raise DataError(f"policy_pairs: group {g} has non-finite scores {sc.tolist()}")
        rng = np.random.default_rng([seed, g])
        n = len(sc)
        half = n // 2
        if half == 0:
            skipped.append(g)
            continue
        if pairing == "official":
            order = np.argsort(-sc, kind="stable")
            top, bottom = order[:half], order[n - half:]
            for i, j in zip(rng.choice(top, size=num_pairs), rng.choice(bottom, size=num_pairs)):
                out.append(PairPick(g, int(i), int(j), cands[i], cands[j], float(sc[i]), float(sc[j])))
            continue
        tiebreak = rng.permutation(n)
        order = tiebreak[np.argsort(-sc[tiebreak], kind="stable")]
        top, bottom = order[:half], order[n - half:]
        valid = [(i, j) for i in top for j in bottom if sc[i] > sc[j]]
        if not valid:
            skipped.append(g)
            continue
        picks = rng.choice(len(valid), size=min(num_pairs, len(valid)), replace=False)
        for p in picks:
            i, j = valid[int(p)]
            out.append(PairPick(g, int(i), int(j), cands[i], cands[j], float(sc[i]), float(sc[j])))
    if skipped:
        log.info("policy_pairs: %d of %d groups gave no pair (too few candidates or all tied)", len(skipped),
                 len(candidates))
    return PolicyPairs(out, skipped)


def sampled_pair_sequences(tokenizer, pair, *, where: str = "") -> tuple[Rendered, Rendered]:
    """(chosen, rejected) from the ids the sampler produced: the prompt's ids (turn id 0), then the reply's
    sampled ids and its end-of-turn token (turn id 1; appended when the reply was cut by max_new_tokens).
    Nothing is tokenised again: decoding and re-encoding a sample need not give back the ids the policy
    sampled, and DPO must score what the policy sampled."""
    eot_ids = end_of_turn_ids(tokenizer)
    eot = end_of_turn_token(tokenizer)
    vocab = len(tokenizer)
    out = []
    for side in ("chosen_ids", "rejected_ids"):
        prompt, reply = list(pair.prompt_ids), list(getattr(pair, side))
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt + reply):
            raise DataError(f"{side} / prompt_ids: token ids must be integers in [0, {vocab}) of this tokenizer",
                            where=where)
        if not reply or reply[-1] not in eot_ids:
            reply = reply + [eot]
        out.append(reply_from_tokens(Rendered(np.asarray(prompt, np.int32), np.zeros(len(prompt), np.int32), (),
                                              tokenizer.eos_token_id), reply))
    return out[0], out[1]


def is_official_pair_row(row: dict) -> bool:
    """A row of an official pairs file: `chosen` and `rejected` are whole templated strings (prompt + reply
    [+ eos]) and there is no `prompt_text` (sweet_jax.rank's rows keep the prompt apart)."""
    return isinstance(row.get("chosen"), str) and isinstance(row.get("rejected"), str) and "prompt_text" not in row


def official_pair_sequences(tokenizer, row: dict, *, label: str = "last", where: str = "") -> tuple[Rendered, Rendered]:
    """(chosen, rejected) of an official pairs row, tokenized and masked as the fork does
    (render.render_official_text): label="last" marks the reply after the last assistant header (the policy's
    step-level pairs; DPO's log-probs are summed there, the prompt being the same on both sides), "all" every
    reply (the critic's ground-truth preference files). The length policy runs afterwards: fit_length's cut_right
    gives the fork's right cut, with the same mask as masking after the cut."""
    try:
        return tuple(render_official_text(tokenizer, row[side], label=label)
                     for side in ("chosen", "rejected"))
    except RenderError as e:
        raise DataError(str(e), where=where, field="chosen/rejected") from None


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    return tqdm(items, desc=desc)

