"""The rank stage's scoring: each turn's candidates scored on their own (one call per turn prompt) vs the
candidates of a batch of turn prompts scored together (ranking.rank_turns since it batches them), same scorer
(ranking.ReplyScorer: fixed-size batches, sorted by length, length buckets), same model, one process.

    python bench/bench_rank_scoring.py --model HF_DIR --run RUN_DIR            # a pipeline run's candidates

RUN_DIR is a `python -m sweet_jax.pipeline` workdir with offline/trajectories.jsonl and candidates/candidates.jsonl
(the pipeline's own inputs to its rank stages); the first --prompts turn prompts of the candidates file are scored
with c (the critic's view), --rounds times each way, interleaved. Prints seconds per turn for both, their ratio,
and the largest difference between the two ways' scores (the same sequences through differently filled batches).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF directory of the scoring model (critic or pi_ref)")
    parser.add_argument("--run", required=True, help="pipeline workdir with offline/ and candidates/")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompts-per-batch", type=int, default=8, help="the pipeline's rank.prompts_per_batch")
    parser.add_argument("--batch-size", type=int, default=16, help="the pipeline's rank.score_batch_size")
    parser.add_argument("--bucket", type=int, default=128, help="the pipeline's train.bucket")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from sweet_jax.rl import ranking
    from sweet_jax.data.loading import load_records
    from sweet_jax.data.schema import CandidatesRecord, Trajectory
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.models import load_hf

    trajectories = [Trajectory.from_json(json.loads(line)) for line in open(f"{args.run}/offline/trajectories.jsonl")]
    prompts = {p.key: p for p in ranking.turn_prompts(trajectories)}
    records = load_records(f"{args.run}/candidates/candidates.jsonl", CandidatesRecord)[:args.prompts]
    turns = [(prompts[r.key], list(r.texts)) for r in records]
    scorer = ranking.ReplyScorer(load_hf(args.model), load_tokenizer(args.model),
                                 info_template="In light that the final answer is: {ground_truth}.",
                                 batch_size=args.batch_size, bucket=args.bucket, max_len=1024)

    def per_turn():
        return np.concatenate([scorer([(p, t) for t in texts]) for p, texts in turns])

    def batched():
        out = []
        for start in range(0, len(turns), args.prompts_per_batch):
            out.append(scorer([(p, t) for p, texts in turns[start:start + args.prompts_per_batch] for t in texts]))
        return np.concatenate(out)

    ways = {"per turn": per_turn, "batched": batched}
    scores = {name: fn() for name, fn in ways.items()}  # compile every shape
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    n = len(turns)
    items = sum(len(texts) for _, texts in turns)
    diff = float(np.nanmax(np.abs(scores["per turn"] - scores["batched"])))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{n} turn prompts, {items} candidates, score batches of {args.batch_size} rows, "
          f"{args.prompts_per_batch} prompts a batch")
    for name in ways:
        print(f"{name:<10} {median[name] / n:7.2f} s/turn  (rounds: {', '.join(f'{t:.1f}' for t in times[name])} s)")
    print(f"batched / per turn: {median['per turn'] / median['batched']:.2f}x faster; largest score difference "
          f"{diff:.2e}")


if __name__ == "__main__":
    main()
