"""Non-finite training (issue 17): the KL-only update over heavily left-padded
prompts has finite gradients for every parameter; an update whose loss or
gradients are NaN is dropped on device and counted; the loop stops on it with
one line (or skips it), the last good checkpoint stays the newest, resume goes
on from there; metrics show NaN as NaN; eval and HF export refuse NaN weights."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax.core import losses
from grpojax.models import transformer
from grpojax.models.config import get_preset
from grpojax.train import checkpoint as checkpoint_lib
from grpojax.train import loop
from grpojax.train import state as state_lib
from grpojax.train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_train_loop import tiny_config  # noqa: E402

B, G, P, T, PAD = 2, 4, 64, 16, 0


def _padded_rollout(cfg, rng):
  """Prompts of 5-6 real tokens left-padded to 64, completions ending at EOS mid-row."""
  prompts = np.full((B, P), PAD, np.int32)
  pmask = np.zeros((B, P), np.int32)
  for b in range(B):
    n = 5 + b
    prompts[b, P - n:] = rng.integers(3, cfg.vocab_size, n)
    pmask[b, P - n:] = 1
  lengths = np.array([16, 3, 9, 1, 12, 7, 16, 5])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask > 0, rng.integers(3, cfg.vocab_size, (B * G, T)), PAD).astype(np.int32)
  return step_lib.Rollout(prompt_tokens=jnp.repeat(prompts, G, axis=0),
                          prompt_mask=jnp.repeat(pmask, G, axis=0), tokens=jnp.asarray(tokens),
                          mask=jnp.asarray(mask), advantages=jnp.zeros((B * G,)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kl_only_gradients_are_finite_with_long_left_padding(dtype):
  # The reported GPU failure's shape: every advantage 0 (all rewards equal), so the
  # KL term alone drives the gradient; prompts ~10% real tokens; the pad token's
  # embedding row zero, as HF initialises padding_idx; a bf16 reference that differs
  # from the policy, so the KL's gradient is not zero.
  cfg = get_preset("qwen2_tiny", dtype=dtype)
  params = transformer.init_params(cfg, jax.random.key(0))
  params["embed"] = params["embed"].at[PAD].set(0.0)
  noise = jax.random.normal(jax.random.key(1), params["embed"].shape)
  ref = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
  ref["embed"] = (params["embed"] + 0.05 * noise).astype(jnp.bfloat16)
  rollout = _padded_rollout(cfg, np.random.default_rng(0))
  ref_logps = step_lib.completion_logps(cfg.replace(dtype="bfloat16"), ref, rollout.prompt_tokens,
                                        rollout.prompt_mask, rollout.tokens, rollout.mask,
                                        group_size=G)
  config = losses.LossConfig(loss_type="grpo", beta=0.04)

  def loss_fn(p, group_size):
    logps = step_lib.completion_logps(cfg, p, rollout.prompt_tokens, rollout.prompt_mask,
                                      rollout.tokens, rollout.mask, group_size=group_size)
    return losses.policy_loss(logps, None, rollout.advantages, rollout.mask, config=config,
                              ref_logps=ref_logps)[0]

  for group_size in (G, 1):  # the shared-prompt forward and the plain one
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params, group_size)
    assert np.isfinite(float(loss)) and float(loss) > 0
    for name, g in grads.items():
      assert np.all(np.isfinite(np.asarray(g, np.float32))), (dtype, group_size, name)
    # The KL reaches every weight (the test would prove nothing with zero gradients).
    assert all(float(jnp.max(jnp.abs(grads[n]))) > 0 for n in ("embed", "wq", "w_down", "bk"))


def _nan_loss(x, config):
  del config
  return jnp.nan * x.logps


losses.register_loss("nan_for_test")(_nan_loss)


@pytest.mark.slow
def test_update_drops_a_non_finite_step_and_counts_it():
  cfg = get_preset("qwen2_tiny")
  params = transformer.init_params(cfg, jax.random.key(0))
  rollout = _padded_rollout(cfg, np.random.default_rng(0))
  rollout = rollout.replace(advantages=jnp.linspace(-1.0, 1.0, B * G))
  make = lambda: state_lib.create_train_state(cfg, params, optax.adam(1e-2),  # noqa: E731
                                              with_reference=False)
  kw = dict(group_size=G, minibatches=2)
  rollout = rollout.replace(old_logps=step_lib.completion_logps(
      cfg, params, rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask))

  good, m = step_lib.update(make(), rollout, jax.random.key(0),
                            loss_config=losses.LossConfig(loss_type="dapo"), **kw)
  assert {k: int(v) for k, v in m.items() if k.startswith("nonfinite/")} == {
      "nonfinite/loss": 0, "nonfinite/grads": 0, "nonfinite/params": 0, "nonfinite/skipped": 0}
  assert not np.allclose(good.params["wq"], params["wq"])

  bad, m = step_lib.update(make(), rollout, jax.random.key(0),
                           loss_config=losses.LossConfig(loss_type="nan_for_test"), **kw)
  # Both optimizer steps had a NaN loss and NaN gradients: both dropped.
  assert int(m["nonfinite/loss"]) == 2 and int(m["nonfinite/grads"]) == 2
  assert int(m["nonfinite/skipped"]) == 2 and math.isnan(float(m["loss"]))
  for name, value in bad.params.items():
    np.testing.assert_array_equal(value, params[name], err_msg=name)
  fresh = make()
  jax.tree.map(np.testing.assert_array_equal, bad.opt_state, fresh.opt_state)
  assert int(bad.step) == 1  # the GRPO step itself still counts


def test_eval_and_export_refuse_nan_weights(tmp_path):
  cfg = get_preset("tiny")
  params = transformer.init_params(cfg, jax.random.key(0))
  params["wq"] = params["wq"].at[0, 0, 0, 0].set(jnp.nan)
  state = state_lib.create_train_state(cfg, params, optax.sgd(0.1), with_reference=False)
  with pytest.raises(state_lib.NonFiniteError, match="export .*wq hold NaN"):
    checkpoint_lib.export_hf(state, str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()
  with pytest.raises(state_lib.NonFiniteError, match="evaluate: parameters wq"):
    state_lib.check_finite(state.params, "evaluate")


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_loop_stops_on_nan_and_resume_goes_on_from_the_last_good_step(tmp_path):
  workdir = str(tmp_path / "w")
  base = {"sft.steps": 0, "eval.num_prompts": 0, "train.save_every": 1}
  loop.train(tiny_config(2, **base), workdir)
  # Steps 3-4 with a loss that turns NaN: the run stops at step 3 with one line,
  # without saving it (save_every=1 would otherwise have).
  with pytest.raises(state_lib.NonFiniteError) as err:
    loop.train(tiny_config(4, **base, **{"loss.loss_type": "nan_for_test",
                                         "train.allow_config_change": True}), workdir)
  assert str(err.value).startswith("step 3: non-finite loss in 1 optimizer step(s)")
  assert "newest checkpoint: step 2" in str(err.value) and "\n" not in str(err.value)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.latest_step() == 2
  ckpt.close()
  rows = _rows(workdir)
  assert rows[-1]["step"] == 3 and math.isnan(rows[-1]["loss"])  # written as NaN
  assert rows[-1]["nonfinite/skipped"] == 1
  # Resuming with a sane loss continues from step 2 and ends finite.
  out = loop.train(tiny_config(4, **base, **{"train.allow_config_change": True}), workdir)
  assert out["step"] == 4
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(math.isfinite(r["loss"]) and r["nonfinite/skipped"] == 0 for r in rows)


@pytest.mark.slow
def test_skip_mode_carries_on_and_counts(tmp_path):
  workdir = str(tmp_path / "w")
  cfg = tiny_config(2, **{"sft.steps": 0, "eval.num_prompts": 0, "train.save_every": 0,
                          "loss.loss_type": "nan_for_test", "train.on_nonfinite": "skip"})
  out = loop.train(cfg, workdir)
  assert out["step"] == 2
  rows = _rows(workdir)
  assert [r["nonfinite/skipped"] for r in rows] == [1, 1]
  # The weights never moved, so the export is the initial model, finite.
  assert os.path.isfile(os.path.join(workdir, "hf", "config.json"))


@pytest.mark.slow
def test_cli_stops_with_one_line(tmp_path):
  # The NaN loss is registered by a config file next to the run (user code).
  cfg_file = tmp_path / "nan_config.py"
  cfg_file.write_text(
      "import sys\n"
      f"sys.path.insert(0, {os.path.join(ROOT, 'experiments')!r})\n"
      f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n"
      "import arithmetic_tiny, test_train_nonfinite  # registers nan_for_test\n"
      "def get_config():\n"
      "  c = arithmetic_tiny.get_config('smoke')\n"
      "  c.loss.loss_type = 'nan_for_test'\n"
      "  c.sft.steps = 0\n"
      "  c.eval.num_prompts = 0\n"
      # tiny_config's rows: the programs of the in-process NaN runs above, which the
      # persistent cache holds (the CLI inherits the session's XLA flags).
      "  c.rollout.prompts_per_step = c.rollout.group_size = 4\n"
      "  return c\n")
  proc = subprocess.run([sys.executable, "-m", "grpojax.main", f"--config={cfg_file}",
                         f"--workdir={tmp_path / 'w'}"], capture_output=True, text=True,
                        cwd=ROOT, timeout=600)
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert errors == [errors[0]] and "step 1: non-finite loss" in errors[0]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "w" / "hf")
