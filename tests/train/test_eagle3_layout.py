"""EAGLE heads trained in the published EAGLE-3 layout (head_layout="eagle3"): training runs the forward drafting
runs, the export to eagle3 and speculators is an exact write, and the head loaded back from either drafts the same
tokens with the same acceptance (tau) as the trained checkpoint; greedy decoding with it is plain decoding."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.train_tiny_test import get_config
from spec_jax.batch import generate
from spec_jax.cache import KVCache
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.checkpoints import published
from spec_jax.proposers import eagle
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from train import data as data_lib
from train import export, losses
from train.main import build_task, load_target
from train.trainer import Trainer, TrainSpec

LAYERS = (0, 1)  # the tiny target's two layers, fused


def _cfg():
  cfg = get_config("eagle")
  cfg.head_layout, cfg.feature_layers, cfg.reg_weight, cfg.ttt_passes = "eagle3", LAYERS, 0.0, 2
  return cfg


def _prompts(config, n, seed):
  rng = np.random.default_rng(seed)
  return [[config.bos_id] + rng.integers(3, config.vocab_size, 4 + i % 3).tolist() for i in range(n)]


def test_training_in_the_eagle3_layout_runs_the_drafting_forward():
  """The training loss's pass 0 (eagle_unrolled) equals the proposer's forward over the same pairs."""
  cfg = _cfg()
  config, params, _ = load_target(cfg)
  _, init, frozen, meta = build_task(cfg, config, params, None)
  assert meta["head_layout"] == "eagle3" and meta["feature_layers"] == list(LAYERS)
  stem_params = dict(init, embed=params["embed"], rows=frozen["rows"])
  toks = jnp.asarray([_prompts(config, 1, 5)[0] + [7, 9, 11]])
  feats = losses.target_features(params, config, toks, LAYERS)[..., config.d_model:]
  from spec_jax.proposers import eagle3_layout
  lcfg = eagle3_layout.layer_config(config, cfg.mlp_dim)
  pred = losses.eagle_unrolled(stem_params, lcfg, feats[:, :-1], toks[:, 1:], 1,
                              eagle.Published(eagle3_layout.LAYOUT))[0]
  T = toks.shape[1] - 1
  cache = KVCache.init(lcfg, 1, 16, jnp.float32)
  got, _ = eagle.eagle_forward(stem_params, lcfg, feats[:, :-1], toks[:, 1:], jnp.arange(T)[None], cache,
                               published=eagle.Published(eagle3_layout.LAYOUT))
  np.testing.assert_allclose(np.asarray(pred), np.asarray(got), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="reg_weight=0"):
    bad = _cfg()
    bad.reg_weight = 1.0
    build_task(bad, config, params, None)


def test_trained_head_exported_and_loaded_back_drafts_identical_tokens(tmp_path):
  cfg = _cfg()
  config, params, _ = load_target(cfg)
  plain_cfg = config.replace(eos_ids=())
  prompts = _prompts(config, 8, 0)
  out = generate(params, plain_cfg, prompts, max_new_tokens=19).token_ids
  toks, mask = data_lib.pack([p + o for p, o in zip(prompts, out)], 24)
  data = data_lib.Dataset(toks, mask, toks[:4], mask[:4])
  d2t = np.arange(3, 97, 2, dtype=np.int32)  # a reduced draft vocabulary: d2t offsets and a t2d mask
  task, init, frozen, meta = build_task(cfg, config, params, d2t)
  spec = TrainSpec(steps=40, batch_size=4, lr=1e-2, warmup=3, eval_every=40, save_every=40, log_every=5,
                   workdir=str(tmp_path / "w"), progress=False)
  trainer = Trainer(task, spec, log=lambda s: None)
  first = trainer.evaluate(trainer.init_state(init).params, frozen, data)
  trained, last = trainer.fit(init, frozen, data)
  assert last["loss"] < 0.8 * first["loss"], (first["loss"], last["loss"])
  stem = str(tmp_path / "head")
  head_ckpt.save_heads(stem, "eagle", jax.tree.map(np.asarray, trained), config, meta, d2t)

  target = Target(config, params)
  ours, ours_p = build_proposer(SpecConfig("eagle3", 3, model=stem), target)
  assert ours.published == eagle.Published("eagle3") and ours.feature_layers == LAYERS
  test_prompts = _prompts(config, 3, 11)
  ref = generate(params, plain_cfg, test_prompts, max_new_tokens=16)
  r1 = generate(params, plain_cfg, test_prompts, max_new_tokens=16, proposer=ours, proposer_params=ours_p,
                adaptive_k=False)
  assert r1.token_ids == ref.token_ids  # greedy with the head is plain decoding
  assert r1.stats["accepted_tokens"] > 0
  for fmt in ("eagle3", "speculators"):
    outdir = str(tmp_path / fmt)
    export.export(stem, fmt, outdir, config, params, None, target_name="tiny-train")
    assert published.detect(outdir) == fmt
    with open(os.path.join(outdir, "config.json")) as f:
      assert "spec_jax_target_fingerprint" in json.load(f)
    back, back_p = build_proposer(SpecConfig("eagle3", 3, model=outdir), target)
    assert back.feature_layers == LAYERS and back.published == ours.published
    # Every tensor the drafts read is the checkpoint's, as it is.
    np.testing.assert_array_equal(np.asarray(back_p["d2t"]), d2t)
    for a, b in zip(jax.tree.leaves({k: ours_p[k] for k in ("fuse", "layer", "out_norm", "rows")}),
                    jax.tree.leaves({k: back_p[k] for k in ("fuse", "layer", "out_norm", "rows")})):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    r2 = generate(params, plain_cfg, test_prompts, max_new_tokens=16, proposer=back, proposer_params=back_p,
                  adaptive_k=False)
    assert r2.token_ids == r1.token_ids
    for key in ("drafted_tokens", "accepted_tokens", "mean_acceptance_length", "per_position_acceptance"):
      assert r1.stats[key] == r2.stats[key], (fmt, key)
  # EAGLE-1/2's format has no place for the fused aux layers: refused by name, nothing written.
  with pytest.raises(export.ExportError, match="published EAGLE-3 layout"):
    export.export(stem, "eagle", str(tmp_path / "no"), config, params, None)
  assert not os.path.exists(tmp_path / "no")
