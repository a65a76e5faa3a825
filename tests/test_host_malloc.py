"""The command lines' host allocator: tcmalloc (or huge pages) for XLA's per-step host buffers."""
import ctypes.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from sweet_jax import host_malloc
from sweet_jax.host_malloc import allocator_env

GLIBC_OK, THP_OK = (2, 36), "madvise"


def test_hugepages_adds_the_glibc_tunable_and_keeps_the_others():
    changes, problem = allocator_env("hugepages", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                                     glibc=GLIBC_OK, thp=THP_OK, tcmalloc=None)
    assert changes == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert problem is None
    changes, _ = allocator_env("hugepages", {}, glibc=GLIBC_OK, thp="always", tcmalloc=None)
    assert changes == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize("glibc, thp, says", [
    ((2, 31), THP_OK, "glibc >= 2.35"),
    (None, THP_OK, "not glibc"),
    (GLIBC_OK, "never", "are never"),
    (GLIBC_OK, None, "are absent"),
])
def test_hugepages_falls_back_to_the_system_allocator_and_says_why(glibc, thp, says):
    changes, problem = allocator_env("hugepages", {}, glibc=glibc, thp=thp, tcmalloc=None)
    assert changes == {}
    assert says in problem and "system allocator" in problem


def test_a_mode_already_in_the_environment_changes_nothing():
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}
    assert allocator_env("hugepages", env, glibc=GLIBC_OK, thp=THP_OK, tcmalloc=None) == ({}, None)
    assert allocator_env("tcmalloc", env, glibc=GLIBC_OK, thp=THP_OK, tcmalloc="libtcmalloc_minimal.so.4") == ({}, None)


def test_tcmalloc_is_preloaded_in_front_of_other_preloads_or_named_as_missing():
    changes, problem = allocator_env("tcmalloc", {"LD_PRELOAD": "libfoo.so"}, glibc=GLIBC_OK, thp=THP_OK,
                                     tcmalloc="libtcmalloc_minimal.so.4")
    assert changes == {"LD_PRELOAD": "libtcmalloc_minimal.so.4 libfoo.so"} and problem is None
    changes, problem = allocator_env("tcmalloc", {}, glibc=GLIBC_OK, thp=THP_OK, tcmalloc=None)
    assert changes == {} and "apt-get install libtcmalloc-minimal4" in problem


def test_system_mode_changes_nothing_and_an_unknown_mode_is_named():
    assert allocator_env("system", {}, glibc=GLIBC_OK, thp=THP_OK, tcmalloc="x") == ({}, None)
    with pytest.raises(ValueError, match="SWEET_JAX_MALLOC='jemalloc': expected one of tcmalloc, hugepages, system"):
        allocator_env("jemalloc", {}, glibc=GLIBC_OK, thp=THP_OK, tcmalloc=None)


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert host_malloc.thp_mode(path) == "madvise"
    assert host_malloc.thp_mode(tmp_path / "missing") is None


# A command line under SWEET_JAX_MALLOC: it re-executes itself once with the same argv, then mallocs, touches and
# frees a 256 MiB block twice, as XLA does with its temporaries every step, and counts the page faults of the
# second time (fresh 4 KiB pages: 65,536; 2 MiB huge pages: ~128; a reused block: ~0).
CHILD = textwrap.dedent("""
    import ctypes, json, os, resource, sys
    from sweet_jax.host_malloc import reexec_with_allocator
    if __name__ == "__main__":
        reexec_with_allocator()
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        size = 256 << 20
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(ctypes.c_size_t(size))
            ctypes.memset(block, 1, size)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            libc.free(block)
        print(json.dumps(dict(argv=sys.argv[1:], faults=faults, applied=os.environ.get("SWEET_JAX_MALLOC_APPLIED"),
                              tunables=os.environ.get("GLIBC_TUNABLES", ""), preload=os.environ.get("LD_PRELOAD", ""))))
""")


def run_child(tmp_path, mode=None):
    script = tmp_path / "cli.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", host_malloc.DONE_VAR, host_malloc.MODE_VAR)}
    if mode is not None:
        env[host_malloc.MODE_VAR] = mode
    out = subprocess.run([sys.executable, str(script), "--config", "x.py:demo"], env=env, capture_output=True,
                         text=True, timeout=120, cwd=pathlib.Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def hugepages_supported() -> bool:
    return (host_malloc.glibc_version() or (0, 0)) >= (2, 35) and host_malloc.thp_mode() in ("always", "madvise")


def test_by_default_the_command_line_reexecutes_once_under_huge_pages_or_tcmalloc_and_faults_far_less(tmp_path):
    system, _ = run_child(tmp_path, "system")
    default, log = run_child(tmp_path)
    assert system["applied"] is None and system["faults"] >= 60_000  # every 4 KiB page of the 256 MiB, again
    assert default["argv"] == ["--config", "x.py:demo"]
    if hugepages_supported():  # glibc's huge pages first: freed blocks go back to the kernel
        assert default["applied"] == "hugepages" and "glibc.malloc.hugetlb=1" in default["tunables"]
        assert default["faults"] < system["faults"] / 4 and "tcmalloc" not in default["preload"]
    elif ctypes.util.find_library("tcmalloc_minimal"):
        assert default["applied"] == "tcmalloc" and "tcmalloc" in default["preload"]
        assert default["faults"] < 1_000
    else:  # neither here: the system allocator, quietly
        assert default["applied"] is None and not log


def test_the_default_is_hugepages_then_tcmalloc_then_system_on_cpu_hosts(monkeypatch, tmp_path):
    answers = {}
    monkeypatch.setattr(host_malloc, "allocator_env_here", lambda mode, environ: answers[mode])
    answers.update(hugepages=({"GLIBC_TUNABLES": "t"}, None), tcmalloc=({"LD_PRELOAD": "p"}, None))
    assert host_malloc.default_mode({}, dev=tmp_path) == ("hugepages", {"GLIBC_TUNABLES": "t"}, None)
    answers["hugepages"] = ({}, "transparent huge pages are never on this kernel: system allocator")
    assert host_malloc.default_mode({}, dev=tmp_path) == ("tcmalloc", {"LD_PRELOAD": "p"}, None)
    answers["tcmalloc"] = ({}, "tcmalloc not found (apt-get install libtcmalloc-minimal4): system allocator")
    assert host_malloc.default_mode({}, dev=tmp_path) == ("system", {}, answers["tcmalloc"][1])
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    (tmp_path / "dev" / "vfio" / "0").touch()  # a TPU chip: the system allocator, whatever applies
    assert host_malloc.default_mode({}, dev=tmp_path) == ("system", {}, None)


def test_tcmalloc_on_request_reexecutes_under_it_and_reuses_freed_blocks(tmp_path):
    forced, log = run_child(tmp_path, "tcmalloc")
    if ctypes.util.find_library("tcmalloc_minimal"):
        assert forced["applied"] == "tcmalloc" and "tcmalloc" in forced["preload"]
        assert forced["faults"] < 1_000
    else:  # asked for by name where it is not installed: the package is named
        assert forced["applied"] is None and "apt-get install libtcmalloc-minimal4" in log


def test_hugepages_mode_reexecutes_with_the_tunable_and_faults_far_less(tmp_path):
    system, _ = run_child(tmp_path, "system")
    huge, log = run_child(tmp_path, "hugepages")
    if hugepages_supported():
        assert huge["applied"] == "hugepages" and "glibc.malloc.hugetlb=1" in huge["tunables"]
        assert huge["faults"] < system["faults"] / 4
    else:  # this machine cannot: the process goes on with the system allocator and says why
        assert huge["applied"] is None and "system allocator" in log


def test_the_default_applies_to_cpu_hosts_only(tmp_path):
    assert host_malloc.computes_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not host_malloc.computes_on_cpu({"JAX_PLATFORMS": "tpu,cpu"})
    assert host_malloc.computes_on_cpu({}, dev=tmp_path)  # no device nodes
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    (tmp_path / "dev" / "vfio" / "vfio").touch()  # the control node every Linux host may have
    assert host_malloc.computes_on_cpu({}, dev=tmp_path)
    (tmp_path / "dev" / "vfio" / "0").touch()  # a TPU v5e/v6e chip
    assert not host_malloc.computes_on_cpu({}, dev=tmp_path)
    assert host_malloc.computes_on_cpu({"JAX_PLATFORMS": "cpu"}, dev=tmp_path)


def test_an_unknown_mode_stops_the_command_line_with_one_line_naming_the_choices(tmp_path):
    script = tmp_path / "cli.py"
    script.write_text(CHILD)
    env = {**os.environ, host_malloc.MODE_VAR: "jemalloc"}
    env.pop(host_malloc.DONE_VAR, None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).parents[1])
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == "error: SWEET_JAX_MALLOC='jemalloc': expected one of tcmalloc, hugepages, system"
