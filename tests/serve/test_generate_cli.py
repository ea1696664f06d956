"""serve.generate as a user runs it: a subprocess on the real model, and clear errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "serve.generate", "--progress=false", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag,match", [("--temperature=-1", "temperature"), ("--top_p=0", "top_p"),
                                        ("--top_p=1.5", "top_p"), ("--max_new_tokens=0", "max_new_tokens")])
def test_bad_sampling_flags(flag, match):
  r = _run(flag)
  assert r.returncode == 2
  assert match in r.stderr and "Traceback" not in r.stderr


def test_missing_model_file(tmp_path):
  r = _run(f"--model={tmp_path}/missing.gguf")
  assert r.returncode == 2 and "missing.gguf" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bad_prompt_line_and_too_long_prompt(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"question": "no"}) + "\n")
  r = _run(f"--prompts={bad}")
  assert r.returncode == 2 and "bad.jsonl:2" in r.stderr and "'prompt' or 'turns'" in r.stderr
  long = tmp_path / "long.jsonl"
  long.write_text(json.dumps({"id": "huge", "prompt": "word " * 40000}) + "\n")
  r = _run(f"--prompts={long}")
  assert r.returncode == 2 and "huge" in r.stderr and "context" in r.stderr
  empty = tmp_path / "empty.jsonl"
  empty.write_text(json.dumps({"id": "e", "prompt": ""}) + "\n")
  r = _run(f"--prompts={empty}")
  assert r.returncode == 2 and "'e'" in r.stderr and "empty" in r.stderr


@pytest.mark.slow
def test_compare_run_writes_records_and_summary(tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("\n".join(json.dumps(x) for x in [
      {"id": "copy", "category": "copy", "prompt": "a b c d e f g a b c d e f g a b c"},
      {"id": "chat", "category": "chat", "turns": ["Say hi."]}]) + "\n")
  out, summ = tmp_path / "out.jsonl", tmp_path / "s.json"
  r = _run(f"--prompts={prompts}", f"--output={out}", f"--summary_json={summ}", "--max_new_tokens=12",
           "--compare", "--method=ngram", "--dtype=float32", "--batch_size=2")
  assert r.returncode == 0, r.stderr[-3000:]
  recs = [json.loads(l) for l in out.read_text().splitlines()]
  assert [x["id"] for x in recs] == ["copy", "chat"]
  for x in recs:
    assert set(x) >= {"id", "prompt_token_ids", "token_ids", "text", "finish_reason", "time_s", "baseline_token_ids"}
    assert x["token_ids"] == x["baseline_token_ids"]  # float32 greedy: lossless
    assert x["prompt_token_ids"][0] == 2
  s = json.loads(summ.read_text())
  assert set(s) >= {"baseline", "speculative"}
  for k in ("output_tokens", "wall_s", "output_tokens_per_s"):
    assert k in s["baseline"] and k in s["speculative"]
  for k in ("mean_acceptance_length", "acceptance_rate", "per_position_acceptance"):
    assert k in s["speculative"]
  assert "speedup" in r.stdout
