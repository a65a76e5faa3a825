"""Frontend renderer throughput: full-page screenshots per minute of the bundled demo pages.

    python bench/bench_renderer.py [--pages 48] [--fresh-pages 6] [--renderers 1 2]

Side by side:
  pool N   sweet_jax.envs.browser.RendererPool with N headless Chromium browsers kept alive between pages
           (pages served by the in-process proxy, reset to about:blank after each).
  fresh    a new browser for every page (start, render, quit): what isolating each page by process costs.
The pool's start-up (browsers launching) is timed apart from the steady state.
"""
import argparse
import os
import time

from sweet_jax.data import demo
from sweet_jax.data.frontend import load_frontend_tasks
from sweet_jax.envs.browser import RendererPool


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=48)
    parser.add_argument("--fresh-pages", type=int, default=6)
    parser.add_argument("--renderers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    pages = [t.ground_truth for t in load_frontend_tasks(demo.paths().frontend_tasks)]
    work = [pages[i % len(pages)] for i in range(args.pages)]
    load = os.getloadavg()[0]
    rows = []
    for n in args.renderers:
        start = time.perf_counter()
        pool = RendererPool(n)
        pool.render_many([pages[0]] * n)  # every browser started and warm
        startup = time.perf_counter() - start
        start = time.perf_counter()
        renders = pool.render_many(work)
        seconds = time.perf_counter() - start
        pool.close()
        failed = sum(r.png is None for r in renders)
        rows.append((f"pool {n}", 60 * len(work) / seconds, startup, failed))
    start = time.perf_counter()
    failed = 0
    for page in work[:args.fresh_pages]:
        with RendererPool(1) as pool:
            failed += pool.render(page).png is None
    seconds = time.perf_counter() - start
    rows.append(("fresh", 60 * args.fresh_pages / seconds, float("nan"), failed))
    print(f"{os.cpu_count()} cores, load average {load:.1f} at start; {args.pages} pages per pool "
          f"({len(pages)} demo pages, 1280x800 viewport), {args.fresh_pages} with a fresh browser each")
    print(f"{'renderer':<10} {'pages/min':>10} {'start-up s':>11} {'failed':>7} {'vs fresh':>9}")
    fresh = rows[-1][1]
    for name, rate, startup, failed in rows:
        print(f"{name:<10} {rate:>10.1f} {startup:>11.1f} {failed:>7d} {rate / fresh:>8.1f}x")


if __name__ == "__main__":
    main()
