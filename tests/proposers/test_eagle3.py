"""EAGLE-3 fused features: the loop hands the head the target's feature layers, the head fuses them as a hand
computation says, decoding stays lossless (chains and trees), the trainer trains and exports such a head, and a
head of another feature layout is refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import slots
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.decode import decode_loop, make_spec
from spec_jax.batch import generate
from spec_jax.models.transformer import forward, init_params
from spec_jax.proposers import eagle
from spec_jax.proposers.registry import Target, build_proposer
from spec_jax.spec_config import SpecConfig
from spec_jax.proposers.tree_expand import DynamicTree
from tests.conftest import tiny_gemma_config

CONFIG = tiny_gemma_config(eos_ids=(1,))
LAYERS = (0, 1, 3)
D2T = jnp.asarray(np.arange(3, 97, 2), jnp.int32)


@functools.lru_cache(maxsize=None)
def _params(seed=0):
  return init_params(CONFIG, jax.random.PRNGKey(seed))


def _head(params, seed=4, d2t=None, k=3, tree=None):
  ecfg = eagle.layer_config(CONFIG, 48)
  w = eagle.init_params(jax.random.PRNGKey(seed), ecfg, target_params=params, num_feature_layers=len(LAYERS))
  # Not the identity-like init: every part of the fused input must matter.
  w = dict(w, fuse_norm=1.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1), w["fuse_norm"].shape),
           fuse=jax.random.normal(jax.random.PRNGKey(seed + 2), w["fuse"].shape) / np.sqrt(w["fuse"].shape[0]))
  prop = eagle.EagleProposer(config=ecfg, vocab_size=CONFIG.vocab_size, k=k, reduced=d2t is not None,
                             feature_layers=LAYERS, tree=tree)
  return prop, eagle.runtime_params(w, params, d2t), w


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    span = rng.integers(3, CONFIG.vocab_size, max(n // 2, 1)).tolist()
    out.append(([2] + span * 3)[:n])
  return out


def test_fused_feature_equals_a_hand_computation():
  params = _params()
  prop, pp, w = _head(params)
  tokens = jnp.asarray([_prompts(0, [9])[0]], jnp.int32)
  _, _, _, layers = forward(params, tokens, config=CONFIG, compute_logits=False, return_layers=LAYERS)
  # The loop's layout: the layers' outputs side by side.
  from spec_jax.rows import target_features
  feats = np.asarray(target_features(None, layers))
  D = CONFIG.d_model
  for i in range(len(LAYERS)):
    np.testing.assert_array_equal(feats[..., i * D:(i + 1) * D], np.asarray(layers[i]))
  # Fusion by hand, in numpy: RMS-norm each part with its own weight, then the FC.
  want = 0.0
  for i in range(len(LAYERS)):
    x = np.asarray(layers[i], np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * np.asarray(w["fuse_norm"][i])
    want = want + x @ np.asarray(w["fuse"][i * D:(i + 1) * D], np.float64)
  got = eagle.fuse_features(pp, prop.config, jnp.asarray(feats))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_the_loop_hands_the_head_the_feature_layers_of_the_last_fed_token():
  """After prefill and after each step, state.last_hidden is the feature layers' outputs at the position that
  predicted the last committed token, as a cache-free forward over the committed tokens computes them."""
  params = _params(1)
  prop, pp, _ = _head(params, d2t=D2T)
  spec = make_spec(CONFIG, prop, adaptive_k=False)
  full = {"target": params, "proposer": pp}
  state = slots.empty_state(full, spec, batch=2, capacity=64)
  for slot, p in enumerate(_prompts(1, [7, 12])):
    state = slots.insert(full, state, np.int32(slot), slots.make_request(p, max_new=20, spec=spec, capacity=64),
                         spec)
  for _ in range(4):
    toks = np.asarray(state.tokens)
    lens = np.asarray(state.lengths)
    for b in range(2):
      seq = jnp.asarray(toks[b:b + 1, :lens[b]])
      _, _, _, layers = forward(params, seq, config=CONFIG, compute_logits=False, return_layers=LAYERS)
      want = np.concatenate([np.asarray(layers[i, 0, lens[b] - 2]) for i in range(len(LAYERS))])
      np.testing.assert_allclose(np.asarray(state.last_hidden[b]), want, rtol=1e-4, atol=1e-4)
    state = decode_loop(full, state, spec, np.int32(1))


@pytest.mark.parametrize("tree", [None, DynamicTree(topk=2, depth=3, nodes=7)])
def test_greedy_is_lossless_with_a_random_eagle3_head(tree):
  params = _params()
  prompts = _prompts(0, [5, 13, 3])  # batch > 1, rows of different lengths
  base = generate(params, CONFIG, prompts, max_new_tokens=16)
  prop, pp, _ = _head(params, d2t=D2T, tree=tree)
  adaptive = tree is None  # chains: adaptive k (k = 0 steps keep the head's cache in step); trees: fixed
  res = generate(params, CONFIG, prompts, max_new_tokens=16, proposer=prop, proposer_params=pp,
                 adaptive_k=adaptive, costs=[1.0, 1.01, 1.02] if adaptive else None)
  assert res.token_ids == base.token_ids
  assert res.stats["drafted_tokens"] > 0


def test_trained_eagle3_head_exports_loads_and_other_layouts_are_refused(tmp_path):
  from configs.train_tiny_test import get_config
  from train import losses
  from train.main import build_task, load_target
  from train.trainer import Trainer, TrainSpec
  cfg = get_config("eagle")
  cfg.feature_layers = (0, 1)
  config, params, _ = load_target(cfg)
  # The training features: the final hidden (the teacher), then the feature layers, side by side.
  toks = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (2, 10)), jnp.int32)
  f = losses.target_features(params, config, toks, (0, 1))
  _, hidden, _, layers = forward(params, toks, config=config, compute_logits=False, return_layers=(0, 1))
  D = config.d_model
  np.testing.assert_array_equal(np.asarray(f[..., :D]), np.asarray(hidden))
  np.testing.assert_array_equal(np.asarray(f[..., D:2 * D]), np.asarray(layers[0]))
  np.testing.assert_array_equal(np.asarray(f[..., 2 * D:]), np.asarray(layers[1]))
  task, init, frozen, meta = build_task(cfg, config, params, None)
  assert meta["feature_layers"] == [0, 1] and init["fuse"].shape == (2 * D, D)
  from train import data as data_lib
  from spec_jax.batch import generate as gen
  rng = np.random.default_rng(0)
  prompts = [[config.bos_id] + rng.integers(3, config.vocab_size, 4).tolist() for _ in range(8)]
  out = gen(params, config.replace(eos_ids=()), prompts, max_new_tokens=19).token_ids
  t, m = data_lib.pack([p + o for p, o in zip(prompts, out)], 24)
  data = data_lib.Dataset(t, m, t[:4], m[:4])
  spec = TrainSpec(steps=40, batch_size=4, lr=1e-2, warmup=3, eval_every=40, save_every=40, log_every=5,
                   workdir=str(tmp_path / "w"), progress=False)
  trainer = Trainer(task, spec, log=lambda s: None)
  first = trainer.evaluate(trainer.init_state(init).params, frozen, data)
  final, last = trainer.fit(init, frozen, data)
  assert last["loss"] < 0.8 * first["loss"]
  final = jax.tree.map(np.asarray, final)
  head_ckpt.save_heads(str(tmp_path / "e3"), "eagle", final, config, dict(meta))
  prop, pp = build_proposer(SpecConfig("eagle", 3, model=str(tmp_path / "e3")), Target(config, params))
  assert prop.feature_layers == (0, 1)
  assert build_proposer(SpecConfig("eagle3", 3, model=str(tmp_path / "e3")), Target(config, params))[0] == prop
  prompts = [[config.bos_id] + rng.integers(3, config.vocab_size, 6).tolist() for _ in range(2)]
  assert generate(params, config, prompts, max_new_tokens=10, proposer=prop, proposer_params=pp).token_ids == \
      generate(params, config, prompts, max_new_tokens=10).token_ids
  # The same weights described as an EAGLE-1 head, an EAGLE-1 head described as EAGLE-3, and layers the target
  # does not have: clear errors, before any decoding.
  head_ckpt.save_heads(str(tmp_path / "as1"), "eagle", final, config, dict(meta, feature_layers=[]))
  with pytest.raises(ValueError, match="another feature layout"):
    build_proposer(SpecConfig("eagle", 3, model=str(tmp_path / "as1")), Target(config, params))
  plain = {k: v for k, v in final.items() if k not in ("fuse", "fuse_norm")}
  head_ckpt.save_heads(str(tmp_path / "as3"), "eagle", plain, config, dict(meta))
  with pytest.raises(ValueError, match="another feature layout"):
    build_proposer(SpecConfig("eagle", 3, model=str(tmp_path / "as3")), Target(config, params))
  head_ckpt.save_heads(str(tmp_path / "far"), "eagle", final, config, dict(meta, feature_layers=[0, 7]))
  with pytest.raises(ValueError, match="must be distinct target layers"):
    build_proposer(SpecConfig("eagle", 3, model=str(tmp_path / "far")), Target(config, params))
