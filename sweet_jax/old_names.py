"""The names of the flat layout, kept for one release: `python -m sweet_jax.NAME` for the commands whose module
moved to sweet_jax.commands (train and pipeline are packages with a __main__.py; the others are found here).

`python -m sweet_jax.rank` runs `sweet_jax.commands.launch("rank")`; importing `sweet_jax.rank` as a library is an
ImportError that names the new home. Remove this module (and its line in sweet_jax/__init__.py) in the next release.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import pathlib

OLD_COMMANDS = ("rank", "rollout", "evaluate", "export", "serve", "plan", "pipeline_report", "pipeline_diagnostics")


class OldCommandLoader(importlib.abc.InspectLoader):
    """The code of `sweet_jax.NAME`: launch the command when run as __main__, else say where it went."""

    def __init__(self, name: str):
        self.name = name

    def is_package(self, fullname: str) -> bool:
        return False

    def get_source(self, fullname: str) -> str:
        return (f"from sweet_jax.commands import launch\n"
                f"if __name__ == '__main__':\n"
                f"    launch({self.name!r})\n"
                f"else:\n"
                f"    raise ImportError('sweet_jax.{self.name} is the command python -m sweet_jax.{self.name} of the old "
                f"flat layout; its main is sweet_jax.commands.{self.name} and its library is in sweet_jax.rl, "
                f"sweet_jax.sampling, sweet_jax.train or sweet_jax.pipeline')\n")


class OldCommandFinder(importlib.abc.MetaPathFinder):
    """`sweet_jax.NAME` for NAME in OLD_COMMANDS (no module of the package has these names any more)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "sweet_jax" or name not in OLD_COMMANDS:
            return None
        # origin: runpy sets sys.argv[0] (which absl reads) to it; the command's own file
        origin = str(pathlib.Path(__file__).with_name("commands") / f"{name}.py")
        return importlib.util.spec_from_loader(fullname, OldCommandLoader(name), origin=origin)


FINDER = OldCommandFinder()
