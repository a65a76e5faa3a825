"""Hugging Face import/export: round trips through transformers and through our own loader, and bad input."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx

import tiny
from sweet_jax.errors import SweetJaxError
from sweet_jax.models import load_hf, save_hf
from sweet_jax.models.hf import (HFCheckpointError, MissingConfigError, MissingTensorError, NAME_TABLE,
                                 TensorShapeError, UnsupportedModelError)

IDS = np.arange(2 * 10).reshape(2, 10) * 7 % 256


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {style: tiny.make_hf_llama(root / style, style, seed=i)
            for i, style in enumerate(["llama31", "llama32"])}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    import tokenizers
    vocab = {f"w{i}": i for i in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def torch_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def params_of(model):
    return {path: np.asarray(var[...]) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("style", ["llama31", "llama32"])
def test_export_loads_in_transformers_with_identical_logits(checkpoints, tokenizer_dir, tmp_path, style):
    model = load_hf(checkpoints[style])
    out = save_hf(model, tmp_path / "export", tokenizer_dir=tokenizer_dir, max_shard_size="100KB")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and all((out / f).is_file() for f in shard_files)
    assert ("lm_head.weight" in index["weight_map"]) == (style == "llama31")  # tied: no lm_head, as HF
    generation = json.loads((out / "generation_config.json").read_text())
    assert np.atleast_1d(generation["eos_token_id"]).tolist() == list(model.config.eos_token_ids)
    assert transformers.AutoTokenizer.from_pretrained(out)("w3 w5")["input_ids"] == [3, 5]

    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_array_equal(torch_logits(exported), torch_logits(tiny.load_torch(checkpoints[style])))


def test_load_of_export_has_bit_identical_params(checkpoints, tmp_path):
    model = load_hf(checkpoints["llama31"])
    reloaded = load_hf(save_hf(model, tmp_path / "export", max_shard_size="50KB"))
    original, again = params_of(model), params_of(reloaded)
    assert original.keys() == again.keys()
    for path in original:
        assert again[path].dtype == original[path].dtype
        np.testing.assert_array_equal(again[path], original[path], err_msg=str(path))
    assert reloaded.config == model.config


def test_bfloat16_round_trip_keeps_dtype(checkpoints, tmp_path):
    model = load_hf(checkpoints["llama32"], dtype="bfloat16")
    assert model.embedder.embedding[...].dtype == jax.numpy.bfloat16
    out = save_hf(model, tmp_path / "bf16")
    raw = (out / "model-00001-of-00001.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    reloaded = load_hf(out, dtype="bfloat16")
    for path, value in params_of(model).items():
        assert params_of(reloaded)[path].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(params_of(reloaded)[path], value)
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_bfloat16_checkpoint_loads_into_float32_params(tmp_path):
    path = tiny.make_hf_llama(tmp_path / "bf16", "llama2", dtype=torch.bfloat16)
    model = load_hf(path)
    reference = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    embedding = model.embedder.embedding[...]
    assert embedding.dtype == jax.numpy.float32
    np.testing.assert_array_equal(embedding, reference.model.embed_tokens.weight.detach().float().numpy())


def test_attention_and_mlp_biases_are_imported(tmp_path):
    path = tiny.make_hf_llama(tmp_path / "bias", "llama31", attention_bias=True, mlp_bias=True)
    model = load_hf(path)
    theirs = torch_logits(tiny.load_torch(path))
    assert np.abs(np.asarray(model(IDS)) - theirs).max() / np.abs(theirs).max() < 1e-4


def test_name_table_rows_are_one_to_one():
    hf_names = [row[0] for row in NAME_TABLE]
    paths = [row[1] for row in NAME_TABLE]
    assert len(set(hf_names)) == len(hf_names) and len(set(paths)) == len(paths)


# --- bad input ----------------------------------------------------------------------------------------------

def copy_checkpoint(src, dst, *, config_edit=None, tensors_edit=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    if tensors_edit:
        tensors_edit(tensors)
    safetensors.numpy.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(MissingConfigError, match=str(tmp_path / "config.json")):
        load_hf(tmp_path)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"]), "model_type='mistral'"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "'yarn'"),
])
def test_unsupported_architecture_is_refused(checkpoints, tmp_path, edit, expected):
    bad = copy_checkpoint(checkpoints["llama31"], tmp_path / "bad", config_edit=edit)
    with pytest.raises(UnsupportedModelError, match=expected) as info:
        load_hf(bad)
    assert str(bad / "config.json") in str(info.value)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = copy_checkpoint(checkpoints["llama31"], tmp_path / "bad", tensors_edit=lambda t: t.pop(name))
    with pytest.raises(MissingTensorError, match=name.replace(".", r"\.")):
        load_hf(bad)


def test_wrongly_shaped_tensor_is_named_with_its_file(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:8]

    bad = copy_checkpoint(checkpoints["llama31"], tmp_path / "bad", tensors_edit=shrink)
    with pytest.raises(TensorShapeError) as info:
        load_hf(bad)
    message = str(info.value)
    assert name in message and "model.safetensors" in message and "[8, 64]" in message and "[32, 64]" in message


def test_checkpoint_errors_are_sweet_jax_errors():
    assert issubclass(HFCheckpointError, SweetJaxError) and issubclass(HFCheckpointError, ValueError)


# --- hostile files: headers validated as the safetensors library does, sizes before anything is built --------

def raw_safetensors(path, header: dict, data: bytes, *, length: int | None = None):
    """A safetensors file written byte by byte, so that its header can say anything."""
    head = json.dumps(header).encode()
    path.write_bytes((len(head) if length is None else length).to_bytes(8, "little") + head + data)
    return path


def two_tensors(offsets_a, offsets_b, data_bytes=64):
    return ({"a": {"dtype": "F32", "shape": [8], "data_offsets": offsets_a},
             "b": {"dtype": "F32", "shape": [8], "data_offsets": offsets_b}}, bytes(data_bytes))


@pytest.mark.parametrize("header, data, length, expected", [
    (*two_tensors([0, 32], [16, 48], 48), None, "overlap"),                     # b reads a's bytes
    (*two_tensors([0, 32], [40, 72], 72), None, "leave a gap"),
    (*two_tensors([0, 32], [32, 64], 96), None, "holds 96"),                    # bytes nobody accounts for
    (*two_tensors([0, 32], [32, 64], 40), None, "truncated"),
    (*two_tensors([0, 32], [-8, 24], 64), None, "0 <= begin <= end"),          # into the header
    (*two_tensors([0, 32], [32, 60], 64), None, "needs 32"),
    ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), None, "not a safetensors dtype"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), None, "sizes >= 0"),
    ({"a": 1}, b"", 2 ** 62, "header length"),                                  # absurd length: never read
    ([1, 2], b"", None, "not a JSON object"),
])
def test_a_safetensors_header_the_library_would_refuse_is_refused(tmp_path, header, data, length, expected):
    from sweet_jax.models.hf import _read_safetensors_header
    path = raw_safetensors(tmp_path / "model.safetensors", header, data, length=length)
    with pytest.raises(HFCheckpointError, match=expected):
        _read_safetensors_header(path)
    if expected not in ("header length", "not a JSON object", "not a safetensors dtype"):
        with pytest.raises(Exception):  # the reference library agrees
            safetensors.numpy.load_file(path)


def test_real_safetensors_files_pass_the_header_checks(checkpoints):
    from sweet_jax.models.hf import _read_safetensors_header
    header, start = _read_safetensors_header(checkpoints["llama31"] / "model.safetensors")
    assert len(header) == len(safetensors.numpy.load_file(checkpoints["llama31"] / "model.safetensors"))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_model_directory_is_refused(checkpoints, tmp_path, name):
    bad = copy_checkpoint(checkpoints["llama31"], tmp_path / "bad")
    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / "outside.safetensors")
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": name}}))
    with pytest.raises(HFCheckpointError, match="not inside the model directory"):
        load_hf(bad)


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10 ** 6), ("hidden_size", 10 ** 9),
                                          ("vocab_size", 0), ("num_attention_heads", 0), ("num_hidden_layers", 2.5)])
def test_an_absurd_config_size_is_refused_before_anything_is_built(checkpoints, tmp_path, field, value):
    bad = copy_checkpoint(checkpoints["llama31"], tmp_path / "bad", config_edit=lambda c: c.update({field: value}))
    with pytest.raises(HFCheckpointError, match=rf"{bad / 'config.json'}: .*expected an integer"):
        load_hf(bad)
