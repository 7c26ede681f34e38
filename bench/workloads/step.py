"""One GRPO step (rollout + update): grpojax against TRL's GRPOTrainer, in one run.

Both train the same random HF checkpoint (a word-level tokenizer built in code,
nothing downloaded) with the same settings: B prompts x G completions a step, P
prompt tokens, T completion tokens forced (an EOS id no row samples), temperature
1, loss "dapo", beta 0.04, AdamW lr 1e-6 with grad-norm clip 1 (grpojax's
defaults are TRL's; the run checks), one optimizer step per generation batch, a
trivial in-process reward (distinct words / T).

The two frameworks' steps alternate (each of ours runs between two of TRL's,
outside TRL's timing), so that load from other jobs falls on both alike. Reports
the median step time of each after one warm-up step, their ratio (ours / TRL's:
< 1 is faster), each phase's time (rollout: sampling, rewards, reference
log-probs; update: forward, backward, AdamW) and each phase's share of the matmul
peak measured between steps, counted on the work each framework does: rollout =
2 x params per generated token + 2 x params per reference position; update = 6 x
params per trained position. TRL runs every row's prompt (N(P + T) positions),
grpojax each group's prompt once (B·P + N·T), for the same log-probs and gradients.
Our rollout is also timed without its reference forward (outside its timing).

Settings by --device: cpu, the 'small' Llama in float32, 4 x 8 rows, P=32, T=64,
4 timed steps, torch on --threads 2; gpu, Qwen2.5-0.5B's shapes, bf16 over float32
master weights and a bf16 reference, 16 x 8 rows, P=128, T=256, per-layer remat
(TRL: bf16 autocast, gradient checkpointing) on one GPU (tpu: ours alone); --quick, a
2-layer model, 2 x 4 rows, P=8, T=8, 2 steps. TRL is a benchmark-only dependency.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import common

common.share_gpu_with_torch()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpojax import config as grpojax_config, models  # noqa: E402
from grpojax.core import losses  # noqa: E402
from grpojax.models import tokenizers  # noqa: E402
from grpojax.rewards.runtime.host import HostRewards  # noqa: E402
from grpojax.sampling.strategies import SamplingParams  # noqa: E402
from grpojax.train import optim  # noqa: E402
from grpojax.train import rollout as rollout_lib  # noqa: E402
from grpojax.train import state as state_lib  # noqa: E402
from grpojax.train import step as step_lib  # noqa: E402
from grpojax.train import strategy as strategy_lib  # noqa: E402

BETA, LR = 0.04, 1e-6
# (B, G, P, T, steps, remat) by setting.
SETTINGS = {"quick": (2, 4, 8, 8, 2, False), "cpu": (4, 8, 32, 64, 4, False),
            "gpu": (16, 8, 128, 256, 4, True), "tpu": (16, 8, 128, 256, 4, True)}


def add_arguments(parser) -> None:
  parser.add_argument("--prompts", type=int, help="B prompts a step")
  parser.add_argument("--groups", type=int, help="G completions a prompt")
  parser.add_argument("--prompt-len", type=int, help="P")
  parser.add_argument("--new-tokens", type=int, help="T, forced")
  parser.add_argument("--steps", type=int, help="timed steps after one warm-up step")
  parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
  parser.add_argument("--skip-trl", action="store_true", help="time grpojax alone")


def distinct_words(completions, **unused):
  """The trivial reward: the fraction of distinct words in the completion."""
  return [len(set(c.split())) / 64.0 for c in completions]


def make_prompts(n: int, length: int, words, seed: int = 0) -> list[str]:
  """n prompts of `length` words drawn from `words` (each word one token)."""
  rng = np.random.default_rng(seed)
  return [" ".join(words[i] for i in rng.integers(0, len(words), length)) for _ in range(n)]


def rollout_fn(config, host, prompts: int):
  """The plain rollout strategy: `fn(state, batch, rng) -> (Rollout, metrics)`."""
  return strategy_lib.make("plain", config, host, num_prompts=prompts)


class Ours:
  """grpojax's GRPO step on the checkpoint at `path`; `step()` runs and times one."""

  def __init__(self, path, tokenizer, prompts, s, *, dtype, remat):
    self.s, self.prompts = s, prompts
    self.tok = tokenizers.load_tokenizer(tokenizer)
    # As the training loop loads it: parameters in the compute dtype, made float32
    # master weights by create_train_state; the reference in the compute dtype.
    model = models.from_pretrained(path, dtype=dtype, remat=remat)
    self.params, self.vocab_size = common.param_count(model.param_dict()), model.config.vocab_size
    self.tokens, self.mask = self.tok.batch_encode(prompts, max_length=s.P)
    assert self.tokens.shape == (len(prompts), s.P), self.tokens.shape
    optim_cfg = grpojax_config.get_config().optim
    assert (optim_cfg.learning_rate, optim_cfg.weight_decay, optim_cfg.max_grad_norm,
            optim_cfg.warmup_steps, optim_cfg.schedule) == (LR, 0.0, 1.0, 0, "constant")
    opt = optim.make_optimizer(optim_cfg, total_steps=s.steps + 1)
    self.state = state_lib.create_train_state(model.config, model.param_dict(), opt,
                                              with_reference=True, ref_dtype=dtype)
    examples = {i: {"prompt": p} for i, p in enumerate(prompts)}
    self.host = HostRewards([distinct_words], decode=self.tok.hf.batch_decode,
                            lookup=examples.__getitem__, num_workers=0)
    self.rollout = rollout_fn(self._config(True), self.host, s.B)
    # Without the reference forward, run after each step outside its timing: the split.
    self.no_ref = rollout_fn(self._config(False), self.host, s.B)
    self.update_kw = dict(loss_config=losses.LossConfig(loss_type="dapo", beta=BETA),
                          group_size=s.G, num_iterations=1, minibatches=1, temperature=1.0)
    self.i, self.times = 0, {"rollout": [], "update": [], "step": [], "sample": []}

  def _config(self, with_reference):
    return rollout_lib.RolloutConfig(
        group_size=self.s.G, max_new_tokens=self.s.T, sampling=SamplingParams(temperature=1.0),
        eos_ids=(self.vocab_size,), pad_id=self.tok.pad_id, with_reference=with_reference)

  def batch(self, i):
    rows = (np.arange(self.s.B) + i * self.s.B) % len(self.prompts)
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
    assert float(rm["completions/min_length"]) == self.s.T, rm
    assert np.isfinite(float(um["loss"])), um
    t3 = time.perf_counter()
    jax.block_until_ready(self.no_ref(self.state, self.batch(self.i), rng))
    t4 = time.perf_counter()
    if self.i:
      for k, t in (("rollout", t1 - t0), ("update", t2 - t1), ("step", t2 - t0),
                   ("sample", t4 - t3)):
        self.times[k].append(t)
    self.i += 1

  def finish(self) -> dict:
    self.host.close()
    med = statistics.median
    return dict(steps=self.times["step"], **{k: med(v) for k, v in self.times.items()})


def run_trl(path, tokenizer, prompts, s, between, *, threads, cuda, remat) -> dict:
  """TRL's GRPOTrainer for steps + 1 optimizer steps; `between()` runs after each of
  them, outside TRL's timing. With `cuda`, bf16 autocast over float32 weights (TRL's
  `bf16`), as grpojax computes in bf16 over float32 master weights."""
  import datasets
  import torch
  import transformers
  import trl

  torch.set_num_threads(threads)
  times = {"steps": [], "rollout": [], "generate": []}
  # CUDA runs asynchronously: a phase has ended when the device is done with it.
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  class Timed(trl.GRPOTrainer):
    # TRL's own phase methods, wrapped to time them: TRL 1.16 has no public hook there.
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
        gradient_checkpointing=remat, per_device_train_batch_size=s.B * s.G,
        gradient_accumulation_steps=1, num_generations=s.G, max_completion_length=s.T,
        temperature=1.0, generation_kwargs={"min_new_tokens": s.T}, beta=BETA, loss_type="dapo",
        num_iterations=1, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=s.steps + 1, report_to="none",
        logging_strategy="no", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    trainer = Timed(model=model, reward_funcs=distinct_words, args=args, processing_class=tok,
                    train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                    callbacks=[Between()])
    trainer.remove_callback(transformers.PrinterCallback)  # the end-of-training metrics line
    trainer.train()
  assert len(times["steps"]) == s.steps and len(times["rollout"]) == s.steps + 1, times
  roll = times["rollout"][1:]
  med = statistics.median
  return dict(version=trl.__version__, step=med(times["steps"]), rollout=med(roll),
              update=med(a - b for a, b in zip(times["steps"], roll)),
              generate=med(times["generate"][1:]), steps=times["steps"])


class Shapes:
  def __init__(self, args):
    B, G, P, T, steps, self.remat = SETTINGS["quick" if args.quick else args.device]
    self.B, self.G = args.prompts or B, args.groups or G
    self.P, self.T, self.steps = args.prompt_len or P, args.new_tokens or T, args.steps or steps


def run(args) -> dict:
  s = Shapes(args)
  name, shape = common.shape_for(args)
  device, dtype = common.peer_device(args.device)
  with tempfile.TemporaryDirectory() as path:
    tokenizer = common.write_checkpoint(path, shape)
    # Each prompt exactly P tokens: P words of the tokenizer's own.
    words = sorted(set(tokenizers.load_tokenizer(tokenizer).hf.get_vocab()) - set(common.SPECIALS))
    prompts = make_prompts(s.B * (s.steps + 1), s.P, words)
    ours = Ours(path, tokenizer, prompts, s, dtype=dtype, remat=s.remat)
    params = ours.params
    peaks = [common.matmul_peak(jnp.dtype(dtype), 256 if args.quick else 2048)]

    def between():
      ours.step()
      peaks.append(common.matmul_peak(jnp.dtype(dtype), 256 if args.quick else 2048))

    if args.skip_trl or device is None:
      theirs = None
      for _ in range(s.steps + 1):
        between()
    else:
      theirs = run_trl(path, tokenizer, prompts, s, between, threads=args.threads,
                       cuda=device == "cuda", remat=s.remat)
    ours = ours.finish()

  n = s.B * s.G
  positions = {"grpojax": s.B * s.P + n * s.T, "trl": n * (s.P + s.T)}
  flops_roll = {k: 2 * params * n * s.T + 2 * params * v for k, v in positions.items()}
  flops_upd = {k: 6 * params * v for k, v in positions.items()}
  peak = max(peaks)
  out = dict(model=name, dtype=dtype, params=params, B=s.B, G=s.G, P=s.P, T=s.T, remat=s.remat,
             matmul_peak_flops=peak, grpojax_step_s=ours["step"],
             grpojax_rollout_s=ours["rollout"], grpojax_update_s=ours["update"],
             grpojax_reference_s=ours["rollout"] - ours["sample"],
             grpojax_rollout_mfu=flops_roll["grpojax"] / ours["rollout"] / peak,
             grpojax_update_mfu=flops_upd["grpojax"] / ours["update"] / peak)
  print(f"{jax.devices()[0].device_kind}: {name} model, {params / 1e6:.1f}M params, {dtype}; "
        f"matmul peak {peak / 1e9:,.0f} GFLOP/s; N={n} rows ({s.B} x G={s.G}), P={s.P}, "
        f"T={s.T}, beta={BETA}, remat {s.remat}")
  print(f"grpojax: step {ours['step']:.3f} s (rollout {ours['rollout']:.3f} s = "
        f"{out['grpojax_rollout_mfu']:.1%} of peak, of which reference forward "
        f"~{out['grpojax_reference_s']:.3f} s; update {ours['update']:.3f} s = "
        f"{out['grpojax_update_mfu']:.1%} of peak); steps {[round(x, 3) for x in ours['steps']]}")
  if theirs is None:
    return out
  out.update(trl_version=theirs["version"], trl_step_s=theirs["step"],
             trl_rollout_s=theirs["rollout"], trl_update_s=theirs["update"],
             trl_generate_s=theirs["generate"],
             trl_update_mfu=flops_upd["trl"] / theirs["update"] / peak,
             step_ratio=ours["step"] / theirs["step"],
             rollout_ratio=ours["rollout"] / theirs["rollout"],
             update_ratio=ours["update"] / theirs["update"])
  print(f"TRL {theirs['version']}: step {theirs['step']:.3f} s (rollout {theirs['rollout']:.3f} "
        f"s, of which generate {theirs['generate']:.3f} s; update {theirs['update']:.3f} s = "
        f"{out['trl_update_mfu']:.1%} of peak); steps {[round(x, 3) for x in theirs['steps']]}")
  print(f"step time ratio (grpojax / TRL): {out['step_ratio']:.2f}x; rollout "
        f"{out['rollout_ratio']:.2f}x, update {out['update_ratio']:.2f}x", flush=True)
  return out
