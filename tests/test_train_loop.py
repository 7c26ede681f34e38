"""The loop end to end on a tiny model: resume equals an uninterrupted run, dynamic
sampling logs what it dropped, SIGTERM saves and stops (in process and through the
CLI), eval numbers are exact, and bad configs stop the CLI with one line."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpojax.data import tasks
from grpojax.models.tokenizers import CharTokenizer
from grpojax.rewards.runtime.host import HostRewards
from grpojax.sampling.sampler import SampleOutput
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import evaluate as evaluate_lib
from grpojax.train import loop
from grpojax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import arithmetic_tiny  # noqa: E402

TIMING = ("time/", "step_time")


def tiny_config(steps, **overrides):
  c = arithmetic_tiny.get_config("smoke")
  c.train.steps = steps
  c.train.eval_every = 2
  c.train.save_every = 2
  c.sft.steps = 2
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 4
  c.eval.num_prompts = 8
  c.eval.batch_size = 8
  c.eval.k = 0
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def read(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in lines]


@pytest.mark.slow
def test_resume_gives_the_metrics_of_an_uninterrupted_run_and_the_run_shows_what_it_does(
    tmp_path, caplog):
  """A run stopped at step 2 and resumed writes the metrics of one never stopped. The
  same runs (one set of compiles) show what they do: sample completions every k steps
  (completions.jsonl, with rewards and advantages), SFT's loss in the step-0 row, the
  resume announced, and a mean speed in the summary."""
  shown = {"train.log_completions": 1}
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  loop.train(tiny_config(4, **shown), straight)
  first = loop.train(tiny_config(2, **shown), resumed)
  assert first["step"] == 2 and first["steps_per_s"] > 0
  rows = [json.loads(line) for line in open(os.path.join(resumed, "completions.jsonl"))]
  assert [r["step"] for r in rows] == [1] * 4 + [2] * 4  # the first of each of 4 groups
  for r in rows:
    assert r["prompt"].endswith("=") and isinstance(r["completion"], str)
    assert set(r["rewards"]) == {"exact_answer"} and "advantage" in r
  with caplog.at_level("INFO", logger="grpojax"):
    second = loop.train(tiny_config(4, **shown), resumed)
  assert second["step"] == 4
  assert second["start"] == first["start"] and "eval/accuracy" in second["start"]  # not "-"
  a, b = read(straight), read(resumed)
  assert [m["step"] for m in a] == [0, 1, 2, 3, 4]
  assert a == b
  assert "eval/accuracy" in a[0] and "eval/accuracy" in a[-1] and "reward" in a[-1]
  assert a[0]["sft/loss"] > 0 and a[0]["sft/loss_start"] > 0
  assert not any(k.startswith("dynamic_sampling/") for m in a for k in m)  # off by default
  assert any("resumed from step 2 of 4" in m for m in caplog.messages)
  # What the run writes, and what not, is said before it starts.
  said = next(m for m in caplog.messages if m.startswith("writes: "))
  assert "metrics.jsonl every 1 step(s)" in said and "sample completions every 1 steps" in said
  # The first step's compile is announced before it starts, its time after.
  said = [i for i, m in enumerate(caplog.messages) if m.startswith("first GRPO step")]
  assert len(said) == 2 and "compiling" in caplog.messages[said[0]]
  steps = [json.loads(line)["step"] for line in open(os.path.join(resumed, "completions.jsonl"))]
  assert steps == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # resumed: none lost, none twice
  # The exported policy is an HF directory.
  assert os.path.isfile(os.path.join(resumed, "hf", "config.json"))
  # Resumed once more, finished: no step runs, and the summary shows the newest logged
  # step's reward and the logged speed, not "-".
  again = loop.train(tiny_config(4, **shown), resumed)
  assert again["step"] == 4 and again["last"]["reward"] == b[-1]["reward"]
  logged = [m["step_time"] for m in metrics_lib.read_metrics(resumed) if m["step"] > 1]
  assert again["steps_per_s"] == pytest.approx(len(logged) / sum(logged))


@pytest.mark.slow
@pytest.mark.parametrize("partial", ["recompute", "keep"])
def test_a_carried_run_resumes_exactly(tmp_path, partial):
  """With rows carried between steps (rollout.max_staleness=2), the checkpoint holds
  them ("keep": the engine's pages too): a run stopped at step 2 and resumed writes
  the metrics of one never stopped. "recompute" on a mesh of 4 row shards (each
  carries its own rows), "keep" on one engine."""
  carried = {"sft.steps": 0, "eval.num_prompts": 0, "rollout.max_staleness": 2,
             "loss.decoupled": True, "rollout.partial": partial}
  if partial == "recompute":
    carried["mesh.shape"] = {"data": 1, "fsdp": 4, "tensor": 2}
  straight, resumed = str(tmp_path / "a"), str(tmp_path / "b")
  loop.train(tiny_config(4, **carried), straight)
  assert loop.train(tiny_config(2, **carried), resumed)["step"] == 2
  assert loop.train(tiny_config(4, **carried), resumed)["step"] == 4
  a, b = read(straight), read(resumed)
  assert [m["step"] for m in a] == [1, 2, 3, 4]
  assert a == b
  assert max(m["carry/staleness/max"] for m in a) > 0  # rows were carried across updates


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lockstep", "paged"])  # rounds; streamed through the engine
def test_dynamic_sampling_out_of_rounds_trains_on_zero_std_groups(tmp_path, engine):
  # Without SFT the tiny model never answers right: every group's rewards are all 0,
  # so each step draws all its rounds and then fills the batch with zero-std groups.
  workdir = str(tmp_path / "w")
  out = loop.train(tiny_config(2, **{"sft.steps": 0, "eval.num_prompts": 0,
                                     "rollout.dynamic_sampling": True,
                                     "rollout.dynamic_sampling_max_rounds": 2,
                                     "rollout.engine": engine}), workdir)
  assert out["step"] == 2
  rows = read(workdir)
  assert [m["step"] for m in rows] == [1, 2]
  for m in rows:
    assert m["frac_reward_zero_std"] == 1.0
    assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/dropped_groups"],
            m["dynamic_sampling/kept_zero_std"]) == (2, 4, 4)


def _sigterm_during_step_2(rows_per_step):
  seen = []  # the bridge may call once per device shard: count rows, not calls

  # Named as arithmetic's own function: the run's rollout program is then the one the
  # other tests' runs compiled (the reward names are among its settings).
  def exact_answer(prompts=None, completions=(), **unused):
    before = len(seen)
    seen.extend(completions)
    if before <= rows_per_step < len(seen):  # the preemption arrives during step 2
      os.kill(os.getpid(), signal.SIGTERM)
    return [0.0] * len(completions)

  return exact_answer


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_stops(tmp_path):
  base = tasks.get_task("arithmetic")
  task = tasks.register_task(tasks.Task(
      name="arithmetic_preempted", default_dataset="arithmetic", columns=base.columns,
      prompt=base.prompt, reward_fns=(_sigterm_during_step_2(16),), is_correct=base.is_correct,
      sft_target=base.sft_target, load=base.load))
  try:
    workdir = str(tmp_path / "w")
    out = loop.train(tiny_config(50, **{"task.name": task.name, "train.save_every": 0,
                                       "sft.steps": 0, "eval.num_prompts": 0}), workdir)
    assert out == {"preempted": True, "step": 2}
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == 2
    ckpt.close()
    assert [m["step"] for m in read(workdir)] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was restored
  finally:
    tasks.TASKS.pop("arithmetic_preempted")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_to_the_cli_saves_the_step_it_reached_and_exits_0(tmp_path, signum):
  workdir = tmp_path / "w"
  # Output to files, not pipes: a full pipe would stall the run before the signal. The
  # session's XLA flags (its cheap compiles) as they are, and tiny_config's rows: the
  # persistent cache holds the programs of this file's runs in process.
  out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
  with open(out_path, "w") as out, open(err_path, "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpojax.main", "--config=experiments/arithmetic_tiny.py:smoke",
         f"--workdir={workdir}", "--config.train.steps=100000", "--config.train.save_every=0",
         "--config.sft.steps=0", "--config.eval.num_prompts=0",
         "--config.rollout.prompts_per_step=4", "--config.rollout.group_size=4"],
        cwd=ROOT, stdout=out, stderr=err)
  try:
    # Step 1's line is written during step 2 (metrics are read one step late):
    # training is running, past every compile.
    deadline = time.monotonic() + 300
    while not _logged_steps(workdir) and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    assert _logged_steps(workdir), err_path.read_text()[-2000:]
    proc.send_signal(signum)
    proc.wait(timeout=120)
  finally:
    if proc.poll() is None:  # only our own child, by handle
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, err_path.read_text()[-2000:]
  reached = int(re.search(r"preempted: checkpoint saved at step (\d+)",
                          out_path.read_text()).group(1))
  # The last logged step is the saved one: a resumed run continues right after it.
  assert reached >= 1 and _logged_steps(workdir)[-1] == reached
  ckpt = checkpoint_lib.Checkpointer(str(workdir / "checkpoints"))
  assert ckpt.latest_step() == reached
  ckpt.close()


def _logged_steps(workdir):
  """Steps logged after step 0 (which eval may log before the handler exists)."""
  if not os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)):
    return []
  # read_metrics skips a line torn by a concurrent write.
  return [m["step"] for m in metrics_lib.read_metrics(workdir) if m["step"] > 0]


@pytest.mark.parametrize("workers", [None, 1])
def test_eval_accuracy_and_pass_at_k_are_exact(monkeypatch, workers):
  """Scored by task.is_correct in this process (workers None), or by the reward
  pool's worker (the training loop's choice when is_correct is the verifier's)."""
  tok = CharTokenizer()
  rows = [{"question": f"{i}+0=", "answer": str(i)} for i in range(6)]
  task = tasks.get_task("arithmetic")

  def fake_generate(cfg, params, tokens, mask, *, num_samples, **kw):
    # Row i answers correctly iff i is even; with k samples, only the last one
    # of rows 1 and 3 is correct as well (so pass@k counts rows 0-4: 5 of 6).
    out = []
    for i in range(tokens.shape[0]):
      text = tok.decode(np.asarray(tokens[i])[np.asarray(mask[i]) > 0])
      answer = text.split("+")[0]
      for s in range(num_samples):
        good = int(answer) % 2 == 0 or (num_samples > 1 and s == num_samples - 1
                                        and answer in "13")
        out.append(tok.encode(answer if good else "x") + [tok.eos_id])
    width = max(map(len, out))
    toks = np.array([o + [0] * (width - len(o)) for o in out], np.int32)
    m = np.array([[1] * len(o) + [0] * (width - len(o)) for o in out], np.int32)
    return SampleOutput(tokens=jnp.asarray(toks), mask=jnp.asarray(m), logps=None, lengths=None,
                        truncated=None)

  monkeypatch.setattr(evaluate_lib.sampler, "generate_from_params", fake_generate)
  assert task.correct_means_full_score
  rewards = None
  if workers is not None:
    rewards = HostRewards(task.reward_fns, decode=tok.batch_decode, lookup=None,
                          num_workers=workers)
    task = dataclasses.replace(task, is_correct=lambda *a: pytest.fail("scored serially"))
  try:
    ev = evaluate_lib.Evaluator(rows, task, tok, batch_size=4, max_prompt_length=8,
                                max_new_tokens=4, ks=(3,), rewards=rewards)
    metrics = ev(None, None, jax.random.key(0))
  finally:
    if rewards is not None:
      rewards.close()
  # maj@3: "x" has no answer key, so rows 1 and 3 vote once, rightly; mean@3: 11 of 18.
  assert metrics == pytest.approx({"eval/accuracy": 3 / 6, "eval/pass@3": 5 / 6,
                                   "eval/maj@3": 5 / 6, "eval/mean@3": 11 / 18})


@pytest.mark.slow
# One value validate() refuses and one key the flag parser does not know: the CLI's two
# ways to stop. Each of validate's messages is checked in process (tests/test_config.py),
# where a case costs no interpreter start.
@pytest.mark.parametrize("flag, words", [
    ("--config.loss.loss_type=dapoo", "loss.loss_type='dapoo' is unknown"),
    ("--config.rollout.group_sise=4", "group_sise"),
])
def test_bad_configs_stop_the_cli_before_any_compile(flag, words, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "grpojax.main", flag, f"--workdir={tmp_path}"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert proc.returncode != 0
  assert words in proc.stderr
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.slow
def test_wandb_logs_offline(tmp_path, monkeypatch):
  """train.loggers=wandb, in W&B's offline mode: the run's metrics and sample
  completions go to a local W&B run directory (no account, no network)."""
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  workdir = tmp_path / "run"
  loop.train(tiny_config(2, **{"train.loggers": "tensorboard,wandb", "train.log_completions": 1,
                               "sft.steps": 0, "eval.num_prompts": 0}), str(workdir))
  runs = list((workdir / "wandb").glob("offline-run-*"))  # wandb.init(dir=workdir)
  run_id = (workdir / "wandb_run_id").read_text().strip()  # a resumed run continues it
  assert len(runs) == 1 and runs[0].name.endswith(run_id), runs
  log = (runs[0] / f"run-{run_id}.wandb").read_bytes()  # the offline run's records
  assert b"reward" in log and b"grad_norm" in log
  tables = sorted((runs[0] / "files" / "media" / "table").glob("completions_*.table.json"))
  assert len(tables) == 2  # the sample completions of steps 1 and 2
  table = json.loads(tables[0].read_text())
  assert table["columns"] == ["prompt", "completion", "rewards", "reward", "advantage"]
