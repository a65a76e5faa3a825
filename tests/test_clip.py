"""CLIP vision tower in Flax vs transformers' CLIPModel, preprocessing vs CLIPProcessor's, and the frontend reward."""
import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from sweet_jax.envs.clip_reward import ClipReward, clip_pixels
from sweet_jax.models.clip import NAME_TABLE, CLIPCheckpointError, CLIPVisionConfig, load_clip_hf


def make_hf_clip(path, *, hidden_act="quick_gelu", image_size=64, patch_size=16, seed=0):
    """A random CLIPModel with a two-layer vision tower, saved as a real HF checkpoint."""
    torch.manual_seed(seed)
    config = transformers.CLIPConfig(
        projection_dim=12,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=image_size, patch_size=patch_size, hidden_act=hidden_act),
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
    )
    model = transformers.CLIPModel(config).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb so parity sees every tensor
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_image_features_match_transformers(tmp_path, hidden_act):
    hf_model = make_hf_clip(tmp_path, hidden_act=hidden_act)
    ours = load_clip_hf(tmp_path)
    pixels_BCHW = np.random.default_rng(0).normal(size=(3, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        expected = hf_model.get_image_features(pixel_values=torch.from_numpy(pixels_BCHW)).pooler_output.numpy()
    got = np.asarray(ours(pixels_BCHW.transpose(0, 2, 3, 1)))
    assert got.shape == (3, 12)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_name_table_covers_every_vision_tensor(tmp_path):
    hf_model = make_hf_clip(tmp_path)
    vision_names = {n for n in hf_model.state_dict() if n.startswith(("vision_model.", "visual_projection"))
                    and "position_ids" not in n}
    covered = {hf.replace("{i}", str(i)) for hf, _, _ in NAME_TABLE for i in range(2)}
    assert vision_names == covered


def test_config_defaults_are_vit_b32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "vision_config": {}}))
    config = CLIPVisionConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config == CLIPVisionConfig.vit_b32()
    assert (config.hidden_size, config.num_layers, config.patch_size, config.projection_dim) == (768, 12, 32, 512)


def test_loading_a_non_clip_checkpoint_says_what_is_wrong(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CLIPCheckpointError, match="model_type is 'llama'"):
        load_clip_hf(tmp_path)


def page_like_image(width, height, seed=0):
    """A page-like picture: blocks of colour and text on white, with sharp edges bicubic has to get right."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
        draw.rectangle([x, y, x + int(rng.integers(10, 200)), y + int(rng.integers(10, 80))],
                       fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        draw.text((x, y), "Sweet page", fill="black")
    return image


@pytest.mark.parametrize("size", [(1366, 2400), (1366, 768), (300, 301), (224, 224), (800, 90)])
def test_pixels_match_clip_processor(size):
    image = page_like_image(*size)
    expected = CLIPImageProcessorPil()(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    np.testing.assert_allclose(clip_pixels(image), expected, atol=1e-5, rtol=0)


def test_missing_render_scores_as_a_black_square():
    black = CLIPImageProcessorPil()(images=Image.new("RGB", (224, 224)), return_tensors="np")["pixel_values"][0]
    np.testing.assert_allclose(clip_pixels(None), black.transpose(1, 2, 0), atol=1e-6)


def test_reward_is_the_cosine_of_transformers_features(tmp_path):
    hf_model = make_hf_clip(tmp_path, image_size=224, patch_size=32)
    reward = ClipReward(load_clip_hf(tmp_path), batch_size=4)
    answers = [page_like_image(600, 900, seed=s) for s in range(5)] + [None]
    references = [page_like_image(600, 900, seed=0)] * 6
    got = reward(answers, references)  # 6 pairs: one full batch of 4 and a padded one
    processor = CLIPImageProcessorPil()
    with torch.no_grad():
        feats = lambda images: hf_model.get_image_features(  # noqa: E731
            pixel_values=torch.from_numpy(processor(images=images, return_tensors="np")["pixel_values"])
        ).pooler_output
        a = feats([im if im is not None else Image.new("RGB", (224, 224)) for im in answers])
        r = feats(references)
    expected = torch.nn.functional.cosine_similarity(a, r, dim=-1).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert got[0] == pytest.approx(1.0, abs=1e-5)  # the reference against itself
