"""A training run's parameters as a Hugging Face checkpoint directory (and a LoRA run's adapter in PEFT format):
the library of `python -m sweet_jax.export`."""
from __future__ import annotations

import logging
import pathlib

from sweet_jax.models import lora, save_hf
from sweet_jax.train.model_loading import restore_model, tokenizer_path
from sweet_jax.train.rundir import RunDirError


def export_run(workdir, out, *, step: int | None = None, dtype: str | None = None,
               max_shard_size: str = "5GB", peft_out: str | None = None) -> pathlib.Path:
    """A training run's parameters (latest readable checkpoint, or `step`) as a Hugging Face checkpoint in `out`,
    with the run's tokenizer files: what transformers and vLLM load. A LoRA run is exported with its adapters
    merged in, and with peft_out also as a PEFT adapter for the base model."""
    log = logging.getLogger("sweet_jax.export")
    model, got_step, config = restore_model(workdir, step)
    if lora.has_adapters(model):
        if peft_out:
            lora.save_peft(model, lora.LoRAConfig.from_config(config.lora), peft_out,
                           base_model=config.model.path, dtype=dtype)
            log.info("wrote the LoRA adapter of step %d in PEFT format to %s", got_step, peft_out)
        model = lora.merge(model)
    elif peft_out:
        raise RunDirError(f"--peft_out={peft_out}: the run {workdir} has no LoRA adapters (its lora.rank is 0)")
    path = save_hf(model, out, tokenizer_dir=tokenizer_path(config), dtype=dtype, max_shard_size=max_shard_size)
    log.info("exported step %d of %s to %s", got_step, workdir, path)
    return path
