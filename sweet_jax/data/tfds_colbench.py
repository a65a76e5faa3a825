"""TFDS dataset `colbench`, built from the Hugging Face files (facebook/collaborative_agent_bench) given as the
manual directory, and the `tfds://` reader used by load_tasks / load_trajectories.

Manual directory layout (as `huggingface-cli download facebook/collaborative_agent_bench ...` writes it):

    <manual_dir>/backend_tasks/train.jsonl                   -> colbench/backend_tasks, split train
    <manual_dir>/backend_tasks/test.jsonl                    -> colbench/backend_tasks, split test
    <manual_dir>/colbench_code_offline_15k_llama8b.jsonl     -> colbench/offline_trajectories, split train

Missing task splits are skipped (at least one is needed). Every row is validated while building (a bad row
stops the build with file:line and field). Each example stores the row's JSON text and its line number, so
reading back gives exactly the JSONL loader's records, in file order.

Reading: load_trajectories("tfds://colbench/offline_trajectories/train?data_dir=DIR&manual_dir=MDIR")
(data_dir defaults to $TFDS_DATA_DIR / ~/tensorflow_datasets; with manual_dir the dataset is prepared first
if needed). Importing this module imports tensorflow_datasets (slow); the rest of sweet_jax.data does not.
"""
from __future__ import annotations

import json
import os
import pathlib
import urllib.parse
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from sweet_jax.data.schema import DataError, Task, Trajectory

TASK_FILES = {"train": "backend_tasks/train.jsonl", "test": "backend_tasks/test.jsonl"}
OFFLINE_FILE = "colbench_code_offline_15k_llama8b.jsonl"


class Colbench(tfds.core.GeneratorBasedBuilder):
    """ColBench backend programming: tasks and offline trajectories."""

    name = "colbench"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Backend tasks and offline trajectories, rows stored as JSON text."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="backend_tasks", description="Backend programming tasks (train/test)."),
        tfds.core.BuilderConfig(name="offline_trajectories",
                                description="Offline Llama-3.1-8B trajectories with rewards (train)."),
    ]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Download the files with `huggingface-cli download facebook/collaborative_agent_bench "
        f"{TASK_FILES['train']} {TASK_FILES['test']} {OFFLINE_FILE} --repo-type dataset --local-dir DIR` "
        "and pass DIR as the manual directory.")

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        # tfds finds a builder's files through its package, which needs the optional importlib_resources
        # backport; this module's own path is what that lookup returns anyway.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        features = {"line": tfds.features.Scalar(dtype=np.int64), "json": tfds.features.Text(),
                    "problem_description": tfds.features.Text()}
        if self.builder_config.name == "offline_trajectories":
            features["reward"] = tfds.features.Scalar(dtype=np.float32)  # NaN when not yet evaluated
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(features),
            homepage="https://huggingface.co/datasets/facebook/collaborative_agent_bench")

    def _split_generators(self, dl_manager):
        manual = pathlib.Path(os.fspath(dl_manager.manual_dir))
        if self.builder_config.name == "backend_tasks":
            splits = {s: manual / f for s, f in TASK_FILES.items() if (manual / f).exists()}
            if not splits:
                raise DataError(f"no task files under {manual}: expected {' or '.join(TASK_FILES.values())}")
        else:
            path = manual / OFFLINE_FILE
            if not path.exists():
                raise DataError(f"{path} not found; the manual directory must hold {OFFLINE_FILE}")
            splits = {"train": path}
        return {s: self._generate_examples(p) for s, p in splits.items()}

    def _generate_examples(self, path):
        trajectories = self.builder_config.name == "offline_trajectories"
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"malformed JSON ({e.msg} at column {e.colno})", where=where) from None
                if trajectories:
                    record = Trajectory.from_json(obj, where=where)
                    ex = {"problem_description": record.task.problem_description,
                          "reward": float("nan") if record.reward is None else record.reward}
                else:
                    ex = {"problem_description": Task.from_json(obj, where=where).problem_description}
                yield lineno, {"line": lineno, "json": line.strip(), **ex}


def parse_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    """'tfds://colbench/<config>[/<split>][?data_dir=..&manual_dir=..]' -> (name/config, split, options)."""
    parsed = urllib.parse.urlparse(uri)
    parts = [p for p in (parsed.netloc + parsed.path).split("/") if p]
    if len(parts) not in (2, 3) or parts[0] != "colbench":
        raise DataError(f"bad TFDS path {uri!r}: use tfds://colbench/<backend_tasks|offline_trajectories>[/<split>]")
    options = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
    return "/".join(parts[:2]), parts[2] if len(parts) == 3 else "train", options


def builder(name: str = "colbench/offline_trajectories", *, data_dir=None, manual_dir=None) -> Colbench:
    """The builder, prepared from manual_dir when given and not yet built."""
    b = tfds.builder(name, data_dir=os.fspath(data_dir) if data_dir else None)
    if manual_dir is not None or not b.is_prepared():
        if manual_dir is None:
            raise DataError(f"TFDS dataset {name} is not prepared under {b.data_dir}; pass manual_dir (the folder "
                            "with the downloaded Hugging Face files) to build it")
        b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir)))
    return b


def read_json_lines(uri: str) -> Iterator[tuple[str, str]]:
    """(where, JSON text) of every example of a split, in the source file's line order."""
    name, split, options = parse_uri(uri)
    b = builder(name, data_dir=options.get("data_dir"), manual_dir=options.get("manual_dir"))
    rows = [(int(ex["line"]), ex["json"].decode("utf-8"))
            for ex in tfds.as_numpy(b.as_dataset(split=split, shuffle_files=False))]
    rows.sort()
    base = uri.split("?", 1)[0]
    for line, text in rows:
        yield f"{base}:{line}", text
