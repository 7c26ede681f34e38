"""The program/test boundary of the sandbox: plain data and remote handles.

Loaded by `_sandbox.py` only (standard library only, no grpojax). The
program runs in one interpreter and the tests in another; the tests see the
program's top-level names as proxies. A call sends its arguments as plain
data, the program's interpreter runs its real function, and the result comes
back as plain data: None, bool, int, float, complex, str, bytes and list,
tuple, dict, set, frozenset of those, tagged so that types stay distinct.
Anything else comes back as an opaque `Remote` handle: it can be called,
iterated, indexed, measured (len), printed and its attributes read, each a
round trip, but it has no truth value and equals only itself. So `==`,
`assert` and every comparison run in the tests' interpreter on values it
built itself, and no object of the program's making can decide them.

Limits that follow, each chosen so that no program can judge its own tests:
- arguments are copies: in-place mutation of a test's list is not seen by
  the test; the program's plain globals are a snapshot taken after it ran;
- objects of the program's classes are handles: usable (methods, attributes,
  len, indexing, iteration, str), but `Point(1, 2) == Point(1, 2)` is False
  and `assert obj` raises; tests compare their attributes or str() instead;
- functions a test passes to the program may only be called, never
  inspected (no attribute of the tests' side is reachable);
- the tests call the program's own objects, always: `from math import
  isclose` in the program gives the tests a handle to that function, never
  a re-import chosen by `__module__`, `__qualname__` or `__name__`, which
  the program can set;
- a name the tests use as `name.attr` that is a stdlib module name, a
  common alias (np, pd, ...) or a module the program imported is the real
  module *called* `name` (or the alias's), imported on the tests' side;
  names that shadow builtins (`all`, `abs`, `isinstance`, ...) are not
  passed to the tests at all.
"""

import _json
import os

_MAX_MESSAGE = 64 << 20  # bytes; a bigger message is refused, not read
_MAX_DEPTH = 200  # nesting of a value; deeper is refused as not plain


class ProtocolError(Exception):
  """The other side sent something that is not a well-formed message."""


class ProgramGone(BaseException):
  """The program's interpreter ended or broke the protocol mid-call.

  A BaseException, so a test's `except Exception` cannot swallow it.
  """


class ProgramError(Exception):
  """The program raised an exception that has no built-in counterpart."""


# ------------------------------------------------------------------ framing

class _Ctx:  # what `_json.make_scanner` reads; only lists and strings are used
  strict = True
  object_hook = object_pairs_hook = parse_constant = None
  parse_float, parse_int = float, int


_scan = _json.make_scanner(_Ctx())
_quote = _json.encode_basestring_ascii


def send(fd, message):
  data = _dump(message).encode("ascii")
  data = len(data).to_bytes(4, "big") + data
  while data:
    data = data[os.write(fd, data):]


def _read_exactly(fd, n):
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def recv(fd):
  """One message, as JSON lists and strings (EOFError at the end)."""
  n = int.from_bytes(_read_exactly(fd, 4), "big")
  if n > _MAX_MESSAGE:
    raise ProtocolError(f"message of {n} bytes")
  text = _read_exactly(fd, n).decode("ascii")
  try:
    obj, end = _scan(text, 0)
  except (ValueError, StopIteration, RecursionError) as e:
    raise ProtocolError(f"malformed message: {e!r}") from None
  if end != len(text) or type(obj) is not list:
    raise ProtocolError("malformed message")
  return obj


def _dump(obj):
  """JSON text of nested lists of str (all that messages are made of)."""
  if type(obj) is str:
    return _quote(obj)
  return "[" + ",".join(_dump(x) for x in obj) + "]"


# ----------------------------------------------------------- plain values

_SCALARS = {type(None): "N", bool: "B", int: "i", float: "f", complex: "c", str: "s", bytes: "y"}
_BOXES = {list: "l", tuple: "t", set: "S", frozenset: "z", dict: "d"}


def encode(x, export, depth=0):
  """Tagged lists of str; `export(x)` gives the tag of a non-plain value."""
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply to cross the sandbox boundary")
  t = type(x)  # exact types: a subclass could carry a lying __eq__
  if t is type(None):
    return ["N"]
  if t is bool:
    return ["B", "1" if x else "0"]
  if t is int:
    return ["i", format(x, "x")]  # hex: no int-to-str digit limit
  if t is float:
    return ["f", x.hex()]
  if t is complex:
    return ["c", x.real.hex(), x.imag.hex()]
  if t is str:
    return ["s", x]
  if t is bytes:
    return ["y", x.hex()]
  if t is dict:
    return ["d", [[encode(k, export, depth + 1), encode(v, export, depth + 1)]
                  for k, v in x.items()]]
  if t in _BOXES:
    return [_BOXES[t], [encode(v, export, depth + 1) for v in x]]
  return export(x)


def decode(j, remote, depth=0):
  """Inverse of `encode`; `remote(tag, id)` resolves handle tags."""
  if depth > _MAX_DEPTH:
    raise ProtocolError("value nested too deeply")
  try:
    tag = j[0]
    if tag == "N":
      return None
    if tag == "B":
      return j[1] == "1"
    if tag == "i":
      return int(j[1], 16)
    if tag == "f":
      return float.fromhex(j[1])
    if tag == "c":
      return complex(float.fromhex(j[1]), float.fromhex(j[2]))
    if tag == "s":
      if type(j[1]) is not str:
        raise ProtocolError("bad str")
      return j[1]
    if tag == "y":
      return bytes.fromhex(j[1])
    if tag == "d":
      return {decode(k, remote, depth + 1): decode(v, remote, depth + 1) for k, v in j[1]}
    if tag in ("l", "t", "S", "z"):
      items = [decode(v, remote, depth + 1) for v in j[1]]
      return {"l": list, "t": tuple, "S": set, "z": frozenset}[tag](items)
    if tag in ("h", "r"):
      return remote(tag, int(j[1], 16))
  except (IndexError, TypeError, ValueError, KeyError) as e:
    raise ProtocolError(f"bad value: {e!r}") from None
  raise ProtocolError(f"unknown tag {tag!r}")


# ------------------------------------------------------------------ peers

class Remote:
  """An object that lives on the other side; see the module docstring."""

  __slots__ = ("_peer", "_id", "__weakref__")

  def __init__(self, peer, ident):
    self._peer, self._id = peer, ident

  def __call__(self, *args, **kwargs):
    return self._peer.request("call", self._id, "", args, kwargs)

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return self._peer.request("get", self._id, name)

  def __len__(self):
    return self._peer.request("op", self._id, "len")

  def __getitem__(self, key):
    return self._peer.request("op", self._id, "getitem", [key])

  def __iter__(self):
    it = self._peer.request("op", self._id, "iter")
    if type(it) is not Remote:
      raise TypeError("the program's iterator is not an iterator")
    while True:
      try:
        yield self._peer.request("op", it._id, "next")
      except StopIteration:
        return

  def __str__(self):
    return self._peer.request("op", self._id, "str")

  def __repr__(self):
    return self._peer.request("op", self._id, "repr")

  def __bool__(self):
    raise TypeError("an object of the program has no truth value in the tests "
                    "(only plain values cross the sandbox boundary)")

  # No __eq__ and friends: object's identity comparison is the only one.


class Peer:
  """One end of the request/reply channel; both sides may call the other.

  `serve_ops`: whether the other side may read attributes and use
  operators on our objects (the program's side allows it; the tests' side
  allows calls only, so no test data is reachable through a callback).
  """

  def __init__(self, rfd, wfd, *, lenient, serve_ops):
    self.rfd, self.wfd = rfd, wfd
    self.lenient, self.serve_ops = lenient, serve_ops
    self.objects = {}  # id -> our object the other side holds a handle to
    self.remotes = {}  # id -> Remote, so a handle keeps its identity

  def _export(self, x):
    if type(x) is Remote and x._peer is self:
      return ["r", format(x._id, "x")]
    if self.lenient:
      plain = _as_plain(x)
      if plain is not _NOT_PLAIN:
        return encode(plain, self._export)
    ident = id(x)
    self.objects[ident] = x
    return ["h", format(ident, "x")]

  def _resolve(self, tag, ident):
    if tag == "r":
      if ident not in self.objects:
        raise ProtocolError("unknown handle")
      return self.objects[ident]
    if ident not in self.remotes:
      self.remotes[ident] = Remote(self, ident)
    return self.remotes[ident]

  def encode(self, x):
    return encode(x, self._export)

  def decode(self, j):
    return decode(j, self._resolve)

  def request(self, kind, ident, name="", args=(), kwargs=None):
    """Sends a request, serving the other side's requests until the reply."""
    msg = [kind, format(ident, "x"), name, self.encode(list(args)),
           self.encode(dict(kwargs or {}))]
    try:
      send(self.wfd, msg)
      while True:
        reply = recv(self.rfd)
        if reply[0] == "ret":
          return self.decode(reply[1])
        if reply[0] == "exc":
          raise _exception(reply[1], reply[2], stop_ok=kind == "op" and name == "next")
        self.answer(reply)
    except (EOFError, OSError, ProtocolError, IndexError) as e:
      raise ProgramGone("the program's process ended or misbehaved during the tests "
                        f"({e!r})") from None

  def answer(self, msg):
    """Runs one request of the other side and sends the reply."""
    try:
      kind, obj, name = msg[0], self.objects[int(msg[1], 16)], msg[2]
      args, kwargs = self.decode(msg[3]), self.decode(msg[4])
      if kind == "call":
        value = obj(*args, **{str(k): v for k, v in kwargs.items()})
      elif kind in ("get", "op") and self.serve_ops:
        value = _op(obj, kind, name, args)
      else:
        raise ProtocolError(f"request {kind!r} refused")
      reply = ["ret", self.encode(value)]
    except ProtocolError:
      raise
    except BaseException as e:  # noqa: BLE001 - every failure goes back as data
      reply = ["exc", _base_name(e), _safe_str(e)]
    send(self.wfd, reply)


_OPS = {"len": len, "getitem": lambda o, k: o[k], "iter": iter, "next": next,
        "str": str, "repr": repr}


def _op(obj, kind, name, args):
  if kind == "get":
    return getattr(obj, name)
  if name not in _OPS:
    raise ProtocolError(f"unknown op {name!r}")
  return _OPS[name](obj, *args)


def _builtin_exception(t):
  import builtins
  return getattr(builtins, t.__name__, None) is t and issubclass(t, BaseException)


def _base_name(e):
  """Name of the nearest built-in exception class in `e`'s type's MRO."""
  for t in type(e).__mro__:
    if _builtin_exception(t):
      return t.__name__
  return "Exception"


def _safe_str(e):
  try:
    text = str(e)
  except BaseException:  # noqa: BLE001
    text = "<unprintable>"
  return text if type(text) is str else "<unprintable>"


def _exception(name, message, stop_ok=False):
  import builtins
  t = getattr(builtins, name, None) if type(name) is str else None
  if t in (StopIteration, StopAsyncIteration) and not stop_ok:
    # Raised by a program's function inside `all(map(f, xs))` it would
    # end the map early and make all() true: only `next` may stop.
    return ProgramError(f"{name}: {message}")
  if not (isinstance(t, type) and issubclass(t, Exception)):
    # SystemExit, KeyboardInterrupt, ... of the program are its errors;
    # they must not end the tests' interpreter.
    return ProgramError(f"{name}: {message}")
  try:
    return t(message)
  except BaseException:  # noqa: BLE001 - e.g. UnicodeDecodeError's signature
    return ProgramError(f"{name}: {message}")


_NOT_PLAIN = object()


def _as_plain(x):
  """A plain equivalent of the program's value, or _NOT_PLAIN.

  Runs in the program's interpreter, so it may call the program's code: a
  plain value it yields is simply the program's answer.
  """
  t = type(x)
  if t in _SCALARS or t in _BOXES:
    return x
  for base in (bool, int, float, complex, str, bytes):
    if isinstance(x, base):  # a subclass: its true value, not its __eq__
      try:
        v = base.__new__(base, x) if base is not bool else bool.__bool__(x)
      except BaseException:  # noqa: BLE001
        return _NOT_PLAIN
      return v if type(v) is base else _NOT_PLAIN
  for base in (list, tuple, set, frozenset):
    if isinstance(x, base):
      return base(iter(base.__iter__(x)))
  if isinstance(x, dict):
    return dict(dict.items(x))
  mod = getattr(t, "__module__", "")
  if type(mod) is str and mod.split(".")[0] == "numpy" and hasattr(x, "tolist"):
    try:
      return x.tolist()  # numpy scalars and arrays: as Python values
    except BaseException:  # noqa: BLE001
      return _NOT_PLAIN
  return _NOT_PLAIN


# ------------------------------------------------------------ the two sides

_NEVER_IMPORT = {"antigravity", "this", "__main__", "__hello__", "__phello__"}
# Names tests use as helpers without importing them, trusting the program's
# `import numpy as np`: bound to the real module, never to the program's value.
_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "nx": "networkx",
            "sp": "scipy"}


def _format_exc(e, skip=1):
  import traceback  # only on this path: it costs start-up time
  tb = e.__traceback__
  for _ in range(skip):  # the harness's own frames: the message is about the program
    tb = tb.tb_next if tb else None
  return "".join(traceback.format_exception(type(e), e, tb))[-2000:]


def _flush():
  import sys
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:  # noqa: BLE001 - the program may have closed them
      pass


def _describe(peer, name, value):
  """One of the program's top-level names as [name, kind, value] for the tests.

  kind is "m" for a module, else "v"; value is always the program's own
  object (plain data or a handle). Nothing here is trusted: the program can
  rewrite this function, so the tests' side only ever uses the kind to
  decide whether `name` may be the real module called `name`, something an
  honest `import name` in the program gives it anyway.
  """
  try:
    return [name, "m" if isinstance(value, type(os)) else "v", peer.encode(value)]
  except BaseException:  # noqa: BLE001 - an unencodable name is left out
    return None


def serve_program(program, rfd, wfd):
  """Program side: runs the program, then answers the tests' requests."""
  import sys
  pid = os.getpid()
  # A real module, so pickle (multiprocessing.Pool) finds the program's functions.
  module = type(sys)("solution")
  sys.modules["solution"] = module
  ns = module.__dict__
  ns["__builtins__"] = __builtins__
  peer = Peer(rfd, wfd, lenient=True, serve_ops=True)
  try:
    exec(compile(program, "<program>", "exec"), ns)
    names = [d for n, v in list(ns.items()) if type(n) is str and not n.startswith("__")
             if (d := _describe(peer, n, v)) is not None]
    first = ["ready", names]
  except MemoryError:
    first = ["memory", "MemoryError while running the program"]
  except SystemExit as e:
    first = ["exit", _safe_str(ValueError(repr(e.code)))]
  except BaseException as e:  # noqa: BLE001
    first = ["error", _format_exc(e)]
  if os.getpid() != pid:
    os._exit(0)  # a fork of the program came back through here: it has no say
  _flush()
  send(wfd, first)
  while first[0] == "ready":
    try:
      msg = recv(rfd)
    except EOFError:
      break
    peer.answer(msg)
    if os.getpid() != pid:
      os._exit(0)
    _flush()
  _flush()


def _import(name):
  import sys
  if type(name) is not str or name in _NEVER_IMPORT or name.startswith("_sandbox"):
    return None
  try:
    __import__(name)
    return sys.modules[name]
  except BaseException:  # noqa: BLE001
    return None


def _used_as_module(name, tests):
  """Do the tests write `name.attr` (not `x.name.attr`, not `rename.attr`)?

  A scan, not `re`: the tests' interpreter has not imported it, and start-up
  is most of a run's cost.
  """
  i = tests.find(name)
  while i >= 0:
    before = tests[i - 1] if i else " "
    if not (before.isalnum() or before in "_.") and tests[i + len(name):].lstrip(" ").startswith("."):
      return True
    i = tests.find(name, i + 1)
  return False


def run_tests(tests, rfd, wfd):
  """Tests side: (status, message); never runs a byte of the program."""
  import builtins
  try:
    first = recv(rfd)
    kind = first[0]
  except (EOFError, OSError):
    return "error", "the program exited before the tests ran"
  except (ProtocolError, IndexError):
    return "error", "the program broke the protocol before the tests ran"
  if kind == "memory":
    return "memory", "MemoryError while running the program"
  if kind == "exit":
    return "error", f"the program exited (SystemExit({first[1]})) before the tests ran"
  if kind == "error" and type(first[1]) is str:
    return "error", first[1]
  if kind != "ready":
    return "error", "the program broke the protocol before the tests ran"
  import sys
  peer = Peer(rfd, wfd, lenient=False, serve_ops=False)
  ns = {"__name__": "tests", "__builtins__": builtins}
  try:
    for name, kind, value in first[1]:
      if type(name) is not str or name.startswith("__") or hasattr(builtins, name):
        continue  # a program's `all = lambda *a: True` must not judge the tests
      module = None
      if ((name in sys.stdlib_module_names or name in _ALIASES or kind == "m")
          and _used_as_module(name, tests)):
        # `math.isclose(...)` or `np.allclose(...)` in a test is the real
        # module's, whatever the program bound to the name. The module
        # imported is named by the name alone, never by anything the
        # program chose (a function named like a module, which tests only
        # call, stays the program's).
        module = _import(_ALIASES.get(name, name))
      # Everything else is the program's own object: a function it imported
      # (`from operator import add`) reaches the tests as that very function,
      # called in the program's interpreter, never as a re-import.
      ns[name] = module if module is not None else peer.decode(value)
  except (ProtocolError, IndexError, TypeError, ValueError, AttributeError):
    return "error", "the program broke the protocol before the tests ran"
  try:
    exec(compile(tests, "<tests>", "exec"), ns)
  except ProgramGone as e:
    return "error", str(e)
  except MemoryError:
    return "memory", "MemoryError while running the tests"
  except SystemExit as e:
    return "failed", f"exited (SystemExit({e.code!r})) before the tests finished"
  except BaseException as e:  # noqa: BLE001
    return "failed", _format_exc(e)
  return "passed", ""
