"""The layering of the package, read from the source with ast: every import (top level or inside a function) of
every module points down the layer order below or stays inside its own layer, no two modules import each other
through any chain, the command-line programs sit on top and no library module imports one, and the imports of the
package's own modules are at the top of each module (the few exceptions say why on their line), and so are the
third-party and standard-library ones but those sweet_jax/lazy.py imports on first use."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import pytest

import sweet_jax
from sweet_jax import cli, lazy

PACKAGE = pathlib.Path(sweet_jax.__file__).resolve().parent

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("errors", "jsonl", "host_malloc", "http_bounds", "sharding", "cli", "old_names", "lazy", "costs"),  # no ColBench,
    # no model
    ("sandbox",),        # runs code; knows no record type
    ("data",),           # records, tokenizers, rendering, pairs, batching
    ("models",),         # the Llama family and its checkpoint formats (GGUF reads a tokenizer: data)
    ("envs",),           # environments, simulators, task generators
    ("config_utils",),   # the training config schema (the presets name models)
    ("train",),          # loop, steps, losses, optimiser, checkpoints, metrics, run directories
    ("sampling",),       # the sampler interface and its implementations, the server
    ("rl",),             # episodes, ranking, diagnostics, probes, results
    ("pipeline",),       # the comparison's stages
    ("commands",),       # the command-line programs
)
LAYER = {top: i for i, names in enumerate(LAYERS) for top in names}
COMMANDS_LAYER = LAYER["commands"]
BOTTOM = {"jsonl": {"errors"}, "errors": set(), "cli": {"errors", "host_malloc"}, "host_malloc": set(),
          "old_names": set(), "lazy": set(), "costs": set()}
MAX_FUNCTION_LEVEL_IMPORTS = 20  # of the package's own modules, each with its reason on its line


def module_name(path: pathlib.Path) -> str:
    """sweet_jax/train/rundir.py -> 'train.rundir'; a package's __init__.py -> the package ('train'); the root
    package's -> ''."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(dotted: str) -> str:
    """'train.rundir.load_x' -> 'train.rundir': the longest module of the package that the name starts with."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def is_main_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` (a module's old command path, kept for one release, belongs to the commands)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def own_imports(path: pathlib.Path) -> list[tuple[str, bool, int, str]]:
    """(imported module, inside a function, line, the line's text) for every import of the package's own modules
    outside the module's `if __name__ == "__main__":` block."""
    source = path.read_text()
    lines = source.splitlines()
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if is_main_block(child):
                continue
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names if a.name.startswith("sweet_jax.")]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and \
                    (child.module == "sweet_jax" or child.module.startswith("sweet_jax.")):
                targets = [f"{child.module}.{a.name}" for a in child.names]
            for target in targets:
                out.append((resolve(target[len("sweet_jax."):]), in_function, child.lineno, lines[child.lineno - 1]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return out


def other_imports_in_functions(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every import inside a function that is not of the package's own modules."""
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in ast.walk(node):
                own = (isinstance(child, ast.ImportFrom) and (child.level or (child.module or "").startswith(
                    "sweet_jax"))) or (isinstance(child, ast.Import) and all(
                        a.name.startswith("sweet_jax") for a in child.names))
                if isinstance(child, (ast.Import, ast.ImportFrom)) and not own:
                    out.append((child.lineno, lines[child.lineno - 1].strip()))
    return sorted(set(out))


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    if module.endswith("__main__"):  # `python -m sweet_jax.train`: a command
        return COMMANDS_LAYER
    assert top in LAYER, f"sweet_jax/{module.replace('.', '/')}: give its package a place in LAYERS"
    return LAYER[top]


GRAPH = {name: {imported for imported, _, _, _ in own_imports(path) if imported != name}
         for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        if name:
            layer_of(name)


def test_no_import_points_up_a_layer():
    upward = [f"{name} (layer {LAYERS[layer_of(name)][0]}) imports {imported} (layer {LAYERS[layer_of(imported)][0]})"
              for name, imported_all in GRAPH.items() if name
              for imported in imported_all if imported and layer_of(imported) > layer_of(name)]
    assert not upward, upward


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])
    assert not cycles, cycles


def test_library_modules_import_no_command():
    offenders = [f"{name} imports {imported}" for name, imported_all in GRAPH.items()
                 if name and layer_of(name) < COMMANDS_LAYER
                 for imported in imported_all if imported.split(".")[0] == "commands"]
    assert not offenders, offenders


def test_no_command_imports_another_command():
    found = sorted((name, imported) for name, imported_all in GRAPH.items() if name.startswith("commands.")
                   for imported in imported_all if imported.startswith("commands.") and imported != name)
    assert not found, found


def test_the_bottom_modules_import_only_the_bottom():
    for name, allowed in BOTTOM.items():
        imported = {i.split(".")[0] for i in GRAPH[name]}
        assert imported <= allowed, (name, imported - allowed)
    for name in LAYERS[0]:
        assert {i.split(".")[0] for i in GRAPH[name]} <= set(LAYERS[0]), name


def test_own_imports_are_at_the_top_but_a_few_that_say_why():
    """The library's modules import at their top (a few exceptions say why); a command imports its library in main,
    after its flags are parsed and checked (test_a_command_module_imports_only_the_flags_layer_at_its_top)."""
    inside = [f"sweet_jax/{MODULES[name].relative_to(PACKAGE)}:{line}: {text.strip()}"
              for name, path in MODULES.items() if not name.startswith("commands.")
              for _, in_function, line, text in own_imports(path) if in_function]
    assert len(inside) < MAX_FUNCTION_LEVEL_IMPORTS, inside
    without_reason = [entry for entry in inside if "#" not in entry]
    assert not without_reason, without_reason


# What a command module may import at its top: the flag parsing and the configs' schema, none of which imports jax,
# Flax or transformers (the configs load without them).
FLAGS_LAYER = {"cli", "errors", "config_utils", "commands", "jsonl"}


def test_a_command_module_imports_only_the_flags_layer_at_its_top():
    """--help, a misspelt flag and a missing file answer before the library (jax, Flax, transformers) is imported:
    a command's own imports of the library are inside its functions, each saying why."""
    for name in cli.COMMANDS:
        path = PACKAGE / "commands" / f"{name}.py"
        imports = own_imports(path)
        top = {imported for imported, in_function, _, _ in imports if not in_function}
        assert {m.split(".")[0] for m in top} <= FLAGS_LAYER, (name, top)
        unexplained = [text for _, in_function, _, text in imports if in_function and "#" not in text]
        assert not unexplained, (name, unexplained)
        tree = ast.parse(path.read_text())
        top_modules = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names} | {
            n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
        others = top_modules - {"sweet_jax", "__future__", "absl", "ml_collections"} - set(sys.stdlib_module_names)
        assert not others, (name, others)


def test_other_imports_are_at_the_top_but_lazy_ones_and_the_sandbox_s_that_say_why():
    """Heavy or optional third-party packages load on first use in one place, sweet_jax/lazy.py; the sandbox
    package (the standard library and numpy only, no sweet_jax module) keeps its own, each saying why."""
    inside = {f"sweet_jax/{path.relative_to(PACKAGE)}:{line}: {text}"
              for name, path in MODULES.items() if name != "lazy"
              for line, text in other_imports_in_functions(path)}
    # the sandbox's workers and the chat-template renderer's child set their limits before they import
    outside_sandbox = [entry for entry in inside
                       if not entry.startswith(("sweet_jax/sandbox/", "sweet_jax/data/_template_worker.py"))]
    assert not outside_sandbox, outside_sandbox
    assert all("#" in entry for entry in inside), inside
    assert [text for _, text in other_imports_in_functions(PACKAGE / "lazy.py")] == [], \
        "lazy.py imports through importlib.import_module, so that its functions are the only place"


def test_every_command_is_a_module_of_commands_with_main_flags_and_help_configs():
    for name in cli.COMMANDS:
        tree = ast.parse((PACKAGE / "commands" / f"{name}.py").read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert {"main", "define_flags", "HELP_CONFIGS"} <= defined, (name, defined)


def test_every_command_keeps_its_old_module_name():
    """`python -m sweet_jax.NAME` finds a module for every command (train and pipeline: the packages' __main__.py;
    the others: sweet_jax.old_names)."""
    for name in cli.COMMANDS:
        spec = importlib.util.find_spec(f"sweet_jax.{name}")
        assert spec is not None, name
        if spec.submodule_search_locations is not None:  # a package: runpy runs its __main__
            assert importlib.util.find_spec(f"sweet_jax.{name}.__main__") is not None, name


def test_a_missing_optional_package_says_which_feature_needs_it_and_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "selenium.webdriver", None)  # what importing an absent package does
    with pytest.raises(ImportError, match=r"the frontend track's browser needs .*'selenium'.*pip install selenium"):
        lazy.selenium_webdriver()


def test_plots_draw_to_files_on_the_agg_backend():
    assert lazy.pyplot().get_backend().lower() == "agg"
