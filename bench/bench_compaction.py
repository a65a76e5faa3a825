"""The sampler's padding cuts against what it ran before, on a pipeline stage's real prompts: decode compaction
(the rows still decoding moved into a smaller batch), the prefill's finer prompt widths (bucket_prompt), the
prompt cache (a turn's prompt prefilled from the previous turn's stored K/V, generate.PromptCache) and a batch's
identical prompts prefilled once.

    python bench/bench_compaction.py --model RUN/init/policy_hf --episodes RUN/offline/trajectories.jsonl

Replays a pipeline stage's sampling: the recorded episodes' agent turns (each assistant message's rendered
`input`), one call per turn of a wave of --wave episodes, as the rollout asks the policy (temperature 1.0,
--max-new tokens, batches of --batch rows, seeds as SamplerPolicy draws them). One process, one Sampler, four
ways: `before` (compact_every 0: the batch decodes until its last row ends; prompts prefilled at power-of-two
widths, as bucket_length), `compacted` (compact_every --every), `compacted + widths` (and quarter-octave widths
past 128 tokens), `+ prompt cache` (and --prompt-cache-mb of stored prompts, emptied before each pass), `+
identical once + widths from 32` (and a batch's identical prompts prefilled once, quarter-octave widths past 32
tokens: bucket_prompt; the sampler now). A warm-up pass of each way (compilation), then --repeats timed passes of each,
alternating. Printed per way: prefill and decode seconds (the best pass), positions and row-steps run against
the real tokens, and whether it gave the tokens of `before` (log-probs: the largest difference). --sweep also times one decode step at each batch size (rows decoding 64 steps, eos
ignored): what a step costs as the batch shrinks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def turn_calls(path: str, wave: int, waves: int) -> list[list[str]]:
    """The rendered agent prompts of each turn of each wave of episodes, in file order."""
    episodes = [json.loads(line) for line in open(path) if line.strip()][:wave * waves]
    calls = []
    for start in range(0, len(episodes), wave):
        turns = [[m["input"] for m in e["dialogue_history"] if m["role"] == "assistant" and m.get("input")]
                 for e in episodes[start:start + wave]]
        for t in range(max(map(len, turns))):
            calls.append([ts[t] for ts in turns if t < len(ts)])
    return calls


WAYS = ("before", "compacted", "compacted + widths", "+ prompt cache", "+ identical once + widths from 32")


def widths_past_128(fine_widths):
    """The prefill's widths before the finer ones under 128 tokens: powers of two up to 128, then fine_widths'
    (generate.bucket_prompt's quarter octaves)."""
    from sweet_jax.sampling import generate
    return lambda n, minimum=16: (generate.bucket_length(n, minimum) if max(n, minimum) <= 128
                                  else fine_widths(n, minimum))


def run_pass(sampler, calls, args, way: str, fine_widths):
    from sweet_jax import costs
    from sweet_jax.sampling import generate
    from sweet_jax.sampling.base import mix_seed
    from sweet_jax.sampling.generate import Request, SamplingParams

    sampler.compact_every = 0 if way == "before" else args.every
    latest = way == WAYS[-1]
    generate.bucket_prompt = (fine_widths if latest else widths_past_128(fine_widths) if way in WAYS[2:] else
                              generate.bucket_length)
    sampler.prompt_cache = generate.PromptCache(args.prompt_cache_mb << 20) if way in WAYS[3:] else None
    sampler.prefill_identical_once = latest
    costs.reset()
    start = time.perf_counter()
    out = []
    for i, prompts in enumerate(calls):
        requests = [Request(sampler.encode(p, add_special_tokens=False),
                            SamplingParams(max_new_tokens=args.max_new, temperature=args.temperature,
                                           seed=mix_seed(args.seed * 1_000_003 + i, j)))
                    for j, p in enumerate(prompts)]
        out.append([g[0] for g in sampler.generate_requests(requests)])
    c = costs.snapshot()
    return dict(wall_s=time.perf_counter() - start, decode_s=c.get("sample_decode_s", 0.0),
                prefill_s=c.get("sample_prefill_s", 0.0), compile_s=c.get("compile_s", 0.0),
                row_steps=c.get("sample_new_padded_tokens", 0), new_tokens=c.get("sample_new_tokens", 0),
                positions=c.get("sample_prompt_padded_tokens", 0), prompt_tokens=c.get("sample_prompt_tokens", 0),
                repeated=c.get("sample_prompt_repeated_tokens", 0),
                load=os.getloadavg()[0]), out


def step_sweep(sampler, prompt: str, rows_list, steps: int = 64):
    from sweet_jax import costs

    sampler.compact_every = 0
    ids = sampler.encode(prompt, add_special_tokens=False)
    result = {}
    for rows in rows_list:
        for timed in (False, True):   # the first call compiles
            costs.reset()
            sampler.generate([ids] * rows, max_new_tokens=steps, temperature=1.0, ignore_eos=True, seed=0)
        result[rows] = costs.snapshot()["sample_decode_s"] / steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy's Hugging Face checkpoint directory")
    parser.add_argument("--episodes", required=True, help="a stage's trajectories.jsonl (assistant turns with input)")
    parser.add_argument("--wave", type=int, default=64, help="episodes played together (collect.batch_size)")
    parser.add_argument("--waves", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="sampler rows per compiled call (train.max_batch_size)")
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--every", type=int, default=16, help="compaction every this many steps")
    parser.add_argument("--min-rows", type=int, default=4, help="the smallest batch compaction makes")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "xla", "xla_bf16", "onednn"])
    parser.add_argument("--prompt-cache-mb", type=int, default=2048)
    parser.add_argument("--ways", default=",".join(WAYS), help="which ways to run (the first is the baseline)")
    parser.add_argument("--sweep", default="", help="comma-separated batch sizes: seconds a decode step at each")
    args = parser.parse_args()

    from sweet_jax import cli
    cli.without_torch()
    cli.compile_cache_environment()
    import numpy as np

    from sweet_jax import costs
    from sweet_jax.sampling import generate
    from sweet_jax.sampling.generate import load_sampler

    fine_widths = generate.bucket_prompt
    costs.listen_to_compiles()
    sampler = load_sampler(args.model, max_batch_size=args.batch, cpu_matmul=args.cpu_matmul)
    sampler.min_compact_rows = args.min_rows
    calls = turn_calls(args.episodes, args.wave, args.waves)
    print(f"{len(calls)} calls, {sum(map(len, calls))} prompts; batch {args.batch}, max_new {args.max_new}, "
          f"compaction every {args.every} steps down to {args.min_rows} rows", flush=True)
    if args.sweep:
        sweep = step_sweep(sampler, calls[0][0], [int(r) for r in args.sweep.split(",")])
        print("| rows | s a decode step | s a row-step |\n|---|---|---|")
        for rows, s in sweep.items():
            print(f"| {rows} | {s:.3f} | {s / rows:.4f} |", flush=True)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        raise SystemExit(f"error: --ways {unknown}: not among {WAYS}")
    best, outs = {}, {}
    for repeat in range(args.repeats + 1):   # pass 0 compiles
        for way in ways:
            stats, out = run_pass(sampler, calls, args, way, fine_widths)
            print(f"pass {repeat} {way}: " + json.dumps({k: round(v, 2) for k, v in stats.items()}), flush=True)
            outs[way] = out
            if repeat and (way not in best or stats["wall_s"] < best[way]["wall_s"]):
                best[way] = stats
    print(f"\n| way | prefill s | positions run (real) | decode s | row-steps run (sampled) | sampling s | same tokens as "
          f"{ways[0]} | log-prob difference | load |\n|---|---|---|---|---|---|---|---|---|")
    base = best[ways[0]]
    for way in ways:
        s = best[way]
        pairs = [(a, b) for ca, cb in zip(outs[ways[0]], outs[way]) for a, b in zip(ca, cb)]
        same = sum(a.token_ids == b.token_ids for a, b in pairs)
        diff = max((float(np.max(np.abs(np.subtract(a.logprobs, b.logprobs)))) for a, b in pairs
                    if a.token_ids == b.token_ids and a.logprobs), default=0.0)
        sampling = s["prefill_s"] + s["decode_s"]
        print(f"| {way} | {s['prefill_s']:.1f} | {s['positions']} ({s['prompt_tokens'] / max(s['positions'], 1):.0%}) "
              f"| {s['decode_s']:.1f} | {s['row_steps']} ({s['new_tokens'] / max(s['row_steps'], 1):.0%}) | "
              f"{sampling:.1f} ({(base['prefill_s'] + base['decode_s']) / sampling:.2f}x) | {same}/{len(pairs)} | "
              f"{diff:.1e} | {s['load']:.1f} |")

if __name__ == "__main__":
    main()
