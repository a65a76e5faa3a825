"""Policy (actor) training configs: `--config configs/policy.py:PRESET`.

loss.kind picks the algorithm:
  dpo    SWEET-RL's actor: step-level DPO on critic-ranked candidate pairs (data.pairs, the JSONL
         written by `python -m sweet_jax.rank`) with nll_coef times the chosen reply's NLL.
  mtdpo  the multi-turn DPO baseline: trajectory-level DPO on the critic's trajectory pairs (no c).
  rft    the rejection fine-tuning baseline: SFT on the successful trajectories.

Presets: demo, llama3_8b (SWEET-RL actor: lr 2e-7, beta 0.1, nll 0.01, batch 8, 1 epoch), and the
baselines demo_mtdpo, demo_rft, mtdpo, rft. official: llama3_8b as the official trainer runs it (docs/official.md):
reads the official pairs file (chosen / rejected strings) as well as sweet_jax.rank's,
the NLL over the whole chosen sequence (loss.nll_scope=sequence), sequences cut from the right at 16384 tokens;
demo_official: demo with the same behaviour. demo_lora: demo trained through LoRA adapters (rank 8 on every
projection; config section `lora`, e.g. --config.lora.rank=16 on any preset). llama3_8b_v5e_16, llama3_8b_v6e_8:
llama3_8b in the layout measured to fit that slice (config_utils.SLICE_LAYOUTS; other slices: python -m
sweet_jax.plan --config configs/policy.py:llama3_8b --topology SLICE --fit).
"""
from sweet_jax import config_utils

PRESETS = ("demo", "demo_mtdpo", "demo_rft", "demo_official", "demo_lora", "llama3_8b", "mtdpo", "rft", "official",
           "llama3_8b_v5e_16", "llama3_8b_v6e_8")


def get_config(preset: str = "demo"):
    c = config_utils.base_config()
    if preset not in PRESETS:
        raise ValueError(f"unknown policy preset {preset!r}: use one of {', '.join(PRESETS)} "
                         "(as configs/policy.py:demo)")
    preset, layout = config_utils.slice_preset(preset, "policy")
    lora = preset == "demo_lora"
    preset = "demo" if lora else preset
    kind = preset.split("_")[-1] if preset.startswith("demo_") else preset
    c.loss.kind = {"demo": "dpo", "llama3_8b": "dpo", "official": "dpo"}.get(kind, kind)
    c.loss.use_info = False           # the policy never sees c
    c.loss.beta = 0.1
    c.loss.nll_coef = 0.01 if c.loss.kind == "dpo" else 0.0
    if preset.startswith("demo"):
        c.model.preset = "tiny"
        c.data.max_len = 512
        c.data.bucket = 512
        c.train.batch_size = 8
        c.train.num_steps = 40
        c.train.eval_every = 20
        c.train.ckpt_every = 20
        c.optim.lr = 1e-3
        c.optim.warmup_ratio = 0.05
    else:
        config_utils.paper_8b(c)
        c.train.epochs = 1
    if preset.endswith("official"):
        config_utils.official(c)
        if preset == "official":
            c.data.max_len = 16384  # the official policy run's --max_len
    if lora:
        config_utils.lora_demo(c)
    config_utils.apply_layout(c, layout)
    c.lock()
    return c
