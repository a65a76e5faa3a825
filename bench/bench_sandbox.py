"""Sandbox throughput: evaluations per minute of a 10-case ColBench task.

    python bench/bench_sandbox.py [--n 3000] [--baseline-n 300] [--workers N]

Side by side, with the same number of concurrent evaluations:
  sandbox   sweet_jax.sandbox.Evaluator: isolated workers (namespaces, set up once) whose zygote
            forks one child per evaluation; reference outputs cached.
  fresh     a fresh interpreter per evaluation (`python -I -c RUNNER`, no isolation at all), the
            usual way to keep untrusted code out of the trainer; same comparison in the parent.
Target (DESIGN.md): >= 1,000 evaluations a minute on 2 cores.
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

from sweet_jax.sandbox import Evaluator, values_equal

TASK = {
    "ground_truth": (
        "import re\n\ndef word_stats(text, min_len=1):\n"
        "    words = [w.lower() for w in re.findall(r\"[A-Za-z']+\", text) if len(w) >= min_len]\n"
        "    counts = {}\n    for w in words:\n        counts[w] = counts.get(w, 0) + 1\n"
        "    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]\n"
        "    return {'n': len(words), 'unique': len(counts), 'top': top}\n"),
    "test_cases": {f"case_{i}": f"word_stats({text!r}, {k})" for i, (text, k) in enumerate([
        ("the cat and the hat", 1), ("A a a b B c", 1), ("", 1), ("Don't stop, don't!", 2),
        ("one two three four five six", 4), ("x " * 50, 1), ("Hello, hello? HELLO!", 3),
        ("it's a dog's life", 2), ("alpha beta gamma alpha beta alpha", 5), ("1 2 3 go", 1)])},
}
ANSWER = "```python\n" + TASK["ground_truth"] + "```"

RUNNER = r"""
import json, sys
request = json.loads(sys.stdin.read())
namespace = {}
out = []
try:
    exec(request["code"], namespace)
    for call in request["calls"]:
        try:
            out.append(["ok", eval(call, namespace)])
        except Exception as e:
            out.append(["error", type(e).__name__])
except Exception as e:
    out = [["error", type(e).__name__]] * len(request["calls"])
print(json.dumps(out))
"""


def bench_sandbox(n, workers):
    with Evaluator(workers=workers, timeout_s=2.0) as evaluator:
        evaluator.score_many([(TASK, ANSWER)] * (2 * evaluator.workers))  # start workers, cache
        start = time.perf_counter()
        scores = evaluator.score_many([(TASK, ANSWER)] * n)
        elapsed = time.perf_counter() - start
        assert all(s.reward == 1.0 for s in scores), "benchmark answer must pass"
        return n / elapsed * 60, evaluator.mode


def bench_fresh_interpreter(n, workers):
    calls = list(TASK["test_cases"].values())
    expected = json.loads(json.dumps(_run_fresh(TASK["ground_truth"], calls)))

    def one(_):
        got = _run_fresh(ANSWER.split("```python\n")[1].split("```")[0], calls)
        return all(values_equal(e[1], g[1]) for e, g in zip(expected, got))

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(workers)))
        start = time.perf_counter()
        results = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - start
    assert all(results)
    return n / elapsed * 60


def _run_fresh(code, calls):
    result = subprocess.run([sys.executable, "-I", "-c", RUNNER], input=json.dumps(
        {"code": code, "calls": calls}), capture_output=True, text=True, timeout=30, env={})
    return json.loads(result.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--baseline-n", type=int, default=300)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    sandbox_rate, mode = bench_sandbox(args.n, args.workers)
    fresh_rate = bench_fresh_interpreter(args.baseline_n, args.workers)
    print(f"10-case task, {args.workers} concurrent evaluations, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| approach                              | evals/min | vs fresh |")
    print("|---------------------------------------|-----------|----------|")
    print(f"| sandbox ({mode}, fork per eval)     | {sandbox_rate:9.0f} | {sandbox_rate / fresh_rate:7.1f}x |")
    print(f"| fresh interpreter per eval (no isol.) | {fresh_rate:9.0f} |    1.0x |")
    print(f"target >= 1,000 evals/min: {'met' if sandbox_rate >= 1000 else 'NOT met'}")


if __name__ == "__main__":
    main()
