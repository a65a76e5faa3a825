"""The smollm2 pipeline's stage times with float32 matmuls (model.cpu_matmul = xla) and with bfloat16 ones (auto;
its sampler stays float32 on AVX512-BF16 without AMX, models/cpu_matmul.py), on the same code, weights, tasks and
seed: each stage's wall and CPU seconds from the stage records the pipeline
keeps (DIR/STAGE/done.json), side by side, with their ratio.

    python bench/bench_stages.py --model HF_DIR --out /tmp/stages [--scale 0.25]

HF_DIR: SmolLM2-135M-Instruct as an HF directory (`python -m sweet_jax.models.gguf smollm2 HF_DIR`). The
pipeline is configs/pipeline.py:smollm2 with methods zero_shot and sweet (init with its SFT, offline episodes,
critic, candidates, rank, SWEET-RL's DPO, held-out episodes), every count (tasks, steps, prompts) multiplied by
--scale (1 = the preset's full size: ~3 CPU hours a mode). The two modes run one after the other, each in its
own process and workdir (OUT/xla, OUT/auto; rerun to resume); the table is printed and written to
OUT/stages.md. The machine should be otherwise idle: each record also keeps the load average at its start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

MODES = ("xla", "auto")
# (field, the smollm2 preset's value): the counts --scale multiplies (at least 1 each, 2 tasks per split)
COUNTS = (("init.num_tasks", 512), ("init.sft.num_steps", 64), ("tasks.num_train", 64), ("tasks.num_heldout", 48),
          ("critic.num_steps", 32), ("rank.max_prompts", 64), ("sweet.num_steps", 24))
STAGES = ("init", "offline", "critic", "candidates", "rank", "policies/sweet", "eval/zero_shot", "eval/sweet")


def overrides(scale: float) -> list[str]:
    out = []
    for field, full in COUNTS:
        least = 2 if field.startswith("tasks.") else 1
        out.append(f"--config.{field}={max(least, round(full * scale))}")
    return out


def run_mode(args, mode: str) -> pathlib.Path:
    workdir = pathlib.Path(args.out) / mode
    cmd = [sys.executable, "-m", "sweet_jax.pipeline", "--config", "configs/pipeline.py:smollm2",
           f"--config.init.pretrained={args.model}", "--config.methods=zero_shot,sweet",
           f"--config.model.cpu_matmul={mode}", f"--config.seed={args.seed}", f"--workdir={workdir}",
           *overrides(args.scale)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=pathlib.Path(__file__).resolve().parent.parent)
    return workdir


def records(workdir: pathlib.Path) -> dict[str, dict]:
    out = {}
    for stage in STAGES:
        done = workdir / stage / "done.json"
        if done.exists():
            out[stage] = json.loads(done.read_text())
    return out


def table(by_mode: dict[str, dict[str, dict]], scale: float) -> str:
    lines = [f"Stage times, seconds, smollm2 at scale {scale} (wall / CPU; load average at start -> end):", "",
             "| stage | float32 (`xla`) | bf16 (`auto`) | wall ratio | CPU ratio |", "|---|---|---|---|---|"]
    totals = {m: [0.0, 0.0] for m in MODES}
    for stage in STAGES:
        cells, pair = [], []
        for m in MODES:
            r = by_mode[m].get(stage)
            if r is None:
                cells.append("")
                continue
            wall, cpu = r["seconds"], r.get("cpu_seconds") or 0.0
            totals[m][0] += wall
            totals[m][1] += cpu
            pair.append((wall, cpu))
            load = r.get("load_average") or [float("nan")] * 2
            cells.append(f"{wall:.0f} / {cpu:.0f} ({load[0]:.1f} -> {load[1]:.1f})")
        ratios = [f"{pair[0][i] / pair[1][i]:.2f}x" if len(pair) == 2 and pair[1][i] else "" for i in (0, 1)]
        lines.append(f"| {stage} | " + " | ".join(cells + ratios) + " |")
    ratio = [f"**{totals['xla'][i] / totals['auto'][i]:.2f}x**" if totals["auto"][i] else "" for i in (0, 1)]
    lines.append("| all | " + " | ".join(f"{totals[m][0]:.0f} / {totals[m][1]:.0f}" for m in MODES)
                 + " | " + " | ".join(ratio) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as an HF directory")
    parser.add_argument("--out", required=True, help="directory of the two pipeline workdirs")
    parser.add_argument("--scale", type=float, default=0.25, help="multiplies the preset's counts (1 = full size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES), help="run only these (the table reads both workdirs)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for mode in args.modes.split(","):
        run_mode(args, mode)
    text = table({m: records(pathlib.Path(args.out) / m) for m in MODES}, args.scale)
    (pathlib.Path(args.out) / "stages.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
