"""Candidates per second: the in-process sampler vs the same sampler behind the `openai` policy backend (HTTP).

    python bench/bench_policy_backend.py [--prompts 64] [--n 8] [--new-tokens 32] [--repeats 3]
    python bench/bench_policy_backend.py --model HF_DIR --repeats 1     # a real checkpoint (SmolLM2-135M)

The pipeline's candidates stage in miniature: `prompts` turn prompts (the demo tokenizer's chat template over
short dialogues), `n` candidates each, `new-tokens` new tokens, temperature 1.0 with a fixed seed, on a random
model of the demo policy's shape (hidden 64, 2 layers, the demo tokenizer's vocabulary), or with --model on that
HF checkpoint and its own tokenizer and chat template.

  in_process   ranking.sample_candidates(Sampler): one generate call, sample rows batched `max_batch_size` at a
               time (the pipeline's setting: 64 rows);
  openai@C     the same call through policy_backend.OpenAISampler with C requests in flight (one prompt and its
               n samples each), to sweet_jax.serve's OpenAIApp over the *same* Sampler object (same compiled
               programs) on 127.0.0.1, which hands a burst of concurrent requests to the sampler as one call,
               batched there into the same 64-row batches.
  --engine process: the server is instead its own process, `python -m sweet_jax.serve --model DIR` started
               and stopped by policy_backend.Engine, as the pipeline runs an engine: client and server no longer
               share one Python interpreter (its lock), as they never do in a deployment.

Both sides draw the same candidates (request j carries the in-process seed of prompt j); the script checks it.
Every sample-row bucket a burst can end in (n x 1, 2, 4, ... prompts) is compiled first: a burst of concurrent
requests that reaches the engine in two parts ends each part with a partial batch, a shape the in-process call
never makes, and its first compile would otherwise land in a timed call. Each side is then run once more, and
`repeats` times timed, interleaved: a repeat times the in-process call and then each concurrency back to back.
Candidates/s = prompts x n / the median seconds; the overhead is the median over the repeats of each repeat's
1 - (openai candidates/s) / (in_process candidates/s). "CPU s": median CPU seconds of a call, this process's
plus, with --engine process, the engine's ("engine", read from Linux /proc). "bursts" (server on a thread): how
the engine received the requests (request counts per sampler call, the warm-up calls included).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_serve import build_model  # noqa: E402  (the same tiny HF model; this script's folder is on sys.path)


def turn_prompts(count: int):
    from sweet_jax.rl import ranking
    from sweet_jax.data.schema import Trajectory

    rows = [Trajectory.from_json({
        "task": {"problem_description": f"write f{i}", "ground_truth": f"def f{i}(x): return {i}",
                 "test_cases": {"t": f"f{i}(1)"}},
        "dialogue_history": [{"role": "user", "content": f"Write a function f{i} that returns {i} times x."},
                             {"role": "assistant", "content": "I WANT TO ANSWER: ..."}]}) for i in range(count)]
    return ranking.turn_prompts(rows)


def cpu_seconds(server) -> tuple[float, float]:
    """CPU seconds used so far by this process, and by the engine when it is its own process (else 0)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    engine = 0.0
    process = getattr(server, "process", None)
    if process is not None:
        with open(f"/proc/{process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        engine = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return usage.ru_utime + usage.ru_stime, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--model", default="", help="an HF checkpoint directory (default: the tiny random model)")
    parser.add_argument("--engine", choices=("thread", "process"), default="thread",
                        help="the server on a thread of this process over the same Sampler, or its own process")
    args = parser.parse_args()

    from sweet_jax.sampling import policy_backend
    from sweet_jax.rl import ranking
    from sweet_jax.sampling import generate
    from sweet_jax.sampling.server import start_server

    model_dir = args.model
    if not model_dir:
        model_dir = tempfile.mkdtemp(prefix="bench_policy_backend_")
        build_model(model_dir)
    sampler = generate.load_sampler(model_dir, max_batch_size=64)
    eos, context = policy_backend.hf_eos_ids(model_dir)
    prompts = turn_prompts(args.prompts)
    kw = dict(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0, seed=7)
    if args.engine == "thread":
        server = start_server(sampler, model_name="bench", max_batch_size=64)
        url, burst_log = server.url, server.app.engine.batch_sizes
    else:
        server = policy_backend.Engine("{python} -m sweet_jax.serve --model {hf_dir} --port {port} "
                                       "--max-batch-size 64 --served-model-name bench", model_dir).start()
        url, burst_log = server.url, None

    def remote_sampler(concurrency: int):
        return policy_backend.OpenAISampler([url], sampler.tokenizer, model="bench", eos_token_ids=eos,
                                            max_position_embeddings=context, concurrency=concurrency)

    k = 1
    while k < args.prompts:  # the partial batches' row buckets (see the docstring), on both sides
        ranking.sample_candidates(sampler, prompts[:k], **kw)
        if args.engine == "process":
            ranking.sample_candidates(remote_sampler(k), prompts[:k], **kw)
        k *= 2

    # Interleaved: each repeat times the in-process call and then each concurrency back to back, and the overhead
    # is the median of the repeats' own ratios, so a slow spell of a shared host falls on both sides of a ratio.
    remotes = {c: remote_sampler(c) for c in [int(x) for x in args.concurrency.split(",")]}
    calls = {None: lambda: ranking.sample_candidates(sampler, prompts, **kw)}
    calls.update({c: (lambda r=r: ranking.sample_candidates(r, prompts, **kw)) for c, r in remotes.items()})
    before = len(burst_log) if burst_log is not None else 0
    outs = {c: fn() for c, fn in calls.items()}  # compile every shape
    times, cpu = {c: [] for c in calls}, {c: [] for c in calls}
    for _ in range(args.repeats):
        for c, fn in calls.items():
            cpu0, start = cpu_seconds(server), time.perf_counter()
            outs[c] = fn()
            times[c].append(time.perf_counter() - start)
            cpu[c].append(np.subtract(cpu_seconds(server), cpu0))
    bursts = burst_log[before:] if burst_log is not None else None
    want = outs[None]
    seconds = statistics.median(times[None])
    base = args.prompts * args.n / seconds
    def cpu_row(samples):  # median CPU seconds of a call: both processes, and the engine's part
        own, engine = np.median(np.array(samples), axis=0)
        return {"cpu_s": float(own + engine), "engine_cpu_s": float(engine)}

    rows = [{"backend": "in_process", "concurrency": None, "seconds": seconds, "candidates_per_s": base,
             "times": times[None], **cpu_row(cpu[None])}]
    for c in remotes:
        same = sum(g.token_ids == w.token_ids for g, w in zip(outs[c], want)) / len(want)
        overheads = [100.0 * (1 - t0 / t) for t0, t in zip(times[None], times[c])]
        rows.append({"backend": "openai", "concurrency": c, "seconds": statistics.median(times[c]),
                     "candidates_per_s": args.prompts * args.n / statistics.median(times[c]),
                     "overhead_pct": statistics.median(overheads), "overheads_pct": overheads, "times": times[c],
                     "same_candidates_pct": 100.0 * same, **cpu_row(cpu[c])})
    if bursts is not None:
        rows[0]["bursts"] = bursts
    server.close() if args.engine == "thread" else server.stop()
    print(f"{args.model or 'tiny random model'}: {args.prompts} prompts x {args.n} candidates x {args.new_tokens} "
          f"tokens, server on a {args.engine}, load {os.getloadavg()[0]:.1f}")
    print(f"{'backend':<12}{'concurrency':>12}{'seconds':>10}{'cand/s':>10}{'overhead':>10}{'same':>8}"
          f"{'CPU s':>8}{'engine':>8}")
    for r in rows:
        over = f"{r['overhead_pct']:.1f}%" if "overhead_pct" in r else "-"
        same = f"{r['same_candidates_pct']:.0f}%" if "same_candidates_pct" in r else "-"
        print(f"{r['backend']:<12}{r['concurrency'] or '-':>12}{r['seconds']:>10.2f}{r['candidates_per_s']:>10.1f}"
              f"{over:>10}{same:>8}{r['cpu_s']:>8.2f}{r['engine_cpu_s']:>8.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
