"""Export a training run's parameters as a Hugging Face checkpoint (transformers and vLLM load it):

    python -m sweet_jax.export --workdir /tmp/critic --out /tmp/critic_hf [--step N] [--dtype bfloat16]

Reads the run's resolved config (workdir/config.json) to rebuild the architecture, restores only the
parameters from the Orbax checkpoint (latest readable one, or --step) straight onto a mesh over the local
devices, then streams them out with sweet_jax.models.save_hf together with the tokenizer files.
"""
from __future__ import annotations

import logging
import pathlib

from sweet_jax import cli
from sweet_jax.errors import SweetJaxError

log = logging.getLogger("sweet_jax.export")


class ExportError(SweetJaxError):
    """The run directory cannot be exported (no run there, no checkpoint, ...)."""


def restore_model(workdir, step: int | None = None):
    """(the trained model as an nnx Llama, its step, the run's config) from a training run directory."""
    import jax
    from flax import nnx
    from sweet_jax import checkpoint, sharding, train
    from sweet_jax.data.tokenizers import load_tokenizer
    from sweet_jax.models import Llama

    workdir = pathlib.Path(workdir)
    config = train.read_config(workdir)
    tokenizer = load_tokenizer(train.tokenizer_path(config))
    llama_config = train.model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer)
    mesh = sharding.make_mesh((1, -1, 1))
    abstract = nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    shardings = sharding.param_shardings(params, mesh)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    ckpt = checkpoint.Checkpointer(workdir / train.CHECKPOINT_DIR, keep=0, async_save=False)
    restored = ckpt.restore({"params": target}, step=step)
    if restored is None:
        raise ExportError(f"{workdir / train.CHECKPOINT_DIR} holds no checkpoint: train first "
                          f"(python -m sweet_jax.train --workdir {workdir} ...)")
    got_step, items, _ = restored
    ckpt.close()
    return nnx.merge(graphdef, items["params"], rest), got_step, config


def export(workdir, out, *, step: int | None = None, dtype: str | None = None,
           max_shard_size: str = "5GB") -> pathlib.Path:
    from sweet_jax import train
    from sweet_jax.models import save_hf

    model, got_step, config = restore_model(workdir, step)
    path = save_hf(model, out, tokenizer_dir=train.tokenizer_path(config), dtype=dtype,
                   max_shard_size=max_shard_size)
    log.info("exported step %d of %s to %s", got_step, workdir, path)
    return path


def main(argv):
    from absl import flags
    del argv
    FLAGS = flags.FLAGS
    path = export(FLAGS.workdir, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype, max_shard_size=FLAGS.max_shard_size)
    print(f"exported to {path}")


def define_flags():
    from absl import flags

    flags.DEFINE_string("workdir", None, "the training run directory (holds config.json and checkpoints/)")
    flags.DEFINE_string("out", None, "output Hugging Face checkpoint directory")
    flags.DEFINE_integer("step", None, "checkpoint step to export (default: the latest readable one)")
    flags.DEFINE_string("dtype", None, "tensor dtype on disk, e.g. bfloat16 (default: the parameter dtype)")
    flags.DEFINE_string("max_shard_size", "5GB", "largest safetensors shard")
    flags.mark_flags_as_required(["workdir", "out"])


if __name__ == "__main__":
    cli.run(main, define_flags=define_flags)
