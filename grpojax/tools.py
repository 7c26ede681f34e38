"""Tools the policy calls between its turns (TRL 1.16's `tools=`), run on the host while
the engine decodes (sampling/engine/turns.py), and a sandboxed Python tool.

Axes: F rows a hand-off holds, T = max_new_tokens, L the longest response in tokens.

A tool is a typed function with a Google-style docstring (TRL's and transformers'
convention: the chat template renders its schema from them), sync or async; or a
class, of which each row gets an instance of its own, its public methods the
tools (state kept between one row's calls, nothing shared between rows: the
built-in `PythonTool` is one). A call runs under a time limit; an exception, a
timeout, an unknown name or arguments that do not parse become the tool message
`{'error': ...}` (counted as a failure), and the row goes on. The result is
rendered by the chat template as TRL renders it (`str(result)` as a "tool"
message) and joined to the row by token ids: the ids the template gives after the
assistant's EOS, found by rendering a conversation with and without the tool
messages (`response_ids`), never by re-tokenising the row.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import json
import random
import re
import threading
import time
from typing import Callable, Mapping, Sequence

import numpy as np

# Hermes' tool-call syntax, which Qwen2.5, Qwen3 and their templates use.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def parse_calls(text: str) -> list[dict]:
  """The tool calls of one assistant turn in Hermes' syntax: [{"name", "arguments"}], or
  {"error": why} for a call that does not parse (it is answered with the error)."""
  calls = []
  for body in _CALL.findall(text):
    try:
      call = json.loads(body)
      if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('a call is a JSON object with a "name" and "arguments"')
      arguments = call.get("arguments", {})
      if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = json.loads(arguments)
      if not isinstance(arguments, dict):
        raise ValueError('"arguments" must be a JSON object')
      calls.append({"name": call["name"], "arguments": arguments})
    except ValueError as e:
      calls.append({"error": f"the tool call does not parse: {e}"})
  return calls


def assistant_message(text: str, calls: Sequence[dict], special: Sequence[str] = ()) -> dict:
  """One assistant turn as TRL's `parse_response` gives it to conversational reward
  functions: {"role": "assistant", "content": the text outside the tool calls, and
  "tool_calls": [{"type": "function", "function": {"name", "arguments"}}] where it made
  calls that parse}. calls: the turn's, parsed (`parse_calls`'); special: the
  tokenizer's special tokens, left out of the content."""
  calls = [{"name": c["name"], "arguments": c["arguments"]} for c in calls if "error" not in c]
  content = _CALL.sub("", text)
  for token in special:
    content = content.replace(token, "")
  message = {"role": "assistant", "content": content.strip() if calls else content}
  if calls:
    message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
  return message


def tool_functions(tool) -> dict[str, Callable]:
  """{name: callable} of one tool: a function, or an instance's public methods."""
  if inspect.isroutine(tool):
    return {tool.__name__: tool}
  return {name: getattr(tool, name)
          for name, _ in inspect.getmembers(type(tool), predicate=inspect.isfunction)
          if not name.startswith("_") and name not in ("reset", "get_reward")}


def schema_tools(tools: Sequence) -> list[Callable]:
  """The callables a chat template renders schemas of (`apply_chat_template(tools=)`):
  functions as they are, a class's public methods bound to a prototype instance."""
  out = []
  for tool in tools:
    out += list(tool_functions(tool() if inspect.isclass(tool) else tool).values())
  return out


class Environments:
  """TRL 1.16's `environment_factory`: each row of a rollout gets an environment instance
  of its own, reset before the rollout; its public methods are the row's tools, and an
  optional `get_reward()` scores the row (a reward of weight 1 named after the class).

  factories: a callable returning an instance (a class), or {name: callable}: then each
    example's `environment` column names its environment, and its prompt shows only
    that environment's tools.
  group_size: G, the rows of one prompt.
  tools: the run's other tools' schema callables (schema_tools), shown beside each
    environment's methods.

  Instances are made as a rollout first needs them and reused after ("construct once,
  reset often", as TRL does). `reset(**row)` gets the example's columns and returns
  None or text that joins the prompt's last message. A group's G rows share one prompt
  (their group is their baseline), so their G resets must return the same text: text
  drawn at random per reset is refused, not silently averaged over different prompts.
  """

  def __init__(self, factories, *, group_size: int, tools: Sequence[Callable] = ()):
    self.multi = isinstance(factories, Mapping)
    self.factories = dict(factories) if self.multi else {None: factories}
    if not self.factories:
      raise ValueError("environment_factory: an empty dict names no environment")
    self.group_size = int(group_size)
    self._pool: dict = {}
    self._schema: dict = {}
    self.rewarded: list[type] = []  # the classes with get_reward, one reward column each
    for name, factory in self.factories.items():
      if not callable(factory):
        raise TypeError(f"environment_factory{'' if name is None else f'[{name!r}]'}: "
                        f"{factory!r} is not callable (give a class or a function)")
      instance = factory()
      if not callable(getattr(instance, "reset", None)):
        raise ValueError(f"environment_factory: {type(instance).__name__} has no reset(): "
                         "each environment must define one (it may return None)")
      self._pool[name] = [instance]
      self._schema[name] = [*tools, *tool_functions(instance).values()]
      if callable(getattr(type(instance), "get_reward", None)) and (
          type(instance) not in self.rewarded):
        self.rewarded.append(type(instance))
    self._rows: list = []  # this rollout's instance per row (prompt-major: i * G + g)

  def name_of(self, row: Mapping):
    """The environment a row of the dataset selects (None: the one environment)."""
    if not self.multi:
      return None
    name = row.get("environment")
    if name not in self.factories:
      raise ValueError(f"an example has environment={name!r}, which is none of "
                       f"environment_factory's {sorted(map(str, self.factories))}")
    return name

  def schema(self, row: Mapping) -> list[Callable]:
    """The methods whose schemas a row's prompt shows (bound to a probe instance)."""
    return self._schema[self.name_of(row)]

  def reset(self, rows: Sequence[Mapping], group_size: int | None = None,
            keys: Sequence[Sequence[int]] | None = None) -> list:
    """A rollout's examples (rows of the dataset), in order: G instances per example, its
    rollout rows i * G .. i * G + G - 1, each reset with the example's columns
    (TRL's `reset(**row)`; a dict factory's `environment` column left out). Returns each
    example's observation: None or the text its G resets agreed on.

    group_size: G for this rollout (default: the run's; eval samples 1 or n per prompt).
    keys: per example, ints naming its draw (the run's seed and the example's place in
      the data order): each of its G resets runs with Python's `random` and NumPy's
      global generator seeded from them (their states put back after), so an
      environment that draws its problem from either gives the group one problem, the
      same again on a resumed run.
    """
    G = self.group_size if group_size is None else int(group_size)
    cursor: dict = {}
    self._rows = []
    out = []
    for e, row in enumerate(rows):
      name = self.name_of(row)
      kwargs = {k: v for k, v in row.items() if not (self.multi and k == "environment")}
      seen = []
      for _ in range(G):
        pool, i = self._pool[name], cursor.get(name, 0)
        if i == len(pool):
          pool.append(self.factories[name]())
        cursor[name] = i + 1
        with _seeded(None if keys is None else keys[e]):
          seen.append(_resolved(pool[i].reset(**kwargs)))
        self._rows.append(pool[i])
      if any(o is not None and not isinstance(o, str) for o in seen):
        raise TypeError(f"{type(pool[0]).__name__}.reset() returned "
                        f"{type(next(o for o in seen if not isinstance(o, str))).__name__}: "
                        "it returns None or text (images are not supported)")
      if any(o != seen[0] for o in seen[1:]):
        raise ValueError(
            f"{type(pool[0]).__name__}.reset() returned different text for the "
            f"{G} rows of one prompt ({seen[0]!r:.60} and "
            f"{next(o for o in seen if o != seen[0])!r:.60}): a group shares its prompt, its "
            "mean is the baseline; draw the text from the row's columns (seed a generator "
            "with them), not anew at each reset")
      out.append(seen[0])
    return out

  def tools_of(self, row: int) -> dict[str, Callable]:
    """A rollout row's environment methods, bound to its own instance."""
    return tool_functions(self._rows[row])

  def columns(self, rows) -> dict[str, list]:
    """HostRewards.row_columns: the instances of these rollout rows [n] as `environments`
    (TRL's reward keyword); None for a row of no rollout (-1: rewards.check_at_start)."""
    return {"environments": [self._rows[r] if 0 <= r < len(self._rows) else None
                             for r in np.asarray(rows).reshape(-1).tolist()]}

  def reward_functions(self) -> list[Callable]:
    """One reward function per class with get_reward, named after it (weight 1)."""
    return [EnvironmentReward(cls) for cls in self.rewarded]


@contextlib.contextmanager
def _seeded(key: Sequence[int] | None):
  """Python's `random` and NumPy's global generator seeded from `key` inside, as they
  were after (None: untouched)."""
  if key is None:
    yield
    return
  state = np.random.SeedSequence([int(x) & 0xFFFFFFFF for x in key]).generate_state(2)
  saved = random.getstate(), np.random.get_state()
  random.seed(int(state[0]) << 32 | int(state[1]))
  np.random.seed(int(state[0]))
  try:
    yield
  finally:
    random.setstate(saved[0])
    np.random.set_state(saved[1])


class EnvironmentReward:
  """A reward column of an environment class's `get_reward()`: None (left out of the
  row's sum) where the row's environment is another class; awaited if it is async."""

  def __init__(self, cls: type):
    self.cls = cls
    self.__name__ = cls.__name__

  def __call__(self, completions, environments=None, **unused) -> list:
    if environments is None:
      raise ValueError(f"{self.__name__}.get_reward: no `environments` (HostRewards' "
                       "row_columns=Environments.columns gives them)")
    return [_resolved(e.get_reward()) if type(e) is self.cls else None  # pylint: disable=unidiomatic-typecheck
            for e in environments]


def _resolved(value):
  return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


class ToolRunner:
  """The host side of the engine's tool turns (TurnHook.host): parses a row's turn,
  runs its calls on threads and answers with the template's tool-response ids.

  tokenizer: an HFTokenizer (its chat template renders the tool messages).
  tools: functions and classes (see the module's docstring).
  timeout_s: each call's time limit; a call past it answers with an error and its
    thread is left to finish (a Python thread cannot be stopped: a tool that must
    be killed runs in a process of its own, as PythonTool runs in the sandbox).
  max_result_chars: a result longer than this is cut (a tool that prints 10 MB).
  response_tokens: L, the longest response in tokens: longer results are cut to fit.
  threads: calls in flight at once.
  parse: text of a turn -> its calls (`parse_calls`: Hermes' syntax).
  isolation: where a function tool runs: "thread" (this process, as TRL runs it: a
    hang is left running past its limit, os._exit ends the trainer) or "process" (a
    forked child per call, killed at its limit: a hang, a crash or os._exit ends
    only the call; its result must pickle, and what it changes in its process is
    lost). Classes' instances keep their state in this process: always "thread".
  """

  def __init__(self, tokenizer, tools: Sequence, *, timeout_s: float = 20.0,
               max_result_chars: int = 4096, response_tokens: int = 1024, threads: int = 8,
               parse: Callable[[str], list[dict]] = parse_calls, isolation: str = "thread",
               environments: Environments | None = None):
    if not tools and environments is None:
      raise ValueError("ToolRunner: give at least one tool or environments")
    self.environments = environments
    self.tokenizer = tokenizer
    self.tools = list(tools)
    self.timeout_s = float(timeout_s)
    self.max_result_chars = int(max_result_chars)
    self.response_tokens = int(response_tokens)
    self.parse = parse
    if isolation not in ("thread", "process"):
      raise ValueError(f"ToolRunner: isolation={isolation!r}: 'thread' or 'process'")
    self.isolation = isolation
    self._shared = {}
    self._classes = []
    for tool in self.tools:
      if inspect.isclass(tool):
        self._classes.append(tool)
      elif callable(tool):
        self._shared.update(tool_functions(tool))
      else:
        raise TypeError(f"a tool is a function or a class, got {tool!r}")
    self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grpojax-tool")
    self._lock = threading.Lock()
    self._suffix_cache: dict[tuple, list[int]] = {}
    self._special_tokens: list[str] | None = None
    self.begin()

  def __hash__(self):  # static in the program: by identity
    return id(self)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def begin(self) -> None:
    """A new rollout: no row's tools nor answers are kept from the last one."""
    with self._lock:
      self._jobs: dict[tuple[int, int], concurrent.futures.Future] = {}
      self._deliver: dict[int, collections.deque] = collections.defaultdict(collections.deque)
      self._row_tools: dict[int, dict[str, Callable]] = {}
      # (row, turn) -> (the assistant turn and its tool messages, the completion's length
      # after the response): the conversation reward functions see (`conversation`).
      self._said: dict[tuple[int, int], tuple[list[dict], int]] = {}
      self.calls = self.failures = self.turns = 0
      self.seconds = 0.0

  def stats(self, rows: int) -> dict[str, float]:
    """The last rollout's tool metrics over its `rows` rows, TRL's names where they exist."""
    return {"tools/call_frequency": self.calls / max(rows, 1),
            "tools/failure_frequency": self.failures / max(self.calls, 1),
            "tools/turns_per_completion": self.turns / max(rows, 1),
            "tools/seconds": self.seconds}

  # --- the engine's callbacks ---

  def submit(self, first_row, rows, turns, tokens, length, turn_start) -> np.ndarray:
    """Host callback: rows [F] (-1: none) with their turn number, tokens [F, T], length
    [F] and the turn's first position [F], each handed to a thread (or answered from
    the run of its calls already made: a row restarted and asked again)."""
    rows, turns = np.asarray(rows), np.asarray(turns)
    tokens, length, turn_start = np.asarray(tokens), np.asarray(length), np.asarray(turn_start)
    with self._lock:
      for i in np.flatnonzero(rows >= 0):
        key = (int(rows[i]), int(turns[i]))
        if key not in self._jobs:
          turn = tokens[i, int(turn_start[i]):int(length[i])].tolist()
          self._jobs[key] = self._pool.submit(self._answer, key, turn, int(length[i]),
                                              tokens.shape[1])
        self._deliver[int(first_row)].append((key, self._jobs[key]))
    return np.int32(0)

  def collect(self, first_row, wait, *, F: int, L: int):
    """Host callback: (rows [F] -1 where none, turns [F], response ids [F, L], their
    lengths [F], end [F] bool) of the answers ready, up to F. wait: nothing else
    decodes; block until one is ready (up to a second)."""
    shard = int(first_row)
    with self._lock:
      pending = [job for _, job in self._deliver[shard]]
    if bool(wait) and pending and not any(job.done() for job in pending):
      concurrent.futures.wait(pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
    rows = np.full((F,), -1, np.int32)
    turns = np.zeros((F,), np.int32)
    ids = np.zeros((F, L), np.int32)
    lengths = np.zeros((F,), np.int32)
    end = np.zeros((F,), bool)
    n = 0
    with self._lock:
      left = collections.deque()
      for key, job in self._deliver[shard]:
        if n == F or not job.done():
          left.append((key, job))
          continue
        response = job.result()  # _answer raises only on a bug of ours
        rows[n], turns[n] = key
        if response is None or len(response) > L:  # no call, or past the budget
          end[n] = True
        else:
          ids[n, :len(response)] = response
          lengths[n] = len(response)
        n += 1
      self._deliver[shard] = left
    return rows, turns, ids, lengths, end

  # --- one turn ---

  def conversation(self, row: int, completion_ids: Sequence[int]) -> list[dict] | None:
    """What a conversational reward function gets as a tool-using row's completion, as
    TRL 1.16 builds it: each answered turn as an assistant message with its
    `tool_calls`, then its "tool" messages, then the last turn (completion_ids [n]:
    the row's whole completion, tool responses included). None: the row made no call
    that was answered (its completion is one assistant message, as without tools)."""
    with self._lock:
      said = sorted((turn, v) for (r, turn), v in self._said.items() if r == row)
    if not said:
      return None
    messages = [m for _, (turn_messages, _) in said for m in turn_messages]
    tail = self.tokenizer.decode(list(completion_ids)[said[-1][1][1]:], skip_special_tokens=False)
    return messages + [assistant_message(tail, self.parse(tail), self._special())]

  def _special(self) -> list[str]:
    """The tokenizer's special tokens, longest first (left out of messages' content)."""
    if self._special_tokens is None:
      hf = getattr(self.tokenizer, "hf", None)
      self._special_tokens = sorted(getattr(hf, "all_special_tokens", []) or [], key=len,
                                    reverse=True)
    return self._special_tokens

  def _answer(self, key: tuple[int, int], turn: list[int], length: int,
              budget: int) -> list[int] | None:
    """The response ids to one turn, or None: no call to run (the row ends, as TRL's
    does when its turn parses to no tool call) or a response that would not fit in
    the row's budget (TRL rolls it back: the row ends with its EOS)."""
    row = key[0]
    text = self.tokenizer.decode(turn, skip_special_tokens=False)
    calls = self.parse(text)
    if not calls:
      return None
    tools = self._tools_of(row)
    messages, start = [], time.perf_counter()
    failures = 0
    for call in calls:
      name = call.get("name", "unknown")
      if "error" in call:
        result, failed = {"error": call["error"]}, True
      elif name not in tools:
        result, failed = {"error": f"Tool {name} not found."}, True
      elif self.isolation == "process" and name in self._shared:
        result, failed = _run_in_child(tools[name], call["arguments"], self.timeout_s,
                                       self.max_result_chars)
      else:
        result, failed = self._run(tools[name], call["arguments"])
      failures += failed
      content = str(result)
      if len(content) > self.max_result_chars:
        content = content[:self.max_result_chars] + f"... [cut at {self.max_result_chars} characters]"
      messages.append({"role": "tool", "name": name, "content": content})
    response = self.response_ids(messages)
    while len(response) > self.response_tokens:  # cut the results, not the template's ids
      long = [m for m in messages if len(m["content"]) > 24]
      if not long:
        break  # the template alone is too long: no answer fits (the row ends)
      for m in long:  # each cut halves it
        m["content"] = m["content"][:len(m["content"]) // 2 - 9] + "... [cut]"
      response = self.response_ids(messages)
    fits = length + len(response) <= budget and len(response) <= self.response_tokens
    with self._lock:
      if fits:
        self._said[key] = ([assistant_message(text, calls, self._special()), *messages],
                           length + len(response))
      self.calls += len(calls)
      self.failures += failures
      self.seconds += time.perf_counter() - start
      self.turns += fits
    return response if fits else None

  def _tools_of(self, row: int) -> dict[str, Callable]:
    with self._lock:
      if row not in self._row_tools:
        tools = dict(self._shared)
        for cls in self._classes:
          tools.update(tool_functions(cls()))
        if self.environments is not None:
          tools.update(self.environments.tools_of(row))
        self._row_tools[row] = tools
      return self._row_tools[row]

  def _run(self, fn: Callable, arguments: dict) -> tuple[object, bool]:
    """(result, failed) of one call under the time limit."""
    box: dict = {}

    def target():
      try:
        out = fn(**arguments)
        if inspect.isawaitable(out):
          out = asyncio.run(_awaited(out))
        box["out"] = out
      except BaseException as e:  # noqa: BLE001  a tool's SystemExit is its failure too
        box["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    thread = threading.Thread(target=target, daemon=True, name="grpojax-tool-call")
    thread.start()
    thread.join(self.timeout_s)
    if thread.is_alive():
      return {"error": f"the tool did not return within {self.timeout_s:g} s"}, True
    if "error" in box:
      return {"error": box["error"]}, True
    return box.get("out"), False

  def response_ids(self, messages: list[dict]) -> list[int]:
    """The ids the chat template puts after an assistant turn's EOS for these tool
    messages, through the next assistant turn's header (TRL's tool suffix)."""
    key = tuple((m["name"], m["content"]) for m in messages)
    if key in self._suffix_cache:
      return self._suffix_cache[key]
    hf = self.tokenizer.hf
    call = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = list(hf.apply_chat_template(head, tokenize=True, add_generation_prompt=False,
                                         return_dict=False))
    full = list(hf.apply_chat_template(head + messages, tokenize=True,
                                       add_generation_prompt=True, return_dict=False))
    eos = [i for i, t in enumerate(prefix) if t in self.tokenizer.eos_ids]
    if eos:  # the assistant's turn ends at its EOS: what the template adds after is ours
      prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
      raise ValueError("the chat template renders the assistant turn differently once tool "
                       "messages follow it: its tool responses cannot be joined by ids")
    suffix = full[len(prefix):]
    if len(self._suffix_cache) < 4096:
      self._suffix_cache[key] = suffix
    return suffix


async def _awaited(awaitable):
  return await awaitable


def _run_in_child(fn: Callable, arguments: dict, timeout_s: float,
                  max_chars: int) -> tuple[object, bool]:
  """(result, failed) of one call in a forked child, killed past timeout_s. The child
  sends back the result's text (str(result), cut at max_chars: all the tool message
  holds) or its error; a child that dies sending nothing is the call's failure."""
  import multiprocessing  # pylint: disable=import-outside-toplevel
  import warnings  # pylint: disable=import-outside-toplevel

  receive, send = multiprocessing.Pipe(duplex=False)

  def child():
    try:
      out = fn(**arguments)
      if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
      send.send(("ok", str(out)[:max_chars + 1]))
    except BaseException as e:  # noqa: BLE001
      send.send(("error", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__))

  with warnings.catch_warnings():
    # JAX warns that a fork of a threaded process may deadlock: the child runs only the
    # tool and the pipe, and is killed at its limit if it does.
    warnings.simplefilter("ignore", RuntimeWarning)
    proc = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    proc.start()
  send.close()
  try:
    if not receive.poll(timeout_s):  # a dead child's pipe polls ready, at its EOF
      return {"error": f"the tool did not return within {timeout_s:g} s"}, True
    try:
      kind, value = receive.recv()
    except EOFError:
      proc.join(1.0)
      return {"error": f"the tool's process exited with status {proc.exitcode}"}, True
    return ({"error": value}, True) if kind == "error" else (value, False)
  finally:
    if proc.is_alive():
      proc.kill()
    proc.join(1.0)
    receive.close()


class PythonTool:
  """The built-in Python tool: each row gets an interpreter of its own in the code
  sandbox (the code reward's isolation), its state kept across the row's calls.

  The state is kept by running the row's earlier cells again, their output
  discarded, before the new one: what a deterministic program defined is there,
  nothing is shared between rows, and a cell that exits, hangs or floods ends only
  its own call. Limits: `timeout_s` for all of a call's cells, `memory_mb`.
  """

  timeout_s = 5.0
  memory_mb = 512

  def __init__(self):
    self._cells: list[str] = []

  def python(self, code: str) -> str:
    """Runs Python code and returns what it prints, with the value of its last line if
    that line is an expression. Variables and imports stay for later calls.

    Args:
      code: the Python source to run.
    """
    from grpojax.sandbox import run_tests

    program = _replay_program(self._cells, code)
    result = run_tests(program, [{"input": "", "output": "\x00"}], timeout_s=self.timeout_s,
                       memory_mb=self.memory_mb, output_limit_bytes=1 << 16)
    out = result.stderr
    if result.status == "timeout":
      raise TimeoutError(f"the code did not finish within {self.timeout_s:g} s")
    if result.status == "output_limit":
      raise RuntimeError("the code printed more than 64 KiB")
    if "exited with status" in result.message:
      raise RuntimeError(f"the interpreter {result.message.split(': ', 1)[-1]}"
                         + (f"; it printed: {out}" if out else ""))
    # A cell that ended its interpreter is not run again: the row's state is as before it.
    self._cells.append(code)
    return out.rstrip("\n")


def _replay_program(cells: list[str], code: str) -> str:
  """A program that runs `cells` silently, then `code` with its output on stderr (the
  stream the sandbox returns) and the value of a last expression printed."""
  return f"""\
import ast, contextlib, io, sys, traceback
sys.stdout = sys.stderr
_g = {{"__name__": "__main__"}}
for _c in {cells!r}:
  with contextlib.redirect_stderr(io.StringIO()):
    sys.stdout = sys.stderr
    try:
      exec(compile(_c, "<cell>", "exec"), _g)
    except BaseException:
      pass
sys.stdout = sys.stderr
_code = {code!r}
try:
  _tree = ast.parse(_code)
  _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
  exec(compile(_tree, "<cell>", "exec"), _g)
  if _last is not None:
    _v = eval(compile(ast.Expression(_last.value), "<cell>", "eval"), _g)
    if _v is not None:
      print(repr(_v))
except BaseException:
  traceback.print_exc(limit=-1)
"""
