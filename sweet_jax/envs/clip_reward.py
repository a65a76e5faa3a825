"""ColBench frontend reward: cosine similarity between the CLIP image features of the agent's rendered page and
of the reference page.

Preprocessing is CLIPProcessor's (the PIL path transformers has always had): shortest side resized to 224 with
bicubic resampling, centre crop 224x224 (a tall page is scored on its middle square), scaled to [0, 1],
normalised with OpenAI's mean and std. A page that did not render scores as a black 224x224 image.
"""
from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
from flax import nnx

from sweet_jax.models.clip import CLIPVision

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)

Screenshot = "bytes | Image.Image | None"  # PNG bytes as the renderer returns them, a PIL image, or no render


def _as_image(screenshot) -> Image.Image:
    if screenshot is None:
        return Image.new("RGB", (224, 224))  # black, as the official reward scores a missing render
    if isinstance(screenshot, (bytes, bytearray)):
        screenshot = Image.open(io.BytesIO(screenshot))
    return screenshot.convert("RGB")


def clip_pixels(screenshot, size: int = 224) -> np.ndarray:
    """One screenshot -> float32 pixels [size, size, 3], as CLIPProcessor's pixel_values (channels last)."""
    image = _as_image(screenshot)
    width, height = image.size
    short, long = min(width, height), max(width, height)
    new_long = int(size * long / short)  # truncation, as transformers computes the long side
    new_w, new_h = (size, new_long) if width <= height else (new_long, size)
    image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    pixels = np.asarray(image.crop((left, top, left + size, top + size)), np.float32) / np.float32(255.0)
    return (pixels - CLIP_MEAN) / CLIP_STD


@nnx.jit
def _cosines(model: CLIPVision, answers_BHWC: jax.Array, references_BHWC: jax.Array) -> jax.Array:
    """[B] cosine between the L2-normalised image features of each (answer, reference) pair."""
    a, r = model(answers_BHWC), model(references_BHWC)
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    r = r / jnp.linalg.norm(r, axis=-1, keepdims=True)
    return jnp.sum(a * r, axis=-1)


class ClipReward:
    """Scores (answer screenshot, reference screenshot) pairs in batches of a fixed size (padded, so one compile)."""

    def __init__(self, model: CLIPVision, batch_size: int = 8):
        self.model = model
        self.batch_size = batch_size
        self.size = model.config.image_size

    def __call__(self, answers: list, references: list) -> np.ndarray:
        if len(answers) != len(references):
            raise ValueError(f"{len(answers)} answer screenshots but {len(references)} references")
        scores = []
        for start in range(0, len(answers), self.batch_size):
            a = [clip_pixels(s, self.size) for s in answers[start:start + self.batch_size]]
            r = [clip_pixels(s, self.size) for s in references[start:start + self.batch_size]]
            n = len(a)
            pad = [np.zeros_like(a[0])] * (self.batch_size - n)
            scores.append(np.asarray(_cosines(self.model, np.stack(a + pad), np.stack(r + pad)))[:n])
        return np.concatenate(scores) if scores else np.zeros((0,), np.float32)
