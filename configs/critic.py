"""Critic training configs: `--config configs/critic.py:PRESET`.

Presets:
  demo        tiny random model, bundled ColBench demo data and tokenizer; CPU, 40-90 s on 2 cores; the
              critic's pair accuracy rises.
  llama3_8b   the paper's critic: Llama-3.1-8B, lr 2e-7, beta 0.1, batch 8, 4 epochs, seq 8192, bf16,
              remat, FSDP. Set --config.model.path to the HF directory of Llama-3.1-8B-Instruct and
              --config.data.trajectories / --config.data.tasks to the ColBench files.
  no_info     llama3_8b without training-time information (the paper's ablation baseline).
  demo_no_info  demo without training-time information.
  official    llama3_8b as the official code trains it (docs/official.md): the fork's
              token mask (data.mask_style=official), c as a raw prefix, the trajectory-mean score, over-long
              sequences cut from the right (data.length_policy=cut_right).
  demo_official  demo with the same official behaviour.
  llama3_8b_v5e_16, llama3_8b_v6e_8  llama3_8b in the layout measured to fit that slice (config_utils.SLICE_LAYOUTS;
              other slices: python -m sweet_jax.plan --config configs/critic.py:llama3_8b --topology SLICE --fit).
  demo_lora   demo trained through LoRA adapters (rank 8 on q,k,v,o,gate,up,down; config section `lora`); any
              preset takes --config.lora.rank=16 --config.lora.alpha=32 --config.lora.targets=q,v the same way.
"""
from sweet_jax import config_utils


def get_config(preset: str = "demo"):
    c = config_utils.base_config()
    c.loss.kind = "critic"
    preset, layout = config_utils.slice_preset(preset, "critic")
    lora = preset.endswith("_lora")
    preset = preset[:-len("_lora")] if lora else preset
    if preset in ("demo", "demo_no_info", "demo_official"):
        c.model.preset = "tiny"
        c.data.max_len = 512          # one bucket: one compile (longer demo dialogues lose early turns)
        c.data.bucket = 512
        c.train.batch_size = 8
        c.train.num_steps = 40       # measured: held-out pair accuracy 0 (ties) -> ~0.9 by step 20
        c.train.log_every = 1
        c.train.eval_every = 10
        c.train.ckpt_every = 20
        c.optim.lr = 3e-3
        c.optim.warmup_ratio = 0.05
        c.loss.beta = 0.1
        c.loss.use_info = preset != "demo_no_info"
    elif preset in ("llama3_8b", "no_info", "official"):
        config_utils.paper_8b(c)
        c.train.epochs = 4
        c.loss.use_info = preset != "no_info"
    else:
        raise ValueError(f"unknown critic preset {preset!r}: use one of demo, demo_no_info, llama3_8b, no_info, "
                         "demo_official, official, demo_lora, llama3_8b_v5e_16, llama3_8b_v6e_8 "
                         "(as configs/critic.py:demo)")
    if preset.endswith("official"):
        config_utils.official(c)
    if lora:
        if preset != "demo":
            raise ValueError(f"unknown critic preset {preset}_lora: the LoRA preset is demo_lora (elsewhere set "
                             "--config.lora.rank)")
        config_utils.lora_demo(c)
    config_utils.apply_layout(c, layout)
    c.lock()
    return c
