"""Sandboxed execution of untrusted programs against tests, and a code reward.

`run_tests` starts `_sandbox.py` (a stdlib-only supervisor) in its own
session and talks to it over pipes; see that file for the process layout and
the trust argument. Everything a hostile program can do ends in an
`ExecResult` whose `passed` is False, within `timeout_s` plus start-up.

Layers, all on by default where the machine allows them (root on Linux):
PID, network and mount namespaces; a throwaway uid; read-only host file
system with a private tmpfs /tmp and working directory; rlimits on CPU,
address space, file size, open files and processes; scrubbed environment;
stdin at /dev/null; sockets refused in-process; capped output.
`ExecResult.isolation` names the layers a run actually got.
"""

from __future__ import annotations

import dataclasses
import functools
import marshal
import os
import re
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from grpojax.rewards import _sandbox
from grpojax.rewards.base import completion_text

_SUPERVISOR = os.path.abspath(_sandbox.__file__)
STATUSES = ("passed", "failed", "timeout", "memory", "error", "output_limit")
_KEEP_CHARS = 4096  # of stdout/stderr kept in the result (the cap is separate)
# Start-up and teardown of the supervisor, outside the program's own limit.
_GRACE_S = 5.0
# Cleared the first time namespaces turn out unusable here (then runs go on
# with the other layers: rlimits, sessions, process-tree sweep, ...).
_namespaces_work = True


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    return [d for d in dirs if os.path.isdir(d)]


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """Outcome of one sandboxed run.

    passed: the test harness itself ran to its end and every test passed.
    status: one of STATUSES.
    message: why it did not pass (traceback tail, limit hit, ...).
    stdout, stderr: the first few KiB the program wrote.
    duration_s: wall-clock seconds of the whole run, start-up included.
    isolation: layers in force, e.g. ("pid", "net", "mount", "uid").
    """

    passed: bool
    status: str
    message: str = ""
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    isolation: tuple[str, ...] = ()


def _clean_env(home: str) -> dict[str, str]:
    # Nothing of the trainer's environment (tokens, keys) crosses over.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        # One thread per math library: threads count against max_processes.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _normalise_tests(tests) -> tuple[str | None, list[dict] | None]:
    """(assert source, None) or (None, stdin/stdout cases)."""
    if isinstance(tests, str):
        return tests, None
    tests = list(tests)
    if all(isinstance(t, str) for t in tests):
        return "\n".join(tests), None
    if all(isinstance(t, dict) and {"input", "output"} <= t.keys() for t in tests):
        return None, [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    raise TypeError(
        "tests must be Python source (str), a list of statements (list[str]) or "
        "stdin/stdout cases (list of {'input': ..., 'output': ...})")


def run_tests(program: str, tests: str | Sequence[str] | Sequence[dict], *,
              timeout_s: float = 5.0, memory_mb: int = 512, output_limit_bytes: int = 1 << 20,
              file_mb: int = 16, disk_mb: int = 64, max_processes: int = 16,
              namespaces: bool = True) -> ExecResult:
    """Runs untrusted `program`, then `tests`, in a fresh sandbox.

    Args:
      program: Python source, e.g. a model's completion with the fences removed.
      tests: assert-style Python source run after the program in the same
        namespace (`__name__` is "solution", so a `__main__` block does not
        run); or a list of such statements; or stdin/stdout cases
        `[{"input": "1 2\\n", "output": "3"}]`, each running the program as
        `__main__` and comparing outputs up to trailing whitespace.
      timeout_s: wall-clock (and, rounded up, CPU) limit for program + tests.
      memory_mb: address-space limit per process.
      output_limit_bytes: more stdout + stderr than this stops the run.
      file_mb: largest file the program may write.
      disk_mb: size of its private working directory and /tmp.
      max_processes: processes and threads it may have at once (enforced
        when the run gets its own uid).
      namespaces: use PID/network/mount namespaces where permitted.

    Returns:
      ExecResult; `passed` only when the harness reached its end.
    """
    global _namespaces_work
    source, io_cases = _normalise_tests(tests)
    use_ns = bool(namespaces) and _namespaces_work
    result = _run_once(program, source, io_cases, timeout_s, memory_mb, output_limit_bytes,
                       file_mb, disk_mb, max_processes, use_ns)
    if result is None:  # namespace set-up failed on this machine
        _namespaces_work = False
        result = _run_once(program, source, io_cases, timeout_s, memory_mb,
                           output_limit_bytes, file_mb, disk_mb, max_processes, False)
    return result


def _run_once(program, source, io_cases, timeout_s, memory_mb, output_limit_bytes, file_mb,
              disk_mb, max_processes, namespaces) -> ExecResult | None:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="grpojax-sbx-")
    nonce = secrets.token_hex(16)
    cfg = {"program": program, "tests": source, "io_cases": io_cases, "nonce": nonce,
           "timeout_s": float(timeout_s), "memory_mb": int(memory_mb),
           "file_mb": int(file_mb), "disk_mb": int(disk_mb),
           "max_processes": int(max_processes), "workdir": workdir,
           "namespaces": namespaces, "site_dirs": _site_dirs()}
    pipes = [os.pipe() for _ in range(3)]  # cfg, verdict, harness record
    (cfg_r, cfg_w), (verdict_r, verdict_w), (result_r, result_w) = pipes
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _SUPERVISOR, str(cfg_r), str(verdict_w), str(result_w)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(cfg_r, verdict_w, result_w), env=_clean_env(workdir), cwd=workdir,
            start_new_session=True)
        for fd in (cfg_r, verdict_w, result_w):
            os.close(fd)
        cfg_r = verdict_w = result_w = -1
        try:
            with os.fdopen(cfg_w, "wb") as f:
                cfg_w = -1
                f.write(marshal.dumps(cfg))
        except BrokenPipeError:
            pass  # the supervisor died at start: its missing verdict says so
        out = _collect(proc, verdict_r, result_r, deadline=start + timeout_s + _GRACE_S,
                       limit=output_limit_bytes)
    finally:
        if proc is not None:
            _kill_session(proc)
        for fd in (cfg_r, cfg_w, verdict_r, verdict_w, result_r, result_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)
    return _verdict(out, nonce, timeout_s, time.monotonic() - start)


def _kill_session(proc: subprocess.Popen) -> None:
    # The supervisor leads its own session; its group holds PID 1 of the
    # sandbox, whose death tears the namespace (and every descendant) down.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def _collect(proc, verdict_r, result_r, *, deadline, limit):
    """Reads every pipe until the supervisor's verdict is in (or time is up).

    Returns (buffers, flags): stdout/stderr keep their first _KEEP_CHARS
    bytes; more than `limit` bytes of output in all sets flags["overflow"].
    """
    bufs = {name: bytearray() for name in ("stdout", "stderr", "verdict", "result")}
    flags = {"deadline": False, "overflow": False}
    total = [0]
    sel = selectors.DefaultSelector()
    for obj, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"),
                      (verdict_r, "verdict"), (result_r, "result")):
        sel.register(obj, selectors.EVENT_READ, name)

    def take(ready) -> None:
        for key, _ in ready:
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(key.fileobj)
            elif key.data in ("stdout", "stderr"):
                total[0] += len(chunk)
                room = _KEEP_CHARS - len(bufs[key.data])
                bufs[key.data] += chunk[:max(room, 0)]
            elif len(bufs[key.data]) < (1 << 20):
                bufs[key.data] += chunk

    try:
        while "verdict" in {k.data for k in sel.get_map().values()}:
            left = deadline - time.monotonic()
            if left <= 0:
                flags["deadline"] = True
                return bufs, flags
            take(sel.select(timeout=left))
            if total[0] > limit:
                flags["overflow"] = True
                return bufs, flags
        # The verdict is in, so everything else was written before it: take
        # what is already buffered, without waiting for EOF (an orphan in a
        # namespace-less run could hold a pipe open).
        for _ in range(64):
            ready = sel.select(timeout=0)
            if not ready:
                break
            take(ready)
        flags["overflow"] = total[0] > limit
        return bufs, flags
    finally:
        sel.close()


def _records(raw: bytes, nonce: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(status, isolation, message) of each line that carries the nonce."""
    out = []
    for line in raw.split(b"\n"):
        parts = line.decode("utf-8", "replace").split("\t")
        # Only records that carry the nonce come from our own code.
        if len(parts) == 4 and parts[0] == nonce:
            try:
                message = bytes.fromhex(parts[3]).decode("utf-8", "replace")
            except ValueError:
                continue
            out.append((parts[1], tuple(filter(None, parts[2].split(","))), message))
    return out


def _verdict(collected, nonce, timeout_s, duration_s) -> ExecResult | None:
    bufs, flags = collected
    text = {k: bufs[k].decode("utf-8", "replace") for k in ("stdout", "stderr")}

    def result(status, message, isolation=()):
        return ExecResult(passed=status == "passed", status=status, message=message,
                          stdout=text["stdout"], stderr=text["stderr"],
                          duration_s=duration_s, isolation=tuple(isolation))

    if flags["overflow"]:
        return result("output_limit", "the program wrote more output than allowed")
    verdicts = _records(bytes(bufs["verdict"]), nonce)
    if flags["deadline"]:
        return result("timeout", f"no verdict within {timeout_s:.1f}s (+{_GRACE_S:.0f}s grace)")
    if not verdicts:
        return result("error", "the sandbox supervisor failed: " + text["stderr"][-500:])
    kind, iso, numbers = verdicts[-1]
    code, cpu_s, _ = numbers.split()
    code, cpu_s = int(code), float(cpu_s)
    if code == _sandbox.SETUP_FAILED and "mount" in iso:
        return None
    records = _records(bytes(bufs["result"]), nonce)
    if records:
        iso = records[-1][1]
    if kind == "timeout" or code == -signal.SIGXCPU or (
            code == -signal.SIGKILL and cpu_s >= int(timeout_s) + 1 - 0.05):
        return result("timeout", f"exceeded {timeout_s:.1f}s", iso)
    if records:
        status, _, message = records[-1]
        if status == "passed" and code != 0:
            return result("error", f"exited with {code} after the tests", iso)
        return result(status, message, iso)
    if code == -signal.SIGKILL:
        return result("memory", "killed (out of memory)", iso)
    if code < 0:
        return result("error", f"crashed with signal {signal.Signals(-code).name}", iso)
    return result("error", f"exited (status {code}) before the tests finished", iso)


@functools.lru_cache(maxsize=None)
def sandbox_isolation() -> tuple[str, ...]:
    """The isolation layers this machine gives a sandboxed run."""
    return run_tests("", "", timeout_s=5.0).isolation


# ---------------------------------------------------------------- the reward

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, else the whole text."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@dataclasses.dataclass(frozen=True)
class CodeReward:
    """TRL-style reward: 1.0 if the completion's code passes its tests, else 0.0.

    Reads the tests from the dataset column `tests_column` (a value per row
    in any form `run_tests` accepts); None where a row has no tests.
    """

    timeout_s: float = 5.0
    memory_mb: int = 512
    tests_column: str = "tests"
    name: str = "code_reward"

    @property
    def __name__(self) -> str:  # reward functions are named by __name__ (TRL)
        return self.name

    def __call__(self, prompts=None, completions=(), **columns) -> list[float | None]:
        tests = columns.get(self.tests_column)
        if tests is None:
            raise KeyError(f"{self.name} needs a {self.tests_column!r} dataset column")
        out = []
        for completion, t in zip(completions, tests):
            if t is None:
                out.append(None)
                continue
            res = run_tests(extract_code(completion_text(completion)), t, timeout_s=self.timeout_s,
                            memory_mb=self.memory_mb)
            out.append(1.0 if res.passed else 0.0)
        return out


code_reward = CodeReward()
