"""Command line: `python -m grpojax.main [--config experiments/X.py[:variant]] [--config.a.b=v] [--workdir DIR]`.

Without --config, runs the embedded default (experiments/arithmetic_tiny.py).
"""

import os
import sys
import traceback

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from grpojax import config as config_lib

_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "experiments", "arithmetic_tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdir", "Outputs, checkpoints; resumes if present.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  cfg = _CONFIG.value
  try:
    config_lib.validate(cfg)
  except config_lib.ConfigError as e:
    print(e, file=sys.stderr)
    return 2
  from grpojax.data.tasks import DataError  # heavy imports only once the config is known good
  from grpojax.rewards.base import RewardFunctionError
  from grpojax.rewards.code import SandboxUnavailable
  from grpojax.train import checkpoint, loop
  from grpojax.train.state import NonFiniteError

  try:
    summary = loop.train(cfg, _WORKDIR.value)
  except Exception as e:  # noqa: BLE001 - the user's problems get one line, bugs a traceback
    known = isinstance(e, (DataError, checkpoint.CheckpointError, RewardFunctionError,
                           NonFiniteError, SandboxUnavailable, config_lib.ConfigError))
    if not (known or checkpoint.disk_full(e)):
      raise
    # The cause in one line; the traceback (pages, for tensorstore) goes to a file.
    log = os.path.join(_WORKDIR.value, "error.log")
    try:
      os.makedirs(_WORKDIR.value, exist_ok=True)
      with open(log, "a", encoding="utf-8") as f:
        traceback.print_exc(file=f)
    except OSError:
      log = "not written: " + log  # a full disk may refuse this too
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    print(f"error: {line if known else 'disk full: ' + line} (traceback: {log})", file=sys.stderr)
    return 1
  if jax.process_index() != 0:
    return 0  # one report per run, from the process that writes its files
  if summary["preempted"]:
    print(f"preempted: checkpoint saved at step {summary['step']}")
    return 0
  from grpojax import plot  # matplotlib only for a finished run's report

  plot.plot_metrics(_WORKDIR.value)
  loop.print_summary(summary, _WORKDIR.value)
  return 0


if __name__ == "__main__":
  app.run(main)
