"""The sandbox's third round: socket families, evidence that tests ran, the names
the tests resolve, and the test styles of HumanEval, MBPP, APPS and LeetCode.

Each cheat is a program that does not solve its task and must score 0; each
control is a correct program in a common test style that must pass.
"""

import errno
import socket
import textwrap

import pytest

from grpojax.rewards.code import CodeReward, run_tests, sandbox_isolation
from grpojax.sandbox import judging

D = textwrap.dedent
ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"


def run(program, tests, **kw):
  kw.setdefault("timeout_s", 2.0)
  kw.setdefault("memory_mb", 512)
  return run_tests(D(program), D(tests) if isinstance(tests, str) else tests, **kw)


def passes(program, tests, **kw):
  # A control passes in well under a second on an idle machine; its limit is generous so
  # that a loaded one (sympy's import under a busy CI) cannot turn it into a timeout.
  kw.setdefault("timeout_s", 60.0)
  res = run(program, tests, **kw)
  assert res.passed, res
  return res


def fails(program, tests, *, because=None, **kw):
  res = run(program, tests, **kw)
  assert not res.passed, res
  assert "SyntaxError" not in res.message and "IndentationError" not in res.message, res
  if because is not None:
    assert because in res.message, res
  return res


# ------------------------------------------------------------------ socket families

def _families():
  return sorted({int(v) for k, v in vars(socket).items() if k.startswith("AF_") and v} | set(range(46)))


def _creatable_here(family):
  for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):
    try:
      socket.socket(family, kind).close()
      return True
    except OSError:
      pass
  return False


SOCKET_PROBE = """
import errno, socket
def refused(families):
    out = {}
    for family in families:
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):
            try:
                socket.socket(family, kind).close()
                out[family] = 'created'
                break
            except OSError as e:
                out[family] = errno.errorcode.get(e.errno, str(e.errno))
    return out
def pair():
    a, b = socket.socketpair()
    a.sendall(b'ping')
    return b.recv(4)
def raw_pair(family):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fds = (ctypes.c_int * 2)()
    rc = libc.socketpair(family, socket.SOCK_STREAM, 0, fds)
    return rc, ctypes.get_errno()
"""


def test_every_socket_family_but_unix_is_refused_inside():
  families = _families()
  # Families this host can open: without the filter the sandbox could open them too
  # (AF_INET on its own loopback, AF_NETLINK, AF_PACKET, AF_VSOCK where the kernel has
  # it), so the test can fail.
  open_here = [f for f in families if f != socket.AF_UNIX and _creatable_here(f)]
  assert socket.AF_INET in open_here and socket.AF_NETLINK in open_here, open_here
  res = run(SOCKET_PROBE, f"""
        got = refused({families!r})
        assert got[{socket.AF_UNIX}] == 'created', got
        opened = {{f: e for f, e in got.items() if f != {socket.AF_UNIX} and e != 'EAFNOSUPPORT'}}
        assert not opened, opened
        assert pair() == b'ping'
        assert raw_pair({socket.AF_INET}) == (-1, {errno.EAFNOSUPPORT})
        assert raw_pair({socket.AF_VSOCK})[0] == -1
        """)
  assert res.passed, res


def test_vsock_is_refused_even_where_the_host_has_it():
  if not _creatable_here(socket.AF_VSOCK):
    pytest.skip("this kernel has no AF_VSOCK: the family-wide test above covers the filter")
  passes(SOCKET_PROBE, f"assert refused([{socket.AF_VSOCK}]) == {{{socket.AF_VSOCK}: 'EAFNOSUPPORT'}}")


def test_the_filter_reads_the_family_argument():
  # The BPF program: socket and socketpair jump to a check of args[0] (AF_UNIX only).
  from grpojax.sandbox import _sandbox_jail as jail
  for arch, (sock, pair) in jail._SOCKETS.items():
    prog = jail._seccomp_filter(arch)
    at = next(i for i, ins in enumerate(prog) if ins[3] == sock and ins[0] == 0x15)
    assert prog[at + 1][3] == pair and prog[at + 2] == (0x20, 0, 0, 16)
    assert prog[at + 3] == (0x15, 1, 0, jail.AF_UNIX)
    assert prog[at + 4][3] == 0x00050000 | errno.EAFNOSUPPORT


# ------------------------------------------------------------------ evidence that tests ran

@pytest.mark.parametrize("tests", [
    "", [], "   \n# only a comment\n", "pass\n", "print(add(1, 2))\n",
    "def helper():\n    assert add(1, 2) == 3\n",  # nothing calls it
    "import sys\nsys.exit(0)\nassert add(1, 2) == 3\n",
    "if False:\n    assert add(1, 2) == 3\n",
])
def test_tests_that_check_nothing_score_zero(tests):
  res = fails(ADD, tests, because="no test ran")
  assert res.status == "failed"


def test_main_guarded_tests_run():
  tests = "if __name__ == '__main__':\n    assert add(2, 3) == 5\n"
  passes(ADD, tests)
  fails(WRONG_ADD, tests, because="AssertionError")


HUMANEVAL = """
METADATA = {'author': 'jt', 'dataset': 'test'}


def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0
"""


def test_humaneval_check_is_called_on_the_entry_point():
  passes(ADD, HUMANEVAL, entry_point="add")
  fails(WRONG_ADD, HUMANEVAL, entry_point="add", because="AssertionError")
  # Without the entry point: the program's one function.
  passes(ADD, HUMANEVAL)
  fails(WRONG_ADD, HUMANEVAL)
  # Two functions and no entry point: nothing to call check on, said so.
  fails(ADD + "def other(a, b):\n    return a + b\n", HUMANEVAL, because="entry_point")
  # The entry point is the program's, never a same-named helper of another kind.
  fails(WRONG_ADD + "def helper(a, b):\n    return a + b\n", HUMANEVAL, entry_point="add")


def test_a_check_the_tests_call_themselves_runs_once():
  res = passes(ADD, HUMANEVAL + "\ncheck(add)\n")
  assert res.message.startswith("2 checks"), res


def test_pytest_style_functions_run():
  tests = "def test_small():\n    assert add(1, 2) == 3\n\ndef test_negative():\n    assert add(-2, -3) == -5\n"
  res = passes(ADD, tests)
  assert res.message.startswith("2 checks"), res
  fails("def add(a, b):\n    return abs(a) + abs(b)\n", tests, because="test_negative")
  # KodCode's form: the tests import the solution module.
  passes(ADD, "from solution import add\n\ndef test_add():\n    assert add(2, 2) == 4\n")


UNITTEST = """
import unittest

class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
"""


def test_unittest_cases_run_with_or_without_main():
  passes(ADD, UNITTEST)
  fails(WRONG_ADD, UNITTEST, because="5")
  with_main = UNITTEST + "\nif __name__ == '__main__':\n    unittest.main()\n"
  passes(ADD, with_main)
  fails(WRONG_ADD, with_main, because="SystemExit")


def test_a_test_without_assertions_passes_nothing():
  fails(ADD, "import unittest\nclass T(unittest.TestCase):\n    def test_nothing(self):\n"
        "        add(1, 2)\n", because="no test ran")


def test_the_program_cannot_count_checks_for_the_tests():
  # Everything a program can reach is its own interpreter: the counter is not there.
  fails(D("""
      import gc, sys
      for o in gc.get_objects():
          if callable(o) and getattr(o, '__name__', '') == '__checked__':
              for _ in range(10):
                  o()
      builtins = __builtins__ if isinstance(__builtins__, dict) else vars(__builtins__)
      builtins['__checked__'] = lambda *a: None
      def add(a, b):
          return a + b
      """), "print(add(1, 2))\n", because="no test ran")


# ------------------------------------------------------------------ the names tests resolve

FULL_NAME_FAKES = {
    "numpy": ("class numpy:\n    allclose = array_equal = staticmethod(lambda *a, **k: True)\n",
              "assert numpy.allclose(add(1, 2), 4)"),
    "pandas": ("class pandas:\n    class testing:\n"
               "        assert_series_equal = staticmethod(lambda *a, **k: None)\n"
               "    Series = staticmethod(lambda x: x)\n",
               "pandas.testing.assert_series_equal(pandas.Series([add(1, 2)]), pandas.Series([4]))"),
    "sympy": ("class sympy:\n    simplify = staticmethod(lambda x: 0)\n",
              "assert sympy.simplify(add(1, 2) - 4) == 0"),
    "math": ("class math:\n    isclose = staticmethod(lambda *a, **k: True)\n",
             "assert math.isclose(add(1, 2), 4)"),
    "operator": ("import types\noperator = types.SimpleNamespace(eq=lambda a, b: True)\n",
                 "assert operator.eq(add(1, 2), 4)"),
    "json": ("class json:\n    dumps = staticmethod(lambda x: '4')\n",
             "assert json.dumps(add(1, 2)) == '4'"),
    "np alias": ("class np:\n    allclose = staticmethod(lambda *a, **k: True)\n",
                 "assert np.allclose(add(1, 2), 4)"),
    "isclose helper": ("def isclose(*a, **k):\n    return True\n", "assert isclose(add(1, 2), 4)"),
    "sqrt helper": ("def sqrt(x):\n    return 2\n", "assert sqrt(add(1, 2)) == 2"),
    "from math import isclose, then redefined": (
        "from math import isclose\ndef isclose(*a, **k):\n    return True\n",
        "assert isclose(add(1, 2), 4)"),
    "builtins all/abs/isinstance": ("all = lambda *a: True\nabs = lambda x: 0\n"
                                    "isinstance = lambda *a: True\n",
                                    "assert all([add(1, 2) == 4])\nassert abs(add(1, 2) - 4) < 1\n"
                                    "assert not isinstance(add(1, 2), str)"),
}


@pytest.mark.parametrize("name", sorted(FULL_NAME_FAKES))
def test_names_the_tests_use_as_helpers_are_the_real_ones(name):
  fake, tests = FULL_NAME_FAKES[name]
  fails(fake + ADD, tests)  # add is right, but the tests' expectations are not met
  # The same tests pass a program that makes them true honestly.
  passes("def add(a, b):\n    return 4\n", tests)


def test_an_alias_follows_the_programs_import():
  # The usual table says nothing of `sp`: the program's own import decides.
  passes("import sympy as sp\ndef half():\n    return 0.5\n",
         "assert sp.__name__ == 'sympy' and sp.nsimplify(half()) == sp.Rational(1, 2)")
  passes("import numpy as sp\ndef f():\n    return [1, 2]\n",
         "assert sp.__name__ == 'numpy' and sp.array_equal(f(), [1, 2])")
  passes("import os.path as p\ndef f():\n    return 'a/b'\n", "assert p.join('a', 'b') == f()")


@pytest.mark.parametrize("name, wrong, right, tests", [
    ("max", "def max(a, b):\n    return a\n", "def max(a, b):\n    return a if a > b else b\n",
     "assert max(1, 2) == 2\nassert max(5, 3) == 5"),
    ("sorted", "def sorted(xs):\n    return list(xs)\n",
     "def sorted(xs):\n    out = list(xs)\n    out.sort()\n    return out\n",
     "assert sorted([3, 1, 2]) == [1, 2, 3]"),
    ("sum", "def sum(xs):\n    return 0\n", "def sum(xs):\n    t = 0\n    for x in xs:\n        t += x\n"
     "    return t\n", "assert sum([1, 2, 3]) == 6"),
    ("gcd", "def gcd(a, b):\n    return 1\n",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n", "assert gcd(12, 18) == 6"),
])
def test_a_task_named_like_a_builtin_tests_the_programs_function(name, wrong, right, tests):
  for entry in (name, None):
    fails(wrong, tests, entry_point=entry)
    passes(right, tests, entry_point=entry)


def test_only_the_entry_point_is_taken_from_the_program_among_builtin_names():
  # The task is `max`; the program also rebinds abs, which the tests use as a helper.
  tests = "assert abs(max(1, 2) - 2) < 1\nassert abs(max(7, 3) - 7) < 1"
  fails("def max(a, b):\n    return a\nabs = lambda x: 0\n", tests, entry_point="max")
  passes("def max(a, b):\n    return a if a > b else b\nabs = lambda x: 0\n", tests,
         entry_point="max")


def test_setup_helpers_are_the_tasks_own():
  # HumanEval/32's shape: the tests call poly, defined by the task (setup), never the program's.
  setup = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
  tests = "def check(candidate):\n    xs = [-6, 11, -6, 1]\n    assert abs(poly(xs, candidate(xs))) < 1e-6\n"
  right = "def find_zero(xs):\n    return 1.0\n"  # (x-1)(x-2)(x-3)
  passes(right, tests, setup=setup, entry_point="find_zero")
  fails("poly = lambda *a: 0\ndef find_zero(xs):\n    return 7.5\n", tests, setup=setup,
        entry_point="find_zero")
  # The program sees the setup too (its helpers, its imports).
  passes("def find_zero(xs):\n    return 1.0 if poly(xs, 1.0) == 0 else None\n", tests,
         setup=setup, entry_point="find_zero")


def test_bad_entry_points_are_refused_without_a_run():
  res = run(ADD, HUMANEVAL, entry_point="add(1, 2)")
  assert res.status == "error" and "entry_point" in res.message, res
  res = run(ADD, "assert add(1, 2) == 3 +", entry_point="add")
  assert res.status == "error" and "compile" in res.message, res


# ------------------------------------------------------------------ test styles

def test_standard_library_values_cross_with_their_types():
  passes("""
      from collections import Counter, OrderedDict, defaultdict, deque
      from fractions import Fraction
      from decimal import Decimal
      def echo(x):
          return x
      def make(kind):
          return {'counter': Counter('aab'), 'ordered': OrderedDict(b=1, a=2),
                  'default': defaultdict(list, {'k': [1]}), 'deque': deque([1, 2], maxlen=3),
                  'fraction': Fraction(3, 4), 'decimal': Decimal('0.1'),
                  'range': range(2, 9, 3), 'bytearray': bytearray(b'ab')}[kind]
      def total(r):
          return len(r), r[-1], 10 ** 11 in r, sum(r[:100])
      """, """
      from collections import Counter, OrderedDict, defaultdict, deque
      from fractions import Fraction
      from decimal import Decimal
      assert make('counter') == Counter(a=2, b=1) and type(make('counter')) is Counter
      assert list(make('ordered').items()) == [('b', 1), ('a', 2)]
      d = make('default')
      assert type(d) is defaultdict and d['missing'] == [] and d['k'] == [1]
      q = make('deque')
      assert type(q) is deque and q.maxlen == 3 and list(q) == [1, 2]
      assert make('fraction') == Fraction(3, 4) and type(make('fraction')) is Fraction
      assert make('decimal') == Decimal('0.1') and type(make('decimal')) is Decimal
      assert make('range') == range(2, 9, 3) and type(make('range')) is range
      assert make('bytearray') == bytearray(b'ab') and type(make('bytearray')) is bytearray
      assert total(range(10 ** 12)) == (10 ** 12, 10 ** 12 - 1, True, 4950)
      for v in (Counter('xyz'), deque('ab'), OrderedDict(a=1), Fraction(1, 3), range(3)):
          assert echo(v) == v and type(echo(v)) is type(v)
      """)


def test_in_place_tasks_see_their_mutations():
  passes("""
      def move_zeroes(nums):
          k = 0
          for i, x in enumerate(nums):
              if x:
                  nums[k], k = x, k + 1
          for i in range(k, len(nums)):
              nums[i] = 0
      def rotate(m):
          n = len(m)
          for i in range(n):
              for j in range(i + 1, n):
                  m[i][j], m[j][i] = m[j][i], m[i][j]
          for row in m:
              row.reverse()
      def tally(d, s, q, b):
          d['n'] = d.get('n', 0) + 1
          s.add(9)
          q.appendleft(0)
          b.extend(b'!')
      def same(xs):
          xs.append(len(xs))
          return xs
      def both(a, b):
          a.append('x')
          return a is b
      def swap_rows(m):
          m[0], m[1] = m[1], m[0]
          m.append(m[0])
      """, """
      from collections import deque
      nums = [0, 1, 0, 3, 12]
      move_zeroes(nums)
      assert nums == [1, 3, 12, 0, 0]
      m = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
      row0 = m[0]
      rotate(m)
      assert m == [[7, 4, 1], [8, 5, 2], [9, 6, 3]] and m[0] is row0
      d, s, q, b = {}, {1}, deque([5]), bytearray(b'a')
      tally(d, s, q, b)
      assert d == {'n': 1} and s == {1, 9} and list(q) == [0, 5] and b == bytearray(b'a!')
      xs = [7]
      assert same(xs) is xs and xs == [7, 1]
      ys = []
      assert both(ys, ys) is True and ys == ['x']
      a, b2 = [1], [2]
      grid = [a, b2]
      swap_rows(grid)
      assert grid[0] is b2 and grid[1] is a and grid[2] is b2
      """)


def test_the_tests_own_objects_live_in_the_tests():
  passes("""
      def length(head):
          n = 0
          while head:
              n, head = n + 1, head.next
          return n
      def reverse(head):
          prev = None
          while head is not None:
              head.next, prev, head = prev, head, head.next
          return prev
      def depth(node):
          return 0 if node is None else 1 + max(depth(node.left), depth(node.right))
      def drain(stack):
          out = []
          while len(stack):
              out.append(stack.pop())
          stack.push('done')
          return out
      def order(items):
          return sorted(items)
      def first_even(gen):
          for x in gen:
              if x % 2 == 0:
                  return x
      def call(fn, x):
          return fn(x) * 2
      """, """
      class ListNode:
          def __init__(self, val=0, next=None):
              self.val, self.next = val, next
      class TreeNode:
          def __init__(self, val, left=None, right=None):
              self.val, self.left, self.right = val, left, right
      class Stack:
          def __init__(self, items):
              self.items = list(items)
          def push(self, x):
              self.items.append(x)
          def pop(self):
              return self.items.pop()
          def __len__(self):
              return len(self.items)
      class Box:
          def __init__(self, v):
              self.v = v
          def __lt__(self, other):
              return self.v < other.v
      head = ListNode(1, ListNode(2, ListNode(3)))
      assert length(head) == 3
      new = reverse(head)
      assert isinstance(new, ListNode) and new.val == 3 and new.next.val == 2
      assert head.next is None and new.next.next is head
      assert depth(TreeNode(1, TreeNode(2, TreeNode(3)), TreeNode(4))) == 3
      s = Stack([1, 2])
      assert drain(s) == [2, 1] and s.items == ['done']
      boxes = [Box(3), Box(1), Box(2)]
      assert [b.v for b in order(boxes)] == [1, 2, 3] and order(boxes)[0] is boxes[1]
      assert first_even(x for x in [1, 3, 4, 5]) == 4
      assert call(lambda v: v + 1, 4) == 10
      """)


def test_the_programs_classes_and_objects_through_handles():
  passes("""
      class Stack:
          def __init__(self):
              self.items = []
          def push(self, x):
              self.items.append(x)
          def __len__(self):
              return len(self.items)
      class Node:
          def __init__(self, val, next=None):
              self.val, self.next = val, next
      def make():
          return Stack()
      def build(xs):
          head = None
          for x in reversed(xs):
              head = Node(x, head)
          return head
      """, """
      s = make()
      assert isinstance(s, Stack) and not isinstance(s, int) and issubclass(Stack, Stack)
      s.push(4)
      assert s.items == [4] and len(s) == 1 and s
      def values(node):
          out = []
          while node:
              out.append(node.val)
              node = node.next
          return out
      assert values(build([1, 2, 3])) == [1, 2, 3]
      """)


def test_a_program_object_decides_no_comparison():
  for liar in ("__eq__ = lambda s, o: True", "__lt__ = __gt__ = __le__ = __ge__ = lambda s, o: True",
               "__contains__ = lambda s, x: True"):
    program = f"class Liar:\n    {liar}\n    __hash__ = object.__hash__\n" \
              "    def __iter__(self):\n        return iter([])\n" \
              "def f(x):\n    return Liar()\n"
    fails(program, "assert f(1) == [1, 2]")
    fails(program, "assert 2 <= f(1) <= 2")
    fails(program, "assert 3 in f(1)")


def test_the_tests_objects_give_the_program_no_way_in():
  # Frames, code, globals: each path from a handle of the tests' to their source is shut.
  tests = """
      SECRET = [4, 2]
      def gen():
          yield 1
      class Box:
          def __init__(self):
              self.v = 1
          def get(self):
              return self.v
      assert probe(gen(), Box(), lambda v: v) == ['refused'] * 6
      """
  passes("""
      def probe(g, box, fn):
          out = []
          for get in (lambda: g.gi_frame.f_globals['SECRET'], lambda: g.gi_code.co_consts,
                      lambda: fn.__globals__['SECRET'], lambda: box._Box__x,
                      lambda: box.get.__func__.__globals__, lambda: box.__dict__):
              try:
                  get()
                  out.append('leaked')
              except Exception:
                  out.append('refused')
          return out
      """, tests)


def test_a_raw_request_for_a_private_name_is_refused_by_the_tests():
  # The program writes its own messages on the channel, bypassing Remote's checks.
  passes("""
      import gc
      def probe(fn):
          peer = next(o for o in gc.get_objects() if type(o).__name__ == 'Peer')
          handle = next(r for r in peer.remotes.values())
          out = []
          for name in ('__globals__', '__code__', '_hidden'):
              try:
                  peer.request('get', handle._id, name)
                  out.append('leaked')
              except Exception as e:
                  out.append(type(e).__name__)
          return out
      """, "SECRET = 1\nassert probe(lambda v: v) == ['AttributeError'] * 3")


LEETCODE_SETUP = """
from typing import *
from collections import *

class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next

def list_node(values: list):
    if not values:
        return None
    head = ListNode(values[0])
    p = head
    for val in values[1:]:
        p.next = ListNode(val)
        p = p.next
    return head

def is_same_list(p1, p2):
    if p1 is None and p2 is None:
        return True
    if not p1 or not p2:
        return False
    return p1.val == p2.val and is_same_list(p1.next, p2.next)
"""
LEETCODE_TESTS = """
def check(candidate):
    assert is_same_list(candidate(head = list_node([1, 2, 3, 4, 5]), n = 2), list_node([1, 2, 3, 5]))
    assert is_same_list(candidate(head = list_node([1]), n = 1), list_node([]))
"""


def test_leetcode_format():
  right = """
      class Solution:
          def removeNthFromEnd(self, head: Optional[ListNode], n: int) -> Optional[ListNode]:
              dummy = ListNode(0, head)
              fast = slow = dummy
              for _ in range(n):
                  fast = fast.next
              while fast.next:
                  fast, slow = fast.next, slow.next
              slow.next = slow.next.next
              return dummy.next
      """
  passes(right, LEETCODE_TESTS, setup=LEETCODE_SETUP, entry_point="Solution().removeNthFromEnd")
  wrong = right.replace("slow.next = slow.next.next", "pass")
  fails(wrong, LEETCODE_TESTS, setup=LEETCODE_SETUP, entry_point="Solution().removeNthFromEnd")


def test_mbpp_with_its_setup_code():
  setup = "class Pair(object):\n    def __init__(self, a, b):\n        self.a = a\n        self.b = b\n"
  tests = ["assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3"]
  right = """
      def max_chain_length(arr, n):
          mcl = [1] * n
          for i in range(1, n):
              for j in range(i):
                  if arr[i].a > arr[j].b and mcl[i] < mcl[j] + 1:
                      mcl[i] = mcl[j] + 1
          return max(mcl)
      """
  passes(right, tests, setup=setup)
  fails(right.replace("return max(mcl)", "return n"), tests, setup=setup)


def test_apps_call_based_and_stdin_cases():
  spec = {"fn_name": "count", "inputs": [[[1, 2, 2]], [[]], [[5]]], "outputs": [[3], 0, [1]]}
  passes("def count(xs):\n    return len(xs)\n", spec)
  fails("def count(xs):\n    return 1\n", spec, because="case 0: got 1")
  # LeetCode-style APPS/TACO problems: the method of Solution.
  passes("class Solution:\n    def count(self, xs):\n        return len(xs)\n", spec)
  # A tuple result compares as a list.
  passes("def pair(x):\n    return (x, x)\n",
         '{"fn_name": "pair", "inputs": [[1]], "outputs": [[1, 1]]}')
  stdin = '{"inputs": ["1 2\\n", "5 5\\n"], "outputs": ["3\\n", "10\\n"]}'
  passes("a, b = map(int, input().split())\nprint(a + b)\n", stdin)
  fails("print(3)\n", stdin)
  fails("def count(xs):\n    return 0\n", {"fn_name": "count", "inputs": [], "outputs": []},
        because="no test ran")


def test_code_reward_reads_entry_points_and_setup_from_columns():
  reward = CodeReward(timeout_s=2.0, setup_column="setup")
  completions = [f"```python\n{code}```" for code in
                 ("def max(a, b):\n    return a\n", "def max(a, b):\n    return a if a > b else b\n",
                  ADD, WRONG_ADD)]
  got = reward(prompts=["p"] * 4, completions=completions,
               tests=["assert max(1, 2) == 2"] * 2 + [HUMANEVAL] * 2,
               entry_point=["max", "max", "add", "add"], setup=[None, None, "X = 1", "X = 1"])
  assert got == [0.0, 1.0, 1.0, 0.0]


def test_code_reward_takes_the_entry_point_from_a_reference_solution():
  # MBPP's rows carry the reference solution, which names the function the tests call.
  reward = CodeReward(timeout_s=2.0, tests_column="test_list", reference_column="code")
  tests = ["assert isclose(area(1), 3.14159, rel_tol=1e-4)"]
  cheat = "```python\ndef isclose(*a, **k):\n    return True\ndef area(r):\n    return 0\n```"
  honest = "```python\nfrom math import isclose, pi\ndef area(r):\n    return pi * r * r\n```"
  got = reward(prompts=["p"] * 2, completions=[cheat, honest], test_list=[tests] * 2,
               code=["import math\ndef area(r):\n    return math.pi * r * r\n"] * 2)
  assert got == [0.0, 1.0]


def test_entry_points_parse():
  assert [name for name, _ in judging.parse_entry_points("Solution().twoSum")] == ["Solution"]
  assert [name for name, _ in judging.parse_entry_points(["a", "b.c"])] == ["a", "b"]
  for bad in ("f(1)", "a + b", "lambda: 0", "x[0]"):
    with pytest.raises(judging.TestsError):
      judging.parse_entry_points(bad)


def test_isolation_layers_are_unchanged():
  assert "seccomp" in sandbox_isolation()
