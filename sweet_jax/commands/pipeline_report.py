"""The pipeline's results: the paper-style table (markdown), a bar chart (PNG), and their mean over seeds.

    python -m sweet_jax.pipeline_report RUN_SEED0 RUN_SEED1 RUN_SEED2 --out DIR

reads each run's results.json (written by `python -m sweet_jax.pipeline`) and writes DIR/results.md and
DIR/results.png with mean +- standard deviation over the runs. Every file it reads is checked first (a damaged
one: one line naming the file and the field, exit 2); DIR must be new (or empty) and not a run's own directory.
"""
from __future__ import annotations

from sweet_jax import cli
from sweet_jax.commands import launch


def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m sweet_jax.pipeline_report",
                                description="Mean results table and chart over pipeline runs (seeds).")
    parser.add_argument("workdirs", nargs="+", help="pipeline workdirs (each with results.json)")
    parser.add_argument("--out", required=True, help="directory for results.md and results.png")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    from sweet_jax.rl.results import check_report_out, read_results, write_report  # after the flags (--help)
    check_report_out(args.out, args.workdirs)
    runs = [read_results(w) for w in args.workdirs]
    md, png = write_report(runs, args.out, title=args.title)
    print(md.read_text())
    print(f"wrote {md} and {png}")


define_flags = None  # main parses its own argv (cli.ArgumentParser)


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("pipeline_report")
