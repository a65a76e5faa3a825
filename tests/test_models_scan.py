"""scan_layers=True: the decoder layers as one stacked module run by jax.lax.scan (the 8B/70B training layout).
Same logits and gradients as the per-layer model, HF import/export through the same name table, sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from flax import nnx
from jax.sharding import PartitionSpec

import tiny
from sweet_jax import sharding
from sweet_jax.models import load_hf, save_hf

IDS = np.arange(2 * 12).reshape(2, 12) * 7 % 256
MASK = np.array([[1] * 12, [0] * 3 + [1] * 9], np.int32)  # left padding in the second row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_hf_llama(tmp_path_factory.mktemp("hf") / "llama31", "llama31", num_layers=3,
                              attention_bias=True, mlp_bias=True)


def flat_params(model):
    return {".".join(map(str, path)): np.asarray(var[...])
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def loss_and_grads(model):
    r = jnp.asarray(np.random.RandomState(0).randn(2, 12, 256), jnp.float32)

    def loss(m):
        return jnp.sum(m(IDS, MASK) * r)

    return nnx.value_and_grad(loss)(model)


def test_stacked_layers_carry_a_leading_layers_axis(checkpoint):
    model = load_hf(checkpoint, config_overrides={"scan_layers": True})
    q = model.layers.attn.q_proj.kernel
    assert q.shape == (3, 64, 4, 16)
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_equals_unrolled_logits_and_gradients(checkpoint, remat):
    unrolled = load_hf(checkpoint, config_overrides={"remat": remat})
    scanned = load_hf(checkpoint, config_overrides={"remat": remat, "scan_layers": True})
    loss_u, grads_u = loss_and_grads(unrolled)
    loss_s, grads_s = loss_and_grads(scanned)
    np.testing.assert_allclose(scanned(IDS, MASK), unrolled(IDS, MASK), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    g_u = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads_u)}
    g_s = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads_s)}
    assert len(g_s) == len(g_u) - 2 * len([k for k in g_s if k.startswith("layers.")])  # 3 layers -> 1 stack
    for name, stacked in g_s.items():
        if not name.startswith("layers."):
            np.testing.assert_allclose(stacked, g_u[name], rtol=1e-4, atol=1e-5, err_msg=name)
            continue
        for i in range(3):
            per_layer = g_u["layers." + str(i) + name[len("layers"):]]
            np.testing.assert_allclose(stacked[i], per_layer, rtol=1e-4, atol=1e-5, err_msg=f"{name}[{i}]")


def test_hf_scanned_hf_round_trip_is_bit_identical_and_matches_transformers(checkpoint, tmp_path):
    scanned = load_hf(checkpoint, config_overrides={"scan_layers": True})
    with torch.no_grad():
        expected = tiny.load_torch(checkpoint)(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
    real = MASK.astype(bool)  # padding query rows are not compared (implementations differ there)
    np.testing.assert_allclose(np.asarray(scanned(IDS, MASK))[real], expected[real], rtol=1e-4, atol=1e-4)

    out = save_hf(scanned, tmp_path / "export", max_shard_size="50KB")
    original = {}
    for f in checkpoint.glob("*.safetensors"):
        original.update(safetensors.numpy.load_file(f))
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(safetensors.numpy.load_file(f))
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
    with torch.no_grad():
        reloaded = tiny.load_torch(out)(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
    np.testing.assert_array_equal(reloaded, expected)


def test_sharded_scanned_model_is_laid_out_by_the_rules_and_gives_the_same_logits(checkpoint, tmp_path):
    mesh = sharding.make_mesh((1, 4, 2))
    scanned = load_hf(checkpoint, mesh=mesh, config_overrides={"scan_layers": True})
    up = scanned.layers.mlp.up_proj.kernel[...]
    assert up.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (3, 64 // 4, 128 // 2)
    reference = load_hf(checkpoint)
    np.testing.assert_allclose(jax.jit(lambda ids, m: scanned(ids, m))(IDS, MASK), reference(IDS, MASK),
                               rtol=1e-5, atol=1e-5)
    exported = flat_params(load_hf(save_hf(scanned, tmp_path / "export")))  # layers gathered one at a time
    assert exported.keys() == flat_params(reference).keys()
    for name, value in flat_params(reference).items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_kv_cache_on_a_scanned_model_gives_the_unrolled_models_hidden_states_and_cache(checkpoint):
    # A prefix written into the cache, then a chunk of tokens attending to it (what the rank stage's shared-
    # prefix scoring runs on the critic, a scan_layers training run): same hidden states, same cache per layer.
    unrolled = load_hf(checkpoint)
    scanned = load_hf(checkpoint, config_overrides={"scan_layers": True})
    slots = np.concatenate([MASK, np.ones((2, 4), np.int32)], axis=1)  # 12 prompt slots (left padded) + 4 new

    def run(model):
        cache = model.init_cache(2, 16)
        h1, cache = model.hidden_states(IDS, slots, cache=cache, cache_pos=0)
        h2, cache = model.hidden_states(IDS[:, :4] + 1, slots, cache=cache, cache_pos=12)
        return h1, h2, cache

    (h1_u, h2_u, cache_u), (h1_s, h2_s, cache_s) = run(unrolled), run(scanned)
    np.testing.assert_allclose(h1_s, h1_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h2_s, h2_u, rtol=1e-5, atol=1e-5)
    assert len(cache_s) == len(cache_u) == 3
    for layer_s, layer_u in zip(cache_s, cache_u):
        for name in layer_u:
            np.testing.assert_allclose(layer_s[name], layer_u[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_sequence_parallel_residual_is_split_over_tensor_and_changes_no_value(checkpoint):
    # The residual stream between layers carries the constraint (tokens over 'tensor') once a mesh is set;
    # logits and gradients stay those of the unsharded model.
    mesh = sharding.make_mesh((1, 2, 4))
    spec = sharding.residual_sharding(sequence_parallel=True)
    assert spec == (("data", "fsdp"), "tensor", None)
    scanned = load_hf(checkpoint, mesh=mesh, config_overrides={"scan_layers": True, "remat": "full",
                                                               "residual_sharding": spec})
    reference = load_hf(checkpoint)
    with jax.set_mesh(mesh):
        step = jax.jit(loss_and_grads)
        assert 'sdy.sharding_constraint' in step.lower(scanned).as_text()
        (loss_s, grads_s) = step(scanned)
    loss_u, grads_u = loss_and_grads(reference)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    g_u = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads_u)}
    stacked = np.asarray(grads_s.layers.mlp.down_proj.kernel[...])
    for i in range(3):
        np.testing.assert_allclose(stacked[i], g_u[f"layers.{i}.mlp.down_proj.kernel"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads_s.embedder.embedding[...], g_u["embedder.embedding"], rtol=1e-4, atol=1e-5)
