"""ColBench data: records, chat rendering with per-turn token ids, training pairs, batching, demo assets.

    tasks = load_tasks("backend_tasks/test.jsonl")
    trajs = load_trajectories("colbench_code_offline_15k_llama8b.jsonl")   # or "tfds://colbench/..."
    tok = load_tokenizer(demo_paths().tokenizer)
    examples, stats = pair_examples(tok, critic_pairs(trajs), with_info=True, options=RenderOptions(max_len=8192))
    for batch in batching.BatchIterator(examples, batch_size=8, max_len=8192, pad_id=pad_id(tok), num_epochs=4): ...

Several hosts: each renders only host_range(len(pairs), batch_size, jax.process_index(), jax.process_count())
of the pair list and passes example_ids / num_global to BatchIterator (see data/batching.py).

The TFDS builder lives in sweet_jax.data.tfds_colbench (data.loading imports it on demand: it pulls in TensorFlow).
Batching (sweet_jax.data.batching, which needs jax) is imported from its module, not from here: the configs import
this package and load without jax (a command's --help answers in a second).
"""
from sweet_jax.data.demo import DemoPaths, paths as demo_paths
from sweet_jax.data.loading import Loaded, load_records, load_tasks, load_trajectories, write_jsonl
from sweet_jax.data.pairs import (Examples, PairPick, PolicyPairs, RenderOptions, TrajectoryPair, critic_pairs,
                                  group_by_task, mtdpo_pairs, pair_examples, policy_pairs, rft_examples, sft_examples)
from sweet_jax.data.render import (INFO_PLACEMENTS, LengthStats, OFFICIAL_INFO_TEMPLATE, RenderError, Rendered,
                                   fit_all, fit_length, info_text, render_dialogue, render_prerendered, render_prompt,
                                   render_trajectory, reply_from_tokens)
from sweet_jax.data.schema import CandidatesRecord, DataError, PolicyPair, Task, Trajectory, Turn
from sweet_jax.data.tokenizers import (LLAMA2_CHAT_TEMPLATE, LLAMA31_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE,
                                       TokenizerError, build_llama2_tokenizer, build_llama3_tokenizer, end_of_turn_ids,
                                       load_tokenizer, pad_id)

__all__ = [name for name in dir() if not name.startswith("_")]
