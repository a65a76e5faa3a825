"""Best-of-N ranking: candidate replies for every turn of the offline trajectories, scored by the critic (what
`python -m sweet_jax.rank` and the pipeline's candidates and rank stages run): turn prompts o_t -> N candidates
per prompt from the policy (temperature 1.0, with their log-probs) -> critic score of each candidate -> policy
pairs -> JSONL.

Score of a candidate a for the prompt o_t (DESIGN.md section 1, policy step 2):

    A(o_t, a, c) = mean over a's tokens of log pi_critic(a | c, o_t)  -  reference

with `rank_reference`:
  ref_with_info  mean log pi_ref(a | c, o_t): the reference model fed the same c (default; the paper);
  sampler        the sampler's own mean log-prob of a, without c (what the official code subtracts).

Pairs per turn (data.policy_pairs): chosen uniformly from the top half, rejected from the bottom half,
num_pairs of them, seeded, chosen always scoring strictly higher.

Output (one JSON object a line, appended batch by batch; a rerun skips turns already written):
  trajectory_index, turn, task_key, prompt (messages before the reply), prompt_text (the rendered prompt
  the candidates were sampled from), chosen, rejected, chosen_score, rejected_score, rank_reference.

The critic scorer is any function items -> mean log-probs, so tests and other critics plug in:
`rank_turns(..., critic_logp=fn, reference_logp=fn)` with fn([(TurnPrompt, reply_text), ...]) -> [N].
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from sweet_jax import costs, jsonl
from sweet_jax.config_utils import RANK_PATH_FIELDS, RANK_RANGES, absolute_paths, check_ranges
from sweet_jax.data import batching, demo, loading, render, tokenizers
from sweet_jax.data.pairs import policy_pairs
from sweet_jax.data.render import RenderError
from sweet_jax.data.schema import PolicyPair, Turn
from sweet_jax.data.tokenizers import apply_chat_template, pad_id
from sweet_jax.envs import AGENT_PROMPT
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import cpu_matmul
from sweet_jax.rl import diagnostics
from sweet_jax.sampling import policy_backend
from sweet_jax.sampling.base import BaseSampler
from sweet_jax.train import losses, model_loading, rundir, steps

log = logging.getLogger(__name__)

RANK_REFERENCES = ("ref_with_info", "sampler")


class RankError(SweetJaxError):
    """Ranking cannot run (bad config, a critic that cannot be loaded, ...)."""


@dataclasses.dataclass(frozen=True)
class TurnPrompt:
    """The prompt o_t before the agent's t-th reply of one offline trajectory."""
    trajectory_index: int
    turn: int                    # 1-based index of the assistant reply this prompt precedes
    task_key: str
    ground_truth: str            # the training-time information c
    messages: tuple              # ({'role', 'content'}, ...) before the reply
    turns: tuple                 # data.Turn objects before the reply (pre-rendered trajectories)
    input_text: str | None       # the recorded prompt string of this turn (official `input`), if any

    @property
    def key(self) -> tuple[int, int]:
        return (self.trajectory_index, self.turn)


@dataclasses.dataclass
class Candidates:
    texts: list[str]
    sampler_logp: np.ndarray     # [N] the sampler's mean log-prob over each candidate's tokens (no c)
    prompt_text: str
    # The token ids the sampler read and wrote (its stop token included): the pairs carry them to the DPO
    # step, which trains on them instead of tokenising the texts again. None: texts only (e.g. read back).
    prompt_ids: list[int] | None = None
    token_ids: list[list[int]] | None = None


def turn_prompts(trajectories: Sequence[Any]) -> list[TurnPrompt]:
    """One TurnPrompt per assistant reply of each trajectory (data.Trajectory objects)."""
    prompts = []
    for i, traj in enumerate(trajectories):
        history = traj.dialogue_history
        turn = 0
        for j, t in enumerate(history):
            if t.role != "assistant":
                continue
            turn += 1
            before = history[:j]
            prompts.append(TurnPrompt(i, turn, traj.task.key, traj.task.ground_truth,
                                      tuple({"role": b.role, "content": b.content} for b in before),
                                      tuple(before), t.input))
    return prompts


TURN_SELECTIONS = ("sample", "trajectories", "tasks", "balanced")


def official_order(prompts: Sequence[TurnPrompt]) -> list[int]:
    """The trajectory indices of `prompts` in the official offline file's order: block b holds the b-th trajectory
    of every task, tasks in the order they first appear (colbench_code_offline_15k_llama8b.jsonl: row b * N + i is
    sample b of task i). A file written that way keeps its order; one written task by task (ours: the k samples of a
    task on consecutive rows) is read as the official one would be laid out, so that its first fraction spans tasks."""
    first_seen: dict[str, int] = {}
    samples: dict[str, int] = {}
    place = {}   # trajectory index -> (its sample number within its task, its task's first appearance)
    for index, task in sorted({p.trajectory_index: p.task_key for p in prompts}.items()):
        place[index] = (samples.get(task, 0), first_seen.setdefault(task, len(first_seen)))
        samples[task] = place[index][0] + 1
    return sorted(place, key=place.__getitem__)


def select_turn_prompts(prompts: list, selection: str, *, max_prompts: int, data_fraction: float, seed: int,
                        tasks: Sequence[dict] | None = None, field: str = "rank") -> list:
    """Which turn prompts get candidates:
    sample        a seeded sample of max_prompts;
    trajectories  every turn of the first data_fraction of the trajectories in the official file's order
                  (official_order: one trajectory of each of many tasks, as the official sample_best_of_n.py
                  --data_fraction reads its file), capped at max_prompts;
    tasks         every turn of every trajectory of a seeded data_fraction of the tasks;
    balanced      a seeded sample of max_prompts, of which those where every value is known (synthetic tasks,
                  `tasks` by trajectory index) make up to half."""
    if selection not in TURN_SELECTIONS:
        raise RankError(f"{field}.turn_selection={selection!r}: use one of {', '.join(TURN_SELECTIONS)}")
    rng = np.random.default_rng(seed)

    def sample(items, n):
        if not n or n >= len(items):
            return items
        return [items[i] for i in sorted(rng.choice(len(items), n, replace=False))]

    if selection in ("trajectories", "tasks"):
        if not 0.0 < data_fraction <= 1.0:
            raise RankError(f"{field}.data_fraction={data_fraction}: use a fraction in (0, 1]")
        if selection == "trajectories":
            order = official_order(prompts)
            chosen = set(order[:int(len(order) * data_fraction)])
            what = f"{len(order)} trajectories"
        else:
            keys = sorted({p.task_key for p in prompts})
            count = int(len(keys) * data_fraction)
            chosen = set(sample(keys, count)) if count else set()
            what = f"{len(keys)} tasks"
        kept = [p for p in prompts if (p.trajectory_index if selection == "trajectories" else p.task_key) in chosen]
        if not kept:
            raise RankError(f"{field}.data_fraction={data_fraction} of {what} keeps none; raise it")
        return kept[:max_prompts] if max_prompts else kept
    if selection == "balanced":
        if tasks is None:
            raise RankError(f"{field}.turn_selection='balanced' needs the synthetic tasks (it balances prompts "
                            "by which values are known)")
        known = [diagnostics.turn_state(tasks[p.trajectory_index], p.messages)["all_known"] for p in prompts]
        ready = [p for p, k in zip(prompts, known) if k]
        rest = [p for p, k in zip(prompts, known) if not k]
        n = max_prompts or len(prompts)
        ready = sample(ready, min(len(ready), n // 2))
        picked = ready + sample(rest, n - len(ready))
        return sorted(picked, key=lambda p: p.key)
    return sample(prompts, max_prompts)


# ----------------------------------------------------------------------------------------------------------
# Sampling candidates
# ----------------------------------------------------------------------------------------------------------

def prompt_ids(tokenizer, prompt: TurnPrompt, *, system_prompt: str | None = None) -> tuple[list[int], str]:
    """Token ids and text the policy samples from: the recorded prompt when the trajectory has one (the
    exact string the agent saw), else the chat template over the messages (plus an optional system prompt)."""
    if prompt.input_text:
        text = prompt.input_text
    else:
        messages = list(prompt.messages)
        if system_prompt:
            messages = [{"role": "system", "content": system_prompt}] + messages
        text = apply_chat_template(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def sample_candidates(sampler: BaseSampler, prompts: Sequence[TurnPrompt], *, n: int, max_new_tokens: int,
                      temperature: float = 1.0, seed: int = 0, system_prompt: str | None = None) -> list[Candidates]:
    encoded = [prompt_ids(sampler.tokenizer, p, system_prompt=system_prompt) for p in prompts]
    samples = sampler.generate([ids for ids, _ in encoded], max_new_tokens=max_new_tokens, temperature=temperature,
                               n=n, seed=seed)
    out = []
    for (ids, text), per_prompt in zip(encoded, samples):
        out.append(Candidates([s.text for s in per_prompt],
                              np.array([np.mean(s.logprobs) if len(s.logprobs) else 0.0 for s in per_prompt]),
                              text, prompt_ids=[int(i) for i in ids],
                              token_ids=[[int(i) for i in s.token_ids] for s in per_prompt]))
    return out


# ----------------------------------------------------------------------------------------------------------
# Scoring: mean log-prob of a reply under a model that sees c
# ----------------------------------------------------------------------------------------------------------

def critic_sequence(tokenizer, prompt: TurnPrompt, reply: str, *, info_template: str, info_placement: str,
                    use_info: bool = True, style: str = "reply", system_prompt: str | None = None):
    """The sequence the critic reads for (c, o_t, a): the reply's tokens carry turn id 1, all others 0.
    style="official": the official ranking script's sequence (data.render.render_official_score: a second BOS,
    c as a raw prefix, the reply's header tokens scored with the reply, no end-of-turn) over the prompt text the
    candidates were sampled from (prompt_ids: the recorded `input`, or the template with system_prompt)."""
    info = prompt.ground_truth if use_info else None
    if style == "official":
        text = prompt_ids(tokenizer, prompt, system_prompt=system_prompt)[1]
        return render.render_official_score(tokenizer, text, reply, info=info, info_template=info_template)
    if prompt.input_text is not None and all(t.input is not None and t.output is not None
                                             for t in prompt.turns if t.role == "assistant"):
        turns = tuple(prompt.turns) + (Turn("assistant", reply, prompt.input_text, reply),)
        return render.render_prerendered(tokenizer, turns, info=info, info_template=info_template, label="last")
    messages = list(prompt.messages) + [{"role": "assistant", "content": reply}]
    return render.render_dialogue(tokenizer, messages, info=info, info_template=info_template,
                                  info_placement=info_placement, label="last")


def make_mean_logp_fn(model, temperature: float = 1.0, *, compiled: dict | None = None):
    """(input_ids [B,T], attention_mask [B,T], turn_ids [B,T]) -> [B] mean log-prob of each row's turn-id-1
    tokens: the critic score step (steps.make_score_step, turn_mean) with a zero reference, so the
    reference term (pi_ref with c, or the sampler's) is subtracted outside and either kind plugs in.
    compiled: a dict shared by calls that score several models of one architecture (Llama keeps no
    non-parameter state), which then share one compiled step, keyed by the model's graph and the temperature."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    key = (graphdef, jax.tree.structure(rest), temperature)
    score = None if compiled is None else compiled.get(key)
    if score is None:
        score = steps.make_score_step(graphdef, num_turns=1, advantage_norm="turn_mean", rest=rest,
                                      temperature=temperature)
        if compiled is not None:
            compiled[key] = score

    def mean_logp(ids_BT, mask_BT, turns_BT):
        batch = {"input_ids": ids_BT[:, None], "attention_mask": mask_BT[:, None], "turn_ids": turns_BT[:, None],
                 "ref_logp": np.zeros(ids_BT.shape, np.float32)[:, None]}
        return np.asarray(score(params, batch))[:, 0, 0]  # [B, P=1, num_turns=1] -> [B]

    return mean_logp


def make_prefix_mean_logp_fn(model, temperature: float = 1.0):
    """make_mean_logp_fn's scores for rows that continue one prefix, the prefix run once:
    (prefix_ids [1, S] left-padded, prefix_mask [1, S], ids [B, T] right-padded, mask [B, T], turn_ids [B, T])
    -> [B] mean log-prob of each row's turn-id-1 tokens given the prefix and the row's earlier tokens.

    The prefix's K/V go into a cache of S + T slots, copied to every row; the rows then run at slots [S, S + T)
    attending to it, and the unembedding runs on the rows' T positions only (the prefix's last hidden state
    predicts each row's first token)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    matmul = model.config.matmul

    @jax.jit
    def score(params, prefix_1S, prefix_mask_1S, ids_BT, mask_BT, turns_BT):
        m = nnx.merge(graphdef, params, rest)
        (B, T), S = ids_BT.shape, prefix_1S.shape[1]
        # Every slot past the prefix is marked valid for the prefix's pass: causality hides them (generate's rule).
        slots_1L = jnp.concatenate([prefix_mask_1S, jnp.ones((1, T), prefix_mask_1S.dtype)], axis=1)
        hidden_1SD, cache = m.hidden_states(prefix_1S, slots_1L, cache=m.init_cache(1, S + T), cache_pos=0)
        cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (B,) + x.shape[1:]), cache)
        slots_BL = jnp.concatenate([jnp.broadcast_to(prefix_mask_1S, (B, S)), mask_BT], axis=1)
        hidden_BTD, _ = m.hidden_states(ids_BT, slots_BL, cache=cache, cache_pos=S)
        before_BTD = jnp.concatenate([jnp.broadcast_to(hidden_1SD[:, -1:], (B, 1, hidden_BTD.shape[-1])),
                                      hidden_BTD[:, :-1]], axis=1)  # the state that predicts each row token
        with cpu_matmul.unembedding(matmul):
            logp_BT = losses.label_logprobs(before_BTD, steps._unembedding(m, temperature)[0], ids_BT)
        return losses.turn_advantages(logp_BT, jnp.zeros_like(logp_BT), turns_BT, num_turns=1, norm="turn_mean")[:, 0]

    def prefix_mean_logp(*arrays):
        return np.asarray(score(params, *arrays))

    prefix_mean_logp.lower = lambda *arrays: score.lower(params, *arrays)  # for compiled-program measurements
    return prefix_mean_logp


def make_packed_mean_logp_fn(model, temperature: float = 1.0):
    """The label log-probs of sequences packed behind the prefixes they share (steps.make_packed_logp_fn over
    batching.pack_rows' arrays) -> [B, X] numpy, with this model's parameters; score_packed takes the means."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    logp = steps.make_packed_logp_fn(graphdef, rest=rest, temperature=temperature)
    return lambda arrays: np.asarray(logp(params, arrays))


SCORE_LAYOUTS = ("packed", "prefix_cache", "whole")


class ReplyScorer:
    """items [(TurnPrompt, reply text)] -> [N] mean log-prob of each reply under `model`, seeing c.

    layout: how a scoring pass lays out the candidates of one turn prompt (same tokens up to the reply); the same
    scores up to float rounding each way, each distinct sequence scored once in the first two:
      packed (default)  one row a call: the prompt once, then each candidate's tokens, kept apart by the
                        attention's segments (score_packed): no row padded to the longest candidate;
      prefix_cache      the prompt run once into a KV cache, the candidates as rows on it (score_shared_prefixes);
      whole             every item's whole sequence in length-sorted batches (score_sequences)."""

    def __init__(self, model, tokenizer, *, info_template: str, info_placement: str = "system",
                 use_info: bool = True, batch_size: int = 16, bucket: int = 128, max_len: int = 8192,
                 style: str = "reply", temperature: float = 1.0, system_prompt: str | None = None,
                 layout: str = "packed"):
        if layout not in SCORE_LAYOUTS:
            raise RankError(f"score layout {layout!r}: use one of {SCORE_LAYOUTS}")
        self.tokenizer, self.info_template, self.info_placement = tokenizer, info_template, info_placement
        self.use_info, self.batch_size, self.bucket, self.max_len = use_info, batch_size, bucket, max_len
        self.pad = pad_id(tokenizer)
        self.style, self.system_prompt = style, system_prompt
        self.layout = layout
        make, self.score = {"packed": (make_packed_mean_logp_fn, score_packed),
                            "prefix_cache": (make_prefix_mean_logp_fn, score_shared_prefixes),
                            "whole": (make_mean_logp_fn, score_sequences)}[layout]
        self.mean_logp = make(model, temperature)
        self.unscorable: list[tuple[tuple[int, int], str]] = []

    def __call__(self, items: Sequence[tuple[TurnPrompt, str]]) -> np.ndarray:
        """Mean log-probs [len(items)]; NaN for a reply that cannot be scored (see `self.unscorable`)."""
        seqs = []
        for prompt, text in items:
            try:
                seq = critic_sequence(self.tokenizer, prompt, text, info_template=self.info_template,
                                      info_placement=self.info_placement, use_info=self.use_info,
                                      style=self.style, system_prompt=self.system_prompt)
                if len(seq) > self.max_len:
                    raise RenderError(f"{len(seq)} tokens > max_len={self.max_len}")
            except RenderError as e:
                # A sampled reply the template cannot delimit exactly (or too long) is left out of the
                # ranking rather than scored on the wrong tokens.
                self.unscorable.append((prompt.key, str(e)))
                seq = None
            seqs.append(seq)
        return self.score(self.mean_logp, [None if s is None else (s.input_ids, s.turn_ids) for s in seqs],
                          batch_size=self.batch_size, bucket=self.bucket, pad=self.pad)


def score_sequences(mean_logp, seqs: Sequence[tuple[Sequence[int], Sequence[int]] | None], *, batch_size: int,
                    bucket: int, pad: int) -> np.ndarray:
    """[len(seqs)] mean log-prob of each (input_ids, turn_ids)'s turn-id-1 tokens (NaN for None), in fixed-size
    batches of similar lengths padded to a multiple of `bucket`: one compiled shape per length bucket."""
    scores = np.full(len(seqs), np.nan, np.float32)
    order = sorted((i for i, s in enumerate(seqs) if s is not None), key=lambda i: len(seqs[i][0]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        T = -(-max(len(seqs[i][0]) for i in rows) // bucket) * bucket
        ids = np.full((batch_size, T), pad, np.int32)
        mask = np.zeros((batch_size, T), np.int32)
        turns = np.zeros((batch_size, T), np.int32)
        for r, i in enumerate(rows):
            n = len(seqs[i][0])
            ids[r, :n], mask[r, :n], turns[r, :n] = seqs[i][0], 1, seqs[i][1]
        mask[len(rows):, 0] = 1  # padding rows attend to one token, never an empty row
        with costs.timed("score_pass"):
            scores[rows] = np.asarray(mean_logp(ids, mask, turns))[:len(rows)]
        costs.tokens("score", sum(len(seqs[i][0]) for i in rows), ids.size)
    return scores


def reply_start(turn_ids) -> int:
    """Where a sequence's shared prefix ends: its first scored (turn id 1) token, at least 1 and leaving at least one
    token after it (the whole sequence but its last token when nothing is scored)."""
    turn_ids = np.asarray(turn_ids)
    labelled = np.flatnonzero(turn_ids == 1)
    return min(max(int(labelled[0]) if len(labelled) else len(turn_ids) - 1, 1), len(turn_ids) - 1)


def score_shape(prefix_len: int, row_lengths: Sequence[int], batch_size: int) -> tuple[int, int, int]:
    """(S, B, T) of a shared-prefix scoring call: the prefix left-padded to S, B rows (a multiple of a quarter of
    batch_size: four row counts, few compiles) right-padded to T, at the sampler's prompt widths
    (batching.bucket_prompt: under 25% padding past 32 tokens)."""
    quarter = max(1, batch_size // 4)
    return (batching.bucket_prompt(prefix_len), min(batch_size, -(-len(row_lengths) // quarter) * quarter),
            batching.bucket_prompt(max(row_lengths, default=1)))


def score_shared_prefixes(prefix_mean_logp, seqs: Sequence[tuple[Sequence[int], Sequence[int]] | None], *,
                          batch_size: int, bucket: int, pad: int) -> np.ndarray:
    """score_sequences' result computed with a prefix shared by rows (make_prefix_mean_logp_fn): a sequence that
    occurs several times is scored once, and sequences with the same tokens before their first turn-id-1 token
    (one turn prompt's candidates) are the rows of one call (up to `batch_size`, shortest first; padded to a
    multiple of a quarter of it), the prefix left-padded and the rows right-padded (score_shape). `bucket`:
    score_sequences' (unused here)."""
    scores = np.full(len(seqs), np.nan, np.float32)
    for prefix, rows in turn_prompt_groups(seqs, batch_size):
        S, B, T = score_shape(len(prefix), [len(row_ids) for row_ids, _, _ in rows], batch_size)
        prefix_ids = np.full((1, S), pad, np.int32)
        prefix_mask = np.zeros((1, S), np.int32)
        prefix_ids[0, S - len(prefix):], prefix_mask[0, S - len(prefix):] = prefix, 1
        ids = np.full((B, T), pad, np.int32)
        mask = np.zeros((B, T), np.int32)
        turns = np.zeros((B, T), np.int32)
        for r, (row_ids, row_turns, _) in enumerate(rows):
            ids[r, :len(row_ids)], mask[r, :len(row_ids)], turns[r, :len(row_ids)] = row_ids, 1, row_turns
        with costs.timed("score_pass"):
            got = prefix_mean_logp(prefix_ids, prefix_mask, ids, mask, turns)
        costs.tokens("score", len(prefix) + sum(len(row_ids) for row_ids, _, _ in rows), S + ids.size)
        for r, (*_, where) in enumerate(rows):
            scores[where] = got[r]
    return scores


def turn_prompt_groups(seqs: Sequence[tuple[Sequence[int], Sequence[int]] | None], rows: int):
    """The distinct sequences of `seqs` (None left out) grouped by their tokens before the first turn-id-1 token
    (reply_start: one turn prompt's candidates), each group shortest first in chunks of up to `rows`:
    yields (prefix ids, [(row ids, row turn ids, indices of `seqs` holding this sequence)])."""
    distinct: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray, list[int]]] = {}
    for i, seq in enumerate(seqs):
        if seq is not None:
            ids, turns = np.asarray(seq[0], np.int32), np.asarray(seq[1], np.int32)
            distinct.setdefault((ids.tobytes(), turns.tobytes()), (ids, turns, []))[2].append(i)
    by_prefix: dict[bytes, list] = {}
    for ids, turns, where in distinct.values():
        split = reply_start(turns)
        by_prefix.setdefault(ids[:split].tobytes(), (ids[:split], []))[1].append((ids[split:], turns[split:], where))
    for prefix, group in by_prefix.values():
        group.sort(key=lambda row: len(row[0]))
        for start in range(0, len(group), rows):
            yield prefix, group[start:start + rows]


def score_packed(packed_logp, seqs: Sequence[tuple[Sequence[int], Sequence[int]] | None], *,
                 batch_size: int, bucket: int, pad: int) -> np.ndarray:
    """score_sequences' result from one row a call (make_packed_mean_logp_fn, batching.pack_rows): each distinct
    sequence once, the candidates of one turn prompt (turn_prompt_groups, up to `batch_size` a row) behind their
    prefix, each at its own positions; the row and its scored tokens padded to the sampler's prompt widths
    (batching.bucket_prompt: under 25% padding past 32 tokens). `bucket`: score_sequences' (unused here)."""
    scores = np.full(len(seqs), np.nan, np.float32)
    for prefix, rows in turn_prompt_groups(seqs, batch_size):
        group = [np.concatenate([prefix, row_ids]) for row_ids, _, _ in rows]
        labelled = [len(prefix) + np.flatnonzero(row_turns == 1) for _, row_turns, _ in rows]
        arrays, where = batching.pack_rows([group], width=batching.bucket_prompt, pad=pad, scored=[labelled])
        with costs.timed("score_pass"):
            logp_X = packed_logp(arrays)[0]
        costs.tokens("score", int(np.count_nonzero(arrays["segments"])), arrays["ids"].size)
        for (*_, at), x in zip(rows, where[0]):
            scores[at] = logp_X[x].mean() if len(x) else 0.0  # turn_mean's value for a reply with no tokens
    return scores


# ----------------------------------------------------------------------------------------------------------
# Ranking and pairs
# ----------------------------------------------------------------------------------------------------------

def candidate_advantages(prompts: Sequence[TurnPrompt], candidates: Sequence[Candidates], critic_logp: Callable,
                         reference_logp, rank_reference: str, *, parts: list | None = None) -> list[np.ndarray]:
    """Each prompt's candidate scores (critic minus reference mean log-prob). The candidates of all the prompts
    go to each scorer in one call, so its fixed-size batches are filled across prompts (8 candidates of one
    prompt would fill half of a 16-row batch) and sorted by length over all of them. `parts`, when given, gets
    each prompt's (critic, reference) mean log-probs."""
    items = [(prompt, t) for prompt, cands in zip(prompts, candidates, strict=True) for t in cands.texts]
    critic = np.asarray(critic_logp(items), np.float64)
    if rank_reference == "ref_with_info":
        reference = np.asarray(reference_logp(items), np.float64)
    elif rank_reference == "sampler":
        reference = np.concatenate([np.asarray(c.sampler_logp, np.float64) for c in candidates])
    elif rank_reference == "none":   # the scorer gives the scores themselves (the pipeline's oracle control)
        reference = np.zeros_like(critic)
    else:
        raise RankError(f"rank_reference={rank_reference!r}: use one of {RANK_REFERENCES}")
    bounds = np.cumsum([len(c.texts) for c in candidates])[:-1]
    if parts is not None:
        parts += list(zip(np.split(critic, bounds), np.split(reference, bounds)))
    return np.split(critic - reference, bounds)


def turn_pairs(prompt: TurnPrompt, candidates: Candidates, scores: np.ndarray, *, num_pairs: int, seed: int,
               rank_reference: str, pairing: str = "strict") -> list[PolicyPair]:
    """The pair records of one turn (data.policy_pairs picks the indices)."""
    keep = [i for i, s in enumerate(scores) if np.isfinite(s)]  # unscorable candidates take no part
    picked = policy_pairs([[candidates.texts[i] for i in keep]], [[float(scores[i]) for i in keep]],
                          num_pairs=num_pairs, seed=_turn_seed(seed, prompt.key), pairing=pairing)
    records = []
    for pair in picked:
        ids = {}
        if candidates.token_ids is not None and candidates.prompt_ids is not None:
            ids = dict(prompt_ids=candidates.prompt_ids, chosen_ids=candidates.token_ids[keep[pair.chosen_index]],
                       rejected_ids=candidates.token_ids[keep[pair.rejected_index]])
        records.append(PolicyPair(prompt.trajectory_index, prompt.turn, prompt.task_key,
                                  [dict(m) for m in prompt.messages], candidates.prompt_text, pair.chosen,
                                  pair.rejected, pair.chosen_score, pair.rejected_score, rank_reference, **ids))
    return records


def _turn_seed(seed: int, key: tuple[int, int]) -> int:
    return int(np.random.default_rng([seed, key[0], key[1]]).integers(2**31))


def rank_turns(prompts: Sequence[TurnPrompt], sample_fn: Callable[[Sequence[TurnPrompt]], list[Candidates]],
               critic_logp: Callable, reference_logp: Callable | None, out_path, *,
               rank_reference: str = "ref_with_info", num_pairs: int = 4, seed: int = 0,
               prompts_per_batch: int = 8, progress: bool = True, pairing: str = "strict",
               scores_path=None) -> dict:
    """Sample, score and pair every prompt; append the pairs to out_path per batch; return counts.

    sample_fn(prompts) -> Candidates per prompt; critic_logp / reference_logp(items) -> [len(items)] mean
    log-probs (reference_logp unused with rank_reference='sampler'; with 'none', critic_logp's values are the
    scores themselves: the pipeline's oracle control). scores_path, when given, gets a line per
    turn with every candidate's critic and reference mean log-probs and advantage (what the pairs came from)."""
    if rank_reference not in RANK_REFERENCES + ("none",):
        raise RankError(f"rank_reference={rank_reference!r}: use one of {RANK_REFERENCES}")
    if rank_reference == "ref_with_info" and reference_logp is None:
        raise RankError("rank_reference='ref_with_info' needs a reference model (pi_ref) scorer")
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["trajectory_index"], r["turn"]) for r in jsonl.read(out, partial="repair")}
    todo = [p for p in prompts if p.key not in done]
    bar = None
    if progress:
        bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="rank", unit="turn")
    written = 0
    gaps = []
    for start in range(0, len(todo), prompts_per_batch):
        batch = todo[start:start + prompts_per_batch]
        records = []
        sampled = sample_fn(batch)
        parts: list = []
        advantages = candidate_advantages(batch, sampled, critic_logp, reference_logp, rank_reference, parts=parts)
        if scores_path is not None:
            jsonl.append(scores_path, [
                {"trajectory_index": p.trajectory_index, "turn": p.turn, "texts": list(c.texts),
                 "critic_logp": [float(x) for x in cr], "reference_logp": [float(x) for x in ref],
                 "advantage": [float(x) for x in adv]}
                for p, c, (cr, ref), adv in zip(batch, sampled, parts, advantages, strict=True)])
        for prompt, candidates, scores in zip(batch, sampled, advantages, strict=True):
            pairs = turn_pairs(prompt, candidates, scores, num_pairs=num_pairs, seed=seed,
                               rank_reference=rank_reference, pairing=pairing)
            gaps += [r.chosen_score - r.rejected_score for r in pairs]
            records += pairs
        jsonl.append(out, records)
        written += len(records)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return {"turns": len(prompts), "turns_ranked_now": len(todo), "pairs_written_now": written,
            "mean_score_gap": float(np.mean(gaps)) if gaps else None}


# Fields that change how fast the pairs come, not which pairs: a rerun may change them freely.
OPERATIONAL_FIELDS = ("progress", "output", "score_batch_size", "prompts_per_batch", "max_batch_size", "mesh",
                      "skip_bad")


def record_config(config, *, accept_config_change: bool = False) -> list:
    """OUTPUT.config.json: the config that produced the pairs in OUTPUT (rundir.record_config's rule: a rerun
    with another config is refused while OUTPUT holds pairs, unless accept_config_change records the change)."""
    out = pathlib.Path(config.output)
    produced = out.exists() and bool(jsonl.read(out, partial="drop"))
    return rundir.record_output_config(config, out, produced=produced, accept_change=accept_config_change,
                                       ignore=OPERATIONAL_FIELDS, what="pairs")


def run(config, *, accept_config_change: bool = False) -> dict:
    config = absolute_paths(config, RANK_PATH_FIELDS)  # relative to the working directory, recorded absolute
    check_ranges(config, RANK_RANGES)
    record_config(config, accept_config_change=accept_config_change)
    mesh = model_loading.make_mesh(config.mesh.shape)
    trajectories = loading.load_trajectories(config.trajectories or str(demo.paths().trajectories),
                                          skip_bad=config.skip_bad)
    if config.num_trajectories > 0:
        trajectories = trajectories[:config.num_trajectories]
    prompts = turn_prompts(trajectories)
    p = config.policy
    with policy_backend.policy_sampler(p, p.path, p.tokenizer, seed=config.seed, dtype=p.dtype, mesh=mesh,
                                       max_batch_size=config.max_batch_size) as sampler:
        return rank_with(config, prompts, sampler, mesh)


def rank_with(config, prompts, sampler: BaseSampler, mesh) -> dict:
    """Candidates from `sampler` (in-process or an engine), scored by the critic, pairs appended to the output."""
    tokenizer = sampler.tokenizer
    tokenizers.check_chat_template(tokenizer)
    system_prompt = AGENT_PROMPT if config.agent_prompt else None
    ref_path = config.reference.path or config.policy.path
    in_process = sampler.local_model is not None  # an engine holds the weights in its own process
    critic_logp, reference_logp = critic_scorers(
        config.critic.path, sampler.local_model if ref_path == config.policy.path and in_process else ref_path,
        tokenizer, rank_reference=config.rank_reference, dtype=config.critic.dtype, mesh=mesh, seed=config.seed,
        info_template=config.info_template, info_placement=config.info_placement, use_info=config.critic.use_info,
        batch_size=config.score_batch_size, bucket=config.bucket, max_len=config.max_len,
        style=config.get("score_style", "reply"), temperature=config.get("critic_temperature", 1.0),
        system_prompt=system_prompt)
    calls = [0]

    def sample_fn(batch):
        calls[0] += 1
        return sample_candidates(sampler, batch, n=config.num_candidates, max_new_tokens=config.max_new_tokens,
                                 temperature=config.temperature, seed=config.seed * 1_000_003 + calls[0],
                                 system_prompt=system_prompt)

    return rank(prompts, sample_fn, critic_logp, reference_logp, config.output,
                rank_reference=config.rank_reference, num_pairs=config.num_pairs, seed=config.seed,
                prompts_per_batch=config.prompts_per_batch, progress=config.progress,
                pairing=config.get("pairing", "strict"))


def critic_scorers(critic_path: str, reference, tokenizer, *, rank_reference: str, dtype: str | None, mesh=None,
                   seed: int = 0, cpu_matmul: str | None = None, info_template: str, info_placement: str,
                   use_info: bool, **scorer_kw) -> tuple[ReplyScorer, ReplyScorer | None]:
    """(critic_logp, reference_logp): the ReplyScorers of the critic at critic_path and, with rank_reference
    'ref_with_info', of pi_ref (`reference`: a model path, or a model already in memory such as the in-process
    sampler's); None for the reference otherwise. A critic that is a training run directory reads c as it was
    trained to (its data.info_template, data.info_placement, loss.use_info). scorer_kw: ReplyScorer's other
    settings. seed: the demo model's ('' paths; the critic's is seed + 1)."""
    critic, critic_run = model_loading.load_model(critic_path, dtype=dtype, mesh=mesh, tokenizer=tokenizer,
                                                  seed=seed + 1, what="critic", cpu_matmul=cpu_matmul)
    if critic_run is not None:  # a training workdir: read c exactly as the critic was trained to
        info_template, info_placement = critic_run.data.info_template, critic_run.data.info_placement
        use_info = bool(critic_run.loss.use_info)
        log.info("critic run settings: info_template=%r info_placement=%s use_info=%s", info_template,
                 info_placement, use_info)
    scorer_kw.update(info_template=info_template, info_placement=info_placement, use_info=use_info)
    critic_logp = ReplyScorer(critic, tokenizer, **scorer_kw)
    if rank_reference != "ref_with_info":
        return critic_logp, None
    if isinstance(reference, (str, pathlib.Path)):
        reference = model_loading.load_model(str(reference), dtype=dtype, mesh=mesh, tokenizer=tokenizer, seed=seed,
                                             what="reference", cpu_matmul=cpu_matmul)[0]
    return critic_logp, ReplyScorer(reference, tokenizer, **scorer_kw)


def rank(prompts: Sequence[TurnPrompt], sample_fn: Callable[[Sequence[TurnPrompt]], list[Candidates]],
         critic_logp: ReplyScorer, reference_logp: ReplyScorer | None, out_path, **rank_kw) -> dict:
    """rank_turns (rank_kw: its settings) with the scorers of critic_scorers; the result also counts the
    candidates that could not be scored (left out of the ranking, the first one logged)."""
    result = rank_turns(prompts, sample_fn, critic_logp, reference_logp, out_path, **rank_kw)
    unscorable = critic_logp.unscorable + (reference_logp.unscorable if reference_logp is not None else [])
    if unscorable:
        log.warning("%d candidates could not be scored and were left out; first: turn %s: %s", len(unscorable),
                    *unscorable[0])
    result["unscorable_candidates"] = len(unscorable)
    return result
