"""Paths of the demo assets bundled with the package (sweet_jax/data/demo/).

- tokenizer/: a small Llama-3-style byte-level BPE tokenizer with Llama 3's chat template
  (built by tools/build_demo_tokenizer.py),
- tasks.jsonl: backend tasks in ColBench format, trajectories.jsonl: scored demo trajectories
  (built by the demo-data tools),
- frontend_tasks.jsonl: frontend-design tasks (short pages written for this project; sweet_jax.data.frontend).
"""
from __future__ import annotations

import dataclasses
import pathlib

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "demo"


@dataclasses.dataclass(frozen=True)
class DemoPaths:
    tokenizer: pathlib.Path
    tasks: pathlib.Path
    trajectories: pathlib.Path
    frontend_tasks: pathlib.Path


def paths() -> DemoPaths:
    """Where the bundled demo tokenizer directory, tasks.jsonl and trajectories.jsonl live."""
    return DemoPaths(tokenizer=DEMO_DIR / "tokenizer", tasks=DEMO_DIR / "tasks.jsonl",
                     trajectories=DEMO_DIR / "trajectories.jsonl", frontend_tasks=DEMO_DIR / "frontend_tasks.jsonl")
