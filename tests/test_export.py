"""export: a trained run -> Hugging Face checkpoint that transformers loads with the same logits."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from sweet_jax.train import trainer
from sweet_jax.train import export as run_export
from sweet_jax.train import model_loading
from test_train import env, small_trajectories

REPO = pathlib.Path(__file__).resolve().parents[1]


def demo_config(**overrides):
    spec = importlib.util.spec_from_file_location("critic_config", REPO / "configs" / "critic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("demo")
    for dotted, value in overrides.items():
        section, field = dotted.split("__")
        c[section][field] = value
    return c


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    config = demo_config(data__trajectories=str(small_trajectories(tmp / "traj.jsonl", num_tasks=4)),
                         data__max_len=256, data__bucket=256, train__num_steps=2, train__eval_every=0,
                         data__eval_fraction=0.0, optim__lr=1e-2)
    summary = trainer.run(config, tmp / "run")
    assert summary["steps"] == 2
    return tmp / "run"


@pytest.mark.slow
def test_exported_checkpoint_loads_in_transformers_with_the_trained_logits(trained_run, tmp_path):
    out = run_export.export_run(trained_run, tmp_path / "hf")
    for name in ("config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / name).exists(), name
    model, step, _ = model_loading.restore_model(trained_run)
    assert step == 2
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 24)).astype(np.int32)
    ours = np.asarray(model(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.config.vocab_size


@pytest.mark.slow
def test_export_cli_writes_the_requested_step(trained_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.export", f"--workdir={trained_run}", "--step=2",
                           f"--out={tmp_path / 'hf2'}", "--dtype=bfloat16"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf2" / "config.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert next(hf.parameters()).dtype == torch.bfloat16


@pytest.mark.slow
def test_export_of_a_missing_step_is_a_one_line_error(trained_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.export", f"--workdir={trained_run}", "--step=9",
                           f"--out={tmp_path / 'hf3'}"], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no checkpoint for step 9" in errors[0] and "have [2]" in errors[0]
