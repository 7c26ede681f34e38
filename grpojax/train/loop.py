"""The training loop: wiring, SFT warm start, rollout -> update, metrics one step
late, eval, checkpoints, preemption, HF export. All math lives in the jitted
programs of rollout.py and step.py; this file only moves data and writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from grpojax import config as config_lib
from grpojax.core import advantages as advantages_lib
from grpojax.data import PromptIterator
from grpojax.models import hf as hf_lib
from grpojax.parallel import mesh as mesh_lib
from grpojax.rewards.base import TrainerState
from grpojax.rewards.runtime.host import HostRewards
from grpojax.run import assemble as assemble_lib
from grpojax.run import settings as settings_lib
from grpojax.train import beside as beside_lib
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import evaluate as evaluate_lib
from grpojax.train import metrics as metrics_lib
from grpojax.train import sft as sft_lib
from grpojax.train import strategy as strategy_lib
from grpojax.train.rollout import RolloutConfig
from grpojax.train.state import NonFiniteError, check_finite, init_optimizer, sync_reference
from grpojax.train.step import update
from grpojax.train import wiring


_log = logging.getLogger(__name__)  # what the run is doing, at INFO (see show_info)
_EVAL_KEY = 2**31 - 1  # eval's key: folded in like a step number no run reaches
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _process_sum(counts: np.ndarray) -> np.ndarray:
  """counts summed over every process (each process must call this at the same point)."""
  if jax.process_count() == 1:
    return counts
  return np.asarray(multihost_utils.process_allgather(np.asarray(counts, np.int32))).sum(0)


class _Preemption:
  """Turns SIGTERM (TPU VMs get it) and a first Ctrl-C (SIGINT) into a flag the loop
  checks between steps: it saves the step and exits. A second Ctrl-C stops at once.

  A Python signal handler runs only when the main thread runs Python, and
  during a rollout it waits inside jit for the reward callback: a hanging
  reward would keep SIGTERM unseen until SIGKILL. So the signal also wakes a
  watcher thread (through signal.set_wakeup_fd), which calls `on_signal`:
  the reward host ends its calls, the rollout returns, and the loop saves.
  """

  def __init__(self, on_signal=lambda: None):
    self.received = False
    self._on_signal = on_signal
    self._previous = {sig: signal.signal(sig, self._handle) for sig in _STOP_SIGNALS}
    self._interrupts = 0
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    self._watcher = threading.Thread(target=self._watch, name="sigterm-watcher", daemon=True)
    self._watcher.start()

  def _handle(self, signum, frame):
    del frame
    self.received = True
    if signum == signal.SIGINT:
      self._interrupts += 1
      if self._interrupts > 1:
        raise KeyboardInterrupt
      print("\nCtrl-C: saving at the end of this step (Ctrl-C again to stop at once)",
            file=sys.stderr, flush=True)

  def _watch(self):
    while True:
      try:
        data = os.read(self._read, 64)
      except OSError:
        return
      if not data:
        return  # restore() closed the pipe
      if self._previous_fd >= 0:
        try:  # whoever listened before us (an event loop) still hears every signal
          os.write(self._previous_fd, data)
        except OSError:
          pass
      if any(sig in data for sig in _STOP_SIGNALS):
        self.received = True
        self._on_signal()

  def requested(self) -> bool:
    """Whether any process got SIGTERM: every process must call this at the same step.

    The hosts of a slice get their signals at different moments, but must stop
    at the same step: saving is collective, and a host that stopped alone would
    leave the others waiting in the next step's collectives.
    """
    return self.any_process(self.received)

  def any_process(self, flag: bool) -> bool:
    """`flag` on any process: every process must call this at the same point."""
    if jax.process_count() == 1:
      return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))

  def restore(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    signal.set_wakeup_fd(self._previous_fd)
    os.close(self._write)  # ends the watcher
    self._watcher.join(timeout=5)
    os.close(self._read)


def show_info() -> None:
  """Shows grpojax's INFO lines (start-up phases and their times, the resume, SFT, the
  first step), on stderr; other libraries' stay at their own levels (orbax logs every
  save at INFO). Where nothing handles logging yet (a plain script), a handler is added."""
  log = logging.getLogger("grpojax")
  log.setLevel(logging.INFO)
  if not logging.getLogger().handlers and not log.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)


@contextlib.contextmanager
def _phase(what: str):
  """Says what start-up is doing, then how long it took: a real model's load, the
  compiles and the first eval take minutes on a CPU, which must not pass in silence."""
  _log.info("%s ...", what)
  start = time.perf_counter()
  yield
  _log.info("%s: done in %.1f s", what, time.perf_counter() - start)


def set_compilation_cache(cache_dir: str) -> str:
  """Turns on JAX's persistent compilation cache in `cache_dir` ("" leaves it off), so a
  repeated or resumed run loads its programs instead of compiling them again.

  A cache already chosen (JAX_COMPILATION_CACHE_DIR, or jax.config) is kept.
  Returns the directory in use ("" for none).
  """
  current = jax.config.jax_compilation_cache_dir
  if current or not cache_dir:
    return current or ""
  cache_dir = os.path.expanduser(cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    # Only programs worth it: the rollout, update and generate programs take seconds to minutes.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return cache_dir


def _check_resume_config(s: settings_lib.Settings, workdir: str) -> None:
  """Stops a run that would resume a workdir's checkpoints under another config."""
  checkpoints = os.path.join(workdir, "checkpoints")
  config_file = os.path.join(workdir, metrics_lib.CONFIG_FILE)
  if (s.train.allow_config_change or not os.path.isfile(config_file)
      or not os.path.isdir(checkpoints) or not any(n.isdigit() for n in os.listdir(checkpoints))):
    return
  with open(config_file, encoding="utf-8") as f:
    previous = json.load(f)
  diffs = config_lib.resume_differences(previous, s.source)
  if diffs:
    shown = ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    raise config_lib.ConfigError(
        f"config: {workdir} holds a run started with another config ({shown}); resuming would "
        "mix the two runs. Use a new --workdir, or --config.train.allow_config_change=True to "
        "continue it anyway")


def train(cfg, workdir: str) -> dict:
  """Runs (or resumes) the experiment `cfg` in `workdir`; returns a summary dict.

  One run at a time per workdir: a second one stops at once (WorkdirBusy).
  Resuming: a checkpoint in workdir/checkpoints continues from its step with
  the data position, parameters and optimizer state it saved; per-step keys
  are fold_in(seed, step), so the run's metrics equal an uninterrupted run's.
  """
  mesh_lib.initialize_distributed()  # before the lock: process 0 holds it
  with checkpoint_lib.workdir_lock(workdir):
    return run(setup(cfg, workdir))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When the loop does what (the train.* keys of the same names)."""

  steps: int
  log_every: int
  eval_every: int  # 0: at the start and the end only
  save_every: int  # 0: at the start and the end only
  log_completions: int  # 0: never
  on_nonfinite: str  # "stop" | "skip"
  ref_sync_every: int  # 0: never
  ref_sync_alpha: float
  # Optimizer steps a step (a rollout) makes: TrainerState counts these, as TRL's
  # global_step and max_steps do.
  updates_per_step: int = 1

  def trainer_state(self, step: int) -> TrainerState:
    """What the reward functions of step `step` (rollouts done) are told: TRL's counts."""
    return TrainerState(global_step=step * self.updates_per_step,
                        max_steps=self.steps * self.updates_per_step)


@dataclasses.dataclass
class Run:
  """Everything `setup` builds for `run`: the state, data, programs and outputs of one run."""

  schedule: Schedule
  rollout: RolloutConfig  # its group size and advantage settings read the logged samples
  workdir: str
  mesh: Any
  tokenizer: Any
  state: Any  # TrainState, restored or fresh (after SFT)
  iterator: PromptIterator
  evaluators: list[evaluate_lib.Evaluator]  # the run's held-out set first, then eval.sets
  ckpt: checkpoint_lib.Checkpointer
  writer: metrics_lib.MetricsWriter
  host: HostRewards
  source: strategy_lib.PromptSource  # the step's batches, from iterator, on the mesh
  strategy: strategy_lib.RolloutStrategy | None  # (state, source, rng) -> (Rollout, metrics)
  update_kw: dict
  root: jax.Array  # the run's key: step s uses fold_in(root, s)
  resumed: int | None  # the step resumed from, or None
  start_eval: dict  # eval before GRPO (empty when eval is off; resumed: the first run's)
  export: dict = dataclasses.field(default_factory=dict)  # export_hf's LoRA arguments

  def evaluate(self, state) -> dict:
    if not self.evaluators:
      return {}
    check_finite(state.params, "evaluate")  # NaN weights would score 0 and read as a result
    rng, metrics = jax.random.fold_in(self.root, _EVAL_KEY), {}
    for i, evaluator in enumerate(self.evaluators):
      # The run's own set keeps eval's key (its samples as before eval.sets existed).
      metrics.update(evaluator(state.model_config, state.model_params,
                               jax.random.fold_in(rng, i) if i else rng))
      if self.host.interrupted:  # SIGTERM cut the scoring short: these numbers are wrong
        logging.warning("SIGTERM during evaluation: its metrics are not written")
        return {}
    return metrics


def setup(cfg, workdir: str) -> Run:
  """Reads the config, then loads or restores everything the run needs.

  In order: the config (read once, here: grpojax.run.settings.read) and a resumed
  workdir's config, the distributed
  runtime, the mesh; the run's parts (grpojax.run.assemble: the rewards' own
  checks before any compile, tokenizer, data, model, fitted sizes, optimizer,
  state, reward models); then what only a live run has: the data iterator,
  evaluators, checkpoints, metrics and the reward pool (which also scores eval
  completions); then the newest good checkpoint, or else SFT (sft.steps), the
  start-of-GRPO eval and the step-0 checkpoint; last the rollout program.
  """
  s = settings_lib.read(cfg)  # the only read of the config: below, its settings
  _check_resume_config(s, workdir)
  mesh_lib.initialize_distributed()
  set_compilation_cache(s.train.compilation_cache_dir)
  os.makedirs(workdir, exist_ok=True)
  rollout_mesh = None  # the rollout's own devices (parallel.rollout_devices), or None: mesh's
  p = s.parallel
  if p.rollout_devices:
    mesh, rollout_mesh = beside_lib.split_meshes(p.mesh_shape, p.rollout_shape,
                                                 p.rollout_devices)
  else:
    mesh = mesh_lib.make_mesh(p.mesh_shape)
  t = s.train
  schedule = Schedule(t.steps, t.log_every, t.eval_every, t.save_every, t.log_completions,
                      t.on_nonfinite, t.ref_sync_every, t.ref_sync_alpha, s.updates_per_step)
  parts = assemble_lib.assemble(s, mesh, phase=_phase)
  _log.info("memory: %s", parts.fitted.how)
  s, task, tokenizer, environments = parts.settings, parts.task, parts.tokenizer, parts.environments
  train_rows, held_out, state = parts.train_rows, parts.held_out, parts.state
  tx, reward_fns, reward_weights = parts.optimizer, parts.reward_fns, parts.reward_weights
  r = s.rollout
  pid, nproc = jax.process_index(), jax.process_count()

  iterator = PromptIterator(train_rows, task, tokenizer, batch_size=r.prompts_per_step,
                            max_prompt_length=r.max_prompt_length, seed=t.seed,
                            on_long=s.task.on_long_prompt, process_index=pid,
                            process_count=nproc, environments=environments)
  evaluators = []
  # Eval runs the rollouts' tool turns too, over environment instances of its own (an
  # eval between steps must not reset the ones a carried or streamed rollout holds).
  eval_environments = wiring.run_environments(s)
  tools = wiring.tool_hook(s, tokenizer, eval_environments)
  # The run's held-out set (plain eval/... names; the best checkpoint is by its
  # eval/accuracy), then each of eval.sets as eval/<name>/...
  for name, eval_rows in held_out:
    evaluators.append(evaluate_lib.Evaluator(
        eval_rows, task, tokenizer, batch_size=s.eval.batch_size,
        max_prompt_length=r.max_prompt_length, max_new_tokens=r.max_completion_length,
        ks=s.eval.k, n=s.eval.samples, temperature=s.eval.temperature, name=name, mesh=mesh,
        engine=parts.engine(),
        hook=tools, environments=eval_environments))

  export, base = {}, None
  m = s.model
  if state.frozen is not None and not m.path:
    logging.warning("model.lora.rank=%d over a model built from scratch (model.path is empty): "
                    "the frozen base is random weights, which adapters alone rarely make "
                    "useful; LoRA is for a pretrained model.path", m.lora.rank)
  if state.frozen is not None:  # LoRA: checkpoints hold adapters; they name their base
    base_path = hf_lib.local_dir(m.path) if m.path else ""
    base = checkpoint_lib.base_identity(base_path, arch=m.arch, seed=t.seed)
    export = dict(base_path=base_path, merged=(os.path.join(workdir, "hf", "merged")
                                               if m.export_merged else None))
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                                     base=base, noise_log=os.path.join(workdir, "error.log"))
  try:
    restored = ckpt.restore_latest(state)
  except BaseException:
    with contextlib.suppress(Exception):  # its manager's threads, its hold on orbax's log
      ckpt.close()
    raise
  resumed = None if restored is None else restored[2]
  # Rows after the resumed step are written again; with no checkpoint (none was
  # ever finished: killed or a full disk during the first save) every row is.
  # config.json holds the config as given ("auto" stays "auto": a resume resolves it again)
  writer = metrics_lib.MetricsWriter(workdir, config=s.source, loggers=list(t.loggers),
                                     resume_step=0 if resumed is None else resumed + 1)
  _log.info("%s", _outputs(t, workdir, bool(evaluators)))
  host = HostRewards(reward_fns, decode=lambda rows: [tokenizer.decode(x) for x in rows],
                     lookup=iterator.lookup, weights=reward_weights, models=parts.reward_models,
                     num_workers=s.rewards.num_workers, row_timeout_s=s.rewards.timeout_s,
                     row_columns=None if environments is None else environments.columns)
  host.trainer_state = schedule.trainer_state(resumed or 0)
  if s.rewards.check_at_start:
    try:
      host.probe(range(min(2, len(iterator.rows))))
    except BaseException:
      host.close()
      with contextlib.suppress(Exception):
        ckpt.close()
      raise
  # Where an environment's get_reward is the only reward, it is the first column: the verifier.
  if task.correct_means_full_score or (environments is not None and not task.reward_fns):
    for evaluator in evaluators:
      evaluator.rewards = host  # eval completions scored by the same workers, a batch at a time
  rollout_cfg = parts.rollout_config()
  if rollout_cfg.hook is not None:  # tool-using rows reach TRL-shaped rewards as conversations
    host.conversation = getattr(rollout_cfg.hook.host, "conversation", None)
  out = Run(schedule=schedule, rollout=rollout_cfg, workdir=workdir, mesh=mesh, tokenizer=tokenizer,
            state=state, iterator=iterator, evaluators=evaluators, ckpt=ckpt, writer=writer,
            host=host, source=strategy_lib.PromptSource(iterator, mesh),
            strategy=None, update_kw={}, root=jax.random.key(t.seed), resumed=resumed,
            start_eval={}, export=export)

  try:
    if restored is not None:
      out.state, extra, _ = restored
      iterator.load_state_dict(extra["data"])
      # The start of GRPO is the first run's: what it wrote at step 0 (SFT, eval).
      written = (metrics_lib.read_metrics(workdir)
                 if os.path.isfile(os.path.join(workdir, metrics_lib.METRICS_FILE)) else [])
      out.start_eval = next(({k: v for k, v in row.items() if k != "step"}
                             for row in written if row["step"] == 0), {})
      if "row" in extra and all(row["step"] != resumed for row in written):
        # The checkpoint's own step's row, lost from metrics.jsonl (a line torn by a
        # kill, damaged bytes): written again from the copy the checkpoint keeps.
        saved = json.loads(extra["row"])
        writer.write(saved.pop("step"), saved)
        if resumed == 0:
          out.start_eval = saved
      _log.info("resumed from step %d of %d (checkpoint in %s)", resumed, t.steps,
                os.path.join(workdir, "checkpoints"))
    else:
      if s.sft.steps:
        sft_iter = PromptIterator(train_rows, task, tokenizer, batch_size=s.sft.batch_size,
                                  max_prompt_length=r.max_prompt_length, seed=t.seed + 1,
                                  process_index=pid, process_count=nproc)
        sft_losses = []
        with _progress(s.sft.steps, desc="SFT") as bar:
          def on_step(i, loss):
            sft_losses.append(loss)
            bar.update(1)
            if i % 10 == 0:
              bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)  # shown by update

          params = sft_lib.run_sft(
              state.model_config, state.params, sft_iter, task, tokenizer, steps=s.sft.steps,
              learning_rate=s.sft.learning_rate, max_length=r.max_completion_length,
              put=lambda b: mesh_lib.global_batch(b, mesh), on_step=on_step,
              frozen=state.frozen)
        if state.frozen is None:  # the SFT model is GRPO's start and its reference
          out.state = assemble_lib.train_state(s, state.model_config, params, tx, mesh)
        else:  # GRPO trains SFT's adapters on; the reference stays the base
          out.state = state.replace(params=params, opt_state=init_optimizer(tx, params))
        losses = [float(x) for x in jax.device_get(sft_losses)]
        tail = losses[-max(1, len(losses) // 10):]
        out.start_eval = {"sft/loss_start": losses[0], "sft/loss": sum(tail) / len(tail)}
        _log.info("SFT: %d steps, loss %.3f -> %.3f", len(losses), losses[0],
                  out.start_eval["sft/loss"])
      if out.evaluators:
        with _phase("eval at the start of GRPO (compiles generation)"):
          out.start_eval.update(out.evaluate(out.state))
      if out.start_eval:
        writer.write(0, out.start_eval)
      ckpt.save(0, out.state, _extra(writer, 0, iterator.state_dict()), force=True)

    out.state = parts.with_reward_models(out.state)  # frozen, for the rollout's scoring
    name = parts.strategy_name()
    kw = dict(num_prompts=r.prompts_per_step, reward_weights=reward_weights,
              max_rounds=r.dynamic_sampling_max_rounds if r.dynamic_sampling else 1)
    out.strategy = (strategy_lib.make(name, rollout_cfg, host, mesh=mesh, **kw)
                    if rollout_mesh is None else beside_lib.make_beside(
                        name, rollout_cfg, host, mesh=mesh, rollout_mesh=rollout_mesh, **kw))
    if restored is not None and hasattr(out.strategy, "load_state_dict"):
      out.strategy.load_state_dict(restored[1].get("rollout", {}))  # the carried rows
    out.update_kw = parts.update_kw
  except BaseException:
    host.close()  # its worker processes
    with contextlib.suppress(Exception):  # the error being raised is the one to see
      ckpt.close()
    raise
  return out


def run(job: Run) -> dict:
  """The GRPO steps of a set-up run, its final eval, checkpoint and HF export.

  Each step: rollout (sample, rewards on the host, advantages, log-probs), then
  the update. Metrics are read one step late, so the host never waits on the
  device between steps. SIGTERM/SIGINT saves the step and returns
  {"preempted": True, "step": ...}; otherwise the summary of the finished run.
  """
  t, state, host, ckpt, writer = job.schedule, job.state, job.host, job.ckpt, job.writer
  preemption = _Preemption(on_signal=host.interrupt)
  pending, last = None, {}
  accuracy = [job.start_eval.get("eval/accuracy", float("nan"))]  # the bar shows the latest
  bar = _progress(t.steps, initial=int(state.step), desc="GRPO")
  seconds, timed, first_step_s = 0.0, 0, 0.0  # this run's step times, for the mean speed

  def flush():
    nonlocal pending, last
    if pending is not None:
      step, device_metrics, host_metrics = pending
      last = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
      last.update(host_metrics)
      if step % t.log_every == 0 or step == t.steps or last.get("nonfinite/skipped"):
        writer.write(step, last)
      if last.get("nonfinite/skipped"):
        _on_nonfinite(step, last, t.on_nonfinite, ckpt, writer)
      accuracy[0] = last.get("eval/accuracy", accuracy[0])
      bar.set_postfix(reward=f"{last.get('reward', 0):.3f}", kl=f"{last.get('kl', 0):.4f}",
                      acc=f"{accuracy[0]:.3f}",
                      step_s=f"{last.get('step_time', 0):.2f}", refresh=False)
      pending = None

  try:
    for step in range(int(state.step), t.steps):
      if timed == 0:  # the first step's compiles take a while: say so before, not after
        _log.info("first GRPO step: compiling the rollout and the update ...")
      t0, reward_s0 = time.perf_counter(), host.seconds
      host.trainer_state = t.trainer_state(step)
      host.recent.clear()  # this step's reward calls, for the sample completions
      data_state = job.iterator.state_dict()  # before this step's batches: the step may be undone
      k_rollout, k_update = jax.random.split(jax.random.fold_in(job.root, step))
      try:
        rollout, rollout_metrics = job.strategy(state, job.source, k_rollout)
        # The rollout already synchronised with the host in its reward callback;
        # waiting for its end costs nothing and times the phase.
        jax.block_until_ready(rollout.advantages)
      except Exception:
        if host.error is not None:  # the reward function's own error, not XLA's wrapper
          raise host.error from None
        raise
      t1 = time.perf_counter()
      # Rows whose verdict ran out of time (TIMED_OUT): counted on each host as its
      # callbacks return, summed over the processes like the errors the rollout sums
      # on device; every process reaches this point each step.
      timeouts = _process_sum(host.take_timeouts())
      if preemption.any_process(host.interrupted):
        # SIGTERM cut this step's rewards short: they are incomplete, so the step
        # is not applied. The checkpoint is of the last finished step (the state
        # and data position before this one), which a resumed run redoes exactly.
        flush()
        getattr(job.strategy, "undo", lambda: None)()  # the carried rows before this rollout
        if ckpt.latest_step() != step:
          ckpt.save(step, state, _extra(writer, step, data_state), metrics=last, force=True,
                    rollout=_rollout_state(job))
        logging.warning("SIGTERM during the rewards of step %d: saved step %d, exiting",
                        step + 1, step)
        ckpt.close()
        writer.close()
        return {"preempted": True, "step": step}
      state, update_metrics = update(state, rollout, k_update, **job.update_kw)
      if t.ref_sync_every and (step + 1) % t.ref_sync_every == 0:
        state = sync_reference(state, t.ref_sync_alpha)
      flush()  # the previous step's metrics: read one step late
      jax.block_until_ready(state.step)
      t2 = time.perf_counter()
      host_metrics = {"time/rollout": t1 - t0, "time/reward": host.seconds - reward_s0,
                      "time/update": t2 - t1, "step_time": t2 - t0,
                      **{f"rewards/{name}/timeouts": float(count)
                         for name, count in zip(host.names, timeouts)},
                      **host.take_logged_metrics()}  # the rewards' log_metric, as TRL names them
      seconds, timed = seconds + t2 - t0, timed + 1
      if timed == 1:
        first_step_s = t2 - t0  # compiles: left out of the mean speed
        _log.info("first GRPO step (compiles the rollout and the update): %.1f s",
                  first_step_s)
      done = step + 1
      if t.log_completions and done % t.log_completions == 0:
        writer.write_completions(done, _sample_completions(host, job.rollout))
      if job.evaluators and t.eval_every and done % t.eval_every == 0 and done < t.steps:
        host_metrics.update(job.evaluate(state))
      pending = (done, {**rollout_metrics, **update_metrics}, host_metrics)
      bar.update(1)
      if done == t.steps:
        break  # the last step is saved after the final eval, below
      preempted = preemption.requested()
      if (t.save_every and done % t.save_every == 0) or preempted:
        flush()
        carried = _rollout_state(job)  # first: it may give prompts back to the data
        ckpt.save(done, state, _extra(writer, done, job.iterator.state_dict()), metrics=last,
                  force=True, rollout=carried)
      if preempted:
        logging.warning("SIGTERM/SIGINT: saved step %d, exiting", done)
        ckpt.close()
        writer.close()
        return {"preempted": True, "step": done}

    final_eval = job.evaluate(state)
    final_step = int(state.step)
    if pending is not None:
      pending[2].update(final_eval)  # one line for the last step, eval included
      flush()
    elif final_eval and job.resumed != final_step:
      writer.write(final_step, final_eval)
    if ckpt.latest_step() != final_step:
      carried = _rollout_state(job)  # first: it may give prompts back to the data
      ckpt.save(final_step, state, _extra(writer, final_step, job.iterator.state_dict()),
                metrics=final_eval, force=True, rollout=carried)
    ckpt.close()
    writer.close()
    hf_dir = os.path.join(job.workdir, "hf")
    checkpoint_lib.export_hf(state, hf_dir, tokenizer=job.tokenizer, **job.export)
  finally:
    job.state = state  # the trained policy, for the Python API
    preemption.restore()
    bar.close()
    host.close()

  # The first step compiles: the mean is over the others when there are any.
  speed = ((timed - 1) / (seconds - first_step_s) if timed > 1 else
           timed / seconds if seconds else None)
  if "reward" not in last or speed is None:  # a resumed run that ran few steps, or none
    last, speed = _from_metrics(job.workdir, last, speed)
  return {"preempted": False, "step": final_step, "start": job.start_eval, "end": final_eval,
          "last": last, "hf": hf_dir, "steps_per_s": speed}


def _extra(writer, step: int, data: dict) -> dict:
  """A checkpoint's host state: the data position and, where it was logged, the
  step's metrics row (a resume whose metrics.jsonl lost it writes it again)."""
  row = writer.last_row
  return {"data": data, **({"row": row} if row and json.loads(row)["step"] == step else {})}


def _from_metrics(workdir: str, last: dict, speed):
  """(last, steps/s) with what this run did not measure taken from metrics.jsonl (the
  runs before a resume): the newest logged step's metrics, and the mean speed of the
  logged steps after the first (which compiles)."""
  path = os.path.join(workdir, metrics_lib.METRICS_FILE)
  rows = metrics_lib.read_metrics(workdir) if os.path.isfile(path) else []
  if "reward" not in last:
    last = {**next((r for r in reversed(rows) if "reward" in r), {}), **last}
  times = [r["step_time"] for r in rows if "step_time" in r and r["step"] > 1]
  if speed is None and times:
    speed = len(times) / sum(times)
  return last, speed


def _outputs(t: settings_lib.Train, workdir: str, evaluates: bool) -> str:
  """One line, before the run: what it will write and what it will not (a Python API
  user with TRL's defaults otherwise learns it at the end)."""
  loggers = t.loggers
  said = [f"writes: metrics.jsonl every {t.log_every} step(s) (train.log_every)",
          f"loggers: {', '.join(loggers) or 'none'} (train.loggers)",
          f"eval every {t.eval_every} steps" if evaluates and t.eval_every else
          "eval at the start and the end" if evaluates else "no eval (eval.num_prompts=0)",
          f"sample completions every {t.log_completions} steps" if t.log_completions else
          "no sample completions (train.log_completions=0)",
          (f"checkpoints every {t.save_every} steps" if t.save_every else "a checkpoint at "
           "the end") + f", the HF export and plots at the end, in {workdir}"]
  return "; ".join(said)


def _rollout_state(job: Run) -> dict:
  """What the rollout strategy carries from step to step (a carried rollout's rows), for
  the checkpoint: {} for the strategies that carry nothing."""
  return getattr(job.strategy, "state_dict", dict)()


def _on_nonfinite(step: int, metrics: dict, mode: str, ckpt, writer) -> None:
  """After an update that dropped non-finite optimizer steps: stop, or warn and carry on.

  Called from the metrics flush, which comes before every save: the update
  whose step this is has not been checkpointed yet.
  """
  # The first in the chain is the cause: a NaN loss makes NaN gradients, which make NaN weights.
  what = next(k for k in ("loss", "grads", "params") if metrics.get(f"nonfinite/{k}"))
  n = int(metrics["nonfinite/skipped"])
  if mode == "skip":
    logging.warning("step %d: dropped %d optimizer step(s) with non-finite %s "
                    "(train.on_nonfinite=skip; metric nonfinite/skipped)", step, n, what)
    return
  ckpt.close()  # lets a save in flight finish: the last good checkpoint stays whole
  writer.close()
  steps = ckpt.all_steps()
  raise NonFiniteError(
      f"step {step}: non-finite {what} in {n} optimizer step(s); stopped without saving "
      f"(newest checkpoint: step {max(steps) if steps else None}). Set train.on_nonfinite=skip to drop such "
      "steps and carry on.")


def _progress(total: int, *, initial: int = 0, desc: str = ""):
  """A progress bar on process 0; in a log file (no terminal) it updates once a minute."""
  tty = sys.stderr.isatty()
  return tqdm.tqdm(total=total, initial=initial, desc=desc, disable=jax.process_index() != 0,
                   dynamic_ncols=True, mininterval=0.1 if tty else 60.0,
                   maxinterval=10.0 if tty else 600.0)


def _sample_completions(host, settings: RolloutConfig, rows: int = 4) -> list[dict]:
  """The first completion of each of the first `rows` groups of this process's last
  rollout: prompt, completion, each reward, their weighted sum, the advantage the
  run's estimator gives it within its group, and the columns the reward functions
  logged for it (log_extra) under "extra"."""
  calls, host.recent = host.recent, []
  if not calls:
    return []
  ids = np.concatenate([c["example_ids"] for c in calls])
  rewards = np.concatenate([c["rewards"] for c in calls])
  prompts = [p for c in calls for p in c["prompts"]]
  completions = [x for c in calls for x in c["completions"]]
  columns = dict.fromkeys(col for c in calls for col in c["extra"])
  extra = {col: [x for c in calls for x in c["extra"].get(col, [None] * len(c["example_ids"]))]
           for col in columns}
  # Combined and normalised exactly as the rollout does it (NaN rewards included).
  total = np.asarray(advantages_lib.combine_rewards(jnp.asarray(rewards),
                                                    jnp.asarray(host.weights, jnp.float32)))
  # PPO's advantages are per token, from the critic: none to show per completion.
  estimator = (None if advantages_lib.needs_critic(settings.estimator)
               else advantages_lib.ESTIMATORS.get(settings.estimator))
  G, out = settings.group_size, []
  for example in list(dict.fromkeys(ids.tolist()))[:rows]:
    members = np.flatnonzero(ids == example)
    i = int(members[0])
    row = {"prompt": prompts[i], "completion": completions[i],
           "rewards": {n: float(v) for n, v in zip(host.names, rewards[i])},
           "reward": float(total[i])}
    if extra:
      row["extra"] = {col: values[i] for col, values in extra.items()}
    # The whole group is here: its advantages as the rollout computes them (not for
    # estimators that normalise over the batch, like gdpo: one group cannot tell).
    if (estimator is not None and len(members) == G
        and not advantages_lib.is_per_function(settings.estimator)):
      adv = estimator(jnp.asarray(total[members]), G, scale=settings.advantage_scale,
                      eps=settings.advantage_eps)
      row["advantage"] = float(adv[0])
    out.append(row)
  return out


def print_summary(summary: dict, workdir: str) -> None:
  """The end-of-run table: accuracy before and after GRPO, reward, speed, outputs."""
  start, end, last = summary["start"], summary["end"], summary["last"]
  rows = [("eval/accuracy (start of GRPO)", start.get("eval/accuracy")),
          ("eval/accuracy (end)", end.get("eval/accuracy")),
          ("reward (last step)", last.get("reward")),
          ("steps/s (mean, after the first)", summary.get("steps_per_s"))]
  rows += [(k, v) for k, v in end.items() if k.startswith("eval/") and k != "eval/accuracy"]
  width = max(len(k) for k, _ in rows)
  print()
  for k, v in rows:
    print(f"{k:<{width}}  {'-' if v is None else f'{v:.3f}'}")
  print(f"{'metrics':<{width}}  {os.path.join(workdir, 'metrics.jsonl')}")
  print(f"{'plots':<{width}}  {os.path.join(workdir, 'plots')}")
  print(f"{'HF export':<{width}}  {summary['hf']}")
