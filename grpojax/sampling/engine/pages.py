"""The engine's page bookkeeping: its sizes, admission, page allocation, preemption
and release, over a paged KV cache (models.cache.PagedCache) and S decode slots.

Axes: N rows, S slots, M pages of p tokens, T = max_new_tokens.

The functions take the decode loop's state (loop.State, or anything with its
status [N], length [N], eos [N], cache and stats fields) and return it updated;
none runs a loop of its own (a GPU would run each trip from the host).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array
PENDING, RUNNING, DONE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static sizes of the engine (hashable: part of the jitted program's identity).

  slots: S rows decoded at once; 0 is all N rows.
  page_size: p tokens per page.
  pages: M pages in the pool, at most (and 0 is) enough for every slot at full
    length (S * ceil(T / p), no preemption). Fewer pages hold only live
    tokens (grpojax.plan.fit_pages sizes them to the memory budget); one row
    at full length must fit.
  tail_slots: the narrower widths the loop steps down to for a run's tail. Once
    no row is pending and at most n rows run (n the next width), the running
    slots are gathered into n slots and the loop goes on in a step over n: its
    draw, products and bookkeeping shrink with the slots, its weight reads do
    not (on an H200 at Qwen2.5-0.5B's shapes, one live row: 2.55 ms a step at
    S = 256, 1.61 at 16; bench/RESULTS.md). Each width is one more compiled
    loop body. None: S/4, S/16, ... while at least 16 (`tail`); (): never.
  """

  slots: int = 0
  page_size: int = 128
  pages: int = 0
  tail_slots: tuple[int, ...] | None = None

  def __post_init__(self):
    for key, why in (("slots", "must be >= 0 (0: every row at once)"),
                     ("pages", "must be >= 0 (0: enough for every slot at full length)"),
                     ("page_size", "must be >= 1 (tokens per KV page)")):
      if getattr(self, key) < (key == "page_size"):
        raise ValueError(f"EngineConfig.{key}={getattr(self, key)!r} {why}")
    if self.tail_slots is not None:
      if (not isinstance(self.tail_slots, tuple)
          or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.tail_slots)):
        raise ValueError(f"EngineConfig.tail_slots={self.tail_slots!r} must be automatic (None), "
                         "none (()) or slot counts >= 1 (a tuple)")

  def tail(self, slots: int) -> tuple[int, ...]:
    """The widths, widest first and each under S = slots, that a run's tail narrows to."""
    if self.tail_slots is None:
      widths, n = [], slots // 4
      while n >= 16:
        widths.append(n)
        n //= 4
      return tuple(widths)
    return tuple(sorted({n for n in self.tail_slots if n < slots}, reverse=True))

  def sizes(self, rows: int, max_new_tokens: int) -> tuple[int, int]:
    """(S, M) for N = rows and T = max_new_tokens; raises when M cannot hold one row."""
    S = min(self.slots or rows, rows)
    per_row = -(-max_new_tokens // self.page_size)
    M = min(self.pages, S * per_row) if self.pages else S * per_row
    if M < per_row:
      raise ValueError(f"EngineConfig.pages={self.pages} cannot hold one completion of "
                       f"{max_new_tokens} tokens in pages of {self.page_size}: give 0 (every "
                       f"slot at full length) or at least {per_row}")
    return S, M

  def per_shard(self, shards: int, max_new_tokens: int) -> EngineConfig:
    """Each of `shards` row shards' engine: its share of the slots and pages (rounded
    up), and at least one completion of max_new_tokens' pages."""
    share = lambda n: -(-n // shards)  # noqa: E731
    pages = self.pages and max(share(self.pages), -(-max_new_tokens // self.page_size))
    tail = None if self.tail_slots is None else tuple(share(n) for n in self.tail_slots)
    return dataclasses.replace(self, slots=share(self.slots), pages=pages, tail_slots=tail)




@flax.struct.dataclass
class EngineStats:
  """What a run of the engine did: steps [] decode steps, preempted [] rows restarted,
  pages_peak [] most pages held at once, keys_read [] keys (each with its value)
  one layer's attention read over all steps (ops.paged_keys_read), and
  live_keys [] the keys the decoded rows attended to (each row its prompt and
  its tokens so far; float32, as it can pass 2**31), tail_steps [] of the steps
  those taken narrowed (EngineConfig.tail_slots), full_steps [] those with every
  one of the S slots decoding a row (the slots' occupancy: full_steps / steps)."""

  steps: Array
  preempted: Array
  pages_peak: Array
  keys_read: Array
  live_keys: Array
  tail_steps: Array
  full_steps: Array

  @classmethod
  def of_shards(cls, stats: EngineStats) -> EngineStats:
    """The stats of a run over row shards from theirs ([d] each): steps the most any
    took, pages_peak the sum of their peaks, full_steps the fewest any had (a shard's
    slots are its share), the rest summed."""
    return cls(steps=jnp.max(stats.steps), preempted=jnp.sum(stats.preempted),
               pages_peak=jnp.sum(stats.pages_peak), keys_read=jnp.sum(stats.keys_read),
               live_keys=jnp.sum(stats.live_keys), tail_steps=jnp.max(stats.tail_steps),
               full_steps=jnp.min(stats.full_steps))




def admit(state, p: int, held: Array | None = None):
  """Idle slots take the lowest-numbered pending rows, as many as the free pages allow
  once every running slot has the page its next token may start. held: [N] bool rows
  that wait (a hook's): they feed no new token."""
  c = state.cache
  S, N = c.slots, state.status.shape[0]
  idle = c.slot_row < 0
  pending = state.status == PENDING
  free = jnp.sum(c.page_owner < 0)
  needs = jnp.sum(needs_page(state, p, held))
  allowed = jnp.clip(free - needs, 0, S)
  idle_rank = jnp.cumsum(idle) - 1
  pend_rank = jnp.cumsum(pending) - 1
  by_rank = jnp.full((S,), -1, jnp.int32).at[jnp.where(pending, pend_rank, S)].set(
      jnp.arange(N, dtype=jnp.int32), mode="drop")
  take = idle & (idle_rank < allowed)
  new = jnp.where(take, by_rank[jnp.clip(idle_rank, 0, S - 1)], -1)
  take = take & (new >= 0)
  slot_row = jnp.where(take, new, c.slot_row)
  return state.replace(
      status=state.status.at[jnp.where(take, new, N)].set(RUNNING, mode="drop"),
      length=state.length.at[jnp.where(take, new, N)].set(1, mode="drop"),
      cache=c.replace(slot_row=slot_row,
                      slot_position=jnp.where(take, 0, c.slot_position)))


def needs_page(state, p: int, held: Array | None = None) -> Array:
  """[S] bool: running slots whose fed token starts a page (a held row's [N] fed token
  is one it fed before: its page is there)."""
  c = state.cache
  need = (c.slot_row >= 0) & (c.slot_position % p == 0)
  if held is not None:
    need = need & ~held[jnp.maximum(c.slot_row, 0)]
  return need


def allocate(state, p: int, held: Array | None = None):
  """Gives each slot whose fed token starts a page a free page (the lowest-numbered
  first), preempting the highest-numbered rows when too few are free. held: as `admit`."""
  c = state.cache
  S, M = c.slots, c.num_pages
  running = c.slot_row >= 0
  need = needs_page(state, p, held)
  free = jnp.sum(c.page_owner < 0)
  # Preemption: evict the j highest-numbered running rows, the smallest j that leaves
  # enough pages for the needs of the rest (j = all always does).
  held = jnp.where(running, -(-c.slot_position // p), 0)
  order = jnp.argsort(jnp.where(running, -c.slot_row, 1))  # highest rows first, idle last
  freed = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(held[order])])
  spared = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(need[order].astype(jnp.int32))])
  enough = free + freed >= jnp.sum(need) - spared
  evict = jnp.argmax(enough)  # the first j that suffices
  victim = jnp.zeros((S,), bool).at[order].set(jnp.arange(S) < evict) & running
  state = release(state, victim, restart=True)
  c = state.cache
  need = need & ~victim
  # The i-th needing slot gets the i-th free page.
  rank = jnp.cumsum(need) - 1
  # Unrolled: the default method is a while loop that a GPU runs from the host, one
  # trip after another, log2(M) trips every step (bench/RESULTS.md, the H100 profile).
  page = jnp.searchsorted(jnp.cumsum(c.page_owner < 0), rank + 1, side="left",
                          method="scan_unrolled").astype(jnp.int32)
  page = jnp.where(need, page, M)
  in_use = jnp.sum(c.page_owner >= 0) + jnp.sum(need)
  return state.replace(
      cache=c.replace(
          page_owner=c.page_owner.at[page].set(jnp.arange(S, dtype=jnp.int32), mode="drop"),
          page_start=c.page_start.at[page].set(c.slot_position, mode="drop"),
          # A slot writes only its newest page: no page table is kept (reads go
          # by owner, releases by owner).
          slot_page=jnp.where(need, page, c.slot_page)),
      stats=state.stats.replace(
          preempted=state.stats.preempted + jnp.sum(victim),
          pages_peak=jnp.maximum(state.stats.pages_peak, in_use)))


def release(state, slots: Array, restart: bool = False):
  """Frees the pages and slots of `slots` [S] bool; with restart, their rows are pending
  again (they will draw the same tokens, from the same keys)."""
  c = state.cache
  N = state.status.shape[0]
  owner_released = slots[jnp.maximum(c.page_owner, 0)] & (c.page_owner >= 0)
  if restart:
    status = state.status.at[jnp.where(slots, c.slot_row, N)].set(PENDING, mode="drop")
    state = state.replace(status=status,
                          eos=state.eos.at[jnp.where(slots, c.slot_row, N)].set(False, mode="drop"))
  return state.replace(
      cache=c.replace(page_owner=jnp.where(owner_released, -1, c.page_owner),
                      slot_row=jnp.where(slots, -1, c.slot_row),
                      slot_page=jnp.where(slots, c.num_pages, c.slot_page)))
