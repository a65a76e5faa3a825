"""Meshes over the 8 fake CPU devices: parameters land on the shardings LOGICAL_RULES asks for, logits don't change."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import tiny
from sweet_jax import sharding
from sweet_jax.models import Llama, LlamaConfig, load_hf, save_hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_hf_llama(tmp_path_factory.mktemp("hf") / "llama31", "llama31")


def test_make_mesh_fills_minus_one_with_the_remaining_devices():
    assert jax.device_count() == 8
    mesh = sharding.make_mesh((2, -1, 1))
    assert mesh.axis_names == ("data", "fsdp", "tensor") and dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(sharding.MeshConfig(data=1, fsdp=2, tensor=2).make().shape) == {"data": 1, "fsdp": 2, "tensor": 2}


def test_make_mesh_refuses_more_devices_than_exist():
    with pytest.raises(sharding.MeshError, match="needs 16 devices, but only 8"):
        sharding.make_mesh((4, 4, 1))
    with pytest.raises(sharding.MeshError, match="not divisible"):
        sharding.make_mesh((3, -1, 1))


def test_logical_rules_map_names_to_mesh_axes():
    assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim")) == P("fsdp", "tensor", None)
    assert sharding.logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
    mesh = sharding.make_mesh((1, 2, 4))
    # 2 kv heads cannot be split 4 ways: that dimension replicates instead of failing.
    assert sharding.spec_for_shape((64, 2, 16), P("fsdp", "tensor", None), mesh) == P("fsdp", None, None)


EXPECTED = {  # module path -> logical axes, per the table in models/llama.py
    "embedder.embedding": ("vocab", "embed"),
    "layers.0.attn.q_proj.kernel": ("embed", "heads", "head_dim"),
    "layers.1.attn.k_proj.kernel": ("embed", "kv_heads", "head_dim"),
    "layers.0.attn.o_proj.kernel": ("heads", "head_dim", "embed"),
    "layers.1.mlp.down_proj.kernel": ("mlp", "embed"),
    "layers.0.input_norm.scale": ("norm",),
    "lm_head.kernel": ("embed", "vocab"),
}


def flat_params(model):
    return {".".join(str(k) for k in path): var[...]
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 2, 4)])
def test_loaded_params_carry_rule_shardings_and_logits_are_unchanged(checkpoint, shape):
    mesh = sharding.make_mesh(shape)
    model = load_hf(checkpoint, mesh=mesh)
    params = flat_params(model)
    for path, value in params.items():
        assert isinstance(value.sharding, NamedSharding) and value.sharding.mesh == mesh, path
        assert len(value.sharding.device_set) == 8
    for path, names in EXPECTED.items():
        value = params[path]
        expected = sharding.spec_for_shape(value.shape, sharding.logical_to_spec(names), mesh)
        assert value.sharding.spec == expected, (path, value.sharding.spec, expected)
    if shape == (2, 2, 2):  # spelled out once: vocab->tensor, embed->fsdp, heads->tensor
        assert params["embedder.embedding"].sharding.spec == P("tensor", "fsdp")
        assert params["layers.0.attn.q_proj.kernel"].sharding.spec == P("fsdp", "tensor", None)
        assert params["layers.0.input_norm.scale"].sharding.spec == P(None)

    unsharded = load_hf(checkpoint)
    input_ids = np.arange(8 * 10, dtype=np.int32).reshape(8, 10) % 256
    mask = np.ones_like(input_ids)
    mask[::2, 7:] = 0
    ids_sharded = jax.device_put(input_ids, sharding.batch_sharding(mesh, 2))
    mask_sharded = jax.device_put(mask, sharding.batch_sharding(mesh, 2))
    logits = jax.jit(lambda m, ids, am: m(ids, am))(model, ids_sharded, mask_sharded)
    np.testing.assert_allclose(logits, unsharded(input_ids, mask), rtol=1e-5, atol=1e-5)


def test_sharded_model_exports_the_same_weights(checkpoint, tmp_path):
    sharded = load_hf(checkpoint, mesh=sharding.make_mesh((2, 2, 2)))
    reloaded = load_hf(save_hf(sharded, tmp_path / "export", max_shard_size="100KB"))
    original = flat_params(load_hf(checkpoint))
    for path, value in flat_params(reloaded).items():
        np.testing.assert_array_equal(value, original[path], err_msg=path)


def test_shard_model_matches_param_shardings():
    mesh = sharding.make_mesh((2, 2, 2))
    model = Llama(LlamaConfig.preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    sharding.shard_model(model, mesh)
    wanted = sharding.param_shardings(model, mesh)
    for (path, var), (_, want) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(wanted)):
        assert var[...].sharding == want.get_value(), path
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)


def test_opt_state_shardings_follow_params():
    mesh = sharding.make_mesh((1, 4, 2))
    model = Llama(LlamaConfig.preset("tiny", vocab_size=256), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    param_shardings = sharding.param_shardings(params, mesh)
    opt_shapes = jax.eval_shape(optax.adamw(1e-3).init, params)
    opt_shardings = sharding.opt_state_shardings(opt_shapes, param_shardings, mesh)
    adam = opt_shardings[0]
    assert adam.mu["embedder"]["embedding"].get_value() == param_shardings["embedder"]["embedding"].get_value()
    assert adam.nu["layers"][1]["mlp"]["up_proj"]["kernel"].get_value().spec == P("fsdp", "tensor")
    assert adam.count == sharding.replicated(mesh)
    # The shardings place a real optimiser state.
    opt_state = jax.jit(optax.adamw(1e-3).init, out_shardings=opt_shardings)(params)
    assert opt_state[0].mu["lm_head"]["kernel"].get_value().sharding.spec == P("fsdp", "tensor")


def test_batch_sharding_splits_the_leading_dim_over_data_and_fsdp():
    mesh = sharding.make_mesh((2, 4, 1))
    batch = jax.device_put(np.zeros((16, 2, 5), np.int32), sharding.batch_sharding(mesh, 3))
    assert batch.sharding.spec == P(("data", "fsdp"), None, None)
    assert {s.data.shape for s in batch.addressable_shards} == {(2, 2, 5)}


def test_initialize_distributed_is_a_no_op_for_one_process():
    assert sharding.initialize_distributed() is False
    assert jax.process_count() == 1


@pytest.mark.parametrize("shape, devices, batch, micro, chosen", [
    ((1, -1, 1), 16, 8, 0, (1, 8, 2)),    # the 8B presets on v5e-16: FSDP over 16 chips cannot split 8 pairs
    ((1, -1, 1), 16, 8, 4, (1, 4, 4)),    # the micro-batch is what each pass splits
    ((1, -1, 1), 8, 6, 0, (1, 2, 4)),
    ((1, -1, 1), 8, 3, 0, (1, 1, 8)),     # odd batch: tensor parallel over every chip
    ((2, -1, 1), 16, 12, 0, (2, 2, 4)),   # data kept where it still divides the batch shards
    ((4, -1, 1), 16, 2, 0, (1, 2, 8)),    # ... and dropped where it does not
    ((1, -1, 2), 16, 4, 0, (1, 4, 4)),    # the configured tensor size stays a factor
    ((1, 5, 1), 5, 10, 0, (1, 5, 1)),     # a mesh that splits the batch is kept as configured
    ((1, -1, 1), 8, 8, 0, (1, 8, 1)),
])
def test_choose_mesh_shape_splits_awkward_batches(shape, devices, batch, micro, chosen):
    got, why = sharding.choose_mesh_shape(shape, devices, batch, micro)
    assert got == chosen
    assert (why == "") == (got == sharding.resolve_mesh_shape(shape, devices))
    if why:
        assert str(chosen) in why


def test_chosen_mesh_is_always_valid_and_uses_every_chip():
    for devices in (1, 2, 4, 6, 8, 12, 16, 32, 64, 128):
        for batch in range(1, 33):
            for shape in ((1, -1, 1), (2, -1, 1), (1, -1, 2), (1, 1, -1)):
                try:
                    sharding.resolve_mesh_shape(shape, devices)
                except sharding.MeshError:
                    continue
                (data, fsdp, tensor), _ = sharding.choose_mesh_shape(shape, devices, batch)
                assert data * fsdp * tensor == devices and batch % (data * fsdp) == 0
                # The largest batch split the configured tensor size leaves: no larger divisor of the chips
                # outside 'tensor' divides the batch.
                free = devices // sharding.resolve_mesh_shape(shape, devices)[2]
                assert not any(free % k == 0 and batch % k == 0 and k > data * fsdp for k in range(1, free + 1))


def test_choose_mesh_shape_rejects_micro_batches_that_do_not_divide_the_batch():
    with pytest.raises(sharding.MeshError, match="micro-batch"):
        sharding.choose_mesh_shape((1, -1, 1), 8, 8, 3)
