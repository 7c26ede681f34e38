"""The rollout engine: G completions per prompt over a paged KV cache and S decode slots.

Axes: B prompts, G samples per prompt, N = B*G rows, P prompt length,
T = max_new_tokens, S decode slots, M pages of p tokens, V vocabulary.

Reasoning completions are ragged: most rows stop early, a few run to T. The
lockstep sampler (sampler.py) keeps every row's slot and T-token buffer until
the longest row ends. Here a row holds a slot only while it decodes, and its
keys and values only the pages it has filled:

- The B prompts are prefilled once, together, and stored once (their G rows
  read the same keys). Each row's first token is drawn from that prefill.
- S slots decode one row each, in one `lax.while_loop` of static shapes. When
  a row ends (EOS or T tokens), its pages return to the pool and its slot
  takes the lowest-numbered pending row at the next step.
- A row takes a page of the pool when its next token starts one. Rows are
  admitted only while pages remain for every slot's next token. If running
  rows need more pages than are free, the highest-numbered rows are preempted:
  their pages are freed and they start again later from their first token.
- Attention (`ops.paged_attention`) reads the live keys once per step: the
  prompts with a decoding row, the full pages in use and each slot's page in
  progress, not the pool nor S x the longest row.

Row r's token t is drawn with key fold_in(fold_in(rng, r), t), whatever slot,
step or restart it is drawn in: the samples do not depend on S, M or the
order rows run in. `generate` (sampler.py) draws each step's tokens with one
key for all rows instead, so the two agree in distribution, and token for
token when greedy.

The rooms: pages.py (sizes, admission, allocation, preemption, release),
loop.py (the decode loop and the programs that run it), hooks.py (the
row-event hook protocol: code acting on rows as they decode, beside the loop),
streaming.py (DAPO's dynamic sampling as one hook), scorer.py (its
host-side verification while the loop decodes) and carry.py (rows carried from
one rollout to the next, under the weights each update makes).
"""

from grpojax import lazy

__getattr__, __dir__, __all__ = lazy.attach(__name__, {
    "hooks": ["Drawn", "RowHook", "Rows"],
    "loop": ["NO_HOOK", "compute_dtype_matmuls", "generate", "generate_program", "output",
             "program_for", "row_keys", "row_shards", "run", "sharded_program"],
    "pages": ["DONE", "PENDING", "RUNNING", "EngineConfig", "EngineStats"],
    "scorer": ["HostScorer"],
    "streaming": ["Stream", "StreamHook", "StreamOutput", "StreamState", "stream_program"],
})
