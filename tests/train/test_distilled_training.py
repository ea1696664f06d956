"""Training on train.distill's shards: the data pipeline reads them (and refuses another target's), one feature
cache serves every kind (a column prefix of EAGLE-3's [final; layers]), and a bfloat16 cache stores exactly the
rounded float32 features in half the bytes."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from configs.train_tiny_test import get_config
from train import data as data_lib
from train import distill, distill_shards
from train.main import build_task, load_target
from train.trainer import Trainer, TrainSpec


def _examples(tmp_path, n):
  d = tmp_path / "train"
  d.mkdir()
  with open(d / "gsm8k_train.jsonl", "w") as f:
    for i in range(n):
      f.write(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n")
  return str(d)


def _distill_dir(tmp_path, target_name, positions, shard_size=4):
  out = str(tmp_path / "distill")
  os.makedirs(out)
  manifest = {"settings": distill.settings("", "float32", 8, 16, shard_size, 0, target_name), "shards": {},
              "runs": []}
  by_shard = {}
  for pos in positions:
    ids = [2, 10 + pos, 11 + pos] + [50 + pos] * (1 + pos % 3)  # prompt (3 ids) + an answer of 1-3 ids
    by_shard.setdefault(pos // shard_size, []).append(dict(position=pos, example=pos, temperature=0.0, finish=0,
                                                           prompt_len=3, ids=ids))
  for s, recs in by_shard.items():
    name = f"shard-{s:05d}.npz"
    manifest["shards"][name] = distill_shards.write_shard(out, name, recs)
  distill_shards.write_manifest(out, manifest)
  return out


def test_build_reads_distilled_answers_then_transcripts_after_them(tmp_path):
  n = data_lib.HELD_OUT + 20
  data_dir = _examples(tmp_path, n)
  out = _distill_dir(tmp_path, "t", range(8))
  spec = data_lib.DataSpec(num_prompts=0, num_transcripts=5, num_text=0, seq_len=16, eval_fraction=0.1,
                           distill_dir=out)
  enc = lambda t: [2] + [ord(c) for c in "|".join(t)]
  kw = dict(target_name="t", encode_prompt=enc, encode_text=enc, cache_dir=str(tmp_path / "c"), texts=[],
            data_dir=data_dir, log=lambda s: None,
            generate_fn=lambda *a: pytest.fail("nothing is generated when distill_dir is set"))
  ds = data_lib.build(spec, **kw)
  rows = [r[m].tolist() for r, m in zip(np.concatenate([ds.tokens, ds.eval_tokens]),
                                         np.concatenate([ds.mask, ds.eval_mask]))]
  answers = sorted(r for r in rows if r[1] < 100)
  assert answers == sorted([2, 10 + p, 11 + p] + [50 + p] * (1 + p % 3) for p in range(8))
  # The transcripts are the examples at positions 8..12 of the seeded order, the first ones not distilled.
  order = data_lib.prompt_order(n, 0)
  want = sorted(enc((f"q{i}", f"a{i}")) for i in order[8:13])
  assert sorted(r for r in rows if r[1] >= 100) == want
  with pytest.raises(ValueError, match="num_prompts"):
    data_lib.build(dataclasses.replace(spec, num_prompts=4), **kw)
  with pytest.raises(ValueError, match="held out"):
    data_lib.build(dataclasses.replace(spec, num_transcripts=n - data_lib.HELD_OUT - 7), **kw)
  with pytest.raises(ValueError, match="not of the target"):
    data_lib.build(spec, **dict(kw, target_name="another"))
  with open(os.path.join(out, "shard-00001.npz"), "r+b") as f:  # a damaged shard is never read
    f.seek(40)
    f.write(b"\0\0\0\0")
  with pytest.raises(ValueError, match="checksum"):
    data_lib.build(spec, **kw)


def test_lazy_build_reads_only_the_answers_and_examples_of_the_rows_it_reads(tmp_path):
  """As a trainer host of many builds it: nothing read at build; a row read reads its answer (from the shards) or
  its transcript's example (from the jsonl line) and nothing else; each process checks its share of the shards."""
  n = data_lib.HELD_OUT + 20
  data_dir = _examples(tmp_path, n)
  out = _distill_dir(tmp_path, "t", range(8))  # 2 shards of 4
  spec = data_lib.DataSpec(num_prompts=0, num_transcripts=5, num_text=0, seq_len=16, eval_fraction=0.1,
                           distill_dir=out)
  enc = lambda t: [2] + [ord(c) for c in "|".join(t)]
  kw = dict(target_name="t", encode_prompt=enc, encode_text=enc, cache_dir=str(tmp_path / "c"), texts=[],
            data_dir=data_dir, log=lambda s: None, generate_fn=None, lazy=True)
  ds = data_lib.build(spec, **kw)
  assert ds.answers.read == set() and ds.examples.read == set() and len(ds.answers) == 8
  seqs = ds.tokens.order
  rows = [int(np.argmax(seqs < 8)), int(np.argmax(seqs >= 8))]  # an answer's row and a transcript's
  got = ds.tokens[rows]
  pos, example = int(seqs[rows[0]]), int(data_lib.prompt_order(n, 0)[8:13][seqs[rows[1]] - 8])
  answer, transcript = [2, 10 + pos, 11 + pos] + [50 + pos] * (1 + pos % 3), enc((f"q{example}", f"a{example}"))
  assert got[0][:len(answer)].tolist() == answer and got[1][:len(transcript)].tolist() == transcript
  assert ds.answers.read == {pos} and ds.examples.read == {example}
  manifest = distill_shards.read_manifest(out)
  manifest["shards"]["shard-00000.npz"]["sha256"] = "0" * 64
  distill_shards.write_manifest(out, manifest)
  with pytest.raises(ValueError, match="checksum"):
    data_lib.build(spec, **dict(kw, share=(0, 2)))
  data_lib.build(spec, **dict(kw, share=(1, 2)))  # process 1 of 2 checks shard 1 only: process 0 refuses shard 0


def _tiny(kind, **over):
  cfg = get_config(kind)
  with cfg.unlocked():
    for k, v in over.items():
      setattr(cfg, k, v)
  config, params, _ = load_target(cfg)
  return cfg, config, params


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
def test_every_kind_reads_its_columns_of_an_eagle3_cache(kind):
  """A run whose cache holds EAGLE-3's [final; layers 0, 1] computes the same loss as one caching only what
  it needs; a wrong slice (an EAGLE-1 head handed fused features) would change it."""
  d2t = np.arange(3, 97, dtype=np.int32)
  cfg, config, params = _tiny(kind)
  task, init, frozen, _ = build_task(cfg, config, params, d2t)
  cfg3, _, _ = _tiny(kind, cached_feature_layers=(0, 1))
  task3, init3, frozen3, _ = build_task(cfg3, config, params, d2t)
  toks = np.random.default_rng(0).integers(3, config.vocab_size, (2, 12)).astype(np.int32)
  mask = np.ones_like(toks, bool)
  f, f3 = task.features(frozen, toks), task3.features(frozen3, toks)
  assert f3.shape[-1] == 3 * f.shape[-1] and task3.features_id != task.features_id
  np.testing.assert_allclose(np.asarray(f3[..., :f.shape[-1]]), np.asarray(f), rtol=1e-5, atol=1e-5)
  key = jax.random.PRNGKey(0)
  loss, _ = task.loss(init, frozen, f, toks, mask, key)
  loss3, _ = task3.loss(init3, frozen3, f3, toks, mask, key)
  np.testing.assert_allclose(float(loss3), float(loss), rtol=1e-5)


def test_eagle3_layers_must_begin_the_cached_layers():
  cfg, config, params = _tiny("eagle", feature_layers=(0, 1), cached_feature_layers=(1, 0))
  with pytest.raises(ValueError, match="must begin"):
    build_task(cfg, config, params, None)


def test_bfloat16_cache_holds_the_rounded_features_in_half_the_bytes(tmp_path):
  cfg, config, params = _tiny("eagle")
  task, init, frozen, _ = build_task(cfg, config, params, None)
  toks = np.random.default_rng(1).integers(3, config.vocab_size, (6, 12)).astype(np.int32)
  paths = {}
  feats = {}
  for dtype in ("float32", "bfloat16"):
    fdir = tmp_path / dtype
    spec = TrainSpec(batch_size=4, workdir=str(tmp_path / f"w-{dtype}"), progress=False, cache_features=True,
                     feature_dir=str(fdir), feature_dtype=dtype)
    feats[dtype] = Trainer(task, spec, log=lambda s: None).precompute(frozen, toks)  # 6 rows: one padded batch
    (paths[dtype],) = [os.path.join(fdir, p) for p in os.listdir(fdir)]
    again = Trainer(task, spec, log=lambda s: None).precompute(frozen, toks)  # read back from disk
    assert again.dtype == feats[dtype].dtype and np.array_equal(np.asarray(again), np.asarray(feats[dtype]))
  want = np.asarray(task.features(frozen, toks[:4]))
  np.testing.assert_allclose(feats["float32"][:4], want, rtol=1e-6, atol=1e-6)
  assert feats["bfloat16"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(np.asarray(feats["bfloat16"], np.float32),
                                feats["float32"].astype(ml_dtypes.bfloat16).astype(np.float32))
  size = {k: os.path.getsize(p) for k, p in paths.items()}
  assert size["bfloat16"] < 0.52 * size["float32"], size
  with pytest.raises(ValueError, match="feature_dtype"):
    Trainer(task, TrainSpec(workdir=str(tmp_path / "x"), progress=False, feature_dtype="float16"),
            log=lambda s: None).precompute(frozen, toks)
