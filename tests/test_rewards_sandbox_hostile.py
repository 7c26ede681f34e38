"""Hostile programs against the code sandbox: no escape, and no cheat scores.

Each cheat targets a correct verdict of 0 (the program does not solve the
task) and tries to turn it into a pass; each escape tries to reach the host
and leaves evidence the test looks for. The red-team report's reproducers
(exit code 71 fallback to root, harness patching, frame/gc snooping, lying
__eq__, socket imports scoring 0) are among them.
"""

import os
import socket
import sys
import textwrap
import uuid

import pytest

from grpojax.rewards import code
from grpojax.rewards.code import run_tests, sandbox_isolation
from grpojax.sandbox import runner

D = textwrap.dedent
LIMIT = 1.0
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) == 15"
WRONG_ADD = "def add(a, b):\n    return 0\n"
IO_CASES = [{"input": "1 2\n", "output": "3"}, {"input": "10 -4\n", "output": "6"}]
FORGE_EVERY_FD = """
import gc, os, re
nonces = {s for o in gc.get_objects() if isinstance(o, dict) for s in o.values()
          if isinstance(s, str) and re.fullmatch('[0-9a-f]{32}', s)}
for fd in range(3, 256):
    for n in nonces or {'0' * 32}:
        for line in (f"{n}\\tpassed\\t\\t\\n", f"{n}\\tdone\\t\\t30 0.1 0.1 0\\n", "passed\\n",
                     "ok tests uid\\n"):
            try:
                os.write(fd, line.encode())
            except OSError:
                pass
"""


def run(program, tests=ADD_TESTS, **kw):
  kw.setdefault("timeout_s", LIMIT)
  kw.setdefault("memory_mb", 256)
  return run_tests(textwrap.dedent(program), tests, **kw)


def full_isolation():
  layers = {"cgroup", "pid", "net", "ipc", "uts", "mount", "uid", "seccomp"}
  return pytest.mark.skipif(not layers <= set(sandbox_isolation()),
                            reason=f"needs {layers}; this machine gives {sandbox_isolation()}")


# ---------------------------------------------------------------- cheats

CHEATS = {
    # Harness and interpreter patching (reward 1 under the old single interpreter).
    "builtins.exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "builtins.compile": ("import builtins\n_c = builtins.compile\n"
                         "builtins.compile = lambda s, f, m, *a, **k: _c('pass', f, m)\n"),
    "patch the harness": ("import sys\n"
                          "for m in list(sys.modules.values()):\n"
                          "    for n in ('_run_asserts', '_run_io', 'run_tests', 'serve_program'):\n"
                          "        if hasattr(m, n):\n"
                          "            setattr(m, n, lambda *a, **k: ('passed', ''))\n"),
    "patch wire encode": ("import sys\nw = sys.modules.get('_sandbox_wire')\n"
                          "w.encode = lambda x, e, d=0: ['B', '1']\n" + WRONG_ADD),
    "patch os.write": ("import os\n_w = os.write\n"
                       "os.write = lambda fd, b: _w(fd, b.replace(b'failed', b'passed'))\n"),
    "forge records on every fd": FORGE_EVERY_FD,
    "AssertionError rebound": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n",
    # Snooping for the tests and expected values.
    "tests from frames": D("""
        import sys
        f, found = sys._getframe(), {}
        while f:
            for v in list(f.f_locals.values()) + list(f.f_globals.values()):
                if isinstance(v, str) and 'assert add(' in v:
                    for line in v.splitlines():
                        if line.startswith('assert add(') and ') == ' in line:
                            args, want = line[len('assert add('):].split(') == ')
                            found[eval('(' + args + ',)')] = eval(want)
            f = f.f_back
        def add(a, b):
            return found.get((a, b))
        """),
    "tests from gc": D("""
        import gc
        found = {}
        for o in gc.get_objects():
            for v in (o.values() if isinstance(o, dict) else [o] if isinstance(o, str) else []):
                if isinstance(v, str) and 'assert add(' in v:
                    for line in v.splitlines():
                        if line.startswith('assert add(') and ') == ' in line:
                            args, want = line[len('assert add('):].split(') == ')
                            found[eval('(' + args + ',)')] = eval(want)
        def add(a, b):
            return found.get((a, b))
        """),
    "tests from memory scan": D("""
        import ctypes, re
        found = {}
        with open('/proc/self/maps') as f:
            maps = [l.split() for l in f]
        for m in maps:
            if not m[1].startswith('rw') or len(m) > 5 and m[5] not in ('[heap]', '[stack]'):
                continue
            lo, hi = (int(x, 16) for x in m[0].split('-'))
            try:
                blob = ctypes.string_at(lo, min(hi - lo, 1 << 26))
            except Exception:
                continue
            for hit in re.finditer(rb'assert add\((-?\d+), (-?\d+)\) == (-?\d+)', blob):
                found[int(hit[1]), int(hit[2])] = int(hit[3])
        def add(a, b):
            return found.get((a, b))
        """),
    # Values that lie about equality or truth.
    "always-equal object": ("class A:\n    def __eq__(self, o): return True\n"
                            "    __hash__ = object.__hash__\n"
                            "def add(a, b):\n    return A()\n"),
    "always-equal with __ne__": ("class A:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
                                 "    __hash__ = object.__hash__\n"
                                 "def add(a, b):\n    return [A(), A()][0]\n"),
    "lying int subclass": ("class I(int):\n    def __eq__(self, o): return True\n"
                           "    __hash__ = int.__hash__\n"
                           "def add(a, b):\n    return I(0)\n"),
    "lying str subclass": ("class S(str):\n    def __eq__(self, o): return True\n"
                           "    __hash__ = str.__hash__\n"
                           "def add(a, b):\n    return S('no')\n"),
    "lying list subclass": ("class L(list):\n    def __eq__(self, o): return True\n"
                            "def add(a, b):\n    return L()\n"),
    "container of always-equal": ("class A:\n    __eq__ = lambda s, o: True\n"
                                  "def add(a, b):\n    return (A(),)[0]\n"),
    "shadow builtins all/abs/isinstance": ("all = any = lambda *a, **k: True\nabs = lambda x: 0\n"
                                           "isinstance = lambda *a: True\n" + WRONG_ADD),
    "fake math module": ("class math:\n    isclose = staticmethod(lambda *a, **k: True)\n"
                         + WRONG_ADD),
    "fake numpy alias": ("class np:\n    allclose = array_equal = staticmethod(lambda *a, **k: True)\n"
                         + WRONG_ADD),
    # Early exits and exit codes (71 was the old "namespaces unusable" code).
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "exit 70": "import os\nos._exit(70)\n",
    "exit 71": "import os\nos._exit(71)\n",
    "exit 137": "import os\nos._exit(137)\n",
    "exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys.exit inside the call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "raise in __del__": ("import os\nclass D:\n    def __del__(self): os._exit(0)\n"
                         "def add(a, b):\n    return D()\n"),
    "atexit prints a pass": "import atexit, os\natexit.register(lambda: print('passed'))\n",
    "kill the tests' process": D("""
        import os, signal
        for pid in range(1, 200):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        """) + WRONG_ADD,
    "write tests' memory": D("""
        import os
        for pid in os.listdir('/proc'):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    open(f'/proc/{pid}/mem', 'r+b').write(b'x')
                    print('WROTE', pid)
                except OSError:
                    pass
        """) + WRONG_ADD,
    "fork answers for the original": "import os\nif os.fork():\n    os.wait()\n    os._exit(0)\n",
    "speak the protocol": D("""
        import os, sys
        w = sys.modules['_sandbox_wire']
        for fd in range(3, 30):
            try:
                w.send(fd, ['ret', ['B', '1']])
                w.send(fd, ['ready', []])
            except OSError:
                pass
        """) + WRONG_ADD,
    "StopIteration ends all(map(...)) early": "def add(a, b):\n    raise StopIteration\n",
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_score_zero(name):
  tests = ADD_TESTS
  if name.startswith("StopIteration"):
    tests = "assert all(map(add, [2, 3], [5, 7]))\n"
  if name in ("fake math module", "fake numpy alias", "shadow builtins all/abs/isinstance"):
    tests = ("assert math.isclose(add(1, 2), 3)\nassert np.allclose(add(1, 2), 3)\n"
             if "fake" in name else
             "assert all(add(a, b) == a + b for a, b in [(1, 2), (3, 4)])\n"
             "assert abs(add(1, 2) - 3) < 1e-9\nassert isinstance(add(1, 2), str)\n")
  res = run(CHEATS[name], tests)
  assert not res.passed, res
  # Each cheat is a valid program: it fails for cheating, not for a typo.
  assert "SyntaxError" not in res.message and "IndentationError" not in res.message, res
  assert "WROTE" not in res.stdout


# Labels the program sets on its own objects: the tests must still call them.
NAME_CHEATS = {
    "__module__ of a wrong add": ("import operator\n" + WRONG_ADD + "add.__module__ = 'operator'\n",
                                  ADD_TESTS),
    "functools.wraps(operator.add)": ("import functools, operator\n"
                                      "@functools.wraps(operator.add)\n" + WRONG_ADD, ADD_TESTS),
    "callable object labelled operator.add": (D("""
        class F:
            def __call__(self, a, b):
                return 0
        add = F()
        add.__module__, add.__qualname__ = 'operator', 'add'
        """), ADD_TESTS),
    "class labelled operator.add": (D("""
        class add:
            def __new__(cls, a, b):
                return 0
        add.__module__, add.__qualname__ = 'operator', 'add'
        """), ADD_TESTS),
    "wrong sort_list labelled builtins.sorted": (D("""
        def sort_list(xs):
            return xs
        sort_list.__module__, sort_list.__qualname__ = 'builtins', 'sorted'
        """), "assert sort_list([3, 1, 2]) == [1, 2, 3]"),
    "wrong class labelled collections.Counter": (D("""
        class Counter(dict):
            pass
        Counter.__module__ = 'collections'
        """), "assert Counter('aab') == {'a': 2, 'b': 1}"),
    "__qualname__ through a real module's attribute path": (D("""
        def add(a, b):
            return 0
        add.__module__, add.__qualname__ = 'math', 'fsum.__self__.fsum'
        """), ADD_TESTS),
    "a module object named like another module": (
        "import types\nCalc = types.ModuleType('operator')\n", "assert Calc.add(2, 3) == 5"),
    "a module the tests never asked for": (
        "import types\nadd = types.ModuleType('operator')\n", "assert add.add(2, 3) == 5"),
    "monkeypatched stdlib function": ("import operator\noperator.add = lambda a, b: 0\n"
                                      "from operator import add\n", ADD_TESTS),
    "__class__ swapped to int": (D("""
        class Liar:
            pass
        def add(a, b):
            x = Liar()
            try:
                x.__class__ = int
            except TypeError:
                pass
            return x
        """), ADD_TESTS),
    "__reduce__ that rebuilds the expected value": (D("""
        class R:
            def __reduce__(self):
                return (int, ('5',))
        def add(a, b):
            return R()
        """), "assert add(2, 3) == 5"),
    "__index__ and __int__ that lie": (D("""
        class N:
            __index__ = __int__ = lambda self: 5
            __eq__ = lambda self, o: True
            __hash__ = object.__hash__
        def add(a, b):
            return N()
        """), "assert add(2, 3) == 5"),
    "__name__ of a wrong function named like a builtin": (
        "def add(a, b):\n    return 0\nadd.__name__ = add.__qualname__ = 'sum'\n"
        "add.__module__ = 'builtins'\n", "assert add(2, 3) == 5"),
    "sys.modules entry for the tests' import": ("import sys, types\nm = types.ModuleType('operator')\n"
                                                "m.add = lambda a, b: 0\nsys.modules['operator'] = m\n"
                                                "from operator import add\n", ADD_TESTS),
}
# The same shapes, honestly: a program's imports keep working through handles.
NAME_CONTROLS = {
    "from operator import add": ("from operator import add\n", ADD_TESTS),
    "import operator; add = operator.add": ("import operator\nadd = operator.add\n", ADD_TESTS),
    "functools.wraps of a right add": ("import functools, operator\n@functools.wraps(operator.add)\n"
                                       "def add(a, b):\n    return a + b\n", ADD_TESTS),
    "from math import isclose": ("from math import isclose\ndef f():\n    return 0.1 + 0.2\n",
                                 "assert isclose(f(), 0.3) and not isclose(f(), 0.4)"),
    "from collections import Counter": ("from collections import Counter\n"
                                        "def count(s):\n    return Counter(s)\n",
                                        "assert count('aab') == Counter('aab') == {'a': 2, 'b': 1}"),
    "sorted under another name": ("sort_list = sorted\n", "assert sort_list([3, 1, 2]) == [1, 2, 3]"),
    "import numpy, used by the tests": ("import numpy\ndef f():\n    return [1, 2]\n",
                                        "assert numpy.array_equal(f(), [1, 2])"),
    "from fractions import Fraction": ("from fractions import Fraction\n"
                                       "def half():\n    return str(Fraction(1, 2))\n",
                                       "assert half() == str(Fraction(2, 4)) == '1/2'"),
}


@pytest.mark.parametrize("name", sorted(NAME_CHEATS))
def test_names_the_program_sets_steer_nothing(name):
  program, tests = NAME_CHEATS[name]
  res = run(program, tests, memory_mb=512)
  assert not res.passed, res
  assert "SyntaxError" not in res.message and "IndentationError" not in res.message, res


@pytest.mark.parametrize("name", sorted(NAME_CONTROLS))
def test_honest_imports_still_pass(name):
  program, tests = NAME_CONTROLS[name]
  # A control's limit is generous: numpy's import on a loaded machine is not a timeout.
  res = run(program, tests, memory_mb=512, timeout_s=60.0)
  assert res.passed, res


IO_CHEATS = {
    "patch the normaliser": ("import __main__, sys\n"
                             "for m in list(sys.modules.values()):\n"
                             "    if hasattr(m, '_normalise_output'):\n"
                             "        m._normalise_output = lambda t: ''\n"),
    "replace sys.stdout": "import io, sys\nsys.stdout = io.StringIO()\nprint('3')\n",
    "replace print": "import builtins\nbuiltins.print = lambda *a, **k: None\n",
    "expected output from gc": D("""
        import gc
        for o in gc.get_objects():
            if isinstance(o, dict) and 'output' in o and 'input' in o:
                print(o['output'])
                break
        """),
    "exit 0 without output": "import sys\nsys.exit(0)\n",
    "fd-level record forging": FORGE_EVERY_FD,
}


@pytest.mark.parametrize("name", sorted(IO_CHEATS))
def test_io_cheats_score_zero(name):
  res = run(IO_CHEATS[name], IO_CASES)
  assert not res.passed, res
  assert "SyntaxError" not in res.stderr and "IndentationError" not in res.stderr, res


def test_io_mode_still_passes_correct_programs():
  assert run("a, b = map(int, input().split())\nprint(a + b)\n", IO_CASES).passed


# ---------------------------------------------------------------- escapes

@full_isolation()
def test_exit_71_reproducer_runs_nothing_as_root():
  marker = f"/var/tmp/grpojax-hostile-{uuid.uuid4().hex}"
  program = (f"import os\nif os.getuid() != 0: os._exit(71)\nopen({marker!r}, 'w').write('root')\n"
             "def add(a, b): return a + b")
  for _ in range(2):  # and no process-wide state changes for the next run
    res = run_tests(program, ["assert add(1, 2) == 3"], timeout_s=LIMIT)
    assert not res.passed and res.status == "error", res
    assert {"uid", "mount", "pid", "seccomp"} <= set(res.isolation), res
    assert not os.path.exists(marker)
  res = run("import os\nprint('UID', os.getuid(), os.geteuid())\n" + WRONG_ADD)
  uid, euid = (int(x) for x in res.stdout.split()[1:3])
  assert uid >= 1_000_000 and euid >= 1_000_000


@full_isolation()
def test_files_outside_cannot_be_written_or_read(tmp_path_factory):
  cwd_dir = os.path.join(os.getcwd(), f".hostile-{uuid.uuid4().hex}")
  home_dir = os.path.join(os.path.expanduser("~"), f".hostile-{uuid.uuid4().hex}")
  secret = f"secret-{uuid.uuid4().hex}"
  os.makedirs(cwd_dir)
  os.makedirs(home_dir)
  readable = [os.path.join(d, "answers.txt") for d in (cwd_dir, home_dir)]
  for p in readable:
    with open(p, "w") as f:
      f.write(secret)
    os.chmod(p, 0o644)
  os.chmod(home_dir, 0o755)
  writes = [f"/var/tmp/grpojax-hostile-{uuid.uuid4().hex}", os.path.join(cwd_dir, "w"),
            os.path.join(home_dir, "w"), "/etc/grpojax-hostile", "/usr/grpojax-hostile"]
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    res = run(D(f"""
            import os
            for p in {readable + [os.path.join(repo, 'README.md'), '/etc/hostname']!r}:
                try:
                    print(open(p).read()[:200])
                except OSError as e:
                    print('unreadable', p, type(e).__name__)
            for p in {writes!r}:
                try:
                    open(p, 'w').write('x')
                except OSError:
                    pass
            print(sorted(os.listdir('/')))
            print(open('/etc/passwd').read())
            """) + WRONG_ADD)
    assert not res.passed
    assert secret not in res.stdout + res.stderr + res.message
    assert "grpojax" not in res.stdout.split("unreadable")[0]  # README not shown
    assert res.stdout.count("unreadable") == 4, res.stdout
    assert "'work'" not in res.stdout and "'home'" not in res.stdout
    with open("/etc/passwd") as f:
      host_users = [line.split(":")[0] for line in f if line.strip()]
    hidden = [u for u in host_users if u not in ("root", "nobody")]
    assert all(f"\n{u}:" not in "\n" + res.stdout for u in hidden)
    for p in writes:
      assert not os.path.exists(p), p
  finally:
    for d in (cwd_dir, home_dir):
      for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
      os.rmdir(d)


ESCAPES = {
    "ptrace": D("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in (1, os.getppid()):
            print('ptrace', libc.ptrace(16, pid, 0, 0), ctypes.get_errno())
        print('traceme', libc.ptrace(0, 0, 0, 0))
        """),
    "unshare and mount via ctypes": D("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        clone, keyctl, bpf = {'x86_64': (56, 250, 321), 'aarch64': (220, 219, 280)}[os.uname().machine]
        for flags in (0x10000000, 0x00020000, 0x40000000, 0x20000000):
            print('unshare', libc.unshare(flags))
        print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))
        print('setns', libc.setns(0, 0))
        print('clone-ns', libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0))
        print('keyctl', libc.syscall(keyctl, 1, 0, 0, 0, 0))
        print('bpf', libc.syscall(bpf, 0, 0, 0))
        print('chroot', libc.chroot(b'/tmp'))
        """),
    "setuid tricks": D("""
        import os, subprocess
        for f in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.seteuid(0)):
            try:
                f()
            except OSError:
                pass
        for b in ('/usr/bin/su', '/usr/bin/sudo', '/usr/bin/passwd', '/usr/bin/newgrp'):
            if os.path.exists(b):
                r = subprocess.run([b, '--help'], capture_output=True, timeout=0.3)
        print('EUID', os.geteuid(), os.getuid())
        """),
    "kill the trainer": None,  # filled in with the test process's pid below
    "kill everything": "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n",
    "/proc snooping": D("""
        import os
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        print('PIDS', pids)
        for p in pids:
            for f in ('environ', 'cmdline'):
                try:
                    print(open(f'/proc/{p}/{f}', 'rb').read()[:300])
                except OSError:
                    pass
        """),
    "cgroup and sys": "import os\nprint('SYS', os.path.exists('/sys/fs/cgroup'))\n",
    "user namespace by a fresh binary": D("""
        import subprocess
        r = subprocess.run(['unshare', '-U', '-r', 'id', '-u'], capture_output=True, text=True)
        print('UNSHARE', r.returncode, r.stdout.strip())
        """),
}


@full_isolation()
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escapes_are_contained(name, monkeypatch):
  secret = f"trainer-secret-{uuid.uuid4().hex}"
  monkeypatch.setenv("GRPOJAX_HOSTILE_SECRET", secret)
  program = ESCAPES[name] or (f"import os, signal\nfor s in (signal.SIGTERM, signal.SIGKILL):\n"
                              f"    try:\n        os.kill({os.getpid()}, s)\n"
                              f"    except OSError:\n        pass\n")
  res = run(D(program) + WRONG_ADD)
  assert not res.passed and res.status == "failed", res  # it ran, and the tests ran after it
  out = res.stdout
  assert secret not in out + res.stderr
  if name == "ptrace":
    assert "ptrace 0" not in out and "traceme 0" not in out
  if name == "unshare and mount via ctypes":
    assert all(line.split()[1] == "-1" for line in out.strip().splitlines()), out
  if name == "setuid tricks":
    assert "EUID 0" not in out and " 0\n" not in out.split("EUID")[1] + "\n"
  if name == "/proc snooping":
    pids = eval(out.split("PIDS ")[1].splitlines()[0])
    assert len(pids) == 1, pids  # its own: not init, not the tests, nothing of the host
  if name == "cgroup and sys":
    assert "SYS False" in out
  if name == "user namespace by a fresh binary":
    assert "UNSHARE 0" not in out


_IPC_PROGRAM = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print('SHM', libc.shmget({key}, 4096, 0o1666))
print('MSG', libc.msgget({key} + 1, 0o1666))
print('SEM', libc.semget({key} + 2, 1, 0o1666))
print('MQ', libc.mq_open({mq!r}.encode(), 0o102, 0o666, None))
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(name={posix_shm!r}, create=True, size=4096)
seg.buf[:4] = b'leak'
print('POSIX_SHM', os.listdir('/dev/shm'))
print('HOST_SHM', libc.shmget({host_key}, 0, 0), libc.msgget({host_key} + 1, 0))
print('HOST_MQ', libc.mq_open({host_mq!r}.encode(), 0, 0, None))
print('HOST_POSIX_SHM', os.path.exists('/dev/shm/' + {host_posix_shm!r}))
print('SYSVIPC', open('/proc/sysvipc/shm').read().split('\\n')[1:])
"""


def _ipc_names():
  tag = uuid.uuid4().hex[:8]
  return dict(key=0x5A000000 + int(tag[:6], 16), mq=f"/grpojax-mq-{tag}",
              posix_shm=f"grpojax-shm-{tag}", host_key=0x5B000000 + int(tag[:6], 16),
              host_mq=f"/grpojax-hostmq-{tag}", host_posix_shm=f"grpojax-hostshm-{tag}")


@full_isolation()
def test_ipc_objects_die_with_the_run_and_the_hosts_stay_out_of_sight():
  # SysV shared memory, queues and semaphores and POSIX queues and shared
  # memory: none of the program's outlives its run (no channel to the next
  # rollout, nothing left on the host), and none of the host's is reachable.
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  names = _ipc_names()
  host_shm = libc.shmget(names["host_key"], 4096, 0o1600)  # root-only, like a host service's
  host_msg = libc.msgget(names["host_key"] + 1, 0o1666)
  host_mq = libc.mq_open(names["host_mq"].encode(), 0o102, 0o666, None)
  host_posix = f"/dev/shm/{names['host_posix_shm']}"
  open(host_posix, "w").close()
  assert min(host_shm, host_msg, host_mq) >= 0, ctypes.get_errno()
  try:
    res = run(_IPC_PROGRAM.format(**names) + WRONG_ADD, memory_mb=512)
    assert not res.passed and res.status == "failed", res
    out = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert all(int(out[k]) >= 0 for k in ("SHM", "MSG", "SEM", "MQ")), out  # it could make them
    assert names["posix_shm"] in out["POSIX_SHM"]
    assert out["HOST_SHM"] == "-1 -1" and out["HOST_MQ"] == "-1", out
    assert out["HOST_POSIX_SHM"] == "False", out
    assert str(names["host_key"]) not in out["SYSVIPC"], out
    # After the run, nothing of the program's exists on the host.
    assert libc.shmget(names["key"], 0, 0) == -1
    assert libc.msgget(names["key"] + 1, 0) == -1
    assert libc.semget(names["key"] + 2, 0, 0) == -1
    assert libc.mq_open(names["mq"].encode(), 0, 0, None) == -1
    assert not os.path.exists(f"/dev/shm/{names['posix_shm']}")
    # ... nor for the next run: no channel between rollouts.
    res = run("import ctypes\nlibc = ctypes.CDLL(None)\n"
              f"print('AGAIN', libc.shmget({names['key']}, 0, 0), libc.msgget({names['key'] + 1}, 0),"
              f" libc.mq_open({names['mq']!r}.encode(), 0, 0, None))\n" + WRONG_ADD)
    assert "AGAIN -1 -1 -1" in res.stdout, res
  finally:
    libc.shmctl(host_shm, 0, None)  # IPC_RMID
    libc.msgctl(host_msg, 0, None)
    libc.mq_close(host_mq)
    libc.mq_unlink(names["host_mq"].encode())
    os.unlink(host_posix)


@full_isolation()
def test_abstract_unix_sockets_are_out_of_reach_both_ways():
  # The abstract socket namespace belongs to the network namespace: a host
  # service listening there is unreachable, and one the program opens is
  # gone with its run (no channel to the next rollout).
  name = f"grpojax-host-{uuid.uuid4().hex[:8]}"
  host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  host.bind("\0" + name)
  host.listen(1)
  host.settimeout(0.2)
  mine = f"grpojax-prog-{uuid.uuid4().hex[:8]}"
  try:
    res = run(D(f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect('\\0{name}')
            print('CONNECTED')
        except OSError as e:
            print('refused', type(e).__name__)
        keep = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        keep.bind('\\0{mine}')
        keep.listen(1)
        """) + WRONG_ADD)
    assert not res.passed and "refused" in res.stdout and "CONNECTED" not in res.stdout, res
    with pytest.raises(socket.timeout):
      host.accept()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
      probe.connect("\0" + mine)
    probe.close()
  finally:
    host.close()


@full_isolation()
def test_the_host_name_is_not_the_programs_to_read():
  res = run("import os, socket\nprint('NAMES', socket.gethostname(), os.uname().nodename,"
            " socket.getfqdn())\n" + WRONG_ADD)
  assert not res.passed and res.status == "failed", res
  names = res.stdout.split("NAMES ")[1].split()
  assert names[:2] == ["sandbox", "sandbox"], names
  host = socket.gethostname()
  assert host == "sandbox" or host not in res.stdout, res.stdout


# ---------------------------------------------------------------- limits

@full_isolation()
def test_total_memory_is_capped_across_processes():
  # Six processes of 150 MB each fit their per-process limit (256 MB) but
  # not the run's total (256 MB + the harness's share): some are killed.
  res = run(D("""
        import os, time
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                b = bytearray(150 << 20)
                for i in range(0, len(b), 4096):
                    b[i] = 1
                time.sleep(1)
                os._exit(0)
            pids.append(pid)
        print('STATUSES', [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
        """) + WRONG_ADD, timeout_s=30.0)  # a safety net: the verdict is the memory cap's
  assert not res.passed and res.status == "memory", res
  statuses = eval(res.stdout.split("STATUSES ")[1].splitlines()[0])
  assert statuses.count(-9) >= 4, statuses  # at most two of 150 MB fit at once


@pytest.mark.slow
@pytest.mark.parametrize("program", [
    "import time\ntime.sleep(30)\n",
    "while True:\n    pass\n",
    "def add(a, b):\n    while True:\n        pass\n",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n",
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(30)\n",
])
def test_limits(program):
  res = run(program)
  assert not res.passed and res.status in ("timeout", "memory", "failed"), res


def test_no_network_to_loopback_but_socket_imports():
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  try:
    res = run(f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=0.5)
                print('CONNECTED')
            except OSError as e:
                print('refused', type(e).__name__)
            def add(a, b):
                return a + b
            """)
    assert res.passed and "refused" in res.stdout and "CONNECTED" not in res.stdout, res
    with pytest.raises(socket.timeout):
      server.accept()
  finally:
    server.close()


# ---------------------------------------------------------------- correct programs

@pytest.mark.parametrize("module", ["socket", "asyncio", "urllib.request", "multiprocessing",
                                    "http.client", "logging.handlers", "ssl"])
def test_stdlib_imports_score_one(module):
  res = run(f"import {module}\ndef add(a, b):\n    return a + b\n", memory_mb=512)
  assert res.passed, res


def test_values_cross_with_their_types():
  res = run("""
        def f(kind):
            return {'tuple': (1, 2), 'list': [1, 2], 'set': {1, 2}, 'bool': True, 'int': 1,
                    'nan': float('nan'), 'inf': float('-inf'), 'big': 3 ** 5000,
                    'bytes': b'\\x00\\xff', 'nested': {(1, 'a'): [frozenset({2}), None, 1.5, 2j]},
                    'str': 'h\\u00e9\\ud800'}[kind]
        """, """
        import math
        assert f('tuple') == (1, 2) and type(f('tuple')) is tuple and f('tuple') != [1, 2]
        assert type(f('list')) is list and f('set') == {1, 2}
        assert f('bool') is True and type(f('int')) is int
        assert math.isnan(f('nan')) and f('inf') == -math.inf
        assert f('big') == 3 ** 5000 and f('bytes') == b'\\x00\\xff'
        assert f('nested') == {(1, 'a'): [frozenset({2}), None, 1.5, 2j]}
        assert f('str') == 'h\\u00e9\\ud800'
        """.replace("\n        ", "\n"))
  assert res.passed, res


def test_objects_classes_generators_and_errors_through_handles():
  res = run("""
        import math
        from collections import Counter
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                return self.items.pop()
            def __len__(self):
                return len(self.items)
        def squares(n):
            for i in range(n):
                yield i * i
        def apply(fn, x):
            return fn(x) + 1
        def check(x):
            if x < 0:
                raise ValueError('negative')
            return math.sqrt(x)
        def sort_in_place(xs):
            xs.sort()
        """, """
        s = Stack()
        s.push(1)
        s.push(2)
        assert len(s) == 2 and s.pop() == 2 and s.items == [1]
        assert s == s and s != Stack()
        assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5
        assert apply(lambda v: v * 10, 2) == 21
        try:
            check(-1)
            raise AssertionError('no error')
        except ValueError as e:
            assert 'negative' in str(e)
        assert check(9) == 3.0 and Counter('aab') == {'a': 2, 'b': 1}
        xs = [3, 1, 2]
        sort_in_place(xs)
        assert xs == [1, 2, 3]  # the tests' list, sorted by the program in place
        """.replace("\n        ", "\n"))
  assert res.passed, res


def test_numpy_results_and_mbpp_style_math():
  res = run("""
        import math
        import numpy as np
        def area(r):
            return math.pi * r * r
        def total(xs):
            return np.sum(np.array(xs))
        """, "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\nassert total([1, 2, 3]) == 6\n"
           "assert np.allclose(np.array([area(1)]), [math.pi])\n", memory_mb=512, timeout_s=60.0)
  assert res.passed, res


# ---------------------------------------------------------------- failing closed

def _broken_supervisor(tmp_path, monkeypatch, breaks):
  """The real supervisor with one set-up step made to fail."""
  real = runner._SUPERVISOR
  script = tmp_path / "broken_sandbox.py"
  script.write_text(textwrap.dedent(f"""
        import sys
        ns = {{"__name__": "broken", "__file__": {real!r}}}
        exec(compile(open({real!r}).read(), {real!r}, "exec"), ns)
        def fail(*args, **kwargs):
            raise OSError("{breaks} refused (test)")
        ns[{breaks!r}] = fail
        main = ns["main"]
        """))
  monkeypatch.setattr(runner, "_SUPERVISOR", str(script))


@pytest.mark.parametrize("breaks", ["_install_seccomp", "_build_root", "_cgroup_join", "_unshare"])
def test_a_set_up_failure_never_runs_the_program(tmp_path, monkeypatch, breaks):
  _broken_supervisor(tmp_path, monkeypatch, breaks)
  res = run("print('RAN')\ndef add(a, b):\n    return a + b\n")
  assert not res.passed and res.status == "error", res
  assert "RAN" not in res.stdout
  assert "set-up" in res.message, res.message


def test_unavailable_sandbox_is_refused_loudly(tmp_path, monkeypatch):
  _broken_supervisor(tmp_path, monkeypatch, "_install_seccomp")
  runner._check_available.cache_clear()
  try:
    with pytest.raises(code.SandboxUnavailable, match="seccomp refused"):
      run("def add(a, b):\n    return a + b\n")
  finally:
    runner._check_available.cache_clear()


def test_threads_processes_and_subprocesses_work_under_seccomp():
  res = run(D("""
        import subprocess, sys
        from concurrent.futures import ThreadPoolExecutor
        from multiprocessing import Pool
        def sq(x):
            return x * x
        with ThreadPoolExecutor(4) as ex:
            T = list(ex.map(sq, range(5)))
        with Pool(2) as p:
            P = p.map(sq, range(5))
        S = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True,
                           text=True).stdout.strip()
        """), "assert T == P == [0, 1, 4, 9, 16]\nassert S == '42'", memory_mb=512, timeout_s=10.0)
  assert res.passed, res


_NON_ROOT_PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = sys.modules["runner"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
try:
    runner.run_tests("def add(a, b):\\n    return a + b\\n", "assert add(1, 2) == 3")
    print("RAN")
except runner.SandboxUnavailable as e:
    print("UNAVAILABLE", e)
r = runner.run_tests("import os\\nprint(os.getuid())\\ndef add(a, b):\\n    return a + b\\n",
                     "assert add(1, 2) == 3", namespaces=False)
print("OPTOUT", r.passed, ",".join(r.isolation), r.stdout.strip())
"""


def test_without_privileges_it_refuses_unless_opted_out():
  # A non-root user cannot have the namespaces: the verifier says so at
  # first use instead of running with less. The system interpreter: the
  # test's own may sit in a directory only root can enter.
  python = "/usr/bin/python3"
  if os.geteuid() != 0 or not os.path.exists(python):
    pytest.skip("needs root (to become nobody) and a system python3")
  # nobody must be able to read grpojax's files (a checkout under /root is not).
  path = os.path.dirname(os.path.abspath(runner.__file__))
  while path != "/":
    if not os.stat(path).st_mode & 0o001:
      pytest.skip(f"{path} is not searchable by other users")
    path = os.path.dirname(path)
  import subprocess
  import tempfile
  fd, script = tempfile.mkstemp(suffix=".py", dir="/tmp")
  try:
    os.write(fd, _NON_ROOT_PROBE.encode())
    os.close(fd)
    os.chmod(script, 0o644)
    out = subprocess.run(
        [python, "-I", script, runner.__file__], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"}, cwd="/tmp",
        preexec_fn=lambda: (os.setgroups([]), os.setgid(65534), os.setuid(65534)))
  finally:
    os.unlink(script)
  if "No module named" in out.stderr:
    pytest.skip(f"the system python3 lacks a module: {out.stderr[-200:]}")
  assert "UNAVAILABLE" in out.stdout and "RAN" not in out.stdout, out
  assert "unshare" in out.stdout and "namespaces=False" in out.stdout
  assert "OPTOUT True seccomp 65534" in out.stdout, out


def test_humaneval_and_mbpp_styles():
  # HumanEval: a check(candidate) the tests define, called on the program's function.
  res = run("def mean(xs):\n    return sum(xs) / len(xs)\n",
            "METADATA = {}\n\ndef check(candidate):\n    assert abs(candidate([1, 2, 4]) - 7 / 3) < 1e-9\n"
            "    assert candidate([2.0]) == 2.0\n\ncheck(mean)\n")
  assert res.passed, res
  # MBPP: tuples, sets, a helper module the program imported.
  res = run("import math\ndef similar(a, b):\n    return tuple(sorted(set(a) & set(b)))\n"
            "def wind_chill(v, t):\n    return int(round(13.12 + 0.6215 * t - 11.37 * math.pow(v, 0.16)"
            " + 0.3965 * t * math.pow(v, 0.16), 0))\n",
            ["assert similar((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
             "assert set(similar((1, 2), (2, 3))) == {2}",
             "assert math.isclose(wind_chill(120, 35), 40)"])
  assert res.passed, res


def test_a_run_refuses_at_startup_where_the_sandbox_cannot_run(monkeypatch, tmp_path):
  # The loop asks every reward for its startup check before anything compiles.
  from grpojax.data import tasks
  from grpojax.train import loop

  def unavailable(namespaces):
    raise code.SandboxUnavailable("the code sandbox cannot run here: test")

  monkeypatch.setattr(code, "sandbox_isolation", unavailable)
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "experiments"))
  import code_qwen2_5_coder
  cfg = code_qwen2_5_coder.get_config("smoke")
  with pytest.raises(code.SandboxUnavailable, match="cannot run here"):
    loop.train(cfg, str(tmp_path / "w"))
  assert not (tmp_path / "w" / "checkpoints").exists()
  assert isinstance(tasks.get_task("code").reward_fns[0], code.CodeReward)
