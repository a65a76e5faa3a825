"""How a model, its tokenizer and its mesh are loaded from a path, the one way every command and stage does it.

A model path is one of: a Hugging Face checkpoint directory (config.json + *.safetensors), a training run
directory (its latest readable checkpoint, sweet_jax.train.rundir), or '' for the demo tiny random model (its
vocabulary from the tokenizer). `load_model` loads one; sweet_jax.sampling.generate.load_sampler wraps it in a sampler.
"""
from __future__ import annotations

import logging
import math
import os
import pathlib

import jax
from flax import nnx

from sweet_jax import sharding
from sweet_jax.config_utils import absolute_path, model_overrides
from sweet_jax.data import demo
from sweet_jax.data.tokenizers import check_vocab, end_of_turn_ids, load_tokenizer
from sweet_jax.models import Llama, LlamaConfig, load_hf
from sweet_jax.models.hf import read_hf_config
from sweet_jax.models.lora import LoRAConfig, add_adapters
from sweet_jax.train import checkpoint
from sweet_jax.train.rundir import CHECKPOINT_DIR, CONFIG_FILE, RunDirError, read_config


def demo_paths():
    return demo.paths()


def tokenizer_dir(*choices) -> str:
    """The tokenizer directory: the first non-empty of `choices` (tokenizer or model directories, in order of
    preference), else the bundled demo tokenizer (the demo tiny model's)."""
    for choice in choices:
        if choice:
            return str(choice)
    return str(demo_paths().tokenizer)


def tokenizer_path(config) -> str:
    """A training config's tokenizer: data.tokenizer, else model.path, else the bundled demo tokenizer."""
    return tokenizer_dir(config.data.tokenizer, config.model.path)


def initialize_distributed() -> bool:
    """sharding.initialize_distributed: jax.distributed when this is one process of several."""
    return sharding.initialize_distributed()


def make_mesh(shape, *, field: str = "config.mesh.shape"):
    """The ('data', 'fsdp', 'tensor') mesh of `shape` (-1 = the rest of the devices); None for an empty shape
    (one device, no sharding). A shape the devices cannot fill is a one-line error naming `field`."""
    if not shape:
        return None

    shape = tuple(int(s) for s in shape)
    n = jax.device_count()
    fixed = math.prod(s for s in shape if s != -1)
    if len(shape) != 3 or fixed > n or (-1 in shape and n % fixed):
        raise RunDirError(
            f"{field}={shape} needs {fixed} devices{'' if -1 not in shape else ' (times the -1 axis)'}, "
            f"but this run has {n}; set {field} so the sizes multiply to {n} (e.g. '(1,-1,1)')")
    return sharding.make_mesh(shape)


def model_config(config, vocab_size: int, tokenizer=None):
    """The LlamaConfig of a training config: from model.path's config.json, or the named preset (demo: tiny,
    whose vocabulary and bos/eos come from the tokenizer so an exported demo model generates and stops)."""
    overrides = model_overrides(config)
    if config.model.path:
        return LlamaConfig.from_hf(read_hf_config(config.model.path), **overrides)
    if config.model.preset == "tiny":
        overrides["vocab_size"] = vocab_size
        if tokenizer is not None:
            overrides.update(demo_token_ids(tokenizer))
    return LlamaConfig.preset(config.model.preset, **overrides)


def demo_token_ids(tokenizer) -> dict:
    """bos/eos of the tiny demo model, from its tokenizer (eos: every end-of-turn token)."""
    eos = tuple(sorted(end_of_turn_ids(tokenizer)))
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos)


def is_hf_checkpoint(path) -> bool:
    p = pathlib.Path(os.fspath(path))
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def is_training_run(path) -> bool:
    """A sweet_jax.train run directory (checkpoints/ + the run's config.json), not a HF checkpoint."""
    p = pathlib.Path(os.fspath(path))
    return (p / CHECKPOINT_DIR).is_dir() and (p / CONFIG_FILE).is_file() and not any(p.glob("*.safetensors"))


def build_model(config, llama_config, mesh):
    """The model to train, sharded on the mesh: HF weights from model.path, or a seeded random init; with
    config.lora.rank > 0, fresh LoRA adapters on it (models/lora.py: the base weights are then frozen)."""
    def with_adapters(model):
        return add_adapters(model, LoRAConfig.from_config(config.get("lora")), seed=int(config.train.seed))

    if config.model.path:
        overrides = {k: v for k, v in model_overrides(config).items() if k != "param_dtype"}
        return with_adapters(load_hf(config.model.path, dtype=llama_config.param_dtype, mesh=mesh,
                                     config_overrides=overrides))
    # Random init straight onto the shardings (jit with out_shardings): big presets never sit on one device.
    abstract = nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.param_shardings(abstract_state, mesh)
    seed = int(config.train.seed)
    state = jax.jit(lambda: nnx.split(Llama(llama_config, rngs=nnx.Rngs(seed)))[1], out_shardings=shardings)()
    return with_adapters(nnx.merge(graphdef, state))


def lora_trainable(config):
    """What a run trains (steps.create_train_state's filter): nnx.LoRAParam, the adapters, when config.lora.rank
    > 0; else every nnx.Param."""
    return nnx.LoRAParam if LoRAConfig.from_config(config.get("lora")).enabled else nnx.Param


def restore_model(workdir, step: int | None = None):
    """(the trained model as an nnx Llama, its step, the run's config) from a training run directory: only
    the trained parameters, restored straight onto a mesh over the local devices. A LoRA run's checkpoints
    hold the adapters: the base is rebuilt as the run built it (model.path or the seeded demo init) and the
    model comes back with its adapters (models.lora.merge folds them in). A relative workdir is taken from the
    working directory."""
    workdir = pathlib.Path(absolute_path(os.fspath(workdir)))
    config = read_config(workdir)
    tokenizer = load_tokenizer(tokenizer_path(config))
    llama_config = model_config(config, vocab_size=len(tokenizer), tokenizer=tokenizer)
    mesh = sharding.make_mesh((1, -1, 1))
    trainable = lora_trainable(config)
    if trainable is nnx.Param:
        abstract = nnx.eval_shape(lambda: Llama(llama_config, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    else:
        graphdef, params, rest = nnx.split(build_model(config, llama_config, mesh), trainable, ...)
    shardings = sharding.param_shardings(params, mesh)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    ckpt = checkpoint.Checkpointer(workdir / CHECKPOINT_DIR, keep=0, async_save=False)
    restored = ckpt.restore({"params": target}, step=step)
    if restored is None:
        raise RunDirError(f"{workdir / CHECKPOINT_DIR} holds no checkpoint: train first "
                          f"(python -m sweet_jax.train --workdir {workdir} ...)")
    got_step, items, _ = restored
    ckpt.close()
    return nnx.merge(graphdef, items["params"], rest), got_step, config


def load_tokenizer_for(path: str, tokenizer: str | None = None, run_config=None, *, chat_template: bool = True):
    """The tokenizer that goes with a model path: `tokenizer` when given, else the checkpoint's own files,
    the training run's tokenizer, or the demo tokenizer for ''."""
    directory = tokenizer_dir(tokenizer, tokenizer_path(run_config) if run_config is not None else path)
    return load_tokenizer(directory, require_chat_template=chat_template)


def load_model(path: str, *, dtype: str | None = None, mesh=None, tokenizer=None, seed: int = 0,
               what: str = "model", cpu_matmul: str | None = None):
    """(model, the training run's config or None) for a model path (see the module docstring). `tokenizer`
    sizes the demo model's vocabulary ('' path) and is checked against the loaded one's. cpu_matmul: the
    model.cpu_matmul of a Hugging Face checkpoint or the demo model (None: LlamaConfig's default; a training run
    keeps its own)."""
    overrides = {} if cpu_matmul is None else {"cpu_matmul": cpu_matmul}
    if not path:
        if tokenizer is None:
            tokenizer = load_tokenizer_for("")
        config = LlamaConfig.preset("tiny", vocab_size=len(tokenizer), **demo_token_ids(tokenizer), **overrides)
        return Llama(config, rngs=nnx.Rngs(seed)), None
    p = pathlib.Path(path)
    if not p.exists():
        raise RunDirError(f"{what} path {path}: no such directory; pass a Hugging Face checkpoint directory "
                          "(config.json + *.safetensors), a training run directory, or '' for the demo model")
    if is_hf_checkpoint(p):
        if tokenizer is not None:  # before reading the weights
            check_vocab(read_hf_config(p).get("vocab_size", 0), tokenizer, model=f"{what} {path}")
        return load_hf(str(p), dtype=dtype or None, mesh=mesh, config_overrides=overrides or None), None
    if is_training_run(p):
        model, step, run_config = restore_model(p)
        logging.getLogger(__name__).info("%s: step %d of the training run %s", what, step, p)
        return model, run_config
    raise RunDirError(f"{what} path {path}: neither a Hugging Face checkpoint directory (config.json + "
                      "*.safetensors) nor a training run directory (config.json + checkpoints/)")
