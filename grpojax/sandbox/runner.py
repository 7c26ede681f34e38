"""Sandboxed execution of untrusted programs against tests.

`run_tests` starts `_sandbox.py` (a stdlib-only supervisor, in this
directory) in its own session and talks to it over pipes; see that file for
the process layout and the trust argument, `_sandbox_wire.py` for what
crosses between the program and its tests, `_sandbox_jail.py` for seccomp,
cgroup and root. Everything a hostile program can do ends in an
`ExecResult` whose `passed` is False, within `timeout_s` plus start-up.

Layers (Linux, as root): PID, network, IPC and UTS namespaces (the program's
SysV and POSIX IPC objects die with its run, the host's are out of reach, and
its host name is "sandbox"); a mount namespace with
an empty root holding only the interpreter, /usr and tmpfs scratch space; a
cgroup capping the run's total memory and processes; throwaway uids (one for
the program, another for the tests, which run in their own interpreter on
proxies); a seccomp filter; rlimits on CPU, address space, file size, open
files and processes; a scrubbed environment; stdin at /dev/null; capped
output. `ExecResult.isolation` names the layers a run got. Without them the
verifier refuses to run (`SandboxUnavailable`) rather than run with less;
`namespaces=False` is the one deliberate opt-out, and even then untrusted
code never runs as root.
"""

from __future__ import annotations

import dataclasses
import functools
import marshal
import os
import py_compile
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

from grpojax.sandbox import judging

# Imported only by the supervisor's interpreter (see _launcher), never here.
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox.py")
STATUSES = ("passed", "failed", "timeout", "memory", "error", "output_limit")
_KEEP_CHARS = 4096  # of stdout/stderr kept in the result (the cap is separate)
# Start-up and teardown of the supervisor, outside the program's own limit.
_GRACE_S = 5.0


class SandboxUnavailable(RuntimeError):
  """This machine cannot give untrusted code the isolation it needs."""


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
  isolation: layers in force, e.g. ("pid", "net", "ipc", "uts", "mount", "uid").
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


def _normalise_tests(tests):
  """(assert source, None, None), (None, stdin/stdout cases, None) or APPS's call-based
  (apps source, None, (fn_name, data))."""
  if isinstance(tests, (str, dict)):
    fn_name, data, io_cases = judging.apps_cases(tests)
    if fn_name is not None:
      return judging.APPS_TESTS, None, (fn_name, data)
    if io_cases is not None:
      return None, io_cases, None
    if isinstance(tests, str):
      return tests, None, None
    tests = [tests]
  tests = list(tests)
  if all(isinstance(t, str) for t in tests):
    return "\n".join(tests), None, None
  if all(isinstance(t, dict) and {"input", "output"} <= t.keys() for t in tests):
    return None, [{"input": str(t["input"]), "output": str(t["output"])} for t in tests], None
  raise TypeError(
      "tests must be Python source (str), a list of statements (list[str]), stdin/stdout "
      "cases (list of {'input': ..., 'output': ...}) or APPS's input_output "
      "({'inputs': [...], 'outputs': [...]} with 'fn_name' for call-based cases)")


def _refused(status: str, message: str) -> ExecResult:
  """A run that never starts: its tests cannot judge any program."""
  return ExecResult(passed=False, status=status, message=message)


def run_tests(program: str, tests: str | Sequence[str] | Sequence[dict] | dict, *,
              entry_point: str | Sequence[str] | None = None, setup: str | None = None,
              timeout_s: float = 5.0, memory_mb: int = 512, output_limit_bytes: int = 1 << 20,
              file_mb: int = 16, disk_mb: int = 64, max_processes: int = 16,
              namespaces: bool = True) -> ExecResult:
  """Runs untrusted `program`, then `tests`, in a fresh sandbox.

  Args:
    program: Python source, e.g. a model's completion with the fences removed.
    tests: assert-style Python source, run as `__main__` in a separate
      interpreter that sees the program's names as proxies (the program runs
      with `__name__` "solution", so its own `__main__` block does not run;
      see `_sandbox_wire` for what crosses and `judging` for which names the
      tests get); or a list of such statements; or stdin/stdout cases
      `[{"input": "1 2\\n", "output": "3"}]`, each running the program as
      `__main__` in a fresh process and comparing its outputs up to trailing
      whitespace; or APPS's `input_output` (a dict or its JSON text): with
      `fn_name`, call-based cases compared as APPS compares them, else
      stdin/stdout cases. A run passes only if its tests ran a check (an
      `assert`, an `assert*` call, an I/O case): tests that check nothing
      fail with the reason.
    entry_point: the name the task asks the program to define (HumanEval's
      and LeetCode's `entry_point`, e.g. "add" or "Solution().twoSum"): the
      tests' `check(candidate)` gets it, and that name is the program's
      object even where it is also a builtin (`max`). None: the names the
      tests use that nothing else defines.
    setup: the task's own helper code (MBPP's test_setup_code, LeetCode's
      ListNode and imports), trusted: run before the program in its
      interpreter and before the tests in theirs.
    timeout_s: wall-clock (and, rounded up, CPU) limit for program + tests.
    memory_mb: address-space limit per process; with a cgroup, also the
      run's total (plus a fixed share for the tests' interpreter).
    output_limit_bytes: more stdout + stderr than this stops the run.
    file_mb: largest file the program may write.
    disk_mb: size of its private working directory and /tmp.
    max_processes: processes and threads it may have at once (enforced
      when the run gets its own uid).
    namespaces: PID/network/IPC/UTS/mount namespaces (required unless False: a
      deliberate opt-out that still drops root, filters syscalls and runs
      the tests in their own interpreter, but leaves the program the
      host's file system, as its throwaway (or the caller's) uid sees it,
      and the host's network).

  Returns:
    ExecResult; `passed` only when the tests' interpreter ran every test
    and counted at least one check. Tests that cannot judge anything (empty,
    or not Python) give status "failed" or "error" without a run.

  Raises:
    SandboxUnavailable: at first use, if this machine cannot set the
      sandbox up (never a silent fallback to weaker isolation).
  """
  source, io_cases, apps = _normalise_tests(tests)
  _check_available(bool(namespaces))
  judge = None
  if io_cases is not None:
    if not io_cases:
      return _refused("failed", "no test ran: the task has no stdin/stdout cases")
  else:
    try:
      if apps is not None:
        fn_name, data = apps
        entry = judging.apps_entry(fn_name, program, entry_point)
        if not data["inputs"]:
          return _refused("failed", "no test ran: the task has no cases")
        judge = judging.judge_plan(f"__apps_entry__ = {entry}\n{source}", setup=setup,
                                   entry_point=entry, program=program,
                                   data={"__apps_inputs__": data["inputs"],
                                         "__apps_outputs__": data["outputs"]})
      else:
        judge = judging.judge_plan(source, setup=setup,
                                   entry_point=judging.normalise_entry(entry_point),
                                   program=program)
    except judging.TestsError as e:
      return _refused("error", f"the tests cannot be judged: {e}")
  return _run_once(program, setup, judge, io_cases, timeout_s, memory_mb, output_limit_bytes,
                   file_mb, disk_mb, max_processes, bool(namespaces))


def _launcher(supervisor: str) -> str:
  """`python -c` source that imports the supervisor from its directory.

  Imported rather than run as a script so that its byte code is cached
  (compiling it would cost each run several ms); the directory leaves
  sys.path again before any sandboxed code runs.
  """
  directory, name = os.path.split(supervisor)
  # Appended, not prepended: nothing in this directory may ever shadow a
  # standard library module.
  return (f"import sys; sys.path.append({directory!r}); import {name[:-3]} as s; "
          f"sys.path.remove({directory!r}); s.main(*map(int, sys.argv[1:6]))")


def _compile_supervisor() -> None:
  here = os.path.dirname(_SUPERVISOR)
  for name in (_SUPERVISOR, *(os.path.join(here, f"_sandbox_{m}.py") for m in ("wire", "jail"))):
    try:
      py_compile.compile(name, doraise=True)
    except (OSError, py_compile.PyCompileError):
      pass  # a read-only install: runs compile it each time, a little slower


@functools.lru_cache(maxsize=None)
def _check_available(namespaces: bool) -> tuple[str, ...]:
  _compile_supervisor()
  res = _run_once("", None, judging.judge_plan("assert True"), None, 5.0, 256, 1 << 16, 1, 1, 4,
                  namespaces)
  if res.status != "passed":
    hint = ("needs root (CAP_SYS_ADMIN) on Linux for namespaces, cgroups and a throwaway "
            "uid; namespaces=False (CodeReward(namespaces=False) in a task) is the explicit "
            "opt-out" if namespaces else
            "even with namespaces=False it needs a non-root user or root to switch uid")
    raise SandboxUnavailable(f"the code sandbox cannot run here: {res.message} ({hint})")
  return res.isolation


def _run_once(program, setup, judge, io_cases, timeout_s, memory_mb, output_limit_bytes, file_mb,
              disk_mb, max_processes, namespaces) -> ExecResult:
  start = time.monotonic()
  workdir = tempfile.mkdtemp(prefix="grpojax-sbx-")
  nonce = secrets.token_hex(16)
  # The tests and expected outputs travel apart from the config, on an fd
  # only the tests' process reads: no program process ever holds them.
  secret_fd = os.memfd_create("grpojax-sbx-tests")
  os.write(secret_fd, marshal.dumps({"judge": judge, "outputs": None if io_cases is None else
                                     [c["output"] for c in io_cases]}))
  cfg = {"program": program, "setup": setup, "nonce": nonce,
         "io_inputs": None if io_cases is None else [c["input"] for c in io_cases],
         "timeout_s": float(timeout_s), "memory_mb": int(memory_mb),
         "file_mb": int(file_mb), "disk_mb": int(disk_mb),
         "max_processes": int(max_processes), "workdir": workdir,
         "output_limit": int(output_limit_bytes),
         "namespaces": namespaces, "site_dirs": _site_dirs()}
  pipes = [os.pipe() for _ in range(4)]  # cfg, set-up report, verdict, run record
  (cfg_r, cfg_w), (setup_r, setup_w), (verdict_r, verdict_w), (result_r, result_w) = pipes
  proc = None
  try:
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _launcher(_SUPERVISOR), str(cfg_r), str(setup_w),
         str(verdict_w), str(result_w), str(secret_fd)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        pass_fds=(cfg_r, setup_w, verdict_w, result_w, secret_fd), env=_clean_env(workdir),
        cwd=workdir, start_new_session=True)
    os.close(secret_fd)
    secret_fd = -1
    for fd in (cfg_r, setup_w, verdict_w, result_w):
      os.close(fd)
    cfg_r = setup_w = verdict_w = result_w = -1
    try:
      with os.fdopen(cfg_w, "wb") as f:
        cfg_w = -1
        f.write(marshal.dumps(cfg))
    except BrokenPipeError:
      pass  # the supervisor died at start: its missing verdict says so
    out = _collect(proc, setup_r, verdict_r, result_r,
                   deadline=start + timeout_s + _GRACE_S, limit=output_limit_bytes)
  finally:
    if proc is not None:
      _kill_session(proc)
    for fd in (cfg_r, cfg_w, setup_r, setup_w, verdict_r, verdict_w, result_r, result_w,
               secret_fd):
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


def _collect(proc, setup_r, verdict_r, result_r, *, deadline, limit):
  """Reads every pipe until the supervisor's verdict is in (or time is up).

  Returns (buffers, flags): stdout/stderr keep their first _KEEP_CHARS
  bytes; more than `limit` bytes of output in all sets flags["overflow"].
  """
  bufs = {name: bytearray() for name in ("stdout", "stderr", "setup", "verdict", "result")}
  flags = {"deadline": False, "overflow": False}
  total = [0]
  sel = selectors.DefaultSelector()
  for obj, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"), (setup_r, "setup"),
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


def _setup_report(raw: bytes) -> tuple[str | None, tuple[str, ...]]:
  """(failure or None, isolation layers) from the set-up channel.

  Only trusted code writes there, before any program byte runs, and every
  stage must have said "ok": a missing line is a failure, not a default.
  """
  layers, seen = [], set()
  for line in raw.decode("utf-8", "replace").splitlines():
    word, _, rest = line.partition(" ")
    role, _, what = rest.partition(" ")
    if word == "fail":
      return f"{role}: {what}", ()
    if word == "ok":
      seen.add(role)
      layers += [x for x in what.split(",") if x and x not in layers]
  need = {"supervisor", "init", "program", "tests"}
  if not need <= seen:
    return f"set-up did not complete (reported: {sorted(seen)})", ()
  return None, tuple(layers)


def _verdict(collected, nonce, timeout_s, duration_s) -> ExecResult:
  bufs, flags = collected
  text = {k: bufs[k].decode("utf-8", "replace") for k in ("stdout", "stderr")}

  def result(status, message, isolation=()):
    return ExecResult(passed=status == "passed", status=status, message=message,
                      stdout=text["stdout"], stderr=text["stderr"],
                      duration_s=duration_s, isolation=tuple(isolation))

  if flags["overflow"]:
    return result("output_limit", "the program wrote more output than allowed")
  if flags["deadline"]:
    return result("timeout", f"no verdict within {timeout_s:.1f}s (+{_GRACE_S:.0f}s grace)")
  verdicts = _records(bytes(bufs["verdict"]), nonce)
  failure, iso = _setup_report(bytes(bufs["setup"]))
  records = _records(bytes(bufs["result"]), nonce)
  if verdicts and verdicts[-1][0] == "timeout":
    return result("timeout", f"exceeded {timeout_s:.1f}s", iso)
  if failure is not None:
    # Checked before any record: without a complete set-up nothing passes.
    return result("error", "sandbox set-up failed: " + failure
                  + (" " + text["stderr"][-300:] if text["stderr"] else ""))
  if not verdicts:
    return result("error", "the sandbox supervisor failed: " + text["stderr"][-500:], iso)
  oom = int(verdicts[-1][2].split()[3])
  if records:
    status, _, message = records[-1]
    if oom and status != "passed":
      return result("memory", f"killed (out of memory) ({message[-300:]})", iso)
    return result(status, message, iso)
  if oom:
    return result("memory", "killed (out of memory)", iso)
  return result("error", "the sandbox ended without a verdict: " + text["stderr"][-500:], iso)


def sandbox_isolation(namespaces: bool = True) -> tuple[str, ...]:
  """The isolation layers this machine gives a sandboxed run (or SandboxUnavailable).

  `namespaces` as in `run_tests`; checked once per value, by a trial run.
  """
  return _check_available(bool(namespaces))
