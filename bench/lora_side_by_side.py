"""LoRA and QLoRA against full fine-tuning on bench/trl_side_by_side.py's task (issue 35):
SmolLM2-135M-Instruct on 2-digit arithmetic chat, 8 prompts x 8 completions of 64 tokens,
16 steps, TRL's GRPOConfig arguments (trl_side_by_side.trl_args) for every run, each run
its own process, one after another.

Runners:
  api        grpojax.GRPOTrainer, full fine-tuning at lr 5e-6 (trl_side_by_side's api run)
  api-lora   the same with peft_config=peft.LoraConfig(r=16, lora_alpha=32,
             target_modules="all-linear", lora_dropout=0) and lr --lora-lr (5e-5: LoRA's
             usual ~10x of full fine-tuning's rate); GRPOConfig(config={
             "model.lora.export_merged": True}) writes hf/merged too
  api-qlora  api-lora plus config={"model.lora.quantize": "nf4"} (a frozen nf4 base)
  trl-lora   trl.GRPOTrainer with the same peft_config and lr (the peer); its adapters are
             folded into the base with peft's merge_and_unload and saved as hf/merged

Scoring is trl_side_by_side.accuracy for every model: greedy decoding of an HF directory with
transformers' PyTorch model on the 200 held-out rows. LoRA runs are scored on hf/merged; with
--check-adapter, grpojax's PEFT adapter export (hf/) is scored too, loaded onto the base with
peft (PeftModel.from_pretrained + merge_and_unload), which checks the adapter files.

  python bench/lora_side_by_side.py --model /tmp/smollm2 --seeds 0 \
      --runners api-lora,api-qlora,api,trl-lora --json

Prints one line per run (held-out accuracy, s/step as the train() call's wall time over the
steps, the process's peak RSS); with --json, the last line is all of them as one JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import trl_side_by_side as side  # noqa: E402  pylint: disable=wrong-import-position

RUNNERS = ("api", "api-lora", "api-qlora", "trl-lora")


def peft_config(rank: int = 16, alpha: float = 32):
  import peft  # pylint: disable=import-outside-toplevel

  return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0,
                         bias="none", task_type="CAUSAL_LM")


def _train(runner: str, model: str, workdir: str, seed: int, steps: int, lora_lr: float) -> None:
  """In the child process: one run; writes WORKDIR/run.json (train seconds, model to score)."""
  import arith_chat  # pylint: disable=import-outside-toplevel

  train_rows = arith_chat.rows(**arith_chat.TRAIN)
  args = side.trl_args(steps)
  lora = runner != "api"
  if lora:
    args["learning_rate"] = lora_lr
  if runner.startswith("api"):
    import grpojax  # pylint: disable=import-outside-toplevel

    extra = {}
    if lora:
      extra["model.lora.export_merged"] = True
    if runner == "api-qlora":
      extra["model.lora.quantize"] = "nf4"
    trainer = grpojax.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                                  args=grpojax.GRPOConfig(output_dir=workdir, seed=seed,
                                                          config=extra, **args),
                                  train_dataset=train_rows,
                                  peft_config=peft_config() if lora else None)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    hf = os.path.join(workdir, "hf", "merged") if lora else os.path.join(workdir, "hf")
  elif runner == "trl-lora":
    import datasets  # pylint: disable=import-outside-toplevel
    import trl  # pylint: disable=import-outside-toplevel

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[arith_chat.correct],
                              args=trl.GRPOConfig(output_dir=workdir, seed=seed, use_cpu=True,
                                                  **args),
                              train_dataset=datasets.Dataset.from_list(train_rows),
                              peft_config=peft_config())
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(os.path.join(workdir, "hf"))  # the PEFT adapter
    hf = os.path.join(workdir, "hf", "merged")
    trainer.model.merge_and_unload().save_pretrained(hf)
    trainer.processing_class.save_pretrained(hf)
  else:
    raise SystemExit(f"unknown runner {runner!r}; known: {', '.join(RUNNERS)}")
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump({"train_s": seconds, "hf": hf}, f)


def adapter_accuracy(base: str, adapter: str) -> float:
  """trl_side_by_side.accuracy of the base with a PEFT adapter directory folded in by peft."""
  import tempfile  # pylint: disable=import-outside-toplevel

  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import AutoModelForCausalLM, AutoTokenizer  # pylint: disable=import-outside-toplevel

  model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
  with tempfile.TemporaryDirectory() as tmp:
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    return side.accuracy(tmp)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct's HF directory")
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--runners", default="api-lora,api-qlora,api,trl-lora")
  ap.add_argument("--out", default="/tmp/lora_side_by_side",
                  help="the runs' workdirs (exports of 0.5 GiB each: keep them out of the repo)")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--lora-lr", type=float, default=5e-5)
  ap.add_argument("--base", action="store_true", help="also score the base model")
  ap.add_argument("--check-adapter", action="store_true",
                  help="also score grpojax's PEFT adapter export, loaded with peft")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--child", nargs=3, metavar=("RUNNER", "WORKDIR", "SEED"), help=argparse.SUPPRESS)
  ap.add_argument("--accuracy", metavar="MODEL_DIR", help=argparse.SUPPRESS)
  ap.add_argument("--adapter-accuracy", metavar="ADAPTER_DIR", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    return _train(args.child[0], args.model, args.child[1], int(args.child[2]), args.steps,
                  args.lora_lr)
  if args.accuracy:
    print(json.dumps({"accuracy": side.accuracy(args.accuracy)}))
    return None
  if args.adapter_accuracy:
    print(json.dumps({"accuracy": adapter_accuracy(args.model, args.adapter_accuracy)}))
    return None

  def score(*flag: str) -> float:  # in its own process: torch stays out of the runs
    out = subprocess.run([sys.executable, __file__, "--model", args.model, *flag],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["accuracy"]

  os.makedirs(args.out, exist_ok=True)
  results = []
  if args.base:
    results.append({"runner": "base", "accuracy": score("--accuracy", args.model)})
    print(f"base model: held-out accuracy {results[0]['accuracy']:.3f}", flush=True)
  for seed in [int(s) for s in args.seeds.split(",")]:
    for runner in args.runners.split(","):
      if runner not in RUNNERS:
        raise SystemExit(f"unknown runner {runner!r}; known: {', '.join(RUNNERS)}")
      lr = 5e-6 if runner == "api" else args.lora_lr
      tag = "" if runner == "api" or args.lora_lr == 5e-5 else f"-lr{args.lora_lr:g}"
      workdir = os.path.join(args.out, f"{runner}{tag}-seed{seed}")
      if os.path.exists(workdir):
        raise SystemExit(f"{workdir} exists: a reused workdir resumes; move it away first")
      argv = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
              "--lora-lr", repr(args.lora_lr), "--child", runner, workdir, str(seed)]
      code, wall, rss = side._child(argv, cwd=BENCH)  # pylint: disable=protected-access
      if code:
        raise SystemExit(f"{runner} seed {seed} failed ({code})")
      with open(os.path.join(workdir, "run.json")) as f:
        run = json.load(f)
      row = {"runner": runner, "seed": seed, "lr": lr, "accuracy": score("--accuracy", run["hf"]),
             "s_per_step": run["train_s"] / args.steps, "peak_rss_gib": rss, "wall_s": wall}
      if args.check_adapter and runner in ("api-lora", "api-qlora"):
        row["adapter_accuracy"] = score("--adapter-accuracy", os.path.join(workdir, "hf"))
      results.append(row)
      extra = (f", adapter via peft {row['adapter_accuracy']:.3f}"
               if "adapter_accuracy" in row else "")
      print(f"{runner} lr {lr:g} seed {seed}: held-out accuracy {row['accuracy']:.3f}{extra}, "
            f"{row['s_per_step']:.1f} s/step, peak RSS {rss:.1f} GiB", flush=True)
  if args.json:
    print(json.dumps(results))
  return None


if __name__ == "__main__":
  main()
