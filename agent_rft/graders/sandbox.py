"""Run a customer's `grade(sample, item)` in a separate, locked-down Python process.

Layers; where the machine refuses one (namespaces, switching users), the others still apply:

1. A fresh interpreter (`python -I -S -B`): no site-packages, no user site, no PYTHON* variables,
   an environment with nothing of the service's in it (`HOME`/`TMPDIR` point at the sandbox),
   its own session (killed as a group), a fresh temporary directory as working directory.
2. A network namespace where the kernel allows one (`unshare --net` when the child then becomes
   `nobody`, else `unshare --user --map-root-user --net`, which also takes away the capabilities
   of a root service): the process has no network interface but a loopback that is down.
   What the machine allows of 2 and 3 is its isolation level (agent_rft/graders/isolation.py); below
   the deployment's minimum the grader does not run at all.
3. A root service's child drops to `nobody` before running user code (when `nobody` can read
   the standard library).
4. Resource limits set in the child before user code runs: address space (memory), CPU time,
   file size, open files, no new processes or threads (RLIMIT_NPROC 0; the kernel does not
   apply it to uid 0), no core dumps.
5. An audit hook (PEP 578, cannot be removed once added) that refuses sockets, processes,
   ctypes, native modules from outside the standard library, reads outside the standard
   library and the sandbox, writes outside the sandbox, crafted bytecode, and every event it
   does not know; and the few os/signal functions that raise no audit event but reach outside
   the process (chroot, pidfd signals, priorities...) are deleted before user code runs.
6. The parent's wall-clock timeout, which kills the process group; and should the parent itself
   die, the child notices (a pipe only the parent holds reaches end-of-file) and exits.

Only the runner writes the result, on the original stdout; the grader's own prints go to stderr,
so a printed "result" (for example the model's output echoing one) is never read as the reward.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from agent_rft.graders.core import GraderError
from agent_rft.graders.isolation import STRONGEST, PythonIsolation

log = logging.getLogger(__name__)

RESULT_LIMIT_BYTES = 1 << 20  # what is read back from the runner
LOG_TAIL_BYTES = 4096  # of the grader's stderr, kept for error details
DETAILS_LIMIT_CHARS = 2000
FILE_SIZE_LIMIT_BYTES = 8 << 20
MAX_FILES_WRITTEN = 64
MAX_OPEN_FILES = 64
NOBODY_UID = 65534
# Modules refused by name (any dotted component), besides `_test*` and `_xx*`/`xx*`: process,
# network and foreign-code access, and C modules that read files or databases without audit events.
DENIED_MODULES = (
    "ctypes", "_ctypes", "_posixsubprocess", "subprocess", "socket", "_socket", "ssl", "_ssl",
    "multiprocessing", "_multiprocessing", "_posixshmem", "sqlite3", "_sqlite3", "dbm", "_dbm", "_gdbm",
    "readline", "_curses", "_curses_panel", "_tkinter", "pwd", "grp", "spwd", "nis", "_crypt", "crypt",
    "syslog", "ossaudiodev", "_interpreters", "_interpchannels", "_interpqueues", "_asyncio", "asyncio", "_uuid",
    # Loaded already and stripped by the runner (see _strip_unaudited_functions): a fresh copy is refused.
    "posix", "_signal",
)
# Functions that reach outside the process without raising an audit event: chroot would make paths
# mean something else than the hook sees; the others reach the service's own process (pidfd
# signals, priority, CPU affinity) or create device nodes. The runner deletes them.
UNAUDITED_FUNCTIONS = (
    "chroot", "mknod", "mkfifo", "pidfd_open", "pidfd_send_signal", "setpriority", "sched_setaffinity",
    "sched_setscheduler", "sched_setparam", "setns", "unshare",
)
# Audit events user code may raise freely; "open", "import" and the path events are checked one by
# one, and anything else (sockets, processes, ctypes, gc walks, tracing, rlimits...) is refused.
SAFE_EVENTS = (
    "compile", "exec", "builtins.id", "marshal.dumps", "function.__new__", "object.__getattr__", "object.__setattr__",
    "object.__delattr__", "sys._getframe", "sys._getframemodulename", "sys._current_frames",
    "sys._current_exceptions", "sys.excepthook", "sys.unraisablehook", "sys.addaudithook", "time.sleep",
    "array.__new__", "builtins.input", "builtins.input/result", "os.putenv", "os.unsetenv", "glob.glob",
    "glob.glob/2", "pickle.find_class", "mmap.__new__", "tempfile.mkstemp", "tempfile.mkdtemp",
    "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.rmtree",
    "shutil.move", "shutil.make_archive", "shutil.unpack_archive", "fcntl.fcntl", "fcntl.flock",
    "fcntl.lockf", "sys.set_asyncgen_hooks_firstiter", "sys.set_asyncgen_hooks_finalizer",
    "cpython._PySys_ClearAuditHooks",
)


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float
    memory_mb: int
    # Below this isolation the grader is not run at all (fail closed): the API's check at job
    # creation saw its own machine, not necessarily this worker's.
    min_isolation: PythonIsolation = PythonIsolation.AUDIT_HOOK
    isolation_cap: PythonIsolation | None = None  # tests: act as a machine that allows no more


async def run_grade_function(source: str, sample: dict[str, Any], item: Any, limits: SandboxLimits) -> float:
    """`grade(sample, item)` of `source`, run in the sandbox. A failure raises GraderError:
    python_grader_runtime_error for the grader's own faults (exception, bad return value, timeout,
    memory), python_grader_server_error when the sandbox itself cannot run."""
    isolation = await asyncio.to_thread(_isolation, limits.isolation_cap)
    if not isolation.level.at_least(limits.min_isolation):
        raise GraderError("python_grader_server_error", isolation_refusal(isolation.level, limits.min_isolation))
    async with _slot():
        sandbox_dir = _make_sandbox_dir(isolation.drop_uid)
        try:
            config = _config(source, sample, item, sandbox_dir, isolation.drop_uid, limits)
            outcome = await _run(isolation.prefix + _interpreter_argv(), config, sandbox_dir, limits)
        finally:
            await asyncio.to_thread(_remove_tree, sandbox_dir)
    return _reward_from(outcome, limits)


def python_isolation(cap: PythonIsolation | None = None) -> PythonIsolation:
    """The isolation python graders get in this process (probed on first use, then remembered)."""
    return _isolation(cap).level


def isolation_refusal(level: PythonIsolation, required: PythonIsolation) -> str:
    """Why python graders are refused here: what is in force, what is required, what changes it."""
    level, required = PythonIsolation(level), PythonIsolation(required)
    return (
        f"python graders run here under isolation '{level}' ({level.describe()}), below the required "
        f"'{required}' ({required.describe()}). Allow namespaces (unshare) for the service's user on this "
        f"machine, or set AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION={level} to accept it."
    )


# --- the parent side -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Outcome:
    result: bytes
    result_overflowed: bool
    log_tail: bytes
    returncode: int


_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _slot() -> asyncio.Semaphore:
    """About one sandbox per CPU at a time: the timeout is wall-clock, and graders that share
    an oversubscribed CPU would be killed for the crowd rather than for their own slowness."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(max(2, os.cpu_count() or 2))
    return _slots[loop]


@dataclass(frozen=True)
class _Isolation:
    level: PythonIsolation
    prefix: list[str]  # the `unshare` command line, or [] where no namespace can be had
    drop_uid: int | None  # the uid the child switches to before running user code


_probe_lock = threading.Lock()
_probed: dict[PythonIsolation | None, _Isolation] = {}


def _isolation(cap: PythonIsolation | None = None) -> _Isolation:
    with _probe_lock:
        if cap not in _probed:
            _probed[cap] = _probe_isolation(cap)
            _log_isolation(_probed[cap].level, cap)
        return _probed[cap]


def _probe_isolation(cap: PythonIsolation | None = None) -> _Isolation:
    """The strongest isolation this machine allows, no stronger than `cap`, tried once per process:
    as root, a network namespace and the `nobody` user (when nobody can read the standard
    library); otherwise a user + network namespace (no capabilities outside it); as root, a
    network namespace alone; else nothing but the audit hook."""
    unshare = shutil.which("unshare")
    for level, flags, drop_uid in _candidates() if unshare else []:
        if cap is not None and not PythonIsolation(cap).at_least(level):
            continue  # the cap only ever skips modes: it cannot make the machine allow more
        prefix = [unshare, *flags, "--"]
        try:
            probe = subprocess.run(
                [*prefix, sys.executable, "-I", "-S", "-c", "pass"], capture_output=True, timeout=20, env={}
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return _Isolation(level, prefix, drop_uid)
    return _Isolation(PythonIsolation.AUDIT_HOOK, [], None)


def _candidates() -> list[tuple[PythonIsolation, list[str], int | None]]:
    """The modes this process could use, strongest first: (level, unshare flags, uid to drop to)."""
    root = os.geteuid() == 0
    candidates: list[tuple[PythonIsolation, list[str], int | None]] = []
    if root and _stdlib_readable_by_others():
        candidates.append((PythonIsolation.UID_DROP_NETNS, ["--net"], NOBODY_UID))
    candidates.append((PythonIsolation.USER_NETNS, ["--user", "--map-root-user", "--net"], None))
    if root:
        candidates.append((PythonIsolation.ROOT_NETNS, ["--net"], None))
    return candidates


def _log_isolation(level: PythonIsolation, cap: PythonIsolation | None) -> None:
    """Once per process (and cap): operators should see when graders run with less than the best."""
    capped = f" (capped by AGENT_RFT_PYTHON_GRADER_ISOLATION_CAP={cap})" if cap is not None else ""
    if level == STRONGEST:
        log.info("python grader isolation: %s (%s)%s", level, level.describe(), capped)
        return
    log.warning("python grader isolation: %s (%s), below the strongest, %s (%s)%s; "
                "AGENT_RFT_PYTHON_GRADER_MIN_ISOLATION sets the least that is accepted",
                level, level.describe(), STRONGEST, STRONGEST.describe(), capped)


def _stdlib_readable_by_others() -> bool:
    """Whether `nobody` can import the standard library: every directory on the way searchable."""
    try:
        for top in {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}:
            path = os.path.realpath(top)
            if not os.stat(path).st_mode & stat.S_IROTH:
                return False
            while path != "/":
                if not os.stat(path).st_mode & stat.S_IXOTH:
                    return False
                path = os.path.dirname(path)
    except OSError:
        return False
    return True


def _make_sandbox_dir(drop_uid: int | None) -> str:
    path = os.path.realpath(tempfile.mkdtemp(prefix="agent-rft-python-grader-"))
    if drop_uid is not None:
        os.chown(path, drop_uid, drop_uid)
    return path


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func: Any, failed: str, _exc: Any) -> None:
        # The grader may have chmod-ed its own files and directories read-only.
        try:
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            func(failed)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=make_writable_and_retry)


def _interpreter_argv() -> list[str]:
    if not sys.executable:
        raise GraderError("python_grader_server_error", "no Python interpreter to run the grader with")
    # The runner's source comes first on stdin (a JSON string on one line), not on the command line.
    bootstrap = "import json,sys;exec(json.loads(sys.stdin.buffer.readline()))"
    return [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", bootstrap]


def _config(
    source: str, sample: dict[str, Any], item: Any, sandbox_dir: str, drop_uid: int | None, limits: SandboxLimits
) -> dict[str, Any]:
    return {
        "source": source, "sample": sample, "item": item, "sandbox_dir": sandbox_dir, "drop_uid": drop_uid,
        "memory_bytes": limits.memory_mb << 20, "cpu_seconds": math.ceil(limits.timeout_s) + 1,
        "file_size_bytes": FILE_SIZE_LIMIT_BYTES, "max_files_written": MAX_FILES_WRITTEN,
        "max_open_files": MAX_OPEN_FILES, "denied_modules": DENIED_MODULES, "safe_events": SAFE_EVENTS,
        "unaudited_functions": UNAUDITED_FUNCTIONS,
        "details_limit": DETAILS_LIMIT_CHARS,
    }


async def _run(argv: list[str], config: dict[str, Any], sandbox_dir: str, limits: SandboxLimits) -> _Outcome:
    env = {"LC_ALL": "C.UTF-8", "HOME": sandbox_dir, "TMPDIR": sandbox_dir}
    # The child watches the read end of this pipe; only this process holds the write end, so the
    # child sees end-of-file exactly when this process is gone (see _exit_with_parent).
    lifeline, lifeline_holder = os.pipe()
    payload = "\n".join((json.dumps(_child_program()), json.dumps({**config, "lifeline_fd": lifeline}, default=str)))
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=sandbox_dir, env=env, start_new_session=True, pass_fds=(lifeline,),
        )
    except OSError as exc:
        os.close(lifeline_holder)
        raise GraderError("python_grader_server_error", f"cannot start the grader process: {exc}") from None
    finally:
        os.close(lifeline)
    try:
        async with asyncio.timeout(limits.timeout_s):
            (result, overflowed), (log_tail, _), _, returncode = await asyncio.gather(
                _read_capped(proc.stdout, RESULT_LIMIT_BYTES, keep_tail=False),
                _read_capped(proc.stderr, LOG_TAIL_BYTES, keep_tail=True),
                _feed(proc.stdin, payload.encode()),
                proc.wait(),
            )
    except TimeoutError:
        raise GraderError("python_grader_runtime_error", f"timed out after {limits.timeout_s:g} s") from None
    finally:
        await _kill(proc)
        os.close(lifeline_holder)
    return _Outcome(result, overflowed, log_tail, returncode)


async def _read_capped(stream: asyncio.StreamReader | None, limit: int, keep_tail: bool) -> tuple[bytes, bool]:
    """Read to the end, keeping at most `limit` bytes (the first or the last): a grader printing
    gigabytes must not fill the service's memory. True when something was dropped."""
    kept = bytearray()
    dropped = False
    while stream is not None and (chunk := await stream.read(1 << 16)):
        kept += chunk
        if len(kept) > limit:
            dropped = True
            kept = kept[-limit:] if keep_tail else kept[:limit]
    return bytes(kept), dropped


async def _feed(stdin: asyncio.StreamWriter | None, payload: bytes) -> None:
    if stdin is None:
        return
    try:
        stdin.write(payload)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the child died early; its exit status says why


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


def _reward_from(outcome: _Outcome, limits: SandboxLimits) -> float:
    if outcome.result_overflowed:
        raise GraderError(
            "python_grader_runtime_error", f"the grader's result is larger than {RESULT_LIMIT_BYTES} bytes"
        )
    if not outcome.result:
        # 126/127: the launcher could not execute the interpreter at all, so no grader code ran.
        flag = "python_grader_server_error" if outcome.returncode in (126, 127) else "python_grader_runtime_error"
        raise GraderError(flag, _describe_exit(outcome, limits))
    try:
        message = json.loads(outcome.result, parse_constant=_refuse_constant)
    except ValueError:
        raise GraderError("python_grader_runtime_error", "the grader process returned an unreadable result") from None
    if not isinstance(message, dict):
        raise GraderError("python_grader_runtime_error", "the grader process returned an unreadable result")
    if "server_error" in message:
        raise GraderError("python_grader_server_error", str(message["server_error"])[:DETAILS_LIMIT_CHARS])
    if "error" in message:
        raise GraderError("python_grader_runtime_error", _with_memory_hint(str(message["error"]), limits))
    reward = message.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise GraderError("python_grader_runtime_error", f"grade() returned {reward!r}, not a finite float")
    return float(reward)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a reward")


def _describe_exit(outcome: _Outcome, limits: SandboxLimits) -> str:
    code = outcome.returncode
    if code == -signal.SIGXCPU:
        reason = f"used more than its CPU time limit ({math.ceil(limits.timeout_s) + 1} s)"
    elif code == -signal.SIGXFSZ:
        reason = f"wrote a file larger than {FILE_SIZE_LIMIT_BYTES >> 20} MB"
    elif code < 0:
        reason = f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"died ({code})"
    else:
        reason = f"exited with status {code}"
    tail = outcome.log_tail.decode("utf-8", "replace").strip()[-DETAILS_LIMIT_CHARS // 2 :]
    message = f"the grader process {reason} without returning a result" + (f"; its last output: {tail}" if tail else "")
    return _with_memory_hint(message, limits)


def _with_memory_hint(message: str, limits: SandboxLimits) -> str:
    if "MemoryError" in message:
        message += f" (the grader may use at most {limits.memory_mb} MB)"
    return message[: DETAILS_LIMIT_CHARS + 100]


@functools.cache
def _child_program() -> str:
    """The runner's source, from the functions below: they use nothing but the stdlib."""
    functions = (
        _child_main, _exit_with_parent, _drop_privileges, _apply_limits, _strip_unaudited_functions, _make_audit_hook, _call_grade,
        _check_reward,
        _describe_exception, _send,
    )
    parts = ["from __future__ import annotations"] + [inspect.getsource(fn) for fn in functions]
    return "\n\n".join(parts) + "\n_child_main()\n"


# --- the child side: shipped as source to `python -c`, so only the stdlib and each other ------


def _child_main() -> None:
    import json
    import os
    import resource  # noqa: F401 - imported while still able to read the stdlib, used by _apply_limits
    import sys

    config = json.loads(sys.stdin.buffer.read())
    _exit_with_parent(config["lifeline_fd"])
    result_fd = os.dup(1)
    os.dup2(2, 1)  # the grader's prints go to stderr: only this runner writes to the result channel
    sys.stdout.reconfigure(line_buffering=True)  # so that a crash's description shows the last lines
    try:
        _drop_privileges(config["drop_uid"])
        _apply_limits(config)
        _strip_unaudited_functions(config["unaudited_functions"])
        os.chdir(config["sandbox_dir"])
        path = "grader.py"  # in the working directory, so that tracebacks show the grader's lines
        with open(path, "w", encoding="utf-8") as file:
            file.write(config["source"])
        read_roots = tuple(p for p in sys.path if p)
        sys.addaudithook(_make_audit_hook(config, read_roots))  # no name keeps a reference to it
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a sandbox failure
        _send(result_fd, {"server_error": f"sandbox setup failed: {type(exc).__name__}: {exc}"})
    _send(result_fd, _call_grade(config, path))


def _exit_with_parent(fd: int) -> None:
    """Exit when the service process is gone (a crashed or killed worker): a grader asleep in
    time.sleep uses no CPU time, so without this it would outlive the timeout that never fires."""
    import _thread
    import os

    def watch() -> None:
        while os.read(fd, 1024):
            pass
        os._exit(70)

    _thread.stack_size(1 << 16)
    _thread.start_new_thread(watch, ())  # before RLIMIT_NPROC forbids threads
    _thread.stack_size(0)


def _drop_privileges(uid: int | None) -> None:
    import os

    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError("could not drop privileges")


def _apply_limits(config: dict) -> None:
    import resource

    limits = (
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        # SIGXCPU at the soft limit, SIGKILL a second later should the grader catch SIGXCPU.
        (resource.RLIMIT_CPU, config["cpu_seconds"], config["cpu_seconds"] + 1),
        (resource.RLIMIT_FSIZE, config["file_size_bytes"], config["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, config["max_open_files"], config["max_open_files"]),
        (resource.RLIMIT_NPROC, 0, 0),  # no fork, no threads
        (resource.RLIMIT_CORE, 0, 0),
    )
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _strip_unaudited_functions(names: list) -> None:
    import os
    import posix
    import sys

    for module in (posix, os, sys.modules.get("_signal"), sys.modules.get("signal")):
        for name in names:
            if module is not None and hasattr(module, name):
                delattr(module, name)


def _make_audit_hook(config: dict, read_roots: tuple) -> object:
    """The audit hook. Everything it uses is captured here, as C functions and immutable values,
    so that user code patching builtins or modules cannot change what it checks."""
    import posix

    sandbox = config["sandbox_dir"]
    library_roots = tuple(read_roots)
    readable_roots = library_roots + (sandbox,)
    denied_modules = frozenset(config["denied_modules"])
    safe_events = frozenset(config["safe_events"])
    lstat, getcwd, read, open_fd, close = posix.lstat, posix.getcwd, posix.read, posix.open, posix.close
    o_rdonly = posix.O_RDONLY
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    is_instance, exact_str, decode, length = isinstance, "".join, bytes.decode, len
    str_type, bytes_type, int_type, bool_type = str, bytes, int, bool
    deny, refuse_import, os_error = PermissionError, ImportError, OSError
    state = {"files_left": config["max_files_written"], "expected_pyc": None, "reading_pyc": False}

    def normalize(path: object) -> str | None:
        """An absolute path made of plain components, or None: '..' is refused outright so that
        no directory file descriptor (dir_fd) can make a path mean something else than it says."""
        if is_instance(path, bytes_type):
            path = decode(path, "utf-8", "surrogateescape")
        elif is_instance(path, str_type):
            path = exact_str((path,))  # an exact str, whatever a str subclass pretends
        else:
            return None
        if "\x00" in path:
            return None
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                return None
            if part not in ("", "."):
                parts.append(part)
        return "/" + "/".join(parts)

    def within(path: str, roots: tuple) -> bool:
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return not has_symlink(path, root)
        return False

    def has_symlink(path: str, root: str) -> bool:
        current = root
        for part in path[length(root) + 1 :].split("/"):
            if not part:
                continue
            current = current + "/" + part
            try:
                mode = lstat(current).st_mode
            except os_error:
                return False  # does not exist (yet): nothing to follow
            if mode & 0o170000 == 0o120000:
                return True
        return False

    def is_directory(path: str) -> bool:
        try:
            return lstat(path).st_mode & 0o170000 == 0o040000
        except os_error:
            return False

    def slurp(path: str) -> bytes:
        fd = open_fd(path, o_rdonly)
        try:
            chunks = []
            while chunk := read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            close(fd)

    def check_open(path: object, flags: object) -> None:
        if is_instance(path, int_type) and not is_instance(path, bool_type):
            return  # an already open descriptor, itself obtained through a checked open
        where = normalize(path)
        writes = not is_instance(flags, int_type) or flags & write_flags
        if where is None:
            raise deny(f"open({path!r}) is not allowed in the python grader sandbox: use a plain str path without '..'")
        if writes:
            if not within(where, (sandbox,)):
                raise deny(f"writing {where} is not allowed: the python grader may only write in its working directory")
            if state["files_left"] <= 0:
                raise deny("the python grader may not open more files for writing")
            state["files_left"] -= 1
            return
        if not within(where, readable_roots) or (is_directory(where) and not within(where, (sandbox,))):
            raise deny(f"reading {where} is not allowed in the python grader sandbox")
        if where.endswith(".pyc") and not state["reading_pyc"] and within(where, library_roots):
            state["reading_pyc"] = True  # the read below raises an "open" event of its own
            try:
                state["expected_pyc"] = slurp(where)  # the only bytes marshal.loads will accept next
            finally:
                state["reading_pyc"] = False

    def check_path(path: object, roots: tuple, what: str) -> None:
        where = normalize(path)
        if where is None or not within(where, roots):
            raise deny(f"{what} {path!r} is not allowed in the python grader sandbox")

    def check_import(name: object, filename: object) -> None:
        if not is_instance(name, str_type):
            raise refuse_import("import refused in the python grader sandbox")
        name = exact_str((name,))  # a str subclass could override split()
        for part in name.split("."):
            if part in denied_modules or part.startswith(("_test", "_xx", "xx")):
                raise refuse_import(f"module {name!r} is not available in the python grader sandbox", name=name)
        # A native extension is loaded only from the standard library: never one the grader wrote.
        if filename is not None:
            where = normalize(filename)
            if where is None or not within(where, library_roots):
                raise refuse_import(f"loading native code from {filename!r} is not allowed", name=name)

    def check_bytecode(data: object) -> None:
        # Crafted bytecode can corrupt the interpreter's memory: only compiled stdlib modules load.
        expected, state["expected_pyc"] = state["expected_pyc"], None
        if expected is None or not is_instance(data, bytes_type) or data != expected[16:]:
            raise deny("marshal.loads is not allowed in the python grader sandbox")

    # No "inside the hook" flag that skips checks: a signal handler of the grader's could run
    # while it is set. Every event, the hook's own included, goes through the checks.
    def hook(event: str, args: tuple) -> None:
        if event in safe_events:
            return
        if event == "open":
            check_open(args[0], args[2])
        elif event == "import":
            check_import(args[0], args[1])
        elif event == "marshal.loads":
            check_bytecode(args[0])
        elif event in ("os.listdir", "os.scandir"):
            if args[0] is not None and not is_instance(args[0], int_type):
                check_path(args[0], readable_roots, "listing")
        elif event in ("os.mkdir", "os.rmdir", "os.remove", "os.truncate", "os.chmod", "os.utime", "os.chdir"):
            if not (event == "os.truncate" and is_instance(args[0], int_type)):
                check_path(args[0], (sandbox,), event)
        elif event == "os.rename":
            check_path(args[0], (sandbox,), event)
            check_path(args[1], (sandbox,), event)
        else:
            raise deny(f"{event} is not allowed in the python grader sandbox")

    return hook


def _call_grade(config: dict, path: str) -> dict:
    import sys
    import traceback  # now, while memory is plentiful: a MemoryError is reported with it
    import types

    # A real module (in sys.modules) so that dataclasses, typing and pickle find the grader's classes.
    module = sys.modules["grader"] = types.ModuleType("grader")
    module.__file__ = path
    namespace = module.__dict__
    try:
        exec(compile(config["source"], path, "exec"), namespace)
        grade = namespace.get("grade")
        if not callable(grade):
            return {"error": "the source does not define a function grade(sample, item)"}
        value = grade(config["sample"], config["item"])
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: every way out is reported
        # Free what the grader held (its globals, its frames' locals), so that even a
        # MemoryError leaves room to describe it.
        namespace.clear()
        traceback.clear_frames(exc.__traceback__)
        return {"error": _describe_exception(exc, config["details_limit"])}
    return _check_reward(value)


def _check_reward(value: object) -> dict:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            shown = repr(value)[:200]
        except Exception:  # noqa: BLE001
            shown = "?"
        return {"error": f"grade() must return a float, got {type(value).__name__}: {shown}"}
    try:
        reward = float(value)
    except OverflowError:
        reward = math.inf
    if not math.isfinite(reward):
        return {"error": f"grade() returned {reward}, not a finite float"}
    return {"reward": reward}


def _describe_exception(exc: BaseException, limit: int) -> str:
    """The traceback's last lines, without the runner's and the audit hook's frames (`<string>`)."""
    try:
        import traceback

        report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
        report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != "<string>"])
        return "".join(report.format()).strip()[-limit:]
    except BaseException:  # noqa: BLE001 - e.g. still out of memory
        try:
            return f"{type(exc).__name__}: {exc}"[-limit:]
        except BaseException:  # noqa: BLE001
            return type(exc).__name__


def _send(fd: int, message: dict) -> None:
    import json
    import os

    data = json.dumps(message).encode()
    while data:
        data = data[os.write(fd, data) :]
    os._exit(0)
