"""A seed of the smollm2 pipeline, stage by stage: each stage's wall and CPU seconds and where they went (compile,
sampling's prefill and decode, sandbox, scoring and reference passes, train steps, real against padded tokens:
the `costs` each stage keeps in DIR/STAGE/done.json), for two sides of a comparison run on the same host (one after
the other, or with --together at once), with their ratio and their outputs compared.

    python bench/bench_stages.py --model HF_DIR --out OUT --before REV [--together] [--preset PRESET] [--scale 0.25]
    python bench/bench_stages.py --model HF_DIR --out OUT [--preset smollm2] [--scale 0.25]
    python bench/bench_stages.py --evidence bench/results/select_seed2/evidence
    python bench/bench_stages.py --run bench/results/discovery_seed0/state

--before REV: "before" is the pipeline at git revision REV (its files exported to OUT/before/src), "after" this tree.
Without it the sides are the float32 and bfloat16 CPU matmuls (model.cpu_matmul = xla | auto) of this tree.
--evidence: the stage table of a kept run (its stages.json and per-step metrics), nothing run.
--run: where the seconds of a run's finished stages went (their done.json costs: a workdir or its --carry state).

HF_DIR: SmolLM2-135M-Instruct as an HF directory (`python -m sweet_jax.models.gguf smollm2 HF_DIR`). --preset
smollm2_select runs a frozen seed of the comparison (select.frozen: seed 0's choices from
bench/results/select_seed0/results.json, their step counts times --scale); smollm2_discovery a seed of the
discovery protocol (its validation cells included, --seed its task draw); smollm2 runs zero_shot and sweet. Every
count (tasks, steps, prompts) is multiplied by --scale (1 = the preset's full size). With --before both sides start
from one starting policy ("after" copies the init stage of "before": init.from_run) and each keeps its own JAX
compilation cache (OUT/SIDE/jax_cache, empty at its start: a cold seed). Rerun to resume; --sides runs only some
(none: only the tables, printed and written to OUT/stages.md). The machine should be otherwise idle: each record
keeps the load average at its start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
MATMUL_SIDES = ("xla", "auto")
BEFORE_AFTER = ("before", "after")
# (field, the preset's value): the counts --scale multiplies (at least 1 each, 2 tasks per split)
COUNTS = {"smollm2": (("init.num_tasks", 512), ("init.sft.num_steps", 64), ("tasks.num_train", 64),
                      ("tasks.num_heldout", 48), ("critic.num_steps", 32), ("rank.max_prompts", 64),
                      ("sweet.num_steps", 24)),
          "smollm2_select": (("init.num_tasks", 512), ("init.sft.num_steps", 64), ("tasks.num_train", 64),
                             ("tasks.num_heldout", 48), ("critic.num_steps", 32)),
          "smollm2_discovery": (("init.num_tasks", 512), ("init.sft.num_steps", 64), ("tasks.num_train", 64),
                                ("tasks.num_validation", 48), ("tasks.num_heldout", 100), ("critic.num_steps", 32))}
# What the cost columns sum (done.json costs): (column, keys)
COST_COLUMNS = (("compile", ("compile_s",)), ("prefill", ("sample_prefill_s",)), ("decode", ("sample_decode_s",)),
                ("sandbox", ("sandbox_s",)), ("score passes", ("score_pass_s",)),
                ("ref passes", ("ref_logp_pass_s",)), ("train steps", ("train_step_s",)),
                ("held-out evals", ("train_eval_s",)))
TOKEN_COLUMNS = (("train", "train"), ("ref", "ref_logp"), ("score", "score"), ("prompt", "sample_prompt"),
                 ("decode", "sample_new"))


def overrides(preset: str, scale: float) -> list[str]:
    out = []
    for field, full in COUNTS[preset]:
        least = 2 if field.startswith("tasks.") else 1
        out.append(f"--config.{field}={max(least, round(full * scale))}")
    return out


def frozen_selection(out: pathlib.Path, scale: float) -> pathlib.Path:
    """Seed 0's selection (its choices), every step count times scale (at least 1)."""
    selection = json.loads((REPO / "bench/results/select_seed0/results.json").read_text())["selection"]
    scaled = lambda n: max(1, round(n * scale))  # noqa: E731
    selection["steps"] = sorted({scaled(n) for n in selection["steps"]})
    for choice in (m["choice"] for m in selection["methods"].values()):
        if "step" in choice:
            choice["step"] = scaled(choice["step"])
    path = out / "selection.json"
    path.write_text(json.dumps(selection, indent=1) + "\n")
    return path


def source_tree(args, side: str) -> pathlib.Path:
    """The tree a side runs: this one, or (before) the files of revision --before."""
    if side != "before":
        return REPO
    src = pathlib.Path(args.out).resolve() / "before" / "src"
    if not src.exists():   # an export of the revision's files, not a worktree: the repository's metadata is not touched
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", args.before], check=True, cwd=REPO,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def run_side(args, side: str, init_from: pathlib.Path | None, *, wait: bool = True):
    out = pathlib.Path(args.out).resolve()
    workdir, src = out / side, source_tree(args, side)
    cmd = [sys.executable, "-m", "sweet_jax.pipeline", "--config", f"configs/pipeline.py:{args.preset}",
           f"--config.init.pretrained={args.model}", f"--config.seed={args.seed}", f"--workdir={workdir}",
           *overrides(args.preset, args.scale)]
    if args.preset == "smollm2_select":
        cmd.append(f"--config.select.frozen={frozen_selection(out, args.scale)}")
    if args.methods:
        cmd.append(f"--config.methods={args.methods}")
    if side in MATMUL_SIDES:
        cmd.append(f"--config.model.cpu_matmul={side}")
    env = dict(os.environ)
    if side in BEFORE_AFTER:
        if side != "before":
            cmd.append(f"--config.init.from_run={init_from}")
            reuse(init_from, workdir, [s for s in args.reuse.split(",") if s])
        env.update(PYTHONPATH=str(src), JAX_COMPILATION_CACHE_DIR=str(workdir / "jax_cache"))
    print("$", " ".join(cmd), f"(in {src})", flush=True)
    proc = subprocess.Popen(cmd, cwd=src, env=env)
    if wait and proc.wait():
        raise SystemExit(f"error: the {side} side's pipeline exited with status {proc.returncode}")
    return proc


def reuse(src: pathlib.Path, dst: pathlib.Path, stages: list[str]) -> None:
    """Copy finished stages (their directories, done.json included) so that this side skips them: stages whose
    code the comparison does not change, whose outputs the next stages then read on both sides alike."""
    for stage in stages:
        if not (src / stage / "done.json").exists():
            raise SystemExit(f"error: --reuse {stage}: {src / stage / 'done.json'} does not exist; run that side first")
        if not (dst / stage / "done.json").exists():
            shutil.rmtree(dst / stage, ignore_errors=True)
            shutil.copytree(src / stage, dst / stage, symlinks=True)


def run_together(args, sides, init_from: pathlib.Path) -> None:
    """Both sides at once under the same load (the second starts when the first's init stage is done)."""
    first = run_side(args, sides[0], init_from, wait=False)
    while not (init_from / "init" / "done.json").exists():
        if first.poll() is not None:
            raise SystemExit(f"error: the {sides[0]} side's pipeline exited with status {first.returncode}")
        time.sleep(10)
    second = run_side(args, sides[1], init_from, wait=False)
    for side, proc in zip(sides, (first, second)):
        if proc.wait():
            raise SystemExit(f"error: the {side} side's pipeline exited with status {proc.returncode}")


def records(workdir: pathlib.Path) -> dict[str, dict]:
    """Every stage's done.json record, keyed by its directory."""
    return {str(rel.parent): json.loads((workdir / rel).read_text()) for rel in _outputs(workdir, "done.json")}


def stage_table(by_side: dict[str, dict[str, dict]], title: str, reused: frozenset = frozenset()) -> str:
    """Wall / CPU seconds per stage on each side, their ratio; reused stages (--reuse) count in neither total."""
    a, b = by_side
    lines = [title, "", f"| stage | {a} | {b} | wall ratio | CPU ratio |", "|---|---|---|---|---|"]
    stages = [s for s in by_side[a] if s != "report"] + [s for s in by_side[b] if s not in by_side[a] and s != "report"]
    totals = {side: [0.0, 0.0] for side in by_side}
    for stage in stages:
        cells, pair = [], []
        if stage in reused:
            r = by_side[a][stage]
            lines.append(f"| {stage} | {r['seconds']:.0f} / {r.get('cpu_seconds') or 0:.0f} | (copied) | | |")
            continue
        for side in by_side:
            r = by_side[side].get(stage)
            if r is None:
                cells.append("")
                continue
            wall, cpu = r["seconds"], r.get("cpu_seconds") or 0.0
            totals[side][0] += wall
            totals[side][1] += cpu
            pair.append((wall, cpu))
            load = r.get("load_average") or [float("nan")] * 2
            cells.append(f"{wall:.0f} / {cpu:.0f} ({load[0]:.1f} -> {load[1]:.1f})")
        ratios = [f"{pair[0][i] / pair[1][i]:.2f}x" if len(pair) == 2 and pair[1][i] else "" for i in (0, 1)]
        lines.append(f"| {stage} | " + " | ".join(cells + ratios) + " |")
    ratio = [f"**{totals[a][i] / totals[b][i]:.2f}x**" if totals[b][i] else "" for i in (0, 1)]
    lines.append("| all | " + " | ".join(f"{totals[s][0]:.0f} / {totals[s][1]:.0f}" for s in by_side)
                 + " | " + " | ".join(ratio) + " |")
    return "\n".join(lines) + "\n"


def cost_table(recs: dict[str, dict], title: str) -> str:
    """Where each stage's wall seconds went (costs of its done.json), and its real / padded tokens."""
    head = ["stage", "wall", *[c for c, _ in COST_COLUMNS], "other", *[f"{c} tokens real/padded" for c, _ in TOKEN_COLUMNS]]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage, r in recs.items():
        c = r.get("costs")
        if c is None or stage == "report":
            continue
        parts = [sum(c.get(k, 0.0) for k in keys) for _, keys in COST_COLUMNS]
        # compile time is inside the passes that triggered it: "other" is what no timer holds
        other = r["seconds"] - sum(parts[1:])
        tokens = [f"{c.get(k + '_tokens', 0) / 1e3:.0f}k / {c.get(k + '_padded_tokens', 0) / 1e3:.0f}k"
                  if c.get(k + "_padded_tokens") else "" for _, k in TOKEN_COLUMNS]
        lines.append(f"| {stage} | {r['seconds']:.0f} | " + " | ".join(f"{p:.0f}" if p else "" for p in parts)
                     + f" | {other:.0f} | " + " | ".join(tokens) + " |")
    return "\n".join(lines) + "\n"


def evidence_table(evidence: pathlib.Path) -> str:
    """A kept run's stage times (its evidence/stages.json) with the train steps' share (its metrics_*.jsonl): what
    runs before the costs existed can say about where their minutes went."""
    recs = json.loads((evidence / "stages.json").read_text())
    lines = [f"Stage times of {evidence.parent.name} (seconds; train steps from the per-step metrics, the first step "
             "includes its compilation):", "", "| stage | wall | CPU | load | train steps | first step | steps | "
             "median step | rest |", "|---|---|---|---|---|---|---|---|---|"]
    total = [0.0, 0.0, 0.0]
    for stage, r in sorted(recs.items(), key=lambda kv: -kv[1]["seconds"]):
        if r["seconds"] < 1:
            continue
        steps = [m["step_seconds"] for m in _jsonl(evidence / f"metrics_{stage.replace('/', '_')}.jsonl")
                 if m.get("split") == "train"]
        load = r.get("load_average") or [float("nan")] * 2
        total = [total[0] + r["seconds"], total[1] + r["cpu_seconds"], total[2] + sum(steps)]
        cells = (f"{sum(steps):.0f} | {steps[0]:.0f} | {len(steps)} | {sorted(steps)[len(steps) // 2]:.1f}"
                 if steps else " | | | ")
        lines.append(f"| {stage} | {r['seconds']:.0f} | {r['cpu_seconds']:.0f} | {load[0]:.1f} -> {load[1]:.1f} | "
                     f"{cells} | {r['seconds'] - sum(steps):.0f} |")
    lines.append(f"| all | {total[0]:.0f} | {total[1]:.0f} | | {total[2]:.0f} | | | | {total[0] - total[2]:.0f} |")
    return "\n".join(lines) + "\n"


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _episodes(path: pathlib.Path) -> dict:
    return {(r["rollout"]["task_index"], r["rollout"]["sample"]) if "rollout" in r else i:
            (r["dialogue_history"], r.get("reward")) for i, r in enumerate(_jsonl(path))}


def _outputs(workdir: pathlib.Path, name: str) -> list[pathlib.Path]:
    """The run's files called `name`, relative to it (not the source tree or the compilation cache)."""
    return [p.relative_to(workdir) for p in sorted(workdir.glob(f"**/{name}"))
            if p.relative_to(workdir).parts[0] not in ("src", "jax_cache")]


def compare_outputs(a: pathlib.Path, b: pathlib.Path, reused: frozenset = frozenset()) -> str:
    """Each stage's outputs on the two sides (reused stages left out): episodes (identical dialogues and rewards),
    pairs, per-step training losses (largest difference)."""
    ran = lambda rel: not any(str(rel).startswith(stage + "/") for stage in reused)  # noqa: E731
    lines = ["Outputs compared (before vs after):", "", "| output | equal | detail |", "|---|---|---|"]
    for rel in filter(ran, _outputs(a, "trajectories.jsonl")):
        ea, eb = _episodes(a / rel), _episodes(b / rel)
        same = sum(ea[k] == eb.get(k) for k in ea)
        lines.append(f"| {rel} | {'yes' if same == len(ea) == len(eb) else 'no'} | {same} of {len(ea)} episodes "
                     f"identical; success {sum(r == 1.0 for _, r in ea.values())} vs "
                     f"{sum(r == 1.0 for _, r in eb.values())} |")
    for rel in filter(ran, _outputs(a, "pairs.jsonl")):
        pa, pb = _jsonl(a / rel), _jsonl(b / rel)
        lines.append(f"| {rel} | {'yes' if pa == pb else 'no'} | {len(pa)} vs {len(pb)} pairs |")
    for rel in filter(ran, _outputs(a, "metrics.jsonl")):
        ma = [r for r in _jsonl(a / rel) if r.get("split") == "train"]
        mb = [r for r in _jsonl(b / rel) if r.get("split") == "train"]
        diff = max((abs(x["loss"] - y["loss"]) for x, y in zip(ma, mb)), default=float("nan"))
        lines.append(f"| {rel.parent.parent} losses | {'yes' if len(ma) == len(mb) and diff < 1e-4 else 'no'} | "
                     f"{len(ma)} vs {len(mb)} steps, largest difference {diff:.2g} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evidence", default="", help="only print a kept run's table (e.g. "
                        "bench/results/select_seed2/evidence) and exit")
    parser.add_argument("--run", default="", help="only print where a run's finished stages' seconds went")
    parser.add_argument("--model", help="SmolLM2-135M-Instruct as an HF directory")
    parser.add_argument("--out", help="directory of the two sides' workdirs")
    parser.add_argument("--before", default="", help="git revision of the 'before' side (else: float32 vs bf16)")
    parser.add_argument("--preset", default="smollm2", choices=sorted(COUNTS))
    parser.add_argument("--scale", type=float, default=0.25, help="multiplies the preset's counts (1 = full size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="", help="config.methods (default: the preset's)")
    parser.add_argument("--together", action="store_true",
                        help="--before: run both sides at once (same load over time) instead of one after the other")
    parser.add_argument("--reuse", default="", help="--before: stages 'after' copies from 'before' instead of "
                        "running them (e.g. offline,candidates: code the comparison does not change)")
    parser.add_argument("--sides", default="", help="run only these, or none (the tables read both workdirs)")
    args = parser.parse_args()
    if args.evidence:
        print(evidence_table(pathlib.Path(args.evidence)))
        return
    if args.run:
        run = pathlib.Path(args.run)
        print(cost_table(records(run), f"Where the seconds of {run} went (its finished stages):"))
        return
    if not args.model or not args.out:
        parser.error("--model and --out are required (unless --evidence)")
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sides = BEFORE_AFTER if args.before else MATMUL_SIDES
    init_from = out / sides[0]
    if args.together:
        run_together(args, sides, init_from)
    for side in ([] if args.together else args.sides.split(",") if args.sides else sides):
        if side != "none":
            run_side(args, side, init_from)
    by_side = {s: records(out / s) for s in sides}
    reused = frozenset(x for x in args.reuse.split(",") if x) | ({"init"} if args.before else frozenset())
    text = stage_table(by_side, f"Stage times, seconds, {args.preset} at scale {args.scale}, seed {args.seed} "
                                "(wall / CPU; load average at start -> end):", reused)
    for s in sides:
        text += "\n" + cost_table(by_side[s], f"Where the seconds went, {s} (seconds; tokens in thousands):")
    if args.before:
        text += "\n" + compare_outputs(out / "before", out / "after", reused)
    (out / "stages.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
