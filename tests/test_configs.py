"""Training configs: presets carry the paper's settings; every field is overridable from the command line."""
from __future__ import annotations

import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from sweet_jax import cli, config_utils

REPO = pathlib.Path(__file__).resolve().parents[1]


def parse(*argv):
    """Parse like `python -m sweet_jax.train` does, into a private FlagValues (overrides are read from argv)."""
    argv = ["prog", *argv]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def all_fields(c, prefix=""):
    for k, v in c.items():
        if hasattr(v, "items"):
            yield from all_fields(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_critic_presets_have_the_papers_settings():
    demo = parse(f"--config={REPO}/configs/critic.py:demo")
    assert demo.model.path == "" and demo.model.preset == "tiny" and demo.loss.kind == "critic"
    assert demo.loss.use_info and demo.data.trajectories == "" and demo.data.tokenizer == ""
    paper = parse(f"--config={REPO}/configs/critic.py:llama3_8b")
    assert (paper.optim.lr, paper.loss.beta, paper.train.batch_size, paper.train.epochs) == (2e-7, 0.1, 8, 4)
    assert (paper.data.max_len, paper.model.dtype, paper.model.remat, paper.model.preset) == \
        (8192, "bfloat16", "full", "llama3_8b")
    assert (paper.optim.b1, paper.optim.b2, paper.optim.weight_decay, paper.optim.clip) == (0.9, 0.95, 0.0, 1.0)
    assert (paper.optim.warmup_ratio, paper.optim.final_ratio) == (0.03, 0.1)
    assert tuple(paper.mesh.shape) == (1, -1, 1) and paper.loss.advantage_norm == "turn_mean"
    assert not parse(f"--config={REPO}/configs/critic.py:no_info").loss.use_info


@pytest.mark.parametrize("preset,kind,nll", [("llama3_8b", "dpo", 0.01), ("mtdpo", "mtdpo", 0.0), ("rft", "rft", 0.0),
                                             ("demo", "dpo", 0.01), ("demo_mtdpo", "mtdpo", 0.0),
                                             ("demo_rft", "rft", 0.0)])
def test_policy_presets_cover_sweet_and_the_baselines(preset, kind, nll):
    c = parse(f"--config={REPO}/configs/policy.py:{preset}")
    assert c.loss.kind == kind and c.loss.nll_coef == nll and not c.loss.use_info
    if not preset.startswith("demo"):
        assert (c.optim.lr, c.loss.beta, c.train.batch_size, c.train.epochs) == (2e-7, 0.1, 8, 1)


def test_every_field_can_be_overridden_on_the_command_line():
    base = parse(f"--config={REPO}/configs/critic.py:demo")
    new_values = {bool: lambda v: not v, int: lambda v: v + 3, float: lambda v: v * 0.5 + 0.25,
                  str: lambda v: v + "x", tuple: lambda v: (2, -1, 4)}
    argv = []
    expected = {}
    for name, value in all_fields(base):
        new = new_values[type(value)](value)
        expected[name] = new
        argv.append(f"--config.{name}={','.join(map(str, new)) if isinstance(new, tuple) else new}")
    c = parse(f"--config={REPO}/configs/critic.py:demo", *argv)
    for name, value in expected.items():
        assert config_utils.config_get(c, name) == value, name


def test_both_configs_share_one_field_layout():
    names = {n for n, _ in all_fields(config_utils.base_config())}
    for spec in ("critic.py:demo", "critic.py:llama3_8b", "policy.py:demo", "policy.py:rft"):
        assert {n for n, _ in all_fields(parse(f"--config={REPO}/configs/{spec}"))} == names


def test_an_unknown_field_is_named_with_a_suggestion():
    argv = ["prog", "--config=configs/critic.py:demo", "--config.train.num_step=3"]
    msg = cli.config_flag_error(argv, AttributeError("x"))
    assert msg == "unknown config field 'train.num_step' in '--config.train.num_step=3' (did you mean train.num_steps?)"
    msg = cli.config_flag_error(["--config", "configs/policy.py:demo", "--config.optimizer.lr=1"], AttributeError("x"))
    assert "unknown config field 'optimizer.lr'" in msg and "optim" in msg


def test_unknown_preset_says_which_exist():
    with pytest.raises(Exception, match="use one of demo, demo_no_info, llama3_8b, no_info"):
        parse(f"--config={REPO}/configs/critic.py:llama3_9b").lock()


CRITIC_PRESETS = ("demo", "demo_no_info", "llama3_8b", "no_info", "demo_lora")
POLICY_PRESETS = ("demo", "demo_mtdpo", "demo_rft", "demo_official", "demo_lora", "llama3_8b", "mtdpo", "rft", "official")


@pytest.mark.parametrize("spec", [f"critic.py:{p}" for p in CRITIC_PRESETS] + [f"policy.py:{p}" for p in POLICY_PRESETS])
def test_every_training_preset_lies_within_the_numeric_ranges(spec):
    config_utils.check_ranges(parse(f"--config={REPO}/configs/{spec}"), config_utils.TRAIN_RANGES)


@pytest.mark.parametrize("spec, ranges", [(f"rollout.py:{p}", "ROLLOUT_RANGES") for p in
                                          ("demo", "demo_server", "collect_8b", "eval_8b", "official", "official_eval")]
                         + [(f"frontend.py:{p}", "ROLLOUT_RANGES") for p in ("rollout_demo", "collect_8b", "eval_8b")]
                         + [(f"rank.py:{p}", "RANK_RANGES") for p in ("demo", "llama3_8b", "official")]
                         + [(f"pipeline.py:{p}", "PIPELINE_RANGES") for p in
                            ("demo", "test", "colbench_8b", "smollm2", "smollm2_test")]
                         + [(f"frontend.py:{p}", "PIPELINE_RANGES") for p in
                            ("frontend_demo", "frontend_test", "frontend_8b")])
def test_every_rollout_rank_and_pipeline_preset_lies_within_the_numeric_ranges(spec, ranges):
    c = parse(f"--config={REPO}/configs/{spec}")
    config_utils.check_ranges(c, getattr(config_utils, ranges))
    if ranges == "PIPELINE_RANGES":   # and its training stages are valid train configs
        config_utils.check_stages(c)


@pytest.mark.parametrize("field, value, expected", [
    ("train.log_every", 0, "an integer > 0"),            # divided by in the loop
    ("loss.beta", -1.0, "a number > 0"),                 # an inverted critic
    ("loss.beta", 0.0, "a number > 0"),                  # every pair scores the same
    ("train.keep_ckpts", -1, "an integer > 0"),
    ("train.ckpt_every", -5, "an integer >= 0"),
    ("train.eval_every", -1, "an integer >= 0"),
    ("optim.lr", float("nan"), "a number >= 0"),
    ("optim.b2", 1.0, r"a number in \[0, 1\)"),
    ("loss.label_smoothing", 0.5, r"a number in \[0, 0.5\)"),     # every preference flipped as often as kept
    ("data.eval_fraction", 1.0, r"a number in \[0, 1\)"),
    ("data.max_len", 0, r"an integer in \[1, 2147483647\]"),
    ("data.max_len", 2 ** 31, r"an integer in \[1, 2147483647\]"),      # past int32: the device's positions
    ("train.batch_size", 0, "an integer > 0"),
])
def test_a_numeric_training_field_out_of_range_is_one_error_naming_it(field, value, expected):
    c = parse(f"--config={REPO}/configs/critic.py:demo")
    c.unlock()
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(config_utils.TrainConfigError, match=rf"config.{field}=.*must be {expected}.*--config.{field}"):
        config_utils.check_config(c)


def test_an_integer_field_refuses_a_bool_or_a_float():
    c = config_utils.base_config()
    c.train.log_every = True
    with pytest.raises(config_utils.TrainConfigError, match="config.train.log_every=True: must be an integer"):
        config_utils.check_ranges(c, config_utils.TRAIN_RANGES)


@pytest.mark.parametrize("field, value", [("simulator.timeout_s", 0.0), ("sampling.top_p", 2.0),
                                          ("policy.openai.max_retries", -1), ("best_of", 0), ("max_turns", 0)])
def test_a_rollout_field_out_of_range_is_refused_before_anything_starts(field, value):
    from sweet_jax.rl import episodes as rollout
    from sweet_jax.rl.episodes import RolloutError
    c = parse(f"--config={REPO}/configs/rollout.py:demo")
    c.unlock()
    *sections, name = field.split(".")
    node = c
    for s in sections:
        node = node[s]
    node[name] = value
    with pytest.raises(RolloutError, match=rf"config.{field}={value!r}: must be"):
        rollout.run(c)


def test_a_pipeline_field_out_of_range_is_refused_before_any_stage(tmp_path):
    from sweet_jax.pipeline import stages as pipeline
    c = parse(f"--config={REPO}/configs/pipeline.py:test")
    c.unlock()
    c.critic.beta = -1.0
    with pytest.raises(pipeline.PipelineError, match=r"config.critic.beta=-1.0: must be a number > 0"):
        pipeline.run_pipeline(c, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("--config.sweet.advantage_norm=bogus", r"config.sweet.advantage_norm='bogus': use turn_mean"),
    ("--config.critic.lr=-1", r"config.critic.lr=-1.0: must be a number >= 0 .*; set --config.critic.lr$"),
    ("--config.rft.warmup_ratio=1.5", r"config.rft.warmup_ratio=1.5: must be a number in \[0, 1\]"),
    ("--config.mtdpo.num_steps=0 --config.mtdpo.epochs=0", r"config.mtdpo.epochs=0: set epochs > 0 or mtdpo.num_steps > 0"),
    ("--config.train.micro_batch_size=3", r"config.train.micro_batch_size=3: .* divide init.sft.batch_size=8"),
    ("--config.train.ref_logp=bogus", r"config.train.ref_logp='bogus': use precompute or in_step"),
])
def test_a_wrong_training_stage_field_is_refused_before_any_stage_naming_it(tmp_path, override, message):
    """A training stage's section is checked as the train config it makes (config_utils.check_stages) when the
    pipeline starts, not when that stage starts training hours later; the error names the pipeline's field."""
    from sweet_jax.pipeline import stages as pipeline
    c = parse(f"--config={REPO}/configs/pipeline.py:test", *override.split())
    with pytest.raises(pipeline.PipelineError, match=message):
        pipeline.run_pipeline(c, tmp_path / "run")
    assert not (tmp_path / "run").exists()
