"""DAPO's dynamic sampling: the engine streaming groups (`engine.stream_program`) against
whole rounds of `engine.generate`, on ragged completions where a fraction of the
groups are degenerate (every row the same reward: dropped).

Both pick the same groups (tests/test_train_rollout.py proves it token for token);
this times them. A group is accepted or not by a table the host looks up, drawn
with probability --accept, after --verify-ms of "verification" (a sleep, the
same for each call however many groups it holds: verifiers in parallel);
completion lengths are lognormal (median T/8) through the engine's stop hook, as
bench/engine.py. Three ways:
  stream    the loop waits for each call (an io_callback as groups end);
  overlap   groups handed to host threads while the loop decodes (engine.HostScorer,
            the rollout's default);
  rounds    engine.generate batch by batch, each round's groups verified in one call.

  python bench/stream.py                              # Qwen2.5-0.5B shapes, bf16, GPU kernels
  python bench/stream.py --model small --kernels xla --dtype float32 --prompts 4 --T 64 --quick
  python bench/stream.py ... --verify-ms 50      # slow verifiers: what overlapping buys

Prints each run's seconds and groups decoded, then one JSON line:
{"stream_s": .., "overlap_s": .., "rounds_s": .., "rounds_vs_stream": .., "groups_stream": ..,
 "groups_overlap": .., "groups_rounds": ..}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from grpojax.sampling import engine as engine_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine as bench  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default=bench.QWEN)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--kernels", default="gpu")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--groups", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--slots", type=int, default=256)
  parser.add_argument("--T", type=int, default=1024)
  parser.add_argument("--rounds", type=int, default=4, help="batches drawn at most")
  parser.add_argument("--accept", type=float, default=0.5, help="P(a group is accepted)")
  parser.add_argument("--verify-ms", type=float, default=0.0,
                      help="milliseconds each verification call takes")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true", help="one timed call each")
  args = parser.parse_args(argv)
  cfg, weights = bench.bench_model(args.model, args.seed, args.dtype, args.kernels)
  B, G, R, T, V = args.prompts, args.groups, args.rounds, args.T, cfg.vocab_size
  rng = np.random.default_rng(args.seed)
  prompts = jnp.asarray(rng.integers(0, V - 1, (R, B, args.prompt_len)), jnp.int32)
  mask = jnp.ones_like(prompts)
  ids = jnp.arange(R * B, dtype=jnp.int32).reshape(R, B)
  accept = rng.random(R * B) < args.accept
  stop = jnp.asarray(np.stack([bench.draw_lengths(args.seed + r, B * G, T, 1.0)
                               for r in range(R)]), jnp.int32)
  eng = engine_lib.EngineConfig(slots=args.slots, page_size=engine_lib.EngineConfig().page_size)
  kw = dict(sampling=bench.SAMPLING, num_samples=G, max_new_tokens=T, eos=(V - 1,), pad_id=0,
            engine=eng)
  calls = []
  verify = lambda: time.sleep(args.verify_ms / 1e3)  # noqa: E731

  def host_accept(ids_F, valid):
    calls.append(int(np.sum(valid)))
    verify()
    return accept[np.asarray(ids_F)] & np.asarray(valid)

  def score(ids_F, tokens, mask_, valid):
    ok = io_callback(host_accept, jax.ShapeDtypeStruct(valid.shape, bool), ids_F, valid)
    return (jnp.zeros((tokens.shape[0], 1), jnp.float32), jnp.zeros((1,), jnp.int32), ok)

  def score_rows(ids_rows, tokens, mask_, valid):  # HostScorer's: a reward per row
    verify()
    return (np.where(valid, accept[ids_rows], np.nan).astype(np.float32)[:, None],
            np.zeros((1, 1), np.int32))

  scorer = engine_lib.HostScorer(score_rows)
  streams = {
      "stream": engine_lib.Stream(score=score, groups=B, rewards=1),
      "overlap": engine_lib.Stream(groups=B, rewards=1, host=scorer,
                                   accept=lambda r, valid: valid & (r[::G, 0] > 0.5)),
  }
  key = jax.random.key(args.seed)

  def streamed(name):
    scorer.begin()
    out, extra, _ = engine_lib.stream_program(cfg, weights, prompts, mask, ids, key,
                                              stream=streams[name], stop_at=stop, **kw)
    return int(np.asarray(extra.decoded).sum()), np.asarray(extra.example_ids)

  def rounds():
    picked, decoded = [], 0
    for r in range(R):
      out, _ = engine_lib.generate_program(cfg, weights, prompts[r], mask[r],
                                           key if r == 0 else jax.random.fold_in(key, r),
                                           stop_at=stop[r], **kw)
      out.lengths.block_until_ready()
      verify()  # the round's groups, verified together
      decoded += B
      picked += [int(i) for i in np.asarray(ids[r]) if accept[i]]  # the host scores the round
      if len(picked) >= B:
        break
    return decoded, np.asarray(picked[:B])

  timed = {}
  for name, fn in (("stream", lambda: streamed("stream")),
                   ("overlap", lambda: streamed("overlap")), ("rounds", rounds)):
    fn()  # compiles
    best = None
    for _ in range(1 if args.quick else 2):
      t = time.perf_counter()
      groups, chosen = fn()
      s = time.perf_counter() - t
      best = s if best is None else min(best, s)
    timed[name] = (best, groups, chosen)
    print(f"  {name}: {best:.2f} s, {groups} groups begun", flush=True)
  n = min(len(timed["stream"][2]), len(timed["rounds"][2]))
  assert np.array_equal(timed["stream"][2][:n], timed["rounds"][2][:n]), "different groups"
  assert np.array_equal(timed["stream"][2], timed["overlap"][2]), "different groups"
  out = dict(device=jax.devices()[0].device_kind, B=B, G=G, T=T, rounds=R, accept=args.accept,
             verify_ms=args.verify_ms, stream_s=timed["stream"][0],
             overlap_s=timed["overlap"][0], rounds_s=timed["rounds"][0],
             rounds_vs_stream=timed["rounds"][0] / timed["stream"][0],
             stream_vs_overlap=timed["stream"][0] / timed["overlap"][0],
             groups_stream=timed["stream"][1], groups_overlap=timed["overlap"][1],
             groups_rounds=timed["rounds"][1],
             callbacks_per_stream_run=len(calls) // (1 + (1 if args.quick else 2)))
  print(json.dumps(out), flush=True)
  return out


if __name__ == "__main__":
  main()
