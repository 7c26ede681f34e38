"""Checkpoints with orbax: async saves, the last k plus the best by eval, restore
onto the current mesh, and export of the policy in Hugging Face format.

A checkpoint holds the TrainState's arrays and a small JSON of host-side state
(the data iterator's position). Random keys are not saved: each step derives
its keys from the root seed and the step number, so a resumed run draws the
same samples as an uninterrupted one.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from grpojax import models
from grpojax.train.state import TrainState, check_finite

BEST_METRIC = "eval/accuracy"


def _arrays(state: TrainState) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
          "ref_params": state.ref_params}


class Checkpointer:
  """Wraps an orbax CheckpointManager for TrainStates.

  Args:
    directory: where step folders go (created).
    keep: how many of the latest checkpoints to keep; the best by
      `eval/accuracy` (when saves carry it) is kept as well.
    async_save: let saves finish in the background (the next save, `wait` or
      `close` waits for the previous one).
  """

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    preserve = policies.AnyPreservationPolicy([
        policies.LatestN(keep),
        policies.BestN(get_metric_fn=lambda m: m[BEST_METRIC], n=1,
                       keep_checkpoints_without_metrics=False),
    ])
    options = ocp.CheckpointManagerOptions(preservation_policy=preserve,
                                           enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: TrainState, extra: dict, *, metrics: dict | None = None,
           force: bool = False) -> bool:
    """Saves the state at `step` with JSON-able `extra`; `metrics` may carry eval/accuracy."""
    if metrics is not None and BEST_METRIC in metrics:
      metrics = {BEST_METRIC: float(metrics[BEST_METRIC])}
    else:
      metrics = None
    args = ocp.args.Composite(state=ocp.args.StandardSave(_arrays(state)),
                              extra=ocp.args.JsonSave(extra))
    return self.manager.save(step, args=args, metrics=metrics, force=force)

  def restore(self, state: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
    """Restores into the structure, shapes and shardings of `state` (a fresh state
    on the current mesh); returns (state, extra). step None: the latest."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _arrays(state))
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
    arrays = out["state"]
    restored = state.replace(step=arrays["step"], params=arrays["params"],
                             opt_state=arrays["opt_state"], ref_params=arrays["ref_params"])
    return restored, dict(out["extra"])

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def export_hf(state: TrainState, path: str, *, tokenizer=None, dtype: str | None = None) -> str:
  """Writes the policy as an HF-format directory loadable by transformers.

  dtype: parameter dtype to write (default: the model's compute dtype).
  """
  check_finite(state.params, f"export {path}")
  cfg = state.model_config
  dtype = dtype or cfg.dtype
  params = {k: v.astype(dtype) for k, v in state.params.items()}
  model = models.Transformer(cfg.replace(param_dtype=dtype), params=params)
  models.save_pretrained(model, path, tokenizer=tokenizer)
  return path
