"""The run's device programs compiled for real accelerators on this CPU, and their budgets.

Axes: B prompts, G group, N = B·G rows, P prompt length, T completion length,
D model width, F MLP width, V vocab, L layers, Nq query heads, K kv heads,
H head dim.

Each program is lowered on abstract inputs (shapes and shardings, no weights)
and compiled by the target's own compiler through `grpojax.targets` (libtpu,
the CUDA plugin): nothing runs. Per program, one row: compile seconds; peak
bytes (memory_analysis: arguments + outputs + temporaries - aliased); kernels
launched per call (loop bodies times their trips) and in the program text;
the bytes its kernels move (`targets.read_program`'s kernel_bytes, loop
bodies times their trips; the TPU's own cost_analysis count, which takes a
loop body once, is in the JSON) against a floor (the decode step's:
`decode_floor_bytes`); matmul FLOPs read from the optimized
HLO (`targets.read_program`) against the analytic count (`analytic_flops`);
and, on a TPU, the compiler's runtime estimate `optimal_seconds` with the
roofline's share of it, where the estimate is valid (> 0). A program whose
temporaries exceed a TPU's memory is refused by its compiler: its row has the
stated requirement as a lower bound (">=") and nothing else.

The programs, bf16 compute over float32 master weights, as the run holds them
(`plan.abstract_state`, with the loss, optimizer and bf16 reference of
experiments/gsm8k_qwen2_5_0_5b.py), on one chip:
  prefill  `transformer.prefill` of the B prompts (cache for N rows, T - 1 slots).
  decode   one `transformer.decode_step` of N rows on that cache, with the
           `decode_params` weights as `sampler.generate_program` builds them (from the
           float32 master weights); the cache is donated (the loop updates it in place).
  decode_unmerged  with --lora lora: the decode step with the adapters applied at each
           matmul, against "decode", whose `decode_params` merged them into the weights.
  rollout  `sampler.generate_program` (prefill + the decode loop), as the planner's eval.
  update   `train.step.update` on the N-row rollout in --micro-batches
           micro-batches (default 8: 16 rows each), one optimizer step; with
           --remat also "update remat", under full per-layer remat.

  source /tmp/cu/env.sh   # the compilers: GRPOJAX_CUDA_PLUGIN, TPU_LIBRARY_PATH
  python bench/run.py device_programs --models qwen2.5-0.5b --remat --json
  python bench/run.py device_programs --quick   # qwen2_tiny at tiny shapes on XLA:CPU
  python bench/run.py device_programs --models qwen2.5-3b --lora none,lora,qlora \
      --programs decode,decode_unmerged,update   # LoRA (rank 16) and QLoRA (nf4) beside full

--device changes nothing: --targets names the compilers (default h100-80gb and
tpu-v5e; --quick: this CPU's).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
import time

# Compile-only: no backend but the CPU starts (a TPU backend's probes are noise here),
# unless jax is started already (the lora workload runs on the device).
if "jax" not in sys.modules:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import common  # noqa: E402
from grpojax import models, plan, targets  # noqa: E402
from grpojax.models import transformer  # noqa: E402
from grpojax.parallel import mesh as mesh_lib  # noqa: E402
from grpojax.run import settings as settings_lib  # noqa: E402

# Dense bf16 peak FLOP/s and HBM bytes/s per chip, the vendors' published figures:
# TPU v5e: cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 819 GB/s HBM2e);
# H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (989 TFLOP/s bf16 tensor cores
# without sparsity, 3.35 TB/s HBM3).
PEAKS = {
    "tpu-v5e": (197e12, 819e9),
    "h100-80gb": (989e12, 3.35e12),
}
PROGRAMS = ("prefill", "decode", "rollout", "update")
LORA_PROGRAMS = ("decode_unmerged",)  # with --lora lora: the adapters at every matmul
EXPERIMENT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "experiments", "gsm8k_qwen2_5_0_5b.py")
DRY_MODEL = "qwen2_tiny"


@dataclasses.dataclass(frozen=True)
class Shapes:
  rows: int  # N = B·G
  group: int  # G
  prompt: int  # P
  completion: int  # T
  micro_batches: int  # of the update

  @property
  def prompts(self) -> int:
    return self.rows // self.group


# ---------------------------------------------------------------- analytic counts


def matmul_params(cfg) -> int:
  """Weights the layers multiply by, all L layers: q/k/v/o and the gated MLP.
  Embedding and unembedding, norms and biases excluded (a gather, elementwise)."""
  D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  per_layer = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * H + cfg.num_heads * H * D + 3 * D * F
  return cfg.num_layers * per_layer


def forward_flops(cfg, *, tokens: int, pairs: int, logits: int) -> int:
  """2·M·N·K of one forward: the layers' projections over `tokens` positions
  (2·matmul_params each), attention over `pairs` (query, key slot) pairs in every
  layer (q·k and p·v: 4·Nq·H each; XLA scores every slot a mask hides too), and
  the unembedding 2·D·V at `logits` positions."""
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs
  return 2 * matmul_params(cfg) * tokens + attention + 2 * cfg.hidden_size * cfg.vocab_size * logits


def analytic_flops(program: str, cfg, s: Shapes, *, remat: bool = False) -> int:
  """The matmul FLOPs `program` must do at shapes `s`, by hand:

  prefill: B·P prompt positions, each attending all P slots; no unembedding
    (`prefill` returns hidden states).
  decode: N positions, each attending the P prompt slots and all T - 1
    completion slots of the cache (masked ones included); the unembedding of N rows.
  rollout: the prefill, the unembedding of each prompt's last position (B), and
    T - 1 decode steps (the first token comes from the prefill).
  update: 6·matmul_params per trained position (forward, and the backward's two
    products) over B·P prompt positions (each group's prompt runs once) and N·T
    completion positions, attention (prompt: P·P per prompt; completion: T·(P+T)
    per row) likewise 3x its forward. Under full remat the layers' forward runs
    again (the 4/3), less its MLP down projection: no gradient needs that
    product's output, so the recompute leaves it out. The unembedding runs at N·T
    positions (padded to the chunks of `chunked_token_logprobs`): 4x its forward
    always (the forward, its checkpointed recompute, and the two backward products).
  """
  B, N, P, T = s.prompts, s.rows, s.prompt, s.completion
  S = max(T - 1, 1)  # the cache's completion slots (`generate_program` prefills for T - 1)
  prefill = forward_flops(cfg, tokens=B * P, pairs=B * P * P, logits=0)
  decode = forward_flops(cfg, tokens=N, pairs=N * (P + S), logits=N)
  if program == "prefill":
    return prefill
  if program in ("decode", "decode_unmerged"):
    return decode
  if program == "rollout":
    return prefill + forward_flops(cfg, tokens=0, pairs=0, logits=B) + (T - 1) * decode
  if program == "update":
    trained = B * P + N * T
    layers = forward_flops(cfg, tokens=trained, pairs=B * P * P + N * T * (P + T), logits=0)
    down = 2 * cfg.num_layers * cfg.hidden_size * cfg.intermediate_size * trained
    per_micro = N * T // s.micro_batches
    chunk = min(1024, per_micro)  # step.update's chunk_size default
    logits = s.micro_batches * -(-per_micro // chunk) * chunk
    recompute = layers - down if remat else 0
    return 3 * layers + recompute + 4 * forward_flops(cfg, tokens=0, pairs=0, logits=logits)
  raise ValueError(f"program {program!r} is unknown; known: {', '.join(PROGRAMS)}")


def decode_floor_bytes(cfg, s: Shapes) -> int:
  """The bytes one decode step must read at least: every bf16 weight once (the
  tied embedding once, as the unembedding), each group's prompt keys and values
  once (shared by its G rows) and each row's completion cache, all T - 1 slots
  (the last step of a full-length rollout, in bf16)."""
  n_params = sum(math.prod(shape) for shape, _ in models.param_specs(cfg).values())
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # keys + values, bf16
  return 2 * n_params + kv * (s.prompts * s.prompt + s.rows * max(s.completion - 1, 1))


# ---------------------------------------------------------------- programs


def experiment(model: str, s: Shapes):
  """The experiment's config with `model` (a preset, built from scratch) at shapes `s`."""
  spec = importlib.util.spec_from_file_location("gsm8k_experiment", EXPERIMENT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  cfg.model.path, cfg.model.arch = "", model
  cfg.model.dtype = "bfloat16"
  cfg.rollout.prompts_per_step, cfg.rollout.group_size = s.prompts, s.group
  cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length = s.prompt, s.completion
  cfg.train.micro_batches = s.micro_batches
  return cfg


def _on(mesh, tree):
  """tree's shapes as ShapeDtypeStructs replicated on `mesh` (one device: its only layout)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)


def lowerings(cfg, model_cfg, mesh, s: Shapes) -> dict:
  """{program: a thunk returning its jax Lowered}, all on abstract inputs."""
  from grpojax.sampling import sampler
  from grpojax.sampling.strategies import SamplingParams
  from grpojax.train import step

  run = settings_lib.read(cfg)
  state = plan.abstract_state(run, model_cfg, mesh)
  params, mcfg = state.model_params, state.model_config  # with LoRA: the base + adapters
  B, G, N, P, T = s.prompts, s.group, s.rows, s.prompt, s.completion
  rows = lambda n: mesh_lib.row_sharding(mesh, n)  # noqa: E731
  tokens = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=rows(B))
  mask = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=rows(B))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  prefill = functools.partial(transformer.prefill, mcfg, group=G, max_new_tokens=max(T - 1, 1))

  def decode():
    _, cache = jax.eval_shape(prefill, params, tokens, mask)
    weights = jax.eval_shape(functools.partial(transformer.decode_params, mcfg), params)
    last = jax.ShapeDtypeStruct((N,), jnp.int32)
    step_fn = jax.jit(functools.partial(transformer.decode_step, mcfg), donate_argnums=(2,))
    return step_fn.lower(*_on(mesh, (weights, last, cache)))

  def update():
    r, t = run.rollout, run.train
    kw = dict(loss_config=run.loss, group_size=r.group_size,
              num_iterations=t.num_iterations, minibatches=t.minibatches,
              temperature=r.temperature or 1.0, grad_accum_steps=run.optim.grad_accum_steps,
              micro_batches=s.micro_batches)
    return step.update.lower(state, plan.abstract_rollout(run, mesh), rng, **kw)

  def decode_unmerged():  # LoRA's adapters applied at every matmul instead of merged
    _, cache = jax.eval_shape(prefill, params, tokens, mask)
    weights = jax.eval_shape(functools.partial(common.unmerged_decode_weights, mcfg), params)
    last = jax.ShapeDtypeStruct((N,), jnp.int32)
    step_fn = jax.jit(functools.partial(transformer.decode_step, mcfg), donate_argnums=(2,))
    return step_fn.lower(*_on(mesh, (weights, last, cache)))

  return {
      "prefill": lambda: jax.jit(prefill).lower(params, tokens, mask),
      "decode": decode,
      "decode_unmerged": decode_unmerged,
      "rollout": lambda: sampler.generate_program.lower(  # as plan.py's eval
          mcfg, params, tokens, mask, rng, sampling=SamplingParams(temperature=1.0),
          num_samples=G, max_new_tokens=T, eos=(mcfg.vocab_size - 1,), pad_id=0, mesh=mesh),
      "update": update,
  }


def _devices(target: str) -> list:
  """One device of `target` to compile for: the target's own, or this CPU ("cpu")."""
  return jax.devices("cpu")[:1] if target == "cpu" else targets.devices(target, chips=1)


def measure(target: str, model: str, program: str, lower, *, model_cfg, s: Shapes,
            remat: bool = False) -> dict:
  """One row: `lower`'s program compiled for `target`, read and set against the counts.

  A TPU's compiler refuses a program whose temporaries exceed its memory: then
  peak_bytes is its stated requirement (a lower bound, `at_least`) and nothing else is read.
  """
  measured, _, compiled = plan.measure(lower, quiet=True)
  row = dict(target=target, model=model, program=program + (" remat" if remat else ""),
             compile_s=measured["compile_s"], peak_bytes=measured["peak_bytes"],
             at_least=bool(measured.get("at_least")),
             analytic_flops=analytic_flops(program, model_cfg, s, remat=remat),
             floor_bytes=decode_floor_bytes(model_cfg, s) if program.startswith("decode") else None)
  if compiled is None:
    return row
  read = targets.read_program(compiled)
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0] if cost else None
  cost = cost or {}
  row.update(kernels=read.kernels, static_kernels=targets.kernels(compiled), loops=read.loops,
             matmul_flops=read.matmul_flops, kernel_bytes=read.kernel_bytes,
             bytes_accessed=cost.get("bytes accessed"),
             cost_flops=cost.get("flops"), optimal_seconds=cost.get("optimal_seconds"))
  # The prefill's layers are a scan: one top-level loop of L trips.
  layer_loops = [k for n, k in read.loops if n == model_cfg.num_layers]
  row["kernels_per_layer"] = layer_loops[0] if program == "prefill" and layer_loops else None
  seconds = row["optimal_seconds"]
  if target in PEAKS and seconds is not None and seconds > 0:
    # The roofline of the work the compiler counted (cost_analysis: each loop body
    # once, as its optimal_seconds counts it).
    flops_peak, bandwidth = PEAKS[target]
    row["roofline_s"] = max((row["cost_flops"] or 0) / flops_peak,
                            (row["bytes_accessed"] or 0) / bandwidth)
    row["roofline_pct"] = 100 * row["roofline_s"] / seconds
  return row


def decode_kernels_per_layer(cfg, model_cfg, mesh, s: Shapes, kernels: int) -> float:
  """Kernels per decoder layer of the decode step (`kernels` at L layers): its layers
  are unrolled, no scan to read, so (kernels - the step's at 1 layer) / (L - 1), a
  mean: XLA fuses a few ops across neighbouring layers (22 or 23 a layer on an H100)."""
  L = model_cfg.num_layers
  if L == 1:
    return float(kernels)
  lower = lowerings(cfg, model_cfg.replace(num_layers=1), mesh, s)["decode"]
  return (kernels - targets.read_program(lower().compile()).kernels) / (L - 1)


def run_target(target: str, model: str, s: Shapes, programs, *, remat: bool,
               lora: str = "none", log=print) -> list[dict]:
  """The rows of one target and model, each printed as it compiles. lora: "none" (full
  fine-tuning), "lora" (rank 16, alpha 32, all projections) or "qlora" (the same on an
  nf4 base); the model column then reads e.g. "qwen2.5-3b+lora"."""
  model_cfg = models.get_preset(model).replace(dtype="bfloat16", kernels="xla")
  cfg = experiment(model, s)
  if lora != "none":
    cfg.model.lora.rank, cfg.model.lora.alpha = 16, 32.0
    cfg.model.lora.quantize = "nf4" if lora == "qlora" else "none"
    model = f"{model}+{lora}"
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=_devices(target))
  lower = lowerings(cfg, model_cfg, mesh, s)
  rows = []
  for program in programs:
    row = measure(target, model, program, lower[program], model_cfg=model_cfg, s=s)
    if program == "decode" and "kernels" in row:
      row["kernels_per_layer"] = decode_kernels_per_layer(cfg, model_cfg, mesh, s, row["kernels"])
    rows.append(row)
    log(format_row(row))
    if program == "update" and remat:
      lower_remat = lowerings(cfg, model_cfg.replace(remat=True), mesh, s)["update"]
      rows.append(measure(target, model, program, lower_remat, model_cfg=model_cfg, s=s,
                          remat=True))
      log(format_row(rows[-1]))
  return rows


# ---------------------------------------------------------------- the table

COLUMNS = (("target", 10), ("model", 13), ("program", 14), ("compile s", 9), ("peak GiB", 9),
           ("kernels", 8), ("static", 7), ("/layer", 6), ("bytes GB", 9), ("floor GB", 9),
           ("x floor", 7), ("mm GFLOP", 11), ("analytic", 11), ("mm/an", 6), ("opt ms", 9),
           ("roof %", 7))


def header() -> str:
  return " ".join(f"{name:>{w}}" if i > 2 else f"{name:<{w}}"
                  for i, (name, w) in enumerate(COLUMNS))


def format_row(r: dict) -> str:
  def num(x, scale=1, fmt=".2f"):
    return "-" if x is None else f"{x / scale if scale != 1 else x:{fmt}}"

  flops, analytic = r.get("matmul_flops"), r["analytic_flops"]
  cells = (r["target"], r["model"], r["program"], num(r["compile_s"], fmt=".1f"),
           (">=" if r["at_least"] else "") + num(r["peak_bytes"], 2**30),
           num(r.get("kernels"), fmt="d"), num(r.get("static_kernels"), fmt="d"),
           num(r.get("kernels_per_layer"), fmt=".3g"), num(r.get("kernel_bytes"), 1e9),
           num(r["floor_bytes"], 1e9),
           num(r["floor_bytes"] and r.get("kernel_bytes") and r["kernel_bytes"] / r["floor_bytes"]),
           num(flops, 1e9, ".4g"), num(analytic, 1e9, ".4g"),
           num(None if flops is None else flops / analytic, fmt=".3f"),
           num(r.get("optimal_seconds"), 1e-3, ".3g"), num(r.get("roofline_pct"), fmt=".0f"))
  return " ".join(f"{c:>{w}}" if i > 2 else f"{c:<{w}}"
                  for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS)))




def add_arguments(parser) -> None:
  parser.add_argument("--targets", default=None,
                      help="comma-separated: h100-80gb, tpu-v5e, ... or cpu (default: "
                      "h100-80gb,tpu-v5e; with --quick, cpu)")
  parser.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b",
                      help="grpojax.models presets, comma-separated")
  parser.add_argument("--programs", default=",".join(PROGRAMS),
                      help=", ".join(PROGRAMS + LORA_PROGRAMS) + " (decode_unmerged: with "
                      "--lora lora only)")
  parser.add_argument("--rows", type=int, default=128, help="N = prompts x group")
  parser.add_argument("--group", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=128, help="P, prompt tokens")
  parser.add_argument("--completion", type=int, default=256, help="T, completion tokens")
  parser.add_argument("--micro-batches", type=int, default=8,
                      help="the update's micro-batches of the N rows (8: 16 rows each)")
  parser.add_argument("--remat", action="store_true",
                      help="also the update with full per-layer remat")
  parser.add_argument("--lora", default="none",
                      help="comma-separated: none (full fine-tuning), lora (rank 16, all "
                      "projections), qlora (the same on an nf4 base)")


def run(args) -> dict:
  if args.quick:
    args.models = DRY_MODEL
    args.rows, args.group, args.prompt, args.completion, args.micro_batches = 8, 4, 8, 8, 2
  names = (args.targets or ("cpu" if args.quick else "h100-80gb,tpu-v5e")).split(",")
  programs = args.programs.split(",")
  unknown = sorted(set(programs) - set(PROGRAMS + LORA_PROGRAMS))
  if unknown:
    raise SystemExit(f"--programs {','.join(unknown)} unknown; known: "
                     f"{', '.join(PROGRAMS + LORA_PROGRAMS)}")
  if args.rows % args.group or (args.rows // args.group) % args.micro_batches:
    raise SystemExit(f"--rows {args.rows} must be whole groups of {args.group}, in "
                     f"--micro-batches {args.micro_batches} of whole groups")
  s = Shapes(args.rows, args.group, args.prompt, args.completion, args.micro_batches)
  print(f"{s.prompts} prompts x G={s.group} = {s.rows} rows, P={s.prompt}, T={s.completion}; "
        f"update in {s.micro_batches} micro-batches of {s.rows // s.micro_batches} rows; bf16 "
        "compute, float32 master weights", flush=True)
  print(header(), flush=True)
  rows, t0 = [], time.perf_counter()
  for target in names:
    if target != "cpu" and not targets.available(target):
      install = targets.INSTALL if target in targets.TPUS else targets.CUDA_INSTALL
      print(f"{target}: skipped, its compiler is not installed ({install})", flush=True)
      continue
    for model in args.models.split(","):
      for lora in args.lora.split(","):
        wanted = [p for p in programs if p != "decode_unmerged" or lora == "lora"]
        rows += run_target(target, model, s, wanted, remat=args.remat, lora=lora,
                           log=lambda line: print(line, flush=True))
  print(f"{len(rows)} programs compiled in {time.perf_counter() - t0:.0f} s", flush=True)
  return dict(shapes=dataclasses.asdict(s), peaks=PEAKS, rows=rows)
