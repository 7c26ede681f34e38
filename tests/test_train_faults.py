"""Faults around the loop (issue 16): a corrupt newest checkpoint falls back to the
older one with one line, a first checkpoint that never finished leaves no duplicate
metrics, a full disk or nothing restorable ends in one line, and SIGTERM is heard
while a reward function hangs."""

import asyncio
import errno
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from grpojax.data import tasks
from grpojax.models.tokenizers import load_tokenizer
from grpojax.parallel import mesh as mesh_lib
from grpojax.run import assemble as assemble_lib
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import metrics as metrics_lib
from grpojax.train import loop, wiring
from grpojax.train.optim import make_optimizer
from grpojax.train.state import create_train_state

from test_train_loop import ROOT, read, tiny_config
from grpojax.run.settings import read as read_settings


CORRUPTIONS = ["empty_data", "random_data", "no_manifest", "garbage_metadata"]


def corrupt(step_dir, kind):
  state = os.path.join(step_dir, "state")
  data = [f for f in glob.glob(os.path.join(state, "**", "d", "*"), recursive=True)
          if os.path.isfile(f)]
  assert data, os.listdir(state)
  if kind == "empty_data":
    for f in data:
      open(f, "w").close()
  elif kind == "random_data":
    for f in data:
      with open(f, "wb") as out:
        out.write(os.urandom(os.path.getsize(f)))
  elif kind == "no_manifest":
    for f in glob.glob(os.path.join(state, "**", "manifest.ocdbt"), recursive=True):
      os.remove(f)
  elif kind == "garbage_metadata":
    with open(os.path.join(state, "_METADATA"), "w") as f:
      f.write("{not json")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A 2-step run: checkpoints at steps 0 and 2, metrics rows 0, 1, 2."""
  workdir = str(tmp_path_factory.mktemp("run") / "w")
  loop.train(tiny_config(2, **{"sft.steps": 0}), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "2"]
  return workdir


def copy_of(workdir, tmp_path):
  target = str(tmp_path / "w")
  shutil.copytree(workdir, target)
  return target


def fresh_state(cfg):
  """A state of the run's structure, as the loop builds before restoring."""
  mesh = mesh_lib.make_mesh(cfg.mesh.shape.to_dict())
  run = read_settings(cfg)
  model_cfg, params = assemble_lib.load_model(
      run, wiring.model_config(run, load_tokenizer("char")), mesh)
  tx = make_optimizer(cfg.optim, cfg.train.steps)
  return create_train_state(model_cfg, params, tx,
                            with_reference=run.uses_reference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_restore_falls_back_past_a_corrupt_newest_checkpoint(finished_run, tmp_path, kind, caplog):
  workdir = copy_of(finished_run, tmp_path)
  directory = os.path.join(workdir, "checkpoints")
  corrupt(os.path.join(directory, "2"), kind)
  ckpt = checkpoint_lib.Checkpointer(directory)
  with caplog.at_level(logging.WARNING):
    state, extra, step = ckpt.restore_latest(fresh_state(tiny_config(2, **{"sft.steps": 0})))
  assert step == 0 and int(state.step) == 0 and extra["data"]["offset"] == 0
  said = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
  assert len(said) == 1 and "checkpoint step 2" in said[0] and "resuming from step 0" in said[0]
  # Never deleted silently: moved aside, where the line says.
  aside = glob.glob(directory + ".corrupt/2-*")
  assert len(aside) == 1 and aside[0] in said[0]
  assert ckpt.all_steps() == [0]
  ckpt.close()


@pytest.mark.slow
def test_resume_past_a_corrupt_checkpoint_equals_an_uninterrupted_run(finished_run, tmp_path,
                                                                      caplog):
  workdir = copy_of(finished_run, tmp_path)
  corrupt(os.path.join(workdir, "checkpoints", "2"), "empty_data")
  with caplog.at_level(logging.WARNING):
    out = loop.train(tiny_config(2, **{"sft.steps": 0}), workdir)
  assert out["step"] == 2
  assert any("checkpoint step 2" in r.getMessage() for r in caplog.records)
  # Steps 1 and 2 ran again: their rows replace the old ones, never duplicate them.
  assert read(workdir) == read(finished_run)


@pytest.mark.slow
def test_a_resume_with_nothing_left_to_run_mends_its_metrics_and_prunes(finished_run, tmp_path,
                                                                       caplog):
  """A run killed in its HF export, after its last save (before orbax pruned, and with
  its metrics.jsonl damaged: row 1 holds bytes that are no UTF-8, row 2 - the newest
  checkpoint's step, with its final eval - is torn mid-line). Each damaged line is
  skipped with a line naming it; the resume, which has nothing left to run or save,
  writes row 2 again from the copy its checkpoint keeps and prunes to keep_checkpoints.
  Row 1 is in no checkpoint: it stays lost, and said so."""
  workdir = copy_of(finished_run, tmp_path)
  directory = os.path.join(workdir, "checkpoints")
  path = os.path.join(workdir, "metrics.jsonl")
  lines = open(path, "rb").read().splitlines(keepends=True)
  assert len(lines) == 3
  with open(path, "wb") as f:
    f.write(lines[0] + b'{"step": 1, "reward": \xff\xfe}\n' + lines[2][:len(lines[2]) // 2])
  with caplog.at_level(logging.WARNING):
    assert [row["step"] for row in metrics_lib.read_metrics(workdir)] == [0]
  said = [r.getMessage() for r in caplog.records if "skipping unreadable line" in r.getMessage()]
  assert [m.split(" of ")[0] for m in said] == ["skipping unreadable line 2",
                                               "skipping unreadable line 3"]
  assert sorted(os.listdir(directory)) == ["0", "2"]
  # keep 1: the newest, which is also the best (step 0 saved no eval accuracy).
  out = loop.train(tiny_config(2, **{"sft.steps": 0, "train.keep_checkpoints": 1}), workdir)
  assert out["step"] == 2
  before = read(finished_run)
  assert read(workdir) == [before[0], before[2]] and "eval/accuracy" in before[2]
  assert sorted(os.listdir(directory)) == ["2"]


@pytest.mark.slow
def test_a_first_checkpoint_that_never_finished_leaves_no_duplicate_rows(finished_run, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  # Killed during the first save: only orbax's temporary folder is left.
  directory = os.path.join(workdir, "checkpoints")
  shutil.rmtree(directory)
  os.makedirs(os.path.join(directory, "0.orbax-checkpoint-tmp-1234"))
  loop.train(tiny_config(2, **{"sft.steps": 0}), workdir)
  assert [m["step"] for m in read(workdir)] == [0, 1, 2]
  assert read(workdir) == read(finished_run)


def test_the_best_checkpoint_survives_a_restart(tmp_path, caplog):
  """Kept: the latest 1 plus the best by eval/accuracy, also by a manager reopened
  on resume (which knows the old steps' accuracy only from disk)."""
  state = fresh_state(tiny_config(2))
  directory = str(tmp_path / "c")
  ckpt = checkpoint_lib.Checkpointer(directory, keep=1, async_save=False)
  ckpt.save(1, state, {}, metrics={"eval/accuracy": 0.9})
  ckpt.save(2, state, {}, metrics={"eval/accuracy": 0.1})
  with caplog.at_level(logging.WARNING):
    ckpt.save(3, state, {})  # no eval at this step: nothing to warn about
  ckpt.close()
  assert not [r for r in caplog.records if "metrics" in r.getMessage()]
  assert ckpt.all_steps() == [1, 3]
  resumed = checkpoint_lib.Checkpointer(directory, keep=1, async_save=False)
  resumed.save(4, state, {})
  resumed.save(5, state, {}, metrics={"eval/accuracy": 0.5})
  resumed.close()
  assert resumed.all_steps() == [1, 5]


def test_a_full_disk_is_one_line_with_the_path(tmp_path, monkeypatch):
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "c"))
  state = fresh_state(tiny_config(2))

  def full(*args, **kwargs):
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file \"/x/d/1234\": "
                     "No space left on device\n" + "tensorstore detail\n" * 500)
  monkeypatch.setattr(ckpt.manager, "save", full)
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    ckpt.save(0, state, {"data": {}}, force=True)
  message = str(e.value)
  assert "\n" not in message and "disk full" in message and str(tmp_path / "c") in message
  assert checkpoint_lib.disk_full(OSError(errno.ENOSPC, "No space left on device"))


@pytest.fixture
def disk_fills_at_step_2(monkeypatch):
  """ENOSPC in the background write of the save whose `extra` has fill_disk (step 2 below):
  JSON items are written by a commit future after save() returns, as arrays are."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler
  handler = json_checkpoint_handler.JsonCheckpointHandler
  write = handler._save_fn

  async def save_fn(self, x, directory):
    if isinstance(x, dict) and x.get("fill_disk"):
      await asyncio.sleep(0.2)  # still in flight when save() returns
      raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return await write(self, x, directory)
  monkeypatch.setattr(handler, "_save_fn", save_fn)


@pytest.mark.parametrize("surfaces_at", ["next save", "close"])
def test_a_full_disk_in_an_async_write_names_the_step_being_written(tmp_path, surfaces_at,
                                                                    disk_fills_at_step_2):
  """The failure of step 2's write surfaces later, at save(5) or at close(): the line
  names step 2 (not 5, nor step 1, the last one that completed)."""
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "c"))
  state = fresh_state(tiny_config(2))
  ckpt.save(1, state, {"data": {}}, force=True)
  ckpt.save(2, state, {"data": {}, "fill_disk": True}, force=True)  # returns before the write
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    if surfaces_at == "next save":
      ckpt.save(5, state, {"data": {}}, force=True)
    else:
      ckpt.close()
  message = str(e.value)
  assert "\n" not in message and "disk full" in message, message
  assert message.startswith(f"saving checkpoint step 2 in {tmp_path / 'c'} failed"), message
  assert ckpt.all_steps() == [1]  # step 5 was not started after the failure
  ckpt.manager.close()


@pytest.mark.slow
def test_nothing_restorable_stops_the_cli_with_one_line(finished_run, tmp_path):
  workdir = copy_of(finished_run, tmp_path)
  # Random bytes make tensorstore's readers print pages of tracebacks from their threads
  # as they fail: they go to error.log, not around the one line.
  corrupt(os.path.join(workdir, "checkpoints", "2"), "random_data")
  corrupt(os.path.join(workdir, "checkpoints", "0"), "garbage_metadata")
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_backend_optimization_level=0")
  proc = subprocess.run(
      [sys.executable, "-m", "grpojax.main", "--config=experiments/arithmetic_tiny.py:smoke",
       f"--workdir={workdir}", "--config.train.steps=2", "--config.sft.steps=0",
       "--config.rollout.prompts_per_step=4", "--config.rollout.group_size=4",
       "--config.eval.num_prompts=8", "--config.eval.batch_size=8", "--config.eval.k=0",
       "--config.train.eval_every=2"],
      capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 1, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: no checkpoint in ") and "checkpoints" in last, last
  assert len(proc.stderr.strip().splitlines()) < 10, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert os.path.isfile(os.path.join(workdir, "error.log"))
  # Nothing was moved: a config that no longer matches fails every checkpoint alike.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "2"]


def _hangs_from_step_2(rows_per_step):
  seen, armed = [], []

  def reward(prompts=None, completions=(), **unused):
    before = len(seen)
    seen.extend(completions)
    if before >= rows_per_step:  # step 2: the preemption comes while this hangs
      if not armed:
        armed.append(time.monotonic())
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
      time.sleep(120)
    return [0.0] * len(completions)

  reward.armed = armed
  return reward


@pytest.mark.slow
def test_sigterm_while_an_in_process_reward_hangs_saves_the_last_step(tmp_path):
  base = tasks.get_task("arithmetic")
  reward = _hangs_from_step_2(16)
  task = tasks.register_task(tasks.Task(
      name="arithmetic_hangs", default_dataset="arithmetic", columns=base.columns,
      prompt=base.prompt, reward_fns=(reward,), is_correct=base.is_correct,
      sft_target=base.sft_target, load=base.load))
  try:
    workdir = str(tmp_path / "w")
    out = loop.train(tiny_config(50, **{"task.name": task.name, "train.save_every": 0,
                                       "sft.steps": 0, "eval.num_prompts": 0,
                                       "rewards.timeout_s": 300.0}), workdir)
    # Heard at once, not after the 120 s hang (or the 300 s timeout): step 2's
    # rewards were cut short, so it is not applied and step 1 is what is saved.
    assert out == {"preempted": True, "step": 1}
    assert time.monotonic() - reward.armed[0] < 30
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == 1
    ckpt.close()
    assert [m["step"] for m in read(workdir)] == [1]
  finally:
    tasks.TASKS.pop("arithmetic_hangs")


LOCK_HOLDER = """
import sys, time
from grpojax.train import checkpoint
with checkpoint.workdir_lock(sys.argv[1]):
  print("held", flush=True)
  time.sleep(600)
"""


def test_a_second_run_on_a_workdir_stops_in_one_line_and_a_killed_runs_lock_is_taken_over(
    tmp_path):
  """Two runs on one workdir delete each other's checkpoints: while one holds the lock, a
  second stops before it writes anything (the CLI in one line naming the holder, the
  loop with WorkdirBusy); SIGKILL leaves no lock behind, and a holder on another host is
  refused with the way out."""
  workdir = str(tmp_path / "w")
  env = dict(os.environ, PYTHONPATH=ROOT)
  holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, workdir], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
  try:
    assert holder.stdout.readline() == "held\n"
    proc = subprocess.run([sys.executable, "-m", "grpojax.main", "--config",
                           "experiments/arithmetic_tiny.py:smoke", f"--workdir={workdir}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {workdir} is in use by another run (pid {holder.pid} on ")
    assert os.listdir(workdir) == [checkpoint_lib.LOCK_FILE]  # nothing written, no error.log
    with pytest.raises(checkpoint_lib.WorkdirBusy, match=f"pid {holder.pid}"):
      loop.train(tiny_config(1), workdir)
  finally:
    holder.kill()
    holder.wait()
  lock = os.path.join(workdir, checkpoint_lib.LOCK_FILE)
  assert f'"pid": {holder.pid}' in open(lock).read()  # killed: its record stays, its flock not
  with checkpoint_lib.workdir_lock(workdir):
    assert f'"pid": {os.getpid()}' in open(lock).read()
  assert open(lock).read() == ""  # released
  with open(lock, "w") as f:
    f.write('{"pid": 4242, "host": "another-host", "since": "2026-12-01 10:00:00"}')
  with pytest.raises(checkpoint_lib.WorkdirBusy, match=r"by a run on another-host \(pid 4242, "
                     r"since 2026-12-01 10:00:00\); if it is no longer running, delete "):
    with checkpoint_lib.workdir_lock(workdir):
      pass


@pytest.mark.slow
@pytest.mark.parametrize("damage", [b"", b'{"eval/accuracy": 0.5, "x"', b"\xff\xfe{}", b"[1, 2]"])
def test_an_unreadable_metrics_file_moves_its_checkpoint_aside(finished_run, tmp_path, damage,
                                                               caplog):
  """orbax's manager reads every step's saved metrics as it opens the folder, and one
  that is no JSON object stopped it from opening at all: that step is moved aside with
  one line, and the run resumes from the step before."""
  workdir = copy_of(finished_run, tmp_path)
  directory = os.path.join(workdir, "checkpoints")
  with open(os.path.join(directory, "2", "metrics", "metrics"), "wb") as f:
    f.write(damage)
  with caplog.at_level(logging.WARNING):
    ckpt = checkpoint_lib.Checkpointer(directory)
  assert ckpt.all_steps() == [0]
  said = [r.getMessage() for r in caplog.records if "unreadable metrics file" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith(f"checkpoint step 2 in {directory} has an ")
  assert glob.glob(directory + ".corrupt/2-*")
  ckpt.close()


def test_a_checkpoint_folder_that_refuses_writes_stops_at_once(tmp_path, monkeypatch):
  """One line before the first save, not a failed save minutes later (orbax's processes
  wait on each other's folder creation first)."""
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=f"the checkpoint folder {blocker}/checkpoints is not writable: "):
    checkpoint_lib.Checkpointer(str(blocker / "checkpoints"))

  def read_only(**kw):
    raise OSError(errno.EROFS, "Read-only file system", kw["dir"])

  monkeypatch.setattr(checkpoint_lib.tempfile, "NamedTemporaryFile", read_only)
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints"))
  assert str(e.value).startswith(f"the checkpoint folder {tmp_path}/checkpoints is not writable: ")
  assert "Read-only file system" in str(e.value) and "\n" not in str(e.value)


def test_orbaxs_own_log_records_go_to_the_noise_log(tmp_path, caplog):
  """What orbax logs (a record whose source is in the orbax package: a failed save logs
  a traceback per thread) goes to the noise log while a Checkpointer with one is open;
  others' records, and orbax's once it is closed, are left alone."""
  noise = tmp_path / "error.log"
  absl_log = logging.getLogger("absl")

  def emit(source, message):
    try:
      raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
      record = absl_log.makeRecord("absl", logging.ERROR, source, 7, message, (), sys.exc_info())
    absl_log.handle(record)

  orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "async_checkpointer.py")
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints"), noise_log=str(noise))
  with caplog.at_level(logging.ERROR, logger="absl"):
    emit(orbax_file, "save failed in a thread")
    emit(os.path.join(os.sep, "work", "mine.py"), "a user's error")
    ckpt.close()
    emit(orbax_file, "after close")
  shown = [r.getMessage() for r in caplog.records]
  assert shown == ["a user's error", "after close"]
  text = noise.read_text()
  assert "save failed in a thread" in text and "No space left on device" in text
  assert "Traceback" in text and "a user's error" not in text


# The run _cli starts, as the loop's config: tiny_config sets the rest of its flags.
CLI_RUN = {"sft.steps": 0, "train.save_every": 1}


def _cli(workdir, out_dir, name):
  """The CLI on a 4-step run saving every step (tiny_config(4, **CLI_RUN)), its output to
  files (a full pipe would stall it before its kill); returns the process. It inherits
  the session's XLA flags (their cheap compiles) as they are: with the same flags its
  programs are the persistent cache's entries of the same run in this process."""
  with open(out_dir / f"{name}.out", "w") as out, open(out_dir / f"{name}.err", "w") as err:
    return subprocess.Popen(
        [sys.executable, "-m", "grpojax.main", "--config=experiments/arithmetic_tiny.py:smoke",
         f"--workdir={workdir}", "--config.train.steps=4", "--config.train.save_every=1",
         "--config.train.eval_every=2", "--config.sft.steps=0", "--config.eval.num_prompts=8",
         "--config.eval.batch_size=8", "--config.eval.k=0", "--config.rollout.prompts_per_step=4",
         "--config.rollout.group_size=4"], cwd=ROOT, stdout=out, stderr=err)


def _saving(workdir) -> bool:  # a checkpoint half written: orbax's temporary folder
  return bool(glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*")))


@pytest.mark.slow
def test_sigkill_mid_save_resumes_to_the_uninterrupted_run(tmp_path):
  """SIGKILL (no handler runs) while a checkpoint is half written, then the same command
  again: the finished run's metrics and exported weights equal an uninterrupted run's
  (the same run, in this process), value for value and byte for byte. (A kill in the HF
  export, after the last save, leaves a run with nothing to run: test_a_resume_with_nothing
  _left_to_run_mends_its_metrics_and_prunes; random moments: tests/kill_trials.py.)"""
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  assert loop.train(tiny_config(4, **CLI_RUN), str(straight))["step"] == 4
  proc = _cli(killed, tmp_path, "killed")
  deadline = time.monotonic() + 600
  while proc.poll() is None and not _saving(killed) and time.monotonic() < deadline:
    time.sleep(0.005)
  assert proc.poll() is None, "the run ended before a save was seen"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  proc = _cli(killed, tmp_path, "resume")
  assert proc.wait(timeout=600) == 0, (tmp_path / "resume.err").read_text()[-2000:]
  assert read(killed) == read(straight)
  for name in ("model.safetensors", "config.json"):
    assert (killed / "hf" / name).read_bytes() == (straight / "hf" / name).read_bytes()
  steps = sorted(int(s) for s in os.listdir(killed / "checkpoints") if s.isdigit())
  assert steps[-1] == 4 and len(steps) <= 3  # the newest 2 and the best by eval
