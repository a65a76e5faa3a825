"""The package list: sweet_jax* and the repository's configs/ directory, installed as sweet_jax.configs so that
`--config configs/critic.py:demo` is found from any working directory and after a non-editable install
(sweet_jax.cli.resolve_config). Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["sweet_jax*"]) + ["sweet_jax.configs"],
      package_dir={"sweet_jax.configs": "configs"})
