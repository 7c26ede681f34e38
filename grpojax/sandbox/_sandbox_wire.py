"""The program/test boundary of the sandbox: plain data and remote handles.

Loaded by `_sandbox.py` only (standard library only, no grpojax). The
program runs in one interpreter and the tests in another; each sees the
other's objects through this channel. A call sends its arguments as plain
data and the result comes back as plain data: None, bool, int, float,
complex, str, bytes, bytearray, range, and list, tuple, dict, set, frozenset
(and collections' Counter, OrderedDict, defaultdict of a built-in factory,
deque; Fraction, Decimal) of those, tagged so that types stay distinct.
Anything else crosses as an opaque `Remote` handle to the object, which
stays where it was made.

Who decides what. Every `==`, `assert` and comparison of the tests runs in
the tests' interpreter on values it decoded itself or on its own objects:
a handle to a program object equals only itself, and has no ordering or
`in` of its own there (membership iterates it, as plain values). What a
program object may still answer (its truth value, len, str, attributes,
calls, arithmetic) is data it could as well have returned directly. So no
object of the program's making can decide a test.

The tests' objects live in the tests' interpreter:
- their mutable containers (list, dict, set, bytearray, deque, ...) cross to
  the program as copies that remember where they came from; when the
  tests' outermost call into the program returns (or raises), what the
  program did to them is written back into the tests' own objects, and a
  container the program hands back is the tests' own again. So
  `move_zeroes(nums); assert nums == [...]` and `rotate(matrix)` work, and
  identity and sharing survive (`f(xs) is xs`);
- their other objects (instances of the tests' classes, a `ListNode`, a
  `Stack`, generators, functions) are handles in the program: attributes,
  methods, items, iteration, truth, ordering and arithmetic run in the
  tests' interpreter. Names starting with `_` and frames, code, tracebacks
  and modules are never handed out, so no handle leads to the tests'
  globals or source.

Which of the program's names the tests see is decided by the trainer
(`runner._judge_plan`), never by the program: the task's entry point is
the program's object, always; a name used as a module is the real module;
builtins and `math`'s names are the real ones; every other name the
tests use is the program's own object (a function it imported reaches the
tests as that very function, run in the program's interpreter).

The tests run as `__main__`; a run passes only with evidence that checks
ran: each `assert` and each call of an `assert*` function (unittest's
`self.assertEqual`, numpy's `assert_allclose`) counts once it completes.
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

_SCALARS = {type(None): "N", bool: "B", int: "i", float: "f", complex: "c", str: "s", bytes: "y",
            range: "R"}
_BOXES = {list: "l", tuple: "t", set: "S", frozenset: "z", dict: "d", bytearray: "Y"}
_MUTABLE = frozenset({"l", "S", "d", "Y", "C", "O", "D", "Q"})  # tags of containers with a state
# defaultdict factories that cross by name: built-in types, nothing of either side's making.
_FACTORIES = ("int", "float", "str", "list", "dict", "set", "tuple", "bool", "frozenset")


def _library_types():
  """{type: tag} of the standard library's value types, for the modules already
  loaded (a value of a type whose module nobody imported cannot exist)."""
  import sys
  out = {}
  collections = sys.modules.get("collections")
  if collections is not None:
    out.update({collections.Counter: "C", collections.OrderedDict: "O",
                collections.defaultdict: "D", collections.deque: "Q"})
  for name, cls, tag in (("fractions", "Fraction", "F"), ("decimal", "Decimal", "E")):
    module = sys.modules.get(name)
    if module is not None:
      out[getattr(module, cls)] = tag
  return out


def _hex(n):
  return format(n, "x")  # no int-to-str digit limit


class Codec:
  """Encodes values as tagged lists of str and decodes them back.

  `export(x)`: the tag of a value that does not cross as data (a handle).
  `resolve(tag, id)`: the object of a handle tag. `lend(x, tag)`: for a
  mutable container, None (plain copy) or its lending id; `lent(id)`: the
  local object of a lending id already seen. `borrow(tid, x)`: registers the
  local copy `x` of the other side's container `tid`.
  """

  def __init__(self, export, resolve, lend=None, lent=None, borrow=None):
    self.export, self.resolve = export, resolve
    self.lend, self.lent, self.borrow = lend, lent, borrow
    self._types = None

  def library(self):
    if self._types is None or len(self._types) < 6:
      self._types = _library_types()  # modules may have loaded since
    return self._types

  def encode(self, x, depth=0, top=True):
    if depth > _MAX_DEPTH:
      raise ValueError("value nested too deeply to cross the sandbox boundary")
    t = type(x)  # exact types: a subclass could carry a lying __eq__
    if t is type(None):
      return ["N"]
    if t is bool:
      return ["B", "1" if x else "0"]
    if t is int:
      return ["i", _hex(x)]
    if t is float:
      return ["f", x.hex()]
    if t is complex:
      return ["c", x.real.hex(), x.imag.hex()]
    if t is str:
      return ["s", x]
    if t is bytes:
      return ["y", x.hex()]
    if t is range:
      return ["R", _hex(x.start), _hex(x.stop), _hex(x.step)]
    tag = _BOXES.get(t)
    if tag is None:
      tag = self.library().get(t)
      if tag is None:
        return self.export(x)
    if tag in _MUTABLE and self.lend is not None:
      ref = self.lend(x, tag) if top is not None else None
      if ref is not None:
        return ref
    return self._contents(x, tag, depth)

  def _contents(self, x, tag, depth):
    enc = self.encode
    if tag == "Y":
      return ["Y", bytes(x).hex()]
    if tag == "F":
      return ["F", _hex(x.numerator), _hex(x.denominator)]
    if tag == "E":
      return ["E", str(x)]
    if tag in ("d", "C", "O", "D"):
      items = [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]
      if tag == "D":
        factory = x.default_factory
        name = "" if factory is None else getattr(factory, "__name__", None)
        import builtins
        if name != "" and (name not in _FACTORIES or getattr(builtins, name) is not factory):
          return self.export(x)
        return ["D", name, items]
      return [tag, items]
    items = [enc(v, depth + 1) for v in x]
    if tag == "Q":
      return ["Q", "" if x.maxlen is None else _hex(x.maxlen), items]
    return [tag, items]

  def decode(self, j, depth=0):
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
      if tag == "R":
        return range(int(j[1], 16), int(j[2], 16), int(j[3], 16))
      if tag in ("h", "r"):
        return self.resolve(tag, int(j[1], 16))
      if tag == "M":  # one of our own containers, lent out earlier in this call
        return self.lent(int(j[1], 16))
      if tag == "m":  # a container of the other side's, lent for this call
        tid = int(j[1], 16)
        if len(j) == 2:
          return self.lent(tid)
        obj = self._empty(j[2])
        self.borrow(tid, obj)
        self._fill(obj, j[2], depth + 1)
        return obj
      obj = self._empty(j)
      self._fill(obj, j, depth + 1)
      return tuple(obj) if tag == "t" else frozenset(obj) if tag == "z" else obj
    except (IndexError, TypeError, ValueError, KeyError, AttributeError) as e:
      raise ProtocolError(f"bad value: {e!r}") from None

  def _empty(self, j):
    """A new, empty container of the tagged kind (filled by _fill: a container that
    holds itself decodes to one that does)."""
    tag = j[0]
    if tag in ("l", "t", "z"):
      return []
    if tag == "S":
      return set()
    if tag == "d":
      return {}
    if tag == "Y":
      return bytearray()
    if tag == "F":
      from fractions import Fraction
      return Fraction(int(j[1], 16), int(j[2], 16))
    if tag == "E":
      from decimal import Decimal
      return Decimal(j[1])
    if tag in ("C", "O", "D", "Q"):
      import collections
      if tag == "C":
        return collections.Counter()
      if tag == "O":
        return collections.OrderedDict()
      if tag == "Q":
        return collections.deque(maxlen=int(j[1], 16) if j[1] else None)
      import builtins
      if j[1] and j[1] not in _FACTORIES:
        raise ProtocolError("bad defaultdict factory")
      return collections.defaultdict(getattr(builtins, j[1]) if j[1] else None)
    raise ProtocolError(f"unknown tag {tag!r}")

  def _fill(self, obj, j, depth):
    tag, dec = j[0], self.decode
    if tag in ("F", "E"):
      return
    if tag == "Y":
      obj.extend(bytes.fromhex(j[1]))
    elif tag in ("d", "C", "O", "D"):
      for k, v in j[-1]:
        obj[dec(k, depth)] = dec(v, depth)
    elif tag == "S":
      obj.update(dec(v, depth) for v in j[1])
    else:  # list, deque; tuple and frozenset are built from the list after
      obj.extend(dec(v, depth) for v in j[-1])


def _items(obj):
  """A shallow snapshot of a container's contents."""
  return list(obj.items()) if isinstance(obj, dict) else bytes(obj) if isinstance(obj, bytearray) \
      else list(obj)


def _same(old, new):
  """Whether a container's contents are still the very objects they were."""
  if type(old) is bytes:
    return old == new
  return len(old) == len(new) and all(
      (a is b) or (type(a) is tuple and a[0] is b[0] and a[1] is b[1]) for a, b in zip(old, new))


def _assign(obj, new):
  """Writes the program's version of a lent container into the tests' own object."""
  if isinstance(obj, dict):
    factory = getattr(obj, "default_factory", None)
    obj.clear()
    obj.update(new)
    if factory is not None:
      obj.default_factory = factory
  elif isinstance(obj, (list, bytearray)):
    obj[:] = new
  elif isinstance(obj, set):
    obj.clear()
    obj |= new
  else:  # deque
    obj.clear()
    obj.extend(new)


# ------------------------------------------------------------------ peers

_ARITH = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
          "lshift", "rshift")
_ORDER = ("lt", "le", "gt", "ge")


def _remote_method(op):
  def method(self, *args):
    return self._peer.request("op", self._id, op, args)
  method.__name__ = f"__{op}__"
  return method


def _remote_order(op):
  def method(self, other):
    if not self._peer.lenient:  # a program object: no say in the tests' comparisons
      return NotImplemented
    return self._peer.request("op", self._id, op, [other])
  method.__name__ = f"__{op}__"
  return method


class Remote:
  """An object that lives on the other side; see the module docstring."""

  __slots__ = ("_peer", "_id", "__weakref__")

  def __init__(self, peer, ident):
    object.__setattr__(self, "_peer", peer)
    object.__setattr__(self, "_id", ident)

  def __call__(self, *args, **kwargs):
    return self._peer.request("call", self._id, "", args, kwargs)

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return self._peer.request("get", self._id, name)

  def __setattr__(self, name, value):
    self._peer.request("set", self._id, name, [value])

  def __delattr__(self, name):
    self._peer.request("op", self._id, "delattr", [name])

  def __len__(self):
    return self._peer.request("op", self._id, "len")

  def __getitem__(self, key):
    return self._peer.request("op", self._id, "getitem", [key])

  def __setitem__(self, key, value):
    self._peer.request("op", self._id, "setitem", [key, value])

  def __delitem__(self, key):
    self._peer.request("op", self._id, "delitem", [key])

  def __iter__(self):
    it = self._peer.request("op", self._id, "iter")
    if type(it) is not Remote:
      raise TypeError("the other side's iterator is not an iterator")
    while True:
      try:
        yield self._peer.request("op", it._id, "next")
      except StopIteration:
        return

  def __next__(self):
    return self._peer.request("op", self._id, "next")

  def __contains__(self, item):
    if not self._peer.lenient:  # a program object: `in` iterates it, as plain values
      return any(item is v or item == v for v in self)
    return self._peer.request("op", self._id, "contains", [item])

  def __bool__(self):
    return self._peer.request("op", self._id, "bool") is True

  def __str__(self):
    return self._peer.request("op", self._id, "str")

  def __repr__(self):
    return self._peer.request("op", self._id, "repr")

  def __instancecheck__(self, obj):
    return self._peer.request("op", self._id, "isinstance", [obj]) is True

  def __subclasscheck__(self, cls):
    return self._peer.request("op", self._id, "issubclass", [cls]) is True

  # No __eq__: object's identity comparison is the only one, on both sides.
  for _op in _ARITH:
    locals()[f"__{_op}__"] = _remote_method(_op)
    locals()[f"__r{_op}__"] = _remote_method("r" + _op)
  for _op in ("neg", "pos", "abs", "invert", "int", "float", "index"):
    locals()[f"__{_op}__"] = _remote_method(_op)
  for _op in _ORDER:
    locals()[f"__{_op}__"] = _remote_order(_op)
  del _op


def _binary(name):
  import operator
  if name.startswith("r") and name[1:] in _ARITH:
    fn = getattr(operator, f"__{name[1:]}__")
    return lambda o, x: fn(x, o)
  return getattr(operator, f"__{name}__")


_OPS = {"len": len, "getitem": lambda o, k: o[k], "iter": iter, "next": next,
        "str": str, "repr": repr, "bool": bool, "contains": lambda o, x: x in o,
        "setitem": lambda o, k, v: o.__setitem__(k, v),
        "delitem": lambda o, k: o.__delitem__(k), "delattr": delattr,
        "isinstance": lambda cls, x: isinstance(x, cls),
        "issubclass": lambda cls, x: issubclass(x, cls),
        "neg": lambda o: -o, "pos": lambda o: +o, "abs": abs, "invert": lambda o: ~o,
        "int": int, "float": float, "index": lambda o: o.__index__()}
_GUARDED = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")  # frames, code: the tests' source and globals


def _handed_out(value):
  """Whether the tests may hand `value` to the program: no frame, code, traceback
  or module (each leads to the tests' globals or source)."""
  import types
  return not isinstance(value, (types.FrameType, types.CodeType, types.TracebackType,
                                types.ModuleType))


class Peer:
  """One end of the request/reply channel; both sides may call the other.

  `lenient`: the program's side (its values cross as plain data wherever
  they can be read as such, _as_plain). The tests' side lends its mutable
  containers for the length of a call and serves its objects' attributes and
  operators, guarded (names with `_`, frames, code, modules are refused).
  """

  def __init__(self, rfd, wfd, *, lenient):
    self.rfd, self.wfd, self.lenient = rfd, wfd, lenient
    self.objects = {}  # id -> our object the other side holds a handle to
    self.remotes = {}  # id -> Remote, so a handle keeps its identity
    self.depth = 0  # requests we are serving (program) / waiting on (tests)
    # Tests' side: containers lent in the current outermost call, by id.
    # Program's side: the local copies of the tests' containers, by their id.
    self.loans = {}
    self.codec = Codec(self._export, self._resolve, self._lend, self._lent, self._borrow)

  # -------------------------------------------------------------- lending

  def _lend(self, x, tag):
    if self.lenient:  # the program's side: a copy of the tests' container goes back as theirs
      tid = self._copies_by_id.get(id(x)) if self.loans else None
      return None if tid is None else ["M", _hex(tid)]
    if id(x) in self.loans:
      return ["m", _hex(id(x))]
    self.loans[id(x)] = x
    return ["m", _hex(id(x)), self.codec._contents(x, tag, 0)]

  def _lent(self, tid):
    if tid not in self.loans:
      raise ProtocolError("unknown lent container")
    return self.loans[tid] if not self.lenient else self.loans[tid][0]

  def _borrow(self, tid, obj):
    if not self.lenient:
      raise ProtocolError("the program lends nothing")
    self.loans[tid] = (obj, None)  # filled in: the snapshot is taken by _snapshots
    self._copies_by_id[id(obj)] = tid

  def _snapshots(self):
    """Each new copy's items as they came, to send back only what the program changed."""
    for tid, (obj, snap) in self.loans.items():
      if snap is None:
        self.loans[tid] = (obj, _items(obj))

  _copies_by_id = None

  def _returns(self):
    """Program's side, at the end of the tests' outermost call: the state of each
    copy the program changed, as [[tid, contents], ...]."""
    out = []
    for tid, (obj, snap) in self.loans.items():
      if snap is not None and _same(snap, _items(obj)):
        continue  # a nested copy that changed is a loan of its own, checked on its own
      tag = _BOXES.get(type(obj)) or self.codec.library().get(type(obj))
      out.append([_hex(tid), self.codec._contents(obj, tag, 0)])
    return out

  def _take_back(self, changes):
    """Tests' side: writes the program's changes into the containers it lent."""
    for tid, contents in changes:
      obj = self._lent(int(tid, 16))
      _assign(obj, self.decode(contents))

  # ---------------------------------------------------------------- values

  def _export(self, x):
    if type(x) is Remote and x._peer is self:
      return ["r", _hex(x._id)]
    if self.lenient:
      plain = _as_plain(x)
      if plain is not _NOT_PLAIN:
        return self.codec.encode(plain, top=None)
    ident = id(x)
    self.objects[ident] = x
    return ["h", _hex(ident)]

  def _resolve(self, tag, ident):
    if tag == "r":
      if ident not in self.objects:
        raise ProtocolError("unknown handle")
      return self.objects[ident]
    if ident not in self.remotes:
      self.remotes[ident] = Remote(self, ident)
    return self.remotes[ident]

  def encode(self, x):
    return self.codec.encode(x)

  def decode(self, j):
    return self.codec.decode(j)

  def request(self, kind, ident, name="", args=(), kwargs=None):
    """Sends a request, serving the other side's requests until the reply."""
    self.depth += 1
    try:
      # The envelope is never lent: only what it carries.
      msg = [kind, _hex(ident), name, self.codec.encode(list(args), top=None),
             self.codec.encode(dict(kwargs or {}), top=None)]
      send(self.wfd, msg)
      while True:
        reply = recv(self.rfd)
        if reply[0] == "ret":
          if len(reply) > 2:
            self._take_back(reply[2])
          return self.decode(reply[1])
        if reply[0] == "exc":
          if len(reply) > 3:
            self._take_back(reply[3])
          raise _exception(reply[1], reply[2], stop_ok=kind == "op" and name == "next")
        self.answer(reply)
    except (EOFError, OSError, ProtocolError, IndexError) as e:
      raise ProgramGone("the program's process ended or misbehaved during the tests "
                        f"({e!r})") from None
    finally:
      self.depth -= 1
      if self.depth == 0 and not self.lenient:
        self.loans = {}

  def answer(self, msg):
    """Runs one request of the other side and sends the reply."""
    outermost = self.lenient and self.depth == 0
    if outermost:
      self.loans, self._copies_by_id = {}, {}
    self.depth += 1
    try:
      try:
        kind, obj, name = msg[0], self.objects[int(msg[1], 16)], msg[2]
        args, kwargs = self.decode(msg[3]), self.decode(msg[4])
        if self.loans and self.lenient:
          self._snapshots()
        if kind == "call":
          value = obj(*args, **{str(k): v for k, v in kwargs.items()})
        elif kind == "get":
          value = self._get(obj, name)
        elif kind == "set":
          if not self.lenient and name.startswith("_"):
            raise AttributeError(f"{name!r} is not the program's to set")
          setattr(obj, name, args[0])
          value = None
        elif kind == "op":
          value = self._op(obj, name, args)
        else:
          raise ProtocolError(f"request {kind!r} refused")
        reply = ["ret", self.encode(value)]
      except ProtocolError:
        raise
      except BaseException as e:  # noqa: BLE001 - every failure goes back as data
        reply = ["exc", _base_name(e), _safe_str(e)]
      if outermost:
        reply.append(self._returns())
    finally:
      self.depth -= 1
      if outermost:
        self.loans, self._copies_by_id = {}, {}
    send(self.wfd, reply)

  def _get(self, obj, name):
    if self.lenient:
      return getattr(obj, name)
    if name.startswith("_") or name.startswith(_GUARDED):
      raise AttributeError(f"{name!r} is not the program's to read")
    value = getattr(obj, name)
    if not _handed_out(value):
      raise AttributeError(f"{name!r} is not the program's to read")
    return value

  def _op(self, obj, name, args):
    if not self.lenient and name == "delattr" and str(args[0]).startswith("_"):
      raise AttributeError(f"{args[0]!r} is not the program's to delete")
    if name in _OPS:
      value = _OPS[name](obj, *args)
    elif name in _ARITH or name in _ORDER or (name[:1] == "r" and name[1:] in _ARITH):
      value = _binary(name)(obj, *args)
    else:
      raise ProtocolError(f"unknown op {name!r}")
    if not self.lenient and not _handed_out(value):
      raise TypeError("not the program's to hold")
    return value


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
  """One of the program's top-level names as [name, value] for the tests.

  value is always the program's own object (plain data or a handle). The
  tests' side decides which names it uses from its own plan, never from
  anything here.
  """
  try:
    return [name, peer.encode(value)]
  except BaseException:  # noqa: BLE001 - an unencodable name is left out
    return None


def serve_program(program, setup, rfd, wfd):
  """Program side: runs the task's setup and the program, then answers the tests."""
  import sys
  pid = os.getpid()
  # A real module, so pickle (multiprocessing.Pool) finds the program's functions.
  module = type(sys)("solution")
  sys.modules["solution"] = module
  ns = module.__dict__
  ns["__builtins__"] = __builtins__
  peer = Peer(rfd, wfd, lenient=True)
  first = None
  if setup:
    try:
      exec(compile(setup, "<setup>", "exec"), ns)
    except BaseException as e:  # noqa: BLE001
      first = ["error", "the task's setup code failed in the program's interpreter:\n"
               + _format_exc(e)]
  if first is None:
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
  """The real module `name` (a dotted path), imported here, or None."""
  import sys
  if type(name) is not str or name.split(".")[0] in _NEVER_IMPORT or name.startswith("_sandbox"):
    return None
  try:
    __import__(name)
    return sys.modules[name]
  except BaseException:  # noqa: BLE001
    return None


class _Checks:
  """Counts the tests' checks as they complete; the instrumented tests call it."""

  def __init__(self):
    self.n = 0

  def __call__(self, value=None):
    self.n += 1
    return value


def _bind(plan, ns, program_names, peer):
  """The tests' globals from the plan: program objects, real modules, real helpers."""
  import builtins
  for name, how in plan["names"].items():
    if how[0] == "program":
      if name in program_names:
        ns[name] = peer.decode(program_names[name])
    elif how[0] == "module":
      module = _import(how[1])
      if module is not None:
        ns[name] = module
    elif how[0] == "from":
      module = _import(how[1])
      if module is not None and hasattr(module, how[2]):
        ns[name] = getattr(module, how[2])
    elif how[0] == "builtin" and hasattr(builtins, name):
      ns[name] = getattr(builtins, name)


def _solution_module(program_names, peer):
  """`solution`, as the tests import it (`from solution import f`): the program's names."""
  import sys
  module = type(sys)("solution")

  def get(name):
    if name in program_names:
      return peer.decode(program_names[name])
    raise AttributeError(f"the program defines no {name!r}")
  module.__getattr__ = get
  return module


def _unittest_cases(ns):
  import unittest
  loader = unittest.TestLoader()
  suite = unittest.TestSuite()
  for value in list(ns.values()):
    if isinstance(value, type) and issubclass(value, unittest.TestCase):
      suite.addTests(loader.loadTestsFromTestCase(value))
  return suite


def _run_unittest(ns):
  """Runs the TestCase classes the tests defined (they did not call unittest.main)."""
  import io
  import unittest
  suite = _unittest_cases(ns)
  result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
  if result.failures or result.errors:
    test, text = (result.failures + result.errors)[0]
    return f"{test}: {text[-1500:]}"
  return None


def run_tests(judge, rfd, wfd):
  """Tests side: (status, message); never runs a byte of the program.

  `judge`: the trainer's plan (runner._judge_plan): the instrumented tests'
  code, the task's setup, how each name the tests use resolves, and what
  runs after the tests' own statements (HumanEval's check(candidate),
  pytest-style test functions, unittest cases).
  """
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
  import builtins
  import sys
  peer = Peer(rfd, wfd, lenient=False)
  try:
    program_names = {}
    for name, value in first[1]:
      if type(name) is not str:
        raise ProtocolError("bad name")
      program_names[name] = value
  except (ProtocolError, IndexError, TypeError, ValueError):
    return "error", "the program broke the protocol before the tests ran"
  checks = _Checks()
  module = type(sys)("__main__")
  ns = module.__dict__
  ns.update({"__builtins__": builtins, "__checked__": checks, **judge["data"]})
  sys.modules["__main__"] = module
  sys.modules["solution"] = _solution_module(program_names, peer)
  sys.argv = ["tests"]  # unittest.main() reads it: the supervisor's own arguments are not tests
  exited = False
  try:
    if judge["setup"] is not None:
      exec(judge["setup"], ns)
    _bind(judge, ns, program_names, peer)
    try:
      exec(judge["code"], ns)
    except SystemExit as e:
      if e.code not in (None, 0, False):
        return "failed", f"the tests exited with SystemExit({e.code!r})"
      exited = True  # unittest.main() ends here: its cases have run
    if not exited:
      if judge["check"] is not None:
        candidate = eval(judge["check"], ns)
        ns["check"](candidate)
      for name in judge["test_functions"]:
        ns[name]()
      if judge["unittest"]:
        failure = _run_unittest(ns)
        if failure is not None:
          return "failed", failure
  except ProgramGone as e:
    return "error", str(e)
  except MemoryError:
    return "memory", "MemoryError while running the tests"
  except SystemExit as e:
    return "failed", f"exited (SystemExit({e.code!r})) before the tests finished"
  except BaseException as e:  # noqa: BLE001
    return "failed", _format_exc(e)
  if checks.n == 0:
    return "failed", ("no test ran: the tests finished without executing a single assert "
                      "or assert* call" + (f" ({judge['why_none']})" if judge["why_none"] else ""))
  return "passed", f"{checks.n} check{'' if checks.n == 1 else 's'} passed"
