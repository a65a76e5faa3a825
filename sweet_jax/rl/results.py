"""The pipeline's results: the paper-style table (markdown), a bar chart (PNG), and their mean over seeds
(mean +- standard deviation over the runs' results.json), written by the pipeline's report stage and by
`python -m sweet_jax.pipeline_report`."""
from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np

from sweet_jax import lazy
from sweet_jax.rl.intervals import intervals_table
from sweet_jax.rl.run_files import ReportError, read_run

# Rows in the paper's order (its Table 1), with the names it uses.
METHOD_NAMES = {
    "zero_shot": "Zero-Shot",
    "rft": "Rejection Fine-Tuning",
    "mtdpo": "Multi-Turn DPO",
    "sweet_no_info": "SWEET-RL w/o training-time information",
    "sweet": "SWEET-RL",
    "sweet_oracle": "SWEET-RL's pairs ranked by the oracle (control)",
    "sweet_balanced": "SWEET-RL, turn prompts balanced by state (beyond the paper)",
    "sweet_iterative": "SWEET-RL, iterative rounds (beyond the paper)",
}
METRICS = (("tests_passed_pct", "% Tests Passed"), ("success_rate_pct", "Success Rate"))
# The frontend track's (the paper's Table 1, right half): CLIP cosine x 100 and win rate against zero-shot.
FRONTEND_METRICS = (("cosine_pct", "Cosine Similarity (x100)"), ("win_rate_pct", "Win Rate vs Zero-Shot (%)"))


def metrics_of(runs: Sequence[dict]):
    return FRONTEND_METRICS if runs[0].get("track") == "frontend" else METRICS


def read_results(workdir) -> dict:
    """A run's results.json with its stage records, diagnostics and held-out episodes, each file checked as it is
    read (run_files.read_run: a damaged one is a ReportError naming the file and the field)."""
    return read_run(workdir)


def _cell(values: Sequence[float | None]) -> str:
    values = [v for v in values if v is not None]   # not measured (a win rate without the zero-shot answers)
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def results_table(runs: Sequence[dict], *, title: str = "") -> str:
    """Markdown: one row per method (the paper's order), % tests passed and success rate on held-out tasks;
    mean ± std over runs when there are several."""
    methods = [m for m in METHOD_NAMES if any(m in r["methods"] for r in runs)]
    model = runs[0].get("model", "policy")
    seeds = [r.get("seed") for r in runs]
    episodes = runs[0]["methods"][methods[0]].get("episodes") if methods else None
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += [f"Held-out tasks: {runs[0].get('heldout_tasks')} ({episodes} episodes per method and run); "
              f"seeds: {', '.join(str(s) for s in seeds)}" + ("; mean ± std over seeds." if len(runs) > 1 else "."),
              "", f"| {model} | " + " | ".join(name for _, name in metrics_of(runs)) + " |",
              "|---|" + "---|" * len(metrics_of(runs))]
    for m in methods:
        cells = [_cell([r["methods"][m][key] for r in runs if m in r["methods"]]) for key, _ in metrics_of(runs)]
        lines.append(f"| {METHOD_NAMES[m]} | " + " | ".join(cells) + " |")
    if any(r.get("episodes") for r in runs):
        intervals = intervals_table([r["episodes"] for r in runs if r.get("episodes")], METHOD_NAMES)
        if intervals:
            lines += ["", intervals]
    diag = _diagnostics(runs)
    if diag:
        lines += ["", "| Diagnostics | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|" + "---|" * len(runs)] + diag
    if any(r.get("run_diagnostics") for r in runs):
        lines += ["", behaviour_table(runs), rankings_table(runs)]
    if any(r.get("stage_records") for r in runs):
        lines += ["", stage_times_table(runs)]
    for r in runs:
        if r.get("selection"):
            lines += ["", selection_table(r["selection"])]
    return "\n".join(lines) + "\n"


def behaviour_table(runs: Sequence[dict]) -> str:
    """Markdown: each evaluated policy on the held-out tasks, one value per run: its success rate, % tests passed
    and turns (results.json), its questions and answering episodes (pipeline_diagnostics' behaviour)."""
    seeds = " / ".join(str(r.get("seed")) for r in runs)
    lines = [f"Each policy on the held-out tasks, seed {seeds} (questions and answers: `pipeline_diagnostics`):", "",
             "| policy | success % | % tests passed | turns an episode | questions an episode | "
             "episodes that answer, % |", "|---|" + "---|" * 5]
    for m in [m for m in METHOD_NAMES if any(m in r["methods"] for r in runs)]:
        cells = []
        for source, key, fmt in (("methods", "success_rate_pct", "{:.1f}"), ("methods", "tests_passed_pct", "{:.1f}"),
                                 ("methods", "turns_per_episode", "{:.1f}"),
                                 ("behaviour", "questions_per_episode", "{:.2f}"),
                                 ("behaviour", "episodes_with_answer_pct", "{:.1f}")):
            values = []
            for r in runs:
                record = (r["methods"].get(m) if source == "methods"
                          else r.get("run_diagnostics", {}).get("behaviour", {}).get(f"eval {m}")) or {}
                values.append("n/a" if record.get(key) is None else fmt.format(record[key]))
            cells.append(" / ".join(values))
        lines.append(f"| {METHOD_NAMES[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


RANKING_NAMES = {"rank": "SWEET-RL (with c)", "rank_no_info": "SWEET-RL w/o c",
                 "rank_balanced": "with c, turn prompts balanced by state", "rank_oracle": "the oracle (control)"}
# The pair kinds whose count and errors the rankings table shows (pipeline_diagnostics' by_kind keys).
RANKING_KINDS = ("question over answer", "answer over question", "all values known: question over answer",
                 "all values known: answer over question")


def _kind_cell(by_kind: dict, kind: str) -> str:
    """'decided (wrong)' of one pair kind; diagnostics files written before ties and states were counted hold
    [agree, decided] per kind and no states."""
    counts = by_kind.get(kind)
    if isinstance(counts, list):
        agree, decided = counts
        return f"{decided} ({decided - agree})"
    if counts is None and any(isinstance(c, list) for c in by_kind.values()):
        return "n/a"
    counts = counts or {}
    return f"{counts.get('agree', 0) + counts.get('disagree', 0)} ({counts.get('disagree', 0)})"


def rankings_table(runs: Sequence[dict]) -> str:
    """Markdown: each step-level ranking of each run against the synthetic oracle (pipeline_diagnostics): its
    decided pairs, their agreement, and the pairs that choose a question over an answer or the reverse, overall and
    where every hidden value is known, each with how many of them the oracle calls wrong."""
    def round_of(name: str) -> int:   # iterative rounds' rankings (rank_round<r>) after the others, in order
        return int(name[len("rank_round"):]) if name.startswith("rank_round") else 0

    names = []
    for r in runs:
        names += [n for n in r.get("run_diagnostics", {}).get("rankings", {}) if n not in names]
    names.sort(key=round_of)
    lines = ["Step-level rankings against the synthetic oracle (Q > A: a question chosen over an answer; in brackets "
             "the pairs the oracle calls wrong; all known: states where every hidden value has been stated):", "",
             "| ranking | seed | decided pairs | oracle agreement (%) | Q > A | A > Q | all known: Q > A | "
             "all known: A > Q |", "|---|" + "---|" * 7]
    for name in names:
        label = RANKING_NAMES.get(name) or f"iterative round {round_of(name)} (with c)"
        for r in runs:
            ranking = r.get("run_diagnostics", {}).get("rankings", {}).get(name)
            if ranking is None:
                continue
            cells = [_kind_cell(ranking.get("by_kind", {}), kind) for kind in RANKING_KINDS]
            agreement = "n/a" if ranking.get("agreement_pct") is None else f"{ranking['agreement_pct']:.1f}"
            lines.append(f"| {label} | {r.get('seed')} | {ranking['decided']} | {agreement} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def stage_group(directory: str) -> str:
    """The row a stage's time counts in: its top directory, per method for the policies, their validation and
    evaluation ('policies/sweet/lr1e-05' -> 'policies/sweet'), per round for iterative SWEET-RL."""
    parts = directory.split("/")
    return "/".join(parts[:2]) if parts[0] in ("policies", "valid", "eval", "rounds") and len(parts) > 1 else parts[0]


def stage_times_table(runs: Sequence[dict]) -> str:
    """Markdown: wall-clock and CPU minutes of each group of stages, per run (from the stage records a run keeps),
    summed over the invocations that ran them; the CPU minutes divided by the cores are the idle machine's time."""
    times = []
    for r in runs:
        groups: dict[str, list[float]] = {}
        for directory, record in r.get("stage_records", {}).items():
            wall_cpu = groups.setdefault(stage_group(directory), [0.0, 0.0])
            wall_cpu[0] += record.get("seconds", 0.0) / 60.0
            wall_cpu[1] += (record.get("cpu_seconds") or 0.0) / 60.0
        times.append(groups)
    order = []
    for groups in times:
        order += [g for g in groups if g not in order]
    lines = ["Stage times, minutes (wall / CPU):", "",
             "| stages | " + " | ".join(f"seed {r.get('seed')}" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for g in order + ["all"]:
        cells = []
        for groups in times:
            wall_cpu = ([sum(v[0] for v in groups.values()), sum(v[1] for v in groups.values())] if g == "all"
                        else groups.get(g))
            cells.append("" if not wall_cpu else f"{wall_cpu[0]:.0f} / {wall_cpu[1]:.0f}")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def selection_table(selection: dict) -> str:
    """Markdown: each method's validation success rate (%) at every (learning rate, steps) of the grid, the
    choice in bold (pipeline.write_selection's record); iterative rounds in a row of their own."""
    cells = sorted({key for m in selection["methods"].values() for key in m["curve"] if "/" in key},
                   key=lambda k: (float(k.split("/")[0]), int(k.split("/")[1])))
    head = [f"lr {k.split('/')[0]}, {k.split('/')[1]} steps" for k in cells]
    zero = selection.get("zero_shot")
    start = f"; the starting policy: {100 * zero['success_rate']:.1f}" if zero else ""
    lines = [f"Validation success rate (%), seed {selection.get('seed')}: {selection.get('validation_tasks')} tasks x "
             f"{selection.get('episodes_per_task')} episodes{start}; bold = chosen.", "",
             "| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for m, record in selection["methods"].items():
        choice = record["choice"]
        if "round" in choice:
            rounds = " · ".join(("**{:.1f}**" if int(k) == choice["round"] else "{:.1f}").format(
                100 * v["success_rate"]) + f" (round {k})" for k, v in sorted(record["curve"].items()))
            lines.append(f"| {METHOD_NAMES.get(m, m)} | {rounds} |" + " |" * (len(head) - 1))
            continue
        row = []
        for k in cells:
            v = record["curve"].get(k)
            text = "" if v is None else f"{100 * v['success_rate']:.1f}"
            row.append(f"**{text}**" if v is not None and (v["lr"], v["step"]) == (choice["lr"], choice["step"])
                       else text)
        lines.append(f"| {METHOD_NAMES.get(m, m)} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


DIAGNOSTICS = (
    ("offline_success_pct", "offline trajectories: success rate of the starting policy (%)"),
    ("offline_tests_passed_pct", "offline trajectories: % tests passed"),
    ("critic_pairs", "critic (trajectory) pairs"),
    ("critic_heldout_pairs", "critic: held-out pairs (what its accuracy counts)"),
    ("critic_heldout_accuracy", "critic with c: held-out pair accuracy"),
    ("critic_no_info_heldout_accuracy", "critic without c: held-out pair accuracy"),
    ("policy_pairs", "step-level policy pairs (with c)"),
    ("policy_pairs_no_info", "step-level policy pairs (without c)"),
    ("policy_pairs_balanced", "step-level policy pairs (with c, prompts balanced by state)"),
    ("policy_pairs_oracle", "step-level policy pairs ranked by the oracle (control)"),
    ("pair_agreement", "ranking with c vs without c: same chosen side (%)"),
    ("pair_oracle_agreement", "pairs with c whose chosen reply is truly better (%, synthetic oracle)"),
    ("pair_oracle_agreement_no_info", "pairs without c whose chosen reply is truly better (%)"),
    ("pair_oracle_agreement_balanced", "pairs on prompts balanced by state whose chosen reply is truly better (%)"),
    ("minutes", "wall-clock minutes of all stages"),
    ("cpu_minutes", "CPU minutes of all stages (this process)"),
    ("load_average", "mean 1-min load average at the stages' starts and ends"),
    ("init_reused_from", "starting policy copied from"),
)


def _diagnostics(runs: Sequence[dict]) -> list[str]:
    rows, rows_of = [], list(DIAGNOSTICS)
    prefix = "pair_oracle_agreement_round"  # iterative rounds' rankings, after the other rankings' rows
    rounds = sorted({int(k[len(prefix):]) for r in runs for k in r.get("diagnostics", {}) if k.startswith(prefix)})
    at = [key for key, _ in rows_of].index("pair_oracle_agreement_balanced") + 1
    rows_of[at:at] = [(f"{prefix}{r}", f"iterative round {r}: pairs with c whose chosen reply is truly better (%)")
                      for r in rounds]
    for key, name in rows_of:
        values = [r.get("diagnostics", {}).get(key) for r in runs]
        if all(v is None for v in values):
            continue
        cells = ["n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else
                                          pathlib.Path(v).name if isinstance(v, str) else str(v)) for v in values]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def bar_chart(runs: Sequence[dict], png_path, *, title: str = "") -> pathlib.Path:
    """Grouped bars: % tests passed and success rate per method (error bars = std over runs)."""
    plt = lazy.pyplot()
    methods = [m for m in METHOD_NAMES if any(m in r["methods"] for r in runs)]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(methods)), 4.0))
    width = 0.38
    x = np.arange(len(methods))
    for k, (key, name) in enumerate(metrics_of(runs)):
        values = [[r["methods"][m][key] for r in runs if r["methods"].get(m, {}).get(key) is not None] for m in methods]
        means = [float(np.mean(v)) if v else 0.0 for v in values]
        errs = [float(np.std(v)) if len(v) > 1 else 0.0 for v in values]
        bars = ax.bar(x + (k - 0.5) * width, means, width, yerr=errs if len(runs) > 1 else None, capsize=3,
                      label=name)
        for b, v in zip(bars, means):
            ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([METHOD_NAMES[m].replace(" w/o ", "\nw/o ") for m in methods], fontsize=8)
    ax.set_ylabel("held-out tasks (%)")
    ax.set_ylim(0, max(5.0, ax.get_ylim()[1] * 1.1))
    ax.legend(fontsize=8)
    ax.set_title(title or f"{runs[0].get('task', '')} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    fig.tight_layout()
    png_path = pathlib.Path(png_path)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def check_report_out(out_dir, workdirs: Sequence) -> pathlib.Path:
    """The directory a report over `workdirs` may be written to: a new (or empty) one, never a run's own directory
    (its results.md and results.png are the run's report) nor a report written before. A ReportError otherwise."""
    out = pathlib.Path(out_dir)
    runs = {pathlib.Path(w).resolve() for w in workdirs}
    if out.resolve() in runs or (out.resolve() / "results.json").exists():
        raise ReportError(f"--out {out_dir}: is a run's own directory; its results.md and results.png are that run's "
                          "report: pass a new directory")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink() or any(out.iterdir()):
            raise ReportError(f"--out {out_dir}: already exists; pass a new directory (or remove it first)")
    return out


def write_report(runs: Sequence[dict], out_dir, *, title: str = "") -> tuple[pathlib.Path, pathlib.Path]:
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(results_table(runs, title=title))
    png = bar_chart(runs, out_dir / "results.png", title=title)
    return md, png
