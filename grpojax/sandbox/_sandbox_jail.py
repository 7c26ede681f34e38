"""The kernel's side of the sandbox: seccomp filter, cgroup, empty root.

Used by `_sandbox.py` only; standard library only. Each piece is set up by
trusted code before any program byte runs (see `_sandbox.py` for the order
and the trust argument).
"""

import ctypes
import os
import sys
import time

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
CLONE_NEWUTS, CLONE_NEWIPC = 0x04000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_SECCOMP = 22


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


# -------------------------------------------------------------------- seccomp

# Syscalls refused with EPERM: new namespaces, mounts, tracing, kernel
# keyrings, BPF, perf, modules, clocks, io_uring (its requests bypass this
# filter); clone only when asked for namespaces; sockets of any family but
# AF_UNIX (EAFNOSUPPORT).
_DENY = {
    "x86_64": dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
                   ptrace=101, process_vm_readv=310, process_vm_writev=311, bpf=321,
                   perf_event_open=298, keyctl=250, add_key=248, request_key=249,
                   userfaultfd=323, kexec_load=246, kexec_file_load=320, init_module=175,
                   finit_module=313, delete_module=176, reboot=169, swapon=167, swapoff=168,
                   acct=163, settimeofday=164, clock_settime=227, adjtimex=159, syslog=103,
                   open_by_handle_at=304, name_to_handle_at=303, open_tree=428, move_mount=429,
                   fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
                   iopl=172, ioperm=173, quotactl=179, vhangup=153,
                   io_uring_setup=425, io_uring_enter=426, io_uring_register=427),
    "aarch64": dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
                    ptrace=117, process_vm_readv=270, process_vm_writev=271, bpf=280,
                    perf_event_open=241, keyctl=219, add_key=217, request_key=218,
                    userfaultfd=282, kexec_load=104, kexec_file_load=294, init_module=105,
                    finit_module=273, delete_module=106, reboot=142, swapon=224, swapoff=225,
                    acct=89, settimeofday=170, clock_settime=112, adjtimex=171, syslog=116,
                    open_by_handle_at=265, name_to_handle_at=264, open_tree=428, move_mount=429,
                    fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
                    quotactl=60, vhangup=58,
                    io_uring_setup=425, io_uring_enter=426, io_uring_register=427),
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE, _CLONE3 = {"x86_64": 56, "aarch64": 220}, 435
# socket(2) and socketpair(2): their family is the first argument, so the filter
# reads it. Only AF_UNIX is let through (multiprocessing, asyncio's self-pipe); every
# other family is refused whatever namespace the run has: the network namespace
# isolates AF_INET and friends but not AF_VSOCK, whose port space and peers (the
# hypervisor among them) are the host's.
_SOCKETS = {"x86_64": (41, 53), "aarch64": (198, 199)}
AF_UNIX = 1
_NS_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_ENOSYS, _EPERM, _EAFNOSUPPORT = 38, 1, 97


def _seccomp_filter(arch):
  """Classic BPF over struct seccomp_data (nr @0, arch @4, args[0] low @16).

  Instructions are (code, jt, jf, k): a jump skips jt instructions when true, jf when
  false.
  """
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, kill, errno = 0x7FFF0000, 0x80000000, 0x00050000
  prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH[arch]), (ret, 0, 0, kill), (ld, 0, 0, 0)]
  if arch == "x86_64":  # the x32 ABI numbers every syscall again, above bit 30
    prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, errno | _EPERM)]
  for nr in _DENY[arch].values():
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno | _EPERM)]
  socket, socketpair = _SOCKETS[arch]
  prog += [(jeq, 1, 0, socket), (jeq, 0, 4, socketpair), (ld, 0, 0, 16),
           (jeq, 1, 0, AF_UNIX), (ret, 0, 0, errno | _EAFNOSUPPORT), (ret, 0, 0, allow)]
  # clone3 passes its flags in memory BPF cannot read: ENOSYS makes glibc
  # fall back to clone, whose flags are an argument.
  prog += [(jeq, 0, 1, _CLONE3), (ret, 0, 0, errno | _ENOSYS),
           (jeq, 0, 3, _CLONE[arch]), (ld, 0, 0, 16), (jset, 0, 1, _NS_FLAGS),
           (ret, 0, 0, errno | _EPERM), (ret, 0, 0, allow)]
  return prog


def _install_seccomp(libc):
  arch = os.uname().machine
  if arch not in _DENY:
    raise OSError(f"no seccomp filter for {arch}")
  insns = _seccomp_filter(arch)

  class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

  class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

  arr = (Insn * len(insns))(*[Insn(*i) for i in insns])
  prog = Prog(len(insns), arr)
  _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "seccomp")


# --------------------------------------------------------------------- cgroup

def _cgroup_dirs():
  """(kind, directory) of this process's cgroups that can limit memory/pids."""
  mounts = {}
  with open("/proc/self/mountinfo") as f:
    for line in f:
      left, right = line.split(" - ", 1)
      fstype, _, opts = right.split()[:3]
      point = left.split()[4]
      if fstype == "cgroup2":
        mounts["v2"] = point
      elif fstype == "cgroup":
        for c in ("memory", "pids"):
          if c in opts.split(","):
            mounts[c] = point
  own = {}
  with open("/proc/self/cgroup") as f:
    for line in f:
      _, controllers, path = line.rstrip("\n").split(":", 2)
      for c in (controllers.split(",") if controllers else ["v2"]):
        own[c] = path
  if "v2" in mounts and "v2" in own:
    d = mounts["v2"] + own["v2"]
    try:
      with open(d + "/cgroup.subtree_control") as f:
        if {"memory", "pids"} <= set(f.read().split()):
          return [("v2", d)]
    except OSError:
      pass
  if "memory" in mounts and "memory" in own:
    dirs = [("memory", mounts["memory"] + own["memory"])]
    if "pids" in mounts and "pids" in own:
      dirs.append(("pids", mounts["pids"] + own["pids"]))
    return dirs
  return []


def _remove_stale(parent):
  """Cgroups of supervisors the trainer killed before they could clean up."""
  for name in os.listdir(parent):
    if name.startswith("grpojax-sbx-") and not os.path.exists(f"/proc/{name[12:]}"):
      try:
        os.rmdir(f"{parent}/{name}")
      except OSError:
        pass


def _write(path, value):
  with open(path, "w") as f:
    f.write(str(value))


def _cgroup_create(name, memory_bytes, pids):
  """Child cgroup(s) capping the sandbox's total memory and processes, or []."""
  made = []
  try:
    for kind, parent in _cgroup_dirs():
      _remove_stale(parent)
      d = f"{parent}/{name}"
      os.mkdir(d)
      made.append((kind, d))
      if kind in ("v2", "memory"):
        _write(f"{d}/memory.{'max' if kind == 'v2' else 'limit_in_bytes'}", memory_bytes)
        swap = "memory.swap.max" if kind == "v2" else "memory.memsw.limit_in_bytes"
        try:
          _write(f"{d}/{swap}", 0 if kind == "v2" else memory_bytes)
        except OSError:
          pass  # no swap accounting here: memory alone is capped
      if kind in ("v2", "pids"):
        _write(f"{d}/pids.max", pids)
  except OSError:
    _cgroup_remove(made)
    return []
  return made


def _cgroup_join(made, pid):
  for _, d in made:
    _write(f"{d}/cgroup.procs", pid)


def _cgroup_oom_kills(made):
  """How many of the run's processes the cgroup's OOM killer took."""
  for kind, d in made:
    name = {"v2": "memory.events", "memory": "memory.oom_control"}.get(kind)
    try:
      with open(f"{d}/{name}") as f:
        for line in f:
          if line.startswith("oom_kill "):
            return int(line.split()[1])
    except (OSError, TypeError, ValueError):
      pass
  return 0


def _cgroup_remove(made):
  for kind, d in made:
    if kind == "v2":
      try:
        _write(f"{d}/cgroup.kill", 1)
      except OSError:
        pass
    for _ in range(200):  # dying tasks leave their cgroup a moment later
      try:
        os.rmdir(d)
        break
      except FileNotFoundError:
        break
      except OSError:
        time.sleep(0.002)


# ---------------------------------------------------------------- file system

def _python_dirs(site_dirs):
  """Directories the interpreter imports from (stdlib, site-packages)."""
  dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
  dirs.update(p if os.path.isdir(p) else os.path.dirname(p) for p in sys.path if p)
  dirs.update(site_dirs)
  dirs = sorted(os.path.abspath(d) for d in dirs if os.path.isdir(d))
  kept = []  # parents first; a directory inside one already kept comes with it
  for d in sorted(dirs, key=len):
    if not any(d == k or d.startswith(k.rstrip("/") + "/") for k in kept):
      kept.append(d)
  return kept


_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def _build_root(libc, cfg, uid):
  """An empty root with only what a Python program needs, then pivot into it.

  Not the host's file system made read-only: the repository, home
  directories, the trainer's checkpoints and /etc/passwd simply are not
  there. Bound read-only: the interpreter's directories, /usr and the
  /lib*, /bin links; /etc has two files and a made-up passwd; /dev five
  devices; /tmp (holding the workdir) and /dev/shm are fresh tmpfs.
  """
  # First: a bind's source must be a mount of the namespace it is made in.
  _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
  binds, links = [], []
  for d in _SYSTEM:
    if os.path.islink(d):
      links.append((d, os.readlink(d)))
    elif os.path.isdir(d):
      binds.append(d)
  binds += _python_dirs(cfg["site_dirs"])
  binds += [p for p in _ETC if os.path.exists(p)]
  # Opened before anything is covered: the binds below take them as source.
  fds = {p: os.open(os.path.realpath(p), os.O_PATH) for p in binds + list(_DEVICES)
         if os.path.exists(p)}
  # Private propagation: nothing below ever reaches the host's mount table.
  _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
  root = "/tmp"  # any directory: covered by the new root's tmpfs in this namespace only
  _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
  # Fresh /tmp and /dev/shm first: an interpreter that lives under /tmp (a CI
  # virtualenv) is bound on top of them below, not hidden by them.
  size = f"size={cfg['disk_mb']}m"
  for d in ("/tmp", "/dev/shm"):
    os.makedirs(root + d, exist_ok=True)
    _mount(libc, "tmpfs", root + d, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
  for p, fd in fds.items():
    target = root + p
    if os.path.isdir(f"/proc/self/fd/{fd}"):
      os.makedirs(target, exist_ok=True)
    else:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      open(target, "w").close()
    _mount(libc, f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    # Devices keep working on a read-only mount; nodev must stay off for them.
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
    _mount(libc, None, target, None, flags | (0 if p.startswith("/dev/") else MS_NODEV))
    os.close(fd)
  for p, dest in links:
    os.symlink(dest, root + p)
  with open(f"{root}/etc/passwd", "w") as f:
    f.write(f"root:x:0:0:root:/:/bin/false\nsandbox:x:{uid}:{uid}:sandbox:{cfg['workdir']}:"
            f"/bin/false\nnobody:x:65534:65534:nobody:/:/bin/false\n")
  with open(f"{root}/etc/group", "w") as f:
    f.write(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
  for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
    os.symlink(dest, f"{root}/dev/{name}")
  os.makedirs(root + "/proc")
  try:  # hidepid: the program does not even see the tests' process
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
  except OSError:
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  work = root + cfg["workdir"]
  os.makedirs(work, exist_ok=True)
  # mode 755: the tests (another uid) may read what the program wrote.
  _mount(libc, "tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
         f"{size},mode=755,uid={uid},gid={uid}")
  os.chdir(root)
  _check(libc.syscall(155 if os.uname().machine == "x86_64" else 41, b".", b"."), "pivot_root")
  _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
  os.chdir("/")
  _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
