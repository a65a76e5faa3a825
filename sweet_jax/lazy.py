"""Third-party packages imported on first use: the heavy ones and those a single optional feature needs.

Every other module imports at its top (tests/test_layers.py walks the package and holds it to that). A package
here is one of:
  - heavy to import and needed by some commands only: transformers' tokenizer classes (~3 s: every command that
    never reads a tokenizer, `--help` included, would pay it), matplotlib (plots at the end of a run),
    tensorboardX (~2 s, only with metrics.writers = tensorboard);
  - needed by one optional feature, and absent where that feature is not installed: wandb (metrics.writers =
    wandb), selenium (the frontend track's browser).
Each function returns what its caller uses; a missing optional package is an ImportError (the metrics writers
log it and go on; the browser's names the feature and the install line).
"""
from __future__ import annotations

import importlib
import types


def _load(name: str, *, feature: str = "", install: str = "") -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if not feature:
            raise
        raise ImportError(f"{feature} needs the Python package {name.split('.')[0]!r}, which is not installed "
                          f"({e}); install it with `pip install {install or name.split('.')[0]}`") from e


def transformers() -> types.ModuleType:
    """transformers (a dependency; its tokenizer classes take seconds to import)."""
    return _load("transformers")


def generate_merges():
    """transformers' generate_merges (the merges of a sentencepiece BPE vocabulary without a merges list)."""
    return _load("transformers.tokenization_utils_base").generate_merges


def pyplot() -> types.ModuleType:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    matplotlib = _load("matplotlib")
    matplotlib.use("Agg")
    return _load("matplotlib.pyplot")


def tensorboard_writer():
    """tensorboardX.SummaryWriter."""
    return _load("tensorboardX").SummaryWriter


def wandb() -> types.ModuleType:
    """wandb (optional: metrics.writers = wandb)."""
    return _load("wandb")


def selenium_timeout() -> type:
    """selenium's TimeoutException (what chromedriver's 'timeout' errors raise)."""
    exceptions = _load("selenium.common.exceptions", feature="the frontend track's browser", install="selenium")
    return exceptions.TimeoutException


def selenium_webdriver() -> types.ModuleType:
    """selenium.webdriver, with its chrome.service module loaded (optional: the frontend track's browser)."""
    webdriver = _load("selenium.webdriver", feature="the frontend track's browser", install="selenium")
    _load("selenium.webdriver.chrome.service")
    return webdriver

