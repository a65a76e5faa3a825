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
