"""Sandbox tests: hostile programs are contained, each within its limit."""

import os
import random
import shutil
import socket
import textwrap
import time

import pytest

from grpojax.rewards.code import CodeReward, extract_code, run_tests, sandbox_isolation

LIMIT = 1.0  # seconds: the per-run timeout in these tests


def run(program, tests="", **kw):
  kw.setdefault("timeout_s", LIMIT)
  kw.setdefault("memory_mb", 256)
  return run_tests(textwrap.dedent(program), tests, **kw)


def assert_still_works():
  res = run("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5")
  assert res.passed and res.status == "passed", res


def isolated(*layers):
  return pytest.mark.skipif(
      not set(layers) <= set(sandbox_isolation()),
      reason=f"needs sandbox layers {layers}; this machine gives {sandbox_isolation()}")


def _parent(pid):
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])
  except (OSError, ValueError, IndexError):
    return None


def sandbox_pids():
  """Host pids of processes under a sandbox uid (>= 1,000,000) that are not part of a
  run another process has in progress (pytest-xdist runs other sandbox tests beside
  this one): a run's uids are 1,000,000 + 2 x its supervisor's pid (+1), so a process
  whose supervisor is alive and not our child belongs to that other run."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        uid = next(int(l.split()[1]) for l in f if l.startswith("Uid:"))
    except (OSError, StopIteration):
      continue
    if uid >= 1_000_000:
      supervisor = (uid - 1_000_000) // 2
      if os.path.exists(f"/proc/{supervisor}") and _parent(supervisor) != os.getpid():
        continue
      pids.append(int(name))
  return pids


# ------------------------------------------------------------------ ordinary

def test_passing_failing_and_broken_programs():
  assert run("def sq(x):\n    return x * x\n", "assert sq(3) == 9").passed
  res = run("def sq(x):\n    return x + x\n", "assert sq(3) == 9")
  assert (res.passed, res.status) == (False, "failed") and "AssertionError" in res.message
  res = run("def sq(x) return x\n", "assert sq(3) == 9")
  assert (res.passed, res.status) == (False, "error") and "SyntaxError" in res.message
  res = run("raise ValueError('boom')", "")
  assert res.status == "error" and "boom" in res.message
  # A list of statements; a __main__ block does not run under assert tests.
  res = run("def f():\n    return 1\nif __name__ == '__main__':\n    raise SystemExit(3)\n",
            ["assert f() == 1", "assert f() + 1 == 2"])
  assert res.passed, res


def test_stdin_stdout_cases():
  prog = "a, b = map(int, input().split())\nprint(a + b)\n"
  cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"}]
  assert run(prog, cases).passed
  res = run(prog, [{"input": "1 2\n", "output": "4\n"}])
  assert res.status == "failed" and "wrong output" in res.message
  # Exiting after printing is normal for such programs; the output decides.
  assert run("import sys\nprint(int(input()) * 2)\nsys.exit(0)\n",
             [{"input": "21", "output": "42"}]).passed
  assert not run("import sys\nsys.exit(0)\n", [{"input": "21", "output": "42"}]).passed


def test_installed_packages_and_exit_builtins_are_available():
  res = run("import numpy, json\nx = int(numpy.arange(4).sum())\n",
            "assert x == 6\nassert callable(exit) and callable(quit)", memory_mb=512,
            timeout_s=60.0)  # numpy's import on a loaded machine is not a timeout
  assert res.passed, res


def test_a_fork_cannot_report_for_the_original():
  # The fork runs the (passing) tests to the end, but only the original
  # process may report, and it left before the tests.
  res = run("import os\nif os.fork():\n    os.wait()\n    os._exit(0)\n", "assert True")
  assert not res.passed and res.status == "error", res


def test_stdin_is_closed():
  res = run("x = input()", "")
  assert res.status == "error" and "EOFError" in res.message


# ------------------------------------------------------------------ hostile

def test_infinite_loop_times_out():
  res = run("while True:\n    pass\n", "assert True")
  assert (res.passed, res.status) == (False, "timeout")
  assert_still_works()


def test_sleeping_program_times_out_on_wall_clock():
  # It uses no CPU: only the wall-clock limit can end it before its sleep does (after
  # which its test would pass).
  res = run("import time\ntime.sleep(30)\n", "assert True")
  assert res.status == "timeout"


@pytest.mark.parametrize("program", [
    "x = bytearray(10 ** 10)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n",
])
def test_memory_bomb(program):
  res = run(program, "assert True", memory_mb=128)
  assert (res.passed, res.status) == (False, "memory"), res
  assert_still_works()


def test_fork_bomb_is_contained():
  res = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """, "assert True")
  assert not res.passed and res.status == "timeout"
  time.sleep(0.1)
  assert sandbox_pids() == []
  assert_still_works()


@isolated("pid")
def test_setsid_orphan_dies_with_the_run():
  sleep = shutil.which("sleep")
  marker = "987.654321"
  res = run(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv({sleep!r}, ["sleep", {marker!r}])
            os._exit(0)
        time.sleep(0.3)
        """, "assert True")
  assert res.passed, res  # the program itself is fine; its orphan must not live on
  time.sleep(0.1)
  for name in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        assert marker.encode() not in f.read(), "an escaped orphan survived"
    except FileNotFoundError:
      pass


@isolated("mount", "uid")
def test_no_writes_outside_the_sandbox(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  targets = [os.path.join(repo, "sandbox_evil.txt"), "/etc/sandbox_evil",
             str(tmp_path / "evil.txt"), "/var/tmp/sandbox_evil", "/dev/shm/sandbox_evil",
             os.path.expanduser("~/sandbox_evil")]
  res = run(f"""
        import os
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
            except OSError as e:
                print("denied", path, type(e).__name__)
        with open("scratch.txt", "w") as f:  # its own directory is writable
            f.write("ok")
        print("CWD", os.getcwd())
        """, "assert open('scratch.txt').read() == 'ok'")
  assert res.passed, res
  for path in targets:
    assert not os.path.exists(path), path
  cwd = res.stdout.split("CWD ")[1].strip()
  assert not os.path.exists(cwd), "the working directory must be deleted afterwards"


def test_file_size_limit():
  res = run("""
        with open("big.bin", "wb") as f:
            f.write(b"x" * (8 << 20))
        """, "assert True", memory_mb=256, file_mb=1)
  assert res.status == "error" and "File too large" in res.message, res


def test_environment_secrets_do_not_leak(monkeypatch):
  secret = "grpojax-test-secret-7f3a9c"
  monkeypatch.setenv("GRPOJAX_TEST_SECRET", secret)
  res = run(f"""
        import os
        print(dict(os.environ))
        for path in ["/proc/self/environ", "/proc/1/environ", "/proc/{os.getpid()}/environ"]:
            try:
                print(open(path, "rb").read())
            except OSError as e:
                print("denied", path)
        """, "assert True")
  assert res.passed, res
  assert "environ" in res.stdout or "denied" in res.stdout
  assert secret not in res.stdout + res.stderr + res.message


@pytest.mark.parametrize("layer", ["socket module", "fresh interpreter"])
def test_no_network_even_to_loopback(layer):
  if layer == "fresh interpreter" and "net" not in sandbox_isolation():
    pytest.skip("a fresh interpreter bypasses the in-process layer: needs a net namespace")
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.3)
  port = server.getsockname()[1]
  connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=0.5)"
  program = connect if layer == "socket module" else (
      f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {connect!r}], check=True)")
  try:
    res = run(program, "assert True")
    assert not res.passed and res.status == "error", res
    with pytest.raises(socket.timeout):
      server.accept()  # nobody reached the server
  finally:
    server.close()
  assert_still_works()


@pytest.mark.parametrize("program", [
    "import sys\nsys.exit(0)",
    "raise SystemExit",
    "exit()",
    "import os\nos._exit(0)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "import atexit, os\natexit.register(lambda: print('PASSED'))\nos._exit(0)",
    # A fork runs the tests while the original leaves early: still no pass.
    "import os\nif os.fork():\n    os.wait()\n    os._exit(0)\n",
])
def test_early_exits_never_pass(program):
  # The hack: leave with status 0 before the failing tests run. (Signalling
  # itself may be ignored, as by PID 1 of a namespace; then the tests fail.)
  res = run(program, "assert False")
  assert not res.passed and res.status in ("error", "failed"), res
  if "kill" not in program:
    assert res.status == "error" and "before the tests" in res.message, res
  assert_still_works()


@pytest.mark.parametrize("kill", [
    "os.kill(os.getppid(), signal.SIGKILL)",
    "os.kill(0, signal.SIGKILL)",
    pytest.param("os.kill(-1, signal.SIGKILL)", marks=isolated("pid", "uid")),
])
def test_killing_the_parent(kill):
  # The tests fail on purpose: only a forged verdict could turn this into a pass.
  res = run(f"import os, signal\n{kill}\n", "assert False")
  assert not res.passed
  assert_still_works()


def test_huge_output_is_capped():
  res = run("""
        import sys
        block = "x" * (1 << 20)
        for _ in range(200):
            sys.stdout.write(block)
        """, "assert True", timeout_s=10.0)
  assert (res.passed, res.status) == (False, "output_limit")
  assert len(res.stdout) <= 4096
  assert_still_works()


def test_segfault_is_an_error():
  res = run("import ctypes\nctypes.string_at(0)", "assert True")
  assert (res.passed, res.status) == (False, "error") and "SIGSEGV" in res.message


@isolated("pid", "uid")
def test_the_trainer_cannot_be_signalled():
  # Were this to work, the test session itself would die.
  res = run(f"""
        import os, signal
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill({os.getpid()}, sig)
                print("signalled")
            except OSError as e:
                print("refused", type(e).__name__)
        """, "assert True")
  assert res.passed and "signalled" not in res.stdout, res
  assert_still_works()


# ------------------------------------------------------------------ reward

def test_code_reward_and_extraction():
  text = "Here:\n```python\ndef inc(x):\n    return x + 1\n```\nDone."
  assert extract_code(text) == "def inc(x):\n    return x + 1\n"
  assert extract_code("def f(): pass") == "def f(): pass"
  reward = CodeReward(timeout_s=LIMIT)
  got = reward(prompts=["p"] * 3,
               completions=[text, "```python\ndef inc(x):\n    return x\n```", text],
               tests=["assert inc(1) == 2", "assert inc(1) == 2", None])
  assert got == [1.0, 0.0, None]
  assert reward.__name__ == "code_reward"


# ------------------------------------------------------------------ fences

ADD = "def add(a, b):\n    return a + b\n"
BASH_THEN_PYTHON = ("Run it with:\n```bash\npython sol.py\n```\nHere is the code:\n"
                    f"```python\n{ADD}```\n")


@pytest.mark.parametrize("text", [
    BASH_THEN_PYTHON,
    f"Output:\n```text\n3\n```\nCode:\n```python\n{ADD}```",
    f'```json\n{{"a": 1}}\n```\n```python\n{ADD}```\n```output\n3\n```\n',
])
def test_the_python_block_not_its_neighbours(text):
  assert extract_code(text) == ADD


@pytest.mark.parametrize("text", [
    f"~~~python\n{ADD}~~~\n",
    f"```py\n{ADD}```",
    f"```Python3\n{ADD}```",
    f"```py3\n{ADD}```",
    f"```python {{.numberLines}}\n{ADD}```",
    f"```python{{.class}}\n{ADD}```",
    f"``` PY title=sol.py\n{ADD}```",
    f"```python\n{ADD.rstrip()}\n```",  # at both ends of the text, no final newline
    f"Here:\n```python\n{ADD}",  # unclosed: runs to the end (cut off at max length)
    f"```python\n{ADD.rstrip()}",
    # In a list item: the opening fence's indent comes off its content.
    "1. Write it:\n   ```python\n   def add(a, b):\n       return a + b\n   ```\n2. Done.",
    BASH_THEN_PYTHON.replace("\n", "\r\n"),
    BASH_THEN_PYTHON.replace("\n", "\r"),
])
def test_fence_forms(text):
  assert extract_code(text) == ADD


@pytest.mark.parametrize("text, want", [
    # Only a line of the same character, at least as long, with nothing but
    # whitespace after it, closes a fence.
    (f"````python\n{ADD}```\n````", ADD + "```\n"),
    (f"~~~python\n{ADD}```\n~~~", ADD + "```\n"),
    (f"```python\n{ADD}``` not a close\n~~~\n```` \t\n", ADD + "``` not a close\n~~~\n"),
    # Content keeps indent beyond the fence's, and lines that have less.
    (" ```python\n  x = 1\ny = 2\n ```", " x = 1\ny = 2\n"),
])
def test_fence_closing_and_indent(text, want):
  assert extract_code(text) == want



def test_fences_match_a_commonmark_parser():
  """The blocks agree with markdown-it-py's (CommonMark; installed with flax via rich)
  on random documents of fence-like lines (no lists or quotes: top-level fences)."""
  markdown_it = pytest.importorskip("markdown_it")
  from grpojax.rewards.code import _fenced_blocks
  md, rng = markdown_it.MarkdownIt("commonmark"), random.Random(0)

  def line():
    if rng.random() < 0.35:
      return (" " * rng.randint(0, 4) + rng.choice("`~") * rng.randint(3, 5)
              + rng.choice(["", "python", " py ", "bash", "python {.x}", "a`b"])
              + rng.choice(["", " ", "\t"]))
    return rng.choice(["x = 1", "  y", "     z", "", "   ", "a ``` b", "```` x", "# h", "---"])

  for _ in range(2000):
    text = rng.choice(["\n", "\r\n", "\r"]).join(line() for _ in range(rng.randint(1, 10)))
    # Without a final newline, its last line keeps none; ours gets one, as code wants.
    ended = text if text.endswith(("\n", "\r")) else text + "\n"
    want = [(t.info.strip(), t.content) for t in md.parse(ended) if t.type == "fence"]
    assert _fenced_blocks(text) == want, repr(text)

def test_python_in_prose_is_not_a_fence():
  # A fence starts a line; the word python elsewhere tags nothing.
  text = f"Wrap it in ```python fences, or write python:\n```\n{ADD}```\nRun python sol.py."
  assert extract_code(text) == ADD
  # Four spaces make an indented code block, and ```x``` is inline code.
  indented = "    ```python\n    x = 1\n    ```\n"
  assert extract_code(indented) == indented
  assert extract_code("```python``` is the tag.\nx = 1") == "```python``` is the tag.\nx = 1"


def test_untagged_blocks_and_no_python():
  assert extract_code(f"```\n{ADD}```\n```bash\npython sol.py\n```") == ADD
  # A tagged block wins over an untagged one, even an earlier one.
  assert extract_code(f"```python\n{ADD}```\n```\n3\n```") == ADD
  # Fences, but none of Python: nothing to run (the prose would not be code).
  assert extract_code("Run:\n```bash\npython sol.py\n```\n") == ""
  assert extract_code("~~~json\n{}\n~~~") == ""
  # No fence at all: the text is the program.
  assert extract_code(ADD) == ADD


def test_which_block():
  text = "```python\nx = 1\n```\n```bash\nls\n```\n```py\ny = 2\n```"
  assert extract_code(text) == extract_code(text, "last") == "y = 2\n"
  assert extract_code(text, block="first") == "x = 1\n"
  assert extract_code(text, block="all") == "x = 1\ny = 2\n"
  assert extract_code("```\nx = 1\n```\n```\ny = 2\n```", block="all") == "x = 1\ny = 2\n"
  for bad in ("middle", "Last", None):
    with pytest.raises(ValueError, match="block=.*known: 'last', 'first', 'all'"):
      extract_code(text, block=bad)
    with pytest.raises(ValueError, match="known: 'last', 'first', 'all'"):
      CodeReward(block=bad)


def test_code_reward_grades_the_python_block():
  assert CodeReward()(completions=[BASH_THEN_PYTHON], tests=["assert add(2, 3) == 5"]) == [1.0]
  draft = f"```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```python\n{ADD}```"
  tests = ["assert add(2, 3) == 5"] * 2
  reward = CodeReward(timeout_s=LIMIT)
  assert reward(completions=[draft, "```bash\nls\n```"], tests=tests) == [1.0, 0.0]
  assert CodeReward(timeout_s=LIMIT, block="first")(completions=[draft], tests=tests[:1]) == [0.0]
