"""Server latency: short requests under a burst of 200 clients, and while a long request runs.

    python bench/bench_serve.py                           # this checkout's server
    python bench/bench_serve.py --before /path/to/older   # that source tree's server too, side by side

Each side starts `python -m sweet_jax.serve` as a subprocess (PYTHONPATH = its source tree) over the same
random model (the demo policy's shape: hidden 64, 2 layers, the demo tokenizer's vocabulary), on 127.0.0.1.
After a warm-up (bursts of 1 to 64 requests and one long request, so that every batch shape is compiled),
two scenarios:

  burst  200 clients send one short chat request each at the same moment (max_tokens 16, greedy):
         latency of each, and how many got no answer (connection reset / refused).
  long   one long request (n=64, 480 new tokens, temperature 1) is sent; 1 s later 4 clients send 5 short
         requests each, one after another: their latency, and the long request's own time.

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


def build_model(path: str) -> None:
    import torch
    import transformers

    from sweet_jax.data import demo

    tok_dir = demo.paths().tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
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


def run_side(source: str, model_dir: str) -> dict:
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
        # Warm-up: the batch shapes the scenarios form are compiled first (rows are bucketed to powers of two).
        for size in [1, 2, 4, 8, 16, 32, 64]:
            burst(port, size)
        post(port, LONG)
        return {"burst": burst(port), "long": long_and_short(port)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=None, help="another source tree (e.g. an older checkout) to compare")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = ([("before", os.path.abspath(args.before))] if args.before else []) + [("this checkout", here)]
    model_dir = tempfile.mkdtemp(prefix="bench_serve_")
    try:
        build_model(model_dir)
        results = {name: run_side(source, model_dir) for name, source in sides}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print("| server | burst of 200: p50 / p95 s | no answer | short beside a long request: p50 / p95 s "
          "| long request s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        b, lg = r["burst"], r["long"]
        print(f"| {name} | {b['p50']:.2f} / {b['p95']:.2f} | {b['failed']} / 200 | {lg['p50']:.2f} / "
              f"{lg['p95']:.2f} | {lg['long_s']:.1f} |")


if __name__ == "__main__":
    main()
