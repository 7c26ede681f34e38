"""Multi-turn rows: a row-event hook (TurnHook) that pauses a row at a tool call, has
the host run the call while the other slots decode, and feeds the result back into
the row as tokens of the chat template's, which the row then answers.

Axes: B prompts, G samples per prompt, N = B*G rows, T = max_new_tokens, F rows a
hand-off or collection holds, L the longest tool response in tokens.

A row decodes its turn as usual. When it draws an EOS after its turn closed the
template's tool-call syntax (`call_end`, token ids), it does not end: it waits,
keeping its slot and pages, and its turn goes to the host (`host.submit`, at the
next step's start). The host decodes the turn, parses and runs its calls on its
threads (grpojax.tools.ToolRunner) and answers with the template's tool-response
tokens, found by id concatenation. The loop collects answers every `poll_every`
steps (every step once nothing else decodes). An answered row goes on: its next
tokens are the response's, forced (attended to, never trained: loss_mask 0), then
it draws its next turn. A row ends at an EOS whose turn called no tool, after
`max_calls` tool turns, at its token budget, or where the host finds no call to
run or a response that would not fit (TRL rolls such a result back: the row ends
with its EOS).

A row preempted while waiting starts again from its first token and asks again;
the host answers each (row, turn) from the first run of its calls, so a tool runs
once per turn whatever the schedule.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from grpojax.sampling.engine.hooks import Drawn, RowHook, Rows
from grpojax.sampling.engine.pages import PENDING, RUNNING

Array = jax.Array


@flax.struct.dataclass
class TurnState:
  """Per row [N]: closed (the turn's tokens closed a tool call), turn_start (position
  of the turn's first token), calls (tool turns answered), asked (to hand to the host),
  handed (with the host), wait (asked or handed, the row held), stop (ends at the next
  step), inject [N, L] / inject_len / inject_from (the response being fed and where it
  starts). first_row: [] this engine's row 0 among all rows (a row shard's)."""

  closed: Array
  turn_start: Array
  calls: Array
  asked: Array
  handed: Array
  wait: Array
  stop: Array
  inject: Array
  inject_len: Array
  inject_from: Array
  first_row: Array


@dataclasses.dataclass(frozen=True, eq=False)
class TurnHook(RowHook):
  """Tool turns as a row-event hook (see the module's docstring).

  host: the host side (grpojax.tools.ToolRunner or anything with its submit and
    collect), static by identity. A host with `traceable` set is called in the
    program instead of through host callbacks (grpojax.plan's stand-in, lowering
    for a device this host lacks).
  call_end: the token ids that close a tool call in the template (Qwen2.5:
    `</tool_call>`); () checks every EOS with the host.
  eos: the EOS ids; max_calls: tool turns per row at most
  (TRL's max_tool_calling_iterations); response_tokens: L, the longest response
  the host may answer with; handoff: F, rows handed or collected per callback;
  poll_every: steps between collections while other rows decode.
  """

  host: object
  eos: tuple[int, ...]
  call_end: tuple[int, ...] = ()
  max_calls: int = 1
  response_tokens: int = 256
  handoff: int = 16
  poll_every: int = 4
  forces = True
  holds = True

  def __post_init__(self):
    if self.max_calls < 0 or self.response_tokens < 1 or self.handoff < 1 or self.poll_every < 1:
      raise ValueError(f"TurnHook: max_calls={self.max_calls} must be >= 0, response_tokens="
                       f"{self.response_tokens}, handoff={self.handoff} and poll_every="
                       f"{self.poll_every} >= 1")

  def __hash__(self):
    return hash((id(self.host), self.eos, self.call_end, self.max_calls, self.response_tokens,
                 self.handoff, self.poll_every))

  def __eq__(self, other):
    return (isinstance(other, TurnHook) and self.host is other.host
            and hash(self) == hash(other))

  def init(self, num_prompts: int, group: int) -> TurnState:
    N = num_prompts * group
    no = jnp.zeros((N,), bool)
    zero = jnp.zeros((N,), jnp.int32)
    return TurnState(closed=no, turn_start=zero, calls=zero, asked=no, handed=no, wait=no,
                     stop=no, inject=jnp.zeros((N, self.response_tokens), jnp.int32),
                     inject_len=zero, inject_from=zero, first_row=jnp.zeros((), jnp.int32))

  def placed(self, state: TurnState, first_row) -> TurnState:
    return state.replace(first_row=jnp.asarray(first_row, jnp.int32))

  def draw(self, state: TurnState, rows: Rows, drawn: Drawn):
    N, T = rows.tokens.shape
    L = self.response_tokens
    r = jnp.minimum(drawn.row, N - 1)
    at = drawn.position
    k = at - state.inject_from[r]
    forced = drawn.active & (k >= 0) & (k < state.inject_len[r])
    token = jnp.where(forced, state.inject[r, jnp.clip(k, 0, L - 1)], drawn.token)
    own = drawn.active & ~forced
    # The call's closing ids end here: the last len(call_end) tokens of this turn.
    match = jnp.zeros_like(own) if not self.call_end else own & (token == self.call_end[-1])
    for j, want in enumerate(reversed(self.call_end[:-1]), start=1):
      before = at - j
      match = match & (before >= state.turn_start[r]) & (
          rows.tokens[r, jnp.maximum(before, 0)] == want)
    closed = state.closed[r] | match if self.call_end else own
    put = jnp.where(own, drawn.row, N)
    is_eos = own & jnp.isin(token, jnp.asarray(self.eos, jnp.int32))
    # A call needs room for at least one response token after its EOS.
    ask = is_eos & closed & (state.calls[r] < self.max_calls) & (at + 1 < T)
    asked_at = jnp.where(ask, drawn.row, N)
    state = state.replace(
        closed=state.closed.at[put].set(closed, mode="drop"),
        asked=state.asked.at[asked_at].set(True, mode="drop"),
        wait=state.wait.at[asked_at].set(True, mode="drop"))
    return state, token, forced

  def goes_on(self, state: TurnState, drawn: Drawn) -> Array:
    N = state.wait.shape[0]
    return drawn.active & state.wait[jnp.minimum(drawn.row, N - 1)]

  def held(self, state: TurnState, rows: Rows):
    N, T = rows.tokens.shape
    F, L = min(self.handoff, N), self.response_tokens
    host = self.host

    def call(fn, shapes, *args):
      if getattr(host, "traceable", False):  # a stand-in: the program lowered, never run here
        return fn(*args)
      return io_callback(fn, shapes, *args)

    def submit(state):
      row, = jnp.nonzero(state.asked, size=F, fill_value=N)
      valid = row < N
      r = jnp.minimum(row, N - 1)
      done = call(host.submit, jax.ShapeDtypeStruct((), jnp.int32), state.first_row,
                         jnp.where(valid, row + state.first_row, -1), state.calls[r],
                         rows.tokens[r], rows.length[r], state.turn_start[r])
      put = jnp.where(valid & (done == 0), row, N)  # the result used: the hand-off stays
      return state.replace(asked=state.asked.at[put].set(False, mode="drop"),
                           handed=state.handed.at[put].set(True, mode="drop"))

    state = jax.lax.cond(jnp.any(state.asked), submit, lambda s: s, state)
    slot_rows = jnp.maximum(rows.slot_row, 0)
    decoding = jnp.any((rows.slot_row >= 0) & ~state.wait[slot_rows])
    admits = jnp.any(rows.status == PENDING) & jnp.any(rows.slot_row < 0)
    idle = ~decoding & ~admits
    poll = jnp.any(state.handed) & (idle | (rows.step % self.poll_every == 0))

    def collect(state):
      got, turn, ids, length, end = call(
          functools.partial(host.collect, F=F, L=L),
          (jax.ShapeDtypeStruct((F,), jnp.int32), jax.ShapeDtypeStruct((F,), jnp.int32),
           jax.ShapeDtypeStruct((F, L), jnp.int32), jax.ShapeDtypeStruct((F,), jnp.int32),
           jax.ShapeDtypeStruct((F,), bool)), state.first_row, idle)
      row = got - state.first_row
      r = jnp.clip(row, 0, N - 1)
      # A result for a row that restarted since it asked is stale: it asks again.
      valid = (got >= 0) & (row < N) & state.handed[r] & (state.calls[r] == turn)
      ends = valid & end
      goes = valid & ~end
      at_end, at_go = jnp.where(ends, row, N), jnp.where(goes, row, N)
      start = rows.length[r]
      return state.replace(
          handed=state.handed.at[jnp.where(valid, row, N)].set(False, mode="drop"),
          stop=state.stop.at[at_end].set(True, mode="drop"),
          wait=state.wait.at[at_go].set(False, mode="drop"),
          inject=state.inject.at[at_go].set(ids, mode="drop"),
          inject_len=state.inject_len.at[at_go].set(length, mode="drop"),
          inject_from=state.inject_from.at[at_go].set(start, mode="drop"),
          turn_start=state.turn_start.at[at_go].set(start + length, mode="drop"),
          calls=state.calls.at[at_go].add(1, mode="drop"),
          closed=state.closed.at[at_go].set(False, mode="drop"))

    state = jax.lax.cond(poll, collect, lambda s: s, state)
    end = state.stop & (rows.status == RUNNING)
    state = state.replace(stop=state.stop & ~end, wait=state.wait & ~end)
    return state, state.wait, end

  def restart(self, state: TurnState, rows: Array) -> TurnState:
    keep = lambda x, v: jnp.where(rows, v, x)  # noqa: E731
    return state.replace(closed=keep(state.closed, False), turn_start=keep(state.turn_start, 0),
                         calls=keep(state.calls, 0), asked=keep(state.asked, False),
                         handed=keep(state.handed, False), wait=keep(state.wait, False),
                         stop=keep(state.stop, False), inject_len=keep(state.inject_len, 0))
