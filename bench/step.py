"""One GRPO step (rollout + update): grpojax vs TRL's GRPOTrainer, in one run.

Both train the same random 'small' Llama checkpoint (hidden 512, 8 layers,
27.8M parameters; saved in HF format by this script with a word-level
tokenizer built in code, nothing downloaded) with the same settings: 4 prompts
x G=8 completions per optimizer step, 32-token prompts, 64 completion tokens
forced (no EOS can be sampled), temperature 1, loss "dapo", beta=0.04 with a
float32 reference, AdamW lr 1e-6, grad-norm clip 1, float32, no gradient
checkpointing, one optimizer step per generation batch (num_iterations=1), a
trivial reward (distinct words / 64) computed in-process.

The two frameworks' steps alternate (each of ours runs between two of TRL's,
outside TRL's timing), so that load from other jobs on a shared machine falls
on both alike. Prints the steady-state step time of each (median; compile and
warm-up excluded: only the 2nd and later steps are timed), their ratio, each
phase's time (rollout: sampling + rewards + reference log-probs; update:
policy forward + backward + AdamW) and each phase's fraction of this
machine's measured float32 matmul peak (the best of large jitted matmuls
timed between the steps), each counted on the work that framework does:
rollout = 2 * params per generated token (N*T) + 2 * params per
reference-forward position; update = 6 * params per trained position (the
backward runs through the prompt too). TRL runs every row's prompt: N*(P+T)
positions; grpojax runs each group's prompt once (forward_shared_prompt):
B*P + N*T positions, for the same log-probs and gradients. Our
rollout is also timed without the reference forward (after each step, outside
its timing), to split it.

Needs TRL, a benchmark-only dependency (not in setup.py). Install it without
letting pip replace torch:
  pip install trl --no-deps && pip install accelerate --no-deps && pip check

  python bench/step.py                  # CPU: 4 steps each, torch on 2 threads
  python bench/step.py --steps 6 --threads 4

`python bench/accelerator.py step` runs the same two steps (`Ours`, `run_trl`) at
Qwen2.5-0.5B shapes, on CUDA in bf16 when there is one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler import SMALL, matmul_peak, param_count  # noqa: E402  (bench/sampler.py)

from grpojax import config as grpojax_config, models  # noqa: E402
from grpojax.core import losses  # noqa: E402
from grpojax.models import tokenizers  # noqa: E402
from grpojax.rewards.runtime.host import HostRewards  # noqa: E402
from grpojax.sampling.strategies import SamplingParams  # noqa: E402
from grpojax.train import optim  # noqa: E402
from grpojax.train import rollout as rollout_lib  # noqa: E402
from grpojax.train import state as state_lib  # noqa: E402
from grpojax.train import step as step_lib  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
BETA, LR = 0.04, 1e-6


def distinct_words(completions, **unused):
  """The trivial reward: the fraction of distinct words in the completion."""
  return [len(set(c.split())) / 64.0 for c in completions]


def write_checkpoint(path: str, vocab: int) -> None:
  """Random 'small' Llama + a word-level tokenizer ("w3" ... "w{vocab-1}")."""
  import tokenizers as tk
  import torch
  import transformers

  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(**SMALL, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
  hf = transformers.AutoModelForCausalLM.from_config(cfg)
  hf.save_pretrained(path)
  words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
  core = tk.Tokenizer(tk.models.WordLevel(words, unk_token="<pad>"))
  core.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
  core.decoder = tk.decoders.WordPiece(prefix="##")  # joins words with spaces
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                             bos_token="<s>", eos_token="</s>")
  tok.save_pretrained(path)


def make_prompts(n: int, length: int, words: Sequence[str], seed: int = 0) -> list[str]:
  """n prompts of `length` words drawn from `words` (each word one token)."""
  rng = np.random.default_rng(seed)
  return [" ".join(words[i] for i in rng.integers(0, len(words), length)) for _ in range(n)]


# --------------------------------------------------------------------- grpojax


class Ours:
  """grpojax's GRPO step on the checkpoint; `step()` runs and times one.

  The tokenizer is read from `tokenizer` (default: the model's directory); the policy
  computes in `dtype` over float32 master weights, the reference is kept in `ref_dtype`,
  and `remat` is the model's per-layer rematerialisation in the update.
  """

  def __init__(self, path, prompts, a, *, tokenizer=None, dtype="float32", ref_dtype="float32",
               remat=False):
    self.a, self.prompts = a, prompts
    self.tok = tokenizers.load_tokenizer(tokenizer or path)
    # As the training loop loads it: parameters in the compute dtype, made float32
    # master weights by create_train_state.
    model = models.from_pretrained(path, dtype=dtype, remat=remat)
    self.params, self.vocab_size = param_count(model), model.config.vocab_size
    self.tokens, self.mask = self.tok.batch_encode(prompts, max_length=a.prompt_len)
    assert self.tokens.shape == (len(prompts), a.prompt_len), self.tokens.shape
    # grpojax's defaults are TRL's: AdamW lr 1e-6, betas (0.9, 0.999), eps 1e-8, no weight
    # decay, grad-norm clip 1.0, constant schedule without warmup.
    optim_cfg = grpojax_config.get_config().optim
    assert (optim_cfg.learning_rate, optim_cfg.weight_decay, optim_cfg.max_grad_norm,
            optim_cfg.warmup_steps, optim_cfg.schedule) == (LR, 0.0, 1.0, 0, "constant")
    opt = optim.make_optimizer(optim_cfg, total_steps=a.steps + 1)
    self.state = state_lib.create_train_state(model.config, model.param_dict(), opt,
                                              with_reference=True, ref_dtype=ref_dtype)
    examples = {i: {"prompt": p} for i, p in enumerate(prompts)}
    self.host = HostRewards([distinct_words], decode=self.tok.hf.batch_decode,
                            lookup=examples.__getitem__, num_workers=0)
    self.rollout = rollout_lib.make_rollout_fn(self._config(True), self.host)
    # The same rollout without the reference forward (sampling + host rewards + advantages),
    # run after each step outside its timing, to split the rollout's time.
    self.no_ref = rollout_lib.make_rollout_fn(self._config(False), self.host)
    self.update_kw = dict(loss_config=losses.LossConfig(loss_type="dapo", beta=BETA),
                          group_size=a.groups, num_iterations=1, minibatches=1, temperature=1.0)
    self.i, self.times = 0, {"rollout": [], "update": [], "step": [], "sample": []}

  def _config(self, with_reference):
    # eos = vocab size: an id never sampled, so every completion runs to full length.
    return rollout_lib.RolloutConfig(
        group_size=self.a.groups, max_new_tokens=self.a.new_tokens,
        sampling=SamplingParams(temperature=1.0), eos_ids=(self.vocab_size,),
        pad_id=self.tok.pad_id, with_reference=with_reference)

  def batch(self, i):
    rows = (np.arange(self.a.prompts) + i * self.a.prompts) % len(self.prompts)
    return {"prompt_tokens": jnp.asarray(self.tokens[rows], jnp.int32),
            "prompt_mask": jnp.asarray(self.mask[rows], jnp.int32),
            "example_ids": jnp.asarray(rows, jnp.int32)}

  def step(self):
    """One rollout + update; the first (compiling) one is not recorded."""
    rng = jax.random.fold_in(jax.random.key(0), self.i)
    t0 = time.perf_counter()
    r, rm = self.rollout(self.state, self.batch(self.i), rng)
    jax.block_until_ready(r)
    t1 = time.perf_counter()
    self.state, um = step_lib.update(self.state, r, rng, **self.update_kw)
    jax.block_until_ready(self.state.params)
    t2 = time.perf_counter()
    assert float(rm["completions/min_length"]) == self.a.new_tokens, rm
    assert np.isfinite(float(um["loss"])), um
    t3 = time.perf_counter()
    jax.block_until_ready(self.no_ref(self.state, self.batch(self.i), rng))
    t4 = time.perf_counter()
    if self.i:
      for k, t in (("rollout", t1 - t0), ("update", t2 - t1), ("step", t2 - t0),
                   ("sample", t4 - t3)):
        self.times[k].append(t)
    self.i += 1
    self.last = r

  def finish(self) -> dict:
    """Medians, and the host reward callback alone (decode + reward function, on numpy)."""
    t0 = time.perf_counter()
    self.host.compute(np.repeat(np.arange(self.a.prompts), self.a.groups),
                      np.asarray(self.last.tokens), np.asarray(self.last.mask))
    t_reward = time.perf_counter() - t0
    self.host.close()
    med = statistics.median
    return dict(params=self.params, reward=t_reward, steps=self.times["step"],
                **{k: med(v) for k, v in self.times.items()})


# ------------------------------------------------------------------------- TRL


def run_trl(path, prompts, a, between, *, tokenizer=None, cuda=False,
            gradient_checkpointing=False) -> dict:
  """TRL's GRPOTrainer for steps + 1 optimizer steps; `between()` runs after each of them,
  outside TRL's timing (so that both frameworks' steps alternate and share the same load).

  The tokenizer is read from `tokenizer` (default: the model's directory). With `cuda`
  the trainer runs on the GPU with bf16 autocast over the float32 weights (TRL's `bf16`),
  as grpojax computes in bf16 over float32 master weights.
  """
  import datasets
  import torch
  import transformers
  import trl

  torch.set_num_threads(a.threads)
  times = {"steps": [], "rollout": [], "generate": []}
  # CUDA runs asynchronously: a phase has ended when the device is done with it.
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  class Timed(trl.GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
      sync()
      t = time.perf_counter()
      out = super()._generate_and_score_completions(inputs)
      sync()
      times["rollout"].append(time.perf_counter() - t)
      return out

    def _generate_single_turn(self, *args, **kwargs):
      sync()
      t = time.perf_counter()
      out = super()._generate_single_turn(*args, **kwargs)
      sync()
      times["generate"].append(time.perf_counter() - t)
      return out

  class Between(transformers.TrainerCallback):
    start = None

    def on_step_end(self, args, state, control, **kwargs):
      sync()
      if self.start is not None:  # the 2nd step onwards: end of this step - end of between()
        times["steps"].append(time.perf_counter() - self.start)
      between()
      self.start = time.perf_counter()

  with tempfile.TemporaryDirectory() as out_dir:
    args = trl.GRPOConfig(
        output_dir=out_dir, use_cpu=not cuda, bf16=cuda, fp16=False,
        gradient_checkpointing=gradient_checkpointing,
        per_device_train_batch_size=a.prompts * a.groups, gradient_accumulation_steps=1,
        num_generations=a.groups, max_completion_length=a.new_tokens, temperature=1.0,
        generation_kwargs={"min_new_tokens": a.new_tokens}, beta=BETA, loss_type="dapo",
        num_iterations=1, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps + 1, report_to="none",
        logging_strategy="no", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer or path)
    trainer = Timed(model=model, reward_funcs=distinct_words, args=args, processing_class=tok,
                    train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                    callbacks=[Between()])
    trainer.remove_callback(transformers.PrinterCallback)  # the end-of-training metrics line
    trainer.train()
  assert len(times["steps"]) == a.steps and len(times["rollout"]) == a.steps + 1, times
  roll = times["rollout"][1:]
  med = statistics.median
  return dict(version=trl.__version__, step=med(times["steps"]), rollout=med(roll),
              update=med(s - r for s, r in zip(times["steps"], roll)),
              generate=med(times["generate"][1:]), steps=times["steps"])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
  p.add_argument("--threads", type=int, default=2, help="torch threads")
  p.add_argument("--skip-trl", action="store_true")
  a = p.parse_args()

  vocab = SMALL["vocab_size"]
  prompts = make_prompts(a.prompts * (a.steps + 1), a.prompt_len,
                         [f"w{i}" for i in range(3, vocab)])
  with tempfile.TemporaryDirectory() as path:
    write_checkpoint(path, vocab)
    # Other jobs may share the cores: the two frameworks' steps alternate (ours runs
    # between TRL's, outside its timing), and the peak is the best of measurements
    # taken between steps.
    ours = Ours(path, prompts, a)
    peaks = [matmul_peak(jnp.float32)]

    def between():
      ours.step()
      peaks.append(matmul_peak(jnp.float32))

    if a.skip_trl:
      theirs = None
      for _ in range(a.steps + 1):
        between()
    else:
      theirs = run_trl(path, prompts, a, between)
    ours = ours.finish()

  n, P, T, params = a.prompts * a.groups, a.prompt_len, a.new_tokens, ours["params"]
  positions = {"grpojax": a.prompts * P + n * T, "TRL": n * (P + T)}
  flops_roll = {k: 2 * params * n * T + 2 * params * v for k, v in positions.items()}
  flops_upd = {k: 6 * params * v for k, v in positions.items()}
  peak = max(peaks)
  util = lambda f, t: f"{f / t / peak:.1%}"  # noqa: E731
  print(f"devices: {jax.devices()}; params {params / 1e6:.1f}M; float32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s (best of {[round(x / 1e9) for x in peaks]}); N={n} rows "
        f"({a.prompts} prompts x G={a.groups}), P={P}, T={T}, beta={BETA}; FLOPs rollout "
        + ", ".join(f"{k} {flops_roll[k] / 1e9:.0f} G" for k in positions) + "; update "
        + ", ".join(f"{k} {flops_upd[k] / 1e9:.0f} G" for k in positions))
  print(f"grpojax: step {ours['step']:.2f} s (rollout {ours['rollout']:.2f} s = "
        f"{util(flops_roll['grpojax'], ours['rollout'])} of peak, of which reference forward "
        f"~{ours['rollout'] - ours['sample']:.2f} s and host rewards {ours['reward']:.3f} s; "
        f"update {ours['update']:.2f} s = {util(flops_upd['grpojax'], ours['update'])} of peak); "
        f"steps {[round(x, 2) for x in ours['steps']]}")
  if theirs is None:
    return
  print(f"TRL {theirs['version']}: step {theirs['step']:.2f} s (rollout {theirs['rollout']:.2f} s"
        f" = {util(flops_roll['TRL'], theirs['rollout'])} of peak, of which generate "
        f"{theirs['generate']:.2f} s; update {theirs['update']:.2f} s = "
        f"{util(flops_upd['TRL'], theirs['update'])} of peak); "
        f"steps {[round(x, 2) for x in theirs['steps']]}")
  print(f"step time ratio (grpojax / TRL): {ours['step'] / theirs['step']:.2f}x "
        f"(target <= 0.5x); rollout {ours['rollout'] / theirs['rollout']:.2f}x, "
        f"update {ours['update'] / theirs['update']:.2f}x")


if __name__ == "__main__":
  main()
