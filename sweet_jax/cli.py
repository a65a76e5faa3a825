"""The one command-line harness of every entry point, and the `sweet-jax COMMAND` console script.

Every `python -m sweet_jax.NAME` ends in `cli.run(main, ...)`, which
  - re-executes once with the host allocator (host_malloc) where the command computes,
  - keeps a CPU host quiet: no TPU probe (JAX_PLATFORMS=cpu where no accelerator device exists), no libtpu,
    TensorFlow or transformers advisory lines,
  - finds `--config configs/NAME.py:PRESET` from any working directory and after any install (the presets ship
    inside the package as sweet_jax.configs; a path that exists where the command runs wins),
  - answers `--help` with what a user sets: the command's flags, the config's presets and its fields,
  - logs through one handler that writes above a progress bar, not through it (tqdm.write),
  - turns every user mistake into one line `error: ...` and exit status 2, never a traceback
    (SWEET_JAX_DEBUG=1 shows the traceback); Ctrl-C is one line and exit status 130.

Commands that take a config (absl flags + ml_collections) pass `define_flags`; the others parse their own
argv with `cli.ArgumentParser` (argparse whose errors are one line, exit 2).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import inspect
import io
import logging
import os
import pathlib
import runpy
import sys
import textwrap
import threading
import tokenize
import traceback
from typing import Any, Callable, Sequence

import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from tqdm import tqdm

from sweet_jax import host_malloc
from sweet_jax.errors import SweetJaxError, exit_with_error, storage_failure

COMMANDS = ("train", "export", "plan", "rollout", "rank", "serve", "evaluate", "pipeline", "pipeline_report",
            "pipeline_diagnostics")
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
DEBUG_VAR = "SWEET_JAX_DEBUG"


class RunInterrupted(Exception):
    """A run stopped on a signal after saving what it had (exit status 128 + the signal's number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# ==========================================================================================================
# Before anything heavy is imported
# ==========================================================================================================

def quiet_environment(environ=os.environ, *, dev: str = "/", platform: str = sys.platform) -> None:
    """Environment variables that silence advisory output of the libraries below us (each one only if the user
    has not set it): transformers' "PyTorch was not found", TensorFlow's C++ info lines (epath and tfds import it).

    On a Linux host without a TPU or GPU device node (`dev`: the root to look under, for tests), JAX_PLATFORMS=cpu:
    with libtpu installed (the planner's extra) jax would otherwise load it and probe for TPU chips at its first
    use, which costs a second and, while another process holds /tmp/libtpu_lockfile, prints libtpu's error with
    its '=== Source Location Trace' on stderr. Without a device node the CPU is all jax can use there anyway."""
    environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow only reads files here (epath's gs://, tfds); its oneDNN notice ignores TF_CPP_MIN_LOG_LEVEL
    environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if platform.startswith("linux") and "JAX_PLATFORMS" not in environ:
        if not host_malloc.accelerator_present(dev):
            environ["JAX_PLATFORMS"] = "cpu"


def configs_dir() -> pathlib.Path | None:
    """Where the bundled presets live: the installed sweet_jax.configs package, else the source checkout's
    configs/ next to sweet_jax/ (running from a clone without installing it)."""
    try:
        spec = importlib.util.find_spec("sweet_jax.configs")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(list(spec.submodule_search_locations)[0])
    checkout = PACKAGE_DIR.parent / "configs"
    return checkout if checkout.is_dir() else None


def resolve_config(value: str, cwd: pathlib.Path | None = None) -> str:
    """`configs/critic.py:demo` -> a path that exists: as given when it exists (relative to `cwd`), else the
    bundled file of that name. Anything else is returned unchanged (and reported by the flag parser)."""
    file, sep, preset = value.partition(":")
    given = pathlib.Path(file)
    if (given if given.is_absolute() else (cwd or pathlib.Path.cwd()) / given).exists():
        return value
    bundled = configs_dir()
    if bundled is not None and given.parent.name in ("configs", "") and (bundled / given.name).is_file():
        return f"{bundled / given.name}{sep}{preset}"
    return value


def resolve_config_args(argv: Sequence[str]) -> list[str]:
    """argv with the value of --config (either `--config=V` or `--config V`) resolved by resolve_config."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg[len("--config="):])
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
    return out


def default_preset_note(argv: Sequence[str]) -> str | None:
    """A `--config FILE` without `:PRESET` runs the file's default preset: say which, so that a run is never the
    demo by accident. None when a preset is named (or there is no --config)."""
    value = next((a[len("--config="):] for a in argv if a.startswith("--config=")), None)
    if value is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
        value = argv[argv.index("--config") + 1]
    if not value or ":" in value or not pathlib.Path(value).is_file():
        return None
    try:
        default = inspect.signature(_load_config_module(pathlib.Path(value)).get_config).parameters["preset"].default
    except (Exception, SystemExit):  # noqa: BLE001 - the flag parser reports a broken file
        return None
    presets = getattr(_load_config_module(pathlib.Path(value)), "PRESETS", None)
    shown = pathlib.Path(value).name
    return (f"--config configs/{shown} names no preset: running its default preset {default!r} "
            f"(name one as configs/{shown}:PRESET{'; presets: ' + ', '.join(presets) if presets else ''})")


# ==========================================================================================================
# Logging: one handler, above the progress bars
# ==========================================================================================================

class _BarSafeHandler(logging.Handler):
    """Writes each record with tqdm.write: a live progress bar is cleared, the line printed, the bar redrawn."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    """sweet_jax's loggers at `level`, every other library's at WARNING (Orbax logs each file operation at INFO,
    jax each backend it probes), all through one bar-safe handler with a short prefix."""
    handler = _BarSafeHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("sweet_jax").setLevel(level)
    logging.getLogger("__main__").setLevel(level)  # a command's own `logging.getLogger(__name__)`
    for name in ("absl", "jax._src.xla_bridge", "jax._src.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    absl_logging.get_absl_handler().setLevel(logging.CRITICAL + 1)  # absl's own would print each record again


# ==========================================================================================================
# Errors
# ==========================================================================================================

def guarded(body: Callable[[], Any]) -> Any:
    """Run a command's body: a user mistake -> one line on stderr and exit 2; Ctrl-C -> one line and exit 130;
    a run stopped by a signal -> its exit status. Other exceptions (bugs) keep their traceback."""
    try:
        return body()
    except SweetJaxError as e:
        _debug_traceback()
        exit_with_error(str(e))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        _debug_traceback()
        what = {FileNotFoundError: "does not exist", IsADirectoryError: "is a directory, not a file",
                NotADirectoryError: "is not a directory", PermissionError: "is not readable (permission denied)"}
        exit_with_error(f"{e.filename}: {what[type(e)]}" if e.filename else str(e))
    except RunInterrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 — a full disk or unreachable storage is one line; other errors keep
        message = storage_failure(e)  # their traceback
        if message is None:
            raise
        _debug_traceback()
        exit_with_error(message)
    except KeyboardInterrupt:
        _debug_traceback()
        print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)


def _debug_traceback() -> None:
    if os.environ.get(DEBUG_VAR):
        traceback.print_exc()


_console_name: str | None = None  # `sweet-jax NAME`, set by main (runpy replaces sys.argv[0] with the module's file)


def console_name() -> str | None:
    """`sweet-jax NAME` when the command was started by the console script (cli.main), else None."""
    return _console_name


def as_invoked(text: str) -> str:
    """`python -m sweet_jax.NAME` in a usage text written as the user typed the command (`sweet-jax NAME`)."""
    name = console_name()
    return text.replace(f"python -m sweet_jax.{name.split()[1]}", name) if name else text


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`error: ... (see --help)`) with exit status 2, and whose options
    take both spellings, as every command's: `--served_model_name` (the one documented) and `--served-model-name`.
    An unknown flag is named as such (with the closest known one) before any missing required flag: `--modle X`
    is a typo of --model, not a missing --model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if console_name():
            self.prog = console_name()
        if self.description:
            self.description = as_invoked(self.description)

    def error(self, message: str):
        exit_with_error(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        known = [s for action in self._actions for s in action.option_strings]
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if name.startswith("--") and name not in known and not any(k.startswith(name) for k in known):
                near = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1)
                self.error(f"unrecognized argument {name}{f' (did you mean {near[0]}?)' if near else ''}")
        return super().parse_args(args, namespace)

    def add_argument(self, *names, **kwargs):
        spellings = []
        for name in names:
            if name.startswith("--"):
                underscored = "--" + name[2:].replace("-", "_")
                spellings += [underscored] + ([] if underscored == name else [name])
                dashed = "--" + name[2:].replace("_", "-")
                spellings += [] if dashed in spellings else [dashed]
            else:
                spellings.append(name)
        return super().add_argument(*spellings, **kwargs)


def require_path(flag: str, path: str | None, *, directory: bool = False) -> None:
    """A SweetJaxError unless `path` (the value of `flag`) exists (as a directory when `directory`): what a command
    checks before it imports the library, so that a mistyped path answers in a second. Remote paths (gs://...)
    are left to the library."""
    if not path or "://" in path or os.path.exists(os.path.expanduser(path)) and (
            not directory or os.path.isdir(os.path.expanduser(path))):
        return
    where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
    what = "is not a directory" if os.path.exists(os.path.expanduser(path)) else "does not exist"
    raise SweetJaxError(f"{flag} {path}: {what}{where}")


def interruptible(body: Callable[[], Any]) -> Any:
    """body() in a worker thread, its result or exception returned here, so that Ctrl-C acts at once even while
    the body is inside a long C++ call that holds the main thread (XLA compiling for minutes): the command line
    then says so and exits 130 without waiting for the call (what it computed is lost; it wrote nothing)."""
    outcome: dict[str, Any] = {}

    def work():
        try:
            outcome["value"] = body()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            outcome["error"] = e

    worker = threading.Thread(target=work, name="sweet_jax-interruptible", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # the worker may be inside XLA: no interpreter shutdown that would wait for it
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def flag_spellings(argv: Sequence[str]) -> list[str]:
    """argv with every flag name written with underscores (`--accept-config-change` -> `--accept_config_change`,
    `--config.train.num-steps=3` -> `--config.train.num_steps=3`): absl and the config fields know only the
    underscored names; values are left as they are, and so is everything after a bare `--`."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


# ==========================================================================================================
# --help for the config commands
# ==========================================================================================================

def _load_config_module(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"_sweet_jax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def field_comments(*paths: pathlib.Path) -> dict[str, str]:
    """What each config field means, read from where it is created: `c.data.max_len = 1024  # tokens per
    sequence` in a config file (or config_utils.base_config) -> {'data.max_len': 'tokens per sequence'}."""
    comments: dict[str, str] = {}
    for path in paths:
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        except (OSError, SyntaxError, tokenize.TokenError):
            continue
        by_line: dict[int, list] = {}
        for tok in tokens:
            by_line.setdefault(tok.start[0], []).append(tok)
        for line in by_line.values():
            words = [t for t in line if t.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL,
                                                       tokenize.NEWLINE)]
            if len(words) < 5 or words[-1].type != tokenize.COMMENT or words[0].type != tokenize.NAME:
                continue
            names, i = [], 1  # `c` `.` NAME (`.` NAME)* `=`
            while i + 1 < len(words) and words[i].string == "." and words[i + 1].type == tokenize.NAME:
                names.append(words[i + 1].string)
                i += 2
            if names and i < len(words) and words[i].string == "=":
                comments.setdefault(".".join(names), words[-1].string.lstrip("#").strip())
    return comments


def _leaves(config, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(config.keys()):
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_fields_text(config, comments: dict[str, str] | None = None, *, only: set[str] | None = None,
                       width: int = 110) -> str:
    """Every field of a config (or those in `only`), one a line: `  section.field=value   what it is`."""
    comments = comments or {}
    leaves = {k: v for k, v in _leaves(config).items() if only is None or k in only}
    column = min(max((len(f"{k}={v!r}") for k, v in leaves.items()), default=0) + 4, 44)
    lines = []
    for key, value in leaves.items():
        setting = f"  {key}={value!r}"
        comment = comments.get(key, "")
        if not comment:
            lines.append(setting)
            continue
        pad = setting.ljust(column) if len(setting) < column else setting + "  "
        lines.append(textwrap.fill(comment, width, initial_indent=pad, subsequent_indent=" " * len(pad))
                     if len(pad) < width - 20 else pad + comment)
    return "\n".join(lines)


def config_help(config_arg: str | None, default_files: Sequence[str]) -> str:
    """The presets (the config file's docstring) and the fields of the chosen (or default) preset, with what
    each means (the comments where the fields are created); a second config file's fields only where its
    preset's values differ from the first one's."""
    out = []
    files = [config_arg] if config_arg else list(default_files)
    shown_leaves: dict[str, Any] | None = None
    for value in files:
        file, _, preset = resolve_config(value).partition(":")
        path = pathlib.Path(file)
        if not path.is_file():
            out.append(f"config {value}: no such file")
            continue
        module = _load_config_module(path)
        shown = value.partition(":")[0]
        out.append(f"--config {shown}:PRESET\n" + textwrap.indent((module.__doc__ or "").strip(), "  "))
        try:
            config = module.get_config(preset) if preset else module.get_config()
        except Exception as e:  # noqa: BLE001 - an unknown preset: say so, still print the rest
            out.append(f"  ({e})")
            continue
        leaves = _leaves(config)
        # The shared training fields are defined (and explained) in config_utils; a preset's own comments say
        # why it sets a value, so the definition's comment wins.
        comments = field_comments(PACKAGE_DIR / "config_utils.py", path)
        name = f"{shown}:{preset or '(default)'}"
        if shown_leaves is not None and set(leaves) == set(shown_leaves):
            differ = {k for k, v in leaves.items() if shown_leaves[k] != v}
            out.append(f"fields of {name}: as above, except\n" + config_fields_text(config, comments, only=differ))
            continue
        shown_leaves = leaves
        out.append(f"fields of {name} (set any with --config.SECTION.FIELD=VALUE):\n"
                   + config_fields_text(config, comments))
    return "\n\n".join(out)


def define_accept_config_change(record: str) -> None:
    """The --accept_config_change flag of every command that writes results (rundir.record_config's rule)."""
    flags.DEFINE_bool("accept_config_change", False, "rerun on results made with another config: go on with the "
                      f"new values (the change is recorded in {record}); without it such a rerun is refused")


def _flag_lines(names: Sequence[str]) -> str:
    lines = []
    for name in names:
        flag = flags.FLAGS[name]
        default = "" if flag.default is None else f" (default {flag.default!r})"
        if flag.default is not None and not isinstance(flag.default, (str, int, float, bool)):
            # a config file flag: its default is the loaded ConfigDict; name the file:preset it came from
            file, _, preset = (flag.default_as_str or "").strip("'\"").partition(":")
            default = f" (default configs/{pathlib.Path(file).name}:{preset})" if file else ""
        lines.append(f"  --{name}: {flag.help}{default}")
    return "\n".join(lines)


def _module_doc(module_name: str) -> str:
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return ""
    return ast.get_docstring(ast.parse(pathlib.Path(spec.origin).read_text())) or ""


# ==========================================================================================================
# Flag errors of the config commands
# ==========================================================================================================

def config_flag_error(argv: Sequence[str], error: Exception, *, default_config: str | None = None) -> str:
    """One line for a failed flag parse: an unknown --config.FIELD names itself and the closest field.
    default_config: the config file:preset the command uses without --config."""
    config_value = default_config
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            config_value = arg[len("--config="):]
        elif arg == "--config" and i + 1 < len(argv):
            config_value = argv[i + 1]
    base = None
    if config_value:
        file, _, preset = resolve_config(config_value).partition(":")
        if not pathlib.Path(file).is_file():
            return (f"--config {config_value}: {file} does not exist; bundled configs: "
                    f"{', '.join(sorted(p.name for p in (configs_dir() or pathlib.Path('.')).glob('*.py')))} "
                    "(as configs/critic.py:demo)")
        try:
            module = _load_config_module(pathlib.Path(file))
            base = module.get_config(preset) if preset else module.get_config()
        except Exception as e:  # noqa: BLE001 - the preset itself is wrong
            return f"--config {config_value}: {e}"
    for arg in argv:
        if base is None or not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0]
        node: Any = base
        walked: list[str] = []
        for part in path.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                near = difflib.get_close_matches(part, options, n=1)
                hint = f" (did you mean {'.'.join(walked + [near[0]])}?)" if near else \
                    (f"; fields of {'.'.join(walked) or 'config'}: {', '.join(options)}" if options else "")
                return f"unknown config field {path!r} in {arg!r}{hint}"
            node = node[part]
            walked.append(part)
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    missing = [name for name in flags.FLAGS if f"Flag --{name} must have a value other than None" in str(error)]
    if missing:
        flag = flags.FLAGS[missing[0]]
        return f"--{flag.name} is required: {flag.help} (see --help)"
    return f"bad flags: {lines[-1] if lines else type(error).__name__} (see --help)"


# ==========================================================================================================
# The entry point
# ==========================================================================================================

def compile_cache_environment(environ=os.environ) -> None:
    """JAX's persistent compilation cache for every command line, unless the user set JAX_COMPILATION_CACHE_DIR
    (an empty value turns it off): $XDG_CACHE_HOME/sweet_jax/jax, else ~/.cache/sweet_jax/jax. A pipeline
    compiles the same step and sampler programs in many stages and seeds (each training stage is a new trainer;
    one SmolLM2-135M step program takes ~20 s to compile on a 2-core CPU); JAX keys entries by the program,
    the devices and its own version. Every program is kept, not only those over JAX's default second of compiling
    (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0, unless the user set it): a sampling stage compiles 50-80
    programs of 0.1-1 s each, the same in every seed of a protocol (BENCHMARKS.md, "The compilation cache")."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(base, "sweet_jax", "jax"))
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def without_torch(modules=sys.modules) -> None:
    """Hide PyTorch from this command's process: no command uses it, but transformers imports it when it is
    installed (the test extra installs it), 2-3 s at every start on a 2-core host, for tokenizers that never
    touch it. `import torch` then raises ImportError here and transformers runs as without PyTorch, as after the
    plain install. A process that has already imported torch keeps it."""
    modules.setdefault("torch", None)


def run(main: Callable, *, define_flags: Callable[[], None] | None = None, allocator: bool = True,
        help_configs: Sequence[str] = (), module_name: str | None = None) -> None:
    """The `if __name__ == "__main__":` of every command.

    main: `main(argv)` (argv without the program name). With define_flags (absl flags), argv holds the
    positional arguments left after the flags; without, main parses argv itself (cli.ArgumentParser).
    allocator: re-execute with the host allocator first (commands that compute; not the report tools).
    help_configs: config files whose presets --help lists when no --config is given.
    module_name: the command's module, whose docstring --help prints (default: the __main__ module's)."""
    quiet_environment()
    compile_cache_environment()
    if allocator:
        host_malloc.reexec_with_allocator()  # before jax starts: huge pages or tcmalloc for XLA's per-step host buffers
    without_torch()
    module_name = module_name or _calling_module()
    if define_flags is None:
        setup_logging()
        code = guarded(lambda: main(sys.argv[1:]))
        sys.exit(code if isinstance(code, int) else 0)

    argv = [sys.argv[0]] + resolve_config_args(flag_spellings(sys.argv[1:]))
    sys.argv = argv  # config_flags reads the --config.FIELD overrides from sys.argv
    before = set(flags.FLAGS)
    try:
        define_flags()
    except Exception as e:  # noqa: BLE001 - a config flag with a default parses the --config.FIELD overrides here
        exit_with_error(config_flag_error(argv[1:], e, default_config=help_configs[0] if help_configs else None))
    own = [name for name in flags.FLAGS if name not in before]
    if any(a in ("-h", "--help", "--helpshort", "-help") for a in argv[1:]):
        config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
        if config_arg is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
            config_arg = argv[argv.index("--config") + 1]
        if config_arg is None and "config" in own and flags.FLAGS["config"].default_as_str:
            default = flags.FLAGS["config"].default_as_str.strip("'\"")
            help_configs = help_configs or (default,)
        print(as_invoked(_module_doc(module_name).strip()) + "\n\nflags:\n" + _flag_lines(own) + "\n\n"
              + config_help(config_arg, help_configs))
        sys.exit(0)

    def parse(args):
        try:
            rest = flags.FLAGS(args)
            if "config" in own:
                getattr(flags.FLAGS.config, "lock")  # a file that failed to load raises on first use: here
            return rest
        except Exception as e:  # noqa: BLE001 - config_flags raises AttributeError/KeyError/ValueError/flags.Error
            exit_with_error(config_flag_error(args, e))

    def absl_main(rest):
        setup_logging()
        note = default_preset_note(argv[1:])
        if note:
            logging.getLogger("sweet_jax").warning("%s", note)
        code = guarded(lambda: main(rest[1:]))
        sys.exit(code if isinstance(code, int) else 0)

    app.run(absl_main, flags_parser=parse)


def _calling_module() -> str:
    """The module name of the command that called run(): `python -m sweet_jax.train` runs it as __main__."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else "sweet_jax"


# ==========================================================================================================
# sweet-jax COMMAND ...
# ==========================================================================================================

def main(argv: Sequence[str] | None = None) -> None:
    """`sweet-jax COMMAND [FLAGS]`: the same as `python -m sweet_jax.COMMAND [FLAGS]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        lines = ["usage: sweet-jax COMMAND [FLAGS]   (the same as python -m sweet_jax.COMMAND; COMMAND --help "
                 "lists its flags)", "", "commands:"]
        for name in COMMANDS:
            first = _module_doc(f"sweet_jax.commands.{name}").strip().splitlines()
            lines.append(f"  {name:<22}{first[0] if first else ''}")
        print("\n".join(lines))
        sys.exit(0 if argv else 2)
    command = argv[0].replace("-", "_")
    if command not in COMMANDS:
        near = difflib.get_close_matches(command, COMMANDS, n=1)
        exit_with_error(f"unknown command {argv[0]!r}{f' (did you mean {near[0]}?)' if near else ''}; "
                        f"commands: {', '.join(COMMANDS)}")
    global _console_name
    _console_name = f"sweet-jax {command}"
    sys.argv = [_console_name] + argv[1:]
    runpy.run_module(f"sweet_jax.{command}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
