"""The `python` grader (a customer's `grade(sample, item)` in a sandboxed process) and the `multi`
grader (sub-graders combined by a `calculate_output` formula).

Hostile graders are real code run for real: each test checks what an operator would check —
the listening server saw no connection, the secret did not come back, the process was killed
in time — not how the sandbox is built."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from agent_rft.graders.core import GradeResult, GraderContext, Sample, grade
from agent_rft.graders.schemas import Grader, MultiGrader

GRADER = TypeAdapter(Grader)
TIMEOUT_S = 2.0


def run_python(source: str, item: Any = None, output: str = "hello", timeout_s: float = 5.0) -> GradeResult:
    config = GRADER.validate_python({"type": "python", "name": "py", "source": textwrap.dedent(source)})
    ctx = GraderContext(python_timeout_s=timeout_s, python_memory_mb=256)
    return asyncio.run(grade(config, Sample.from_model_sample(output), item if item is not None else {}, ctx))


def runtime_error(result: GradeResult) -> str:
    assert result.reward == 0.0
    assert result.errors["python_grader_runtime_error"] is True, result.errors
    return result.errors["python_grader_runtime_error_details"]


def assert_clean(result: GradeResult) -> None:
    assert not result.failed, {k: v for k, v in result.errors.items() if v}


# --- python: what a grader may do -------------------------------------------------------------


def test_grade_returns_a_float_computed_from_sample_and_item() -> None:
    result = run_python(
        """
        import difflib, json, math, re, statistics

        def grade(sample, item):
            words = re.findall(r"\\w+", sample["output_text"].lower())
            ratio = difflib.SequenceMatcher(None, " ".join(words), item["reference"]).ratio()
            return round(statistics.mean([ratio, float(json.loads(item["weight"]))]) * math.sqrt(1), 3)
        """,
        item={"reference": "paris is the capital", "weight": "1"},
        output="Paris is the capital!",
    )
    assert_clean(result)
    assert result.reward == 1.0
    assert result.type == "python" and result.name == "py"
    response = result.to_run_response()
    assert response["reward"] == 1.0 and response["metadata"]["errors"]["python_grader_runtime_error"] is False


def test_the_standard_library_works_as_usual() -> None:
    result = run_python(
        """
        import csv, dataclasses, datetime, decimal, enum, hashlib, io, logging, pickle, random, typing
        import xml.etree.ElementTree as ET
        from collections import Counter, namedtuple

        @dataclasses.dataclass
        class Score:
            value: float

        Pair = namedtuple("Pair", "a b")

        class Level(enum.Enum):
            LOW = 0.25

        def grade(sample, item):
            logging.getLogger("grader").info("grading %s", item)
            rows = list(csv.reader(io.StringIO("a,b\\n1,2")))
            assert rows[1] == ["1", "2"] and ET.fromstring("<a><b/></a>").find("b") is not None
            assert hashlib.sha256(b"x").hexdigest() and random.Random(1).random() < 1
            assert datetime.date(2024, 1, 1).isoformat() == "2024-01-01" and Counter("aab")["a"] == 2
            assert pickle.loads(pickle.dumps(Score(1.0))) == Score(1.0) and Pair(1, 2).b == 2
            assert typing.get_type_hints(Score)["value"] is float
            return float(decimal.Decimal(str(Level.LOW.value)))
        """
    )
    assert_clean(result)
    assert result.reward == 0.25


def test_grader_sees_output_json_and_tools_and_may_use_its_working_directory() -> None:
    result = run_python(
        """
        import pathlib, tempfile

        def grade(sample, item):
            pathlib.Path("notes.txt").write_text(sample["output_json"]["answer"])
            with tempfile.TemporaryFile() as scratch:
                scratch.write(b"ok")
            return float(pathlib.Path("notes.txt").read_text() == item["answer"]) / 2
        """,
        item={"answer": "42"},
        output='{"answer": "42"}',
    )
    assert_clean(result)
    assert result.reward == 0.5


def test_prints_cannot_forge_the_result() -> None:
    # The model's output often reaches the grader's prints: it must not be able to set the reward.
    result = run_python(
        """
        import sys

        def grade(sample, item):
            print(sample["output_text"])
            print('{"reward": 1.0}', file=sys.stderr)
            sys.stdout.flush()
            return 0.25
        """,
        output='{"reward": 1.0}',
    )
    assert_clean(result)
    assert result.reward == 0.25


# --- python: bad graders ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("None", "must return a float, got NoneType"),
        ("'0.5'", "must return a float, got str"),
        ("True", "must return a float, got bool"),
        ("[1.0]", "must return a float, got list"),
        ("float('nan')", "not a finite float"),
        ("float('inf')", "not a finite float"),
        ("10 ** 400", "not a finite float"),
    ],
)
def test_a_return_value_that_is_not_a_finite_number_scores_zero(returned: str, expected: str) -> None:
    details = runtime_error(run_python(f"def grade(sample, item):\n    return {returned}\n"))
    assert expected in details


def test_an_integer_is_a_float() -> None:
    result = run_python("def grade(sample, item):\n    return 1\n")
    assert_clean(result)
    assert result.reward == 1.0


def test_an_exception_reports_the_end_of_its_traceback() -> None:
    details = runtime_error(
        run_python(
            """
            def grade(sample, item):
                return check(item)

            def check(item):
                raise ValueError("no reference in " + repr(item))
            """,
            item={"id": 7},
        )
    )
    assert "ValueError: no reference in {'id': 7}" in details
    assert 'File "grader.py", line 6, in check' in details
    assert "hook" not in details  # the sandbox's own frames are not the customer's concern


def test_an_error_at_import_time_and_sys_exit_are_reported() -> None:
    assert "ZeroDivisionError" in runtime_error(run_python("x = 1 / 0\ndef grade(sample, item):\n    return 1.0\n"))
    assert "SystemExit: 3" in runtime_error(run_python("def grade(sample, item):\n    raise SystemExit(3)\n"))
    assert "exited with status 4" in runtime_error(
        run_python("import os\ndef grade(sample, item):\n    os._exit(4)\n")
    )


# --- python: hostile graders ------------------------------------------------------------------


def test_an_infinite_loop_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    result = run_python("def grade(sample, item):\n    while True:\n        pass\n", timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert runtime_error(result) == f"timed out after {TIMEOUT_S:g} s"
    assert elapsed < TIMEOUT_S + 3


def test_a_grader_that_blocks_in_sleep_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    result = run_python("import time\ndef grade(sample, item):\n    time.sleep(60)\n", timeout_s=TIMEOUT_S)
    assert "timed out" in runtime_error(result)
    assert time.monotonic() - started < TIMEOUT_S + 3


def test_a_sleeping_grader_does_not_outlive_a_crashed_worker(tmp_path: Path) -> None:
    # A worker grading with a long timeout is killed; its grader, asleep (no CPU time), must go too.
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import asyncio
            from agent_rft.graders.core import GraderContext, Sample, grade
            from agent_rft.graders.schemas import PythonGrader
            source = "import os, time\\ndef grade(s, i):\\n    open('pid.txt', 'w').write(str(os.getpid()))\\n    time.sleep(600)\\n"
            config = PythonGrader(type="python", name="sleepy", source=source)
            asyncio.run(grade(config, Sample(), {}, GraderContext(python_timeout_s=600, python_memory_mb=256)))
            """
        )],
        env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=Path(__file__).resolve().parents[2],
    )
    try:
        pid_file = wait_for_file(tmp_path, "agent-rft-python-grader-*/pid.txt")
        grader_pid = int(pid_file.read_text())
        assert process_alive(grader_pid)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 5
    while process_alive(grader_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(grader_pid)


def wait_for_file(directory: Path, pattern: str, timeout_s: float = 20) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [p for p in directory.glob(pattern) if p.stat().st_size]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {pattern} in {directory}")


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent's reaping is left


@pytest.mark.parametrize(
    "body",
    [
        "x = bytearray(10 ** 10)",
        "x = []\n    while True:\n        x.append(' ' * 10 ** 6)",
        "x = ' ' * (300 << 20)",
    ],
    ids=["one-huge-allocation", "growing-list", "just-over-the-limit"],
)
def test_a_memory_bomb_dies_and_scores_zero(body: str) -> None:
    started = time.monotonic()
    details = runtime_error(run_python(f"def grade(sample, item):\n    {body}\n    return 1.0\n"))
    assert "MemoryError" in details and "256 MB" in details
    assert time.monotonic() - started < 5


class Listener:
    """A real TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


# Appended to a grader that defines ATTEMPTS {name: function(item)}: each attempt returns normally
# only if it got through; the sandbox makes it raise.
ATTEMPTS = """
def grade(sample, item):
    got_through = []
    for name, attempt in ATTEMPTS.items():
        try:
            attempt(item)
            got_through.append(name)
        except BaseException as exc:
            print(name, "refused:", type(exc).__name__, exc)
    if got_through:
        raise AssertionError("got through: " + ", ".join(got_through))
    return 0.5
"""


def run_attempts(attempts: str, item: dict[str, Any]) -> GradeResult:
    """Run a grader whose ATTEMPTS each try to break out; it scores 0.5 when none succeeded."""
    return run_python(textwrap.dedent(attempts) + ATTEMPTS, item=item)


def test_no_network_not_even_to_a_listening_server_on_localhost(listener: Listener) -> None:
    result = run_attempts(
        """
        def with_socket(item):
            import socket
            socket.create_connection(("127.0.0.1", item["port"]), timeout=2)

        def with_raw_socket(item):
            import _socket
            s = _socket.socket()
            s.connect(("127.0.0.1", item["port"]))

        def with_urllib(item):
            import urllib.request
            urllib.request.urlopen(f"http://127.0.0.1:{item['port']}/", timeout=2)

        def with_http_client(item):
            import http.client
            http.client.HTTPConnection("127.0.0.1", item["port"], timeout=2).request("GET", "/")

        def with_asyncio(item):
            import asyncio
            asyncio.run(asyncio.open_connection("127.0.0.1", item["port"]))

        def with_ctypes(item):
            import ctypes
            ctypes.CDLL(None).socket(2, 1, 0)

        ATTEMPTS = {f.__name__: f for f in (
            with_socket, with_raw_socket, with_urllib, with_http_client, with_asyncio, with_ctypes,
        )}
        """,
        item={"port": listener.port},
    )
    assert_clean(result)
    assert result.reward == 0.5
    time.sleep(0.3)
    assert listener.accepted == 0


def test_the_services_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_RFT_WORKER_TOKEN", "topsecret")
    result = run_attempts(
        """
        def found(text):
            if "topsecret" in text:
                return
            raise LookupError("no secret here")

        def environ(item):
            import os
            found(repr(dict(os.environ)))

        def getenv(item):
            import os
            found(str(os.getenv("AGENT_RFT_WORKER_TOKEN")))

        def proc_self(item):
            found(open("/proc/self/environ", "rb").read().decode(errors="replace"))

        def proc_parent(item):
            found(open(f"/proc/{item['parent_pid']}/environ", "rb").read().decode(errors="replace"))

        def proc_parent_via_os(item):
            import os
            fd = os.open(f"/proc/{item['parent_pid']}/environ", os.O_RDONLY)
            found(os.read(fd, 1 << 20).decode(errors="replace"))

        def proc_parent_via_ppid(item):
            import os
            found(open(f"/proc/{os.getppid()}/environ", "rb").read().decode(errors="replace"))

        ATTEMPTS = {f.__name__: f for f in (
            environ, getenv, proc_self, proc_parent, proc_parent_via_os, proc_parent_via_ppid,
        )}
        """,
        item={"parent_pid": os.getpid()},
    )
    assert_clean(result)
    assert result.reward == 0.5


def test_files_outside_the_sandbox_can_be_neither_read_nor_written(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    stdlib = sysconfig.get_path("stdlib")
    result = run_attempts(
        """
        import os

        def check(text):
            if "s3cr3t" not in text and "root:" not in text:
                raise LookupError("read something, but not the secret")

        def builtin_open(item):
            check(open(item["secret"]).read())

        def os_open(item):
            check(os.read(os.open(item["secret"], os.O_RDONLY), 100).decode())

        def pathlib_read(item):
            import pathlib
            check(pathlib.Path(item["secret"]).read_text())

        def bytes_path(item):
            check(open(item["secret"].encode(), "rb").read().decode())

        def relative_traversal(item):
            check(open("../" * 20 + item["secret"].lstrip("/")).read())

        def etc_passwd(item):
            check(open("/etc/passwd").read())

        def dir_fd_of_the_stdlib(item):
            fd = os.open(item["stdlib"], os.O_RDONLY)
            check(os.read(os.open("../" * 20 + "etc/passwd", os.O_RDONLY, dir_fd=fd), 100).decode())

        def symlink_into_sandbox(item):
            os.symlink(item["secret"], "link.txt")
            check(open("link.txt").read())

        def hard_link_into_sandbox(item):
            os.link(item["secret"], "link.txt")
            check(open("link.txt").read())

        def list_the_secrets_directory(item):
            if "secret.txt" not in os.listdir(os.path.dirname(item["secret"])):
                raise LookupError

        def write_outside(item):
            with open(item["secret"] + ".written", "w") as f:
                f.write("pwned")

        def chdir_out(item):
            os.chdir(os.path.dirname(item["secret"]))
            check(open("secret.txt").read())

        ATTEMPTS = {f.__name__: f for f in (
            builtin_open, os_open, pathlib_read, bytes_path, relative_traversal, etc_passwd, dir_fd_of_the_stdlib,
            symlink_into_sandbox, hard_link_into_sandbox, list_the_secrets_directory, write_outside, chdir_out,
        )}
        """,
        item={"secret": str(secret), "stdlib": stdlib},
    )
    assert_clean(result)
    assert result.reward == 0.5
    assert not (tmp_path / "secret.txt.written").exists()


def test_no_processes_no_fork_bomb() -> None:
    result = run_attempts(
        """
        import os

        def subprocess_run(item):
            import subprocess
            subprocess.run(["ls"], check=True)

        def os_system(item):
            if os.system("ls") != 0:
                raise OSError("ls failed")

        def fork(item):
            if os.fork() == 0:
                os._exit(0)

        def fork_bomb(item):
            while True:
                os.fork()

        def exec_ls(item):
            os.execv("/bin/ls", ["ls"])

        def posix_spawn(item):
            os.posix_spawn("/bin/ls", ["ls"], {})

        def multiprocessing_pool(item):
            import multiprocessing
            multiprocessing.Pool(2).map(abs, [1, 2])

        def kill_the_parent(item):
            os.kill(item["parent_pid"], 0)

        def signal_the_parent_through_a_pidfd(item):
            import signal
            signal.pidfd_send_signal(os.pidfd_open(item["parent_pid"]), 0)

        def renice_the_parent(item):
            os.setpriority(os.PRIO_PROCESS, item["parent_pid"], 19)

        def reimport_a_fresh_posix(item):
            import sys
            del sys.modules["posix"]
            import posix
            posix.pidfd_open(item["parent_pid"])

        ATTEMPTS = {f.__name__: f for f in (
            subprocess_run, os_system, fork, fork_bomb, exec_ls, posix_spawn, multiprocessing_pool, kill_the_parent,
            signal_the_parent_through_a_pidfd, renice_the_parent, reimport_a_fresh_posix,
        )}
        """,
        item={"parent_pid": os.getpid()},
    )
    assert_clean(result)
    assert result.reward == 0.5


def test_no_native_code_no_crafted_bytecode_no_escape_from_the_audit_hook(tmp_path: Path) -> None:
    import _csv  # a native extension of the standard library, which the grader copies

    result = run_attempts(
        """
        import os

        def ctypes_import(item):
            import ctypes

        def extension_copied_into_the_sandbox(item):
            # Native code the grader wrote itself would run outside every check: refused.
            import importlib.util, shutil
            shutil.copy(item["extension"], "mine.so")
            spec = importlib.util.spec_from_file_location("_csv", os.path.abspath("mine.so"))
            importlib.util.module_from_spec(spec)

        def crafted_bytecode(item):
            import marshal
            code = compile("1", "x", "eval")
            marshal.loads(marshal.dumps(code))

        def replaced_bytecode(item):
            code = compile("1", "x", "eval")
            code.replace(co_code=code.co_code)

        def walk_the_heap(item):
            import gc
            gc.get_objects()

        def trace_the_hook(item):
            import sys
            sys.settrace(lambda *args: None)

        def raise_the_memory_limit(item):
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

        def sub_interpreter(item):
            import _xxsubinterpreters
            _xxsubinterpreters.create()

        def import_with_a_str_subclass(item):
            class Sly(str):
                def split(self, *args):
                    return []
                def startswith(self, *args):
                    return False
            __import__(Sly("_ctypes"))

        def fd_number_with_patched_int(item):
            import builtins
            saved = builtins.int
            builtins.int = object
            try:
                open("/etc/passwd").read()
            finally:
                builtins.int = saved

        def chroot_into_a_fake_stdlib(item):
            # After a chroot, "/usr/lib/python3/..." would name a file the grader wrote.
            os.makedirs("fake", exist_ok=True)
            os.chroot("fake")

        def sqlite_reads_files_in_c(item):
            import sqlite3
            sqlite3.connect(item["secret"])

        def patch_builtins_then_read(item):
            import builtins, posixpath
            saved = builtins.isinstance, builtins.str, posixpath.normpath
            builtins.isinstance = lambda *args: True
            builtins.str = type("str", (str,), {"startswith": lambda *args: True})
            posixpath.normpath = lambda path: "/tmp"
            try:
                open("/etc/passwd").read()
            finally:
                builtins.isinstance, builtins.str, posixpath.normpath = saved

        ATTEMPTS = {f.__name__: f for f in (
            ctypes_import, extension_copied_into_the_sandbox, crafted_bytecode, replaced_bytecode, walk_the_heap,
            trace_the_hook, raise_the_memory_limit, sub_interpreter, import_with_a_str_subclass,
            fd_number_with_patched_int, chroot_into_a_fake_stdlib, sqlite_reads_files_in_c, patch_builtins_then_read,
        )}
        """,
        item={"extension": _csv.__file__, "secret": str(tmp_path / "db.sqlite")},
    )
    assert_clean(result)
    assert result.reward == 0.5
    assert not (tmp_path / "db.sqlite").exists()


def test_twenty_graders_at_once_do_not_block_the_event_loop() -> None:
    config = GRADER.validate_python(
        {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return item['n'] / 100\n"}
    )
    ctx = GraderContext(python_timeout_s=20, python_memory_mb=256)

    async def twenty() -> tuple[list[GradeResult], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.create_task(ticker())
        results = await asyncio.gather(*(grade(config, Sample(), {"n": n}, ctx) for n in range(20)))
        beat.cancel()
        return list(results), ticks

    started = time.monotonic()
    results, ticks = asyncio.run(twenty())
    elapsed = time.monotonic() - started
    assert [r.reward for r in results] == [n / 100 for n in range(20)]
    assert not any(r.failed for r in results)
    assert elapsed < 15
    assert ticks > elapsed * 20  # the loop kept ticking (every 10 ms) while the graders ran


# --- multi ------------------------------------------------------------------------------------


def string_check(operation: str = "eq", input_: str = "{{sample.output_text}}", reference: str = "yes") -> dict:
    return {"type": "string_check", "name": "check", "input": input_, "reference": reference, "operation": operation}


# `a` passes (1.0) and `b` fails (0.0) for the output "yes".
AB = {"a": string_check("eq"), "b": string_check("ne")}


def run_multi(
    formula: str, graders: dict[str, dict] | None = None, output: str = "yes", item: Any = None
) -> GradeResult:
    config = GRADER.validate_python(
        {"type": "multi", "name": "combined", "graders": graders or AB, "calculate_output": formula}
    )
    return asyncio.run(grade(config, Sample.from_model_sample(output), item or {}, GraderContext(python_memory_mb=256)))


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        ("1 + 2 * 3", 7.0),
        ("(1 + 2) * 3", 9.0),
        ("10 - 4 - 3", 3.0),
        ("12 / 3 / 2", 2.0),
        ("2 ^ 3 ^ 2", 512.0),
        ("(2 ^ 3) ^ 2", 64.0),
        ("-2 ^ 2", -4.0),
        ("2 ^ -1", 0.5),
        ("--3", 3.0),
        ("-(1 - 4) * +2", 6.0),
        ("0.5 * a + .25", 0.75),
        ("1.5e1 / 3", 5.0),
        ("a * 3 + b * 10", 3.0),
        ("(a + b) / 2", 0.5),
        ("a ^ 2 - b", 1.0),
    ],
)
def test_formula_arithmetic_and_precedence(formula: str, expected: float) -> None:
    result = run_multi(formula)
    assert not result.failed, {k: v for k, v in result.errors.items() if v}
    assert result.reward == pytest.approx(expected)


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        ("min(a, b)", 0.0),
        ("max(a, b, 0.5)", 1.0),
        ("min(3)", 3.0),
        ("abs(b - a)", 1.0),
        ("floor(2.7) + floor(-0.5)", 1.0),
        ("ceil(2.1) + ceil(-0.5)", 3.0),
        ("exp(b)", 1.0),
        ("sqrt(16 * a)", 4.0),
        ("log(exp(2))", 2.0),
        ("max(min(a, 0.8), sqrt(b))", 0.8),
    ],
)
def test_formula_functions(formula: str, expected: float) -> None:
    result = run_multi(formula)
    assert not result.failed, {k: v for k, v in result.errors.items() if v}
    assert result.reward == pytest.approx(expected)


def test_sub_rewards_and_scores_are_reported_by_name() -> None:
    graders = {"exact": string_check("eq"), "contains": string_check("like", reference="nope")}
    result = run_multi("0.7 * exact + 0.3 * contains", graders)
    assert result.reward == pytest.approx(0.7)
    assert result.sub_rewards == {"exact": 1.0, "contains": 0.0}
    assert result.scores == {"exact": 1.0, "contains": 0.0}
    response = result.to_run_response()
    assert response["sub_rewards"] == {"exact": 1.0, "contains": 0.0}
    assert response["metadata"]["type"] == "multi"


def test_python_and_string_check_sub_graders_together() -> None:
    graders = {
        "length": {
            "type": "python", "name": "len", "source": "def grade(sample, item):\n    return len(sample['output_text']) / 10\n"
        },
        "exact": string_check("eq", reference="{{item.answer}}"),
    }
    result = run_multi("length + exact", graders, output="yes", item={"answer": "yes"})
    assert not result.failed, {k: v for k, v in result.errors.items() if v}
    assert result.reward == pytest.approx(1.3)
    assert result.sub_rewards == {"length": pytest.approx(0.3), "exact": 1.0}


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        ("(a + b", "missing ')' for the '(' at position 1"),
        ("a + b)", "unexpected ')' at position 6"),
        ("a + c", "unknown name 'c' at position 5"),
        ("pow(a, 2)", "unknown function 'pow' at position 1"),
        ("__import__('os')", "unexpected character \"'\" at position 12"),
        ("a.real", "unexpected character '.' at position 2"),
        ("a ** 2", "powers are written a ^ b"),
        ("a b", "unexpected 'b' at position 3"),
        ("abs(a, b)", "abs takes 1 argument, got 2"),
        ("max", "call it as max(...)"),
        ("   ", "calculate_output: the formula is empty"),
        ("(" * 100 + "a" + ")" * 100, "nested more than"),
    ],
)
def test_a_formula_that_does_not_parse_is_refused_at_creation(formula: str, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        GRADER.validate_python({"type": "multi", "name": "m", "graders": AB, "calculate_output": formula})
    assert message in str(refused.value)


def test_an_empty_formula_is_refused_at_creation() -> None:
    with pytest.raises(ValidationError):
        GRADER.validate_python({"type": "multi", "name": "m", "graders": AB, "calculate_output": ""})


@pytest.mark.parametrize("formula", ["(a + b", "a + c", "__import__('os').system('id')", "a.__class__", ""])
def test_a_formula_that_does_not_parse_at_grading_time_is_a_formula_parse_error(formula: str) -> None:
    # A config that skipped validation (e.g. stored before a rule changed) still never reaches eval.
    valid = GRADER.validate_python({"type": "multi", "name": "m", "graders": AB, "calculate_output": "a"})
    config = MultiGrader.model_construct(**{**dict(valid), "calculate_output": formula})
    result = asyncio.run(grade(config, Sample.from_model_sample("yes"), {}, GraderContext()))
    assert result.reward == 0.0
    assert result.errors["formula_parse_error"] is True
    assert "calculate_output" in result.errors["details"]


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        ("a / b", "division by zero at position 3"),
        ("log(b)", "log(0) at position 1 is undefined"),
        ("sqrt(b - a)", "sqrt(-1) at position 1 is undefined"),
        ("(b - a) ^ 0.5", "-1 ^ 0.5"),
        ("exp(1000 * a)", "exp(1000) at position 1 is undefined"),
        ("10 ^ 400", "is undefined"),
        ("1e308 * 10", "not a finite number"),
    ],
)
def test_a_formula_whose_value_is_undefined_is_an_other_error(formula: str, message: str) -> None:
    result = run_multi(formula)
    assert result.reward == 0.0
    assert result.errors["other_error"] is True
    assert result.errors["formula_parse_error"] is False
    assert message in result.errors["details"]
    assert result.sub_rewards == {"a": 1.0, "b": 0.0}


def test_a_sub_graders_error_flag_propagates_and_the_reward_is_zero() -> None:
    graders = {"a": string_check("eq"), "broken": string_check("eq", input_="{{item.missing}}")}
    result = run_multi("1 - broken", graders)  # would be 1.0 if the failed sub-grader counted as 0
    assert result.reward == 0.0
    assert result.errors["invalid_variable_error"] is True
    assert "broken:" in result.errors["details"] and "item.missing" in result.errors["details"]
    assert result.sub_rewards == {"a": 1.0, "broken": 0.0}
    assert result.to_run_response()["metadata"]["errors"]["invalid_variable_error"] is True


def test_a_python_sub_graders_runtime_error_propagates_with_its_details() -> None:
    failing = {"type": "python", "name": "p", "source": "def grade(s, i):\n    raise KeyError('gold')\n"}
    graders = {"a": string_check("eq"), "py": failing}
    result = run_multi("a + py", graders)
    assert result.reward == 0.0
    assert result.errors["python_grader_runtime_error"] is True
    assert "KeyError: 'gold'" in result.errors["python_grader_runtime_error_details"]



def test_python_source_over_256_kib_is_refused_with_its_size(api) -> None:
    """The cap is on the source's UTF-8 bytes, checked before parsing; at the cap it is accepted."""
    body = "def grade(sample, item):\n    return 1.0\n"
    filler = "#" + "x" * 1023 + "\n"  # 1 KiB comment lines
    at_cap = body + filler * ((256 * 1024 - len(body)) // len(filler))
    at_cap += "#" * (256 * 1024 - len(at_cap.encode()))
    ok = api.post("/v1/fine_tuning/alpha/graders/validate",
                  json={"grader": {"type": "python", "name": "py", "source": at_cap}})
    assert ok.status_code == 200, ok.text
    over = api.post("/v1/fine_tuning/alpha/graders/validate",
                    json={"grader": {"type": "python", "name": "py", "source": at_cap + "é"}})
    error = over.json()["error"]
    assert (over.status_code, error["code"], error["param"]) == (400, "invalid_value", "grader.source")
    assert "262,146 bytes" in error["message"] and "262,144" in error["message"]
