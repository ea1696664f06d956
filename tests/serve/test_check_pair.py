"""serve.check_pair on the committed published-head fixtures (a tiny Llama 3 target and heads in each format): a
good pair passes the static check, each planted mismatch is reported (an error, or a warning that --strict makes
an error), the run commands refuse an incompatible pair at start-up, and the run part prints per-position
acceptance."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from serve import check_pair
from serve.jobs import setup as setup_lib
from spec_jax import pair_check
from spec_jax.checkpoints import safetensors_io
from spec_jax.spec_config import SpecConfig

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "published_heads")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """The fixture target under the name its heads' configs give the verifier."""
  d = tmp_path_factory.mktemp("models") / "tiny-llama-target"
  shutil.copytree(os.path.join(HERE, "target"), d)
  return str(d)


def _cfg(model, spec, **kw):
  c = dict(model=model, dtype="float32", quantize="none", attention_impl="xla", mesh="", temperature=0.0, top_k=0,
           top_p=1.0, max_new_tokens=8, seed=0, batch_size=1, strict=False, spec=spec, prompts=None, limit=2,
           check_temperatures=["0", "0.7"], cost_reps=1, progress=False)
  c.update(kw)
  return c


def _head(tmp_path, name, cfg_edit=None, tensors_edit=None):
  d = tmp_path / f"{name}_{len(os.listdir(tmp_path))}"
  shutil.copytree(os.path.join(HERE, name), d)
  if cfg_edit:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    cfg_edit(cfg)
    p.write_text(json.dumps(cfg))
  if tensors_edit:
    p = str(d / "model.safetensors")
    t = safetensors_io.read(p)
    tensors_edit(t)
    safetensors_io.write(p, t)
  return str(d)


def _static(target, method, head):
  t, tok, _ = setup_lib.load_target(_cfg(target, None))
  return pair_check.static_check(SpecConfig(method, 3, model=head), t.config, tok, target)


@pytest.mark.parametrize("method,name", [("eagle3", "eagle3"), ("eagle3", "speculators_eagle3"), ("eagle", "eagle1"),
                                         ("eagle", "speculators_eagle"), ("eagle", "speculators_eagle_ln"),
                                         ("medusa", "medusa")])
def test_a_good_pair_passes(target, method, name):
  findings = _static(target, method, os.path.join(HERE, name))
  assert pair_check.verdict(findings, strict=True) == "compatible", pair_check.format_findings(findings)
  checks = {f.check for f in findings if f.level == "pass"}
  assert {"format", "vocab", "hidden"} <= checks
  if name.startswith("speculators"):
    assert "verifier" in checks
  if name == "speculators_eagle3":
    assert {"layers", "d2t"} <= checks


def test_planted_mismatches_are_reported(target, tmp_path):
  def wide(c):
    c["target_hidden_size"] = 64

  def far(t):
    t["d2t"] = t["d2t"].copy()
    t["d2t"][5] = 400

  def other(c):
    c["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"

  def qwen(c):
    c["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]

  cases = [(wide, None, "hidden", "error", "width 64, the target's hidden size is 48"),
           (None, far, "d2t", "error", "d2t is out of range: draft id 5"),
           (other, None, "verifier", "warning", "names verifier 'meta-llama/Llama-3.1-8B-Instruct'"),
           (qwen, None, "verifier", "warning", "architecture \\['Qwen3ForCausalLM'\\] is not the target's")]
  import re
  for cfg_edit, t_edit, check, level, msg in cases:
    head = _head(tmp_path, "speculators_eagle3", cfg_edit, t_edit)
    findings = _static(target, "eagle3", head)
    hit = [f for f in findings if f.check == check and f.level == level and re.search(msg, f.message)]
    assert hit, pair_check.format_findings(findings)
    if level == "warning":
      assert pair_check.verdict(findings) == "compatible, with warnings"
      assert pair_check.verdict(findings, strict=True) == "incompatible"
    else:
      assert pair_check.verdict(findings) == "incompatible"
  # Medusa: another hidden size; EAGLE-1: a wider layer; a head of the wrong kind for the method.
  head = _head(tmp_path, "medusa", lambda c: c.update(hidden_size=64))
  assert any(f.check == "hidden" and f.level == "error" for f in _static(target, "medusa", head))
  head = _head(tmp_path, "eagle1", lambda c: c.update(hidden_size=64))
  assert any(f.check == "hidden" and f.level == "error" for f in _static(target, "eagle", head))
  assert pair_check.verdict(_static(target, "medusa", os.path.join(HERE, "eagle3"))) == "incompatible"
  with pytest.raises(FileNotFoundError, match="does not exist"):
    _static(target, "medusa", str(tmp_path / "nothing_here"))


def test_the_run_commands_refuse_an_incompatible_pair(target, tmp_path):
  """serve/jobs/setup.py load (the server's build_engine, serve.generate, serve.evaluate) runs the static check first."""
  def far(t):
    t["d2t"] = t["d2t"].copy()
    t["d2t"][7] = -20
  head = _head(tmp_path, "speculators_eagle3", None, far)
  with pytest.raises(ValueError, match="pair check.*d2t: .*d2t is out of range: draft id 7"):
    setup_lib.load(_cfg(target, SpecConfig("eagle3", 3, model=head)))
  head = _head(tmp_path, "speculators_eagle3", lambda c: c["speculators_config"]["verifier"].update(
      name_or_path="someone/another-model"))
  setup_lib.load(_cfg(target, SpecConfig("eagle3", 3, model=head)))  # a warning only
  with pytest.raises(ValueError, match="pair check, strict.*verifier: the head names verifier 'someone/another"):
    setup_lib.load(_cfg(target, SpecConfig("eagle3", 3, model=head), strict=True))


def test_the_run_part_prints_per_position_acceptance(target, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"id": "a", "prompt": "the sea and the sky"}\n{"id": "b", "prompt": "one two three"}\n'
                     '{"id": "c", "prompt": "never read: --limit=2"}\n')
  out = io.StringIO()
  report = check_pair.run(_cfg(target, SpecConfig("eagle3", 3, model=os.path.join(HERE, "speculators_eagle3")),
                               prompts=str(prompts)), out)
  text = out.getvalue()
  print(text)
  assert "acc by position" in text and "draft cost/token" in text and "tau" in text
  assert [r["temperature"] for r in report["runs"]] == [0.0, 0.7]
  for r in report["runs"]:
    assert r["prompts"] == 2 and len(r["per_position_acceptance"]) == 3 and r["tau"] >= 1.0
  c = report["cost"]
  assert c["propose_s"] > 0 and c["plain_step_s"] > 0 and c["draft_cost_per_token"] > 0
  assert report["static_verdict"] == "compatible"


def test_the_command_line_exits_1_on_an_incompatible_pair_under_strict(target, tmp_path):
  head = _head(tmp_path, "medusa", lambda c: c.update(base_model_name_or_path="lmsys/vicuna-7b-v1.3"))
  out = tmp_path / "r.json"
  cmd = [sys.executable, "-m", "serve.check_pair", f"--model={target}", "--dtype=float32", "--strict",
         f"--speculative_config={json.dumps({'method': 'medusa', 'model': head, 'num_speculative_tokens': 2})}",
         f"--json_out={out}"]
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 1, p.stdout + p.stderr
  assert "WARNING  verifier" in p.stdout and "static verdict: incompatible (strict)" in p.stdout
  report = json.loads(out.read_text())
  assert report["verdict"] == "incompatible" and report["strict"]


def test_an_8bit_cache_reports_tau_beside_auto(target, monkeypatch):
  """--kv_cache_dtype int8: each temperature runs the pair with the int8 cache and with `auto` (the real runner,
  recorded on the way), and the rows and the table put the two taus side by side (the run part alone: the cost
  timing is the same with any cache)."""
  calls, real = [], check_pair.run_arms

  def recorded(*a, **kw):
    out = real(*a, **kw)
    calls.append((kw["kv_cache_dtype"], out[0].summary["mean_acceptance_length"]))
    return out

  monkeypatch.setattr(check_pair, "run_arms", recorded)
  cfg = _cfg(target, SpecConfig("eagle3", 3, model=os.path.join(HERE, "speculators_eagle3")), kv_cache_dtype="int8",
             max_new_tokens=6)
  setup = setup_lib.load(cfg)
  prompts, ids, _ = check_pair.sample_prompts(None, setup.tokenizer, 1, 64)
  (row,) = check_pair.run_pair(cfg, setup, prompts, ids, [0.0])
  assert [c[0] for c in calls] == ["int8", "auto"]
  assert row["kv_cache_dtype"] == "int8" and (row["tau"], row["tau_auto"]) == (calls[0][1], calls[1][1])
  assert row["tau_change"] == pytest.approx(row["tau"] / row["tau_auto"] - 1)
  table = check_pair.verdict_table([row], None)
  assert "tau auto" in table and f"{row['tau_change']:+.1%}" in table
