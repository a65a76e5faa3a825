"""Probes of what a run's models have learned about *when to answer*, on the synthetic lookup tasks: the
measurements behind docs/results.md ("The hypotheses, measured"). Each is exact (a forward pass), not sampled:

- answer_probability: P(the reply starts with "I WANT TO ANSWER:" | o_t), the product of the marker tokens'
  probabilities, for turn prompts grouped by state (every value known or not; agent turn index);
- answer_over_repeat: at prompts where every value is known, the DPO implicit reward margin
  beta * [(log pi - log pi_ref)(the correct answer) - (log pi - log pi_ref)(a repeated question)], log-probs summed
  over the reply's tokens as DPO sums them: > 0 when training has moved the policy towards answering there;
- critic_turn_scores: the critic's per-turn advantage (mean over a turn's tokens of log critic - log pi_ref, both
  seeing c) for every assistant turn of the offline trajectories, by reply kind and turn index, and what the
  Bradley-Terry objective compares with each normalisation: turn_mean (the sum of the turns' means, one term a
  turn) and trajectory_mean (one mean over all the trajectory's reply tokens).

    python -m sweet_jax.pipeline_diagnostics WORKDIR --probes      # the run's probes as JSON
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import ml_collections
import numpy as np

from sweet_jax.data import render
from sweet_jax.data.loading import load_trajectories
from sweet_jax.data.pairs import trajectory_pairs
from sweet_jax.data.tokenizers import load_tokenizer, pad_id
from sweet_jax.envs import ANSWER_MARKER, synthetic
from sweet_jax.envs.prompts import AGENT_PROMPT
from sweet_jax.models import load_hf
from sweet_jax.rl import diagnostics, ranking
from sweet_jax.train import model_loading
from sweet_jax.train.rundir import CHECKPOINT_DIR


_SCORE_STEPS: dict = {}


def _scorer(model):
    """model's mean log-prob function, with one compiled program per architecture: the probes score many models
    of one run (checkpoints, policies, critics) of the same shapes."""
    return ranking.make_mean_logp_fn(model, compiled=_SCORE_STEPS)


def summed_logps(model, tokenizer, seqs: Sequence[tuple[list[int], list[int]]], *, batch_size: int = 16,
                 bucket: int = 128) -> np.ndarray:
    """[len(seqs)] summed log-prob of each (input_ids, turn_ids)'s turn-id-1 tokens under `model`."""
    means = ranking.score_sequences(_scorer(model), seqs, batch_size=batch_size, bucket=bucket, pad=pad_id(tokenizer))
    return means * np.array([sum(1 for t in turns if t == 1) for _, turns in seqs], np.float64)


def _from_messages(prompt: ranking.TurnPrompt) -> ranking.TurnPrompt:
    """The prompt rendered from its messages, not from the recorded prompt string: so that the system prompt
    given here, not the one of the collection, is the one probed."""
    return dataclasses.replace(prompt, input_text=None)


def prefix_sequence(tokenizer, prompt: ranking.TurnPrompt, prefix: str, *, system_prompt: str | None = None):
    """(ids, turn ids) of the prompt as the policy samples from it, followed by `prefix` as the start of its reply."""
    ids, _ = ranking.prompt_ids(tokenizer, _from_messages(prompt), system_prompt=system_prompt)
    reply = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    return ids + reply, [0] * len(ids) + [1] * len(reply)


def reply_sequence(tokenizer, prompt: ranking.TurnPrompt, reply: str, *, system_prompt: str | None = None):
    """(ids, turn ids) of the prompt and a whole reply (its end-of-turn tokens included), as DPO scores it."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(prompt.messages)
    rendered = render.render_dialogue(tokenizer, messages + [{"role": "assistant", "content": reply}], info=None,
                                      label="last")
    return list(rendered.input_ids), [int(t == 1) for t in rendered.turn_ids]


def _by_state(states: Sequence[dict], values: np.ndarray) -> dict:
    """Mean of values over all prompts, those where every value is known, the others, and per turn index."""
    groups: dict[str, list[float]] = {"all prompts": list(values)}
    for st, v in zip(states, values):
        groups.setdefault("every value known" if st["all_known"] else "some value unknown", []).append(v)
        groups.setdefault(f"turn {st['turn']}", []).append(v)
    return {k: {"prompts": len(v), "mean": float(np.mean(v))} for k, v in groups.items()}


def answer_probability(model, tokenizer, prompts: Sequence[ranking.TurnPrompt], states: Sequence[dict], *,
                       system_prompt: str | None = None) -> dict:
    seqs = [prefix_sequence(tokenizer, p, ANSWER_MARKER, system_prompt=system_prompt) for p in prompts]
    return _by_state(states, np.exp(summed_logps(model, tokenizer, seqs)))


def correct_answer_and_repeat(task: dict, prompt: ranking.TurnPrompt) -> tuple[str, str]:
    """At a prompt where every value is known: the correct answer, and a question about a key already stated."""
    theme, truth = synthetic.task_theme(task), synthetic.hidden_constants(task)
    answer = f"{ANSWER_MARKER}\n" + synthetic.lookup_code(theme.function, theme.argument, truth)
    return answer, theme.question.format(key=sorted(truth)[0])


def answer_over_repeat(policy, reference, tokenizer, prompts: Sequence[ranking.TurnPrompt], tasks: Sequence[dict],
                       *, beta: float, system_prompt: str | None = None) -> dict:
    """The implicit reward margin of the correct answer over a repeated question, at every given prompt (each
    must have every value known), under a DPO policy against its reference."""
    seqs = []
    for p, task in zip(prompts, tasks):
        seqs += [reply_sequence(tokenizer, p, r, system_prompt=system_prompt)
                 for r in correct_answer_and_repeat(task, p)]
    if not seqs:
        return {"prompts": 0}
    rewards = beta * (summed_logps(policy, tokenizer, seqs) - summed_logps(reference, tokenizer, seqs))
    margins = rewards[0::2] - rewards[1::2]
    return {"prompts": len(prompts), "mean_margin": float(margins.mean()),
            "share_positive": float((margins > 0).mean())}


def critic_turn_scores(critic, reference, tokenizer, trajectories: Sequence, pairs: Sequence[tuple[int, int]], *,
                       use_info: bool, info_template: str, info_placement: str = "system") -> dict:
    """The critic's per-turn advantages over the offline trajectories (data.Trajectory), by reply kind and turn
    index, and the trajectory pairs (chosen, rejected indices) it ranks right under each normalisation."""
    prompts = ranking.turn_prompts(trajectories)
    replies = [trajectories[p.trajectory_index].dialogue_history[len(p.messages)].content for p in prompts]
    kw = dict(info_template=info_template, info_placement=info_placement, use_info=use_info)
    rendered = [ranking.critic_sequence(tokenizer, p, r, **kw) for p, r in zip(prompts, replies)]
    seqs = [(list(x.input_ids), [int(t == 1) for t in x.turn_ids]) for x in rendered]
    counts = np.array([sum(t) for _, t in seqs], np.float64)
    score = lambda model: ranking.score_sequences(_scorer(model), seqs, batch_size=16, bucket=128,  # noqa: E731
                                                  pad=pad_id(tokenizer))
    advantage = score(critic) - score(reference)
    by_kind: dict[str, list[float]] = {}
    per_traj: dict[int, list[tuple[float, float]]] = {}
    for p, reply, a, n in zip(prompts, replies, advantage, counts):
        kind = diagnostics.reply_kind(trajectories[p.trajectory_index].task.to_json(), p.messages, reply)
        for key in (kind, f"{kind}, turn {p.turn}"):
            by_kind.setdefault(key, []).append(float(a))
        per_traj.setdefault(p.trajectory_index, []).append((float(a), float(n)))
    turn_mean = {i: sum(a for a, _ in v) for i, v in per_traj.items()}
    trajectory_mean = {i: sum(a * n for a, n in v) / sum(n for _, n in v) for i, v in per_traj.items()}
    turns = {i: len(v) for i, v in per_traj.items()}

    def ranked_right(traj_score):
        decided = [(c, r) for c, r in pairs if c in traj_score and r in traj_score]
        return float(np.mean([traj_score[c] > traj_score[r] for c, r in decided])) if decided else None

    def with_turns(traj_score):   # does the score grow with the number of turns, whatever they are?
        keys = sorted(traj_score)
        if len(keys) < 3 or len({turns[k] for k in keys}) < 2:
            return None
        return float(np.corrcoef([traj_score[k] for k in keys], [turns[k] for k in keys])[0, 1])

    return {
        "turns_scored": len(prompts),
        "by_kind": {k: {"turns": len(v), "mean_advantage": float(np.mean(v))} for k, v in sorted(by_kind.items())},
        "pairs": len(pairs),
        "pair_accuracy": {"turn_mean": ranked_right(turn_mean), "trajectory_mean": ranked_right(trajectory_mean)},
        "score_vs_number_of_turns_correlation": {"turn_mean": with_turns(turn_mean),
                                                 "trajectory_mean": with_turns(trajectory_mean)},
    }


def load_states(prompts: Sequence[ranking.TurnPrompt], trajectories: Sequence[dict]) -> list[dict]:
    return [diagnostics.turn_state(trajectories[p.trajectory_index]["task"], p.messages) for p in prompts]


def checkpoint_steps(train_dir: pathlib.Path) -> list[int]:
    root = train_dir / CHECKPOINT_DIR
    return sorted(int(d.name) for d in root.iterdir() if d.name.isdigit()) if root.is_dir() else []


def run_probes(workdir: pathlib.Path) -> dict:
    """sweet_jax.rl.probes over a pipeline run: the starting policy, each SWEET-RL run's kept checkpoints and
    final policy, the other trained policies, and the critics."""
    config = ml_collections.ConfigDict(json.loads((workdir / "pipeline_config.json").read_text()))
    offline = workdir / "offline" / "trajectories.jsonl"
    trajs = load_trajectories(offline)
    records = [t.to_json() for t in trajs]
    start_hf = json.loads((workdir / "init" / "done.json").read_text())["summary"]["policy_hf"]
    tokenizer = load_tokenizer(start_hf)   # every model of a run reads the starting policy's tokenizer
    start = load_hf(start_hf)
    system = AGENT_PROMPT if config.agent_prompt else None

    every = ranking.turn_prompts(trajs)
    r = config.rank
    ranked = every if not (workdir / "candidates" / "done.json").exists() else ranking.select_turn_prompts(
        every, r.get("turn_selection", "sample"), max_prompts=r.max_prompts, data_fraction=r.get("data_fraction", 1.0),
        seed=config.seed, tasks=[t["task"] for t in records])   # the ranked prompts, as the pipeline chose them
    ranked_states = load_states(ranked, records)
    ready = [p for p, st in zip(every, load_states(every, records)) if st["all_known"]]
    ready_tasks = [records[p.trajectory_index]["task"] for p in ready]
    out: dict = {"ranked_prompts": len(ranked), "offline_prompts_with_every_value_known": len(ready)}

    def policy_probes(model) -> dict:
        return {"answer_probability": answer_probability(model, tokenizer, ranked, ranked_states,
                                                                system_prompt=system),
                "answer_over_repeat": answer_over_repeat(model, start, tokenizer, ready, ready_tasks,
                                                                beta=config.sweet.beta, system_prompt=system)}

    out["starting policy"] = policy_probes(start)
    other = None if system else AGENT_PROMPT
    out["starting policy, agent prompt " + ("off" if system else "on")] = {
        "answer_probability": answer_probability(start, tokenizer, ranked, ranked_states, system_prompt=other)}
    for method in ("sweet", "sweet_no_info"):
        train_dir = workdir / "policies" / method / "train"
        for step in checkpoint_steps(train_dir):
            model = model_loading.restore_model(train_dir, step)[0]
            out[f"{method} step {step}"] = policy_probes(model)
    for method in ("rft", "mtdpo", "sweet", "sweet_no_info"):
        hf = workdir / "policies" / method / "hf"
        if hf.is_dir():
            out[f"{method} (final)"] = policy_probes(load_hf(str(hf)))
    index = {id(t): i for i, t in enumerate(trajs)}
    pairs = [(index[id(p.chosen)], index[id(p.rejected)])
             for p in trajectory_pairs(trajs, rule=config.collect.get("pair_rule", "best_success"))]
    for name, use_info in (("critic", True), ("critic_no_info", False)):
        if (workdir / name / "hf").is_dir():
            out[name] = critic_turn_scores(load_hf(str(workdir / name / "hf")), start, tokenizer, trajs, pairs,
                                                  use_info=use_info, info_template=config.rank.info_template,
                                                  info_placement=config.rank.info_placement)
    return out
