"""grpojax against TRL on a real model, one TRL script for both: SmolLM2-135M-Instruct on
2-digit arithmetic in chat form (bench/arith_chat.py: 2,000 train rows, 200 held out),
one TRL-signature reward, 8 prompts x 8 completions of 64 tokens, lr 5e-6 (TRL's linear
decay, no warm-up), beta 0, dapo, grad-norm clip 1, 16 steps, float32, no gradient
checkpointing.

Each run is its own process, on an otherwise idle machine, one after another:
  api  grpojax.GRPOTrainer with grpojax.GRPOConfig(**trl_args(steps)): the TRL script, imports changed
  cli  python -m grpojax.main --config <the api run's workdir>/config.py (the same config)
  trl  trl.GRPOTrainer with trl.GRPOConfig(**trl_args(steps), use_cpu=True)
Then one evaluation script scores every exported model, and the base model, on the 200
held-out rows: greedy decoding with HF transformers' PyTorch model (neither trainer's
code), 64 new tokens, the answer being the completion's last integer.

  bash ../shared/models/smollm2.sh /tmp/smollm2
  python bench/trl_side_by_side.py --model /tmp/smollm2 --seeds 0 --runners api,cli,trl \
      --out bench/logs/trl_side_by_side

Prints one line per run: held-out accuracy after, seconds per step (the train call's
wall time over the steps; the cli's whole process, start-up included), and the
process's peak RSS (os.wait4); with --json, the last line is all of them as one JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)


def trl_args(steps: int) -> dict:
  """TRL's GRPOConfig arguments, the same for both trainers."""
  return dict(learning_rate=5e-6, per_device_train_batch_size=64, num_generations=8,
              max_completion_length=64, max_steps=steps, beta=0.0, loss_type="dapo",
              warmup_steps=0, max_grad_norm=1.0, temperature=1.0, logging_steps=1,
              save_strategy="no", report_to="none", gradient_checkpointing=False)


def _train(runner: str, model: str, workdir: str, seed: int, steps: int) -> None:
  """In the child process: one trainer's run; writes WORKDIR/run.json (train seconds)."""
  sys.path.insert(0, BENCH)
  import arith_chat  # pylint: disable=import-outside-toplevel

  train_rows = arith_chat.rows(**arith_chat.TRAIN)
  if runner == "api":
    import grpojax  # pylint: disable=import-outside-toplevel

    trainer = grpojax.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                                  args=grpojax.GRPOConfig(output_dir=workdir, seed=seed,
                                                          **trl_args(steps)),
                                  train_dataset=train_rows)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    hf = os.path.join(workdir, "hf")
  else:
    import datasets  # pylint: disable=import-outside-toplevel
    import trl  # pylint: disable=import-outside-toplevel

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                              args=trl.GRPOConfig(output_dir=workdir, seed=seed, use_cpu=True,
                                                  **trl_args(steps)),
                              train_dataset=datasets.Dataset.from_list(train_rows))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    hf = os.path.join(workdir, "hf")
    trainer.save_model(hf)
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump({"train_s": seconds, "hf": hf}, f)


def _child(argv: list[str], cwd: str) -> tuple[int, float, float]:
  """(exit status, wall seconds, peak RSS in GiB) of a child process."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, BENCH]), PYTHONUNBUFFERED="1")
  start = time.perf_counter()
  proc = subprocess.Popen(argv, cwd=cwd, env=env)
  _, status, usage = os.wait4(proc.pid, 0)
  return os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss / 2**20


def accuracy(model_dir: str) -> float:
  """Greedy held-out accuracy of an HF-format model, with transformers' PyTorch model."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import AutoModelForCausalLM, AutoTokenizer  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, BENCH)
  import arith_chat  # pylint: disable=import-outside-toplevel

  tok = AutoTokenizer.from_pretrained(model_dir)
  tok.padding_side = "left"
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  rows = arith_chat.rows(**arith_chat.HELD_OUT)
  right = 0
  for i in range(0, len(rows), 50):
    batch = rows[i:i + 50]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
      out = model.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    for r, ids in zip(batch, out[:, enc["input_ids"].shape[1]:]):
      right += arith_chat.answer(tok.decode(ids, skip_special_tokens=True)) == r["solution"]
  return right / len(rows)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct's HF directory")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--runners", default="api,cli,trl")
  ap.add_argument("--out", default=os.path.join(BENCH, "logs", "trl_side_by_side"))
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--child", nargs=3, metavar=("RUNNER", "WORKDIR", "SEED"), help=argparse.SUPPRESS)
  ap.add_argument("--accuracy", metavar="MODEL_DIR", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return _train(args.child[0], args.model, args.child[1], int(args.child[2]), args.steps)
  if args.accuracy:
    print(json.dumps({"accuracy": accuracy(args.accuracy)}))
    return None

  def score(model_dir: str) -> float:  # in its own process too: torch stays out of the runs
    out = subprocess.run([sys.executable, __file__, "--model", args.model, "--accuracy", model_dir],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["accuracy"]

  os.makedirs(args.out, exist_ok=True)
  results = [{"runner": "base", "accuracy": score(args.model)}]
  print(f"base model: held-out accuracy {results[0]['accuracy']:.3f}", flush=True)
  for seed in [int(s) for s in args.seeds.split(",")]:
    for runner in args.runners.split(","):
      workdir = os.path.join(args.out, f"{runner}-seed{seed}")
      if runner == "cli":
        api = os.path.join(args.out, f"api-seed{seed}")
        argv = [sys.executable, "-m", "grpojax.main", "--config", os.path.join(api, "config.py"),
                "--workdir", workdir]
      else:
        argv = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                "--child", runner, workdir, str(seed)]
      code, wall, rss = _child(argv, cwd=BENCH)
      if code:
        raise SystemExit(f"{runner} seed {seed} failed ({code})")
      if runner == "cli":
        train_s, hf = wall, os.path.join(workdir, "hf")
      else:
        with open(os.path.join(workdir, "run.json")) as f:
          run = json.load(f)
        train_s, hf = run["train_s"], run["hf"]
      row = {"runner": runner, "seed": seed, "accuracy": score(hf), "s_per_step": train_s / args.steps,
             "peak_rss_gib": rss, "wall_s": wall}
      results.append(row)
      print(f"{runner} seed {seed}: held-out accuracy {row['accuracy']:.3f}, "
            f"{row['s_per_step']:.1f} s/step, peak RSS {rss:.1f} GiB", flush=True)
  if args.json:
    print(json.dumps(results))
  return None


if __name__ == "__main__":
  main()
