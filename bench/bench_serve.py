"""Server latency: short requests under a burst of 200 clients, and while a long request runs; streaming.

    python bench/bench_serve.py                           # this checkout's server
    python bench/bench_serve.py --before /path/to/older   # that source tree's server too, side by side
    python bench/bench_serve.py --scenarios stream        # only the streaming scenario
    python bench/bench_serve.py --scenarios stream --hidden 512 --layers 8   # a small model instead of the tiny one

Each side starts `python -m sweet_jax.serve` as a subprocess (PYTHONPATH = its source tree) over the same
random model (default the demo policy's shape: hidden 64, 2 layers; the demo tokenizer's vocabulary), on 127.0.0.1.
After a warm-up (bursts of 1 to 64 requests and one long request, so that every batch shape is compiled),
two scenarios:

  burst  200 clients send one short chat request each at the same moment (max_tokens 16, greedy):
         latency of each, and how many got no answer (connection reset / refused).
  long   one long request (n=64, 480 new tokens, temperature 1) is sent; 1 s later 4 clients send 5 short
         requests each, one after another: their latency, and the long request's own time.

  stream C clients (C = 1, 8, 64) send one completions request each at the same moment (256 new tokens,
         temperature 1, seeded), once with stream=true and once without: time to first token (streamed: the first
         delta with text; not streamed: the whole answer), time to the last token, the first token's time as a
         share of the last's (per request, median), and tokens/s (all the completion tokens over the wall time of
         the C requests).

Latencies are wall clock from sending the request to reading the whole answer (p50 / p95 over the
answered requests). The clients are threads of this process; the server is another process.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

SHORT = {"model": "bench", "messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
         "max_tokens": 16, "temperature": 0}
LONG = {"model": "bench", "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 480, "n": 64, "temperature": 1.0}


def build_model(path: str, hidden: int = 64, layers: int = 2) -> None:
    import torch
    import transformers

    from sweet_jax.data import demo

    tok_dir = demo.paths().tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 64), num_key_value_heads=max(2, hidden // 128),
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def post(port: int, body: dict, timeout: float = 600) -> tuple[int | None, float]:
    """(status or None when the connection failed, seconds)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - start
    except OSError:
        return None, time.perf_counter() - start
    finally:
        conn.close()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def burst(port: int, n: int = 200) -> dict:
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return post(port, SHORT)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    ok = [t for status, t in results if status == 200]
    return {"p50": percentile(ok, 50), "p95": percentile(ok, 95), "failed": n - len(ok)}


STREAMED = {"model": "bench", "prompt": "Write a long story.", "max_tokens": 256, "temperature": 1.0}


def completion(port: int, body: dict) -> dict:
    """One completions request: {'first': s to the first token's text, 'end': s to the last, 'tokens': n}."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if not body.get("stream"):
            answer = json.loads(response.read())
            end = time.perf_counter() - start
            return {"first": end, "end": end, "tokens": answer["usage"]["completion_tokens"]}
        first, tokens = None, 0
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - start
        end = time.perf_counter() - start
        return {"first": end if first is None else first, "end": end, "tokens": tokens}
    finally:
        conn.close()


def streams(port: int, clients: int, stream: bool) -> dict:
    barrier = threading.Barrier(clients)

    def one(i):
        body = {**STREAMED, "seed": i}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        barrier.wait()
        return completion(port, body)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(clients)))
    wall = time.perf_counter() - start
    return {"first_p50": percentile([r["first"] for r in results], 50),
            "first_p95": percentile([r["first"] for r in results], 95),
            "end_p50": percentile([r["end"] for r in results], 50),
            "first_share": percentile([r["first"] / r["end"] for r in results], 50),
            "tokens_s": sum(r["tokens"] for r in results) / wall}


def streaming(port: int) -> dict:
    for clients in (1, 2, 4, 8, 16, 32, 64):  # warm-up: every row bucket a burst may split into, both paths
        streams(port, clients, True)
        streams(port, clients, False)
    return {(clients, stream): streams(port, clients, stream) for clients in (1, 8, 64) for stream in (False, True)}


def long_and_short(port: int, clients: int = 4, each: int = 5) -> dict:
    long_result = {}

    def long_request():
        long_result["status"], long_result["s"] = post(port, LONG)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)

    def client(_):
        return [post(port, SHORT) for _ in range(each)]

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    thread.join()
    ok = [t for status, t in results if status == 200]
    return {"p50": percentile(ok, 50), "p95": percentile(ok, 95), "failed": len(results) - len(ok),
            "long_s": long_result["s"] if long_result.get("status") == 200 else float("nan")}


def run_side(source: str, model_dir: str, scenarios: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=source, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen([sys.executable, "-m", "sweet_jax.serve", "--model", model_dir, "--port", "0",
                             "--served-model-name", "bench"], cwd=source, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "serving" in line:
                break
        else:
            raise RuntimeError(f"the server in {source} did not start")
        port = int(line.strip().rsplit(":", 1)[1].split("/")[0])
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain its log
        results = {}
        if "latency" in scenarios:
            # Warm-up: the batch shapes the scenarios form are compiled first (rows are bucketed to powers of two).
            for size in [1, 2, 4, 8, 16, 32, 64]:
                burst(port, size)
            post(port, LONG)
            results.update(burst=burst(port), long=long_and_short(port))
        if "stream" in scenarios:
            results["stream"] = streaming(port)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=None, help="another source tree (e.g. an older checkout) to compare")
    parser.add_argument("--scenarios", default="latency,stream", help="comma-separated: latency, stream")
    parser.add_argument("--hidden", type=int, default=64, help="the random model's width (64: the demo policy's)")
    parser.add_argument("--layers", type=int, default=2, help="the random model's depth")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = ([("before", os.path.abspath(args.before))] if args.before else []) + [("this checkout", here)]
    model_dir = tempfile.mkdtemp(prefix="bench_serve_")
    try:
        build_model(model_dir, args.hidden, args.layers)
        results = {name: run_side(source, model_dir, scenarios) for name, source in sides}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if "latency" in scenarios:
        print("| server | burst of 200: p50 / p95 s | no answer | short beside a long request: p50 / p95 s "
              "| long request s |")
        print("|---|---|---|---|---|")
        for name, r in results.items():
            b, lg = r["burst"], r["long"]
            print(f"| {name} | {b['p50']:.2f} / {b['p95']:.2f} | {b['failed']} / 200 | {lg['p50']:.2f} / "
                  f"{lg['p95']:.2f} | {lg['long_s']:.1f} |")
    if "stream" in scenarios:
        print("\n| server | streams | path | first token p50 / p95 s | last token p50 s | first / last p50 "
              "| tokens/s |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            for (clients, stream), m in r["stream"].items():
                print(f"| {name} | {clients} | {'stream' if stream else 'whole'} | {m['first_p50']:.2f} / "
                      f"{m['first_p95']:.2f} | {m['end_p50']:.2f} | {m['first_share']:.0%} | {m['tokens_s']:.0f} |")


if __name__ == "__main__":
    main()
