"""Export a training run's parameters as a Hugging Face checkpoint (transformers and vLLM load it):

    python -m sweet_jax.export --workdir /tmp/critic --out /tmp/critic_hf [--step N] [--dtype bfloat16]
        [--peft_out /tmp/critic_adapter]

Reads the run's resolved config (workdir/config.json) to rebuild the architecture, restores only the
parameters from the Orbax checkpoint (latest readable one, or --step) straight onto a mesh over the local
devices, then streams them out with sweet_jax.models.save_hf together with the tokenizer files
(sweet_jax.train.export.export_run). A LoRA run (config lora.rank > 0) is exported as full weights with the adapters
merged in (models/lora.py merge), and with --peft_out also as a PEFT adapter (adapter_config.json +
adapter_model.safetensors) for the base model.
"""
from __future__ import annotations

from absl import flags

from sweet_jax import cli
from sweet_jax.commands import launch


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    cli.require_path("--workdir", FLAGS.workdir, directory=True)
    from sweet_jax.train import export as run_export  # after the flags: --help in a second
    path = run_export.export_run(FLAGS.workdir, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype,
                             max_shard_size=FLAGS.max_shard_size, peft_out=FLAGS.peft_out)
    print(f"exported to {path}")


def define_flags():
    flags.DEFINE_string("workdir", None, "the training run directory (holds config.json and checkpoints/)")
    flags.DEFINE_string("out", None, "output Hugging Face checkpoint directory")
    flags.DEFINE_integer("step", None, "checkpoint step to export (default: the latest readable one)")
    flags.DEFINE_string("dtype", None, "tensor dtype on disk, e.g. bfloat16 (default: the parameter dtype)")
    flags.DEFINE_string("max_shard_size", "5GB", "largest safetensors shard")
    flags.DEFINE_string("peft_out", None, "a LoRA run: also write its adapter in PEFT format to this directory")
    flags.mark_flags_as_required(["workdir", "out"])


HELP_CONFIGS = ()

if __name__ == "__main__":
    launch("export")
