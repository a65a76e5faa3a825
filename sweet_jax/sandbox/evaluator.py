"""Scores ColBench backend answers by running them, and the references, in sandboxed workers.

    with Evaluator(timeout_s=1.0) as evaluator:
        score = evaluator.score(task, answer)          # Score(reward=0.8, passed=8, total=10, ...)
        scores = evaluator.score_many([(task, answer), ...])

Nothing untrusted runs in this process: each worker (sandbox/_worker.py) is a separate process
tree in its own namespaces, and only tagged plain data comes back (sandbox/protocol.py). A case
passes when the reference returned a value that is not None and the answer returned an equal one
(``protocol.values_equal``: Python == on plain values, NaN never equal).

Two pools of workers: one runs references, the other answers, so a child running an answer is
forked from a zygote that has never held a reference's code (it cannot find it by walking memory).
Reference outputs are cached by (compat, code, calls).

compat="sweet_rl" reproduces the official evaluator's rules that change numbers (still sandboxed):
its deny-list of substrings scores 0, its code-fence splitting, exec of the whole answer into a
function's locals for every case (helpers and imports the function needs become invisible; the
reference is run the same way), and any Exception giving None. What it does not reproduce, on
purpose: objects that are not plain data (an always-equal __eq__ passes there, fails here); state
shared between the reference and the answer in one process; a BaseException (SystemExit,
KeyboardInterrupt) aborting the whole official run (here only that case fails); the reference
running without a time limit (here timeout_s applies to it too).

Values in sweet_rl mode: well-known types (numpy scalars and arrays, Counter, OrderedDict, defaultdict,
namedtuples, Decimal, Fraction) are turned into plain values in the child and compared by Python == with
the official NaN identity (protocol.official_plain, values_equal_official); user-defined classes stay
refused. Python 3.13+: the official exec into a function's locals no longer reaches eval (PEP 667), so the
official code there scores every answer 0; this evaluator keeps the <= 3.12 scoring and warns
(OFFICIAL_EXEC_WARNING).

strict (default) differs from sweet_rl in: the answer runs once as a module per evaluation
(imports and helpers visible), the first ```python block is taken, no deny-list.
Both: a case passes only when the reference returned a value that is not None (DESIGN.md) and the
answer returned an equal one; the reference raising or timing out fails the case.

Thread-safe: score_many may be called from several threads.
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from sweet_jax.errors import SweetJaxError
from sweet_jax.sandbox import protocol

log = logging.getLogger(__name__)

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
MAX_CODE_CHARS = 1_000_000
_MAX_RESPONSE_BYTES = 256 << 20
_STARTUP_TIMEOUT_S = 120.0

# The official evaluator scores 0, without running it, an answer containing any of these.
SWEET_RL_DENY_LIST = ("import os", "from os", "import sys", "from sys", "sudo", "transformers",
                      "exit(", "quit(", "argparse")


def task_field(task: Any, name: str) -> Any:
    """A task's field from a record object (sweet_jax.data.schema.Task) or its JSON form (a dict): the sandbox
    reads the tasks it scores without depending on the record types."""
    return task.get(name) if isinstance(task, dict) else getattr(task, name, None)


class SandboxError(SweetJaxError):
    """A problem with the sandbox itself (not with the code it runs)."""


class SandboxUnavailableError(SandboxError):
    """The isolation primitives the sandbox needs are missing on this machine."""


@dataclasses.dataclass(frozen=True)
class Score:
    """reward = passed / total; status 'infra_error' when the sandbox failed (never a pass)."""

    reward: float
    passed: int
    total: int
    status: str
    details: dict

    def to_json(self):
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Answers and tasks


def task_cases(task):
    """[(name, call expression)] of a task's test_cases (a name -> call dict, or a list)."""
    cases = task_field(task, "test_cases")
    if isinstance(cases, dict):
        return [(str(k), str(v)) for k, v in cases.items()]
    if isinstance(cases, (list, tuple)):
        return [(str(i), str(v)) for i, v in enumerate(cases)]
    raise SandboxError(f"task field 'test_cases' must be an object of name -> call expression, "
                       f"got {type(cases).__name__}")


_LANGUAGE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+.-")


def _fenced_blocks(text):
    """[(language, body)] of the ```-fenced blocks of text, in one left-to-right pass (str.find
    only: linear in len(text), where a regex with a lazy body backtracks quadratically on a long
    run of fences without a newline). A fence's first line names the language (its leading
    [A-Za-z0-9_+.-] word after spaces); the body runs to the next ``` or to the end."""
    blocks, pos = [], 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return blocks
        newline = text.find("\n", start + 3)
        if newline < 0:  # no later fence can have a first line either
            return blocks
        header = text[start + 3:newline].lstrip(" \t")
        end = 0
        while end < len(header) and header[end] in _LANGUAGE_CHARS:
            end += 1
        close = text.find("```", newline + 1)
        body_end = len(text) if close < 0 else close
        blocks.append((header[:end], text[newline + 1:body_end]))
        if close < 0:
            return blocks
        pos = close + 3


def extract_code(answer):
    """The Python code of an answer: the first ```python block (else the first fenced block,
    else the whole text), after an optional 'I WANT TO ANSWER:' marker."""
    text = answer
    marker = "I WANT TO ANSWER:"
    if marker in text[:200]:
        text = text.split(marker, 1)[1]
    blocks = _fenced_blocks(text)
    for language, body in blocks:
        if language.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else text


def sweet_rl_code(answer):
    """The official evaluator's rule: (code, None), or (None, reason) when its deny-list hits."""
    for word in SWEET_RL_DENY_LIST:
        if word in answer:
            return None, f"sweet_rl deny-list: contains {word!r}"
    if "```python" in answer:
        answer = answer.split("```python")[1].split("```")[0]
    if "```" in answer:
        answer = answer.split("```")[1].split("```")[0]
    return answer, None


# ----------------------------------------------------------------------------------------------
# Workers (the trainer side of sandbox/_worker.py)


_STALLED = "worker did not answer in time"


class _WorkerFailed(Exception):
    pass


_CGROUP_NUMBERS = itertools.count()  # unique cgroup names across the Evaluators of a process


class _MemoryCgroups:
    """One memory cgroup per worker, so per evaluation (a worker runs one at a time), limiting all
    of its sandboxed processes together. Made beneath this process's own cgroup, in the cgroup v2
    hierarchy where the memory controller is delegated to it, else in the v1 memory hierarchy
    where it may write there; `available` is False otherwise (then rlimits bound each process)."""

    PREFIX = "sweet_jax_sandbox_"

    def __init__(self):
        self.base, self.version = self._find()
        self.available = self.base is not None
        if self.available:
            self._remove_stale()

    def _remove_stale(self):
        """Empty cgroups left by trainers that ended without closing their Evaluator (killed, say)."""
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            pid = name[len(self.PREFIX):].split("_")[0]
            if name.startswith(self.PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(self.base, name))  # fails, harmlessly, unless empty
                except OSError:
                    pass

    @staticmethod
    def _find():
        try:
            with open("/proc/self/cgroup") as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f]
            with open("/proc/self/mountinfo") as f:
                mounts = [line.split() for line in f]
        except OSError:
            return None, None
        for version in (2, 1):
            for hierarchy, controllers, path in lines:
                if version == 2 and (hierarchy, controllers) != ("0", ""):
                    continue
                if version == 1 and "memory" not in controllers.split(","):
                    continue
                for m in mounts:
                    sep = m.index("-")
                    fstype, options = m[sep + 1], m[sep + 3].split(",") if len(m) > sep + 3 else []
                    if m[3] != "/" or (version == 2 and fstype != "cgroup2") or (
                            version == 1 and (fstype != "cgroup" or "memory" not in options)):
                        continue
                    base = os.path.join(m[4], path.lstrip("/"))
                    try:
                        with open(os.path.join(base, "cgroup.procs")) as f:
                            if str(os.getpid()) not in f.read().split():
                                continue
                        if version == 2:
                            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                                if "memory" not in f.read().split():
                                    continue
                    except OSError:
                        continue
                    if os.access(base, os.W_OK):
                        return base, version
        return None, None

    def create(self, limit_mb):
        """A new cgroup limited to limit_mb (swap included); its path, or None if that failed."""
        path = os.path.join(self.base, f"{self.PREFIX}{os.getpid()}_{next(_CGROUP_NUMBERS)}")
        try:
            os.mkdir(path)
        except OSError:
            return None
        files = ({"memory.max": limit_mb << 20, "memory.swap.max": 0} if self.version == 2 else
                 {"memory.limit_in_bytes": limit_mb << 20, "memory.memsw.limit_in_bytes": limit_mb << 20})
        try:
            for name, value in files.items():
                if os.path.exists(os.path.join(path, name)):  # no swap accounting: nothing to set
                    with open(os.path.join(path, name), "w") as f:
                        f.write(str(value))
        except OSError:
            self.remove(path)
            return None
        return path

    @staticmethod
    def remove(path):
        for _ in range(200):  # the namespace's processes die just after the worker
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


class _Worker:
    """One worker process tree. Any failure kills it whole; the pool starts a fresh one."""

    def __init__(self, mode, uid_base, cgroups=None, memory_mb=None):
        self.cgroups = cgroups
        self.cgroup = cgroups.create(memory_mb) if cgroups is not None else None
        self.process = subprocess.Popen(
            [sys.executable, "-I", _WORKER_SCRIPT, mode, str(uid_base), self.cgroup or "-"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={},
            cwd="/", close_fds=True, start_new_session=True)
        try:
            self.report = self._read(time.monotonic() + _STARTUP_TIMEOUT_S)
        except _WorkerFailed as e:
            self.kill()
            raise SandboxUnavailableError(f"sandbox worker ({mode}) did not start: {e}") from None
        if self.report.get("k") == "setup_error":
            self.kill()
            raise SandboxUnavailableError(
                f"sandbox isolation could not be set up: {self.report.get('error')}. It needs user, "
                "mount, network and pid namespaces (root, or unprivileged user namespaces enabled: "
                "sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0) and "
                "mount_setattr (Linux >= 5.12). Pass degraded_ok=True to run in a clearly labelled "
                "degraded mode (child processes + rlimits, no namespaces) instead.")

    def run(self, request, timeout_s):
        try:
            self.process.stdin.write(protocol.pack_frame(request))
            self.process.stdin.flush()
        except (OSError, ValueError) as e:
            raise _WorkerFailed(f"cannot write to the worker: {e}") from None
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline):
        fd = self.process.stdout.fileno()
        header = self._read_exact(fd, 4, deadline)
        size = protocol.unpack_header(header)
        if size > _MAX_RESPONSE_BYTES:
            raise _WorkerFailed(f"worker response of {size} bytes")
        try:
            return protocol.parse_frame_body(self._read_exact(fd, size, deadline))
        except protocol.ValueRejected as e:
            raise _WorkerFailed(f"unreadable worker response: {e}") from None

    @staticmethod
    def _read_exact(fd, n, deadline):
        chunks = []
        poller = select.poll()  # not select(): the trainer may hold more than 1024 fds
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                raise _WorkerFailed(_STALLED)
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                raise _WorkerFailed("worker died (pipe closed)")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def kill(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.process.wait()
        if self.cgroup is not None:
            self.cgroups.remove(self.cgroup)
            self.cgroup = None


class _Pool:
    """Up to `size` workers; a worker that failed is replaced by a fresh one on next use."""

    def __init__(self, mode, size, uid_offset, cgroups=None, memory_mb=None):
        self.mode = mode
        self.cgroups = cgroups
        self.memory_mb = memory_mb
        self.size = size
        self.idle = queue.Queue()
        self.uid_offset = uid_offset
        self.started = 0
        self.lock = threading.Lock()
        self.all = []
        self.closed = False

    def _new_worker(self, slot):
        # Distinct unprivileged host uids per worker (and per process, mostly): the zygote maps
        # to uid_base, its children to uid_base + 1.
        uid_base = 100_000 + (os.getpid() % 10_000) * 4096 + (self.uid_offset + slot % 1024) * 2
        worker = _Worker(self.mode, uid_base, self.cgroups, self.memory_mb)
        worker.slot = slot
        with self.lock:
            self.all.append(worker)
        return worker

    def _acquire(self):
        with self.lock:
            if self.idle.empty() and self.started < self.size:
                slot = self.started
                self.started += 1
                return None, slot
        return self.idle.get(), None

    def run(self, request, timeout_s):
        worker, slot = self._acquire()
        if worker is None:
            try:
                worker = self._new_worker(slot)
            except BaseException as e:
                with self.lock:
                    self.started -= 1
                if isinstance(e, SandboxError):  # worked at start-up (the probe): report, go on
                    return None, f"worker start failed: {e}"
                raise
        try:
            response = worker.run(request, timeout_s)
        except _WorkerFailed as e:
            worker.kill()
            with self.lock:
                self.all.remove(worker)
            try:
                replacement = self._new_worker(worker.slot)
            except SandboxError:
                with self.lock:
                    self.started -= 1
            else:
                self.idle.put(replacement)
            return None, str(e)
        self.idle.put(worker)
        return response, None

    def close(self):
        with self.lock:
            workers, self.all = self.all, []
        for worker in workers:
            worker.kill()


# ----------------------------------------------------------------------------------------------


class Evaluator:
    """Scores answers to ColBench backend tasks in sandboxed worker processes.

    workers: worker processes per pool (default: the usable cores).
    timeout_s: wall-clock limit per test case (and, in strict mode, for running the answer's
        module-level code), enforced by the zygote with SIGKILL of the whole namespace.
    compat: "strict" (our rules) or "sweet_rl" (the official evaluator's scoring, see module doc).
    degraded_ok: where namespaces are unavailable, run without them (labelled 'degraded' in every
        Score's details) instead of raising SandboxUnavailableError.
    memory_mb: memory of one evaluation. Where a memory cgroup can be made (cgroup v2 with the
        memory controller delegated to this process's cgroup, or the v1 memory hierarchy writable),
        all the evaluation's processes together stay within it (the kernel kills one that goes
        over: its case fails); it is also each process's address-space limit (RLIMIT_AS). Without
        a cgroup, RLIMIT_AS alone with at most 8 processes/threads: 8 x memory_mb in all.
    memory_cgroup: False to use the rlimits only, even where a cgroup could be made.
    force_degraded: use the degraded mode even where isolation works (to test it).
    """

    def __init__(self, *, workers=None, timeout_s=2.0, compat="strict", degraded_ok=False,
                 memory_mb=1024, memory_cgroup=True, force_degraded=False,
                 max_cached_references=200_000, _isolated_mode="isolated"):
        if compat not in ("strict", "sweet_rl"):
            raise SandboxError(f"compat must be 'strict' or 'sweet_rl', got {compat!r}")
        if not timeout_s > 0:
            raise SandboxError(f"timeout_s must be > 0, got {timeout_s}")
        self.workers = workers or len(os.sched_getaffinity(0))
        self.timeout_s = float(timeout_s)
        self.compat = compat
        if compat == "sweet_rl" and official_exec_warning() is not None:
            warnings.warn(official_exec_warning(), RuntimeWarning, stacklevel=2)
            print("WARNING: " + official_exec_warning(), file=sys.stderr, flush=True)
        self.memory_mb = int(memory_mb)
        self._references = collections.OrderedDict()
        self._max_cached = max_cached_references
        self._cache_lock = threading.Lock()
        mode = "degraded" if force_degraded else _isolated_mode
        cgroups = _MemoryCgroups() if memory_cgroup else None
        self._cgroups = cgroups if cgroups is not None and cgroups.available else None
        pool_args = {"cgroups": self._cgroups, "memory_mb": self.memory_mb}
        # Probe now, so a machine without isolation fails here, loudly, not mid-training.
        probe = _Pool(mode, self.workers, uid_offset=0, **pool_args)
        try:
            probe.idle.put(probe._new_worker(0))
            probe.started = 1
        except SandboxUnavailableError:
            if not degraded_ok:
                raise
            warnings.warn("sandbox isolation unavailable: running in DEGRADED mode (child processes "
                          "and rlimits only, no namespaces)", RuntimeWarning, stacklevel=2)
            mode = "degraded"
            probe = _Pool(mode, self.workers, uid_offset=0, **pool_args)
            probe.idle.put(probe._new_worker(0))
            probe.started = 1
        self.mode = mode
        self.isolation = probe.all[0].report
        self._answers = probe
        self._reference_pool = _Pool(mode, self.workers, uid_offset=1024, **pool_args)
        self._executor = concurrent.futures.ThreadPoolExecutor(2 * self.workers)

    # -- public API --------------------------------------------------------------------------

    def score(self, task, answer):
        return self.score_many([(task, answer)])[0]

    def score_many(self, pairs, *, progress=False):
        """Scores (task, answer) pairs in parallel over the workers, in order."""
        pairs = list(pairs)
        jobs = [self._prepare(task, answer) for task, answer in pairs]
        references = {}  # ref_key -> cached result or future (held here: the cache may evict)
        for job in jobs:
            key = job["ref_key"]
            if key not in references:
                references[key] = self._cached(key) or self._executor.submit(self._reference, job)
        answer_futures = [self._executor.submit(self._run_answer, job) if job["code"] is not None
                          else None for job in jobs]
        bar = None
        if progress:
            import tqdm  # here only: the sandbox package imports nothing but the standard library and numpy

            bar = tqdm.tqdm(total=len(jobs), desc="sandbox", unit="eval")
        scores = []
        for job, future in zip(jobs, answer_futures):
            answer_result = future.result() if future is not None else None
            reference = references[job["ref_key"]]
            if isinstance(reference, concurrent.futures.Future):
                reference = reference.result()
            scores.append(self._compare(job, reference, answer_result))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return scores

    def reference_outputs(self, task):
        """The reference's outcome per case: [(name, 'ok', value) | (name, status, message)]."""
        job = self._prepare(task, "")
        reference = self._cached(job["ref_key"]) or self._reference(job)
        if reference.get("infra"):
            raise SandboxError(f"reference run failed: {reference['infra']}")
        return [(name,) + tuple(outcome) for name, outcome in zip(job["names"], reference["cases"])]

    def child_host_uids(self):
        """Host uids the sandboxed children of live workers run as (to check for leftovers)."""
        return {w.report.get("child_uid_host") for pool in (self._answers, self._reference_pool)
                for w in list(pool.all)} - {None}

    def close(self):
        self._executor.shutdown(wait=True)
        self._answers.close()
        self._reference_pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _prepare(self, task, answer):
        ground_truth = task_field(task, "ground_truth")
        if not isinstance(ground_truth, str):
            raise SandboxError("task field 'ground_truth' (the reference's Python source) is "
                               f"missing or not a string: {type(ground_truth).__name__}")
        cases = task_cases(task)
        names = [n for n, _ in cases]
        calls = [c for _, c in cases]
        denied = None
        answer = answer if isinstance(answer, str) else ""
        if len(answer) > MAX_CODE_CHARS:  # before any parsing: extraction is linear, but not free
            code, denied = None, f"answer longer than {MAX_CODE_CHARS} characters"
        elif self.compat == "sweet_rl":
            code, denied = sweet_rl_code(answer)
        else:
            code = extract_code(answer)
        reference_code = ground_truth  # run as is, in both modes (as the official code does)
        if code is not None and len(code) > MAX_CODE_CHARS:
            code, denied = None, f"answer longer than {MAX_CODE_CHARS} characters"
        key = hashlib.sha256(json.dumps([self.compat, reference_code, calls]).encode(
            "utf-8", "surrogatepass")).hexdigest()
        return {"code": code, "denied": denied, "reference_code": reference_code, "calls": calls,
                "names": names, "ref_key": key}

    def _request(self, code, calls):
        return {"code": code, "calls": calls, "mode": self.compat, "timeout_s": self.timeout_s,
                "mem_mb": self.memory_mb}

    def _deadline(self, calls):
        # The zygote enforces timeout_s per case; this only catches a worker that stopped working.
        return (len(calls) + 1) * (self.timeout_s + 0.5) + 15.0

    def _cached(self, key):
        with self._cache_lock:
            return self._references.get(key)

    def _run(self, pool, code, calls):
        """One job on a pool's worker. A worker that stopped answering (its deadline passed: the zygote's own
        per-case limit did not end the job, so the worker stalled, e.g. starved of CPU on a loaded machine) has
        been replaced by then; the job runs once more on the fresh one before it counts as infra_error."""
        request, deadline = self._request(code, calls), self._deadline(calls)
        response, failure = pool.run(request, deadline)
        if response is None and failure == _STALLED:
            log.warning("sandbox worker stalled past its %.0f s deadline; running the job again on a fresh "
                        "worker", deadline)
            response, failure = pool.run(request, deadline)
        return response, failure

    def _reference(self, job):
        response, failure = self._run(self._reference_pool, job["reference_code"], job["calls"])
        if response is None:
            return {"infra": failure}
        cases = [_decode_case(case) for case in _response_cases(response, len(job["calls"]))]
        reference = {"infra": None, "cases": cases}
        with self._cache_lock:
            self._references[job["ref_key"]] = reference
            while len(self._references) > self._max_cached:
                self._references.popitem(last=False)
        return reference

    def _run_answer(self, job):
        response, failure = self._run(self._answers, job["code"], job["calls"])
        if response is None:
            return {"infra": failure}
        return {"infra": None, "cases": [_decode_case(case) for case in
                                         _response_cases(response, len(job["calls"]))]}

    def _compare(self, job, reference, answer):
        total = len(job["calls"])
        base = {"isolation": self.mode, "compat": self.compat}
        for who, result in (("reference", reference), ("answer", answer)):
            if result is not None and result.get("infra"):
                return Score(0.0, 0, total, "infra_error", {**base, "error": f"{who}: {result['infra']}"})
        cases = []
        passed = 0
        for i, name in enumerate(job["names"]):
            ref_status, ref_value = reference["cases"][i]
            if job["code"] is None:
                outcome, message = "denied", job["denied"]
            elif ref_status != "ok":
                outcome, message = "reference_error", f"reference {ref_status}: {ref_value}"
            elif ref_value is None:
                outcome, message = "reference_none", "the reference returned None"
            else:
                status, value = answer["cases"][i]
                if status != "ok":
                    outcome, message = status, value
                elif values_equal_safe(ref_value, value, self.compat):
                    outcome, message = "pass", None
                else:
                    outcome, message = "wrong", None
            passed += outcome == "pass"
            case = {"name": name, "outcome": outcome}
            if message:
                case["message"] = str(message)[:300]
            cases.append(case)
        reward = passed / total if total else 0.0
        return Score(reward, passed, total, "ok", {**base, "cases": cases})


OFFICIAL_EXEC_WARNING = (
    "compat='sweet_rl' on Python {version}: the official evaluator execs the answer into a function's locals "
    "and evals the call there; from Python 3.13 (PEP 667) that eval no longer sees the answer's function, so the "
    "official code run on this Python scores every answer 0. sweet_jax scores as the official code did on "
    "Python <= 3.12 (the numbers of the paper); to reproduce a run of the official code on {version}, expect 0.")


def official_exec_warning(version_info=None):
    """The warning for compat='sweet_rl' on Python >= 3.13 (None below 3.13)."""
    v = version_info or sys.version_info
    return OFFICIAL_EXEC_WARNING.format(version=f"{v[0]}.{v[1]}") if tuple(v[:2]) >= (3, 13) else None


def values_equal_safe(expected, actual, compat="strict"):
    try:
        if compat == "sweet_rl":
            return protocol.values_equal_official(expected, actual)
        return protocol.values_equal(expected, actual)
    except RecursionError:  # cannot happen within MAX_DEPTH, kept as a guard
        return False


def _response_cases(response, n):
    cases = response.get("cases")
    if type(cases) is not list or len(cases) != n:
        return [{"s": "invalid", "e": "malformed worker response"}] * n
    return cases


def _decode_case(case):
    """('ok', value) or (status, message) from one case of a worker response."""
    if type(case) is not dict:
        return ("invalid", "malformed case")
    status = case.get("s")
    if status == "ok":
        try:
            return ("ok", protocol.decode_value(case.get("v")))
        except protocol.ValueRejected as e:
            return ("invalid", str(e))
    if status in ("error", "timeout", "crash", "invalid"):
        return (status, str(case.get("e", status))[:300])
    return ("invalid", "unknown case status")
