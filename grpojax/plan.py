"""`python -m grpojax.plan --config X [--device h100-80gb] [--devices N] [--json]`: will it fit?
`python -m grpojax.plan --install-compilers`: the devices' compilers, beside the venv.

Lowers and compiles the run's own programs (rollout, update, eval generate, SFT
step) ahead of time on abstract inputs (shapes and shardings, no weights, no
device memory), and reports per program the bytes per device XLA's
memory_analysis gives, matmul FLOPs per call (`targets.read_program`: a loop's
body times its trips) and compile seconds, against a device's memory.

For `--device tpu-v5e|tpu-v6e|h100-80gb|...` with that device's compiler
installed (libtpu, or the CUDA plugin: `grpojax.targets`), the programs compile
for the device itself, on this machine: the bytes per device and compile
seconds are its compiler's (`--devices N`: a TPU slice of 1, 4 or 8 chips, or
N GPUs of one host). Otherwise, off the accelerator, they compile for XLA:CPU
on a mesh of fake CPU devices (`--devices N`): the byte counts are XLA:CPU's
for the same programs, a proxy whose measured error (PROXY_ERROR) the output
quotes in one line. Each compile is announced on stderr as it starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys

from grpojax import targets  # no JAX: the command line's flags and --help need only its names


_HELP_FLAGS = {"-?", "--help", "--helpshort", "--helpfull", "--helpxml"}


def _define_flags(help_only: bool = False):
  """The command line's flags (absl), defined before JAX loads. help_only: --config as a
  plain string, as loading the experiment imports JAX (seconds) only to print text."""
  from absl import flags
  from ml_collections import config_flags

  # The same default experiment as grpojax.main (whose flags cannot be imported twice).
  default = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "arithmetic_tiny.py")
  return dict(
      config=(flags.DEFINE_string("config", default, "Experiment config file.") if help_only
              else config_flags.DEFINE_config_file("config", default, "Experiment config file.",
                                                   lock_config=True)),
      device=flags.DEFINE_string("device", "", f"budget of a device: {', '.join(targets.DEVICES)}; "
                                 "default: the detected device"),
      devices=flags.DEFINE_integer("devices", 0, "plan on N devices (the run's mesh): fake CPU "
                                   "devices, or N of the target's own (a TPU slice of 1, 4 "
                                   "or 8 chips; 1-8 GPUs)"),
      memory_gb=flags.DEFINE_float("memory_gb", 0.0,
                                   "budget in GiB per device (overrides --device)"),
      json=flags.DEFINE_boolean("json", False, "also print one JSON object on the last line"),
      compare=flags.DEFINE_string("compare", "", "'ppo': plan the run as configured and as PPO "
                                  "with a learned critic (same samples per step), side by side"),
      install=flags.DEFINE_boolean(
          "install-compilers", False, "install the TPU and NVIDIA compilers (libtpu, the CUDA "
          "plugin) beside the venv, where --device finds them; then exit"))


# `--devices N` means N fake CPU devices (or N of a target's): the flag must be set
# before JAX creates its CPU client. A plan for a named device compiles for it from
# here and starts no other backend (whose probes, e.g. for a TPU, are noise on this host).
if __name__ == "__main__":
  _FLAGS = _define_flags(help_only=bool(_HELP_FLAGS & set(sys.argv[1:])))
  if _HELP_FLAGS & set(sys.argv[1:]):
    from absl import app
    app.run(lambda argv: 0)  # prints the usage and exits, before JAX loads
  for i, arg in enumerate(sys.argv):
    value = lambda: arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]  # noqa: E731
    if arg.startswith("--devices") and int(value()) > 0:
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                 + f" --xla_force_host_platform_device_count={int(value())}")
      os.environ["JAX_PLATFORMS"] = "cpu"
    elif arg.startswith("--device") and not arg.startswith("--devices") and value():
      os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from grpojax import config as config_lib  # noqa: E402
from grpojax.models import lora as lora_lib  # noqa: E402
from grpojax.run import settings as settings_lib  # noqa: E402
from grpojax.run.assemble import assemble  # noqa: E402
# The fitting lives with the run's assembly (the trainer sizes itself with it); its
# names stay readable here, where the planner's users have always found them.
from grpojax.run.fit import (  # noqa: E402,F401
    DEVICES, Fit, GiB, abstract_opt_state, abstract_rollout, abstract_state, bytes_per_device,
    device_memory, fit, fit_engine, fit_pages, live_pages_peak, load_program, measure,
    memory_budget, page_bytes, peak_bytes, update_bytes)

# How far XLA:CPU's GiB per device have been from the devices' own compilers, program
# by program, (proxy - device) / device: the range of docs/devices.md's table, which
# `python bench/run.py plan_proxy --write` rewrites with this line.
PROXY_ERROR = (0.11, 0.87)
_NO_TARGET_NOTE = ("{name}'s compiler is not installed, so these are XLA:CPU's byte counts, "
                   "a proxy measured {low:+.0%} to {high:+.0%} off the devices' own compilers "
                   "per program (docs/devices.md); for the device's own: {install}")


def target_kernels(name: str, mesh) -> str:
  """The grpojax.ops backend `model.kernels="auto"` picks on device `name` with
  `mesh`'s devices (ops.resolve's rule): its Pallas attention where this host
  compiles for it, else XLA's (XLA:CPU's proxy cannot lower a Mosaic or Triton kernel)."""
  if not targets.compile_only(mesh):
    return "xla"
  if name in targets.TPUS:
    return "tpu" if mesh.size == 1 else "xla"
  return "gpu" if name in targets.GPUS else "xla"


class _TargetRewards:
  """The reward callback's stand-in in a program compiled for a device this host
  lacks: JAX lowers a host callback only against a running backend of the
  device's platform. Same outputs (rewards [N, K], errors [K]), read from the
  tokens as the callback reads them; the callback itself holds no device memory
  beyond those outputs."""

  def __init__(self, host):
    self.host, self.names = host, host.names

  def __call__(self, example_ids, tokens, mask, *, reward_params=None, **_):
    n, k = tokens.shape[0], len(self.names)
    rewards = jnp.broadcast_to(mask.sum(-1, keepdims=True).astype(jnp.float32), (n, k))
    models = getattr(self.host, "models", ())
    if models:  # their forward is the program's own: compile it on stand-in ids
      lengths = mask.sum(-1).astype(jnp.int32)
      scored = [m.score(p, jnp.broadcast_to(tokens[:, :1], (n, m.max_length)), lengths)
                for m, p in zip(models, reward_params)]
      rewards = jnp.concatenate([rewards[:, :k - len(models)], jnp.stack(scored, 1)], axis=1)
    return rewards, jnp.zeros((k,), jnp.int32)

  def close(self):
    self.host.close()


class _TargetTools:
  """The tool host's stand-in in a program compiled for a device this host lacks (see
  _TargetRewards): traceable, it takes the hand-offs and answers none."""

  traceable = True

  def submit(self, first_row, rows, *_):
    return jnp.zeros((), jnp.int32)

  def collect(self, first_row, wait, *, F: int, L: int):
    return (jnp.full((F,), -1, jnp.int32), jnp.zeros((F,), jnp.int32),
            jnp.zeros((F, L), jnp.int32), jnp.zeros((F,), jnp.int32), jnp.zeros((F,), bool))


def plan(cfg, *, device: str = "", memory_bytes: int | None = None, devices: int = 0,
         progress=None) -> dict:
  """The plan of experiment `cfg` on the current devices: a JSON-able dict.

  With the named `device`'s compiler here (`grpojax.targets`), the programs
  compile for `devices` of it (default: as many as this host's local devices).

  Each program's `peak_bytes` is the compiler's peak per device (`measure`);
  `total_bytes` adds the train state it does not take as arguments but which
  stays on the device while it runs (e.g. Adam's moments during the rollout),
  none for a program the compiler refused (its stated need is a lower bound).
  A QLoRA run's "load" is its start-up: the quantiser of the largest projection, with
  the rest of the frozen base (quantised as it was loaded) resident.
  progress: called with one line before each wait (a fit, a program's compile).
  """
  from grpojax.parallel import mesh as mesh_lib
  from grpojax.rewards.runtime.host import HostRewards
  from grpojax.sampling import engine as engine_lib
  from grpojax.sampling import sampler
  from grpojax.sampling.strategies import SamplingParams
  from grpojax.train import sft, step
  from grpojax.train import strategy as strategy_lib

  s = settings_lib.read(cfg)  # the plan's one read of the config
  name, budget = device_memory(device)
  if memory_bytes:
    budget = int(memory_bytes)
  # The target's own compiler where this machine has it: as many chips as there
  # are (fake) local devices.
  target_devices = None
  if name in targets.known() and targets.available(name):
    target_devices = targets.devices(name, chips=devices or jax.device_count())
  mesh = mesh_lib.make_mesh(s.parallel.mesh_shape, devices=target_devices)
  compiler = ("its own compiler" if target_devices is not None else
              "XLA:CPU" + ("" if name == "cpu" else f" as a proxy: {name}'s compiler is not here"))
  say = progress or (lambda line: None)

  def compiling(program):
    say(f"plan: compiling {program} for {mesh.size} x {name} ({compiler})")

  if "auto" in (s.train.micro_batches, s.model.remat, s.rollout.decode_slots,
                s.rollout.kv_pages):
    say(f"plan: fitting the run to {name}'s memory (each layout it tries is a compile)")
  # The run's own assembly, abstract; the named device's memory and (where the target
  # is not this CPU) its kernels, not this host's.
  parts = assemble(s, mesh, abstract=True, device_bytes=budget,
                   kernels=None if name == "cpu" else target_kernels(name, mesh))
  s, tokenizer, fitted, unfitted = parts.settings, parts.tokenizer, parts.fitted, parts.unfit
  model_cfg, reward_models = parts.model_config, parts.reward_models
  state = parts.with_reward_models(parts.state)
  r, t = s.rollout, s.train
  state_bytes = bytes_per_device(state)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  B, P, T = r.prompts_per_step, r.max_prompt_length, r.max_completion_length

  def prompts(rows):
    return {"prompt_tokens": jax.ShapeDtypeStruct((rows, P), jnp.int32,
                                                  sharding=mesh_lib.row_sharding(mesh, rows)),
            "prompt_mask": jax.ShapeDtypeStruct((rows, P), jnp.int32,
                                                sharding=mesh_lib.row_sharding(mesh, rows))}

  programs, resident = {}, {}
  # A state over the budget fits no program: nothing to compile (fit said so).
  if budget is None or state_bytes <= budget:
    load = load_program(s, model_cfg, mesh, state)
    if load is not None:
      compiling("load")
      programs["load"], *_ = measure(load[0], mesh=mesh)
      resident["load"] = load[1]
    # Lowering never calls the reward callback: decode and lookup are never used.
    host = HostRewards(parts.reward_fns, decode=lambda rows: [""] * len(rows),
                       lookup=lambda i: {}, weights=parts.reward_weights, num_workers=0,
                       models=reward_models)
    if targets.compile_only(mesh):  # no backend of the target's platform runs here
      host = _TargetRewards(host)
    try:
      rollout_config = parts.rollout_config()
      if rollout_config.hook is not None and targets.compile_only(mesh):
        rollout_config.hook.host.close()
        rollout_config = dataclasses.replace(
            rollout_config, hook=dataclasses.replace(rollout_config.hook, host=_TargetTools()))
      strategy = strategy_lib.make(
          parts.strategy_name(), rollout_config, host, num_prompts=B,
          max_rounds=r.dynamic_sampling_max_rounds if r.dynamic_sampling else 1,
          reward_weights=parts.reward_weights, mesh=mesh)
      lower = lambda: strategy.lower(state, rng, prompt_length=P)  # noqa: E731
      compiling("rollout")
      programs["rollout"], lowered, compiled = measure(lower, mesh=mesh)
      if r.max_staleness > 0 and r.partial == "keep":
        # The engine's state (its pages) stays on the device through the update.
        resident["update"] = sum(x.size * x.dtype.itemsize
                                 for x in jax.tree.leaves(lowered.out_info[2]))
      # The update's input is the rollout's output: its shapes, and the shardings XLA chose
      # (the run's own layout where the rollout did not compile: too large for the device).
      if compiled is None:
        rollout = abstract_rollout(s, mesh)
      else:
        outputs = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                               lowered.out_info, compiled.output_shardings)
        rollout = outputs[0]
    finally:
      host.close()
    del lowered, compiled

    update_kw = parts.update_kw
    jax.clear_caches()  # fit may have compiled this very update: time a real compile
    compiling("update")
    programs["update"], *_ = measure(lambda: step.update.lower(state, rollout, rng, **update_kw),
                                      mesh=mesh)

    if s.eval.num_prompts:
      modes = [("eval_greedy", 1, SamplingParams(temperature=0.0))]
      n = s.eval.samples
      if n:  # the n samples of pass@k, maj@k and mean@n
        modes.append((f"eval_sampled@{n}", n, SamplingParams(temperature=s.eval.temperature)))
      engine = parts.engine()
      for key, k, sampling in modes:
        b = prompts(s.eval.batch_size)
        kw = dict(sampling=sampling, num_samples=k, max_new_tokens=T, eos=tuple(tokenizer.eos_ids),
                  pad_id=int(tokenizer.pad_id))
        if engine is None:
          generate, kw = sampler.generate_program, dict(kw, mesh=mesh)
        else:
          generate, more = engine_lib.program_for(engine, mesh, s.eval.batch_size)
          kw = dict(kw, **more)
        compiling(key)
        programs[key], *_ = measure(lambda b=b, generate=generate, kw=kw: generate.lower(
            state.model_config, state.model_params, b["prompt_tokens"], b["prompt_mask"], rng,
            **kw),
            mesh=mesh)

    if s.sft.steps:
      tx = sft.sft_optimizer(s.sft.learning_rate, s.sft.steps)
      params = state.params
      opt_state = abstract_opt_state(tx, params, mesh)
      rows = s.sft.batch_size
      sft_batch = dict(prompts(rows), example_ids=jax.ShapeDtypeStruct(
          (rows,), jnp.int32, sharding=mesh_lib.row_sharding(mesh, rows, 1)))
      for key in ("targets", "target_mask"):
        sft_batch[key] = jax.ShapeDtypeStruct((rows, T), jnp.int32,
                                              sharding=mesh_lib.row_sharding(mesh, rows))
      compiling("sft")
      programs["sft"], *_ = measure(lambda: sft.sft_step.lower(
          state.model_config, params, opt_state, sft_batch, tx=tx, frozen=state.frozen),
          mesh=mesh)

  for key, p in programs.items():
    # The train state stays on the device around every program: the update takes
    # (and donates) all of it, the others only part, and SFT works on a copy.
    outside = resident[key] if key in resident else state_bytes if key == "sft" else (
        0 if key == "update" or p.get("at_least") else max(0, state_bytes - p["argument_bytes"]))
    p["resident_bytes"] = outside
    p["total_bytes"] = p["peak_bytes"] + outside

  worst = max(programs, key=lambda k: programs[k]["total_bytes"], default="the train state")
  need = programs[worst]["total_bytes"] if programs else state_bytes
  fits = None if budget is None else need <= budget
  backend = mesh.devices.flat[0].platform
  if backend != "cpu" or name == "cpu":
    note = None  # the target's own compiler, or a plan for this CPU itself
  else:
    note = _NO_TARGET_NOTE.format(
        name=name, low=PROXY_ERROR[0], high=PROXY_ERROR[1],
        install=targets.INSTALL if name in targets.TPUS else targets.CUDA_INSTALL)
  if unfitted:  # the run itself would stop before its first step
    fits, reason = False, unfitted
  elif fits is None:
    reason = f"{worst} needs {need / GiB:.2f} GiB per device; {name}'s memory is unknown"
  else:
    reason = (f"{worst} needs {need / GiB:.2f} GiB per device "
              f"{'<=' if fits else '>'} {name}'s {budget / GiB:.2f} GiB")
  n_params = sum(math.prod(x.shape) for n, x in state.model_params.items()
                 if not lora_lib.is_adapter(n))
  choices = {
      "model": s.model.path or s.model.arch, "parameters": n_params,
      "devices": mesh.size, "mesh": dict(mesh.shape), "backend": backend,
      "rows": B * r.group_size, "prompt_length": P, "completion_length": T,
      "minibatches": t.minibatches, "grad_accum_steps": s.optim.grad_accum_steps,
      "num_iterations": t.num_iterations, "remat": fitted.remat, "micro_batches": fitted.micro_batches,
      "fit": fitted.how, "dtype": s.model.dtype,
      "kernels": model_cfg.kernels,
      "reference": s.uses_reference, "state_bytes": state_bytes,
      "trainable": sum(math.prod(x.shape) for x in state.params.values()),
      "lora": (f"rank {s.model.lora.rank}, base {s.model.lora.quantize}"
               if state.frozen is not None else None),
  }
  return {"device": name, "device_memory_bytes": budget, "programs": programs,
          "choices": choices, "fits": fits, "reason": reason,
          "note": note}


def ppo_twin(cfg):
  """The run `cfg` as PPO with a learned critic: advantage.estimator=gae from the
  policy, one completion per prompt and G times the prompts (the same samples per
  step), the KL in the reward where the run has one (TRL's PPO recipe)."""
  out = copy.deepcopy(cfg)
  with out.unlocked():
    r = out.rollout
    r.prompts_per_step, r.group_size = r.prompts_per_step * r.group_size, 1
    if isinstance(r.decode_slots, int) and r.decode_slots:
      r.decode_slots = min(r.decode_slots, r.prompts_per_step)
    out.advantage.estimator = "gae"
    out.loss.kl_in_reward = out.loss.beta > 0
    out.rollout.dynamic_sampling = False
    if out.rollout.strategy in ("dynamic", "streaming"):
      out.rollout.strategy = "auto"
  return out


def compare(cfg, against: str = "ppo", **kw) -> dict:
  """{"grpo": plan(cfg), "ppo": plan(ppo_twin(cfg)), "ratios": PPO's bytes over GRPO's}
  (plan's keyword arguments kw): the same run both ways, program by program."""
  if against != "ppo":
    raise ValueError(f"--compare={against!r}: the planner compares against 'ppo'")
  grpo, ppo = plan(cfg, **kw), plan(ppo_twin(cfg), **kw)
  ratios = {"state": ppo["choices"]["state_bytes"] / grpo["choices"]["state_bytes"]}
  for k, p in ppo["programs"].items():
    if k in grpo["programs"] and grpo["programs"][k]["total_bytes"]:
      ratios[k] = p["total_bytes"] / grpo["programs"][k]["total_bytes"]
  return {"grpo": grpo, "ppo": ppo, "ratios": ratios}


def format_compare(result: dict) -> str:
  """Both plans' tables, then PPO's bytes over GRPO's, program by program."""
  g, p = result["grpo"], result["ppo"]
  lines = ["GRPO, as configured:", format_plan(g), "",
           f"PPO with a critic (advantage.estimator=gae, {p['choices']['rows']} rows of one "
           "completion per prompt):", format_plan(p), "",
           "PPO / GRPO, bytes per device (total, with the resident train state):"]
  for k, ratio in result["ratios"].items():
    what = (f"{g['choices']['state_bytes'] / GiB:.2f} -> {p['choices']['state_bytes'] / GiB:.2f}"
            if k == "state" else f"{g['programs'][k]['total_bytes'] / GiB:.2f} -> "
            f"{p['programs'][k]['total_bytes'] / GiB:.2f}")
    lines.append(f"  {k}: {what} GiB, {ratio:.2f}x")
  verdict = {True: "fits", False: "does not fit", None: "unknown"}
  lines.append(f"GRPO {verdict[g['fits']]}, PPO {verdict[p['fits']]} on {g['device']}")
  return "\n".join(lines)


def format_plan(result: dict) -> str:
  """The human table."""
  c = result["choices"]
  lines = [f"model {c['model']} ({c['parameters'] / 1e9:.3f}B parameters), {c['dtype']} compute, "
           f"remat={c['remat']}; {c['rows']} rows x (P={c['prompt_length']} + "
           f"T={c['completion_length']}), minibatches={c['minibatches']}, "
           f"micro_batches={c['micro_batches']}; "
           f"{c['devices']} {c['backend']} device(s), mesh {c['mesh']}",
           f"fit: {c['fit']}",
           *([f"LoRA {c['lora']}: {c['trainable'] / 1e6:.2f}M trainable parameters"]
             if c.get("lora") else []),
           f"train state: {c['state_bytes'] / GiB:.2f} GiB per device", ""]
  header = ("program", "peak GiB", "+state GiB", "total GiB", "matmul GFLOP", "compile s")
  def over(p):  # a TPU compiler's refusal: its requirement is a lower bound
    return ">=" if p.get("at_least") else ""
  rows = [header] + [(k, f"{over(p)}{p['peak_bytes'] / GiB:.2f}", f"{p['resident_bytes'] / GiB:.2f}",
                      f"{over(p)}{p['total_bytes'] / GiB:.2f}",
                      "?" if p.get("at_least") else f"{p['flops'] / 1e9:,.1f}",
                      f"{p['compile_s']:.1f}") for k, p in result["programs"].items()]
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  for r in rows if result["programs"] else []:  # none compiled when the state cannot fit
    lines.append("  ".join(r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i])
                           for i in range(len(r))))
  budget = result["device_memory_bytes"]
  if result["programs"]:
    lines.append("")
  lines.append(f"device: {result['device']}"
               + ("" if budget is None else f", {budget / GiB:.2f} GiB per device"))
  verdict = {True: "fits", False: "does not fit", None: "unknown"}[result["fits"]]
  lines.append(f"{verdict}: {result['reason']}")
  if result["note"]:
    lines.append(f"note: {result['note']}")
  return "\n".join(lines)


def main(argv):
  from absl import app, logging

  # absl's INFO default would print JAX's probe of every backend this host lacks.
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _FLAGS['install'].value:
    found = targets.install_compilers()
    if all(found.values()):
      print(f"installed in {targets.compilers_dir()}: the planner finds them there "
            f"(--device {', '.join(targets.known())})")
    return 0 if all(found.values()) else 1
  say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 (stdout: the table)
  kw = dict(device=_FLAGS['device'].value, devices=_FLAGS['devices'].value,
            memory_bytes=int(_FLAGS['memory_gb'].value * GiB) if _FLAGS['memory_gb'].value else None, progress=say)
  try:
    if _FLAGS['compare'].value:
      result = compare(_FLAGS['config'].value, _FLAGS['compare'].value, **kw)
    else:
      result = plan(_FLAGS['config'].value, **kw)
  except (config_lib.ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_compare(result) if _FLAGS['compare'].value else format_plan(result))
  if _FLAGS['json'].value:
    print(json.dumps(result))
  if _FLAGS['compare'].value:
    return 0 if result["grpo"]["fits"] is not False else 1
  return 0 if result["fits"] is not False else 1


if __name__ == "__main__":
  from absl import app

  app.run(main)
