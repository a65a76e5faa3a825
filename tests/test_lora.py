"""LoRA (models/lora.py): fresh adapters are the base model, merging gives the adapted model's logits, the
merged export and the PEFT adapter load in transformers / peft with the same logits, and the trainer trains
only the adapters (the demo critic's held-out accuracy rises), resumes bit-exactly and exports."""
from __future__ import annotations

import json
import pathlib
import signal

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

import tiny
from sweet_jax.models import Llama, LlamaConfig, load_hf, lora, save_hf
from test_train import demo_config, ranked_pairs, small_trajectories

IDS = np.arange(2 * 12).reshape(2, 12) * 7 % 256


def randomised(model: Llama, seed: int = 0) -> Llama:
    """The model with its adapters (A and B) drawn at random, so that they change what it computes."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS, dtype=torch.long)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_fresh_adapters_are_the_base_and_merging_gives_the_adapted_logits(scan_layers):
    model = Llama(LlamaConfig.preset("tiny", scan_layers=scan_layers), rngs=nnx.Rngs(0))
    base_logits = np.asarray(model(IDS))
    lora.add_adapters(model, lora.LoRAConfig(rank=4, alpha=8.0), seed=1)
    np.testing.assert_array_equal(np.asarray(model(IDS)), base_logits)  # B starts at zero

    model = randomised(model)
    adapted = np.asarray(model(IDS))
    assert np.abs(adapted - base_logits).max() > 0.1
    merged = lora.merge(model)
    assert lora.has_adapters(model) and not lora.has_adapters(merged)
    np.testing.assert_allclose(np.asarray(merged(IDS)), adapted, atol=1e-5, rtol=1e-5)

    # The reference model of a LoRA run: the same graph with the adapters zeroed is the base, bit for bit.
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, lora.adapters_off(adapters), rest)(IDS)),
                                  base_logits)


def test_merged_kernels_are_w_plus_alpha_over_rank_a_b():
    config = LlamaConfig.preset("tiny")
    model = randomised(lora.add_adapters(Llama(config, rngs=nnx.Rngs(0)), lora.LoRAConfig(rank=2, alpha=6.0,
                                                                                         targets=("q", "o"))))
    attn = model.layers[1].attn
    D, N, H = config.hidden_size, config.num_heads, config.head_dim
    q_a, q_b, o_a, o_b = (np.asarray(v[...], np.float64) for v in (attn.q_proj.lora_a, attn.q_proj.lora_b,
                                                                   attn.o_proj.lora_a, attn.o_proj.lora_b))
    assert q_a.shape == (D, 2) and q_b.shape == (2, N, H) and o_a.shape == (N, H, 2) and o_b.shape == (2, D)
    want_q = np.asarray(attn.q_proj.kernel[...]) + 3.0 * (q_a @ q_b.reshape(2, N * H)).reshape(D, N, H)
    want_o = np.asarray(attn.o_proj.kernel[...]) + 3.0 * (o_a.reshape(N * H, 2) @ o_b).reshape(N, H, D)
    merged = lora.merge(model).layers[1].attn
    np.testing.assert_allclose(np.asarray(merged.q_proj.kernel[...]), want_q, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged.o_proj.kernel[...]), want_o, atol=1e-6)
    assert model.layers[1].mlp.gate_proj.lora_a is None  # not a target


def test_merged_export_and_peft_adapter_load_in_transformers_with_the_adapted_logits(tmp_path):
    base_dir = tiny.make_hf_llama(tmp_path / "base", "llama31", seed=3)
    config = lora.LoRAConfig(rank=4, alpha=8.0)
    model = randomised(lora.add_adapters(load_hf(base_dir), config, seed=0))
    ours = np.asarray(model(IDS))

    save_hf(lora.merge(model), tmp_path / "merged")
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(merged), ours, atol=1e-4, rtol=1e-4)

    adapter_dir = lora.save_peft(model, config, tmp_path / "adapter", base_model=str(base_dir))
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and len(saved["target_modules"]) == 7
    with_adapter = peft.PeftModel.from_pretrained(tiny.load_torch(base_dir), adapter_dir).eval()
    np.testing.assert_allclose(torch_logits(with_adapter), ours, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# Through the trainer (8 fake devices: FSDP over the adapters and the frozen base)
# ----------------------------------------------------------------------------------------------------------

STEPS = 8


def lora_critic_config(**overrides):
    """The demo_lora critic at 256 tokens, 8 steps."""
    return demo_config(file="critic.py", preset="demo_lora", data__max_len=256, data__bucket=256,
                       train__num_steps=STEPS, train__ckpt_every=2, train__eval_every=STEPS, **overrides)


def records(workdir, split):
    return [r for r in map(json.loads, (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())
            if r["split"] == split]


@pytest.fixture(scope="module")
def straight_lora_run(tmp_path_factory):
    """10 demo tasks, 3 of them held out."""
    from sweet_jax.train import trainer
    tmp = tmp_path_factory.mktemp("lora_straight")
    data = small_trajectories(tmp / "trajectories.jsonl", num_tasks=10)
    trainer.run(lora_critic_config(data__trajectories=str(data), data__eval_fraction=0.3), tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def straight_lora_run_all_data(tmp_path_factory):
    """The bundled demo data: the uninterrupted run the resume test compares with."""
    from sweet_jax.train import trainer
    workdir = tmp_path_factory.mktemp("lora_straight_all") / "run"
    trainer.run(lora_critic_config(), workdir)
    return workdir


@pytest.mark.slow
def test_lora_trains_the_demo_critic_through_the_adapters_only(straight_lora_run):
    from sweet_jax.train import model_loading
    from sweet_jax.models.lora import TARGETS

    evals, trains = records(straight_lora_run, "eval"), records(straight_lora_run, "train")
    assert evals[0]["step"] == 0 and evals[0]["pair_accuracy"] == 0.0  # adapters at zero: every pair ties
    assert evals[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert evals[-1]["step"] == STEPS and evals[-1]["pair_accuracy"] > evals[0]["pair_accuracy"]
    assert trains[-1]["pair_accuracy"] > 0.5 and trains[-1]["loss"] < trains[0]["loss"]

    # The checkpoint holds the adapters alone; the base is the seeded demo model, untouched by training.
    model, step, config = model_loading.restore_model(straight_lora_run)
    assert step == STEPS
    trained = nnx.state(model, nnx.LoRAParam)
    names = {str(path[-2]) + "." + str(path[-1]) for path, _ in nnx.to_flat_state(trained)}
    assert names == {f"{proj}.lora_{ab}" for _, proj in TARGETS.values() for ab in "ab"}
    base = model_loading.build_model(demo_config(file="critic.py", preset="demo"), model.config,
                              model_loading.make_mesh((1, -1, 1)))
    frozen = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.LoRAParam))))
    for path, var in nnx.to_flat_state(nnx.state(base, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(frozen[path][...]), np.asarray(var[...]), err_msg=str(path))


@pytest.mark.slow
def test_lora_run_resumes_bit_exactly(straight_lora_run_all_data, tmp_path, monkeypatch):
    from sweet_jax.train import model_loading, steps, trainer

    real_factory = steps.make_step

    def factory_sigterm_in_step_3(*args, **kwargs):
        step_fn = real_factory(*args, **kwargs)

        def step_with_sigterm(state, batch, *rest):
            if int(state.step) == 2:
                signal.raise_signal(signal.SIGTERM)
            return step_fn(state, batch, *rest)
        return step_with_sigterm

    config = lora_critic_config()
    with monkeypatch.context() as m:
        m.setattr(steps, "make_step", factory_sigterm_in_step_3)
        with pytest.raises(trainer.Preempted):
            trainer.run(config, tmp_path / "run")
    trainer.run(config, tmp_path / "run")  # resumes from step 3's checkpoint

    fields = ("loss", "pair_accuracy", "margin", "grad_norm", "lr")
    resumed, straight = records(tmp_path / "run", "train"), records(straight_lora_run_all_data, "train")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [[r[f] for f in fields] for r in resumed] == [[r[f] for f in fields] for r in straight]
    got, want = (nnx.to_flat_state(nnx.state(model_loading.restore_model(w)[0], nnx.LoRAParam))
                 for w in (tmp_path / "run", straight_lora_run_all_data))
    for (path, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


@pytest.mark.slow
def test_lora_run_exports_merged_weights_that_transformers_loads(straight_lora_run, tmp_path):
    from sweet_jax.train import model_loading
    from sweet_jax.train import export as run_export

    out = run_export.export_run(straight_lora_run, tmp_path / "hf")
    model, _, _ = model_loading.restore_model(straight_lora_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(2, 24))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids.astype(np.int32))), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_lora_policy_starts_at_the_reference_the_frozen_base(tmp_path):
    """DPO through adapters: at step 1 the policy is the base, which is also the reference (no second copy of
    the weights), so the loss is exactly log 2 plus the NLL term."""
    from sweet_jax.train import model_loading, trainer
    from sweet_jax.data.tokenizers import load_tokenizer

    data = small_trajectories(tmp_path / "trajectories.jsonl", num_tasks=4)
    tokenizer = load_tokenizer(model_loading.tokenizer_path(demo_config(file="critic.py", preset="demo")))
    pairs = ranked_pairs(tmp_path / "pairs.jsonl", data, tokenizer)
    config = demo_config(file="policy.py", preset="demo_lora", data__pairs=str(pairs), data__max_len=256,
                         data__bucket=256, train__num_steps=1, train__eval_every=0, data__eval_fraction=0.0)
    trainer.run(config, tmp_path / "policy")
    (row,) = records(tmp_path / "policy", "train")
    assert row["loss"] == pytest.approx(np.log(2) + 0.01 * row["nll"], rel=1e-5)
