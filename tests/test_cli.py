"""The command lines as a newcomer meets them: each mistake is one line `error: ...` and exit status 2, never a
traceback; presets are found from any working directory; --help lists presets and fields."""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from sweet_jax import cli, jsonl
from sweet_jax.data import demo

REPO = pathlib.Path(__file__).resolve().parents[1]


def command(*args, cwd, timeout=300, **env_extra) -> subprocess.CompletedProcess:
    """`python -m sweet_jax.NAME ...` from `cwd` (this checkout's package first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **env_extra}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, exactly one line on stderr, `error: ...` holding every needle; returns that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "%|" not in line]  # progress bars
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_a_preset_is_found_from_any_working_directory(tmp_path):
    resolved = cli.resolve_config("configs/critic.py:demo", cwd=tmp_path)
    file, _, preset = resolved.partition(":")
    assert preset == "demo" and pathlib.Path(file).is_file() and pathlib.Path(file).name == "critic.py"
    here = tmp_path / "configs"
    here.mkdir()
    (here / "critic.py").write_text("")
    assert cli.resolve_config("configs/critic.py:demo", cwd=tmp_path) == "configs/critic.py:demo"  # the user's wins
    assert cli.resolve_config("elsewhere/nope.py:x", cwd=tmp_path) == "elsewhere/nope.py:x"
    # The command line loads it from another directory: the config's own check is the error here (epochs 0),
    # which only a loaded config can give.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = command("sweet_jax.train", "--config", "configs/critic.py:demo", f"--workdir={tmp_path / 'run'}",
                   "--config.train.num_steps=0", "--config.train.epochs=0", cwd=elsewhere)
    assert_one_line_error(proc, "config.train.epochs=0")


def test_a_bad_preset_and_an_unknown_field_are_one_line(tmp_path):
    proc = command("sweet_jax.train", "--config", "configs/critic.py:dem", f"--workdir={tmp_path}", cwd=tmp_path)
    assert_one_line_error(proc, "unknown critic preset 'dem'", "demo")
    proc = command("sweet_jax.train", "--config=configs/critic.py:demo", f"--workdir={tmp_path}",
                   "--config.train.num_step=3", cwd=tmp_path)
    assert_one_line_error(proc, "did you mean train.num_steps?")
    proc = command("sweet_jax.train", "--config=configs/nope.py:demo", f"--workdir={tmp_path}", cwd=tmp_path)
    assert_one_line_error(proc, "configs/nope.py does not exist", "critic.py")
    # A command whose --config has a default reads the overrides while its flags are defined.
    proc = command("sweet_jax.rollout", "--config.best_off=2", cwd=tmp_path)
    assert_one_line_error(proc, "unknown config field 'best_off'", "did you mean best_of?")


def test_help_lists_the_flags_presets_and_fields(tmp_path):
    proc = command("sweet_jax.train", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for needle in ("--workdir", "--config configs/critic.py:PRESET", "demo_no_info", "configs/policy.py:PRESET",
                   "optim.lr=0.003", "--config.SECTION.FIELD=VALUE", "fields of configs/policy.py:demo: as above"):
        assert needle in proc.stdout, needle
    lines = proc.stdout.splitlines()
    # Each field with what it means (the comment where config_utils creates it); the policy preset only where
    # it differs from the critic's.
    assert any(line.split() == ["model.path=''", "HF", "checkpoint", "directory;", "''", "=", "the", "demo", "tiny",
                                "random", "model"] for line in lines), proc.stdout
    policy = proc.stdout.split("fields of configs/policy.py:demo: as above, except")[1]
    assert "loss.kind='dpo'" in policy and "data.max_len" not in policy
    assert "--helpfull" not in proc.stdout and "absl" not in proc.stdout
    proc = command("sweet_jax.rollout", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "  --config: rollout config (file:preset) (default configs/rollout.py:demo)\n" \
        in proc.stdout, proc.stdout[:3000]
    assert "best_of=2" in proc.stdout and "k episodes per task" in proc.stdout
    proc = command("sweet_jax.cli", "--help", cwd=tmp_path)  # `sweet-jax --help`
    assert proc.returncode == 0 and all(name in proc.stdout for name in cli.COMMANDS), proc.stdout
    proc = command("sweet_jax.cli", "trian", cwd=tmp_path)
    assert_one_line_error(proc, "unknown command 'trian'", "did you mean train?")
    proc = command("sweet_jax.cli", "rank", "--help", cwd=tmp_path)  # `sweet-jax rank --help`
    assert proc.returncode == 0 and "configs/rank.py:PRESET" in proc.stdout, proc.stderr[-2000:]


# What libtpu and jax print when they probe for TPU chips (the C++ logs at TF_CPP_MIN_LOG_LEVEL=0, the error block
# libtpu prints while another process holds /tmp/libtpu_lockfile) and transformers' advisories.
PROBE_LINES = ("libtpu", "Source Location Trace", "TPU platform", "backend 'tpu'", "PyTorch was not found",
               "None of PyTorch")


def test_a_cpu_host_with_libtpu_installed_prints_no_tpu_probe(tmp_path):
    """With libtpu installed (the planner's extra: CI installs it) and no TPU, a command's first use of jax
    loads no libtpu: nothing of the probe on stderr, even with libtpu's C++ info logs switched on."""
    import importlib.util
    assert importlib.util.find_spec("libtpu") is not None, "install the plan extra: pip install -e '.[plan]'"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="0")
    # The mesh needs 3 devices: an error that comes only after jax has counted its devices.
    proc = subprocess.run([sys.executable, "-m", "sweet_jax.train", "--config=configs/critic.py:demo",
                           f"--workdir={tmp_path / 'run'}", "--config.mesh.shape=(1,3,1)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs 3 devices, but this run has 1" in proc.stderr, proc.stderr[-3000:]
    for needle in PROBE_LINES:
        assert needle not in proc.stderr, (needle, proc.stderr[-3000:])


def test_quiet_environment_runs_jax_on_the_cpu_only_where_no_accelerator_exists(tmp_path):
    for devices, user, want in [((), {}, "cpu"), (("dev/accel0",), {}, None), (("dev/vfio/0",), {}, None),
                                (("dev/nvidia0",), {}, None), ((), {"JAX_PLATFORMS": ""}, ""),
                                ((), {"JAX_PLATFORMS": "tpu"}, "tpu")]:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for device in devices:
            (root / device).parent.mkdir(parents=True, exist_ok=True)
            (root / device).touch()
        root.mkdir(exist_ok=True)
        environ = dict(user)
        cli.quiet_environment(environ, dev=str(root), platform="linux")
        assert environ.get("JAX_PLATFORMS") == want, (devices, user, environ)
        assert environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    environ = {}
    cli.quiet_environment(environ, dev=str(tmp_path / "0"), platform="darwin")  # jax-metal has no device node
    assert "JAX_PLATFORMS" not in environ


def test_field_comments_are_read_from_where_the_fields_are_created(tmp_path):
    path = tmp_path / "conf.py"
    path.write_text("def get_config():\n"
                    "    c = ml_collections.ConfigDict()\n"
                    "    c.data.max_len = 1024  # tokens per sequence\n"
                    "    c.note = 'a # in a string'\n"
                    "    c.data.max_len = 8  # why this preset sets it (the definition's comment wins)\n"
                    "    x = 3  # not a field\n")
    assert cli.field_comments(path) == {"data.max_len": "tokens per sequence"}


def test_serve_a_missing_model_directory(tmp_path):
    assert_one_line_error(command("sweet_jax.serve", "--model", "/nope", "--port", "0", cwd=tmp_path), "/nope")


def test_serve_an_unknown_flag(tmp_path):
    assert_one_line_error(command("sweet_jax.serve", "--model", "m", "--prot", "1", cwd=tmp_path), "--prot")


def test_evaluate_a_missing_file_and_a_bad_row(tmp_path):
    proc = command("sweet_jax.evaluate", "nope.jsonl", "--out", "o.jsonl", cwd=tmp_path)
    assert_one_line_error(proc, "nope.jsonl", "file not found")
    rows = demo.paths().trajectories.read_text().splitlines()[:3]
    bad = json.loads(rows[1])
    del bad["dialogue_history"]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([rows[0], json.dumps(bad), rows[2]]) + "\n")
    proc = command("sweet_jax.evaluate", str(path), "--out", "o.jsonl", cwd=tmp_path)
    assert_one_line_error(proc, f"{path}:2", "dialogue_history")
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("kind", ["binary", "gzip", "directory"])
def test_a_jsonl_path_that_is_not_jsonl_text_is_named(tmp_path, kind):
    path = tmp_path / "data.jsonl"
    expected = {"binary": "binary file", "gzip": "gzip file", "directory": "is a directory"}[kind]
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "gzip":
        path.write_bytes(gzip.compress(demo.paths().trajectories.read_bytes()[:2000]))
    else:
        path.mkdir()
    with pytest.raises(jsonl.DataError, match=expected):
        jsonl.read(path)
    proc = command("sweet_jax.evaluate", str(path), "--out", "o.jsonl", cwd=tmp_path)
    assert_one_line_error(proc, str(path), expected)


def test_jsonl_read_is_strict_and_the_append_only_read_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n[1, 2]\n')
    with pytest.raises(jsonl.DataError, match=f"{path}:3: expected a JSON object, got list"):
        jsonl.read(path)
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    with pytest.raises(jsonl.DataError, match=f"{path}:3: malformed JSON"):
        jsonl.read(path)
    assert jsonl.read(path, partial="drop") == [{"a": 1}, {"a": 2}]
    assert path.read_text().endswith('{"a": ')
    jsonl.read(path, partial="repair")
    jsonl.append(path, [{"a": 3}])
    assert jsonl.read(path) == [{"a": 1}, {"a": 2}, {"a": 3}]
    jsonl.write(tmp_path / "sub" / "y.jsonl", [{"b": "é"}])
    assert jsonl.read(tmp_path / "sub" / "y.jsonl") == [{"b": "é"}]
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["y.jsonl"]  # no temporary file left


def test_pipeline_diagnostics_on_a_missing_or_foreign_directory(tmp_path):
    assert_one_line_error(command("sweet_jax.pipeline_diagnostics", str(tmp_path / "nope"), cwd=tmp_path),
                          "nope is not a directory")
    assert_one_line_error(command("sweet_jax.pipeline_diagnostics", str(tmp_path), cwd=tmp_path),
                          "holds no pipeline stage")


def test_pipeline_report_on_a_directory_without_results(tmp_path):
    assert_one_line_error(command("sweet_jax.pipeline_report", str(tmp_path), "--out", "r", cwd=tmp_path),
                          "results.json does not exist")


def test_a_model_whose_vocabulary_is_smaller_than_its_tokenizer_is_refused_at_load(tmp_path):
    from tiny import make_hf_llama

    tokenizer_files = demo.paths().tokenizer
    model_dir = make_hf_llama(tmp_path / "model", "llama32", vocab_size=64)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, model_dir / f.name)
    import transformers
    size = len(transformers.AutoTokenizer.from_pretrained(str(tokenizer_files)))
    assert size > 64
    proc = command("sweet_jax.serve", "--model", str(model_dir), "--port", "0", cwd=tmp_path)
    assert_one_line_error(proc, "vocabulary of 64 tokens", f"has {size}")


def test_command_lines_share_a_persistent_compilation_cache_unless_the_user_chose_one(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    cli.compile_cache_environment(environ)
    assert environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "sweet_jax" / "jax")
    assert environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    environ = {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}   # off; JAX's own
    cli.compile_cache_environment(environ)
    assert environ == {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}


def test_a_program_that_compiles_in_milliseconds_is_kept_in_the_cache_and_read_back_by_the_next_process(tmp_path):
    """The environment a command line sets, as JAX reads it at import: a tiny program (JAX's default would skip
    it, under a second) is written to the cache by one process and read from it by the next."""
    script = ("import os, sys; from sweet_jax import cli; cli.compile_cache_environment(); import jax; "
              "from sweet_jax import costs; costs.listen_to_compiles(); costs.reset(); "
              "jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready(); "
              "print(int(costs.snapshot().get('compile_cache_hits', 0)))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path)}
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(key, None)
    hits = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                           timeout=120).stdout.split()[-1] for _ in range(2)]
    entries = [p.name for p in (tmp_path / "sweet_jax" / "jax").rglob("*") if p.is_file()]
    assert hits == ["0", "2"] and any(e.startswith("jit__lambda") for e in entries), (hits, entries)  # iota, lambda


def test_importing_the_library_on_a_cpu_host_with_libtpu_prints_no_tpu_probe(tmp_path):
    """A notebook's `import sweet_jax` then jax, with libtpu installed (.[plan]) and no TPU: no libtpu lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="0")
    proc = subprocess.run([sys.executable, "-c", "import sweet_jax, jax; print(jax.devices()[0].platform)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr[-3000:]
    for needle in PROBE_LINES + ("INVALID_ARGUMENT",):
        assert needle not in proc.stderr, (needle, proc.stderr[-3000:])


def test_a_config_file_without_a_preset_says_which_preset_it_runs():
    note = cli.default_preset_note(["--config", str(REPO / "configs/critic.py"), "--workdir=/tmp/x"])
    assert "names no preset: running its default preset 'demo'" in note and "configs/critic.py:PRESET" in note
    assert "presets: demo, demo_mtdpo" in cli.default_preset_note([f"--config={REPO / 'configs/policy.py'}"])
    assert cli.default_preset_note([f"--config={REPO / 'configs/critic.py'}:llama3_8b"]) is None


def test_evaluate_a_row_without_an_assistant_turn_says_there_is_no_answer(tmp_path):
    row = json.loads(demo.paths().trajectories.read_text().splitlines()[0])
    row["dialogue_history"] = [t for t in row["dialogue_history"] if t["role"] != "assistant"]
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    proc = command("sweet_jax.evaluate", "t.jsonl", "--out", "o.jsonl", cwd=tmp_path)
    assert_one_line_error(proc, "t.jsonl:1", "dialogue_history", "no answer to evaluate", "--skip_bad")


def test_flag_names_take_underscores_or_dashes_values_are_left_alone():
    assert cli.flag_spellings(["--accept-config-change", "--config.train.num-steps=3", "--workdir", "/a-b",
                               "--peft_out=x-y", "--", "--not-a-flag"]) == [
        "--accept_config_change", "--config.train.num_steps=3", "--workdir", "/a-b", "--peft_out=x-y", "--",
        "--not-a-flag"]
    parser = cli.ArgumentParser(prog="p")
    parser.add_argument("--served-model-name")
    parser.add_argument("--timeout_s", type=float)
    assert vars(parser.parse_args(["--served_model_name", "m", "--timeout-s", "2"])) == {
        "served_model_name": "m", "timeout_s": 2.0}
    assert vars(parser.parse_args(["--served-model-name", "m", "--timeout_s", "2"])) == {
        "served_model_name": "m", "timeout_s": 2.0}


@pytest.mark.parametrize("args,needle", [
    (("sweet_jax.export", "--workdir=/nope", "--peft-out=/tmp/x", "--max-shard-size=1GB", "--out=/tmp/y"), "/nope"),
    (("sweet_jax.serve", "--model", "/nope", "--served_model_name", "m", "--max_batch_size", "4"), "/nope"),
])
def test_absl_and_argparse_commands_accept_the_other_spelling(tmp_path, args, needle):
    """Past the flag parser either way: the error is about the missing directory, not an unknown flag."""
    line = assert_one_line_error(command(*args, cwd=tmp_path), needle)
    assert "unknown" not in line.lower() and "unrecognized" not in line.lower(), line


HEAVY = ("jax", "flax", "transformers", "torch", "tensorflow", "orbax")
QUICK_ANSWERS = {  # per command: --help, a misspelt flag, a missing file (where it takes one)
    "train": [["--help"], ["--config", "configs/critic.py:demo", "--workdri", "x"],
              ["--config", "configs/critic.py:demo", "--workdir", "x", "--config.data.trajectories=nope.jsonl"]],
    "rank": [["--help"], ["--config.num_candidatez=2"], ["--config.critic.path=nope"]],
    "rollout": [["--help"], ["--outptu=x"], ["--config.tasks=nope.jsonl"]],
    "pipeline": [["--help"], ["--workdir", "x", "--config.seeed=1"],
                 ["--workdir", "x", "--config.init.from_run=nope"]],
    "export": [["--help"], ["--workdri", "x"], ["--workdir", "nope", "--out", "hf"]],
    "serve": [["--help"], ["--modle", "x"], ["--model", "nope"]],
    "evaluate": [["--help"], ["x.jsonl", "--out", "o", "--detials"], ["nope.jsonl", "--out", "o"]],
    "plan": [["--help"], ["--topolgy", "v5e-16"]],
    "pipeline_report": [["--help"], ["x", "--ot", "y"]],
    "pipeline_diagnostics": [["--help"], ["x", "--prbes"], ["nope"]],
}


@pytest.mark.parametrize("name", sorted(QUICK_ANSWERS))
def test_help_a_misspelt_flag_and_a_missing_file_are_answered_before_jax_is_imported(tmp_path, name):
    """What makes them answer in about a second (bench/bench_help.py measures it): the flags are parsed and the
    paths checked before the library, and with it jax, Flax or transformers, is imported."""
    for args in QUICK_ANSWERS[name]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", f"sweet_jax.{name}", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "import time:" in line}
        assert not imported & set(HEAVY), (name, args, sorted(imported & set(HEAVY)))
        proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if "import time:" not in line)
        if args == ["--help"]:
            assert proc.returncode == 0 and ("flags:" in proc.stdout or "usage:" in proc.stdout), proc.stdout[-2000:]
        else:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
            assert proc.returncode == 2 and len(errors) == 1, (name, args, proc.stderr[-2000:])
            assert ("nope" in errors[0]) if "nope" in " ".join(args) else ("unrecognized" in errors[0] or
                                                                          "nknown" in errors[0]), errors[0]


def test_a_missing_required_flag_names_it_with_what_it_is(tmp_path):
    assert_one_line_error(command("sweet_jax.train", "--config", "configs/critic.py:demo", cwd=tmp_path),
                          "--workdir is required: run directory")


def test_an_unknown_flag_is_named_before_a_missing_required_one(tmp_path):
    assert_one_line_error(command("sweet_jax.serve", "--modle", "m", cwd=tmp_path),
                          "unrecognized argument --modle (did you mean --model?)")


def test_the_console_script_s_usage_says_sweet_jax_name(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    for name, needle in (("serve", "usage: sweet-jax serve"), ("train", "sweet-jax train --config")):
        proc = subprocess.run([sys.executable, "-c", "from sweet_jax.cli import main; main()", name, "--help"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and needle in proc.stdout and f"python -m sweet_jax.{name}" not in proc.stdout, \
            proc.stdout[:2000]


def test_a_command_process_runs_without_torch_and_reads_tokenizers_as_with_it(tmp_path):
    """cli.without_torch (every command): transformers does not import PyTorch (2-3 s a start), and the demo and
    the SmolLM2 tokenizers give the same ids and chat rendering as in this process, which has torch."""
    import transformers
    from sweet_jax.models import gguf

    smollm2 = gguf.gguf_to_hf("smollm2", tmp_path / "smollm2_hf")
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "Write f(x) = 2 * x."}]
    script = (
        "import json, sys\n"
        "from sweet_jax import cli\n"
        "cli.without_torch()\n"
        "from sweet_jax.data.tokenizers import load_tokenizer\n"
        "out = {}\n"
        "for path in sys.argv[2:]:\n"
        "    tok = load_tokenizer(path)\n"
        "    out[path] = [tok.apply_chat_template(json.loads(sys.argv[1]), tokenize=False),\n"
        "                 tok('def f(x): return 2 * x')['input_ids']]\n"
        "import transformers.utils.import_utils as iu\n"
        "print(json.dumps({'torch': sys.modules.get('torch') is not None, 'available': iu.is_torch_available(),\n"
        "                  'tokens': out}))\n")
    paths = [str(demo.paths().tokenizer), str(smollm2)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(messages), *paths], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["torch"] is False and answer["available"] is False
    for path in paths:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        assert answer["tokens"][path] == [tok.apply_chat_template(messages, tokenize=False),
                                          tok("def f(x): return 2 * x")["input_ids"]], path
    assert "torch" in sys.modules   # this process (the tests) has it: the comparison was with torch present
    modules = {"torch": sys.modules["torch"]}
    cli.without_torch(modules)
    assert modules["torch"] is sys.modules["torch"]   # a process that imported torch keeps it
