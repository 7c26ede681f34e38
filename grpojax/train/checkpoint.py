"""Checkpoints with orbax: async saves, the last k plus the best by eval, restore
onto the current mesh, and export of the policy in Hugging Face format.

A checkpoint holds the TrainState's arrays and a small JSON of host-side state
(the data iterator's position). Random keys are not saved: each step derives
its keys from the root seed and the step number, so a resumed run draws the
same samples as an uninterrupted one.

Resuming takes the newest checkpoint that reads back: a newer one that does
not (a crash mid-write, a corrupted disk) is moved aside with one line saying
why. Failures that stop the run (a full disk, nothing readable) raise
CheckpointError, one line naming the cause and the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from grpojax import models
from grpojax.models import lora as lora_lib
from grpojax.train.state import TrainState, check_finite

BEST_METRIC = "eval/accuracy"


class CheckpointError(RuntimeError):
  """Saving or restoring checkpoints failed; the message is one line with the cause and path."""


class WorkdirBusy(CheckpointError):
  """Another run holds the workdir's lock: two runs would delete each other's saves."""


LOCK_FILE = "run.lock"
# After a failed restore, how long tensorstore's reader threads get to print their
# tracebacks into the noise log rather than around the one line that explains them.
_DRAIN_S = 1.0


def _lock_holder(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.loads(f.read() or "{}")
  except (OSError, ValueError):
    return {}


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Holds `workdir/run.lock` for a run (process 0's, in a multi-process run; the
  others take none). The kernel's flock on it ends with the process however it
  ends, so a killed run leaves no lock behind on this host; the file names its
  holder (pid, host, start) for the error a second run gets, and a holder on
  another host, whose lock this host cannot test, is refused too. Raises
  WorkdirBusy, one line."""
  if jax.process_index() != 0:
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _lock_holder(path)
      raise WorkdirBusy(
          f"{workdir} is in use by another run (pid {holder.get('pid', '?')} on "
          f"{holder.get('host', 'this host')}, since {holder.get('since', '?')}): wait for it "
          "or stop it; two runs on one workdir delete each other's checkpoints") from None
    holder, host = _lock_holder(path), socket.gethostname()
    if holder.get("host") not in (None, host):  # its flock may not reach this host
      raise WorkdirBusy(
          f"{workdir} is in use by a run on {holder['host']} (pid {holder.get('pid', '?')}, "
          f"since {holder.get('since', '?')}); if it is no longer running, delete {path}")
    if holder:  # this host's, and its flock is gone: the process ended without releasing
      logging.info("%s: the lock of pid %s (ended) taken over", workdir, holder.get("pid"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": host,
                              "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # released: an empty file names no holder
  finally:
    os.close(fd)  # and with it the flock


def _chain(e: BaseException):
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


def disk_full(e: BaseException) -> bool:
  """Out of disk (or quota), as the OS or tensorstore (RESOURCE_EXHAUSTED) says it."""
  for x in _chain(e):
    if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if "RESOURCE_EXHAUSTED" in str(x) or "No space left on device" in str(x):
      return True
  return False


def _reason(e: BaseException) -> str:
  """One short line for an exception (tensorstore's messages run to pages)."""
  text = (str(e).strip().splitlines() or [""])[0]
  text = text.split(" [tensorstore_spec")[0]
  return f"{type(e).__name__}: {text[:300]}"


@contextlib.contextmanager
def _stderr_to(path: str | None):
  """File descriptor 2 appended to `path` (None: left alone), for C++ and thread
  output that no Python handler sees."""
  if path is None:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(path, "a", encoding="utf-8") as log:
      os.dup2(log.fileno(), 2)
      try:
        yield
      finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
  finally:
    os.close(saved)


def _best_metric(metrics: dict) -> float:
  return metrics[BEST_METRIC]


class _NoMissingMetricWarning(logging.Filter):
  """Most saves carry no eval (it runs every train.eval_every steps): orbax's
  warning for each of them says nothing wrong."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoMissingMetricWarning())


class _ToNoiseLog(logging.Filter):
  """orbax's own warnings and errors (a failed save logs a traceback from each of
  its threads: hundreds of lines on a full disk) appended to the noise log instead
  of stderr, where the run says the cause in one line."""

  LIBRARIES = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "tensorstore"))
  FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(pathname)s:%(lineno)d %(message)s")

  def __init__(self, path: str):
    super().__init__()
    self.path = path

  def filter(self, record: logging.LogRecord) -> bool:
    if not any(name in record.pathname for name in self.LIBRARIES):
      return True
    try:
      with open(self.path, "a", encoding="utf-8") as log:
        log.write(self.FORMAT.format(record) + "\n")
    except OSError:
      pass  # a full disk refuses this too: dropped, as it says nothing the line does not
    return False


def _arrays(state: TrainState) -> dict:
  arrays = {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "ref_params": state.ref_params}
  if state.critic_params is not None:  # PPO's critic; absent otherwise (older checkpoints too)
    arrays["critic_params"] = state.critic_params
  return arrays


class Checkpointer:
  """Wraps an orbax CheckpointManager for TrainStates.

  Args:
    directory: where step folders go (created).
    keep: how many of the latest checkpoints to keep; the best by
      `eval/accuracy` (when saves carry it) is kept as well.
    async_save: let saves finish in the background (the next save, `wait` or
      `close` waits for the previous one).
  """

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True,
               base: dict | None = None, noise_log: str | None = None):
    self.directory = os.path.abspath(directory)
    # Where the pages a broken checkpoint's read prints go (tensorstore's callbacks
    # print "Event loop is closed" tracebacks straight to stderr): the one warning
    # line says what happened.
    self.noise_log = noise_log
    self._noise = None if noise_log is None else _ToNoiseLog(noise_log)
    if self._noise is not None:
      logging.getLogger("absl").addFilter(self._noise)
    self._check_writable()
    self._set_aside_unreadable_metrics()
    # LoRA: the frozen base the adapters belong to (base_identity), saved with each
    # checkpoint and checked on restore: adapters on another base are another model.
    self.base = base
    preserve = policies.AnyPreservationPolicy([
        policies.LatestN(keep),
        policies.BestN(get_metric_fn=_best_metric, n=1,
                       keep_checkpoints_without_metrics=False),
    ])
    # best_fn as well: orbax writes a save's metrics to disk only when it is set.
    # Without them, a manager reopened on resume sees no metric on any old step,
    # and BestN (keep_checkpoints_without_metrics=False) deletes the best one.
    options = ocp.CheckpointManagerOptions(preservation_policy=preserve,
                                           best_fn=_best_metric, best_mode="max",
                                           enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self.keep = keep
    self.async_save = async_save
    # The step whose write may still be running. Its failure surfaces at the next
    # save or at close, and must be named as its own, not as the step saving then.
    self._writing: int | None = None

  def _check_writable(self):
    """Now, in one line: a folder that refuses writes fails orbax's first save only
    after its processes wait minutes on each other."""
    try:
      os.makedirs(self.directory, exist_ok=True)
      with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".writable-"):
        pass
    except OSError as e:
      raise CheckpointError(f"the checkpoint folder {self.directory} is not writable: "
                            f"{_reason(e)}") from e

  def _set_aside_unreadable_metrics(self):
    """A step whose saved metrics (its eval accuracy, for keeping the best) do not read
    as JSON stops orbax's manager from opening the folder at all: moved aside, as a
    checkpoint that fails to restore is, with one line."""
    bad = []
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name, "metrics", "metrics")
      if not (name.isdigit() and os.path.isfile(path)):
        continue
      try:
        with open(path, encoding="utf-8") as f:
          ok = isinstance(json.load(f), dict)
      except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError included
        ok = False
      if not ok:
        bad.append(int(name))
    for step in bad:
      logging.warning("checkpoint step %d in %s has an unreadable metrics file: %s", step,
                      self.directory, self._move_aside(step))
    if bad and jax.process_count() > 1:
      multihost_utils.sync_global_devices("grpojax: unreadable checkpoints moved aside")

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _raise(self, action: str, step, e: BaseException):
    cause = "disk full" if disk_full(e) else _reason(e)
    raise CheckpointError(f"{action} checkpoint step {step} in {self.directory} failed: "
                          f"{cause}") from e

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: TrainState, extra: dict, *, metrics: dict | None = None,
           force: bool = False, rollout: dict | None = None) -> bool:
    """Saves the state at `step` with JSON-able `extra`; `metrics` may carry eval/accuracy;
    `rollout`: host arrays by name (a carried rollout's rows), restored as
    extra["rollout"]."""
    if metrics is not None and BEST_METRIC in metrics:
      metrics = {BEST_METRIC: float(metrics[BEST_METRIC])}
    else:
      metrics = None
    if self.base is not None:
      extra = dict(extra, base=self.base)
    items = dict(state=ocp.args.StandardSave(_arrays(state)), extra=ocp.args.JsonSave(extra))
    if rollout:
      items["rollout"] = ocp.args.StandardSave(dict(rollout))
    args = ocp.args.Composite(**items)
    # orbax waits for the previous save before writing (and raises its failure
    # from there): wait here, so that the failure is named as the previous step's.
    self._wait()
    try:
      saved = self.manager.save(step, args=args, metrics=metrics, force=force)
    except Exception as e:  # noqa: BLE001 - this step's blocking part
      self._raise("saving", step, e)
    if saved and self.async_save:
      self._writing = step
    return saved

  def _wait(self):
    """Waits for the save in flight; its failure raises CheckpointError naming its step."""
    step, self._writing = self._writing, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      self._raise("saving", step if step is not None else self.latest_step(), e)

  def restore(self, state: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
    """Restores into the structure, shapes and shardings of `state` (a fresh state
    on the current mesh); returns (state, extra). step None: the latest."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _arrays(state))
    items = dict(state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore())
    path = ocp.step.find_step_path(self.directory, ocp.step.standard_name_format(), step=step)
    if os.path.isdir(os.path.join(str(path), "rollout")):
      items["rollout"] = ocp.args.StandardRestore()
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    arrays = out["state"]
    saved_base = out["extra"].get("base")
    if self.base is not None and saved_base != self.base:
      raise ValueError(f"its LoRA adapters were trained on another base model ({saved_base}, "
                       f"now {self.base})")
    restored = state.replace(step=arrays["step"], params=arrays["params"],
                             opt_state=arrays["opt_state"], ref_params=arrays["ref_params"],
                             critic_params=arrays.get("critic_params"))
    extra = dict(out["extra"])
    if "rollout" in items:
      extra["rollout"] = {k: np.asarray(v) for k, v in out["rollout"].items()}
    return restored, extra

  def restore_latest(self, state: TrainState) -> tuple[TrainState, dict, int] | None:
    """The newest checkpoint that restores, as (state, extra, step); None if none exist.

    Newer checkpoints that fail are moved to `<directory>.corrupt/` (so that
    the resumed run can save those steps again), each with one warning line.
    When none restores, nothing is moved (a changed model config fails them
    all alike) and CheckpointError names the newest one's failure.
    """
    steps = sorted(self.all_steps(), reverse=True)
    failed = []
    asyncio_log = logging.getLogger("asyncio")
    for step in steps:
      # A broken checkpoint makes each of tensorstore's reads log its own page-long
      # "exception never retrieved": the one line below says it instead.
      level = asyncio_log.level
      asyncio_log.setLevel(logging.CRITICAL)
      try:
        with _stderr_to(self.noise_log):
          try:
            restored, extra = self.restore(state, step)
          except Exception:
            if self.noise_log is not None:  # the readers still running print as they end
              time.sleep(_DRAIN_S)
            raise
      except Exception as e:  # noqa: BLE001 - any failure: try the next older one
        if disk_full(e):
          self._raise("restoring", step, e)
        failed.append((step, _reason(e)))
        continue
      finally:
        asyncio_log.setLevel(level)
      for bad, why in failed:
        logging.warning("checkpoint step %d in %s cannot be restored (%s): skipped and %s; "
                        "resuming from step %d", bad, self.directory, why,
                        self._move_aside(bad), step)
      if failed:
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices("grpojax: checkpoints moved aside")
        self.manager.reload()
      self._prune()
      return restored, extra, step
    if failed:
      bad, why = failed[0]
      raise CheckpointError(
          f"no checkpoint in {self.directory} can be restored (steps {[s for s, _ in failed]}; "
          f"step {bad}: {why}); if the model config changed, resume with the one they were "
          "saved with, else move the directory away to start afresh")
    return None

  def _prune(self):
    """Removes the steps the keep policy no longer holds (the newest `keep`, and the
    best by eval/accuracy). orbax prunes as it saves: a run killed between its last
    save and that pruning (in the HF export) leaves one step too many, which a
    resumed run with nothing left to save would never remove."""
    steps = sorted(self.all_steps())
    scores = {}
    for step in steps:
      path = os.path.join(self.directory, str(step), "metrics", "metrics")
      try:
        with open(path, encoding="utf-8") as f:
          scores[step] = float(json.load(f)[BEST_METRIC])
      except (OSError, ValueError, KeyError, TypeError):
        pass  # no eval saved with it: not a candidate for the best
    keep = set(steps[-self.keep:])
    if scores:
      keep.add(max(scores, key=lambda s: (scores[s], s)))
    for step in steps:
      if step not in keep:
        logging.info("checkpoint step %d in %s: past keep_checkpoints=%d, removed", step,
                     self.directory, self.keep)
        self.manager.delete(step)

  def _move_aside(self, step: int) -> str:
    try:
      path = str(ocp.step.find_step_path(self.directory, ocp.step.standard_name_format(),
                                         step=step))
    except ValueError:
      return "left in place (its folder was not found)"
    aside = os.path.join(self.directory + ".corrupt", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    if jax.process_index() == 0:  # one move per shared directory
      os.makedirs(os.path.dirname(aside), exist_ok=True)
      shutil.move(path, aside)
    return f"moved to {aside}"

  def close(self):
    try:
      self._wait()
      self.manager.close()
    finally:
      if self._noise is not None:
        logging.getLogger("absl").removeFilter(self._noise)


def base_identity(path: str, *, arch: str = "", seed: int = 0) -> dict:
  """What identifies LoRA's frozen base: an HF directory's path and a fingerprint of its
  weights, or a built model's preset and seed.

  The fingerprint is a SHA-256 over each safetensors file's name, size, header
  (every tensor's name, dtype, shape and offsets) and 32 samples of 64 KiB spread
  through its data: a fine-tuned copy of a model differs in every sample, and
  reading 2 MiB per file takes milliseconds where hashing a 7B model's 15 GB takes minutes.
  """
  if not path:
    return {"arch": arch, "seed": seed}
  digest = hashlib.sha256()
  for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    digest.update(f"{name}:{size}".encode())
    with open(file, "rb") as f:
      head = f.read(8)
      digest.update(f.read(int.from_bytes(head, "little")) if len(head) == 8 else head)
      for k in range(32):
        f.seek(size * k // 32)
        digest.update(f.read(1 << 16))
  return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}


def export_hf(state: TrainState, path: str, *, tokenizer=None, dtype: str | None = None,
              base_path: str = "", merged: str | None = None) -> str:
  """Writes the policy as an HF-format directory loadable by transformers.

  dtype: parameter dtype to write (default: the model's compute dtype).
  With LoRA (state.frozen set), `path` becomes a PEFT adapter directory
  (adapter_config.json naming `base_path`, adapter_model.safetensors in float32,
  the tokenizer): peft.PeftModel.from_pretrained(base, path) loads it. `merged`:
  a directory for the full model with the adapters folded in as well (the base
  dequantised first if it was quantised). PPO's critic (state.critic_params) goes to
  `path`/critic as a *ForSequenceClassification directory of one label (a LoRA
  critic's adapters folded into the base), which TRL's and verl's value models load.
  """
  check_finite(state.params, f"export {path}")
  cfg = state.model_config
  dtype = dtype or cfg.dtype
  ids = {}
  if tokenizer is not None:  # the ids the run used, for generate() to stop and pad with
    eos = tuple(tokenizer.eos_ids)
    ids = dict(eos_token_id=eos[0] if len(eos) == 1 else eos, pad_token_id=tokenizer.pad_id,
               bos_token_id=getattr(tokenizer, "bos_id", None))
    ids = {k: v for k, v in ids.items() if v is not None and getattr(cfg, k) is None}
  if state.frozen is not None:
    lora = lora_lib.config_of(state.params, cfg.lora_scale)
    lora_lib.save_peft(cfg, lora, state.params, path, base_path=base_path)
    if tokenizer is not None and jax.process_index() == 0:
      tokenizer.save_pretrained(path)
    full = (lora_lib.merge(state.model_params, cfg.lora_scale), merged) if merged else None
  else:
    full = state.params, path
  if full is not None:
    params, full_dir = full
    params = {k: v.astype(dtype) for k, v in params.items()}
    model = models.Transformer(cfg.replace(param_dtype=dtype, **ids), params=params)
    if state.frozen is not None and base_path:
      model.source_path = base_path  # its config fields and tokenizer files
    models.save_pretrained(model, full_dir, tokenizer=tokenizer)
  if state.critic_params is not None:
    _export_critic(state, os.path.join(path, "critic"), dtype, ids, tokenizer)
  return path


def _export_critic(state: TrainState, path: str, dtype: str, ids: dict, tokenizer) -> None:
  """PPO's critic as an HF sequence classifier at `path` (see export_hf)."""
  check_finite(state.critic_params, f"export {path}")
  cfg = state.critic_config
  params = state.critic_model_params
  if state.frozen is not None:  # its adapters folded into the shared base
    params = lora_lib.merge(params, cfg.lora_scale)
    cfg = cfg.replace(lora_scale=1.0)
  names = models.param_specs(cfg)  # the base's lm_head is the policy's, not the critic's
  params = {k: params[k].astype(dtype) for k in names}
  model = models.Transformer(cfg.replace(param_dtype=dtype, **ids), params=params)
  models.save_pretrained(model, path, tokenizer=tokenizer)
