"""MetricsWriter: metrics.jsonl, config.json, resume truncation, TensorBoard, process 0 only."""

import glob
import json
import math
import os
import struct
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.train import metrics as metrics_lib
from grpojax.train.metrics import MetricsWriter, read_metrics


def _run(workdir, steps, *, resume_step=None, **kwargs):
  with MetricsWriter(workdir, loggers=(), resume_step=resume_step, **kwargs) as writer:
    for step in steps:
      writer.write(step, {"reward": 0.5 * step, "kl": 0.01 * step})


def test_jsonl_round_trip_converts_scalars(tmp_path):
  with MetricsWriter(str(tmp_path), loggers=()) as writer:
    writer.write(0, {
        "reward": 0.25,
        "count": 3,
        "nan": float("nan"),
        "np_float": np.float32(1.5),
        "np_int": np.int64(7),
        "jax_float": jnp.asarray(2.5, jnp.float32),
        "jax_bf16": jnp.asarray(0.75, jnp.bfloat16),
        "jax_int": jnp.asarray(4, jnp.int32),
        "jax_nan": jnp.asarray(jnp.nan),
        "clip_ratio/low_mean": np.asarray(0.125),
    })
    writer.write(np.int32(1), {"reward": jnp.float32(0.5)})
  text = (tmp_path / "metrics.jsonl").read_text()
  # A diverged metric reads as NaN, never as a missing value.
  assert text.count("NaN") == 2 and "null" not in text
  rows = read_metrics(str(tmp_path))
  assert math.isnan(rows[0].pop("nan")) and math.isnan(rows[0].pop("jax_nan"))
  assert rows == [
      {"step": 0, "reward": 0.25, "count": 3, "np_float": 1.5, "np_int": 7,
       "jax_float": 2.5, "jax_bf16": 0.75, "jax_int": 4, "clip_ratio/low_mean": 0.125},
      {"step": 1, "reward": 0.5},
  ]
  assert isinstance(rows[0]["np_int"], int) and isinstance(rows[0]["jax_int"], int)


def test_rejects_non_scalars_and_step_key(tmp_path):
  with MetricsWriter(str(tmp_path), loggers=()) as writer:
    with pytest.raises(TypeError, match="'v'"):
      writer.write(0, {"v": np.zeros(3)})
    with pytest.raises(ValueError, match="reserved"):
      writer.write(0, {"step": 1})


def test_config_json_written(tmp_path):
  config = {"loss": {"loss_type": "dapo", "beta": 0.0}, "mesh": {"shape": {"data": 1}}}
  _run(str(tmp_path), [], config=config)
  assert json.loads((tmp_path / "config.json").read_text()) == config


def test_resume_equals_uninterrupted_run(tmp_path):
  full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
  _run(full, range(6))
  _run(resumed, range(5))  # interrupted after logging step 4, last checkpoint at step 3
  with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:
    f.write('{"step": 5, "rew')  # and a torn line from the kill
  _run(resumed, range(3, 6), resume_step=3)
  assert read_metrics(resumed) == read_metrics(full)
  with open(os.path.join(full, "metrics.jsonl")) as a, \
       open(os.path.join(resumed, "metrics.jsonl")) as b:
    assert a.read() == b.read()


def _tb_scalars(logdir):
  """(tag, step, value) of every scalar in the event files: TFRecord framing, parsed here."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4  # length, its crc, payload, payload crc
      for value in event.summary.value:
        out.append((value.tag, event.step, value.simple_value))
  return out


def test_tensorboard_events(tmp_path):
  pytest.importorskip("tensorboardX")
  with MetricsWriter(str(tmp_path), loggers=("tensorboard",)) as writer:
    writer.write(0, {"reward": 1.0, "eval/accuracy": jnp.float32(0.5), "missing": float("nan")})
    writer.write(1, {"reward": 2.0})
  scalars = _tb_scalars(str(tmp_path / "tb"))
  by_tag = {(tag, step): value for tag, step, value in scalars}
  assert by_tag[("reward", 0)] == 1.0 and by_tag[("reward", 1)] == 2.0
  assert by_tag[("eval/accuracy", 0)] == 0.5
  assert math.isnan(by_tag[("missing", 0)])


def test_missing_tensorboardx_warns_once(tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
  monkeypatch.setattr(metrics_lib, "_warned_no_tensorboard", False)
  for name in ("a", "b"):
    with MetricsWriter(str(tmp_path / name)) as writer:
      writer.write(0, {"reward": 1.0})
  assert sum("tensorboardX" in r.getMessage() for r in caplog.records) == 1
  assert read_metrics(str(tmp_path / "b")) == [{"step": 0, "reward": 1.0}]
  assert not (tmp_path / "b" / "tb").exists()


def test_wandb_logs_and_keeps_run_id(tmp_path, monkeypatch):
  calls = []

  class FakeRun:
    def log(self, values, step):
      calls.append(("log", values, step))

    def finish(self):
      calls.append(("finish",))

  def init(**kwargs):
    calls.append(("init", kwargs))
    return FakeRun()

  fake = types.SimpleNamespace(init=init)
  monkeypatch.setitem(sys.modules, "wandb", fake)
  for resume_step in (None, 1):
    with MetricsWriter(str(tmp_path), loggers=("wandb",), config={"a": 1},
                       resume_step=resume_step) as writer:
      writer.write(1, {"reward": 1.0, "nan": float("nan")})
  inits = [c[1] for c in calls if c[0] == "init"]
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  assert [i["id"] for i in inits] == [run_id, run_id] and run_id.isalnum()  # resumed: the same run
  assert inits[0]["config"] == {"a": 1} and inits[0]["project"] == "grpojax"
  logged = [c[1:] for c in calls if c[0] == "log"]
  assert logged[0][1] == 1 and logged[0][0]["reward"] == 1.0 and math.isnan(logged[0][0]["nan"])
  assert calls[-1] == ("finish",)


def test_nonzero_process_is_a_noop(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  workdir = str(tmp_path / "run")
  with MetricsWriter(workdir, config={"a": 1}, loggers=("tensorboard",), resume_step=0) as writer:
    writer.write(0, {"reward": 1.0})
    writer.flush()
  assert not os.path.exists(workdir)


class Collect(metrics_lib.Logger):
  """A logger in one class: keeps every row it is given."""

  def __init__(self):
    self.rows, self.closed = [], False

  def write(self, step, metrics):
    self.rows.append({"step": step, **metrics})

  def close(self):
    self.closed = True


@pytest.mark.slow
def test_a_logger_in_one_class_receives_every_row_of_a_run(tmp_path):
  """Registered by name and listed in train.loggers: the run's every metrics.jsonl row
  reaches it, and it is closed at the end."""
  from grpojax.config import validate
  from grpojax.train import loop
  from test_train_loop import tiny_config

  made = []
  metrics_lib.register_logger("collect", lambda workdir, config, resume_step: made.append(
      Collect()) or made[-1])
  try:
    cfg = tiny_config(2, **{"sft.steps": 0, "eval.num_prompts": 0, "train.loggers": "collect"})
    validate(cfg)
    loop.train(cfg, str(tmp_path))
  finally:
    metrics_lib.LOGGERS.pop("collect")
  (logger,) = made
  want = [{k: v for k, v in row.items() if v is not None} for row in read_metrics(str(tmp_path))]
  assert len(want) == 2 and logger.rows == want and logger.closed
  bad = tiny_config(2, **{"train.loggers": "collect"})
  with pytest.raises(ValueError, match="train.loggers.*collect"):
    validate(bad)  # unregistered again: named in one line


def test_a_logger_object_is_given_directly(tmp_path):
  logger = Collect()
  with MetricsWriter(str(tmp_path), loggers=(logger,)) as writer:
    writer.write(3, {"reward": 1.0, "none": None})
  assert logger.rows == [{"step": 3, "reward": 1.0}] and logger.closed
