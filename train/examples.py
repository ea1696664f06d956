"""The training transcripts: (prompt, reference answer) pairs of the repository's data/train/*.jsonl, in a fixed
order (files sorted, lines in order), loaded whole or read one line at a time (a trainer host of many reads only
the examples it feeds)."""

from __future__ import annotations

import os
from typing import Optional

from spec_jax.datasets import TRAIN_DIR, json_record, jsonl_files


def _example(rec: dict) -> Optional[tuple]:
  """(prompt, reference answer) of one training record, or None."""
  if "question" in rec:  # gsm8k
    return rec["question"], rec.get("answer", "")
  if "text" in rec and "code" in rec:  # mbpp
    return rec["text"], rec["code"].replace("\r\n", "\n")
  if "instruction" in rec:  # self-instruct seed tasks
    inst = rec["instruction"]
    first = (rec.get("instances") or [{}])[0]
    inp = first.get("input", "") or ""
    return inst + ("\n\n" + inp if inp.strip() else ""), first.get("output", "") or ""
  return None


def _scan_examples(data_dir: str):
  """-> (path, byte offset of its line, (prompt, reference answer)) of every training example in a fixed order
  (files sorted, lines in order). A missing or empty file, or a line that is not a JSON object, is an error that
  names the path (and line), as spec_jax.datasets.read_jsonl's."""
  for path in jsonl_files(data_dir):
    if "spec_bench" in os.path.basename(path).lower():
      continue
    offset, lines = 0, 0
    with open(path, "rb") as f:
      for n, line in enumerate(f, 1):
        start, offset = offset, offset + len(line)
        if not line.strip():
          continue
        lines += 1
        ex = _example(json_record(line, path, n))
        if ex and ex[0]:
          yield path, start, ex
    if not lines:
      raise ValueError(f"data file is empty: {path}")


def load_examples(data_dir: str = TRAIN_DIR) -> list:
  """(prompt, reference answer) of every training jsonl record, in a fixed order (files sorted, lines in order)."""
  out = [ex for _, _, ex in _scan_examples(data_dir)]
  if not out:
    raise ValueError(f"no training examples in {data_dir}")
  return out


class Examples:
  """load_examples' (prompt, reference answer) pairs, each read from its line on use (`examples[i]`): a trainer
  host of many reads only the examples it feeds. The index (one line offset per example, and whether its answer
  is non-blank) is one pass over the files that keeps nothing else. `read` holds the indices read so far."""

  def __init__(self, data_dir: str = TRAIN_DIR):
    self.where, self.answered, self.read = [], [], set()
    for path, offset, (_, answer) in _scan_examples(data_dir):
      self.where.append((path, offset))
      self.answered.append(bool(answer.strip()))
    if not self.where:
      raise ValueError(f"no training examples in {data_dir}")

  def __len__(self):
    return len(self.where)

  def __getitem__(self, i: int) -> tuple:
    path, offset = self.where[i]
    with open(path, "rb") as f:
      f.seek(offset)
      line = f.readline()
    self.read.add(int(i))
    return _example(json_record(line, path, 0))


def load_prompts(data_dir: str = TRAIN_DIR) -> list:
  return [p for p, _ in load_examples(data_dir)]
