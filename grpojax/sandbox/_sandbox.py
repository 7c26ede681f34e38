"""Sandbox supervisor: runs one untrusted Python program against its tests.

Started by `grpojax.sandbox.runner` as `python -I -S -c ...`, which imports
this file by path and calls `main(CFG_FD, SETUP_FD, VERDICT_FD, RESULT_FD,
SECRET_FD)` (imported, not run as a script, so its byte code is cached).
Standard library only, and few imports (interpreter start-up is most of a
run's cost), so nothing of grpojax or JAX is loaded where untrusted code runs.
The kernel-facing pieces (seccomp, cgroup, root file system) live in
`_sandbox_jail.py`; what crosses between program and tests in
`_sandbox_wire.py`.

Process layout (the normal case, as root):

    trainer ── supervisor (this file; own session; child subreaper)
                 └── init: PID 1 of new PID, network, IPC, UTS and mount namespaces,
                     in a fresh cgroup; builds an empty root file system
                     holding only the interpreter, /usr and a tmpfs workdir
                       ├── program: throwaway uid A, seccomp, rlimits;
                       │   runs the program, answers calls (_sandbox_wire)
                       └── tests: throwaway uid B, seccomp, rlimits; runs the
                           tests on proxies, never a byte of the program, and
                           passes only if a check ran (_sandbox_wire)

Trust argument. The verdict ("passed") is computed in the tests' interpreter
from plain values it decoded itself, so nothing the program does to its own
interpreter (builtins, harness functions, frames, gc, objects with lying
__eq__) reaches it; the program never sees the tests or expected values.
The tests' interpreter runs under another uid, is not dumpable, and seccomp
refuses ptrace, so the program cannot read or write its memory or signal it.
The tests hand their result to init on a pipe only they hold; init (which
never runs program code) writes the one record the trainer reads, on a pipe
the program never holds. Set-up (namespaces, file system, uid, seccomp) is
reported on yet another pipe, closed before any program byte runs; a run
whose set-up did not report success is never a pass, and no exit code a
program chooses means anything but "the program exited". Nothing falls back
to weaker isolation: the trainer refuses to run instead (SandboxUnavailable).
When init exits the kernel kills everything else in its PID namespace.
"""

import ctypes
import marshal
import os
import resource
import select
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(_HERE)  # last: nothing here may shadow the stdlib
import _sandbox_wire as wire  # noqa: E402
from _sandbox_jail import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUTS,  # noqa: E402
                           _build_root, _cgroup_create, _cgroup_join, _cgroup_oom_kills,
                           _cgroup_remove, _check, _install_seccomp, _libc, _write)
sys.path.remove(_HERE)

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SIGKILL, SIGXCPU = 9, 24  # numbers, not the `signal` module: that one imports enum
UID_BASE = 1_000_000  # + 2 x supervisor pid (+1 for the tests): unique per live run
HOSTNAME = b"sandbox"  # what the program's gethostname() says, on every machine
HARNESS_MB = 96  # the cgroup's memory on top of memory_mb: init + the tests' interpreter
_CASE_CODES = {3: "memory"}  # exit codes of an I/O-mode case child (diagnostics only)


def _read_fd(fd):
  chunks = []
  while chunk := os.read(fd, 1 << 16):
    chunks.append(chunk)
  return b"".join(chunks)


def _record(nonce, status, isolation, message):
  """One tab-separated line; the message is hex so it cannot break the line."""
  hexed = message.encode("utf-8", "replace").hex()
  return f"{nonce}\t{status}\t{isolation}\t{hexed}\n".encode()


# ------------------------------------------------------------------ children

def _install_exit_builtins():
  """`exit()` and `quit()` come from `site`, which -S skips; programs use them."""
  import builtins

  def leave(code=None):
    raise SystemExit(code)
  builtins.exit = builtins.quit = leave


def _set_limits(cfg, nproc):
  cpu = int(cfg["timeout_s"]) + 1
  mem, fsize = cfg["memory_mb"] << 20, cfg["file_mb"] << 20
  for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                          (resource.RLIMIT_AS, mem, mem),
                          (resource.RLIMIT_FSIZE, fsize, fsize),
                          (resource.RLIMIT_NOFILE, 256, 256),
                          (resource.RLIMIT_CORE, 0, 0),
                          (resource.RLIMIT_NPROC, nproc, nproc)):
    resource.setrlimit(res, (soft, hard))


def _jail(cfg, libc, uid, setup_w, role, nproc):
  """Drops to `uid` and locks the process down; reports on the set-up pipe.

  Everything here happens before the first byte of program (or tests)
  runs; a failure is reported and the child exits without running any.
  """
  try:
    cfg.pop("nonce", None)
    layers = []
    if role == "program":  # the cgroup's OOM killer goes for the program first
      _write("/proc/self/oom_score_adj", 500)
    if os.geteuid() == 0:
      os.setgroups([])
      os.setresgid(uid, uid, uid)
      os.setresuid(uid, uid, uid)
      layers.append("uid")
    if 0 in os.getresuid() or 0 in os.getresgid():
      raise OSError("refusing to run untrusted code as root")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if role == "tests":  # not dumpable: /proc/PID/mem stays root's
      _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    _set_limits(cfg, nproc)
    _install_seccomp(libc)
    layers.append("seccomp")
    os.chdir(cfg["workdir"])
    _install_exit_builtins()
    os.write(setup_w, f"ok {role} {','.join(layers)}\n".encode())
  except BaseException as e:  # noqa: BLE001
    os.write(setup_w, f"fail {role} {_where(e)}"[:500].replace("\n", " ").encode() + b"\n")
    os._exit(1)
  finally:
    os.close(setup_w)


def _where(e):
  """`e` and the line it came from: set-up failures must be findable."""
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}" if tb else "?"
  return f"{e!r} ({where})"


def _spawn(fn):
  pid = os.fork()
  if pid == 0:
    try:
      fn()
    except BaseException:  # noqa: BLE001
      import traceback
      traceback.print_exc()
    os._exit(0)
  return pid


def _reap_all(pid_ns):
  """Kill every process of the run but init itself, and reap them."""
  if pid_ns:
    try:
      os.kill(-1, SIGKILL)  # PID 1 of its namespace: exactly the sandbox
    except OSError:
      pass
  else:
    _sweep(os.getpid())
  try:
    while os.waitpid(-1, os.WNOHANG)[0] > 0:
      pass
  except ChildProcessError:
    pass


def _wait_child(pid):
  """(wait status, cpu seconds) of `pid`; the supervisor bounds the wait."""
  _, status, usage = os.wait4(pid, 0)
  return status, usage.ru_utime + usage.ru_stime


def _describe_death(status, cpu, cfg):
  """(status, message) for a program process that did not end by itself."""
  if status is None:
    return None
  code = os.waitstatus_to_exitcode(status)
  if code == -SIGXCPU or (code == -SIGKILL and cpu >= int(cfg["timeout_s"]) + 1 - 0.05):
    return "timeout", f"exceeded {cfg['timeout_s']:.1f}s of CPU time"
  # Not "memory" yet: the supervisor tells OOM kills apart by the cgroup's counter.
  if code < 0:
    return "error", f"crashed with signal {_signal_name(-code)}"
  return None


def _signal_name(n):
  import signal
  return signal.Signals(n).name


def _assert_run(cfg, libc, setup_w, pid_ns):
  """Program and tests in two jailed children; (status, message)."""
  t2p_r, t2p_w = os.pipe()
  p2t_r, p2t_w = os.pipe()
  res_r, res_w = os.pipe()
  uid = cfg["uid"]

  def program():
    for fd in (t2p_w, p2t_r, res_r, res_w, cfg.pop("result_fd"), cfg.pop("secret_fd")):
      os.close(fd)
    _jail(cfg, libc, uid, setup_w, "program", cfg["max_processes"])
    wire.serve_program(cfg["program"], cfg["setup"], t2p_r, p2t_w)

  def tests():
    for fd in (t2p_r, p2t_w, res_r, cfg.pop("result_fd")):
      os.close(fd)
    _jail(cfg, libc, uid + 1, setup_w, "tests", 4)
    status, message = wire.run_tests(_secrets(cfg)["judge"], p2t_r, t2p_w)
    os.write(res_w, f"{status}\n{message}".encode("utf-8", "replace")[:1 << 16])

  sys.stdout.flush()
  _spawn(tests)  # first: a fork bomb in the program must not keep it from starting
  prog_pid = _spawn(program)
  for fd in (t2p_r, t2p_w, p2t_r, p2t_w, res_w, setup_w):
    os.close(fd)
  raw = _read_fd(res_r)  # EOF: the tests' process has ended
  prog_status = cpu = None
  # The program's process ends when the tests close its pipe; give it a moment.
  end = time.monotonic() + 0.2
  while prog_status is None and time.monotonic() < end:
    done, st, usage = os.wait4(prog_pid, os.WNOHANG)
    if done:
      prog_status, cpu = st, usage.ru_utime + usage.ru_stime
    else:
      time.sleep(0.002)
  _reap_all(pid_ns)
  status, _, message = raw.decode("utf-8", "replace").partition("\n")
  if status not in ("passed", "failed", "error", "memory"):
    return "error", "the tests' process died without a verdict"
  died = _describe_death(prog_status, cpu, cfg)
  if status == "error" and died is not None:  # the tests saw the program go: say why
    return died
  return status, message


def _normalise_output(text):
  return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _secrets(cfg):
  """The tests and expected outputs: read only by the tests' (judge's) process.

  They come on their own fd, which every program process closes before
  it runs, so they never sit in memory a program process inherited.
  """
  fd = cfg.pop("secret_fd")
  os.lseek(fd, 0, os.SEEK_SET)
  data = marshal.loads(_read_fd(fd))
  os.close(fd)
  return data


def _judge(cfg, libc, setup_w, in_r, out_w):
  """I/O mode's comparer: gets each case's output from init, says ok or wrong."""
  _jail(cfg, libc, cfg["uid"] + 1, setup_w, "tests", 4)
  outputs = _secrets(cfg)["outputs"]
  while True:
    try:
      i, text = wire.recv(in_r)
    except EOFError:
      return
    same = _normalise_output(text) == _normalise_output(outputs[int(i)])
    os.write(out_w, b"1" if same else b"0")


def _io_run(cfg, libc, setup_w, pid_ns):
  """Each case: a fresh jailed program process; its stdout judged elsewhere."""
  limit = cfg["output_limit"]
  deadline = time.monotonic() + cfg["timeout_s"] + 1
  verdict = ("passed", "")
  to_judge_r, to_judge_w = os.pipe()
  from_judge_r, from_judge_w = os.pipe()

  def judge():
    for fd in (to_judge_w, from_judge_r, cfg.pop("result_fd")):
      os.close(fd)
    _judge(cfg, libc, setup_w, to_judge_r, from_judge_w)

  sys.stdout.flush()
  judge_pid = _spawn(judge)
  os.close(cfg.pop("secret_fd"))
  for fd in (to_judge_r, from_judge_w):
    os.close(fd)
  for i, stdin_text in enumerate(cfg["io_inputs"]):
    stdin = os.memfd_create("stdin")
    os.write(stdin, stdin_text.encode())
    os.lseek(stdin, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()

    def program():
      for fd in (out_r, to_judge_w, from_judge_r, cfg.pop("result_fd")):
        os.close(fd)
      os.dup2(stdin, 0)
      os.dup2(out_w, 1)
      os.close(stdin)
      os.close(out_w)
      _jail(cfg, libc, cfg["uid"], setup_w, "program", cfg["max_processes"])
      _run_main(cfg["program"], cfg["setup"])

    pid = _spawn(program)
    os.close(stdin)
    os.close(out_w)
    got, too_much = _read_output(out_r, pid, deadline, limit)
    os.close(out_r)
    status, cpu = _wait_child(pid)
    _kill_all_but(judge_pid, pid_ns)
    if too_much:
      verdict = ("output_limit", f"case {i}: more than {limit} bytes of output")
      break
    died = _describe_death(status, cpu, cfg)
    if died is not None:
      verdict = (died[0], f"case {i}: {died[1]}")
      break
    code = os.waitstatus_to_exitcode(status) if status is not None else -1
    if code != 0:
      verdict = (_CASE_CODES.get(code, "failed"), f"case {i}: exited with status {code}")
      break
    text = got.decode("utf-8", "replace")
    try:
      wire.send(to_judge_w, [str(i), text])
      same = os.read(from_judge_r, 1) == b"1"
    except OSError:
      same = False
    if not same:
      verdict = ("failed", f"case {i}: wrong output {text[:200]!r}")
      break
  for fd in (setup_w, to_judge_w, from_judge_r):
    os.close(fd)
  _reap_all(pid_ns)
  return verdict


def _kill_all_but(keep, pid_ns):
  """Between I/O cases: the case's processes go, the judge stays."""
  victims = _descendants(os.getpid()) - {keep}
  for p in victims:
    try:
      os.kill(p, SIGKILL)
    except OSError:
      pass
  for p in victims:
    try:
      os.waitpid(p, 0)
    except ChildProcessError:
      pass
  if _descendants(os.getpid()) - {keep}:  # forked meanwhile: go again
    _kill_all_but(keep, pid_ns)


def _read_output(fd, pid, deadline, limit):
  """Everything the case wrote to `fd` until it closed or the case ended."""
  chunks, total = [], 0
  while True:
    r, _, _ = select.select([fd], [], [], 0.05)
    if r:
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        break
      chunks.append(chunk)
      total += len(chunk)
      if total > limit:
        return b"", True
    elif (os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
          or time.monotonic() > deadline):
      # The case ended; an orphan may still hold the pipe: take what is there.
      os.set_blocking(fd, False)
      try:
        while chunk := os.read(fd, 1 << 16):
          chunks.append(chunk)
      except BlockingIOError:
        pass
      break
  return b"".join(chunks), False


def _run_main(program, setup):
  """An I/O case's program as `__main__` (after the task's setup code, in the same
  namespace); its exit status is all it reports."""
  code = 0
  try:
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    if setup:
      exec(compile(setup, "<setup>", "exec"), ns)
    exec(compile(program, "<program>", "exec"), ns)
  except SystemExit as e:
    code = e.code if type(e.code) is int else (0 if e.code is None else 1)
  except MemoryError:
    code = 3
  except BaseException:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    code = 1
  wire._flush()
  os._exit(code & 0xFF)


def _init(cfg, setup_w, result_fd, secret_fd, go_r):
  """PID 1 of the sandbox: builds it, runs the run, writes the one record."""
  libc = _libc()
  libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
  libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  pid_ns = cfg["namespaces"]
  cfg["result_fd"] = result_fd  # each child closes it first thing
  cfg["secret_fd"] = secret_fd
  try:
    if pid_ns:
      _build_root(libc, cfg, cfg["uid"])
    elif os.geteuid() == 0:
      os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])
      os.chmod(cfg["workdir"], 0o755)
    # Only now: joining a cgroup can take a kernel RCU grace period
    # (~10 ms on cgroup v1), which the file-system set-up above overlaps.
    if os.read(go_r, 1) != b"g":
      raise OSError("the supervisor could not put the sandbox in its cgroup")
    os.close(go_r)
    os.write(setup_w, b"ok init mount\n" if pid_ns else b"ok init\n")
  except BaseException as e:  # noqa: BLE001
    os.write(setup_w, f"fail init {_where(e)}"[:500].replace("\n", " ").encode() + b"\n")
    os._exit(1)
  run = _io_run if cfg["io_inputs"] is not None else _assert_run
  status, message = run(cfg, libc, setup_w, pid_ns)
  os.write(result_fd, _record(cfg["nonce"], status, "", message))
  os._exit(0)


# ----------------------------------------------------------------- supervisor

def _descendants(root):
  """Pids whose parent chain leads to `root`, found by scanning /proc."""
  parent = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat", "rb") as f:
          stat = f.read()
        parent[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
      except (OSError, ValueError, IndexError):
        continue
  found, frontier = set(), {root}
  while frontier:
    frontier = {p for p, pp in parent.items() if pp in frontier} - found
    found |= frontier
  return found


def _sweep(root):
  """Kill and reap every descendant of `root` (their subreaper)."""
  for _ in range(100):
    pids = _descendants(root)
    if not pids:
      return
    for p in pids:
      try:
        os.kill(p, SIGKILL)
      except OSError:
        pass
    time.sleep(0.002)
    try:
      while os.waitpid(-1, os.WNOHANG)[0] > 0:
        pass
    except ChildProcessError:
      pass


def _wait(pid, timeout_s):
  """wait4 with a wall-clock limit: (status, rusage, timed_out)."""
  deadline = time.monotonic() + timeout_s
  pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
  timed_out = False
  while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
      break
    left = deadline - time.monotonic()
    if left <= 0:
      timed_out = True
      os.kill(pid, SIGKILL)
      _, status, usage = os.wait4(pid, 0)
      break
    if pidfd is not None:
      select.select([pidfd], [], [], left)
    else:
      time.sleep(min(left, 0.005))
  if pidfd is not None:
    os.close(pidfd)
  return status, usage, timed_out


def _unshare(libc, flags, names):
  """New namespaces for this process, and a fixed host name in the new UTS
  one; None, or what failed."""
  if libc.unshare(flags) != 0:
    return f"unshare({names}): {os.strerror(ctypes.get_errno())}"
  for call, name in ((libc.sethostname, HOSTNAME), (libc.setdomainname, b"(none)")):
    if call(name, len(name)) != 0:
      return f"{call.__name__}: {os.strerror(ctypes.get_errno())}"
  return None


def main(cfg_fd, setup_fd, verdict_fd, result_fd, secret_fd):
  cfg = marshal.loads(_read_fd(cfg_fd))  # written by the trainer: trusted
  os.close(cfg_fd)
  # Started with -S (no site: much faster); put site-packages back, with no .pth code.
  sys.path.extend(d for d in cfg["site_dirs"] if d not in sys.path)
  libc = _libc()
  libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  cfg["uid"] = UID_BASE + 2 * os.getpid()
  isolation = []
  if os.geteuid() == 0:
    # All the sandbox's processes together; the harness's share on top.
    cgroup = _cgroup_create(f"grpojax-sbx-{os.getpid()}",
                            (cfg["memory_mb"] + HARNESS_MB) << 20, cfg["max_processes"] + 8)
  else:
    cgroup = []
  if cgroup:
    isolation.append("cgroup")
  else:  # no total cap to lean on: a budget of 4 x memory_mb, split across processes
    cfg["max_processes"] = min(cfg["max_processes"], 4)
  if cfg["namespaces"]:
    # IPC: SysV segments, queues and semaphores (and POSIX queues) the
    # program makes die with the run, and the host's are out of sight. UTS:
    # the host's name is not the program's to read.
    failed = _unshare(libc, CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
                      "CLONE_NEWPID|CLONE_NEWNET|CLONE_NEWIPC|CLONE_NEWUTS")
    if failed:
      os.write(setup_fd, f"fail supervisor {failed}\n".encode())
      os.close(setup_fd)
      _cgroup_remove(cgroup)
      return
    isolation += ["pid", "net", "ipc", "uts"]
  os.write(setup_fd, f"ok supervisor {','.join(isolation)}\n".encode())
  go_r, go_w = os.pipe()
  started = time.monotonic()
  pid = os.fork()
  if pid == 0:
    try:
      os.close(verdict_fd)
      os.close(go_w)
      _init(cfg, setup_fd, result_fd, secret_fd, go_r)
    except BaseException:  # noqa: BLE001
      import traceback
      traceback.print_exc()
    os._exit(70)
  for fd in (result_fd, setup_fd, secret_fd, go_r):
    os.close(fd)
  try:
    _cgroup_join(cgroup, pid)
  except OSError:
    os.kill(pid, SIGKILL)  # never let it run outside the cap it reports
  os.write(go_w, b"g")
  os.close(go_w)
  status, usage, timed_out = _wait(pid, cfg["timeout_s"] + 0.5)
  if "pid" not in isolation:
    _sweep(os.getpid())
  oom = _cgroup_oom_kills(cgroup)
  _cgroup_remove(cgroup)
  code = os.waitstatus_to_exitcode(status)
  cpu = usage.ru_utime + usage.ru_stime
  verdict = _record(cfg["nonce"], "timeout" if timed_out else "done", "",
                    f"{code} {cpu:.3f} {time.monotonic() - started:.3f} {oom}")
  os.write(verdict_fd, verdict)
  os.close(verdict_fd)


if __name__ == "__main__":
  main(*(int(a) for a in sys.argv[1:6]))
