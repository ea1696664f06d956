"""train.distill on a tiny random Qwen2 (real byte-level BPE tokenizer and chat template) over the real training
prompts: shards and manifest, answers equal to plain decoding, skipped long prompts, resume, and bad shards."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from spec_jax.checkpoints.load import load_model
from spec_jax.config import SamplingParams
from spec_jax.batch import generate
from tests.checkpoints.tiny_qwen2 import write_tiny_qwen2
from train import distill, distill_shards

KW = dict(max_new_tokens=12, max_prompt_tokens=200, shard_size=16, seed=0, limit=40, steps_per_sync=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path, _ = write_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny-qwen2.gguf")
  return load_model(path, "float32")


def test_distill_writes_shards_that_match_plain_decoding(tiny, tmp_path):
  config, params, tok = tiny
  out = str(tmp_path / "d")
  manifest = distill.distill(params, config, tok, out=out, batch=3, log=lambda s: None, **KW)
  assert sorted(manifest["shards"]) == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
  recs = distill_shards.load_shards(out)
  items = distill.prompts_in_order(tok, 0, KW["limit"])
  encoded = {pos: tok.encode(tok.apply_chat_template([text])) for pos, _, text in items}
  kept = [pos for pos, ids in encoded.items() if len(ids) <= KW["max_prompt_tokens"]]
  assert 0 < len(kept) < KW["limit"]  # some prompts are over the limit and skipped
  assert [r["position"] for r in recs] == kept
  assert manifest["totals"]["prompts"] == len(kept)
  assert manifest["totals"]["answer_tokens"] == sum(len(r["ids"]) - r["prompt_len"] for r in recs)
  with open(os.path.join(out, "manifest.json")) as f:
    assert json.load(f) == manifest
  for r in recs:
    assert r["ids"][:r["prompt_len"]].tolist() == encoded[r["position"]]
    assert r["temperature"] == distill.temperature_at(r["position"])
    assert r["example"] == [ex for pos, ex, _ in items if pos == r["position"]][0]
  # Greedy answers are the target's own: plain batched decoding of the same prompts gives the same tokens.
  greedy = [r for r in recs if r["temperature"] == 0.0]
  assert greedy and any(r["temperature"] > 0 for r in recs)
  ref = generate(params, config, [encoded[r["position"]] for r in greedy], max_new_tokens=KW["max_new_tokens"],
                 sampling=SamplingParams.make(len(greedy)), stop_ids=tok.stop_ids)
  for r, want in zip(greedy, ref.token_ids):
    assert r["ids"][r["prompt_len"]:].tolist() == want
    assert r["finish"] == int(bool(want) and want[-1] in tok.stop_ids)


def test_distill_resumes_and_rejects_bad_shards(tiny, tmp_path):
  config, params, tok = tiny
  out = str(tmp_path / "d")
  first = distill.distill(params, config, tok, out=out, batch=3, log=lambda s: None, **KW)
  before = {n: e["sha256"] for n, e in first["shards"].items()}
  recs = {r["position"]: r for r in distill_shards.load_shards(out)}
  # A lost shard is answered again, and only that one: the same greedy answers (same batch size), other samples
  # for the sampled ones (the loop's key is shared by the batch).
  os.remove(os.path.join(out, "shard-00001.npz"))
  again = distill.distill(params, config, tok, out=out, batch=3, log=lambda s: None, **KW)
  assert {n: e["sha256"] for n, e in again["shards"].items() if n != "shard-00001.npz"} == \
      {n: s for n, s in before.items() if n != "shard-00001.npz"}
  redone = {r["position"]: r for r in distill_shards.load_shards(out)}
  assert redone.keys() == recs.keys()
  for pos, r in redone.items():
    if r["temperature"] == 0.0 or pos < 16 or pos >= 32:
      assert r["ids"].tolist() == recs[pos]["ids"].tolist()
  n1 = first["shards"]["shard-00001.npz"]["prompts"]
  assert again["runs"][-1]["answers"] == n1 < first["runs"][-1]["answers"]
  # A damaged shard is never read.
  path = os.path.join(out, "shard-00000.npz")
  with open(path, "r+b") as f:
    f.seek(40)
    f.write(b"\x00\x01\x02\x03")
  with pytest.raises(ValueError, match="checksum"):
    distill_shards.load_shards(out)
  # Other settings in the same directory are refused.
  with pytest.raises(ValueError, match="other settings"):
    distill.distill(params, config, tok, out=out, batch=3, log=lambda s: None, **dict(KW, max_new_tokens=8))
  with pytest.raises(FileNotFoundError, match="train.distill"):
    distill_shards.load_shards(str(tmp_path / "empty"))


def test_coverage_curve_against_a_count():
  from benchmarks.probes.vocab_coverage import coverage_curve
  rng = np.random.default_rng(0)
  train = rng.zipf(1.5, 5000) % 50
  test = rng.zipf(1.5, 800) % 60  # ids 50..59 never occur in training
  cov = coverage_curve(train, test, [1, 5, 20, 50], 64)
  counts = np.bincount(train, minlength=64)
  for n in (1, 5, 20, 50):
    top = set(np.argsort(-counts, kind="stable")[:n].tolist())
    assert cov[n] == np.mean([t in top for t in test])
  assert cov[1] < cov[5] < cov[20] < 1.0
