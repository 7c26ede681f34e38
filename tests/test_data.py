"""Tasks, dataset loading from local files, and the resumable per-process prompt iterator."""

import json
import re

import numpy as np
import pytest

from grpojax.data import pipeline, synthetic, tasks
from grpojax.models.tokenizers import CharTokenizer
from grpojax.rewards.base import completion_text
from grpojax.run.settings import read as read_settings


def test_arithmetic_rows_are_right_and_seeded():
  rows = synthetic.arithmetic_rows(300, seed=5, digits=2, ops="+-*", terms=3)
  for r in rows:  # Python's own evaluator is the independent reference here
    assert int(r["answer"]) == eval(r["question"][:-1])  # noqa: S307
  assert rows == synthetic.arithmetic_rows(300, seed=5, digits=2, ops="+-*", terms=3)
  assert rows != synthetic.arithmetic_rows(300, seed=6, digits=2, ops="+-*", terms=3)
  with pytest.raises(ValueError, match="ops"):
    synthetic.arithmetic_rows(1, seed=0, ops="/")


def test_arithmetic_task_splits_differ_and_difficulty_parses():
  task = tasks.get_task("arithmetic")
  train = tasks.load_rows(task, "arithmetic:1:*", "train")
  test = tasks.load_rows(task, "arithmetic:1:*", "test")
  assert all("*" in r["question"] and len(r["question"]) <= 4 for r in train[:50])
  assert [r["question"] for r in train[:20]] != [r["question"] for r in test[:20]]


def test_unknown_task_lists_known_ones():
  with pytest.raises(ValueError, match=r"task.name='gsm9k' is unknown; known: \[.*'gsm8k'"):
    tasks.get_task("gsm9k")


def test_local_jsonl_and_directory_datasets(tmp_path):
  rows = [{"question": "1+1?", "answer": "So #### 2"}, {"question": "2+3?", "answer": "#### 5"}]
  path = tmp_path / "train.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows))
  task = tasks.get_task("gsm8k")
  assert tasks.load_rows(task, str(path), "train") == rows
  assert tasks.load_rows(task, str(tmp_path), "train") == rows


def test_split_slices_of_local_files_and_directories(tmp_path):
  rows = [{"question": f"{i}+0?", "answer": f"#### {i}"} for i in range(10)]
  path = tmp_path / "train.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows))
  task = tasks.get_task("gsm8k")
  load = lambda dataset, split: tasks.load_rows(task, str(dataset), split)  # noqa: E731
  assert load(path, "train[:3]") == rows[:3]
  assert load(path, "train[3:5]") == rows[3:5]
  assert load(path, "test[-2:]") == rows[-2:]  # a single file is any split, sliced the same
  assert load(path, "train[:50%]") == rows[:5]
  assert load(tmp_path, "train[7:]") == rows[7:]  # a directory: train.jsonl, sliced
  # Disjoint train and eval slices of one file, as countdown's TinyZero split.
  train, held_out = load(path, "train[:8]"), load(path, "train[8:10]")
  assert train + held_out == rows
  with pytest.raises(ValueError, match="no data"):
    load(path, "train[20:30]")


def test_arithmetic_refuses_splits_it_cannot_generate():
  task = tasks.get_task("arithmetic")
  for split in ("train[:100]", "validation"):
    with pytest.raises(ValueError, match=r"'train' and 'test' only, got '" + re.escape(split)):
      tasks.load_rows(task, "arithmetic", split)


def test_hub_names_carry_an_optional_subset(monkeypatch):
  # No hub here: record what datasets.load_dataset would be asked for.
  import datasets

  calls = []
  monkeypatch.setattr(datasets, "load_dataset",
                      lambda *a, **kw: calls.append((a, kw)) or [{"question": "q", "answer": "a"}])
  tasks.load_rows(tasks.get_task("gsm8k"), "", "train")  # the default needs subset "main"
  tasks.load_rows(tasks.get_task("gsm8k"), "someone/gsm-like", "test")
  tasks.load_rows(tasks.get_task("gsm8k"), "someone/gsm-like", "train[100:120]")
  assert calls == [(("openai/gsm8k", "main"), {"split": "train"}),
                   (("someone/gsm-like", None), {"split": "test"}),
                   (("someone/gsm-like", None), {"split": "train[100:120]"})]


def test_missing_column_names_the_column_and_the_task(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"question": "q"}))
  with pytest.raises(ValueError, match=r"task 'gsm8k'.*lacks column\(s\) \['answer'\]"):
    tasks.load_rows(tasks.get_task("gsm8k"), str(path), "train")


def test_task_correctness_checks():
  assert tasks.get_task("arithmetic").is_correct(" 45 ", {"answer": "45"})
  assert not tasks.get_task("arithmetic").is_correct("46", {"answer": "45"})
  gsm = tasks.get_task("gsm8k")
  assert gsm.is_correct("so it is \\boxed{1,234}", {"answer": "work #### 1234"})
  assert not gsm.is_correct("so it is \\boxed{1233}", {"answer": "work #### 1234"})
  cd = tasks.get_task("countdown")
  assert cd.is_correct("<think>x</think><answer>(6-2)*5</answer>", {"nums": [2, 5, 6], "target": 20})
  assert not cd.is_correct("<answer>6*5-2</answer>", {"nums": [2, 5, 6], "target": 20})


# The hand-written is_correct of each built-in task before they were derived
# from the task's verifier (commit 2d49e20): the derived ones must agree.
def _old_math_correct(completion, row):
  from grpojax.rewards import math as m
  gold = m.gold_answer(row["answer"]) if row.get("answer") is not None else None
  return gold is not None and m.is_equivalent(m.extract_answer(completion_text(completion)), gold)


def _old_reward_correct(fn, **columns):
  return lambda c, row: bool(fn([None], [c], **{k: [row[k]] for k in columns})[0])


def _old_checks():
  from grpojax.rewards import code, countdown
  return {
      "arithmetic": lambda c, row: completion_text(c).strip() == str(row["answer"]).strip(),
      "gsm8k": _old_math_correct,
      "math": _old_math_correct,
      "countdown": _old_reward_correct(countdown.CountdownReward(), target=1, nums=1),
      "code": _old_reward_correct(code.CodeReward(tests_column="test_list"), test_list=1),
  }


_CASES = {  # (row, completions: right, wrong, unparsable, ...)
    "arithmetic": ({"question": "40+5=", "answer": "45"}, [" 45 ", "46", "", "forty-five"]),
    "gsm8k": ({"question": "q", "answer": "work #### 1234"},
              ["so \\boxed{1,234}", "\\boxed{1233}", "\\boxed{", "no answer", "1234"]),
    "math": ({"problem": "p", "answer": "\\frac{1}{2}"},
             ["\\boxed{0.5}", "\\boxed{2}", "}{", "\\boxed{\\frac12}", ""]),
    "countdown": ({"nums": [2, 5, 6], "target": 20},
                  ["<think>x</think><answer>(6-2)*5</answer>", "<answer>6*5-2</answer>",
                   "<answer>", "(6-2)*5"]),
    "code": ({"text": "t", "test_list": ["assert f(2) == 4"], "code": "def f(x): return 2*x"},
             ["```python\ndef f(x): return 2*x\n```", "```python\ndef f(x): return x\n```",
              "```python\ndef f(x:\n```", "no code"]),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_derived_is_correct_agrees_with_the_old_hand_written_check(name):
  task, old = tasks.get_task(name), _old_checks()[name]
  try:  # a machine that cannot isolate programs runs no code verifier
    getattr(task.reward_fns[0], "startup_check", lambda: None)()
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"{name}: {e}")
  row, completions = _CASES[name]
  got = [task.is_correct(c, row) for c in completions]
  assert got == [old(c, row) for c in completions]
  assert got[0] and not got[1] and not got[2]  # right, wrong, unparsable
  assert all(type(g) is bool for g in got)


def test_is_correct_is_the_verifier_at_full_score_unless_given():
  def partial(prompts=None, completions=(), **unused):
    return [{"a": 1.0, "b": 0.5, "c": 0.0, "d": None}[c] for c in completions]

  def shaping(prompts=None, completions=(), **unused):
    return [1.0] * len(completions)  # not the verifier: ignored by is_correct

  task = tasks.Task(name="t", default_dataset="", columns=(), prompt=lambda row: "",
                    reward_fns=(partial, shaping))
  assert [task.is_correct(c, {}) for c in "abcd"] == [True, False, False, False]
  given = tasks.Task(name="t", default_dataset="", columns=(), prompt=lambda row: "",
                     reward_fns=(partial,), is_correct=lambda c, row: c == "b")
  assert [given.is_correct(c, {}) for c in "abcd"] == [False, True, False, False]


def _iterator(rows, **kw):
  kw = dict(batch_size=4, max_prompt_length=8, seed=0, **kw)
  return pipeline.PromptIterator(rows, tasks.get_task("arithmetic"), CharTokenizer(), **kw)


ROWS = synthetic.arithmetic_rows(30, seed=0)


def test_batches_are_left_padded_and_ids_look_up_their_rows():
  it = _iterator(ROWS)
  tok = CharTokenizer()
  batch = it.next()
  assert batch["prompt_tokens"].shape[0] == 4
  for toks, mask, i in zip(batch["prompt_tokens"], batch["prompt_mask"], batch["example_ids"]):
    real = toks[mask > 0]
    assert tok.decode(real) == it.lookup(i)["question"] == it.lookup(i)["prompt"]
    assert mask[-1] == 1 and (np.diff(mask) >= 0).all()  # left padding


def test_resume_from_state_gives_the_same_batches_across_epochs():
  a = _iterator(ROWS)
  seen = [a.next()["example_ids"].tolist() for _ in range(3)]
  state = a.state_dict()
  rest = [a.next()["example_ids"].tolist() for _ in range(6)]  # crosses an epoch (30 rows / 4)
  b = _iterator(ROWS)
  b.load_state_dict(state)
  assert [b.next()["example_ids"].tolist() for _ in range(6)] == rest
  assert len({i for s in seen for i in s}) == 12  # no repeats within an epoch


def test_rewind_serves_the_prompts_given_back_again():
  it = _iterator(ROWS)
  order = it._order.tolist()
  marks = []
  for _ in range(2):
    marks.append(it.state_dict())
    it.next()
  it.rewind(marks[1], 1)  # batch 1's first prompt was used: its other three come next
  assert it.next()["example_ids"].tolist() == order[5:9]
  for _ in range(5):  # up to the last batch of epoch 0 (30 rows: 28 in batches of 4)
    it.next()
  mark = it.state_dict()
  first = it.next()["example_ids"].tolist()  # epoch 1's first batch
  it.rewind(mark, 2)
  assert it.epoch == 1 and it.next()["example_ids"].tolist()[:2] == first[2:]


def test_processes_split_each_global_batch():
  whole = _iterator(ROWS).next()
  parts = [_iterator(ROWS, process_index=p, process_count=2).next() for p in range(2)]
  assert np.concatenate([p["example_ids"] for p in parts]).tolist() == whole["example_ids"].tolist()
  assert {p["prompt_tokens"].shape[1] for p in parts} == {whole["prompt_tokens"].shape[1]}


def test_long_prompts_are_filtered_with_a_count_or_refused():
  rows = ROWS[:10] + [{"id": 99, "question": "1234567+1=", "answer": "1234568"}]
  it = _iterator(rows)
  assert it.num_dropped == 1 and all(r["id"] != 99 for r in it.rows)
  with pytest.raises(ValueError, match="exceed rollout.max_prompt_length=8"):
    _iterator(rows, on_long="error")


def test_too_few_prompts_within_the_length_says_what_length_keeps_them():
  rows = [{"id": i, "question": f"{i:07d}+1=", "answer": str(i + 1)} for i in range(12)]
  with pytest.raises(tasks.DataError) as e:
    _iterator(rows)  # 10-character prompts over max_prompt_length=8: every one dropped
  assert str(e.value) == (
      "task 'arithmetic' has 0 usable prompts, fewer than the 4 prompts one step needs "
      "(rollout.prompts_per_step), 12 of 12 being longer than rollout.max_prompt_length=8 "
      "tokens; the longest is 10 tokens (rollout.max_prompt_length=10 keeps every one)")


def test_chat_prompts_go_through_the_tokenizer_template():
  text = pipeline.prompt_text(tasks.get_task("gsm8k"), {"question": "1+1?", "answer": "2"},
                              CharTokenizer())
  assert text.startswith("1+1?\n") and "boxed" in text


# Issue 16: bad data stops at startup with one line naming the file (and column).
def test_bad_files_stop_with_one_line_naming_the_file_and_column(tmp_path):
  task = tasks.get_task("gsm8k")
  nulls = tmp_path / "nulls.jsonl"
  nulls.write_text("\n".join(json.dumps({"question": f"{i}?", "answer": None}) for i in range(3)))
  with pytest.raises(ValueError, match=r"nulls\.jsonl.*column 'answer' is null in all 3 rows"):
    tasks.load_rows(task, str(nulls), "train")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match=r"empty\.jsonl.*no rows"):
    tasks.load_rows(task, str(empty), "train")
  blank = tmp_path / "blank.jsonl"  # only blank lines: the same line as an empty file
  blank.write_text("\n  \n\t\n" * 1000)
  with pytest.raises(ValueError, match=r"blank\.jsonl.*has no rows"):
    tasks.load_rows(task, str(blank), "train")
  # A bad byte deep in a file: its line and its offset in the file, not in a block.
  latin = tmp_path / "latin.jsonl"
  good = "".join(json.dumps({"question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n"
                 for i in range(10_000)).encode()
  latin.write_bytes(good + b'{"question": "caf\xe9 \xff\xfe?", "answer": "1"}\n')
  with pytest.raises(ValueError) as e:
    tasks.load_rows(task, str(latin), "train")
  assert str(e.value) == (f"dataset file {str(latin)!r} is not UTF-8 text (line 10001, byte "
                          f"{len(good) + 17} of the file: invalid continuation byte); "
                          "re-encode it, e.g. iconv -t utf-8")


def test_a_folder_without_the_eval_split_says_so_in_one_line(tmp_path):
  from grpojax import config as config_lib
  from grpojax.data.tasks import DataError, get_task, load_rows
  from grpojax.train import wiring

  (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
  task = get_task("prompt")
  assert load_rows(task, str(tmp_path), "train")[0]["prompt"] == "1+1="
  with pytest.raises(DataError) as e:
    load_rows(task, str(tmp_path), "test")
  assert "has no split 'test'" in str(e.value) and "train.jsonl" in str(e.value)
  cfg = config_lib.validate(config_lib.apply(config_lib.get_config(), {
      "task.name": "prompt", "task.dataset": str(tmp_path),
      "rewards.functions": "trl.rewards:think_format_reward"}))
  with pytest.raises(DataError) as e:
    wiring.run_rows(read_settings(cfg), task)
  assert str(e.value).startswith("eval: dataset directory") and "eval.num_prompts=0" in str(e.value)
  assert "\n" not in str(e.value)
  off = read_settings(config_lib.apply(cfg, {"eval.num_prompts": 0}))
  train, held_out = wiring.run_rows(off, task)
  assert len(train) == 1 and held_out == []
