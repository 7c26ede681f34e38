"""Row-event hooks: code that acts on the engine's rows as they decode, beside the
decode loop rather than inside it.

Axes: B prompts, G samples per prompt, N = B*G rows, T = max_new_tokens, X the
rows of one event (S slots in a decode step, N at the first token).

A hook is a static object (hashable: part of the jitted program's identity)
with a state pytree of its own that the loop carries beside its own. The loop
calls it at fixed points, each a traceable function of (hook state, what
happened) -> hook state:

- `init(B, G)`: its state before the first token; `placed(state, first_row)`:
  that state in an engine whose row 0 is row `first_row` of all (a row shard's).
- `begin_step(state, rows)`: at the start of every decode step, the rows as
  the last step left them (the rows that ended have status DONE): where a hook
  acts on rows that ended (DAPO's streaming scores a group once all its rows
  have). A hook gates its own work (`lax.cond`) where a step has nothing for it.
- `draw(state, rows, event)`: after each token is drawn, the rows that drew one
  (`Drawn`): a hook may put a token of its own in place of the one drawn
  (a tool's response, fed back in as the row goes on). Such tokens exist (they
  are attended to and take positions) but are not the policy's: the engine
  gives them logp 0 and loss_mask 0, and they never end a row.
- `restart(state, rows)`: rows [N] bool were preempted and will decode again
  from their first token, drawing the same tokens with the same keys.
- `more(state, rows)`: whether the run must go on ([] bool), or None for the
  engine's own rule (until every row is DONE).

`RowHook` does nothing at each of them; a hook overrides what it needs.
`forces`: set True by a hook whose `draw` may put tokens of its own, so the
engine keeps a loss mask ([N, T]) and returns it (SampleOutput.loss_mask).
`holds`: set True by a hook that holds rows (`held`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class Rows:
  """The engine's rows as a hook sees them.

  tokens: [N, T] int32 drawn so far (pad_id past length). length: [N] tokens so
  far. status: [N] int32 PENDING / RUNNING / DONE (engine.pages). eos: [N]
  bool, the row ended with an EOS. slot_row: [S] the row each slot decodes (-1
  idle). step: [] decode steps taken.
  """

  tokens: Array
  length: Array
  status: Array
  eos: Array
  slot_row: Array
  step: Array


@flax.struct.dataclass
class Drawn:
  """One draw's rows: row [X] int32 the row of each entry (N: none), position [X]
  the token's position in its row, token [X] the token drawn, active [X] bool
  whether the entry is a row at all (a slot may be idle)."""

  row: Array
  position: Array
  token: Array
  active: Array


class RowHook:
  """A hook that does nothing: the base of every hook (see the module's docstring)."""

  forces = False
  holds = False

  def init(self, num_prompts: int, group: int):
    return ()

  def placed(self, state, first_row):
    return state

  def begin_step(self, state, rows: Rows):
    return state

  def draw(self, state, rows: Rows, drawn: Drawn) -> tuple[object, Array, Array]:
    """(state, token [X] to keep, forced [X] bool: the entries whose token is the hook's)."""
    return state, drawn.token, jnp.zeros_like(drawn.active)

  def goes_on(self, state, drawn: Drawn) -> Array:
    """[X] bool: the entries of `drawn` whose EOS does not end their row."""
    return jnp.zeros_like(drawn.active)

  def held(self, state, rows: Rows) -> tuple[object, Array, Array]:
    """(state, held [N] bool: rows that wait this step, end [N] bool: rows that end now)."""
    none = jnp.zeros(rows.status.shape, bool)
    return state, none, none

  def restart(self, state, rows: Array):
    return state

  def more(self, state, rows: Rows) -> Array | None:
    return None

  # Static in the program: two hooks are one program's when they are equal.
  def __hash__(self):
    return hash((type(self), tuple(sorted(vars(self).items()))))

  def __eq__(self, other):
    return type(self) is type(other) and vars(self) == vars(other)
