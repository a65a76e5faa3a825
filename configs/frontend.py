"""ColBench frontend-design track presets (the agent writes HTML; rewards are CLIP cosines of browser screenshots).

Rollouts (`python -m sweet_jax.rollout --config configs/frontend.py:PRESET`), the fields of configs/rollout.py
plus `track` and the `frontend` block:
  rollout_demo   tiny random policy on the six bundled demo pages x 2 samples, the scripted simulator (feedback
                 from the pages' HTML), Chromium renders, a random tiny CLIP (mechanics only); CPU.
  collect_8b     the paper's collection: Llama-3.1-8B-Instruct (--config.policy.path), WebSight-derived tasks
                 (--config.tasks), a vision-language simulator (Qwen2-VL-72B-Instruct behind vLLM:
                 --config.simulator.base_url), CLIP ViT-B/32 from a local HF directory (--config.frontend.clip_path).
  eval_8b        one greedy episode per task, same simulator and CLIP.

The whole comparison (`python -m sweet_jax.pipeline --config configs/frontend.py:PRESET --workdir DIR`), the
fields of configs/pipeline.py plus `track` and `frontend`:
  frontend_demo  CPU: the bundled pages (4 train, 2 held out), a tiny random Llama as starting policy, scripted
                 drafts of mixed fidelity added to the offline set, the scripted simulator, random tiny CLIP.
  frontend_test  frontend_demo with a few steps per stage, SWEET-RL and zero-shot only
                 (tests/test_frontend_pipeline.py).
  frontend_8b    the paper's setting: Llama-3.1-8B-Instruct (--config.init.path), frontend task files
                 (--config.tasks.train_path / heldout_path), the VLM simulator, real CLIP weights
                 (--config.frontend.clip_path), Table 5 hyper-parameters.
"""
import importlib.util
import pathlib

from sweet_jax import config_utils

ROLLOUT_PRESETS = ("rollout_demo", "collect_8b", "eval_8b")
PIPELINE_PRESETS = ("frontend_demo", "frontend_test", "frontend_8b")


def _sibling(name: str):
    """configs/<name>.py as a module (configs/ is loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"_sweet_jax_configs_{name}",
                                                  pathlib.Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frontend_block():
    return config_utils.frontend_config()


def _vision_simulator(c):
    c.simulator.kind = "openai"
    c.simulator.model = "Qwen/Qwen2-VL-72B-Instruct"
    c.simulator.max_tokens = 512      # replies are cut to 1000 characters


def rollout_config(preset: str):
    c = _sibling("rollout").get_config("demo" if preset == "rollout_demo" else preset)
    c.track = "frontend"
    c.frontend = _frontend_block()
    c.tasks = ""                      # frontend tasks JSONL; '' = the bundled demo pages
    c.sandbox.enabled = False         # rewards come from the browser and CLIP
    if preset == "rollout_demo":
        c.sampling.max_new_tokens = 64
        c.max_turns = 3
        c.output = "runs/frontend_rollout_demo/trajectories.jsonl"
    else:
        _vision_simulator(c)
        c.sampling.max_new_tokens = 2048  # a whole page per draft
        c.frontend.renderers = 8
    return c


def pipeline_config(preset: str):
    pipeline = _sibling("pipeline")
    c = pipeline.get_config({"frontend_demo": "demo", "frontend_test": "test", "frontend_8b": "colbench_8b"}[preset])
    c.preset = preset
    c.track = "frontend"
    c.frontend = _frontend_block()
    c.tasks.source = "frontend_files"  # frontend tasks JSONL (train_path / heldout_path); '' = the demo pages
    # rank.info_template stays the pipeline's: c is the ground-truth HTML
    # RFT keeps reward-1.0 trajectories, which CLIP cosines almost never reach: not part of the frontend runs.
    c.methods = "zero_shot,mtdpo,sweet_no_info,sweet"
    c.collect.pair_rule = "all_gaps"   # the official frontend pairs: every two episodes >= min_gap apart
    c.collect.min_gap = 0.1
    if preset in ("frontend_demo", "frontend_test"):
        c.tasks.num_train = 4
        c.tasks.num_heldout = 2
        c.init.kind = "random"         # a tiny random Llama: the demo shows the mechanics, not learning
        c.simulator.kind = "scripted"  # feedback from the two pages' HTML (envs.frontend.ScriptedDesignSimulator)
        c.collect.scripted_per_task = 3  # scripted drafts (exact, no colours, half, empty) give reward gaps
        # The random tiny CLIP puts most pages close together; the official 0.1 leaves too few pairs.
        c.collect.min_gap = 0.02
        c.collect.max_turns = 3
        c.eval.max_turns = 3
        c.train.max_len = 2048          # the critic's c is a whole page of HTML
        c.train.bucket = 512
    if preset == "frontend_test":
        c.methods = "zero_shot,sweet"  # the stages the backend's test covers for the other methods are the same code
        c.collect.best_of = 1
        c.collect.max_new_tokens = 16
        c.rank.max_prompts = 4
        c.train.max_len = 1024         # longer dialogues are cut (length_policy=truncate): enough for the mechanics
        c.train.bucket = 1024          # one shape per stage: one compilation
    if preset == "frontend_8b":
        c.tasks.num_heldout = 100
        _vision_simulator(c)
        c.collect.max_new_tokens = 2048
        c.rank.max_new_tokens = 2048
        c.eval.max_new_tokens = 2048
        c.frontend.renderers = 8
    return c


def get_config(preset: str = "frontend_demo"):
    if preset in ROLLOUT_PRESETS:
        return rollout_config(preset)
    if preset in PIPELINE_PRESETS:
        return pipeline_config(preset)
    raise ValueError(f"unknown frontend preset {preset!r}: rollouts {', '.join(ROLLOUT_PRESETS)}; pipelines "
                     f"{', '.join(PIPELINE_PRESETS)} (as configs/frontend.py:frontend_demo)")
