"""The layering of the package, read from the source with ast: command-line programs sit on top of library
modules and do not import each other; the JSONL and command-line harness modules sit at the bottom."""
from __future__ import annotations

import ast
import pathlib

import sweet_jax
from sweet_jax import cli

PACKAGE = pathlib.Path(sweet_jax.__file__).resolve().parent
PROGRAMS = set(cli.COMMANDS)
BOTTOM = {"jsonl": {"errors"}, "errors": set(), "cli": {"errors", "host_malloc"}}


def sweet_jax_imports(path: pathlib.Path) -> set[str]:
    """The sweet_jax modules a file imports anywhere (top level or inside functions), as dotted names
    relative to the package ('data.schema', 'train')."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name[len("sweet_jax."):] for a in node.names if a.name.startswith("sweet_jax.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sweet_jax":
                out |= {a.name for a in node.names}
            elif node.module.startswith("sweet_jax."):
                out.add(node.module[len("sweet_jax."):])
    return out


def test_no_program_imports_another_program():
    found = set()
    for program in PROGRAMS:
        for imported in sweet_jax_imports(PACKAGE / f"{program}.py"):
            top = imported.split(".")[0]
            if top in PROGRAMS and top != program:
                found.add((program, top))
    assert not found, sorted(found)


def test_library_modules_import_no_program():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
        if name in PROGRAMS or name == "cli":
            continue
        for imported in sweet_jax_imports(path):
            if imported.split(".")[0] in PROGRAMS:
                offenders.append(f"{name} imports {imported}")
    assert not offenders, offenders


def test_the_bottom_modules_import_only_the_bottom():
    for name, allowed in BOTTOM.items():
        imported = {i.split(".")[0] for i in sweet_jax_imports(PACKAGE / f"{name}.py")}
        assert imported <= allowed, (name, imported - allowed)
