"""The training splits of a config, as one host holds them: which examples each loss kind trains on (critic and
multi-turn DPO: trajectory pairs; RFT: successful trajectories; step-level DPO: rank's policy pairs), the
held-out split (by task, or the official first rows), and this host's slice, rendered.

    train_set, eval_set = build_datasets(config, tokenizer, process_index=i, process_count=n)
    train_set.gather_lengths()                                # every host's lengths: the same batches anywhere
    train_set = train_set.with_extras(ref_logp=refs)          # reference log-probs, before the batches exist
    for batch in train_set.batches(config, pad_id=pad_id(tokenizer)): ...

Every host lists the same examples (cheap: no tokenizer) and renders only its rows (data.batching.host_range).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
from etils import epath

from sweet_jax import jsonl
from sweet_jax.data import batching, loading, pairs as pairs_lib, render, schema
from sweet_jax.data.demo import paths as demo_paths
from sweet_jax.data.schema import PolicyPair, Turn
from sweet_jax.errors import TrainConfigError


@dataclasses.dataclass
class Dataset:
    """One split as this host holds it. Every host lists the split's examples the same way (critic pairs from
    the rewards, successful trajectories, ranked pairs: no tokenizer, cheap), then renders only its slice:
    `examples` (tuples of P data.render.Rendered), `ids` their positions in the global list (the length
    policy may have dropped some), `num_global` the list's length. `lengths` = (ids, lengths) of every
    host's examples (gather_lengths), `extras` per-token arrays added later (the reference pass's ref_logp)."""
    examples: list
    ids: list[int]
    num_global: int
    tasks: int
    num_sequences: int
    extras: dict = dataclasses.field(default_factory=dict)
    lengths: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def with_extras(self, **extras) -> "Dataset":
        """This split with per-token arrays attached (e.g. ref_logp: one tuple of [L] arrays per example)."""
        return dataclasses.replace(self, extras={**self.extras, **extras})

    @property
    def num_examples(self) -> int:
        """Examples over all hosts (after gather_lengths)."""
        return len(self.lengths[0])

    def gather_lengths(self) -> None:
        self.lengths = batching.gather_lengths(np.asarray(self.ids),
                                               batching.example_lengths(self.examples, scored=True))

    def batches(self, config, *, pad_id: int, process_index: int = 0, process_count: int = 1, **kwargs):
        """A data.batching.BatchIterator over this split (its position goes into the checkpoint)."""
        kwargs.setdefault("score_positions", bool(config.loss.get("score_positions", False)))
        return batching.BatchIterator(
            self.examples, batch_size=config.train.batch_size, seed=config.train.seed, pad_id=pad_id,
            padding_side=config.data.padding_side, max_len=config.data.max_len, bucket_size=config.data.bucket,
            process_index=process_index, process_count=process_count, example_ids=self.ids,
            num_global=self.num_global, global_lengths=self.lengths, extras=self.extras,
            num_sequences=self.num_sequences, **kwargs)


def split_by_task(keys: list[str], eval_fraction: float, seed: int) -> set[str]:
    """The held-out task keys: a seeded eval_fraction of the distinct tasks (at least one when > 0)."""
    distinct = sorted(set(keys))
    if eval_fraction <= 0 or len(distinct) < 2:
        return set()
    n_eval = min(len(distinct) - 1, max(1, round(eval_fraction * len(distinct))))
    picked = np.random.default_rng(seed).choice(len(distinct), size=n_eval, replace=False)
    return {distinct[i] for i in picked}


def first_rows(num_rows: int, eval_fraction: float) -> int:
    """data.eval_split='first_rows' (the official trainer's split when the data has no test split): the first
    int(eval_fraction * rows) rows are evaluated on, and every row, those included, is trained on."""
    return int(num_rows * eval_fraction)


def _read_jsonl(path: str, what: str, field: str) -> list[dict]:
    if not epath.Path(path).exists():
        raise TrainConfigError(f"config.{field}={path!r} does not exist: set --config.{field} to the {what} JSONL")
    rows = jsonl.read(path)
    if not rows:
        raise TrainConfigError(f"config.{field}={path!r} has no rows: point --config.{field} at a non-empty {what} JSONL")
    return rows


def build_datasets(config, tokenizer, *, process_index: int = 0, process_count: int = 1) -> tuple[Dataset, Dataset]:
    """(train, eval) examples for config.loss.kind, this host's slice of each (process_index of
    process_count row slices of the global batch); eval = the examples of a held-out set of tasks."""

    kind = config.loss.kind
    options = pairs_lib.RenderOptions(
        max_len=config.data.max_len, overflow=config.data.length_policy,
        info_template=config.data.info_template, info_placement=config.data.info_placement,
        mask_style=config.data.get("mask_style", "turns"))
    mine = lambda n: batching.host_range(n, config.train.batch_size, process_index, process_count)  # noqa: E731
    if kind == "dpo":
        return _policy_pair_datasets(config, tokenizer, options, mine)

    path = config.data.trajectories or str(demo_paths().trajectories)
    if not config.data.trajectories and not pathlib.Path(path).exists():
        raise TrainConfigError(f"the bundled demo trajectories ({path}) are missing; set --config.data.trajectories")
    local = not str(path).startswith("tfds://")
    try:  # a directory, a gzip/binary file or a non-UTF-8 one is named here, before anything reads it as text
        if local:
            jsonl.check_file(path)
        empty = local and not any(True for _ in jsonl.lines(path))
    except jsonl.DataError as e:
        raise TrainConfigError(f"config.data.trajectories={path!r}: {e}; point --config.data.trajectories "
                               "at a ColBench trajectories JSONL (plain text)") from None
    if empty:
        raise TrainConfigError(f"config.data.trajectories={path!r} has no rows: point --config.data.trajectories "
                               "at a non-empty ColBench trajectories JSONL")
    try:
        trajectories = loading.load_trajectories(path)
    except schema.DataError as e:
        raise TrainConfigError(f"config.data.trajectories={path!r}: {e}") from None
    if not trajectories:
        raise TrainConfigError(f"config.data.trajectories={path!r} has no rows: point it at a non-empty "
                               "ColBench trajectories JSONL")
    def listing(trajs):  # critic / mtdpo: trajectory pairs; rft: the successful trajectories
        if kind in ("critic", "mtdpo"):
            return pairs_lib.trajectory_pairs(trajs, rule=config.data.get("pair_rule", "best_success"),
                                              min_gap=config.data.min_gap)
        return pairs_lib.rft_examples(trajs)

    if config.data.get("eval_split", "tasks") == "first_rows":
        everything = listing(trajectories)
        lists = (everything, everything[:first_rows(len(everything), config.data.eval_fraction)])
    else:
        eval_keys = split_by_task([t.task.key for t in trajectories], config.data.eval_fraction, config.train.seed)
        lists = (listing([t for t in trajectories if t.task.key not in eval_keys]),
                 listing([t for t in trajectories if t.task.key in eval_keys]))
    out = []
    for listed in lists:
        tasks = len({x.task_key if kind != "rft" else x.task.key for x in listed})
        if kind in ("critic", "mtdpo"):
            part = mine(len(listed))
            examples, _ = pairs_lib.pair_examples(tokenizer, listed[part.start:part.stop],
                                                  with_info=kind == "critic" and config.loss.use_info,
                                                  options=options, progress=len(part) > 200)
        else:  # rft: SFT on the successful trajectories
            part = mine(len(listed))
            examples, _ = pairs_lib.sft_examples(tokenizer, listed[part.start:part.stop], options=options,
                                                 progress=len(part) > 200)
        out.append(Dataset(list(examples), [part.start + i for i in examples.indices], len(listed), tasks,
                           1 if kind == "rft" else 2))
    if not out[0].num_global:
        what = "pairs (a task needs a trajectory with reward 1.0 and one with a lower reward)" \
            if kind != "rft" else "successful trajectories (reward 1.0)"
        raise TrainConfigError(f"config.data.trajectories={path!r}: {len(trajectories)} trajectories give no training "
                               f"{what}; use scored trajectories with successes and failures per task")
    return out[0], out[1]


def _policy_pair_datasets(config, tokenizer, options, mine) -> tuple[Dataset, Dataset]:
    """Step-level pairs written by `python -m sweet_jax.rank`: the prompt the candidates were sampled from,
    then the chosen / rejected reply (turn id 1) and its end-of-turn token."""

    if not config.data.pairs:
        raise TrainConfigError("config.data.pairs is empty: loss.kind=dpo trains on the pairs JSONL written by "
                               "`python -m sweet_jax.rank`; set --config.data.pairs=PATH (or use loss.kind=mtdpo/rft)")
    records = _read_jsonl(config.data.pairs, "ranked policy pairs", "data.pairs")
    # Each line with its file:line: a PolicyPair record (sweet_jax.rank's output, checked field by field) or an
    # official pairs row (whole templated chosen / rejected strings).
    parsed = [_policy_pair_row(r, f"{config.data.pairs}:{n}") for n, r in enumerate(records, start=1)]
    keys = [str(r.get("task_key", r.get("trajectory_index", n))) for n, r in enumerate(records)]
    if config.data.get("eval_split", "tasks") == "first_rows":
        n_eval = first_rows(len(records), config.data.eval_fraction)
        splits, eval_keys = (parsed, parsed[:n_eval]), set(keys[:n_eval])
    else:
        eval_keys = split_by_task(keys, config.data.eval_fraction, config.train.seed)
        splits = tuple([r for key, r in zip(keys, parsed) if (key in eval_keys) == held_out]
                       for held_out in (False, True))
    stats = render.LengthStats()
    out = []
    for held_out, listed in zip((False, True), splits):
        part = mine(len(listed))
        examples, ids = [], []
        for i in part:
            where, r = listed[i]
            if not isinstance(r, PolicyPair):
                seqs = pairs_lib.official_pair_sequences(tokenizer, r, where=where)
            elif r.has_sampled_ids:  # the sampled token ids, not their text tokenised again
                seqs = pairs_lib.sampled_pair_sequences(tokenizer, r, where=where)
            else:
                seqs = tuple(render.render_prerendered(tokenizer, (Turn("assistant", reply, r.prompt_text, reply),),
                                                       label="last") for reply in (r.chosen, r.rejected))
            fitted = render.fit_all(seqs, options.max_len, overflow=options.overflow, stats=stats)
            if fitted is not None:
                examples.append(fitted)
                ids.append(i)
        tasks = len({k for k in keys if (k in eval_keys) == held_out or (listed is parsed)})
        out.append(Dataset(examples, ids, len(listed), tasks, 2))
    stats.log("policy pairs", options.max_len)
    return out[0], out[1]


def _policy_pair_row(row: dict, where: str):
    """(where, record): an official pairs row as it is, any other line as a checked PolicyPair."""
    if pairs_lib.is_official_pair_row(row):
        return where, row
    try:
        return where, PolicyPair.from_json(row, where=where)
    except jsonl.DataError as e:
        raise TrainConfigError(f"{e}; the file must come from `python -m sweet_jax.rank`, or be an official pairs "
                               "file (chosen and rejected strings)") from None
