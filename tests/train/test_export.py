"""train.export: a head trained here, written in a published format and loaded back through the published loaders,
drafts the same tokens; heads a format cannot hold exactly are refused with the reason, nothing written."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import pair_check
from spec_jax.batch import generate
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.checkpoints import published
from spec_jax.checkpoints.load import load_model
from spec_jax.models.transformer import forward
from spec_jax.proposers import eagle, medusa
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from train import export

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TARGET = os.path.join(ROOT, "tests", "fixtures", "published_heads", "target")
HEADS = os.path.join(ROOT, "heads")


@functools.lru_cache(maxsize=None)
def _target():
  return load_model(TARGET, "float32")


def _medusa_head(tmp_path, name="m", d2t=None, k=3):
  config, _, _ = _target()
  w = medusa.init_params(jax.random.PRNGKey(3), config.d_model, k, scale=1.0)
  w["b"] = 0.1 * jax.random.normal(jax.random.PRNGKey(4), w["b"].shape)
  head_ckpt.save_heads(str(tmp_path / name), "medusa", w, config, {"num_heads": k}, d2t)
  return str(tmp_path / name)


def test_a_medusa_head_exported_and_loaded_back_drafts_identical_tokens(tmp_path):
  config, params, tok = _target()
  stem = _medusa_head(tmp_path)
  out = str(tmp_path / "exported")
  export.export(stem, "medusa", out, config, params, tok, target_name=TARGET)
  assert published.detect(out) == "medusa"
  target = Target(config, params)
  ours, ours_p = build_proposer(SpecConfig("medusa", 3, model=stem), target)
  back, back_p = build_proposer(SpecConfig("medusa", 3, model=out), target)
  assert back.num_heads == ours.num_heads == 3
  # The same draft logits on every position of a prompt's hidden states.
  prompt = jnp.asarray([tok.encode("the sea and the sky, one two three four")])
  _, hidden, _ = forward(params, prompt, config=config, compute_logits=False)
  a = np.asarray(medusa.project(medusa.head_features(ours_p["heads"], hidden[0]), ours_p["rows"]))
  b = np.asarray(medusa.project(medusa.head_features(back_p["heads"], hidden[0]), back_p["rows"]))
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  assert (a.argmax(-1) == b.argmax(-1)).all()
  # Decoding with each: the same tokens drafted and accepted, so the same tau.
  prompts = [tok.encode(t) for t in ("the sea and the sky", "one two three", "a b c d e f")]
  cfg = config.replace(eos_ids=())
  r1 = generate(params, cfg, prompts, max_new_tokens=12, proposer=ours, proposer_params=ours_p, adaptive_k=False)
  r2 = generate(params, cfg, prompts, max_new_tokens=12, proposer=back, proposer_params=back_p, adaptive_k=False)
  assert r1.token_ids == r2.token_ids and r1.stats["drafted_tokens"] > 0
  for key in ("drafted_tokens", "accepted_tokens", "mean_acceptance_length", "per_position_acceptance"):
    assert r1.stats[key] == r2.stats[key], key
  # The exported config names the verifier, its fingerprint and tokenizer digest: the pair check passes them.
  findings = pair_check.static_check(SpecConfig("medusa", 3, model=out), config, tok, TARGET)
  assert pair_check.verdict(findings, strict=True) == "compatible", pair_check.format_findings(findings)
  assert {(f.check, f.level) for f in findings} >= {("vocab", "pass"), ("verifier", "pass")}
  assert any("tokenizer digest" in f.message for f in findings)
  assert any("fingerprint" in f.message and f.level == "pass" for f in findings)
  # Our own checkpoint, named by its stem or a file of it, passes too.
  for name in (stem, stem + ".safetensors"):
    findings = pair_check.static_check(SpecConfig("medusa", 3, model=name), config, tok, TARGET)
    assert pair_check.verdict(findings) == "compatible", pair_check.format_findings(findings)


def test_heads_a_format_cannot_hold_are_refused(tmp_path):
  config, params, tok = _target()
  reduced = _medusa_head(tmp_path, "reduced", d2t=np.arange(0, 320, 2, dtype=np.int32))
  with pytest.raises(export.ExportError, match="reduced vocabulary of 160 ids"):
    export.export(reduced, "medusa", str(tmp_path / "x"), config, params, tok)
  full = _medusa_head(tmp_path, "full")
  with pytest.raises(export.ExportError, match="exports to --format=medusa only"):
    export.export(full, "eagle3", str(tmp_path / "x"), config, params, tok)
  ecfg = eagle.layer_config(config, 32)
  w = eagle.init_params(jax.random.PRNGKey(1), ecfg, num_feature_layers=3)
  head_ckpt.save_heads(str(tmp_path / "e3"), "eagle", w, config, {"mlp_dim": 32, "feature_layers": [1, 3, 5]})
  for fmt in ("eagle3", "speculators", "eagle"):
    with pytest.raises(export.ExportError, match=f"cannot be written as --format={fmt} exactly"):
      export.export(str(tmp_path / "e3"), fmt, str(tmp_path / "x"), config, params, tok)
  with pytest.raises(export.ExportError, match="--format=medusa holds Medusa heads"):
    export.export(str(tmp_path / "e3"), "medusa", str(tmp_path / "x"), config, params, tok)
  assert not os.path.exists(tmp_path / "x")  # nothing written
  # The shipped Gemma heads: reduced draft vocabularies and this project's EAGLE layer, so each is refused.
  # The EAGLE refusals name each part of our forward the format lacks (train/export.py's docstring).
  why = {"eagle": ["no FC weight absorbs it", "after its out_norm", "GeGLU MLP, QK norms", "8192 ids"],
         "eagle3": ["no q/k/v weight", "GeGLU MLP, QK norms"]}
  for name, fmt, parts in (("medusa", "medusa", ["8192 ids"]), ("eagle", "eagle", why["eagle"]),
                           ("eagle", "speculators", why["eagle"]), ("eagle", "eagle3", why["eagle3"]),
                           ("eagle3", "eagle3", why["eagle3"]), ("eagle3", "speculators", why["eagle3"]),
                           ("draft", "eagle", ["not a draft head"])):
    with open(os.path.join(HEADS, f"{name}_gemma3_270m.json")) as f:
      meta = json.load(f)
    with pytest.raises(export.ExportError) as e:
      export.check_exportable(meta, fmt, name)
    assert all(p in str(e.value) for p in parts), (name, fmt, str(e.value))


def test_the_command_line_writes_a_loadable_head(tmp_path):
  stem = _medusa_head(tmp_path)
  out = tmp_path / "cli"
  p = subprocess.run([sys.executable, "-m", "train.export", f"--heads={stem}", "--format=medusa", f"--output={out}",
                      f"--model={TARGET}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stdout + p.stderr
  assert sorted(os.listdir(out)) == ["config.json", "medusa_lm_head.safetensors"]
  p = subprocess.run([sys.executable, "-m", "train.export", f"--heads={stem}", "--format=eagle3",
                      f"--output={tmp_path / 'no'}", f"--model={TARGET}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 2 and "exports to --format=medusa only" in p.stderr
  assert not os.path.exists(tmp_path / "no")
