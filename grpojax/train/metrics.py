"""Run outputs on process 0: config.json, metrics.jsonl, TensorBoard events, W&B.

metrics.jsonl is the record of truth (one JSON object per logged step); the
other sinks are views of it and are skipped, never required, when their
package is missing.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from grpojax import registry

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CONFIG_PY = "config.py"  # loads config.json: `--config WORKDIR/config.py` resumes the run
TB_DIR = "tb"
WANDB_ID_FILE = "wandb_run_id"
COMPLETIONS_FILE = "completions.jsonl"

_warned_no_tensorboard = False
_CONFIG_PY = '''"""The config of the run in this directory (config.json, beside this file).

Resume or repeat the run from the command line, whether it was started there or from
Python (grpojax.GRPOTrainer):
  python -m grpojax.main --config THIS_DIR/config.py --workdir THIS_DIR
"""

import os

from grpojax import config


def get_config():
  return config.from_json(os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.json"))
'''


def _to_number(key: str, value: Any) -> int | float | None:
  """A Python int/float from a host or 0-d device scalar; None stays None."""
  if value is None:
    return None
  if isinstance(value, bool):
    return int(value)
  if isinstance(value, (int, float)):
    return value
  array = np.asarray(value)  # a device value: the caller logs one step late, so no stall
  if array.size != 1:
    raise TypeError(f"metric {key!r} must be a scalar, got shape {array.shape}")
  array = array.reshape(())
  if array.dtype.kind in "biu":
    return int(array)
  if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
    return float(array)
  raise TypeError(f"metric {key!r} must be a number, got {array.dtype}")


def _parse_lines(path: str) -> list[dict]:
  """The file's rows; a line that is no JSON object (torn by a kill mid-write, or
  damaged bytes) is skipped with a warning, as it carries nothing usable."""
  rows = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      raw = raw.strip()
      if not raw:
        continue
      try:
        row = json.loads(raw.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError):
        row = None
      if isinstance(row, dict) and isinstance(row.get("step"), int):
        rows.append(row)
      else:
        logging.warning("skipping unreadable line %d of %s: %.80r", number, path, raw)
  return rows


def read_metrics(workdir: str) -> list[dict]:
  """The rows of `workdir/metrics.jsonl`, in file order (NaN reads back as NaN)."""
  return _parse_lines(os.path.join(workdir, METRICS_FILE))


def _atomic_write(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class Logger:
  """A view of metrics.jsonl somewhere else: TensorBoard, W&B, or a user's.

  One class is a logger: subclass this, override `write` (and, if it shows them,
  `write_completions`; `flush` and `close` if it holds resources), and register a
  factory under a name that `train.loggers` can list:

    class PrintLogger(metrics.Logger):
      def write(self, step, metrics):
        print(step, metrics)

    metrics.register_logger("print", lambda workdir, config, resume_step: PrintLogger())

  `MetricsWriter` gives every logger each row it writes to metrics.jsonl (the
  numbers only: a None value is left out), process 0 only. The factory gets the
  run's workdir, its config as a dict (None outside a run) and the step a resumed
  run starts at (None: a fresh run), to hide or drop what was logged after it.
  """

  def write(self, step: int, metrics: Mapping[str, int | float]) -> None:
    raise NotImplementedError

  def write_completions(self, step: int, rows: list[dict]) -> None:
    """Sample completions ({"prompt", "completion", "rewards", ...} each); default: none."""

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


# train.loggers names -> factory(workdir, config, resume_step) -> Logger (or None: skipped).
LOGGERS = registry.Registry[Callable[[str, "dict | None", "int | None"], "Logger | None"]](
    "train.loggers")


def register_logger(name: str, factory, *, override: bool = False):
  """Makes `name` a value of train.loggers: factory(workdir, config, resume_step) -> Logger."""
  return LOGGERS.register(name, factory, override=override)


class TensorBoardLogger(Logger):
  """TensorBoard events under workdir/tb (tensorboardX); scalars, and completions as a
  text table."""

  def __init__(self, writer):
    self._tb = writer

  @classmethod
  def create(cls, workdir: str, config: dict | None, resume_step: int | None):
    global _warned_no_tensorboard
    try:
      import tensorboardX  # pylint: disable=import-outside-toplevel
    except ImportError:
      if not _warned_no_tensorboard:
        logging.warning("tensorboardX is not installed: no TensorBoard events "
                        "(metrics.jsonl is still written; pip install tensorboardX)")
        _warned_no_tensorboard = True
      return None
    # purge_step makes TensorBoard hide events at steps >= the resumed step that the
    # interrupted run already wrote, so the curves match an uninterrupted run.
    return cls(tensorboardX.SummaryWriter(logdir=os.path.join(workdir, TB_DIR),
                                          purge_step=resume_step, flush_secs=30))

  def write(self, step, metrics):
    for key, value in metrics.items():
      self._tb.add_scalar(key, value, global_step=step)

  def write_completions(self, step, rows):
    head = list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(cell(r.get(k)) for k in head) + " |" for r in rows]
    self._tb.add_text("completions", "\n".join(table), global_step=step)

  def flush(self):
    self._tb.flush()

  def close(self):
    self._tb.close()


class WandbLogger(Logger):
  """A W&B run (project: the config's train.wandb_project), resumed across restarts
  through the run id kept in workdir/wandb_run_id."""

  def __init__(self, run):
    self._run = run

  @classmethod
  def create(cls, workdir: str, config: dict | None, resume_step: int | None):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError:
      logging.warning("wandb is a logger but is not installed; not logging to W&B")
      return None
    project = ((config or {}).get("train") or {}).get("wandb_project") or "grpojax"
    # A run id kept in the workdir lets a resumed run continue the same W&B run.
    id_path = os.path.join(workdir, WANDB_ID_FILE)
    if os.path.exists(id_path):
      with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(4)  # W&B ids are short alphanumerics (wandb.util has none now)
      _atomic_write(id_path, run_id + "\n")
    return cls(wandb.init(project=project, id=run_id, resume="allow", config=config,
                          dir=workdir, name=os.path.basename(os.path.abspath(workdir))))

  def write(self, step, metrics):
    self._run.log(dict(metrics), step=step)

  def write_completions(self, step, rows):
    import wandb  # pylint: disable=import-outside-toplevel
    head = list(rows[0])
    self._run.log({"completions": wandb.Table(
        columns=head, data=[[str(r.get(k)) for k in head] for r in rows])}, step=step)

  def close(self):
    self._run.finish()


register_logger("tensorboard", TensorBoardLogger.create)
register_logger("wandb", WandbLogger.create)


class MetricsWriter:
  """Writes a run's config and per-step metrics; a no-op on processes other than 0.

  Usage:
    with MetricsWriter(workdir, config=cfg, loggers=("tensorboard",), resume_step=start) as w:
      w.write(step, {"reward": r, "kl": kl})

  metrics.jsonl is always written; `loggers` are registered names (LOGGERS: the
  config's train.loggers) or Logger objects, each given every row. `resume_step=s`
  (resuming from the checkpoint at step s) first drops the lines of metrics.jsonl
  with step >= s, which the interrupted run wrote after its checkpoint and the
  resumed run will write again.
  """

  def __init__(self, workdir: str, *, config: dict | None = None,
               loggers: Sequence[str | Logger] = ("tensorboard",),
               resume_step: int | None = None):
    self.workdir = workdir
    self.active = jax.process_index() == 0
    self._file = None
    self.last_row: str | None = None  # the newest row written, as its line (a checkpoint keeps it)
    self.loggers: list[Logger] = []
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    if config is not None:
      # default=str: a stray non-JSON leaf (a path object, a dtype) should not stop a run.
      _atomic_write(os.path.join(workdir, CONFIG_FILE),
                    json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
      _atomic_write(os.path.join(workdir, CONFIG_PY), _CONFIG_PY)
    path = os.path.join(workdir, METRICS_FILE)
    if resume_step is not None and os.path.exists(path):
      kept = [row for row in _parse_lines(path) if row.get("step", -1) < resume_step]
      _atomic_write(path, "".join(json.dumps(row) + "\n" for row in kept))
    self._file = open(path, "a", encoding="utf-8")
    samples = os.path.join(workdir, COMPLETIONS_FILE)
    if resume_step is not None and os.path.exists(samples):
      kept = [row for row in _parse_lines(samples) if row.get("step", -1) < resume_step]
      _atomic_write(samples, "".join(json.dumps(row) + "\n" for row in kept))
    for entry in dict.fromkeys(loggers):  # once each, in order
      logger = entry if isinstance(entry, Logger) else LOGGERS.get(entry)(workdir, config,
                                                                           resume_step)
      if logger is not None:  # None: its package is missing (warned)
        self.loggers.append(logger)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Appends one row: `{"step": step, **metrics}`, every value a scalar."""
    if not self.active:
      return
    if self._file is None:
      raise RuntimeError(f"MetricsWriter({self.workdir!r}) is closed")
    if "step" in metrics:
      raise ValueError("'step' is reserved in metrics; pass it as the step argument")
    step = int(step)
    values = {key: _to_number(key, value) for key, value in metrics.items()}
    row = {"step": step, **values}
    # NaN and inf are written as Python's json does (NaN, Infinity): a diverged
    # metric must read as NaN, not as a missing value (null).
    self.last_row = json.dumps(row)
    self._file.write(self.last_row + "\n")
    # Flushed per row (no fsync) so a preempted run keeps every line it logged.
    self._file.flush()
    numbers = {key: v for key, v in values.items() if v is not None}
    for logger in self.loggers:
      logger.write(step, numbers)

  def write_completions(self, step: int, rows: list[dict]) -> None:
    """Appends sample completions ({"prompt", "completion", "rewards", ...} each) to
    completions.jsonl, and to each logger (TensorBoard's text tab: one table)."""
    if not self.active or not rows:
      return
    with open(os.path.join(self.workdir, COMPLETIONS_FILE), "a", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps({"step": int(step), **row}, default=str) + "\n")
    for logger in self.loggers:
      logger.write_completions(int(step), rows)

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
      os.fsync(self._file.fileno())
    for logger in self.loggers:
      logger.flush()

  def close(self) -> None:
    if self._file is not None:
      self.flush()
      self._file.close()
      self._file = None
    loggers, self.loggers = self.loggers, []
    for logger in loggers:
      logger.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
