"""One sandbox worker: isolation set up once, then a single-threaded zygote forking a child per run.

Started by sandbox/evaluator.py as ``python -I _worker.py MODE UID_BASE`` with an empty environment,
stdin/stdout as the control pipes and stderr at /dev/null. Standard library only (plus protocol.py
next to it), so it starts fast and imports nothing from the trainer.

Process layout in isolated mode (MODE = "isolated"):

    outer (root, this script)      waits; killing its process group ends everything
      └ zygote = pid 1 of a new pid namespace, in new user/mount/net/ipc/uts namespaces,
        root *inside* only (mapped to an unprivileged host uid), read-only root filesystem,
        private /tmp, fresh /proc, no network, empty environment
          └ child, one per run: uid 1000 inside (another unprivileged host uid), no capabilities,
            no_new_privs, rlimits, stdio at /dev/null; runs the code and writes results to a pipe

After each run the zygote sends SIGKILL to every process of the namespace (kill(-1) from pid 1),
reaps them all, and mounts a fresh /tmp, so nothing outlives or leaks into the next run.

MODE = "degraded": no namespaces; the same zygote and child, with rlimits, its own process group,
a different uid when started as root, and clean-up by process group and by uid. Clearly weaker.
"""

import builtins
import ctypes
import errno
import gc
import importlib.util
import os
import resource
import select
import signal
import site
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402  (stand-alone import: see protocol.py)

del sys.path[0]

# Modules most answers use, imported once here so that each forked child finds them loaded.
for _name in ("math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
              "datetime", "random", "typing", "statistics", "json", "copy", "operator", "decimal",
              "fractions", "enum", "dataclasses", "textwrap", "unicodedata", "hashlib", "calendar",
              "queue", "multiprocessing", "array", "struct", "abc", "numbers", "time", "io"):
    try:
        __import__(_name)
    except ImportError:
        pass

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 alike
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, 155)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

CHILD_UID_INSIDE = 1000
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None),
           f"mount {fstype or source} on {target}")


def _prctl(option, value):
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


# ----------------------------------------------------------------------------------------------
# Control channel with the trainer (stdin: requests, stdout: responses)


def _read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(message):
    _write_all(1, protocol.pack_frame(message))


def _receive():
    size = protocol.unpack_header(_read_exact(0, 4))
    return protocol.parse_frame_body(_read_exact(0, size))


# ----------------------------------------------------------------------------------------------
# Isolation (once per worker)


def _enter_namespaces(uid_base):
    """Moves this process into new namespaces, mapped to unprivileged host uids by a helper."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    me = os.getpid()
    mapper = os.fork()
    if mapper == 0:  # stays in the host user namespace, where root may write any mapping
        os.close(ready_w)
        os.close(done_r)
        status = 1
        try:
            if os.read(ready_r, 1) == b"u":
                mapping = f"0 {uid_base} 1\n{CHILD_UID_INSIDE} {uid_base + 1} 1\n"
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(mapping)
                status = 0
        except OSError as e:
            os.write(done_w, str(e).encode()[:500])
        os._exit(status)
    os.close(ready_r)
    os.close(done_w)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    try:
        _setup_host_mounts()  # after the fork: the mapper keeps the host's writable /proc
        _check(_libc.unshare(flags), "unshare(user, mount, net, ipc, uts, pid namespaces)")
    except OSError:
        os.write(ready_w, b"x")
        os.waitpid(mapper, 0)
        raise
    os.write(ready_w, b"u")
    message = os.read(done_r, 600)
    _, status = os.waitpid(mapper, 0)
    if status != 0:
        raise OSError(errno.EPERM, f"writing uid_map/gid_map failed: {message.decode(errors='replace')}")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


# What the sandbox's filesystem holds: the system directories and the interpreter, nothing else
# (no /home, /root, /work, /var, /tmp of the host: no data set or reference solution to read).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")


def _interpreter_paths():
    """The base interpreter's prefixes (its standard library). Not a virtual environment's prefix,
    and not the rest of sys.path: a source checkout, an editable install or a package installed
    with `pip install .` (its data files: reference solutions) stays outside."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    # A prefix under /tmp would lie beneath the private /tmp and clash with its mount point; the
    # worker has imported what it needs by then (stdlib only), so such a prefix is left out.
    return sorted(p for p in paths if os.path.isdir(p) and not (p == "/tmp" or p.startswith("/tmp/")))


# Third-party packages answers may import: these only, bind-mounted at one fixed path wherever the
# trainer's environment keeps them (a venv in the repository, under /tmp, or none: then absent).
SANDBOX_PACKAGES = ("numpy",)
PACKAGES_DIR = "/sandbox-packages"


def _package_dirs():
    """[(name, host directory)] of SANDBOX_PACKAGES and the shared libraries their wheels carry."""
    found = []
    for name in SANDBOX_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        package = os.path.realpath(list(spec.submodule_search_locations)[0])
        found.append((name, package))
        libs = os.path.join(os.path.dirname(package), name + ".libs")  # manylinux wheels: $ORIGIN/../../numpy.libs
        if os.path.isdir(libs):
            found.append((name + ".libs", os.path.realpath(libs)))
    return found


def _site_dirs():
    """Every site-packages / dist-packages directory of this interpreter (to be hidden)."""
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    dirs = set(site.getsitepackages(list(prefixes)))
    dirs.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return sorted({os.path.realpath(d) for d in dirs if os.path.isdir(d)})


def _setup_host_mounts():
    """As host root, in a new mount namespace: a new, read-only root holding only the system
    directories, the interpreter, /dev's harmless devices and mount points for /proc and /tmp.
    The user namespace created next copies this tree with every mount locked, so even the
    zygote cannot make it writable or uncover what lies beneath."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    binds = []  # (path in the new root, O_PATH fd of the source), taken before /tmp is covered
    for path in [p for p in _SYSTEM_PATHS if os.path.lexists(p)] + _interpreter_paths():
        if os.path.islink(path) and os.path.dirname(path) == "/":
            binds.append((path, os.readlink(path)))  # /bin -> usr/bin on merged-/usr systems
        elif os.path.isdir(path):
            binds.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    packages = [(f"{PACKAGES_DIR}/{name}", os.open(path, os.O_PATH | os.O_DIRECTORY))
                for name, path in _package_dirs()]
    hidden = _site_dirs()
    devices = [(f"/dev/{d}", os.open(f"/dev/{d}", os.O_PATH)) for d in _DEVICES
               if os.path.exists(f"/dev/{d}")]
    root = "/tmp"  # our mount namespace's /tmp: the host's stays untouched
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, source in binds:
        target = root + path
        if isinstance(source, str):
            os.symlink(source, target)
            continue
        if os.path.lexists(target):  # already inside an earlier bind (e.g. a venv under /usr)
            os.close(source)
            continue
        os.makedirs(target, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{source}", target, None, MS_BIND | MS_REC)
        os.close(source)
    for path in hidden:  # an empty, read-only directory over each site-packages bound above
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0555")
    for path, source in packages:
        os.makedirs(root + path, mode=0o755)
        _mount(f"/proc/self/fd/{source}", root + path, None, MS_BIND | MS_REC)
        os.close(source)
    os.makedirs(root + "/dev/shm", mode=0o755)
    for path, fd in devices:
        open(root + path, "w").close()
        _mount(f"/proc/self/fd/{fd}", root + path, None, MS_BIND)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for name in ("proc", "tmp", ".old_root"):
        os.mkdir(f"{root}/{name}", 0o755)
    # A proc instance must be visible for the zygote to mount its own (mount_too_revealing).
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _check(_libc.syscall(_SYS_PIVOT_ROOT, root.encode(), (root + "/.old_root").encode()),
           "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old_root", MNT_DETACH), "umount the old root")
    os.rmdir("/.old_root")
    attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)  # devices: /dev/null
    _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                         ctypes.sizeof(attr)), "mount_setattr(/, read-only, recursive)")


def _sandbox_import_path():
    """Inside: the standard library, then PACKAGES_DIR; no site-packages (they are hidden)."""
    sys.path[:] = [p for p in sys.path if os.path.exists(p) and os.path.basename(p) not in
                   ("site-packages", "dist-packages")] + [PACKAGES_DIR]
    # Finders that site-packages installed (an editable install's, say) go with them.
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith(
        ("_frozen_importlib", "importlib"))]
    sys.path_hooks[:] = [h for h in sys.path_hooks if getattr(h, "__module__", "").startswith(
        ("_frozen_importlib", "importlib", "zipimport"))]
    sys.path_importer_cache.clear()


def _setup_sandbox_mounts():
    """In the zygote (pid 1 of the new pid namespace): its own /proc, private /tmp and /dev/shm."""
    try:
        _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    _fresh_tmp(first=True)


def _fresh_tmp(first=False):
    if not first:
        _check(_libc.umount2(b"/tmp", MNT_DETACH), "umount /tmp")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,nr_inodes=4096,mode=1777")


# ----------------------------------------------------------------------------------------------
# seccomp: a small deny-list filter, written as classic BPF by hand (no library needed). The child
# has no capabilities already; this shrinks the kernel surface it can reach (nested namespaces,
# mounts, ptrace, bpf, io_uring, keyrings, ...). x86_64 only; elsewhere the report says so.

_AUDIT_ARCH_X86_64 = 0xC000003E
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_DENIED_SYSCALLS_X86_64 = (
    101,  # ptrace
    135,  # personality
    155, 161, 165, 166,  # pivot_root, chroot, mount, umount2
    159, 164, 227,  # adjtimex, settimeofday, clock_settime
    163, 167, 168, 169, 179,  # acct, swapon, swapoff, reboot, quotactl
    175, 176, 313,  # init_module, delete_module, finit_module
    246, 320,  # kexec_load, kexec_file_load
    248, 249, 250,  # add_key, request_key, keyctl
    272, 308,  # unshare, setns
    298, 304, 310, 311, 321, 323,  # perf_event_open, open_by_handle_at, process_vm_*, bpf, userfaultfd
    425, 426, 427,  # io_uring_*
    428, 429, 430, 431, 432, 442,  # open_tree, move_mount, fsopen, fsconfig, fsmount, mount_setattr
)
_SYS_CLONE, _SYS_CLONE3 = 56, 435
_NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                    | CLONE_NEWNET | 0x02000000)  # ... | CLONE_NEWCGROUP


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program():
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    eperm = _SECCOMP_RET_ERRNO | errno.EPERM
    enosys = _SECCOMP_RET_ERRNO | errno.ENOSYS
    # (code, k, true-label, false-label); labels resolved to relative jumps below.
    program = [(ld, 4, None, None), (jeq, _AUDIT_ARCH_X86_64, "nr", "kill")]
    program += [("label", "nr"), (ld, 0, None, None), (jge, 0x40000000, "deny", "next")]  # x32 ABI
    for nr in _DENIED_SYSCALLS_X86_64:
        program.append((jeq, nr, "deny", "next"))
    program += [(jeq, _SYS_CLONE3, "nosys", "next"),  # libc falls back to clone, checked below
                (jeq, _SYS_CLONE, "clone", "allow"),
                ("label", "clone"), (ld, 16, None, None),  # low half of clone's flags argument
                (jset, _NAMESPACE_FLAGS, "deny", "allow"),
                ("label", "allow"), (ret, _SECCOMP_RET_ALLOW, None, None),
                ("label", "deny"), (ret, eperm, None, None),
                ("label", "nosys"), (ret, enosys, None, None),
                ("label", "kill"), (ret, _SECCOMP_RET_KILL_PROCESS, None, None)]
    labels, index = {}, 0
    for item in program:
        if item[0] == "label":
            labels[item[1]] = index
        else:
            index += 1
    out, index = [], 0
    for item in program:
        if item[0] == "label":
            continue
        code, k, if_true, if_false = item
        def rel(label):
            return 0 if label in (None, "next") else labels[label] - index - 1
        out.append(_SockFilter(code, rel(if_true), rel(if_false), k))
        index += 1
    return (_SockFilter * len(out))(*out)


_SECCOMP_FILTER = _seccomp_program() if os.uname().machine == "x86_64" else None


def _install_seccomp():
    if _SECCOMP_FILTER is None:
        return
    prog = _SockFprog(len(_SECCOMP_FILTER), _SECCOMP_FILTER)
    _check(_libc.prctl(22, 2, ctypes.byref(prog), 0, 0), "seccomp filter")  # PR_SET_SECCOMP, FILTER


# ----------------------------------------------------------------------------------------------
# The child: runs untrusted code, reports results on its pipe


def _describe(exc):
    try:
        return type(exc).__name__[:100]
    except BaseException:
        return "exception"


# Processes (and threads: RLIMIT_NPROC counts both) of one evaluation. Without a memory cgroup,
# each has RLIMIT_AS = memory_mb, so an evaluation holds at most MAX_PROCESSES x memory_mb.
MAX_PROCESSES = 8
MAX_PROCESSES_WITH_CGROUP = 32


def _child_main(request, start, result_fd, child_uid, devnull, cgroup_fd):
    if cgroup_fd is not None:
        # Into the evaluation's memory cgroup, before anything else runs: every process the answer
        # starts inherits it, and the cgroup bounds their memory together. (The fd was opened by
        # host root before isolation; the kernel checks the opener's credentials.)
        os.write(cgroup_fd, b"0")
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, 1 << 16)
    os.setsid()
    os.chdir("/tmp")
    os.environ.clear()
    n_calls = len(request["calls"])
    limits = [
        (resource.RLIMIT_AS, request["mem_mb"] << 20),
        (resource.RLIMIT_CPU, int(request["timeout_s"] * (n_calls + 1)) + 2),
        (resource.RLIMIT_FSIZE, 1 << 20),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_NPROC, MAX_PROCESSES_WITH_CGROUP if cgroup_fd is not None else MAX_PROCESSES),
        (resource.RLIMIT_STACK, 64 << 20),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ]
    for limit, value in limits:
        resource.setrlimit(limit, (value, value))
    if child_uid is not None:
        os.setgroups([])
        os.setresgid(child_uid, child_uid, child_uid)
        os.setresuid(child_uid, child_uid, child_uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if child_uid is not None or os.geteuid() != 0:
        _install_seccomp()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)

    def report(message):
        try:
            data = protocol.pack_frame(message)
        except BaseException as e:  # pragma: no cover - values are checked before
            data = protocol.pack_frame({"k": message["k"], "i": message.get("i"), "e": _describe(e)})
        _write_all(result_fd, data)

    official = request["mode"] == "sweet_rl"

    def case_message(i, thunk):
        try:
            value = thunk()
        except BaseException as e:
            return {"k": "case", "i": i, "e": _describe(e)}
        try:
            if official:  # the plain values Python == equates well-known types with (protocol.official_plain)
                return {"k": "case", "i": i, "v": protocol.encode_value(
                    protocol.official_plain(value, sys.modules), shared_nans=protocol.shared_nans(sys.modules))}
            return {"k": "case", "i": i, "v": protocol.encode_value(value)}
        except protocol.ValueRejected as e:
            return {"k": "case", "i": i, "e": "rejected: " + str(e)[:300]}
        except BaseException as e:
            return {"k": "case", "i": i, "e": "rejected: " + _describe(e)}

    code, calls = request["code"], request["calls"]
    if request["mode"] == "sweet_rl":
        # The official evaluator: exec the whole answer into a function's locals, for every case,
        # then eval the call there; any Exception gives None. Helpers and imports defined by the
        # answer are therefore invisible to its function (they land in locals, not globals).
        namespace = {"__name__": "sweet_rl.utils.code_utils", "__builtins__": builtins,
                     "multiprocessing": sys.modules.get("multiprocessing"), "signal": signal,
                     "Empty": getattr(sys.modules.get("queue"), "Empty", None)}
        exec(_OFFICIAL_GET_FUNCTION_OUTPUT, namespace)
        run_case = namespace["get_function_output"]
        for i in range(start, n_calls):
            report(case_message(i, lambda call=calls[i]: run_case(code, call)))
    else:
        module = types.ModuleType("answer")
        module.__dict__["__builtins__"] = builtins
        try:
            exec(compile(code, "<answer>", "exec"), module.__dict__)
        except BaseException as e:
            report({"k": "module_err", "e": _describe(e)})
            os._exit(0)
        report({"k": "module_ok"})
        for i in range(start, n_calls):
            report(case_message(i, lambda call=calls[i]: eval(compile(call, "<test>", "eval"),
                                                              module.__dict__)))
    os._exit(0)


# The official function execs into its own locals and evals the call there. Up to Python 3.12 exec and eval
# share the frame's locals dict; here that dict is explicit, so every Python scores as those did (from 3.13,
# PEP 667, the official code itself no longer sees the answer's function and scores 0: evaluator.py warns).
_OFFICIAL_GET_FUNCTION_OUTPUT = '''
def get_function_output(function_definition, test_case):
    try:
        scope = {"function_definition": function_definition, "test_case": test_case}
        exec(function_definition, globals(), scope)
        return eval(test_case, globals(), scope)
    except Exception:
        return None
'''


# ----------------------------------------------------------------------------------------------
# The zygote: forks children, enforces the wall clock, kills and reaps everything after each run


class Zygote:
    def __init__(self, isolated, child_uid, cgroup_fd=None):
        self.isolated = isolated
        self.child_uid = child_uid
        self.cgroup_fd = cgroup_fd
        self.devnull = os.open("/dev/null", os.O_RDWR)

    def run(self, request):
        if self.isolated:
            # A fresh IPC namespace per evaluation: SysV shared memory, semaphores and message
            # queues (and POSIX queues) made by this evaluation's processes go with the old one
            # once they are killed, so none outlives it or reaches the next evaluation.
            _check(_libc.unshare(CLONE_NEWIPC), "unshare(ipc namespace)")
        calls = request["calls"]
        timeout_s = float(request["timeout_s"])
        strict = request["mode"] != "sweet_rl"
        cases = [None] * len(calls)
        module = "ok"
        start = 0
        self.result_bytes = 0
        # One wall-clock budget for the whole evaluation (the module and every case), below the
        # trainer's own deadline for this worker: code that makes each case (or each re-run of
        # its module) use most of timeout_s runs out of budget, and its remaining cases time out.
        budget = time.monotonic() + timeout_s * (len(calls) + 1)
        while start < len(calls):
            spent = time.monotonic() >= budget
            outcome = None if spent else self._run_child(request, start, timeout_s, budget, strict, cases)
            if spent or outcome == ("budget", None):
                for i in range(start, len(calls)):
                    if cases[i] is None:
                        cases[i] = {"s": "timeout", "e": "the evaluation's time budget is spent"}
                break
            if outcome is not None and outcome[0] == "module":
                module = outcome[1]
                for i in range(start, len(calls)):
                    cases[i] = {"s": "error", "e": "module: " + outcome[1]}
                break
            start = next((i for i, c in enumerate(cases) if c is None), len(calls))
        return {"k": "result", "module": module, "cases": cases}

    def _run_child(self, request, start, timeout_s, budget, strict, cases):
        """Runs cases[start:] in one child; on a hang or crash, marks the current case and returns."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            try:
                _child_main(request, start, write_fd, self.child_uid, self.devnull, self.cgroup_fd)
            finally:
                os._exit(1)
        os.close(write_fd)
        stream = _FrameReader(read_fd)
        waiting_module = strict
        current = start
        deadline = min(time.monotonic() + timeout_s, budget)
        result = None
        try:
            while current < len(cases):
                try:
                    message = stream.next_frame(deadline)
                except TimeoutError:
                    if deadline == budget:
                        # The evaluation's budget ran out, not this step's timeout: a re-run of the
                        # module cut short here has not failed; the remaining cases are out of time.
                        result = ("budget", None)
                        break
                    result = self._mark(cases, current, waiting_module, {"s": "timeout"}, "timeout")
                    break
                except EOFError:
                    status = self._exit_status(pid, deadline)
                    result = self._mark(cases, current, waiting_module,
                                        {"s": "crash", "e": status}, "crash: " + status)
                    break
                except protocol.ValueRejected as e:
                    result = self._mark(cases, current, waiting_module,
                                        {"s": "invalid", "e": str(e)[:300]}, "invalid output")
                    break
                self.result_bytes += stream.last_size
                if self.result_bytes > protocol.MAX_RESULT_BYTES:  # keeps our answer bounded
                    for i in range(current, len(cases)):
                        cases[i] = {"s": "invalid", "e": "results of this evaluation exceed "
                                    f"{protocol.MAX_RESULT_BYTES} bytes"}
                    result = ("case", None)
                    break
                kind = message.get("k")
                if waiting_module:
                    if kind == "module_ok":
                        waiting_module = False
                        deadline = min(time.monotonic() + timeout_s, budget)
                        continue
                    error = _text(message.get("e")) if kind == "module_err" else "protocol violation"
                    result = ("module", error)
                    break
                if kind != "case" or message.get("i") != current:
                    cases[current] = {"s": "invalid", "e": "protocol violation"}
                    result = ("case", None)
                    break
                if "v" in message:
                    # Checked here, by the same decoder the trainer uses (depth, size, hashes), so
                    # that only well-formed values reach the trainer: a forged one fails its case.
                    # A frame with few brackets cannot nest deeply, and the trainer's own decoding
                    # bounds everything else: most results skip this second decoding.
                    try:
                        if stream.last_brackets > _FEW_BRACKETS:
                            protocol.decode_value(message["v"])
                    except protocol.ValueRejected as e:
                        cases[current] = {"s": "invalid", "e": str(e)[:300]}
                    else:
                        cases[current] = {"s": "ok", "v": message["v"]}
                else:
                    cases[current] = {"s": "error", "e": _text(message.get("e"))}
                current += 1
                deadline = min(time.monotonic() + timeout_s, budget)
        finally:
            os.close(read_fd)
            self._kill_all(pid)
        return result

    @staticmethod
    def _mark(cases, current, waiting_module, case_outcome, module_outcome):
        if waiting_module:
            return ("module", module_outcome)
        cases[current] = case_outcome
        return ("case", None)

    def _exit_status(self, pid, deadline):
        """How the child ended, if it ends before the deadline (it may have closed its pipe)."""
        while True:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return "exited"
            if got:
                break
            if time.monotonic() > deadline:
                return "closed its result pipe"
            time.sleep(0.002)
        if os.WIFSIGNALED(status):
            return f"killed by signal {os.WTERMSIG(status)}"
        return f"exit status {os.WEXITSTATUS(status)}"

    def _kill_all(self, pid):
        if self.isolated:
            # pid 1 of the namespace: kill(-1) reaches every other process in it, however it
            # detached (setsid, double fork); repeat until no child is left to reap.
            while True:
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
            _fresh_tmp()
            return
        # Degraded: process group, then everything running as the child's uid, then orphans
        # re-parented to us (we are a subreaper).
        for _ in range(100):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.child_uid is not None:
                killer = os.fork()
                if killer == 0:
                    try:
                        os.setresuid(self.child_uid, self.child_uid, self.child_uid)
                        os.kill(-1, signal.SIGKILL)
                    finally:
                        os._exit(0)
                os.waitpid(killer, 0)
            for orphan in _children_of(os.getpid()):
                try:
                    os.kill(orphan, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            reaped = 0
            while True:
                try:
                    got, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if got == 0:
                    break
                reaped += 1
            if not reaped:
                time.sleep(0.005)


_FEW_BRACKETS = 2 * protocol.MAX_DEPTH  # a frame nests at most as deep as it has brackets


def _text(x):
    """A child's error message: a short string, whatever it sent (str() of a forged 900-deep list
    would recurse, of a huge one would take long)."""
    return x[:300] if type(x) is str else "error"


def _children_of(ppid):
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if int(fields[1]) == ppid:
                    children.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return children


class _FrameReader:
    """Reads length-prefixed frames from the child's pipe, with a deadline and size caps."""

    def __init__(self, fd):
        self.fd = fd
        self.buffer = bytearray()
        self.last_size = 0
        self.last_brackets = 0

    def _fill(self, n, deadline):
        while len(self.buffer) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError
            self.buffer += chunk

    def next_frame(self, deadline):
        self._fill(4, deadline)
        size = protocol.unpack_header(bytes(self.buffer[:4]))
        if size > protocol.MAX_FRAME_BYTES:
            raise protocol.ValueRejected(f"result larger than {protocol.MAX_FRAME_BYTES} bytes")
        self._fill(4 + size, deadline)
        self.last_size = size
        body = bytes(self.buffer[4:4 + size])
        self.last_brackets = body.count(b"[") + body.count(b"{")
        del self.buffer[:4 + size]
        return protocol.parse_frame_body(body)


# ----------------------------------------------------------------------------------------------


def _zygote_loop(zygote, report):
    # Children never collect the zygote's objects: fewer copy-on-write page faults per fork.
    gc.collect()
    gc.freeze()
    _send({"k": "ready", **report})
    while True:
        try:
            request = _receive()
        except EOFError:  # the trainer went away
            os._exit(0)
        _send(zygote.run(request))


def _open_cgroup(path):
    """O_WRONLY fd of a memory cgroup's cgroup.procs (opened now, as host root), or None."""
    if path == "-":
        return None
    return os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)


def main():
    mode, uid_base = sys.argv[1], int(sys.argv[2])
    cgroup_path = sys.argv[3] if len(sys.argv) > 3 else "-"
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if mode == "unavailable":  # lets tests exercise the trainer's handling of a failed setup
        _send({"k": "setup_error", "error": "isolation unavailable (simulated)"})
        os._exit(3)
    if mode == "degraded":
        is_root = os.geteuid() == 0
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        zygote = Zygote(isolated=False, child_uid=uid_base + 1 if is_root else None,
                        cgroup_fd=_open_cgroup(cgroup_path))
        _zygote_loop(zygote, {"mode": "degraded", "child_uid_host": zygote.child_uid, "isolation": [
            "child processes", "rlimits", "process group kill"] + (["separate uid"] if is_root else [])})
        return
    try:
        cgroup_fd = _open_cgroup(cgroup_path)
        _enter_namespaces(uid_base)
    except OSError as e:
        _send({"k": "setup_error", "error": str(e)})
        os._exit(3)
    zygote_pid = os.fork()
    if zygote_pid == 0:  # pid 1 of the new pid namespace
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _setup_sandbox_mounts()
            _sandbox_import_path()
            _libc.sethostname(b"sandbox", 7)
            zygote = Zygote(isolated=True, child_uid=CHILD_UID_INSIDE, cgroup_fd=cgroup_fd)
        except OSError as e:
            _send({"k": "setup_error", "error": str(e)})
            os._exit(3)
        _zygote_loop(zygote, {"mode": "isolated", "child_uid_host": uid_base + 1, "isolation": [
            "user/mount/net/ipc/uts/pid namespaces", "read-only root", "private /tmp",
            "no network", "empty environment", f"uid {CHILD_UID_INSIDE} (host {uid_base + 1})",
            "ipc namespace per evaluation", "stdlib + " + ", ".join(SANDBOX_PACKAGES) + " only",
            "memory cgroup per evaluation" if cgroup_fd is not None
            else f"at most {MAX_PROCESSES} processes x RLIMIT_AS",
            "no_new_privs", "seccomp deny-list" if _SECCOMP_FILTER else "no seccomp (not x86_64)",
            "rlimits", "namespace-wide SIGKILL"]})
        os._exit(0)
    for fd in (0, 1):
        os.close(fd)
    _, status = os.waitpid(zygote_pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
