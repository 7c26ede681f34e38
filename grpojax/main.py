"""Command line: `python -m grpojax.main [--config experiments/X.py[:variant]] [--config.a.b=v]
[--workdir DIR] [--import MODULE ...]`.

Without --config, runs the embedded default (grpojax/default_experiment.py, also
experiments/arithmetic_tiny.py), whose settings are for its own task: a command that
names another task (`--config.task.name=prompt`) starts from grpojax's defaults
(`grpojax.config.get_config()`, docs/configuration.md) instead. The run's
first line says which config is in force. A --config file may import modules next to it
(its directory is on sys.path); `--import my_losses` (repeatable) imports your
modules before the config is checked, so the losses, advantages, rewards and
tasks they register are found by name (`--config.loss.loss_type=my_loss`).
"""

import importlib
import os
import sys
import traceback


def _override(argv, key: str) -> str | None:
  """The value `--config.<key>=V` (or `--config.<key> V`) gives on the command line."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--config.{key}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--config.{key}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def _config_dirs(argv) -> list[str]:
  """The directories of --config files on the command line (for their sibling imports)."""
  out = []
  for i, arg in enumerate(argv):
    path = (arg.split("=", 1)[1] if arg.startswith("--config=")
            else argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
    if path:
      out.append(os.path.dirname(os.path.abspath(path.split(":", 1)[0])))
  return out


# The config file is loaded while the flags are parsed: its directory must be on the
# path by then. The working directory too, for --import of the user's own modules.
if __name__ == "__main__":
  for _dir in [os.getcwd(), *_config_dirs(sys.argv)]:
    if _dir not in sys.path:
      sys.path.insert(0, _dir)

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEFAULT = os.path.join(_HERE, "default_experiment.py")
_DEFAULTS = os.path.join(_HERE, "config.py")  # grpojax.config, not imported for --help
_EMBEDDED_TASK = "arithmetic"  # default_experiment.py's task, which its settings are for


def _base(argv) -> tuple[str, str]:
  """(the config file a command without --config starts from, what to call it): the
  embedded experiment for its own task, grpojax's defaults for any other."""
  task = _override(argv, "task.name")
  if task is None or task == _EMBEDDED_TASK:
    return _DEFAULT, "the embedded arithmetic experiment (grpojax/default_experiment.py)"
  return _DEFAULTS, (f"grpojax's defaults (docs/configuration.md): "
                     f"task.name={task} leaves the embedded arithmetic experiment")


def _source(argv) -> str:
  """The config in force, for the run's first line."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return _base(argv)[1]


def _one_line(e: Exception, argv) -> str:
  """An error of ml_collections applying --config.a.b=v, as one line."""
  text = str(e)
  if len(text) > 1 and text[0] == text[-1] == "'":
    text = text[1:-1]
  text = " ".join(text.replace("\\n", "\n").replace("\\'", "'").split())
  if isinstance(e, (AttributeError, KeyError)) and text.strip("\"'").isidentifier():
    text = f"no field {text.strip(chr(34))}"  # ml_collections says only the name
  overrides = " ".join(a for a in argv[1:] if a.startswith("--config"))
  return f"error: config: {text} (in {overrides})"


# --help lists the flags and loads no config: that would import JAX (seconds) to print text.
_HELP = __name__ == "__main__" and bool({"-?", "--help", "--helpshort"} & set(sys.argv[1:]))
try:  # ml_collections applies the --config.a.b=v overrides here, as the flag is defined
  _CONFIG = (flags.DEFINE_string("config", _base(sys.argv)[0], "Experiment config file.")
             if _HELP else config_flags.DEFINE_config_file(
                 "config", _base(sys.argv)[0], "Experiment config file.", lock_config=True))
except (AttributeError, KeyError, TypeError, ValueError) as _e:
  if __name__ != "__main__":
    raise
  print(_one_line(_e, sys.argv), file=sys.stderr)
  sys.exit(2)
_WORKDIR = flags.DEFINE_string("workdir", "workdir", "Outputs, checkpoints; resumes if present.")
_IMPORT = flags.DEFINE_multi_string(
    "import", [], "A module of yours to import first (repeatable): what it registers "
    "(losses, advantage estimators, rewards, tasks) can then be named in the config.")


def _parse_flags(argv):
  """absl's flag parsing, with a config override that cannot apply reported in one line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # an unknown flag, a value of the wrong type
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # noqa: BLE001 - from ml_collections applying --config.a.b=v
    print(_one_line(e, argv), file=sys.stderr)
    sys.exit(2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  for name in _IMPORT.value:
    try:
      importlib.import_module(name)
    except ImportError as e:
      print(f"error: --import {name}: {e} (searched the working directory, the --config "
            "file's directory and PYTHONPATH)", file=sys.stderr)
      return 2
  cfg = _CONFIG.value
  print(f"config: {_source(sys.argv)}", flush=True)  # stdout: a mistake stays one line on stderr
  from grpojax.data import tasks  # noqa: PLC0415  (registered by --import above too)
  task = tasks.TASKS.get(cfg.task.name) if cfg.task.name in tasks.TASKS else None
  if (task is not None and task.sft_target is None and cfg.sft.steps
      and _override(sys.argv, "sft.steps") is None):
    # The experiment's warm start, for a task it was not written for: skipped. One set
    # on the command line stays, and validation names it.
    logging.warning("sft.steps=%d (the experiment's) skipped: task %r has no SFT target",
                    cfg.sft.steps, task.name)
    cfg.sft.steps = 0
  from grpojax import config as config_lib  # noqa: PLC0415  (not for --help)

  try:
    config_lib.validate(cfg)
  except config_lib.ConfigError as e:
    print(e, file=sys.stderr)
    return 2
  import jax  # noqa: PLC0415  (heavy imports only once the config is known good)

  from grpojax.data.tasks import DataError
  from grpojax.parallel import peers
  from grpojax.rewards.base import RewardFunctionError
  from grpojax.rewards.code import SandboxUnavailable
  from grpojax.train import checkpoint, loop
  from grpojax.train.state import NonFiniteError

  loop.show_info()

  try:
    summary = loop.train(cfg, _WORKDIR.value)
  except Exception as e:  # noqa: BLE001 - the user's problems get one line, bugs a traceback
    known = isinstance(e, (DataError, checkpoint.CheckpointError, RewardFunctionError,
                           NonFiniteError, SandboxUnavailable, config_lib.ConfigError))
    # The other processes of a multi-process run stop too, quoting this line.
    peers.failed(peers.error_line(e))
    if not (known or checkpoint.disk_full(e)):
      if peers.watching():  # multi-process: ends here, not in JAX's shutdown
        traceback.print_exc()
        peers.leave(1)
      raise
    if isinstance(e, checkpoint.WorkdirBusy):  # the workdir is the other run's: no error.log
      print(f"error: {e}", file=sys.stderr)
      peers.leave(1)
      return 1
    # The cause in one line; the traceback (pages, for tensorstore) goes to a file.
    log = os.path.join(_WORKDIR.value, "error.log")
    try:
      os.makedirs(_WORKDIR.value, exist_ok=True)
      with open(log, "a", encoding="utf-8") as f:
        traceback.print_exc(file=f)
    except OSError:
      log = "not written: " + log  # a full disk may refuse this too
    line = peers.error_line(e)
    print(f"error: {line if known else 'disk full: ' + line} (traceback: {log})", file=sys.stderr)
    peers.leave(1)
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
  app.run(main, flags_parser=_parse_flags)
