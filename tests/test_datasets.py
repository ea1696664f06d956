"""The data the project reads ships inside it (data/), is found from anywhere, and nothing reads outside the tree.

`make test-standalone` runs this file (with the distillation, trainer-data and traffic tests) from a copy of the
working tree in an empty folder, where nothing outside the copy exists to be read."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from spec_jax import datasets
from tests.conftest import ROOT


def test_the_code_under_test_is_this_tree():
  # A copy of the repository must run its own code, not an installed one beside it.
  assert datasets.REPO_ROOT == ROOT


def test_shipped_files_match_their_recorded_sha256():
  with open(os.path.join(datasets.DATA_DIR, "README.md"), encoding="utf-8") as f:
    rows = re.findall(r"^\| `([^`]+\.jsonl)` \|.*\| ([0-9a-f]{64}) \|$", f.read(), flags=re.M)
  assert len(rows) == 5
  for rel, digest in rows:
    with open(os.path.join(datasets.DATA_DIR, rel), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == digest, rel
  for lic in ("specbench/LICENSE-Apache-2.0.txt", "train/LICENSE-gsm8k-MIT.txt", "train/LICENSE-mbpp-CC-BY-4.0.txt",
              "train/LICENSE-self-instruct-Apache-2.0.txt"):
    assert os.path.getsize(os.path.join(datasets.DATA_DIR, lic)) > 1000, lic


def _reads_during(fn):
  """Run fn in a fresh interpreter with an audit hook; -> the files and folders it opened or listed."""
  code = f"""
import json, os, sys
seen = []
def hook(event, args):
  if event in ("open", "os.listdir", "os.scandir") and args and args[0] is not None and not isinstance(args[0], int):
    seen.append(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
{fn}
print("READS=" + json.dumps(seen))
"""
  out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.rsplit("READS=", 1)[1])


def test_default_data_is_found_from_any_directory_and_only_inside_the_repository():
  # From cwd "/": the defaults of train.data, train.distill, serve.loadtest's config and the prompt loaders.
  reads = _reads_during("""
from train import data, distill, distill_shards, examples as examples_lib
from serve.loadtest import traffic
from serve.jobs import prompts
from configs import loadtest
from spec_jax.datasets import SPEC_BENCH
n = len(examples_lib.load_examples())
assert n == 7473 + 474 + 175, n
assert len(traffic.load_prompts(loadtest.get_config().prompts)) == 480
class Tok:
  def apply_chat_template(self, turns): return turns[0]
assert len(prompts.load_prompts(SPEC_BENCH, Tok())) == 480
assert len(distill.prompts_in_order(None, 0, limit=5)) == 5
recs = distill_shards.load_shards(distill.DEFAULT_OUT)
assert len(recs) > 1000
""")
  data_reads = [p for p in reads if p.endswith((".jsonl", ".npz", "manifest.json")) or "/data/" in p]
  assert any(p.endswith("spec_bench_question.jsonl") for p in data_reads)
  assert any(p.endswith("gsm8k_train.jsonl") for p in data_reads)
  outside = [p for p in data_reads if not p.startswith(ROOT + os.sep)]
  assert not outside, outside


def test_no_source_names_a_path_outside_the_repository():
  # The old layout read ../shared/data beside the checkout; no code or usage line may point out of the tree.
  files = []
  for top, dirs, names in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
    files += [os.path.relpath(os.path.join(top, n), ROOT) for n in names]
  pattern = re.compile(r"""\.\./shared|["']shared["']\s*,\s*["']data["']""")
  hits = []
  for rel in files:
    if not rel.endswith((".py", ".md", ".sh", "Makefile", ".toml")) or rel.startswith("benchmarks/reports/") \
        or rel == "tests/test_datasets.py":
      continue
    path = os.path.join(ROOT, rel)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      for n, line in enumerate(f, 1):
        if pattern.search(line):
          hits.append(f"{rel}:{n}: {line.strip()}")
  assert not hits, "\n".join(hits)


def test_missing_or_empty_data_is_a_clear_error_naming_the_path(tmp_path):
  from train import examples as examples_lib
  missing = tmp_path / "nowhere"
  with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
    examples_lib.load_examples(str(missing))
  empty_dir = tmp_path / "empty"
  empty_dir.mkdir()
  with pytest.raises(FileNotFoundError, match="no .jsonl files.*" + re.escape(str(empty_dir))):
    examples_lib.load_examples(str(empty_dir))
  (empty_dir / "a.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match="empty.*" + re.escape(str(empty_dir / "a.jsonl"))):
    examples_lib.load_examples(str(empty_dir))
  (empty_dir / "a.jsonl").write_text(json.dumps({"unrelated": 1}) + "\n")
  with pytest.raises(ValueError, match="no training examples in " + re.escape(str(empty_dir))):
    examples_lib.load_examples(str(empty_dir))
  (empty_dir / "a.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n{oops\n")
  with pytest.raises(ValueError, match=re.escape(str(empty_dir / "a.jsonl")) + ":2: not valid JSON"):
    examples_lib.load_examples(str(empty_dir))
  from serve.loadtest import traffic
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    traffic.load_prompts(str(tmp_path / "nope.jsonl"))


def test_relative_paths_resolve_from_the_repository_first(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert datasets.resolve("data/specbench/spec_bench_question.jsonl") == datasets.SPEC_BENCH
  (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
  assert datasets.resolve("mine.jsonl") == "mine.jsonl"  # not in the repository: the working directory's
  assert len(datasets.read_jsonl("mine.jsonl")) == 1
