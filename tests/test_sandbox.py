"""The sandboxed evaluator: good answers pass, and >= 25 hostile programs score 0, in time, leave no
process behind, change nothing outside the sandbox and do not affect the next evaluation."""
import os
import signal
import threading
import time

import pytest

from sweet_jax.sandbox import Evaluator, SandboxUnavailableError

TIMEOUT_S = 1.0
SLACK_S = 4.0  # fork, kill, reap, and a busy 2-core CI machine

ADD_TASK = {"ground_truth": "def f(a, b):\n    return a + b\n",
            "test_cases": {"small": "f(1, 2)", "large": "f(30, 12)"}}
GOOD_ANSWER = "import math\n\ndef f(a, b):\n    return helper(a) + b\n\ndef helper(x):\n    return int(math.fabs(x))\n"

# A reference that holds a secret: a candidate that found this code could compute the answers.
SECRET_TASK = {"ground_truth": "def f(a, b):\n    # MARKER_5e1f\n    return (a * 7919 + b) % 104729\n",
               "test_cases": {"one": "f(1, 2)"}}


def _processes_of(uids):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) in uids:
                                found.append(int(entry))
                            break
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator(workers=2, timeout_s=TIMEOUT_S, memory_mb=384) as ev:
        yield ev


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory):
    """Files the sandbox must not touch: in pytest's tmp dir (host /tmp) and on the root fs."""
    base = tmp_path_factory.mktemp("sentinels")
    files = {base / "sentinel.txt": "keep me", base / "secret.txt": "s3cr3t-host"}
    outside = f"/var/tmp/sweet_jax_sentinel_{os.getpid()}"
    os.makedirs(outside, exist_ok=True)
    files[os.path.join(outside, "sentinel.txt")] = "keep me too"
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)
    os.chmod(base / "secret.txt", 0o600)
    yield {"dir": str(base), "outside": outside, "files": files}
    for path in files:
        if str(path).startswith(outside):
            os.remove(path)
    os.rmdir(outside)


def _demo_tasks_path():
    import sweet_jax

    return os.path.join(os.path.dirname(sweet_jax.__file__), "data", "demo", "tasks.jsonl")


# Tagged values (protocol.py) a child may forge: NaN, which the zygote could not re-encode; 490
# containers (980 JSON levels), under the zygote's recursion limit but over the trainer's; 20,000
# ints that all hash alike (multiples of 2**61 - 1), quadratic to put in a set or a dict.
_FORGED_VALUES = {
    "nan": '["l",[["f","0x1p+0"],NaN]]',
    "nested_980_deep": '["l",[' * 490 + '["n"]' + ']]' * 490,
    "colliding_set": '["S",[' + ",".join(f'["i","{k * (2**61 - 1)}"]' for k in range(1, 20_001)) + ']]',
    "colliding_dict": '["d",[' + ",".join(f'[["i","{k * (2**61 - 1)}"],["n"]]'
                                          for k in range(1, 20_001)) + ']]',
}


def _hostile_programs(sentinels):
    d, outside, trainer_pid = sentinels["dir"], sentinels["outside"], os.getpid()
    return {
        "infinite_loop": "def f(a, b):\n    while True:\n        pass\n",
        "loop_catching_base_exception": (
            "def f(a, b):\n    while True:\n        try:\n            while True:\n                pass\n"
            "        except BaseException:\n            pass\n"),
        "ignores_sigalrm_sigterm_sigxcpu": (
            "import signal\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGXCPU, signal.SIGINT):\n"
            "    signal.signal(s, signal.SIG_IGN)\n"
            "def f(a, b):\n    signal.alarm(1)\n    while True:\n        pass\n"),
        "sleep": "import time\ndef f(a, b):\n    time.sleep(1000)\n    return a + b\n",
        "reads_stdin": ("import sys, os\ndef f(a, b):\n    data = sys.stdin.read() + os.read(0, 10).decode()\n"
                        "    return a + b if data else input()\n"),
        "fork_bomb": ("import os\ndef f(a, b):\n    while True:\n        try:\n            os.fork()\n"
                      "        except OSError:\n            pass\n"),
        "subprocess_sleepers": (
            "import subprocess, sys\ndef f(a, b):\n    for _ in range(5):\n"
            "        subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
            "        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])\n"
            "    return None\n"),
        "multiprocessing_children": (
            "import multiprocessing, time\ndef f(a, b):\n    for _ in range(3):\n"
            "        multiprocessing.Process(target=time.sleep, args=(1000,), daemon=False).start()\n"
            "    return 'spawned'\n"),
        "setsid_daemon": (
            "import os, time\ndef f(a, b):\n    if os.fork() == 0:\n        os.setsid()\n"
            "        if os.fork() == 0:\n            time.sleep(1000)\n        os._exit(0)\n    return 0\n"),
        "memory_bomb": ("def f(a, b):\n    chunks = []\n    while True:\n"
                        "        chunks.append(bytearray(100 << 20))\n"),
        "raises_rlimits": (
            "import resource\ndef f(a, b):\n"
            "    for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU):\n"
            "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "    return a + b\n"),
        "deep_recursion": ("import sys\nsys.setrecursionlimit(10**7)\n"
                           "def f(a, b):\n    return f(a, b) + 1\n"),
        "rm_rf_root": (
            "import shutil, subprocess\ndef f(a, b):\n"
            "    subprocess.run(['rm', '-rf', '--no-preserve-root', '/'], timeout=5)\n"
            f"    shutil.rmtree({d!r}, ignore_errors=True)\n"
            f"    shutil.rmtree({outside!r}, ignore_errors=True)\n"
            "    shutil.rmtree('/', ignore_errors=True)\n    return None\n"),
        "writes_outside_tmp": (
            "def f(a, b):\n    written = 0\n"
            f"    for p in ({d + '/sentinel.txt'!r}, {outside + '/sentinel.txt'!r}, "
            "'/etc/pwned', '/var/tmp/pwned', '/dev/shm/pwned', '/root/pwned'):\n"
            "        try:\n            open(p, 'w').write('pwned')\n            written += 1\n"
            "        except OSError:\n            pass\n    return a + b if written else None\n"),
        "sockets_and_dns": (
            "import socket\ndef f(a, b):\n    ok = 0\n"
            "    for attempt in (lambda: socket.create_connection(('1.1.1.1', 80), timeout=0.3),\n"
            "                    lambda: socket.getaddrinfo('example.com', 80),\n"
            "                    lambda: socket.create_connection(('127.0.0.1', 22), timeout=0.3)):\n"
            "        try:\n            attempt()\n            ok += 1\n        except OSError:\n"
            "            pass\n    return a + b if ok else None\n"),
        "kills_parent_and_everyone": (
            "import os, signal\ndef f(a, b):\n"
            f"    for pid in (os.getppid(), 1, {trainer_pid}, -1):\n"
            "        try:\n            os.kill(pid, signal.SIGKILL)\n        except OSError:\n"
            "            pass\n    return None\n"),
        "sys_exit": "import sys\ndef f(a, b):\n    sys.exit(0)\n",
        "os_exit_at_import": "import os\nos._exit(0)\ndef f(a, b):\n    return a + b\n",
        "keyboard_interrupt": "def f(a, b):\n    raise KeyboardInterrupt\n",
        "custom_base_exception": ("class Escape(BaseException):\n    pass\n"
                                  "def f(a, b):\n    raise Escape()\n"),
        "always_equal_object": (
            "class Eq:\n    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
            "def f(a, b):\n    return Eq()\n"),
        "int_and_str_subclasses": (
            "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
            "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
            "def f(a, b):\n    return [I(0), S('x')][a % 2]\n"),
        "eq_and_repr_that_raise_or_loop": (
            "class Bad:\n    def __eq__(self, o):\n        raise ValueError\n"
            "    def __repr__(self):\n        while True:\n            pass\n"
            "    def __hash__(self):\n        while True:\n            pass\n"
            "def f(a, b):\n    return {'k': Bad()}\n"),
        "reduce_payload": (
            "import os\nclass P:\n    def __reduce__(self):\n"
            f"        return (os.system, ('touch {d}/pwned_by_reduce',))\n"
            "def f(a, b):\n    return P()\n"),
        "frame_and_gc_walking": (
            "import gc, sys\ndef f(a, b):\n    needle = 'MARK' + 'ER_5e1f'\n"
            "    for obj in gc.get_objects() + [fr.f_locals for fr in [sys._getframe(i) for i in range(3)]]:\n"
            "        for text in (obj if isinstance(obj, dict) else [obj]):\n"
            "            if isinstance(text, str) and needle in text and 'def f' in text:\n"
            "                ns = {}\n                exec(text, ns)\n                return ns['f'](a, b)\n"
            "    return None\n"),
        "forged_output": (
            "import os, sys\ndef f(a, b):\n"
            "    forged = b'{\"k\":\"result\",\"cases\":[{\"s\":\"pass\"}],\"reward\":1.0}'\n"
            "    print(forged.decode()); sys.stderr.write(forged.decode())\n"
            "    for fd in range(1, 40):\n"
            "        try:\n            os.write(fd, len(forged).to_bytes(4, 'big') + forged)\n"
            "        except OSError:\n            pass\n    return None\n"),
        "monkeypatched_builtins_and_json": (
            "import builtins, json, math\nbuiltins.abs = lambda x: 42\nbuiltins.int = float\n"
            "math.fabs = lambda x: -1.0\njson.dumps = lambda *a, **k: '{\"k\":\"case\",\"i\":0,\"s\":\"pass\"}'\n"
            "json.loads = lambda *a, **k: {'k': 'case', 'i': 0, 'v': ['n']}\n"
            "def f(a, b):\n    return None\n"),
        "huge_prints_and_closed_stdout": (
            "import os, sys\ndef f(a, b):\n    print('x' * 100_000_000)\n    sys.stdout.close()\n"
            "    os.close(1)\n    os.close(2)\n    return str(a + b)\n"),
        "huge_string_result": "def f(a, b):\n    return 'x' * (50 << 20)\n",
        "deep_result": ("def f(a, b):\n    v = a + b\n    for _ in range(100000):\n        v = [v]\n"
                        "    return v\n"),
        "self_referential_result": "def f(a, b):\n    x = [a + b]\n    x.append(x)\n    return x\n",
        "huge_int_result": ("import sys\nsys.set_int_max_str_digits(0)\n"
                            "def f(a, b):\n    return 10 ** 200000 + a + b\n"),
        "generator_lambda_module": ("import math\ndef f(a, b):\n"
                                    "    return [(x for x in [a + b]), lambda: a + b, math][a % 3]\n"),
        "thread_outliving_the_call": (
            "import threading, time, os\ndef spin():\n    while True:\n        time.sleep(0.01)\n"
            "def f(a, b):\n    threading.Thread(target=spin, daemon=False).start()\n"
            "    return a * b\n"),
        "ctypes_tricks": (
            "import ctypes, os\ndef f(a, b):\n    libc = ctypes.CDLL(None)\n"
            "    libc.setuid(0); libc.setgid(0); libc.kill(1, 9); libc.unshare(0x10000000)\n"
            "    return a + b if os.getuid() == 0 else None\n"),
        "nested_namespaces_mounts_ptrace": (
            "import ctypes\ndef f(a, b):\n    libc = ctypes.CDLL(None)\n"
            "    ok = [libc.unshare(0x10000000), libc.unshare(0x40000000),\n"
            "          libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), libc.ptrace(16, 1, 0, 0)]\n"
            "    return a + b if 0 in ok else None\n"),
        "reads_environment_and_host_files": (
            "import os\ndef f(a, b):\n    found = dict(os.environ)\n"
            f"    for p in ({d + '/secret.txt'!r}, '/etc/shadow', '/root/.bash_history',"
            f" {'/proc/' + str(trainer_pid) + '/environ'!r}):\n"
            "        try:\n            found[p] = open(p).read()\n        except OSError:\n"
            "            pass\n    return a + b if found else None\n"),
        "reads_task_data_and_sources_from_disk": (
            "import glob\ndef f(a, b):\n    found = []\n"
            f"    for p in ({os.path.abspath(__file__)!r}, {_demo_tasks_path()!r}):\n"
            "        try:\n            found.append(open(p).read())\n        except OSError:\n"
            "            pass\n    found += glob.glob('/work/main/*') + glob.glob('/home/*') + glob.glob('/var/*')\n"
            "    return a + b if found else None\n"),
        "leaves_files_for_the_next_evaluation": (
            "def f(a, b):\n    open('/tmp/leak.txt', 'w').write('hello')\n"
            "    try:\n        open('/dev/shm/leak', 'w').write('hello')\n    except OSError:\n"
            "        pass\n    return None\n"),
        # Forged result frames written straight to the result pipe, for the case being run: the
        # zygote must refuse them as that case's output (never crash, never hand them on).
        **{f"forged_frame_{kind}": (
            "import os\ndef f(a, b):\n"
            "    i = 0 if (a, b) == (1, 2) else 1\n"
            f"    body = ('{{\"k\":\"case\",\"i\":%d,\"v\":' % i + {value!r}).encode() + b'}}'\n"
            "    for fd in range(3, 64):\n"
            "        try:\n            os.write(fd, len(body).to_bytes(4, 'big') + body)\n"
            "        except OSError:\n            pass\n    return None\n")
           for kind, value in _FORGED_VALUES.items()},
        "memory_in_8_processes": _MEMORY_HOG.replace("return held", "return a + b if held == 8 else None"),
        "reads_files_left_by_the_previous_evaluation": (
            "import os\ndef f(a, b):\n"
            "    return a + b if os.path.exists('/tmp/leak.txt') or os.path.exists('/dev/shm/leak') else None\n"),
    }


def test_good_answers_pass_in_the_sandbox(evaluator):
    assert evaluator.isolation["mode"] == "isolated"
    score = evaluator.score(ADD_TASK, "Sure!\n```python\n" + GOOD_ANSWER + "```\n")
    assert (score.reward, score.passed, score.total, score.status) == (1.0, 2, 2, "ok")
    assert [c["outcome"] for c in score.details["cases"]] == ["pass", "pass"]


def test_honest_answers_still_pass(evaluator):
    """Helpers at module level, stdlib imports, recursion 3000 deep, printing, numpy: all score 1.0."""
    answers = [
        "import collections, itertools, functools, re, json, heapq, bisect, datetime, fractions\n"
        "@functools.lru_cache(None)\ndef helper(x):\n    return int(re.sub('[^0-9-]', '', json.dumps(x)))\n"
        "def f(a, b):\n    c = collections.Counter(itertools.repeat(a, 2))\n"
        "    return helper(a) + b + c[a] - 2\n",
        "import sys\nsys.setrecursionlimit(10_000)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def f(a, b):\n    return depth(3000) - 3000 + a + b\n",
        "print('module')\ndef f(a, b):\n    for i in range(10_000):\n        print('line', i)\n"
        "    return a + b\n",
        "import numpy as np\ndef f(a, b):\n    return int(np.array([a, b]).sum())\n",
    ]
    scores = evaluator.score_many([(ADD_TASK, a) for a in answers])
    assert [(s.status, s.reward) for s in scores] == [("ok", 1.0)] * len(answers), scores


def test_known_wrong_answers_score_the_fraction_of_cases_they_pass(evaluator):
    half = "def f(a, b):\n    return 3 if (a, b) == (1, 2) else 0\n"
    assert evaluator.score(ADD_TASK, half).reward == 0.5
    error = evaluator.score(ADD_TASK, "def f(a, b):\n    return 1 / 0\n")
    assert error.reward == 0.0 and error.details["cases"][0]["outcome"] == "error"
    assert "ZeroDivisionError" in error.details["cases"][0]["message"]
    missing = evaluator.score(ADD_TASK, "def g(a, b):\n    return a + b\n")
    assert missing.reward == 0.0 and "NameError" in missing.details["cases"][0]["message"]


@pytest.mark.slow
def test_hostile_programs_score_zero_and_leave_nothing_behind(evaluator, sentinels):
    os.environ["SWEET_JAX_TEST_SECRET"] = "s3cr3t-env"  # the sandbox must not see the trainer's env
    programs = _hostile_programs(sentinels)
    assert len(programs) >= 25
    failures = []
    for name, code in programs.items():
        task = SECRET_TASK if name == "frame_and_gc_walking" else ADD_TASK
        if name == "frame_and_gc_walking":  # put the secret reference through the sandbox first
            assert evaluator.score(SECRET_TASK, SECRET_TASK["ground_truth"]).reward == 1.0
        start = time.monotonic()
        score = evaluator.score(task, code)
        elapsed = time.monotonic() - start
        deadline = (len(task["test_cases"]) + 1) * TIMEOUT_S + SLACK_S
        leftovers = _processes_of(evaluator.child_host_uids())
        follow_up = evaluator.score(ADD_TASK, GOOD_ANSWER)
        problems = []
        if score.reward != 0.0 or score.status != "ok":
            problems.append(f"scored {score}")
        if elapsed > deadline:
            problems.append(f"took {elapsed:.1f}s > {deadline:.1f}s")
        if leftovers:
            problems.append(f"left processes {leftovers}")
        if follow_up.reward != 1.0:
            problems.append(f"next evaluation scored {follow_up}")
        if problems:
            failures.append(f"{name}: {'; '.join(problems)}")
    for path, text in sentinels["files"].items():
        with open(path) as f:
            assert f.read() == text, f"sentinel {path} was changed"
    assert not os.path.exists(os.path.join(sentinels["dir"], "pwned_by_reduce"))
    assert not failures, "\n".join(failures)


def test_hostile_programs_in_parallel_do_not_disturb_good_ones(evaluator, sentinels):
    programs = _hostile_programs(sentinels)
    quick = [code for name, code in programs.items() if name in (
        "fork_bomb", "memory_bomb", "setsid_daemon", "always_equal_object", "kills_parent_and_everyone",
        "monkeypatched_builtins_and_json", "forged_output")]
    pairs = [(ADD_TASK, code) for code in quick] + [(ADD_TASK, GOOD_ANSWER)] * 20
    scores = evaluator.score_many(pairs)
    assert [s.reward for s in scores] == [0.0] * len(quick) + [1.0] * 20
    assert not _processes_of(evaluator.child_host_uids())


def test_forged_result_frames_fail_their_case_without_costing_the_trainer(evaluator, sentinels):
    programs = _hostile_programs(sentinels)
    names = [f"forged_frame_{kind}" for kind in _FORGED_VALUES]
    cpu = time.process_time()  # this process only: the trainer's side of the evaluations
    scores = evaluator.score_many([(ADD_TASK, programs[name]) for name in names])
    cpu = time.process_time() - cpu
    for name, score in zip(names, scores):
        assert (score.status, score.reward) == ("ok", 0.0), (name, score)
        first = score.details["cases"][0]
        assert first["outcome"] == "invalid", (name, first)
    messages = [s.details["cases"][0]["message"] for s in scores]
    assert "unreadable" in messages[0]
    assert "nested deeper than 64" in messages[1]
    assert "one hash value" in messages[2] and "one hash value" in messages[3]
    assert cpu < 2.0, f"the trainer spent {cpu:.1f} s of CPU on four forged frames"


def test_one_time_budget_per_evaluation_ends_a_hang_in_every_case():
    """Module-level code using most of timeout_s, then a hang in every case: each case would cost
    a timeout plus a re-run of the module; the evaluation's budget ends it, and it scores 0."""
    # The module's own sleep leaves headroom for interpreter start-up on a loaded host (at 0.15 s of 0.3 s
    # the module itself sometimes timed out, a different outcome than the one under test).
    timeout_s, n = 1.0, 8
    task = {"ground_truth": "def f(i):\n    return i\n", "test_cases": {str(i): f"f({i})" for i in range(n)}}
    answer = "import time\ntime.sleep(0.4)\ndef f(i):\n    while True:\n        pass\n"
    with Evaluator(workers=1, timeout_s=timeout_s) as ev:
        start = time.monotonic()
        score = ev.score(task, answer)
        elapsed = time.monotonic() - start
        assert (score.status, score.reward) == ("ok", 0.0)
        outcomes = [c["outcome"] for c in score.details["cases"]]
        assert set(outcomes) == {"timeout"}, score
        assert "budget" in score.details["cases"][-1]["message"], score
        assert elapsed < (n + 1) * timeout_s + SLACK_S
        assert ev.score(task, "def f(i):\n    return i\n").reward == 1.0


def test_a_module_rerun_cut_short_by_the_budget_times_out_the_remaining_case():
    """Every case hangs, so the module runs again for each: the re-run for the last case sleeps past
    the evaluation's budget, which ends it before its own timeout_s. That case is out of time (the
    budget), not failed by its module, which loaded every time before."""
    timeout_s, n = 1.0, 4
    task = {"ground_truth": "def f(i):\n    return i\n", "test_cases": {str(i): f"f({i})" for i in range(n)}}
    with Evaluator(workers=1, timeout_s=timeout_s) as ev:
        assert ev.score(task, "def f(i):\n    return i\n").reward == 1.0  # the worker is up
        # Runs of the module start near 0, 1.5, 3.0 and 4.5 s (0.5 s of module, 1 s of hang); the
        # budget is (n + 1) * timeout_s = 5 s. A run starting past 4.2 s would outlast it: it sleeps.
        late = time.time() + n * timeout_s + 0.2
        answer = (f"import time\ntime.sleep(30 if time.time() > {late!r} else 0.5)\n"
                  "def f(i):\n    while True:\n        pass\n")
        score = ev.score(task, answer)
        assert (score.status, score.reward) == ("ok", 0.0)
        cases = score.details["cases"]
        assert [c["outcome"] for c in cases] == ["timeout"] * n, score
        assert not any("budget" in c["message"] for c in cases[:-1]), score
        assert "budget" in cases[-1]["message"], score


def test_results_too_large_in_total_fail_the_remaining_cases_not_the_sandbox(evaluator):
    task = {"ground_truth": "def f(i):\n    return i\n", "test_cases": {str(i): f"f({i})" for i in range(6)}}
    score = evaluator.score(task, "def f(i):\n    return 'x' * (7 << 20) if i < 5 else i\n")
    assert score.status == "ok" and score.reward == 0.0
    assert "exceed" in score.details["cases"][5]["message"]


def test_value_semantics_follow_the_documented_rule_end_to_end(evaluator):
    # (reference returns, answer returns, passes?) -- see sandbox/protocol.py
    rows = [("1", "1.0", True), ("1", "True", True), ("0.0", "-0.0", True), ("(1, 2)", "[1, 2]", False),
            ("[1, 2]", "[1, 2]", True), ("float('nan')", "float('nan')", False),
            ("[float('nan')]", "[float('nan')]", False), ("{'a': 1, 'b': 2}", "{'b': 2, 'a': 1}", True),
            ("{1, 2}", "frozenset({1, 2})", True), ("'a'", "b'a'", False), ("None", "None", False),
            ("'1'", "1", False), ("{'k': (1, [2.5])}", "{'k': (1, [2.5])}", True)]
    pairs = [({"ground_truth": f"def f():\n    return {ref}\n", "test_cases": {"c": "f()"}},
              f"def f():\n    return {ans}\n") for ref, ans, _ in rows]
    scores = evaluator.score_many(pairs)
    assert [s.reward == 1.0 for s in scores] == [passes for _, _, passes in rows]
    assert scores[10].details["cases"][0]["outcome"] == "reference_none"


def test_reference_outputs_are_computed_once_and_cached(evaluator):
    task = {"ground_truth": "def g(x):\n    return [x, x * 2]\n", "test_cases": {"a": "g(2)", "b": "g('z')"}}
    assert evaluator.reference_outputs(task) == [("a", "ok", [2, 4]), ("b", "ok", ["z", "zz"])]
    key = evaluator._prepare(task, "")["ref_key"]
    assert evaluator._cached(key) is not None


def test_a_worker_that_dies_gives_infra_error_never_a_pass():
    with Evaluator(workers=1, timeout_s=TIMEOUT_S) as ev:
        assert ev.score(ADD_TASK, GOOD_ANSWER).reward == 1.0  # references cached, workers started
        victim = ev._answers.all[0].process.pid
        threading.Timer(0.3, os.killpg, (victim, signal.SIGKILL)).start()
        score = ev.score(ADD_TASK, "import time\ndef f(a, b):\n    time.sleep(0.8)\n    return a + b\n")
        assert (score.status, score.reward, score.passed) == ("infra_error", 0.0, 0)
        assert "worker died" in score.details["error"]
        assert ev.score(ADD_TASK, GOOD_ANSWER).reward == 1.0  # a fresh worker took over


def test_a_stalled_worker_is_replaced_and_the_job_runs_again():
    """A worker that stops answering (stopped here; starved of CPU on a loaded machine in practice) misses its
    deadline; the job runs once more on a fresh worker instead of failing the caller with infra_error."""
    with Evaluator(workers=1, timeout_s=TIMEOUT_S) as ev:
        assert ev.score(ADD_TASK, GOOD_ANSWER).reward == 1.0  # references cached, workers started
        ev._deadline = lambda calls: 2.0
        stalled = ev._answers.all[0].process.pid
        os.killpg(stalled, signal.SIGSTOP)
        score = ev.score(ADD_TASK, GOOD_ANSWER)
        assert (score.status, score.reward) == ("ok", 1.0), score
        assert [w.process.pid for w in ev._answers.all] != [stalled]


def test_missing_isolation_fails_loudly_or_runs_labelled_degraded():
    with pytest.raises(SandboxUnavailableError, match="degraded_ok=True"):
        Evaluator(workers=1, _isolated_mode="unavailable")
    with pytest.warns(RuntimeWarning, match="DEGRADED"):
        ev = Evaluator(workers=1, timeout_s=TIMEOUT_S, degraded_ok=True, _isolated_mode="unavailable")
    with ev:
        assert ev.mode == "degraded"
        score = ev.score(ADD_TASK, "def f(a, b):\n    return a + b\n")
        assert score.reward == 1.0 and score.details["isolation"] == "degraded"


def test_degraded_mode_still_kills_hangs_and_daemons(sentinels):
    programs = _hostile_programs(sentinels)
    with Evaluator(workers=1, timeout_s=TIMEOUT_S, force_degraded=True) as ev:
        for name in ("infinite_loop", "setsid_daemon", "fork_bomb", "always_equal_object"):
            start = time.monotonic()
            score = ev.score(ADD_TASK, programs[name])
            assert score.reward == 0.0 and score.status == "ok", name
            assert time.monotonic() - start < 3 * TIMEOUT_S + SLACK_S, name
            assert not _processes_of(ev.child_host_uids()), name
        assert ev.score(ADD_TASK, "def f(a, b):\n    return a + b\n").reward == 1.0


def test_sweet_rl_compat_reproduces_the_official_scoring_rules():
    helper_answer = "def helper(x):\n    return x\ndef f(a, b):\n    return helper(a) + b\n"
    plain_answer = "def f(a, b):\n    return a + b\n"
    with Evaluator(workers=1, timeout_s=TIMEOUT_S, compat="sweet_rl") as official:
        scores = official.score_many([
            (ADD_TASK, plain_answer),
            (ADD_TASK, "import os\n" + plain_answer),  # deny-list: 0 without running
            (ADD_TASK, "# write tests later\n" + plain_answer),  # 'write' is not on its list here
            (ADD_TASK, helper_answer),  # helpers land in exec's locals: NameError -> None
            (ADD_TASK, "```python\n" + plain_answer + "```"),
            ({"ground_truth": helper_answer, "test_cases": ADD_TASK["test_cases"]}, helper_answer),
            (ADD_TASK, "class Eq:\n    def __eq__(s, o):\n        return True\ndef f(a, b):\n    return Eq()\n"),
        ])
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert scores[1].details["cases"][0]["outcome"] == "denied"
    assert scores[5].details["cases"][0]["outcome"] == "reference_none"
    with Evaluator(workers=1, timeout_s=TIMEOUT_S) as strict:
        assert strict.score(ADD_TASK, "import os\n" + plain_answer).reward == 1.0
        assert strict.score(ADD_TASK, helper_answer).reward == 1.0


def _official_reward(ground_truth, answer, test_cases):
    """The official evaluator's check_correctness, re-stated for benign answers (run in-process)."""
    for word in ("import os", "from os", "import sys", "from sys", "sudo", "transformers", "exit(",
                 "quit(", "argparse"):
        if word in answer:
            return 0.0
    if "```python" in answer:
        answer = answer.split("```python")[1].split("```")[0]
    if "```" in answer:
        answer = answer.split("```")[1].split("```")[0]
    import multiprocessing
    import queue
    namespace = {"multiprocessing": multiprocessing, "signal": signal, "Empty": queue.Empty}
    exec("def get_function_output(function_definition, test_case):\n    try:\n"
         "        exec(function_definition)\n        return eval(test_case)\n"
         "    except Exception:\n        return None\n", namespace)
    run = namespace["get_function_output"]
    correct = 0
    for case in test_cases.values():
        expected, got = run(ground_truth, case), run(answer, case)
        correct += expected == got and expected is not None
    return correct / len(test_cases)


def test_sweet_rl_compat_matches_the_official_rules_on_benign_answers():
    task = {"ground_truth": "def area(w, h=None):\n    if h is None:\n        h = w\n    return w * h\n",
            "test_cases": {"square": "area(3)", "rect": "area(2, 5)", "float": "area(1.5, 2)"}}
    answers = [
        "def area(w, h=None):\n    return w * (w if h is None else h)\n",
        "```python\ndef area(w, h=None):\n    return w * (h or w)\n```\nHope this helps!",
        "Here you go:\n```\ndef area(w, h=None):\n    return w * (h or w)\n```",
        "Here you go: def area(w, h=None): return w * w",  # prose outside a fence: syntax error
        "import math\ndef area(w, h=None):\n    return math.prod([w, h or w])\n",  # import lost
        "def area(w, h=None):\n    import math\n    return math.prod([w, h or w])\n",
        "def sq(x):\n    return x * x\ndef area(w, h=None):\n    return sq(w) if h is None else w * h\n",
        "def area(w, h=None):\n    return signal.SIGINT * 0 + w * (h or w)\n",  # official globals
        "def area(w, h=None):\n    return area(w, w) if h is None else w * h\n",  # recursion lost
        "def area(w, h=None):\n    return float(w * (h or w))\n",  # 9.0 == 9
        "def area(w, h=None):\n    return (w * (h or w),)\n",
        "import sys\ndef area(w, h=None):\n    return w * (h or w)\n",
    ]
    expected = [_official_reward(task["ground_truth"], a, task["test_cases"]) for a in answers]
    assert expected == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 2 / 3, 1.0, 2 / 3, 1.0, 0.0, 0.0]  # sanity
    with Evaluator(workers=2, timeout_s=TIMEOUT_S, compat="sweet_rl") as official:
        assert [s.reward for s in official.score_many([(task, a) for a in answers])] == expected


_PLACEMENT_SCRIPT = """
import json, sys
from sweet_jax.sandbox import Evaluator
add = {'ground_truth': 'def f(a, b):\\n    return a + b\\n', 'test_cases': {'t1': 'f(1, 2)', 't2': 'f(2, 3)'}}
answers = [
    'def f(a, b):\\n    return a + b',
    'import numpy\\ndef f(a, b):\\n    return int(numpy.add(numpy.int64(a), b))',
    # walks the interpreter's prefixes and the packages for the task data a `pip install .` ships
    'import os, sys\\ndef f(a, b):\\n    found = []\\n'
    '    for top in (sys.prefix, sys.exec_prefix, sys.base_prefix, "/sandbox-packages", "/usr/local/lib"):\\n'
    '        for root, dirs, files in os.walk(top):\\n'
    '            found += [x for x in files + dirs if x in ("tasks.jsonl", "sweet_jax")]\\n'
    '    return a + b if found else None',
    'import sweet_jax\\ndef f(a, b):\\n    return a + b',
]
with Evaluator(workers=1, timeout_s=5.0) as ev:
    scores = ev.score_many([(add, a) for a in answers])
    print(json.dumps([ev.mode, [s.status for s in scores], [s.reward for s in scores]]))
"""


def test_the_same_answer_scores_the_same_wherever_the_interpreter_lives(tmp_path):
    """Venvs under /tmp (as CI makes them) and under /var/tmp, each holding numpy and a copy of the
    sweet_jax package with its demo task data, as a non-editable `pip install .` leaves it, and
    the repository's venv: inside, the standard library plus numpy, and no reference solution."""
    import pathlib
    import shutil
    import subprocess
    import sys
    import tempfile

    import numpy

    repo = pathlib.Path(__file__).resolve().parents[1]
    numpy_dir = pathlib.Path(numpy.__file__).resolve().parent
    results = {}
    made = []
    try:
        for where in ("/tmp", "/var/tmp"):
            venv = pathlib.Path(tempfile.mkdtemp(dir=where, prefix="sweet_jax_venv_"))
            made.append(venv)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
            shutil.copytree(numpy_dir, site / "numpy")
            if (numpy_dir.parent / "numpy.libs").is_dir():
                shutil.copytree(numpy_dir.parent / "numpy.libs", site / "numpy.libs")
            shutil.copytree(repo / "sweet_jax", site / "sweet_jax",
                            ignore=shutil.ignore_patterns("__pycache__"))
            assert (site / "sweet_jax" / "data" / "demo" / "tasks.jsonl").exists()
            out = subprocess.run([str(venv / "bin" / "python"), "-c", _PLACEMENT_SCRIPT],
                                 env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd="/",
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            results[where] = out.stdout.strip().splitlines()[-1]
    finally:
        for venv in made:
            shutil.rmtree(venv, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _PLACEMENT_SCRIPT], env={
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(repo)}, capture_output=True,
        text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    results["repository venv"] = out.stdout.strip().splitlines()[-1]
    expected = '["isolated", ["ok", "ok", "ok", "ok"], [1.0, 1.0, 0.0, 0.0]]'
    assert results == {where: expected for where in results}


def test_no_ipc_object_outlives_its_evaluation():
    """SysV shared memory, semaphores and message queues made by one evaluation are gone for the next
    (same worker): no channel between evaluations, and no memory held past them."""
    task = {"ground_truth": "def f():\n    return 1\n", "test_cases": {"c": "f()"}}
    make = ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "def f():\n    shm = libc.shmget(0x5eed, 1 << 20, 0o1666)\n"
            "    ctypes.memset(libc.shmat(shm, None, 0), 7, 1 << 20)\n"
            "    ids = [shm, libc.semget(0x5eed, 1, 0o1666), libc.msgget(0x5eed, 0o1666)]\n"
            "    return 1 if min(ids) >= 0 else -1\n")
    find = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "def f():\n    ids = [libc.shmget(0x5eed, 0, 0o666), libc.semget(0x5eed, 0, 0o666),\n"
            "           libc.msgget(0x5eed, 0o666)]\n"
            "    return 1 if max(ids) >= 0 else None\n")
    with Evaluator(workers=1, timeout_s=TIMEOUT_S) as ev:
        assert ev.score(task, make).reward == 1.0  # they were made (and filled)
        assert ev.score(task, find).reward == 0.0
        assert ev.score(task, make).reward == 1.0  # and can be made again: the key is free


# Forks 8 children that each touch 150 MB, say so and hold it for 3 s; `held` counts those that
# said so and are still alive together at the end. (Counting the messages alone would overcount: the
# OOM killer may take a child that had already said so, which lets another one finish.)
_MEMORY_HOG = (
    "import os, select, time\ndef f(a, b):\n    r, w = os.pipe()\n    pids = []\n"
    "    for n in range(8):\n        try:\n            pid = os.fork()\n        except OSError:\n"
    "            break\n        if pid == 0:\n"
    "            x = bytearray(150 << 20)\n            for i in range(0, len(x), 4096):\n"
    "                x[i] = 1\n            os.write(w, bytes([n]))\n            time.sleep(3)\n"
    "            os._exit(0)\n"
    "        pids.append(pid)\n"
    "    said, end = set(), time.monotonic() + 0.8\n"
    "    while len(said) < len(pids) and select.select([r], [], [], max(0, end - time.monotonic()))[0]:\n"
    "        said.update(os.read(r, 8))\n"
    "    time.sleep(0.2)\n"
    "    held = sum(os.waitpid(pids[n], os.WNOHANG)[0] == 0 for n in said)\n"
    "    return held\n")


def test_memory_cgroups_left_by_a_killed_trainer_are_removed():
    import subprocess
    import sys

    from sweet_jax.sandbox.evaluator import _MemoryCgroups

    cgroups = _MemoryCgroups()
    if not cgroups.available:  # nothing is made, so nothing can be left: the rlimits apply instead
        with Evaluator(workers=1, memory_cgroup=True) as ev:
            assert "at most 8 processes x RLIMIT_AS" in ev.isolation["isolation"]
        return
    trainer = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True)
    stale = os.path.join(cgroups.base, f"{cgroups.PREFIX}{int(trainer.stdout)}_0")  # its pid is gone
    os.mkdir(stale)
    with Evaluator(workers=1, timeout_s=TIMEOUT_S) as ev:
        assert not os.path.exists(stale)
        live = ev._answers.all[0].cgroup
        assert os.path.isdir(live)
        _MemoryCgroups()  # another Evaluator starting leaves a live one alone
        assert os.path.isdir(live)
    assert not os.path.exists(live)


def test_one_memory_bound_per_evaluation_across_its_processes():
    """8 processes x 150 MB with memory_mb=384: with a memory cgroup at most 2 of them hold their
    memory at once; without one, at most 8 processes of 384 MB each (one is the answer's own)."""
    task = {"ground_truth": "def f(a, b):\n    return 8\n", "test_cases": {"c": "f(1, 2)"}}
    for cgroup in (True, False):
        with Evaluator(workers=1, timeout_s=2.0, memory_mb=384, memory_cgroup=cgroup) as ev:
            reference = ev.score(task, "def f(a, b):\n    return 8\n")
            assert reference.reward == 1.0
            has_cgroup = "memory cgroup per evaluation" in ev.isolation["isolation"]
            if cgroup:
                assert has_cgroup == (ev._cgroups is not None)
            else:
                assert not has_cgroup
            held = ev.reference_outputs({"ground_truth": _MEMORY_HOG, "test_cases": {"c": "f(1, 2)"}})
            assert held[0][1] == "ok", held
            assert held[0][2] <= (384 // 150 if has_cgroup else 7), (cgroup, held)
            assert ev.score(task, _MEMORY_HOG).reward == 0.0


