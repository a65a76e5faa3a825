"""How good are a run's step-level pairs? On the synthetic lookup tasks every reply has a known worth, so the
critic's ranking can be checked against the truth: the rankings' agreement with the oracle below (overall, by
reply kind and by state) and each policy's behaviour (questions on the task's keys, answers, copy accuracy of the
values the user stated). The pipeline's report stage and `python -m sweet_jax.pipeline_diagnostics` read them.

Oracle worth of a reply a_t at agent turn t (1-based) after the dialogue o_t, with a turn limit of T agent turns
(the T-th reply must be the answer): the reward the best continuation reaches from there, less a small cost
TURN_COST for each further turn it needs —
  an answer ("I WANT TO ANSWER:"): the fraction of the task's keys whose value it writes correctly; no further turn;
  a question at t < T: the user states (at most two of) the task's keys it names (the scripted human's rule), so
    the keys known after it are those stated so far plus those; the r = T - t turns left allow r - 1 more
    questions of two keys each before the answer: (known + min(unknown, 2 (r - 1))) / n, less TURN_COST for the
    question itself and each further question and the answer it takes;
  a question at t = T: the episode ends without an answer: 0.
So at a state where every value is known a correct answer (1.0) beats a repeated question (1.0 - TURN_COST),
a question that learns a new value beats one that learns none, and no question is worth more than the turn limit
lets it be. TURN_COST (0.01) is below any reward difference (1/n >= 1/4 over at most 10 turns), so it only breaks
ties between replies that reach the same reward.

A task of the discovery family (envs/discovery.py, docs/discovery.md) has its own oracle, kinds and states, by the
same definition; reply_worth, reply_kind and turn_state pick the task's family. max_turns=None: the family's limit.
"""
from __future__ import annotations

import math
import pathlib
import re
from typing import Sequence

from sweet_jax import jsonl
from sweet_jax.data.schema import PolicyPair
from sweet_jax.envs import ANSWER_MARKER, discovery, synthetic
from sweet_jax.rl.run_files import ReportError, check_trajectory_index, read_episodes

TURN_COST = 0.01
MAX_TURNS = 10          # the environment's default turn limit (envs.ColBenchEnv)
KEYS_PER_REPLY = 2      # the scripted human states at most two values a reply (synthetic.simulator_reply)


def _named(text: str, keys) -> set[str]:
    return {k for k in keys if re.search(rf"\b{re.escape(k)}\b", text.lower())}


def _stated_by_reply(text: str, keys) -> set[str]:
    """The keys the scripted human states in answer to `text`: the first two task keys it names."""
    named = sorted((m.start(), k) for k in keys for m in [re.search(rf"\b{re.escape(k)}\b", text.lower())] if m)
    return {k for _, k in named[:KEYS_PER_REPLY]}


def known_keys(task, prompt_messages: Sequence[dict]) -> set[str]:
    """The task's keys whose value the user has stated in the dialogue so far (after the task statement)."""
    truth = synthetic.hidden_constants(task)
    user_turns = [m["content"] for m in prompt_messages if m["role"] == "user"][1:]
    return set().union(*[_named(t, truth) for t in user_turns]) if user_turns else set()


def agent_turn(prompt_messages: Sequence[dict]) -> int:
    """The 1-based index of the agent turn that replies after these messages."""
    return 1 + sum(m["role"] == "assistant" for m in prompt_messages)


def reply_worth(task, prompt_messages: Sequence[dict], reply: str, *, max_turns: int | None = None) -> float:
    if discovery.is_task(task):
        return discovery.reply_worth(task, prompt_messages, reply, max_turns=max_turns or discovery.MAX_TURNS)
    max_turns = max_turns or MAX_TURNS
    truth = synthetic.hidden_constants(task)
    n = len(truth)
    if not n:
        return 0.0
    if ANSWER_MARKER in reply:
        written = synthetic.hidden_constants({"ground_truth": reply.split(ANSWER_MARKER, 1)[1]})
        return sum(written.get(k) == v for k, v in truth.items()) / n
    t = agent_turn(prompt_messages)
    if t >= max_turns:
        return 0.0
    known = known_keys(task, prompt_messages) | _stated_by_reply(reply, truth)
    unknown = n - len(known)
    more_questions = min(math.ceil(unknown / KEYS_PER_REPLY), max_turns - t - 1)
    reached = min(n, len(known) + KEYS_PER_REPLY * more_questions) / n
    return reached - TURN_COST * (1 + more_questions)   # the turns it adds before the answer: itself and the later ones


def reply_kind(task, prompt_messages: Sequence[dict], reply: str) -> str:
    """What a reply does, in the oracle's terms: answer_correct / answer_wrong (every value right or not);
    question_new (learns a value not yet stated), question_repeat (names only stated keys), question_other
    (names no key of the task). A discovery task's kinds: discovery.reply_kind."""
    if discovery.is_task(task):
        return discovery.reply_kind(task, prompt_messages, reply)
    truth = synthetic.hidden_constants(task)
    if ANSWER_MARKER in reply:
        written = synthetic.hidden_constants({"ground_truth": reply.split(ANSWER_MARKER, 1)[1]})
        return "answer_correct" if all(written.get(k) == v for k, v in truth.items()) else "answer_wrong"
    asked = _stated_by_reply(reply, truth)
    if not asked:
        return "question_other"
    return "question_new" if asked - known_keys(task, prompt_messages) else "question_repeat"


def turn_state(task, prompt_messages: Sequence[dict]) -> dict:
    """Where a turn prompt stands: its agent turn index, how many of the task's values are known, and
    `all_known` (every value stated: answering is right now); a discovery task's also counts the hidden keys not
    yet discovered."""
    if discovery.is_task(task):
        return discovery.turn_state(task, prompt_messages)
    n, known = len(synthetic.hidden_constants(task)), len(known_keys(task, prompt_messages))
    return {"turn": agent_turn(prompt_messages), "known": known, "keys": n, "all_known": known == n}


def pair_evidence(pairs_path, trajectories_path, *, max_turns: int | None = None) -> list[dict]:
    """Every pair of a ranking (rank*/pairs.jsonl) with what explains it: the state of its turn prompt, the kind
    and oracle worth of each reply, the critic's scores and the oracle's verdict (agree / disagree / tie)."""
    trajs = read_episodes(trajectories_path)
    rows = []
    for where, line in jsonl.lines(pairs_path):
        p = PolicyPair.from_json(jsonl.parse(line, where), where=where)
        task = check_trajectory_index(p.trajectory_index, trajs, where)["task"]
        worth = [reply_worth(task, p.prompt, r, max_turns=max_turns) for r in (p.chosen, p.rejected)]
        verdict = "agree" if worth[0] > worth[1] else "disagree" if worth[0] < worth[1] else "tie"
        rows.append({"trajectory_index": p.trajectory_index, "turn_index": p.turn, **turn_state(task, p.prompt),
                     "chosen_kind": reply_kind(task, p.prompt, p.chosen),
                     "rejected_kind": reply_kind(task, p.prompt, p.rejected),
                     "chosen_worth": worth[0], "rejected_worth": worth[1], "verdict": verdict,
                     "chosen_score": p.chosen_score, "rejected_score": p.rejected_score,
                     "chosen": p.chosen, "rejected": p.rejected})
    return rows


def pair_oracle_agreement(pairs_path, trajectories_path, *, max_turns: int | None = None) -> dict:
    """Share of a ranking's pairs whose chosen reply the oracle also prefers (ties counted apart)."""
    verdicts = [r["verdict"] for r in pair_evidence(pairs_path, trajectories_path, max_turns=max_turns)]
    agree, disagree = verdicts.count("agree"), verdicts.count("disagree")
    return {"pairs": len(verdicts), "decided": agree + disagree, "ties": verdicts.count("tie"),
            "agreement_pct": 100.0 * agree / (agree + disagree) if agree + disagree else None}


def _coarse(kind: str) -> str:
    return kind.split("_")[0]


def pair_kinds(pairs_path, trajectories_path, *, max_turns: int | None = None, fine: bool = False) -> dict:
    """The oracle's verdicts by the kinds of the two replies ("question over answer": {"agree": .., "disagree":
    .., "tie": ..}, chosen first; `fine` uses reply_kind's five kinds) and by the prompt's state ("all values
    known" / "some unknown"): which decisions the ranking makes, and which it gets right."""
    out: dict[str, dict[str, int]] = {}
    for r in pair_evidence(pairs_path, trajectories_path, max_turns=max_turns):
        kinds = (r["chosen_kind"], r["rejected_kind"]) if fine else (_coarse(r["chosen_kind"]),
                                                                      _coarse(r["rejected_kind"]))
        state = "all values known" if r["all_known"] else "some unknown"
        for key in (f"{kinds[0]} over {kinds[1]}", f"{state}: {kinds[0]} over {kinds[1]}"):
            cell = out.setdefault(key, {"agree": 0, "disagree": 0, "tie": 0})
            cell[r["verdict"]] += 1
    return dict(sorted(out.items()))


def annotate_scores(row: dict, trajectories: Sequence[dict], *, max_turns: int | None = None) -> dict:
    """A ranking's scores line (one turn's candidates) with the turn's state and each candidate's kind and
    oracle worth."""
    where = f"scores line of turn {row.get('turn')!r}"
    traj = check_trajectory_index(row.get("trajectory_index"), trajectories, where)
    history = traj["dialogue_history"]
    assistant = [i for i, m in enumerate(history) if m["role"] == "assistant"]
    check_turn = row.get("turn")
    if not isinstance(check_turn, int) or isinstance(check_turn, bool) or not 1 <= check_turn <= len(assistant):
        raise ReportError(f"{where}: field 'turn': not one of the episode's {len(assistant)} agent turns")
    prompt = history[:assistant[row["turn"] - 1]]
    task = traj["task"]
    return dict(row, **turn_state(task, prompt), kinds=[reply_kind(task, prompt, t) for t in row["texts"]],
                worth=[reply_worth(task, prompt, t, max_turns=max_turns) for t in row["texts"]])


def prompt_states(prompts: Sequence, trajectories: Sequence[dict]) -> dict:
    """How the ranked turn prompts (ranking.TurnPrompt) are spread over states: {"turn 1, 0/3 known": n, ...}
    and the count where every value is known (where answering is right)."""
    counts: dict[str, int] = {}
    all_known = 0
    for p in prompts:
        st = turn_state(trajectories[p.trajectory_index]["task"], p.messages)
        key = f"turn {st['turn']}, {st['known']}/{st['keys']} known"
        counts[key] = counts.get(key, 0) + 1
        all_known += st["all_known"]
    return {"prompts": len(prompts), "all_known": all_known, "by_state": dict(sorted(counts.items()))}


def policy_behaviour(trajectories: Sequence[dict]) -> dict:
    """What a policy does on the synthetic tasks, from its episodes (scripted ones, marked `scripted`, left
    out): does it ask about the task's keys, does it answer, and does its answer copy the values the user
    stated (copy accuracy) or guess right the ones never asked (chance: 10%)? And how many replies of each of the
    oracle's kinds an episode holds (reply_kind; the discovery family's discovery and untested-key questions)."""
    episodes = [t for t in trajectories if not t.get("scripted")]
    questions = on_task = off_task = answers = 0
    keys_total = keys_written = stated = copied = unstated = guessed = 0
    kinds: dict[str, int] = {}
    for t in episodes:
        task = t["task"]
        truth, theme_keys = synthetic.hidden_constants(task), synthetic.task_theme(task).keys
        told: set[str] = set()
        for i, turn in enumerate(t["dialogue_history"]):
            if turn["role"] == "user":
                if i > 0:
                    told |= _named(turn["content"], truth)
                continue
            kind = reply_kind(task, t["dialogue_history"][:i], turn["content"])
            kinds[kind] = kinds.get(kind, 0) + 1
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
            "guess_accuracy_pct": pct(guessed, unstated),
            "replies_per_episode": {k: kinds[k] / len(episodes) for k in sorted(kinds)}}


def behaviour_diagnostics(workdir) -> dict:
    """policy_behaviour of the starting policy's offline episodes, of each iterative round's episodes (the previous
    round's policy) and of every evaluated policy."""
    workdir = pathlib.Path(workdir)
    sources = {"offline (starting policy, training tasks)": workdir / "offline" / "trajectories.jsonl"}
    sources.update({f"round {r} offline (round {r - 1}'s policy, training tasks)": _round_episodes(d)
                    for r, d in _rounds(workdir)})
    sources.update({f"eval {d.name}": d / "trajectories.jsonl" for d in sorted((workdir / "eval").glob("*"))})
    out = {}
    for name, path in sources.items():
        if path.exists():
            out[name] = policy_behaviour(read_episodes(path))
    return out


# The rankings of the offline episodes a pipeline run may hold (its stage directories): with c, without c, on
# prompts balanced by state, by the oracle (the control).
RANKINGS = ("rank", "rank_no_info", "rank_balanced", "rank_oracle")


def _rounds(workdir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(r, rounds/<r>/) for each iterative round of a run, in order."""
    return sorted((int(d.name), d) for d in workdir.glob("rounds/*") if d.name.isdigit())


def _round_episodes(round_dir: pathlib.Path) -> pathlib.Path:
    """The episodes a round collected with the previous round's policy (pipeline stage round<r>_offline)."""
    return round_dir / "offline" / "collected.jsonl"


def rankings(workdir) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    """name -> (ranking stage directory, the trajectories its turn prompts come from): RANKINGS over the offline
    episodes, and each iterative round's ranking (rank_round<r>: rounds/<r>/rank over that round's episodes)."""
    workdir = pathlib.Path(workdir)
    out = {name: (workdir / name, workdir / "offline" / "trajectories.jsonl") for name in RANKINGS}
    out.update({f"rank_round{r}": (d / "rank", _round_episodes(d)) for r, d in _rounds(workdir)})
    return out


def run_diagnostics(workdir) -> dict:
    out = {}
    for name, (stage, trajectories) in rankings(workdir).items():
        pairs = stage / "pairs.jsonl"
        if pairs.exists() and trajectories.exists():
            out[name] = pair_oracle_agreement(pairs, trajectories)
    return out
