"""The supervised warm start: its loss is the completion tokens' cross-entropy, it
learns the reference answers, and its step compiles once on a mesh."""

import io
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpojax import models
from grpojax.data import PromptIterator, get_task
from grpojax.models import transformer
from grpojax.models.tokenizers import CharTokenizer
from grpojax.parallel import mesh as mesh_lib
from grpojax.train import sft


def _setup(batch_size=8):
  task = get_task("arithmetic")
  # Prompts of one length: one padded width, so one compile.
  rows = [{"id": i, "question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10, 26)]
  tokenizer = CharTokenizer()
  iterator = PromptIterator(rows, task, tokenizer, batch_size=batch_size, max_prompt_length=8,
                            seed=0)
  model = models.build_model("tiny", seed=0, vocab_size=tokenizer.vocab_size)
  return task, tokenizer, iterator, model


@pytest.mark.slow
def test_loss_is_the_mean_cross_entropy_of_target_tokens():
  task, tokenizer, iterator, model = _setup()
  batch = sft.target_batch(iterator, task, tokenizer, max_length=6)
  # Reference: a full forward pass over prompt + target, log-softmax by hand.
  tokens = np.concatenate([batch["prompt_tokens"], batch["targets"]], axis=1)
  mask = np.concatenate([batch["prompt_mask"], batch["target_mask"]], axis=1)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  hidden = models.forward(model.config, model.param_dict(), jnp.asarray(tokens),
                             jnp.asarray(positions), jnp.asarray(mask))
  logits = transformer.unembed(model.config, model.param_dict(), hidden)
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  P = batch["prompt_tokens"].shape[1]
  nll, count = 0.0, 0
  for r in range(tokens.shape[0]):
    for t in range(batch["targets"].shape[1]):
      if batch["target_mask"][r, t]:
        nll -= logp[r, P + t - 1, batch["targets"][r, t]]
        count += 1
  # The target is the answer then EOS; prompt tokens never count.
  assert count == sum(len(iterator.lookup(i)["answer"]) + 1 for i in batch["example_ids"])
  tx = optax.sgd(0.0)
  params = {k: jnp.array(v) for k, v in model.param_dict().items()}
  _, _, loss = sft.sft_step(model.config, params, tx.init(params), batch, tx=tx)
  np.testing.assert_allclose(float(loss), nll / count, rtol=1e-5)


def test_sft_learns_the_answers_and_compiles_once_on_a_mesh():
  task, tokenizer, iterator, model = _setup()
  mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  model = models.build_model("tiny", seed=0, vocab_size=tokenizer.vocab_size, mesh=mesh)
  losses = []
  log = io.StringIO()
  handler = logging.StreamHandler(log)
  logging.getLogger("jax").addHandler(handler)
  try:
    with jax.log_compiles(True):
      params = sft.run_sft(model.config, model.param_dict(), iterator, task, tokenizer, steps=40,
                           learning_rate=3e-3, max_length=4,
                           put=lambda b: mesh_lib.global_batch(b, mesh),
                           on_step=lambda step, loss: losses.append(float(loss)))
  finally:
    logging.getLogger("jax").removeHandler(handler)
  # Once for all 40 steps: the optimizer's scalars start where the step returns them.
  assert log.getvalue().count("Compiling jit(sft_step)") == 1
  assert losses[-1] < 0.5 * losses[0]
  assert set(params) == set(model.param_dict())
