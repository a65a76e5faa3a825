"""Sampler throughput: sweet_jax's KV-cache sampler vs transformers' generate, same models, same run.

    python bench/bench_sampler.py                          # CPU table over model sizes (a few minutes)
    python bench/bench_sampler.py --rows small             # only the 24M target row
    python bench/bench_sampler.py --rows 1b --dtype bfloat16 --skip-hf   # with jax[cuda] / jax[tpu]
    python bench/bench_sampler.py --model HF_DIR --batches 8,64   # a real checkpoint (SmolLM2-135M), chat prompts
    python bench/bench_sampler.py --model HF_DIR --batches 8,64 --hf-dtype bfloat16   # against transformers in bf16

--model HF_DIR: both sides run that checkpoint's weights (load_hf vs from_pretrained) on chat-templated prompts
(its tokenizer; distinct short coding requests), greedy, --new-tokens new tokens with eos ignored, one row per
batch size of --batches. Each side is its own process (its peak RSS is its own; the sweet_jax side's
Sampler gets max_batch_size = the batch, as the pipeline sizes it), warmed up with one call, then the timed
calls alternate (--repeats each, best reported). --cpu-matmul sets the sweet_jax side's model.cpu_matmul (auto:
bf16 matmuls on oneDNN where the CPU has bf16 units, models/cpu_matmul.py); unless it is xla, a third process runs
our float32 sampler (cpu_matmul=xla) and the table counts the rows whose greedy tokens equal it.
--system-prompt agent gives every prompt the ColBench agent's rules as its system message (as the pipeline's
policy prompts: ~150 tokens every row shares); --shared-prefix sets our Sampler's min_shared_prefix (0: the
common prefix is computed per row, as transformers does).

Rows (--rows, comma-separated; `all` = every CPU row):
  demo      the demo pipeline's policy (configs/pipeline.py:demo: hidden 64, 2 layers, tied, vocab 4096),
            batch 8, 256 new tokens, greedy
  demo_t1   the same model as the demo samples it: batch 64, 96 new tokens, temperature 1.0 (full softmax),
            prompts of 128-256 tokens
  mid       a 4.6M Llama (hidden 128, 4 layers, vocab 16k), batch 8, 256 new tokens, greedy
  small     the target row: 24.3M Llama (hidden 256, 8 layers, GQA, vocab 32k), batch 8, 256 new, greedy
  small_b32 the same model at batch 32 (the weights read once per step serve 4x the rows)

Each row builds a random HF LlamaForCausalLM, saves it and loads it into ours with sweet_jax.models.load_hf, so
both sides run the same float32 weights; every row is forced to the full number of new tokens (eos ignored).
After one warm-up call per side (compilation, allocator), timed calls alternate ours / theirs (--repeats
each; best reported) so both see the same background load; the load average is sampled after every timed
call and the row reports the mean. Greedy rows also count rows with tokens identical to transformers'.
The roofline line: bytes a decode step must read (weights used per token: every matmul kernel, the
unembedding, and the attended K/V slots) over the measured read bandwidth of this machine. --model rows also
print a compute floor: the least matmul work of one call (call_matmul_flops) at PyTorch's bf16 matmul rates on
this processor, measured after the sides exit, against the time a sampler twice as fast as transformers has.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time


@dataclasses.dataclass(frozen=True)
class Row:
    hf: dict              # transformers.LlamaConfig fields
    batch: int = 8
    new_tokens: int = 256
    prompt_len: tuple[int, int] = (16, 32)  # prompt lengths drawn in [lo, hi]
    temperature: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


DEMO = dict(vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
MID = dict(vocab_size=16384, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2)
SMALL = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4)
ROWS = {
    "demo": Row(DEMO),
    "demo_t1": Row(DEMO, batch=64, new_tokens=96, prompt_len=(128, 256), temperature=1.0),
    "mid": Row(MID),
    "small": Row(SMALL),
    "small_b32": Row(SMALL, batch=32),
    # Llama-3.2-1B shapes, for an accelerator run (--skip-hf --dtype bfloat16).
    "1b": Row(dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True), batch=64),
}
CPU_ROWS = ("demo", "demo_t1", "mid", "small", "small_b32")


def build_hf_checkpoint(path: str, hf_fields: dict, seed: int = 0) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=1,
                                      eos_token_id=2, **hf_fields)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def read_bandwidth_gbs() -> float:
    """Best of a few passes summing a 256 MB float32 array with jax (all cores), in GB/s."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def step_bytes(config, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes one decode step reads, averaged over the steps: every weight used per token (the embedding row
    gather aside) plus the K/V slots attended (prompt + half the new tokens on average)."""
    c = config
    matmul = c.num_params() - c.vocab_size * c.hidden_size + (c.vocab_size * c.hidden_size if c.tie_word_embeddings
                                                              else 0)
    itemsize = 2 if c.param_dtype == "bfloat16" else 4
    kv = 2 * c.num_layers * batch * c.num_kv_heads * c.head_dim * (prompt_len + new_tokens / 2) * itemsize
    return matmul * itemsize + kv


# Which matmuls take the activations as two bf16 halves (hi + lo rows: twice the rows, twice the work) in each
# variant of bench_greedy_rounding.py's agreement table: the sampler's full split and the two partial ones.
SPLITS = {"bf16 activations": (), "split attention + unembedding": ("attention", "unembed"),
          "full split (the sampler)": ("attention", "mlp", "unembed")}


def call_matmul_flops(config, prompts: list[list[int]], new_tokens: int) -> dict[str, dict[str, float]]:
    """The least matmul FLOPs (2 per multiply-add) one greedy call must do, per phase (prefill, decode) and part
    (attention projections, mlp, unembed, scores: attention's scores and values): every prompt token once, the
    prefix the whole batch shares counted once and no padding, then new_tokens - 1 decode steps a row; the
    unembedding once per produced token; scores over each position's context. Any bf16 sampler does at least
    this."""
    c = config
    D, F, N, K, H, L = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers)
    per_token = {"attention": 2 * L * (2 * D * N * H + 2 * D * K * H), "mlp": 2 * L * 3 * D * F}
    unembed, scores = 2 * D * c.vocab_size, 4 * L * N * H  # per produced token; per token and context position

    def context(lo, hi):  # the sum of the context lengths of the tokens at positions [lo, hi)
        return (hi * (hi + 1) - lo * (lo + 1)) / 2

    from sweet_jax.sampling.generate import shared_prefix_length
    shared = shared_prefix_length(prompts, minimum=1, multiple=1)  # all of it, each prompt keeping a token
    prefill_tokens = shared + sum(len(p) - shared for p in prompts)
    steps = new_tokens - 1
    phases = {"prefill": (prefill_tokens, len(prompts), context(0, shared) + sum(context(shared, len(p))
                                                                                  for p in prompts)),
              "decode": (steps * len(prompts), steps * len(prompts),
                         sum(context(len(p), len(p) + steps) for p in prompts))}
    return {phase: {**{part: tokens * f for part, f in per_token.items()}, "unembed": produced * unembed,
                    "scores": ctx * scores} for phase, (tokens, produced, ctx) in phases.items()}


def matmul_floor(flops: dict[str, dict[str, float]], split: tuple[str, ...], rate) -> float:
    """Seconds of matmul at rate(phase, doubled) GFLOP/s, the parts in split doing twice the work."""
    return sum(f * (2 if part in split else 1) / rate(phase, part in split) / 1e9
               for phase, parts in flops.items() for part, f in parts.items())


def torch_bf16_gflops(m: int, k: int, n: int) -> float:
    """PyTorch's bf16 matmul (its oneDNN kernel: this processor's bf16 units) at m x k x n, best of 5 calls (50
    for a decode step's few rows, whose single calls the scheduler's noise dominates)."""
    import torch
    from bench_matmul import best_seconds, operands
    a, b = operands("torch", torch.bfloat16, m, k, n)
    return 2 * m * k * n / best_seconds("torch", torch.matmul, a, b, 5 if m >= 512 else 50) / 1e9


def run_row(name: str, row: Row, args) -> dict:
    import jax
    import numpy as np
    import torch

    from sweet_jax.sampling.generate import Sampler
    from sweet_jax.models import load_hf

    rng = np.random.default_rng(0)
    V = row.hf["vocab_size"]
    lo, hi = row.prompt_len
    lengths = [int(x) for x in rng.integers(lo, hi + 1, size=row.batch)]
    prompts = [rng.integers(3, V, size=n).tolist() for n in lengths]
    total_new = row.batch * row.new_tokens
    loads: dict[str, list[float]] = {"ours": [], "hf": []}

    with tempfile.TemporaryDirectory() as tmp:
        build_hf_checkpoint(tmp, row.hf)
        model = load_hf(tmp, dtype=args.dtype, config_overrides={"dtype": args.dtype,
                                                                   "attention_impl": args.attention_impl})
        sampler = Sampler(model, max_batch_size=row.batch)

        def ours():
            out = sampler.generate(prompts, max_new_tokens=row.new_tokens, temperature=row.temperature,
                                   ignore_eos=True, seed=0)
            return [g[0].token_ids for g in out]

        sides = {"ours": ours}
        if not args.skip_hf:
            import transformers

            device = "cuda" if torch.cuda.is_available() else "cpu"
            hf = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=getattr(torch, args.dtype))
            hf = hf.to(device).eval()
            width = max(lengths)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            sampling = (dict(do_sample=False) if row.greedy else
                        dict(do_sample=True, temperature=row.temperature, top_k=0, top_p=1.0))

            def theirs():
                with torch.inference_mode():
                    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=row.new_tokens,
                                      min_new_tokens=row.new_tokens, pad_token_id=0, **sampling)
                if device == "cuda":
                    torch.cuda.synchronize()
                return out[:, width:].tolist()

            sides["hf"] = theirs

        first, best, tokens = {}, {side: float("inf") for side in sides}, {}
        for side, fn in sides.items():  # warm-up: compilation, allocator
            start = time.perf_counter()
            tokens[side] = fn()
            first[side] = time.perf_counter() - start
        for _ in range(args.repeats):  # interleaved, so both sides see the same background load
            for side, fn in sides.items():
                start = time.perf_counter()
                fn()
                best[side] = min(best[side], time.perf_counter() - start)
                loads[side].append(os.getloadavg()[0])

    result = dict(name=name, row=row, params=model.config.num_params(), config=model.config,
                  prompt_mean=float(np.mean(lengths)), backend=jax.default_backend(),
                  ours_tps=total_new / best["ours"], ours_first=first["ours"],
                  ours_load=float(np.mean(loads["ours"])))
    if "hf" in sides:
        result.update(hf_tps=total_new / best["hf"], hf_first=first["hf"], hf_load=float(np.mean(loads["hf"])),
                      identical=(sum(a == b for a, b in zip(tokens["ours"], tokens["hf"])) if row.greedy else None))
    print(f"  {name}: ours {result['ours_tps']:.0f} tok/s"
          + (f", transformers {result['hf_tps']:.0f} tok/s" if "hf" in sides else "")
          + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    return result


REQUESTS = ["reverses a string", "checks whether a number is prime", "merges two sorted lists",
            "counts the vowels in a text", "returns the n-th Fibonacci number", "flattens a nested list",
            "computes the median of a list", "removes duplicates from a list while keeping the order"]
STYLES = ["Write a Python function that {}.", "In Python, implement a function that {}.",
          "Give me Python code for a function that {}.", "I need a short Python function that {}.",
          "Please write a Python function which {}.", "Show a Python function that {}, with a docstring.",
          "Write a small, well-named Python function that {}.", "Can you write a Python function that {}?"]


def chat_prompts(model_dir: str, n: int, system_prompt: str = "") -> list[list[int]]:
    """n distinct chat-templated requests (8 x 8 combinations, repeated past 64) as token ids; system_prompt
    "agent": each with the ColBench agent's rules as its system message, as the pipeline's policy prompts."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [STYLES[i // len(REQUESTS) % len(STYLES)].format(REQUESTS[i % len(REQUESTS)]) for i in range(n)]
    system = []
    if system_prompt == "agent":
        from sweet_jax.envs import AGENT_PROMPT
        system = [{"role": "system", "content": AGENT_PROMPT}]
    return [list(tok.apply_chat_template(system + [{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for t in texts]


def model_child(args) -> None:
    """One side of --model (stdin protocol: 'run' -> one timed call; anything else -> tokens and peak RSS)."""
    import json
    import resource
    import numpy as np
    prompts = chat_prompts(args.model, args._batch, args.system_prompt)
    new = args.new_tokens
    if args._child in ("ours", "ours_xla"):
        from sweet_jax.sampling.generate import Sampler
        from sweet_jax.models import load_hf
        matmul = args.cpu_matmul if args._child == "ours" else "xla"
        model = load_hf(args.model, dtype=args.dtype, config_overrides={"dtype": args.dtype, "cpu_matmul": matmul,
                                                                         "attention_impl": args.attention_impl})
        sampler = Sampler(model, max_batch_size=args._batch, min_shared_prefix=args.shared_prefix)

        def call():
            out = sampler.generate(prompts, max_new_tokens=new, temperature=0.0, ignore_eos=True, seed=0)
            return [g[0].token_ids for g in out]
    else:
        import torch
        import transformers
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        hf = transformers.LlamaForCausalLM.from_pretrained(args.model,
                                                           dtype=getattr(torch, args.hf_dtype or args.dtype)).eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def call():
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
            return out[:, width:].tolist()
    start = time.perf_counter()
    tokens = call()
    print("READY " + json.dumps(dict(first=time.perf_counter() - start, prompt_mean=float(np.mean([len(p) for p in
                                                                                                  prompts])))),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        call()
        print("DONE " + json.dumps(dict(seconds=time.perf_counter() - start, load=os.getloadavg()[0])), flush=True)
    print("RESULT " + json.dumps(dict(tokens=tokens, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                      * 1024)), flush=True)


def run_model(args) -> None:
    """--model: one row per batch size, each side in its own process, timed calls interleaved."""
    import json
    import subprocess
    import transformers

    import torch
    from sweet_jax.models import LlamaConfig
    from sweet_jax.models.hf import read_hf_config
    config = LlamaConfig.from_hf(read_hf_config(args.model))
    bandwidth = read_bandwidth_gbs()
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        procs = {}
        for side in ("ours", "hf") + (("ours_xla",) if args.cpu_matmul != "xla" else ()):
            cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--new-tokens",
                   str(args.new_tokens), "--dtype", args.dtype, "--attention-impl", args.attention_impl,
                   "--cpu-matmul", args.cpu_matmul, "--hf-dtype", args.hf_dtype or args.dtype,
                   "--torch-threads", str(args.torch_threads), "--system-prompt", args.system_prompt,
                   "--shared-prefix", str(args.shared_prefix), "--_child", side, "--_batch", str(batch)]
            procs[side] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def expect(side, prefix):
            for line in procs[side].stdout:
                if line.startswith(prefix + " "):
                    return json.loads(line[len(prefix) + 1:])
            sys.exit(f"the {side} side of batch {batch} died (its stderr is above)")

        ready = {side: expect(side, "READY") for side in procs}  # both warm up at once, untimed
        best, loads = {side: float("inf") for side in procs}, {side: [] for side in procs}
        for _ in range(args.repeats):
            for side, proc in procs.items():
                proc.stdin.write("run\n")
                proc.stdin.flush()
                done = expect(side, "DONE")
                best[side] = min(best[side], done["seconds"])
                loads[side].append(done["load"])
        final = {}
        for side, proc in procs.items():
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            final[side] = expect(side, "RESULT")
            proc.wait()
        same = sum(a == b for a, b in zip(final["ours"]["tokens"], final["hf"]["tokens"]))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(final["ours"]["tokens"], final["hf"]["tokens"]) if a != b]
        total = batch * args.new_tokens
        results.append(dict(batch=batch, ours=total / best["ours"], hf=total / best["hf"], same=same,
                            first_diff=first_diff, ours_rss=final["ours"]["peak_rss"], hf_rss=final["hf"]["peak_rss"],
                            ours_load=sum(loads["ours"]) / len(loads["ours"]), hf_load=sum(loads["hf"]) / len(loads["hf"]),
                            first=(ready["ours"]["first"], ready["hf"]["first"]), prompt_mean=ready["ours"]["prompt_mean"]))
        # The compute floor, measured once the sides have exited: the least matmul work of this call at this
        # processor's bf16 matmul rates, against the time 2x transformers allows.
        prompts = chat_prompts(args.model, batch, args.system_prompt)
        rates = {rows: torch_bf16_gflops(rows, config.hidden_size, config.intermediate_size)
                 for rows in (2048, batch, 2 * batch)}
        flops = call_matmul_flops(config, prompts, args.new_tokens)
        floors = {name: matmul_floor(flops, split, lambda phase, doubled: rates[
            2048 if phase == "prefill" else batch * (2 if doubled else 1)]) for name, split in SPLITS.items()}
        results[-1].update(flops={phase: sum(parts.values()) for phase, parts in flops.items()}, rates=rates,
                           floors=floors, hf_seconds=best["hf"])
        if "ours_xla" in final:
            results[-1].update(f32=total / best["ours_xla"], same_f32=sum(
                a == b for a, b in zip(final["ours"]["tokens"], final["ours_xla"]["tokens"])))
        print(f"  batch {batch}: ours {results[-1]['ours']:.0f} tok/s, transformers {results[-1]['hf']:.0f} tok/s",
              file=sys.stderr, flush=True)

    print(f"\nSampler on {args.model} ({config.num_params() / 1e6:.1f}M params, {args.dtype}, model.cpu_matmul="
          f"{args.cpu_matmul}; transformers in {args.hf_dtype or args.dtype}): sweet_jax Sampler vs "
          f"transformers {transformers.__version__} generate (torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads), greedy, {args.new_tokens} new tokens (eos ignored), chat-templated prompts"
          f"{' with the agent system prompt' if args.system_prompt else ''}, our min_shared_prefix "
          f"{args.shared_prefix}, best of "
          f"{args.repeats} interleaved calls after a warm-up call each, each side its own process; host cores "
          f"{os.cpu_count()}. Read bandwidth {bandwidth:.1f} GB/s.")
    head = ("| batch | prompt tokens (mean) | sweet_jax tok/s (load) | transformers tok/s (load) | ratio | identical "
            "| peak RSS GiB sweet_jax / transformers | step floor ms | sweet_jax step ms |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        floor_ms = step_bytes(config, r["batch"], r["prompt_mean"], args.new_tokens) / (bandwidth * 1e9) * 1e3
        print(f"| {r['batch']} | {r['prompt_mean']:.0f} | {r['ours']:.0f} ({r['ours_load']:.1f}) | {r['hf']:.0f} "
              f"({r['hf_load']:.1f}) | **{r['ours'] / r['hf']:.2f}x** | {r['same']}/{r['batch']} | "
              f"{r['ours_rss'] / 2**30:.2f} / {r['hf_rss'] / 2**30:.2f} | {floor_ms:.2f} | "
              f"{r['batch'] / r['ours'] * 1e3:.2f} |")
    for r in results:
        if "f32" in r:
            print(f"batch {r['batch']}: our float32 sampler (cpu_matmul=xla) {r['f32']:.0f} tok/s; greedy rows equal "
                  f"to it {r['same_f32']}/{r['batch']}; ratio to transformers {r['f32'] / r['hf']:.2f}x")
    for r in results:
        budget, b, D, F = r["hf_seconds"] / 2, r["batch"], config.hidden_size, config.intermediate_size
        floors = ", ".join(f"{name} {sec:.2f} s ({sec / budget:.0%})" for name, sec in r["floors"].items())
        print(f"batch {b}: compute floor: the least matmul work of one call (common prefix once, no padding) is "
              f"{r['flops']['prefill'] / 1e9:.0f} GFLOP prefill + {r['flops']['decode'] / 1e9:.0f} decode; at "
              f"PyTorch's bf16 matmul rates here (GFLOP/s at rows x {D} x {F}: "
              + ", ".join(f"{rows} rows {rate:.0f}" for rows, rate in r["rates"].items())
              + f") 2x transformers means a call in {budget:.2f} s, and the matmuls alone take: {floors}")
    for r in results:
        if r["first_diff"]:
            print(f"batch {r['batch']}: differing rows first differ at new-token positions {r['first_diff']}")
    print("first call (compile / warm-up) s, ours/transformers: "
          + ", ".join(f"batch {r['batch']} {r['first'][0]:.1f}/{r['first'][1]:.1f}" for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="all", help=f"comma-separated of {sorted(ROWS)}; all = {','.join(CPU_ROWS)}")
    parser.add_argument("--dtype", default="float32", help="param and compute dtype of both sides")
    parser.add_argument("--attention-impl", default="auto", choices=["xla", "cudnn", "auto", "blocked", "chunked"],
                        help="ours: the model's attention implementation for the prompt (the prefill); decoding "
                             "always reads the heads-major cache directly (auto: the model's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side (best is reported)")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--skip-hf", action="store_true", help="time only sweet_jax (e.g. a 1B model on a TPU)")
    parser.add_argument("--model", default="", help="an HF Llama checkpoint directory: rows on its weights")
    parser.add_argument("--batches", default="8,64", help="--model: batch sizes, one row each")
    parser.add_argument("--new-tokens", type=int, default=128, help="--model: new tokens per row")
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "xla", "xla_bf16", "onednn"],
                        help="--model: the sweet_jax side's model.cpu_matmul")
    parser.add_argument("--hf-dtype", default="", help="--model: the transformers side's dtype (default --dtype)")
    parser.add_argument("--system-prompt", default="", choices=["", "agent"],
                        help="--model: agent = the ColBench agent's rules as every prompt's system message")
    parser.add_argument("--shared-prefix", type=int, default=32,
                        help="--model: our Sampler's min_shared_prefix (a prefix common to the batch runs once; 0 off)")
    parser.add_argument("--_child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--_batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        model_child(args)
        return
    if args.model:
        run_model(args)
        return
    names = CPU_ROWS if args.rows == "all" else tuple(args.rows.split(","))
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {sorted(ROWS)}")

    import jax
    import torch
    import transformers

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    bandwidth = read_bandwidth_gbs()
    results = [run_row(name, ROWS[name], args) for name in names]

    print(f"\nSampler throughput, sweet_jax (jit prefill + one compiled while_loop per cache window) vs transformers "
          f"{transformers.__version__} generate (torch {torch.__version__}, {torch.get_num_threads()} threads), "
          f"{args.dtype}, eos ignored, best of {args.repeats} interleaved calls after a warm-up call each. "
          f"jax backend: {jax.default_backend()}, host cores: {os.cpu_count()}. Load averages (1 min) are the "
          f"means over each side's timed calls; other processes share the cores, so compare within a row.")
    print(f"Measured read bandwidth (jnp.sum of 256 MB, best of 5): {bandwidth:.1f} GB/s.")
    head = ("| row | params | batch | new | mode | sweet_jax tok/s (load) | transformers tok/s (load) | ratio "
            "| identical | step floor ms (bytes/bandwidth) | sweet_jax step ms |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        row: Row = r["row"]
        mode = "greedy" if row.greedy else f"T={row.temperature:g}"
        floor_ms = step_bytes(r["config"], row.batch, r["prompt_mean"], row.new_tokens) / (bandwidth * 1e9) * 1e3
        step_ms = row.batch / r["ours_tps"] * 1e3
        hf = (f"{r['hf_tps']:.0f} ({r['hf_load']:.1f})", f"**{r['ours_tps'] / r['hf_tps']:.2f}x**",
              "-" if r["identical"] is None else f"{r['identical']}/{row.batch}") if "hf_tps" in r else ("-",) * 3
        print(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {row.batch} | {row.new_tokens} | {mode} "
              f"| {r['ours_tps']:.0f} ({r['ours_load']:.1f}) | {hf[0]} | {hf[1]} | {hf[2]} | {floor_ms:.2f} "
              f"| {step_ms:.2f} |")
    first = ", ".join(f"{r['name']} {r['ours_first']:.1f}/{r.get('hf_first', float('nan')):.1f}" for r in results)
    print(f"first call (compile / warm-up) s, ours/transformers: {first}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
