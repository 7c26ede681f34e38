"""Sandbox supervisor: runs one untrusted Python program against its tests.

Started by `grpojax.rewards.code` as `python -I -S _sandbox.py CFG_FD
VERDICT_FD RESULT_FD`. Standard library only, and few imports (interpreter
start-up is most of a run's cost), so nothing of grpojax or JAX is loaded
where untrusted code runs.

Process layout (namespace mode, the normal case when running as root):

    trainer ── supervisor (this file, own session, child subreaper)
                  └── PID 1 of a new PID + network + mount namespace:
                        isolates the file system, drops to a throwaway uid,
                        sets rlimits, runs the program, then the tests.

When PID 1 exits the kernel kills everything else in its PID namespace, so
no descendant (setsid'ed, double-forked or otherwise) outlives the run.
Without namespaces (unprivileged hosts) the supervisor falls back to a sweep
of its own process tree, whose orphans it adopts as subreaper.

Trust: the supervisor's verdict travels on a pipe the program never holds.
The harness's "tests passed" record carries a nonce, is written only after
the tests ran to their end and only by the original process, so exiting
early (sys.exit, os._exit, killing the parent, forking) never reads as a
pass. A program that digs the nonce out of the interpreter's memory could
forge a record; that is outside the threat model (reward hacking by early
exit, hangs, bombs, escapes, snooping).
"""

import ctypes
import io
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SIGKILL = 9  # a number, not the `signal` module: that one imports enum
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
                "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
UID_BASE = 1_000_000  # + supervisor pid: a uid no other live sandbox shares
SETUP_FAILED = 71  # PID 1's exit code when the namespaces could not be set up
_TAIL = 2000  # characters of a traceback kept in a record


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None):
    def enc(s):
        return None if s is None else s.encode()
    rc = libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(rc, f"mount {target}")


def _read_fd(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _record(nonce, status, isolation, message):
    """One tab-separated line; the message is hex so it cannot break the line."""
    hexed = message.encode("utf-8", "replace").hex()
    return f"{nonce}\t{status}\t{isolation}\t{hexed}\n".encode()


# ---------------------------------------------------------------- file system

def _mountinfo():
    """(mount point, per-mount flags) of every mount, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 for spaces
            flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
            out.append((point, flags))
    return sorted(out, key=lambda pf: pf[0].count("/"))


def _blocking_ancestor(path):
    """The highest directory on `path` that others cannot traverse, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def _python_dirs():
    """Directories the interpreter imports from (stdlib, site-packages)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    dirs.update(p if os.path.isdir(p) else os.path.dirname(p) for p in sys.path if p)
    dirs = sorted(os.path.abspath(d) for d in dirs if os.path.isdir(d))
    kept = []  # parents first; a directory inside one already kept comes with it
    for d in sorted(dirs, key=len):
        if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(d)
    return kept


def _isolate_fs(libc, workdir, uid, disk_mb):
    """Read-only view of the host; fresh private /tmp, /dev/shm and workdir."""
    py_dirs = _python_dirs()
    # Opened before anything is covered: bind mounts below take them as source.
    fds = {d: os.open(d, os.O_PATH | os.O_DIRECTORY) for d in py_dirs}
    blockers = sorted({b for d in py_dirs if (b := _blocking_ancestor(d))})
    # Private propagation: nothing below ever reaches the host's mount table.
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for point, flags in _mountinfo():
        if point == "/proc" or point.startswith("/proc/"):
            continue
        # MS_BIND makes this per-mount: the host's superblock stays writable.
        flags |= MS_REMOUNT | MS_BIND | MS_RDONLY
        rc = libc.mount(None, point.encode(), None, ctypes.c_ulong(flags), None)
        if rc != 0 and point == "/":
            _check(rc, "remount / read-only")
    size = f"size={disk_mb}m"
    for d in ("/tmp", "/dev/shm"):
        if os.path.isdir(d):
            _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
    # Directories like /root (0700) would hide a pyenv/venv interpreter from
    # the throwaway uid: cover them (which also hides their other contents)
    # and bind back only the interpreter's own directories, read-only.
    for b in blockers:
        _mount(libc, "tmpfs", b, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for d, fd in fds.items():
        os.makedirs(d, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", d, None, MS_BIND | MS_REC)
        _mount(libc, None, d, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for b in blockers:
        _mount(libc, None, b, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(workdir, exist_ok=True)
    _mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"{size},mode=700,uid={uid},gid={uid}")


# ---------------------------------------------------------- in-process layers

class _NoNetwork(OSError):
    pass


def _block_sockets():
    """Second layer behind the network namespace: no socket can be created.

    Patching the C module before `socket` is imported is enough: socket.py
    subclasses `_socket.socket` and star-imports its functions.
    """
    import _socket

    def refuse(*args, **kwargs):
        raise _NoNetwork(1, "network access is disabled in the sandbox")

    class BlockedSocket:
        def __new__(cls, *args, **kwargs):
            refuse()

    _socket.socket = _socket.SocketType = BlockedSocket
    for name in ("socketpair", "fromfd", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(_socket, name):
            setattr(_socket, name, refuse)


def _install_exit_builtins():
    """`exit()` and `quit()` come from `site`, which -S skips; programs use them."""
    import builtins

    def leave(code=None):
        raise SystemExit(code)
    builtins.exit = builtins.quit = leave


def _set_limits(cfg):
    cpu = int(cfg["timeout_s"]) + 1
    mem, fsize, nproc = cfg["memory_mb"] << 20, cfg["file_mb"] << 20, cfg["max_processes"]
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_AS, mem, mem),
                            (resource.RLIMIT_FSIZE, fsize, fsize),
                            (resource.RLIMIT_NOFILE, 256, 256),
                            (resource.RLIMIT_CORE, 0, 0),
                            (resource.RLIMIT_NPROC, nproc, nproc)):
        resource.setrlimit(res, (soft, hard))


# -------------------------------------------------------------------- harness

def _format_exc(e):
    import traceback  # only on this path: it costs start-up time
    # Skip the harness's own frame: the message is about the program.
    tb = e.__traceback__.tb_next if e.__traceback__ else None
    return "".join(traceback.format_exception(type(e), e, tb))[-_TAIL:]


def _run_asserts(program, tests):
    """Program then tests in one namespace; `__name__` is not "__main__"."""
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(program, "<program>", "exec"), ns)
    except MemoryError:
        return "memory", "MemoryError while running the program"
    except SystemExit as e:
        return "error", f"the program exited (SystemExit({e.code!r})) before the tests ran"
    except BaseException as e:
        return "error", _format_exc(e)
    try:
        exec(compile(tests, "<tests>", "exec"), ns)
    except MemoryError:
        return "memory", "MemoryError while running the tests"
    except SystemExit as e:
        return "failed", f"exited (SystemExit({e.code!r})) before the tests finished"
    except BaseException as e:
        return "failed", _format_exc(e)
    return "passed", ""


def _normalise_output(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _run_io(program, cases):
    """Each case runs the program as `__main__` on its stdin; stdout compared."""
    code = compile(program, "<program>", "exec")
    real_stdin, real_stdout = sys.stdin, sys.stdout
    for i, case in enumerate(cases):
        # Keep the wrappers referenced: a collected wrapper closes `out`.
        out = io.BytesIO()
        stdin = io.TextIOWrapper(io.BytesIO(case["input"].encode()), encoding="utf-8")
        stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
        sys.stdin, sys.stdout = stdin, stdout
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            # Such programs legitimately exit after printing; the verdict
            # comes from the output, so an exit cannot fake a pass here.
            if e.code not in (None, 0):
                return "failed", f"case {i}: exited with status {e.code!r}"
        except MemoryError:
            return "memory", f"case {i}: MemoryError"
        except BaseException as e:
            return "failed", f"case {i}: " + _format_exc(e)
        finally:
            sys.stdin, sys.stdout = real_stdin, real_stdout
        stdout.flush()
        got = out.getvalue().decode("utf-8", "replace")
        if _normalise_output(got) != _normalise_output(case["output"]):
            return "failed", f"case {i}: wrong output {got[:200]!r}"
    return "passed", ""


def _child(cfg, result_fd, isolation):
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    uid = UID_BASE + cfg["supervisor_pid"]
    if "mount" in isolation:
        try:
            _isolate_fs(libc, cfg["workdir"], uid, cfg["disk_mb"])
        except OSError as e:
            # Half-built isolation is worse than none: fail closed; the
            # trainer retries this machine's runs without namespaces.
            sys.stderr.write(f"sandbox: namespace set-up failed: {e}\n")
            os._exit(SETUP_FAILED)
    os.chdir(cfg["workdir"])
    if "mount" in isolation and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        isolation.append("uid")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _set_limits(cfg)
    _block_sockets()
    _install_exit_builtins()
    harness_pid = os.getpid()
    if cfg["io_cases"] is not None:
        status, message = _run_io(cfg["program"], cfg["io_cases"])
    else:
        status, message = _run_asserts(cfg["program"], cfg["tests"])
    if os.getpid() != harness_pid:
        # A fork of the program came back through the harness: only the
        # original process may speak for the run.
        os._exit(0)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the program may have closed them
        pass
    os.write(result_fd, _record(cfg["nonce"], status, ",".join(isolation), message))
    # os._exit: atexit hooks and finalizers the program left behind never run.
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


def main():
    cfg_fd, verdict_fd, result_fd = (int(a) for a in sys.argv[1:4])
    cfg = marshal.loads(_read_fd(cfg_fd))  # written by the trainer: trusted
    os.close(cfg_fd)
    # Started with -S (no site: much faster); put site-packages back, with no .pth code.
    sys.path.extend(d for d in cfg["site_dirs"] if d not in sys.path)
    libc = _libc()
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    isolation = []
    if cfg["namespaces"]:
        if libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET) == 0:
            isolation = ["pid", "net", "mount"]
        elif libc.unshare(CLONE_NEWNET) == 0:
            isolation = ["net"]
    cfg["supervisor_pid"] = os.getpid()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(verdict_fd)
            _child(cfg, result_fd, isolation)
        except BaseException:  # noqa: BLE001
            import traceback
            traceback.print_exc()
        os._exit(70)
    os.close(result_fd)
    status, usage, timed_out = _wait(pid, cfg["timeout_s"])
    if "pid" not in isolation:
        _sweep(os.getpid())
    code = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    verdict = _record(cfg["nonce"], "timeout" if timed_out else "done", ",".join(isolation),
                      f"{code} {cpu:.3f} {time.monotonic() - started:.3f}")
    os.write(verdict_fd, verdict)
    os.close(verdict_fd)


if __name__ == "__main__":
    main()
