"""Every command line in README.md, docs/*.md and BENCHMARKS.md is true as written.

The code blocks are read as shell: each `python -m sweet_jax.NAME` / `sweet-jax NAME` line must name a module
that runs (`--help` answers), use only flags that command has (and its required ones), and its
`--config FILE[:PRESET]` plus every `--config.a.b=VALUE` must load through ml_collections' config flags, as the
command itself loads them (the overrides applied, nothing run). Lines that need a TPU, a GPU or the network get
these same checks and no more; other commands (bench scripts, launch_tpu.sh, pytest, pip extras) are checked
against the files they name. The commands are found through their public entry points only (`python -m`,
`cli.COMMANDS`), never through the path of the module that implements them.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from sweet_jax import cli

# ml_collections loads config files with importlib's deprecated load_module (its concern, not the documents').
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "BENCHMARKS.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))
# Tokens that name a file of this repository; each must exist.
REPO_PREFIXES = ("sweet_jax/", "configs/", "bench/", "tests/", "tools/", "docs/")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}


# ==========================================================================================================
# Reading the documents
# ==========================================================================================================

SHELL_FENCES = ("", "bash", "sh", "shell")  # other fences (```text for output, ```python) hold no command lines


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every shell block: fenced (```bash, or no language) or indented by 4 spaces
    after a blank line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            language = line.lstrip()[3:].strip()
            start, body = i + 2, []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            if language in SHELL_FENCES:
                blocks.append((start, body))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and line.strip():
            start, body = i + 1, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append((start, body))
            continue
        i += 1
    return blocks


def commands_of_block(start: int, body: list[str]) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each simple command of a shell block: continuation lines joined, comments dropped,
    split at ; && || | &, `VAR=value` assignments and `for VAR in FIRST ...` loops expanded (a loop variable takes
    its first value)."""
    logical: list[tuple[int, str]] = []
    pending, pending_line = "", 0
    for offset, line in enumerate(body):
        if not pending:
            pending_line = start + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append((pending_line, pending + line))
        pending = ""
    if pending:
        logical.append((pending_line, pending))

    variables: dict[str, str] = {}
    out = []
    for number, line in logical:
        for name, value in variables.items():
            line = re.sub(r"\$\{?" + name + r"\b\}?", lambda _m, v=value: v, line)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError as e:
            out.append((number, ["<unparsable>", f"{e}: {line.strip()}"]))
            continue
        command: list[str] = []
        for token in tokens + [";"]:
            if token not in SEPARATORS:
                command.append(token)
                continue
            while command and command[0] in ("do", "then", "else", "done", "fi"):
                command = command[1:]
            if len(command) >= 4 and command[0] == "for" and command[2] == "in":
                variables[command[1]] = command[3]
            elif len(command) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                name, _, value = command[0].partition("=")
                variables[name] = value
            elif command:
                out.append((number, command))
            command = []
    return out


def documented_commands(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """('FILE:LINE', argv) of every command in the document's code blocks."""
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return [(f"{name}:{number}", argv) for start, body in code_blocks(path.read_text())
            for number, argv in commands_of_block(start, body)]


# ==========================================================================================================
# What each command accepts, asked from the command itself
# ==========================================================================================================

@functools.lru_cache(maxsize=None)
def command_help(module: str) -> tuple[str | None, str]:
    """(None, help text) of `python -m MODULE --help`, or (the reason it does not run, '')."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        return f"{module} cannot be imported ({e})", ""
    if spec is None:
        return f"no module {module}", ""
    if spec.submodule_search_locations is not None and importlib.util.find_spec(module + ".__main__") is None:
        return f"{module} is a package without __main__: `python -m {module}` cannot run it", ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    if done.returncode != 0:
        return f"`python -m {module} --help` exits {done.returncode}: {done.stderr.strip()[-300:]}", ""
    return None, done.stdout


@functools.lru_cache(maxsize=None)
def command_flags(module: str) -> tuple[str | None, frozenset, frozenset, str | None]:
    """(error, the flags it takes, those it requires, its default --config) from its --help: absl commands list
    theirs under 'flags:' (`  --name: help (default configs/x.py:p)`), argparse ones in their usage lines."""
    error, text = command_help(module)
    if error:
        return error, frozenset(), frozenset(), None
    if "\nflags:\n" in text:
        section = text.split("\nflags:\n", 1)[1].split("\n\n", 1)[0]
        names = frozenset(re.findall(r"^  --(\w+):", section, re.M))
        default = re.search(r"^  --config:.*\(default (configs/\S+?:\S+?)\)$", section, re.M)
        return None, names | {"help"}, frozenset(), default.group(1) if default else None
    usage = text.split("\n\n", 1)[0]
    names = frozenset(n.replace("-", "_") for n in re.findall(r"--([\w-]+)", usage))
    bare = usage
    while re.search(r"\[[^\[\]]*\]", bare):
        bare = re.sub(r"\[[^\[\]]*\]", "", bare)
    required = frozenset(n.replace("-", "_") for n in re.findall(r"--([\w-]+)", bare))
    return None, names | {"help"}, required, None


def load_config(value: str, overrides: list[str]) -> str | None:
    """Load `--config VALUE` with the `--config.a.b=v` overrides the way every command does (ml_collections'
    config_flags over the file's get_config(preset)); None when that works, else why not."""
    file, _, preset = value.partition(":")
    path = pathlib.Path(file) if pathlib.Path(file).is_absolute() else REPO / file
    if not path.is_file():
        return f"config file {file} does not exist"
    argv = ["prog", f"--config={path}:{preset}" if preset else f"--config={path}"] + overrides
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    try:
        values(argv)
        values.config.keys()  # a file or preset that failed to load raises on first use
    except Exception as e:  # noqa: BLE001 - every failure of the real parse is a wrong line
        text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() is a repr
        lines = [line for line in str(text).strip().splitlines() if line.strip()]
        return f"--config {value} {' '.join(overrides)}: {lines[-1] if lines else type(e).__name__}"
    return None


def sweet_jax_invocation(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) where argv runs a sweet_jax command, possibly behind a wrapper
    (`bash launch_tpu.sh ... -- python -m ...`, `/usr/bin/time python -m ...`)."""
    for i, token in enumerate(argv):
        if pathlib.Path(token).name in ("python", "python3") and argv[i + 1:i + 2] == ["-m"] and i + 2 < len(argv) \
                and argv[i + 2].split(".")[0] == "sweet_jax":
            return argv[i + 2], argv[i + 3:]
        if token == "sweet-jax":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                return "sweet_jax.cli", argv[i + 1:]
            name = argv[i + 1].replace("-", "_")
            if name not in cli.COMMANDS:
                return f"sweet-jax {argv[i + 1]} (not one of cli.COMMANDS)", []
            return f"sweet_jax.{name}", argv[i + 2:]
    return None


# ==========================================================================================================
# The checks
# ==========================================================================================================

def check_sweet_jax(module: str, args: list[str]) -> list[str]:
    error, names, required, default_config = command_flags(module)
    if error:
        return [error]
    problems, config, overrides, given = [], None, [], set()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("--config."):
            name, eq, value = arg[len("--config."):].partition("=")
            if not eq:  # `--config.a.b VALUE`
                value = args[i + 1] if i + 1 < len(args) else ""
                i += 1
            overrides.append(f"--config.{name.replace('-', '_')}={value}")
        elif arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            name = name.replace("-", "_")
            given.add(name)
            if name not in names:
                problems.append(f"{module} has no flag --{name} (its flags: {', '.join(sorted(names))})")
            if name == "config":
                config = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        i += 1
    if "help" in given:
        return problems
    problems += [f"{module} requires --{name}" for name in sorted(required - given)]
    if config is None and (overrides or default_config):
        config = default_config
        if config is None:
            problems.append(f"{module}: --config.* overrides without --config (the command has no default config)")
    if config is not None:
        problem = load_config(config, overrides)
        if problem:
            problems.append(problem)
    return problems


def check_repo_files(argv: list[str]) -> list[str]:
    problems = []
    for token in argv:
        for part in [token] + token.split("=")[1:]:
            if part.startswith(REPO_PREFIXES) and not re.search(r"[*?{}]|[A-Z]{2,}", part):
                file = part.split(":")[0].rstrip("/")  # configs/x.py:PRESET, tests/x.py::test
                if not (REPO / file).exists():
                    problems.append(f"{file} does not exist in the repository")
    return problems


@functools.lru_cache(maxsize=None)
def extras() -> frozenset:
    """The extras of pyproject.toml's [project.optional-dependencies] (read as text: tomllib is Python >= 3.11)."""
    section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1]
    return frozenset(re.findall(r"^([\w-]+) = \[", section.split("\n[", 1)[0], re.M))


def check_command(argv: list[str]) -> list[str]:
    """What is wrong with one documented command ([] when nothing is)."""
    if argv[0] == "<unparsable>":
        return [f"not valid shell: {argv[1]}"]
    problems = check_repo_files(argv)
    invocation = sweet_jax_invocation(argv)
    if invocation is not None:
        module, args = invocation
        if module.startswith("sweet-jax "):
            return problems + [module]
        return problems + check_sweet_jax(module, args)
    for i, token in enumerate(argv):
        script = REPO / token
        if token.endswith((".py", ".sh")) and token.startswith(("bench/", "tools/", "launch_tpu")) and i > 0:
            if not script.is_file():
                return problems + [f"{token} does not exist"]
            source = script.read_text()
            for arg in argv[i + 1:]:
                if arg == "--":
                    break
                name = arg[2:].split("=")[0] if arg.startswith("--") else None
                if name and not re.search(r"(?<![\w-])--" + re.escape(name) + r"(?![\w-])", source):
                    problems.append(f"{token} has no option --{name}")
            return problems
    if argv[:2] == ["pip", "install"]:
        for token in argv[2:]:
            match = re.fullmatch(r"\.\[([\w,-]+)\]", token)
            for extra in (match.group(1).split(",") if match else []):
                if extra not in extras():
                    problems.append(f"pyproject.toml has no extra [{extra}] (extras: {', '.join(sorted(extras()))})")
    return problems


# ==========================================================================================================
# Tests
# ==========================================================================================================

@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_command_of_the_document_is_true(document):
    commands = documented_commands(REPO / document)
    problems = [f"{where}: {problem}\n    {shlex.join(argv)}" for where, argv in commands
                for problem in check_command(argv)]
    assert not problems, f"{len(problems)} documented command(s) are not true:\n" + "\n".join(problems)


def test_the_readme_runs_sweet_jax_commands():
    """The extraction finds what the quick start and the recipes show (an empty list would check nothing)."""
    modules = {sweet_jax_invocation(argv)[0] for _, argv in documented_commands(REPO / "README.md")
               if sweet_jax_invocation(argv)}
    assert {"sweet_jax.train", "sweet_jax.pipeline"} <= modules


def test_shell_blocks_are_read_as_a_shell_reads_them():
    block = ["# a comment", "L=\"--topology local --config.model.scan_layers=True\"",
             "python -m sweet_jax.plan --config configs/critic.py:llama3_8b $L \\",
             "    --config.train.micro_batch_size=2   # M = 2",
             "for s in 1 2; do",
             "  python -m sweet_jax.pipeline --config configs/pipeline.py:demo --workdir runs/demo_seed$s",
             "done",
             "bash launch_tpu.sh --dry-run -- python -m sweet_jax.train --config configs/critic.py:demo"]
    got = commands_of_block(10, block)
    assert got[0] == (12, ["python", "-m", "sweet_jax.plan", "--config", "configs/critic.py:llama3_8b",
                           "--topology", "local", "--config.model.scan_layers=True",
                           "--config.train.micro_batch_size=2"])
    assert got[1][1][-1] == "runs/demo_seed1"
    assert sweet_jax_invocation(got[2][1]) == ("sweet_jax.train", ["--config", "configs/critic.py:demo"])


def test_shell_blocks_are_fenced_or_indented_and_output_blocks_are_not_read():
    text = ("intro\n\n    python -m sweet_jax.train --help\n\nprose\n```bash\nsweet-jax rank --help\n```\n"
            "```text\n10:00 I sweet_jax.train: done\n```\n```python\nfrom sweet_jax import models\n```\n")
    assert [body for _, body in code_blocks(text)] == [["python -m sweet_jax.train --help", ""],
                                                       ["sweet-jax rank --help"]]


@pytest.mark.parametrize("line, expected", [
    ("python -m sweet_jax.train --config configs/critic.py:demo --workdir /tmp/w", None),
    ("sweet-jax train --config configs/policy.py:demo_rft --config.train.num_steps=3 --workdir W", None),
    ("python -m sweet_jax.rank --config.num_candidates=4", None),  # the command's default config
    ("python -m sweet_jax.trainn --config configs/critic.py:demo", "no module sweet_jax.trainn"),
    ("sweet-jax trian --config configs/critic.py:demo", "not one of cli.COMMANDS"),
    ("python -m sweet_jax.train --config configs/critic.py:nope --workdir W", "nope"),
    ("python -m sweet_jax.train --config configs/nope.py:demo --workdir W", "does not exist"),
    ("python -m sweet_jax.train --config configs/critic.py:demo --config.train.num_stepz=3", "num_stepz"),
    ("python -m sweet_jax.train --config configs/critic.py:demo --config.train.num_steps=many", "num_steps"),
    ("python -m sweet_jax.train --config configs/critic.py:demo --work_dir W", "no flag --work_dir"),
    ("python -m sweet_jax.train --config.train.num_steps=3", "without --config"),
    ("python -m sweet_jax.pipeline_report runs/a runs/b", "requires --out"),
    ("python -m sweet_jax.evaluate sweet_jax/data/demo/nope.jsonl --out x", "does not exist in the repository"),
    ("python bench/bench_sampler.py --no-such-option", "has no option --no-such-option"),
    ("python bench/bench_nope.py", "does not exist"),
    ("pip install -e '.[tpuu]'", "no extra [tpuu]"),
])
def test_the_checker_refuses_wrong_lines(line, expected):
    (_, argv), = commands_of_block(1, [line])
    problems = check_command(argv)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


# ==========================================================================================================
# Links between the documents
# ==========================================================================================================

def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(path: pathlib.Path) -> list[str]:
    """Relative links `[text](file#anchor)` of a document whose file or heading does not exist."""
    problems = []
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            problems.append(f"{path.name}: link to {target}: {file} does not exist")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{path.name}: link to {target}: no heading #{anchor} in {linked.name}")
    return problems


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_link_of_the_document_leads_to_a_file_and_heading(document):
    assert broken_links(REPO / document) == []


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one\n\n## Two (x >= 1)\n\n[ok](#two-x--1) [bad](#three) [gone](b.md)\n")
    assert anchors(tmp_path / "a.md") == {"title-one", "two-x--1"}
    assert broken_links(tmp_path / "a.md") == ["a.md: link to #three: no heading #three in a.md",
                                                "a.md: link to b.md: b.md does not exist"]


# ==========================================================================================================
# docs/configuration.md: the field tables are the configs' fields
# ==========================================================================================================

# heading of a table in docs/configuration.md -> the config (file:preset) whose fields it lists, and the prefix
# its rows leave out
FIELD_TABLES = {
    "## Training fields": ("configs/critic.py:demo", ""),
    "## Ranking fields": ("configs/rank.py:demo", ""),
    "## Rollout fields": ("configs/rollout.py:demo", ""),
    "## The policy's inference engine": ("configs/rank.py:demo", ""),
    "## Pipeline fields": ("configs/pipeline.py:demo", ""),
    "Each training stage": ("configs/pipeline.py:demo", "critic."),
    "## Frontend additions": ("configs/frontend.py:frontend_demo", ""),
}


def loaded_config(value: str):
    argv = ["prog", f"--config={REPO / value}"]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def config_leaves(config, prefix: str = "") -> set[str]:
    out = set()
    for key in config.keys():
        value = config[key]
        out |= config_leaves(value, f"{prefix}{key}.") if hasattr(value, "keys") else {f"{prefix}{key}"}
    return out


def documented_fields(text: str) -> dict[str, list[str]]:
    """Table heading -> the fields its rows name (the first column, in backquotes)."""
    tables: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        current = next((h for h in FIELD_TABLES if line.startswith(h)), current)
        match = re.match(r"\| `([\w.]+)` \|", line)
        if match and current:
            tables.setdefault(current, []).append(match.group(1))
    return tables


def test_every_field_in_the_configuration_page_exists_and_every_field_is_there():
    tables = documented_fields((REPO / "docs" / "configuration.md").read_text())
    assert set(tables) == set(FIELD_TABLES), "a field table of docs/configuration.md is missing or renamed"
    unknown, documented = [], {}
    for heading, fields in tables.items():
        config, prefix = FIELD_TABLES[heading]
        leaves = config_leaves(loaded_config(config))
        documented.setdefault(config, set()).update(prefix + f for f in fields)
        unknown += [f"{heading}: {prefix}{f} is not a field of {config}" for f in fields if prefix + f not in leaves]
    assert not unknown, "\n".join(unknown)
    # Every field is documented: the pipeline's stage blocks share the stage table, its metrics block is the
    # training one's, the frontend table lists only what configs/frontend.py adds.
    stage_fields = {f.split(".")[-1] for f in documented["configs/pipeline.py:demo"] if f.startswith("critic.")}
    missing = []
    for config in ("configs/critic.py:demo", "configs/rank.py:demo", "configs/rollout.py:demo", "configs/pipeline.py:demo"):
        for leaf in sorted(config_leaves(loaded_config(config)) - documented[config]):
            block, _, name = leaf.rpartition(".")
            if config.startswith("configs/pipeline.py") and (
                    (block in ("critic", "sweet", "mtdpo", "rft", "init.sft") and name in stage_fields)
                    or block == "metrics"):
                continue
            if block == "policy.openai" and leaf in documented["configs/rank.py:demo"]:
                continue
            missing.append(f"{config}: {leaf}")
    assert not missing, "fields missing from docs/configuration.md:\n" + "\n".join(missing)


@pytest.mark.parametrize("first_run, out, header, intervals_end", [
    ("select_seed0", "select_mean", "| SmolLM2-135M-Instruct, SFT start |", None),
    ("discovery_seed0/state", "discovery_mean", "| SmolLM2-135M-Instruct, SFT start, discovery family |",
     "**The lookup family**"),
    ("lookup_seed0/state", "lookup_mean", "| SmolLM2-135M-Instruct, SFT start, lookup family |",
     "**Both families")])
def test_the_readme_s_results_commands_run_as_written_from_another_directory_and_give_their_tables(
        tmp_path, first_run, out, header, intervals_end):
    """The README's result tables are `python -m sweet_jax.pipeline_report bench/results/... --out runs/...`, paths
    relative to where it runs: run as written from a directory holding bench/results (here a link to the
    checkout's), each writes its runs/<out> there and prints the README's numbers (and the paired intervals the
    README quotes between the table and intervals_end)."""
    readme = (REPO / "README.md").read_text()
    line = re.search(rf"`(python -m sweet_jax\.pipeline_report bench/results/{first_run} [^`]*)`", readme).group(1)
    (tmp_path / "bench").symlink_to(REPO / "bench")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(shlex.split(line.replace("python", sys.executable, 1)), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / out / "results.md").is_file()
    numbers = lambda text: re.findall(r"\d+\.\d ± \d+\.\d", text)  # noqa: E731
    table = readme.split(header, 1)[1].split("\n\n", 1)[0]
    assert numbers(table) and numbers(proc.stdout)[:len(numbers(table))] == numbers(table)
    if intervals_end:
        intervals = lambda text: re.findall(r"[-+]\d+\.\d \[[-+]\d+\.\d, [-+]\d+\.\d\]", text)  # noqa: E731
        quoted = intervals(readme.split(header, 1)[1].split(intervals_end, 1)[0])
        assert len(quoted) == 4 and set(quoted) <= set(intervals(proc.stdout)), (quoted, intervals(proc.stdout))
