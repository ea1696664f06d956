"""The prompt sets that ship inside the repository (`data/`; sources, licenses and sha256 in data/README.md).

Paths resolve from this file's location, never from the working directory, so every entry point finds them from
anywhere. Nothing in the project reads data from outside its own tree.
"""

from __future__ import annotations

import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_ROOT, "data")
# Spec-Bench's 480 questions: evaluation only (the load matrix's default traffic, benchmarks), never training.
SPEC_BENCH = os.path.join(DATA_DIR, "specbench", "spec_bench_question.jsonl")
# Training prompts (gsm8k train, the MBPP non-test subset, self-instruct's seed tasks).
TRAIN_DIR = os.path.join(DATA_DIR, "train")
# The committed answers of `python -m train.distill` for Gemma 3 270M.
DISTILL_DIR = os.path.join(DATA_DIR, "distill", "gemma3_270m")


def resolve(path: str) -> str:
  """A relative path names a file under the repository root when one is there (configs write them so), else it
  is taken from the working directory as usual."""
  if not path or os.path.isabs(path):
    return path
  in_repo = os.path.join(REPO_ROOT, path)
  return in_repo if os.path.exists(in_repo) else path


def json_record(line, path: str, n: int) -> dict:
  """One jsonl line (str or bytes) -> its JSON object; anything else is an error naming the path and line."""
  try:
    rec = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
  if not isinstance(rec, dict):
    raise ValueError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
  return rec


def read_jsonl(path: str) -> list[tuple[str, dict]]:
  """-> [(\"path:line\", record)] of every non-blank line. A missing or empty file, or a line that is not a JSON
  object, is an error that names the path (and line)."""
  path = resolve(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file not found: {path}")
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      out.append((f"{path}:{n}", json_record(line, path, n)))
  if not out:
    raise ValueError(f"data file is empty: {path}")
  return out


def jsonl_files(directory: str) -> list[str]:
  """The .jsonl files of a data folder, sorted; a missing folder or one without any is an error naming it."""
  directory = resolve(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"data folder not found: {directory}")
  files = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".jsonl"))
  if not files:
    raise FileNotFoundError(f"no .jsonl files in the data folder {directory}")
  return files
