"""grpojax against TRL on a real model, one TRL script for both: SmolLM2-135M-Instruct on
2-digit arithmetic in chat form (bench/arith_chat.py: 2,000 train rows, 200 held out),
one TRL-signature reward, 8 prompts x 8 completions of 64 tokens, lr 5e-6 (TRL's linear
decay, no warm-up), beta 0, dapo, grad-norm clip 1, 16 steps, float32, no gradient
checkpointing.

Each run is its own process, one after another, on an otherwise idle machine:
  api  grpojax.GRPOTrainer with grpojax.GRPOConfig(**trl_args(steps)): the TRL script,
       imports changed
  cli  python -m grpojax.main --config <the api run's workdir>/config.py (the same config)
  carried  api's run with carried rollouts (rollout.max_staleness=2) and AReaL's
       decoupled loss (loss.decoupled): GRPOConfig(config=CARRIED)
  trl  trl.GRPOTrainer with trl.GRPOConfig(**trl_args(steps), use_cpu=True)
Then one evaluation scores every exported model, and the base model, on the held-out
rows: greedy decoding with HF transformers' PyTorch model (neither trainer's code),
64 new tokens, the answer being the completion's last integer. Each run's line: its
held-out accuracy, seconds per step (the train call's wall time over the steps; the
cli's whole process, start-up included) and the process's peak RSS (os.wait4).

  bash ../shared/models/smollm2.sh /tmp/smollm2
  python bench/run.py trl_side_by_side --model /tmp/smollm2 --seeds 0

--device changes nothing (the CPU). --quick: a random 2-layer chat model written by
the run, runners api and trl, 2 steps of 2 x 4 completions of 8 tokens, 16 held-out
rows scored in this process. --dry-run: both trainers built on that model, not trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import arith_chat

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH)


def add_arguments(parser) -> None:
  parser.add_argument("--model", help="SmolLM2-135M-Instruct's HF directory (not with --quick)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--runners", help="of api, cli, carried, trl, comma-separated (default "
                      "api,cli,trl)")
  parser.add_argument("--out", help="the runs' workdirs (default bench/logs/trl_side_by_side; "
                      "--quick: a temporary directory)")
  parser.add_argument("--steps", type=int, help="optimizer steps (default 16)")


def trl_args(steps: int, quick: bool = False) -> dict:
  """TRL's GRPOConfig arguments, the same for both trainers."""
  shapes = (dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8)
            if quick else dict(per_device_train_batch_size=64, num_generations=8,
                               max_completion_length=64))
  return dict(learning_rate=5e-6, max_steps=steps, beta=0.0, loss_type="dapo", warmup_steps=0,
              max_grad_norm=1.0, temperature=1.0, logging_steps=1, save_strategy="no",
              report_to="none", gradient_checkpointing=False, **shapes)


# The carried runner's grpojax keys: rows carried across updates, at most 2 versions old,
# under AReaL's decoupled loss.
CARRIED = {"rollout.max_staleness": 2, "loss.decoupled": True}


def trainer(runner: str, model: str, workdir: str, seed: int, steps: int, quick: bool):
  """The runner's trainer (api, carried: grpojax's; trl: TRL's), built from the same
  arguments."""
  train_rows = arith_chat.rows(**arith_chat.TRAIN)
  args = trl_args(steps, quick)
  if runner in ("api", "carried"):
    import grpojax

    config = CARRIED if runner == "carried" else {}
    return grpojax.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                               args=grpojax.GRPOConfig(output_dir=workdir, seed=seed,
                                                       config=config, **args),
                               train_dataset=train_rows)
  import datasets
  import trl

  return trl.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                         args=trl.GRPOConfig(output_dir=workdir, seed=seed, use_cpu=True, **args),
                         train_dataset=datasets.Dataset.from_list(train_rows))


def train(runner: str, model: str, workdir: str, seed: int, steps: int, quick: bool) -> None:
  """In the child process: one trainer's run; writes WORKDIR/run.json (train seconds)."""
  built = trainer(runner, model, workdir, seed, steps, quick)
  start = time.perf_counter()
  built.train()
  seconds = time.perf_counter() - start
  hf = os.path.join(workdir, "hf")
  if runner == "trl":
    built.save_model(hf)
  with open(os.path.join(workdir, "run.json"), "w", encoding="utf-8") as f:
    json.dump({"train_s": seconds, "hf": hf}, f)


def child(argv: list[str]) -> tuple[int, float, float]:
  """(exit status, wall seconds, peak RSS in GiB) of a child process run in bench/."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, BENCH]), PYTHONUNBUFFERED="1")
  start = time.perf_counter()
  proc = subprocess.Popen(argv, cwd=BENCH, env=env)
  _, status, usage = os.wait4(proc.pid, 0)
  return os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss / 2**20


def accuracy(model_dir: str, rows: int = 200) -> float:
  """Greedy held-out accuracy of an HF-format model on the first `rows` held-out rows,
  with transformers' PyTorch model."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tok = AutoTokenizer.from_pretrained(model_dir)
  tok.padding_side = "left"
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  held_out = arith_chat.rows(**arith_chat.HELD_OUT)[:rows]
  right = 0
  for i in range(0, len(held_out), 50):
    batch = held_out[i:i + 50]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
      out = model.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    for r, ids in zip(batch, out[:, enc["input_ids"].shape[1]:]):
      right += arith_chat.answer(tok.decode(ids, skip_special_tokens=True)) == r["solution"]
  return right / len(held_out)


def quick_model(path: str) -> str:
  """A random 2-layer Llama whose word-level tokenizer (in its own directory, as a
  model's is) holds the task's words: the chat template's markers, digits, operators."""
  import common

  rows = arith_chat.rows(**arith_chat.TRAIN) + arith_chat.rows(**arith_chat.HELD_OUT)
  words = " ".join(r["prompt"][0]["content"] for r in rows)
  words += " user assistant " + " ".join(str(i) for i in range(-99, 199))
  common.write_checkpoint(path, common.TINY, words=words.split(), tokenizer=path)
  return path


def dry_run(args) -> dict:
  """Both trainers built in this process on the --quick model, neither trained."""
  with tempfile.TemporaryDirectory() as tmp:
    model = quick_model(os.path.join(tmp, "model"))
    for runner in ("api", "carried", "trl"):
      trainer(runner, model, os.path.join(tmp, runner), 0, 2, True)
      print(f"  {runner}: built", flush=True)
  return {"built": ["api", "carried", "trl"]}


def run(args) -> dict:
  runners = (args.runners or ("api,trl" if args.quick else "api,cli,trl")).split(",")
  steps = args.steps or (2 if args.quick else 16)
  with tempfile.TemporaryDirectory() as tmp:
    model = quick_model(os.path.join(tmp, "model")) if args.quick else args.model
    if not model:
      raise SystemExit("--model: SmolLM2-135M-Instruct's HF directory (or --quick)")
    out_dir = os.path.join(tmp, "runs") if args.quick else (
        args.out or os.path.join(BENCH, "logs", "trl_side_by_side"))
    os.makedirs(out_dir, exist_ok=True)

    def score(model_dir: str) -> float:
      if args.quick:
        return accuracy(model_dir, rows=16)
      # In its own process too: torch stays out of the runs' processes.
      got = subprocess.run([sys.executable, "-m", "workloads.trl_side_by_side", "--accuracy",
                            model_dir], capture_output=True, text=True, check=True, cwd=BENCH,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, BENCH])))
      return json.loads(got.stdout.strip().splitlines()[-1])["accuracy"]

    results = [{"runner": "base", "accuracy": score(model)}]
    print(f"base model: held-out accuracy {results[0]['accuracy']:.3f}", flush=True)
    for seed in [int(s) for s in args.seeds.split(",")][:1 if args.quick else None]:
      for runner in runners:
        workdir = os.path.join(out_dir, f"{runner}-seed{seed}")
        if runner == "cli":
          argv = [sys.executable, "-m", "grpojax.main", "--config",
                  os.path.join(out_dir, f"api-seed{seed}", "config.py"), "--workdir", workdir]
        else:
          argv = [sys.executable, "-m", "workloads.trl_side_by_side", "--child", runner, model,
                  workdir, str(seed), str(steps), str(int(args.quick))]
        code, wall, rss = child(argv)
        if code:
          raise SystemExit(f"{runner} seed {seed} failed ({code})")
        if runner == "cli":
          train_s, hf = wall, os.path.join(workdir, "hf")
        else:
          with open(os.path.join(workdir, "run.json"), encoding="utf-8") as f:
            done = json.load(f)
          train_s, hf = done["train_s"], done["hf"]
        row = {"runner": runner, "seed": seed, "accuracy": score(hf), "s_per_step": train_s / steps,
               "peak_rss_gib": rss, "wall_s": wall}
        results.append(row)
        print(f"{runner} seed {seed}: held-out accuracy {row['accuracy']:.3f}, "
              f"{row['s_per_step']:.1f} s/step, peak RSS {rss:.2f} GiB", flush=True)
  by = {r["runner"]: r for r in results if r.get("seed") == results[-1].get("seed")}
  out = {"runs": results}
  if "api" in by and "trl" in by:
    out["api_vs_trl_s_per_step"] = by["api"]["s_per_step"] / by["trl"]["s_per_step"]
    print(f"s/step, api / trl: {out['api_vs_trl_s_per_step']:.2f}x", flush=True)
  return out


if __name__ == "__main__":  # the child processes' entry (cwd bench/, on PYTHONPATH)
  if sys.argv[1] == "--accuracy":
    print(json.dumps({"accuracy": accuracy(sys.argv[2])}))
  else:
    runner_, model_, workdir_, seed_, steps_, quick_ = sys.argv[2:8]
    train(runner_, model_, workdir_, int(seed_), int(steps_), bool(int(quick_)))
