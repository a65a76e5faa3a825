"""The rank stage's scoring, its layouts side by side (ranking.ReplyScorer's `layout`), same model, same candidates,
one process: every candidate's whole sequence in length-sorted batches (whole); each turn prompt's common prefix
run once into a KV cache and each distinct candidate a row on it (prefix_cache); the prefix once and every distinct
candidate after it in one row, kept apart by the attention's segments (packed, the default).

    python bench/bench_rank_scoring.py --model HF_DIR --run RUN_DIR            # a pipeline run's candidates
    python bench/bench_rank_scoring.py --model HF_DIR --run RUN_DIR --layouts prefix_cache,packed
    python bench/bench_rank_scoring.py --run RUN_DIR --recorded                # against its rank stage's scores
    python bench/bench_rank_scoring.py --model HF_DIR --memory                 # compiled scratch memory, both ways
    python bench/bench_rank_scoring.py --model HF_DIR --run RUN_DIR --shapes-before   # call shapes: before vs now

RUN_DIR is a `python -m sweet_jax.pipeline` workdir with offline/trajectories.jsonl and candidates/candidates.jsonl
(the pipeline's own inputs to its rank stages); the first --prompts turn prompts of the candidates file are scored
with c (the critic's view), --prompts-per-batch prompts a scorer call as ranking.rank_turns makes them, --rounds
times each way, interleaved, after a first call that compiles every shape (its time printed apart). Prints seconds
per turn for each layout, its ratio to the first, the largest difference between its scores and the first's, how
many of a turn's candidate pairs it puts in the first's order, and the positions each way runs (--layouts: which,
the first the baseline; default whole,packed).

--memory: the scratch memory XLA assigns to one scoring pass of --batch-size rows each way (the compiled program's
memory_analysis), whole sequences of prefix + reply tokens against the prefix once and the rows on it, for
prefixes of 512 and 1024 tokens and 64-token replies.

--recorded: every turn prompt of RUN_DIR/rank/scores.jsonl scored in the default layout by the run's critic
(critic/hf) and pi_ref (init/policy_hf) with the run's rank settings (pipeline_config.json, float32), against the
scores the rank stage recorded: the largest differences, and how many candidate pairs keep the recorded order of
their advantages (pairs of identical candidates are exact ties now; they are counted apart).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from sweet_jax.rl.ranking import SCORE_LAYOUTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF directory of the scoring model (critic or pi_ref)")
    parser.add_argument("--run", help="pipeline workdir with offline/ and candidates/")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompts-per-batch", type=int, default=8, help="the pipeline's rank.prompts_per_batch")
    parser.add_argument("--batch-size", type=int, default=16, help="the pipeline's rank.score_batch_size")
    parser.add_argument("--bucket", type=int, default=128, help="the pipeline's train.bucket")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-matmul", default=None, help="model.cpu_matmul (default: LlamaConfig's)")
    parser.add_argument("--recorded", action="store_true", help="check the run's recorded rank scores instead")
    parser.add_argument("--memory", action="store_true", help="print the compiled scratch memory of both ways")
    parser.add_argument("--layouts", default="whole,packed",
                        help=f"comma-separated ReplyScorer layouts, the first the baseline (of {','.join(SCORE_LAYOUTS)})")
    parser.add_argument("--shapes-before", action="store_true",
                        help="prefix_cache at the call shapes before 2026-12-02 against now (instead of --layouts)")
    args = parser.parse_args()
    if args.recorded:
        return check_recorded(args.run)
    if args.memory:
        return compiled_memory(args.model, args.batch_size)
    if not args.model or not args.run:
        parser.error("--model and --run are required (or --run with --recorded, --model with --memory)")

    from sweet_jax import costs
    from sweet_jax.data.loading import load_records
    from sweet_jax.data.schema import CandidatesRecord, Trajectory
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.models import load_hf
    from sweet_jax.rl import ranking

    trajectories = [Trajectory.from_json(json.loads(line)) for line in open(f"{args.run}/offline/trajectories.jsonl")]
    prompts = {p.key: p for p in ranking.turn_prompts(trajectories)}
    records = load_records(f"{args.run}/candidates/candidates.jsonl", CandidatesRecord)[:args.prompts]
    turns = [(prompts[r.key], list(r.texts)) for r in records]
    model = load_hf(args.model, config_overrides=None if args.cpu_matmul is None else {"cpu_matmul": args.cpu_matmul})
    tokenizer = load_tokenizer(args.model)
    kw = dict(info_template="In light that the final answer is: {ground_truth}.", batch_size=args.batch_size,
              bucket=args.bucket, max_len=4096)
    if args.shapes_before:
        scorers = {"prefix_cache, shapes before": ranking.ReplyScorer(model, tokenizer, layout="prefix_cache", **kw),
                   "prefix_cache": ranking.ReplyScorer(model, tokenizer, layout="prefix_cache", **kw)}
    else:
        scorers = {name: ranking.ReplyScorer(model, tokenizer, layout=name, **kw) for name in args.layouts.split(",")}
    batches = [[(p, t) for p, texts in turns[start:start + args.prompts_per_batch] for t in texts]
               for start in range(0, len(turns), args.prompts_per_batch)]
    shape_now = ranking.score_shape
    positions = {}

    def run(name):
        ranking.score_shape = shapes_before(args.bucket) if name.endswith("shapes before") else shape_now
        costs.reset()
        out = np.concatenate([scorers[name](items) for items in batches])
        positions[name] = costs.snapshot().get("score_padded_tokens", 0)
        ranking.score_shape = shape_now
        return out

    scores, first = {}, {}
    for name in scorers:
        start = time.perf_counter()
        scores[name] = run(name)
        first[name] = time.perf_counter() - start
    times = {name: [] for name in scorers}
    for _ in range(args.rounds):
        for name in scorers:
            start = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - start)

    seqs = [ranking.critic_sequence(tokenizer, p, t, info_template=kw["info_template"], info_placement="system")
            for items in batches for p, t in items]
    whole_tokens = sum(len(s.input_ids) for s in seqs)
    distinct = {(s.input_ids.tobytes(), s.turn_ids.tobytes()): s for s in seqs}.values()
    prefixes = {tuple(s.input_ids[:ranking.reply_start(s.turn_ids)]) for s in distinct}
    shared_tokens = (sum(map(len, prefixes))
                     + sum(len(s.input_ids) - ranking.reply_start(s.turn_ids) for s in distinct))
    n = len(turns)
    median = {name: statistics.median(t) for name, t in times.items()}
    base = next(iter(scorers))
    print(f"{n} turn prompts, {len(seqs)} candidates ({len(distinct)} distinct), score batches of {args.batch_size} "
          f"rows, {args.prompts_per_batch} prompts a call; tokens run (unpadded): whole {whole_tokens}, "
          f"shared {shared_tokens} ({whole_tokens / shared_tokens:.1f}x fewer)")
    for name in scorers:
        print(f"{name:<28} {median[name] / n:7.2f} s/turn, {positions[name]} positions run (first call, compiling: "
              f"{first[name]:.1f} s; rounds: {', '.join(f'{t:.1f}' for t in times[name])} s)")
    for name in list(scorers)[1:]:
        diff = float(np.nanmax(np.abs(scores[base] - scores[name])))
        same, ordered, twins = same_order(scores[base], scores[name], [t for _, t in turns])
        if base == "whole":
            ordered += twins  # identical candidates scored apart by whole sequences: exact ties once
        print(f"{name} / {base}: {median[base] / median[name]:.2f}x faster; largest score difference {diff:.2e}; "
              f"candidate pairs in the same order {same}/{ordered}")


def shapes_before(bucket: int):
    """ranking.score_shape before 2026-12-02: the prefix padded to a multiple of `bucket`, rows to a power of two
    (at least a quarter of the batch), reply tokens to a power of two."""
    from sweet_jax.sampling.generate import bucket_length, bucket_rows

    def score_shape(prefix_len, row_lengths, batch_size):
        return (-(-prefix_len // bucket) * bucket, min(batch_size, max(bucket_rows(len(row_lengths)), batch_size // 4)),
                bucket_length(max(row_lengths, default=1)))
    return score_shape


def same_order(reference: np.ndarray, other: np.ndarray, texts: list[list[str]]) -> tuple[int, int, int]:
    """Over each turn's candidate pairs (texts: each turn's candidates, in the scores' order): (pairs of distinct
    candidates that `other` orders as `reference`, pairs of distinct candidates `reference` orders, pairs of
    identical candidates that `reference` scores apart)."""
    same = ordered = identical = 0
    bounds = np.cumsum([0] + [len(t) for t in texts])
    for turn, lo, hi in zip(texts, bounds[:-1], bounds[1:]):
        a, b = reference[lo:hi], other[lo:hi]
        i, j = np.triu_indices(hi - lo, 1)
        twins = np.array([turn[x] == turn[y] for x, y in zip(i, j)], bool)
        decided = a[i] != a[j]
        identical += int((twins & decided).sum())
        ordered += int((~twins & decided).sum())
        same += int((np.sign(a[i] - a[j]) == np.sign(b[i] - b[j]))[~twins & decided].sum())
    return same, ordered, identical


def compiled_memory(model_dir: str, rows: int) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sweet_jax.models import load_hf
    from sweet_jax.rl import ranking
    from sweet_jax.train import steps

    model = load_hf(model_dir)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    whole = steps.make_score_step(graphdef, num_turns=1, advantage_norm="turn_mean", rest=rest)
    shared = ranking.make_prefix_mean_logp_fn(model)
    ids = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    for prefix, reply in ((512, 64), (1024, 64)):
        batch = {k: ids(rows, 1, prefix + reply) for k in ("input_ids", "attention_mask", "turn_ids")}
        batch["ref_logp"] = jax.ShapeDtypeStruct((rows, 1, prefix + reply), jnp.float32)
        a = whole.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        b = shared.lower(ids(1, prefix), ids(1, prefix), *[ids(rows, reply)] * 3).compile()
        b = b.memory_analysis().temp_size_in_bytes
        print(f"{rows} rows, prefix {prefix} + reply {reply} tokens: scratch memory whole sequences "
              f"{a / 2**20:.0f} MiB, shared prefix {b / 2**20:.0f} MiB")


def check_recorded(run: str) -> None:
    from sweet_jax.data.schema import Trajectory
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.models import load_hf
    from sweet_jax.rl import ranking

    config = json.load(open(f"{run}/pipeline_config.json"))
    trajectories = [Trajectory.from_json(json.loads(line)) for line in open(f"{run}/offline/trajectories.jsonl")]
    prompts = {p.key: p for p in ranking.turn_prompts(trajectories)}
    records = [json.loads(line) for line in open(f"{run}/rank/scores.jsonl")]
    items = [(prompts[(r["trajectory_index"], r["turn"])], text) for r in records for text in r["texts"]]
    tokenizer = load_tokenizer(f"{run}/init/policy_hf")
    kw = dict(info_template=config["rank"]["info_template"], info_placement=config["rank"]["info_placement"],
              batch_size=config["rank"]["score_batch_size"], bucket=config["train"]["bucket"],
              max_len=config["train"]["max_len"] * 2)
    got = {}
    for name, path in (("critic_logp", f"{run}/critic/hf"), ("reference_logp", f"{run}/init/policy_hf")):
        start = time.perf_counter()
        got[name] = ranking.ReplyScorer(load_hf(path, config_overrides={"cpu_matmul": "xla"}), tokenizer, **kw)(items)
        recorded = np.concatenate([r[name] for r in records])
        print(f"{name}: {time.perf_counter() - start:.0f} s, largest |scored now - recorded| "
              f"{np.nanmax(np.abs(got[name] - recorded)):.2e}")
    same, ordered, identical = same_order(np.concatenate([r["advantage"] for r in records]),
                                          got["critic_logp"] - got["reference_logp"], [r["texts"] for r in records])
    print(f"{len(records)} turn prompts, {len(items)} candidates: pairs of distinct candidates in the recorded order "
          f"{same}/{ordered}; pairs of identical candidates recorded apart (exact ties now) {identical}")


if __name__ == "__main__":
    main()
