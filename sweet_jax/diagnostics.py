"""How good are a run's step-level pairs? On the synthetic lookup tasks every reply has a known worth, so the
critic's ranking can be checked against the truth: the rankings' agreement with the oracle below (overall and
by reply kind) and each policy's behaviour (questions on the task's keys, answers, copy accuracy of the values
the user stated). The pipeline's report stage and `python -m sweet_jax.pipeline_diagnostics` read them.

Oracle worth of a reply a_t after the dialogue o_t (data/synthetic.py tasks): the fraction of the task's
constants that are settled after it —
  an answer ("I WANT TO ANSWER:"): the fraction of the task's keys whose value it writes correctly;
  a question: the fraction of keys whose value the user has stated so far plus the new keys it asks about
  (what a later answer can copy).
A pair agrees with the oracle when its chosen reply is worth more than its rejected one; pairs of equal worth
are not counted.
"""
from __future__ import annotations

import pathlib
import re
from typing import Sequence

from sweet_jax import jsonl
from sweet_jax.data import synthetic
from sweet_jax.data.schema import PolicyPair, load_records
from sweet_jax.envs import ANSWER_MARKER


def _named(text: str, keys) -> set[str]:
    return {k for k in keys if re.search(rf"\b{re.escape(k)}\b", text.lower())}


def reply_worth(task, prompt_messages: Sequence[dict], reply: str) -> float:
    truth = synthetic.hidden_constants(task)
    if not truth:
        return 0.0
    if ANSWER_MARKER in reply:
        written = synthetic.hidden_constants({"ground_truth": reply.split(ANSWER_MARKER, 1)[1]})
        return sum(written.get(k) == v for k, v in truth.items()) / len(truth)
    user_turns = [m["content"] for m in prompt_messages if m["role"] == "user"][1:]  # after the task statement
    known = set().union(*[_named(t, truth) for t in user_turns]) if user_turns else set()
    return len(known | _named(reply, truth)) / len(truth)


def pair_oracle_agreement(pairs_path, trajectories_path) -> dict:
    """Share of a ranking's pairs (rank*/pairs.jsonl) whose chosen reply the oracle also prefers."""
    trajs = jsonl.read(trajectories_path)
    agree = disagree = ties = 0
    for p in load_records(pairs_path, PolicyPair):
        task = trajs[p.trajectory_index]["task"]
        chosen = reply_worth(task, p.prompt, p.chosen)
        rejected = reply_worth(task, p.prompt, p.rejected)
        if chosen > rejected:
            agree += 1
        elif chosen < rejected:
            disagree += 1
        else:
            ties += 1
    decided = agree + disagree
    return {"pairs": agree + disagree + ties, "decided": decided, "ties": ties,
            "agreement_pct": 100.0 * agree / decided if decided else None}


def _kind(reply: str) -> str:
    return "answer" if ANSWER_MARKER in reply else "question"


def pair_kinds(pairs_path, trajectories_path) -> dict:
    """Oracle agreement by the kinds of the two replies (chosen vs rejected: question / answer): which
    decisions the ranking gets right. {"question>answer": [agree, decided], ...}."""
    trajs = jsonl.read(trajectories_path)
    out: dict[str, list[int]] = {}
    for p in load_records(pairs_path, PolicyPair):
        task = trajs[p.trajectory_index]["task"]
        chosen, rejected = (reply_worth(task, p.prompt, reply) for reply in (p.chosen, p.rejected))
        if chosen == rejected:
            continue
        cell = out.setdefault(f"{_kind(p.chosen)} over {_kind(p.rejected)}", [0, 0])
        cell[0] += chosen > rejected
        cell[1] += 1
    return out


def policy_behaviour(trajectories: Sequence[dict]) -> dict:
    """What a policy does on the synthetic tasks, from its episodes (scripted ones, marked `scripted`, left
    out): does it ask about the task's keys, does it answer, and does its answer copy the values the user
    stated (copy accuracy) or guess right the ones never asked (chance: 10%)?"""
    episodes = [t for t in trajectories if not t.get("scripted")]
    questions = on_task = off_task = answers = 0
    keys_total = keys_written = stated = copied = unstated = guessed = 0
    for t in episodes:
        task = t["task"]
        truth, theme_keys = synthetic.hidden_constants(task), synthetic.task_theme(task).keys
        told: set[str] = set()
        for i, turn in enumerate(t["dialogue_history"]):
            if turn["role"] == "user":
                if i > 0:
                    told |= _named(turn["content"], truth)
                continue
            if ANSWER_MARKER in turn["content"]:
                answers += 1
                written = synthetic.hidden_constants({"ground_truth": turn["content"].split(ANSWER_MARKER, 1)[1]})
                keys_total += len(truth)
                keys_written += sum(k in written for k in truth)
                for k, v in truth.items():
                    if k in told:
                        stated += 1
                        copied += written.get(k) == v
                    else:
                        unstated += 1
                        guessed += written.get(k) == v
                break
            questions += 1
            named = _named(turn["content"], theme_keys)
            on_task += bool(named & set(truth))
            off_task += bool(named - set(truth))
    pct = lambda a, b: 100.0 * a / b if b else None  # noqa: E731
    rewards = [t.get("reward") for t in episodes if t.get("reward") is not None]
    return {"episodes": len(episodes), "success_pct": pct(sum(r == 1.0 for r in rewards), len(rewards)),
            "questions_per_episode": questions / len(episodes) if episodes else None,
            "questions_naming_a_task_key_pct": pct(on_task, questions),
            "questions_naming_another_key_pct": pct(off_task, questions),
            "episodes_with_answer_pct": pct(answers, len(episodes)),
            "answer_key_coverage_pct": pct(keys_written, keys_total),
            "copy_accuracy_pct": pct(copied, stated), "stated_keys_pct": pct(stated, keys_total),
            "guess_accuracy_pct": pct(guessed, unstated)}


def behaviour_diagnostics(workdir) -> dict:
    """policy_behaviour of the starting policy's offline episodes and of every evaluated policy."""
    workdir = pathlib.Path(workdir)
    sources = {"offline (starting policy, training tasks)": workdir / "offline" / "trajectories.jsonl"}
    sources.update({f"eval {d.name}": d / "trajectories.jsonl" for d in sorted((workdir / "eval").glob("*"))})
    out = {}
    for name, path in sources.items():
        if path.exists():
            out[name] = policy_behaviour(jsonl.read(path))
    return out


def run_diagnostics(workdir) -> dict:
    workdir = pathlib.Path(workdir)
    traj = workdir / "offline" / "trajectories.jsonl"
    out = {}
    for name in ("rank", "rank_no_info"):
        pairs = workdir / name / "pairs.jsonl"
        if pairs.exists() and traj.exists():
            out[name] = pair_oracle_agreement(pairs, traj)
    return out
