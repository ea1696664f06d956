"""Training losses: EAGLE's training-time test sees exactly what the decode loop's draft chain sees, and the
target's features (the model's cache-free forward) equal its cached forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache
from spec_jax.models.transformer import init_params
from spec_jax.proposers import eagle
from tests.conftest import tiny_gemma_config
from train import losses

CONFIG = tiny_gemma_config()


def _setup(seed=0, B=2, T=12):
  target = init_params(CONFIG, jax.random.PRNGKey(seed))
  ecfg = eagle.layer_config(CONFIG, 48)
  w = eagle.init_params(jax.random.PRNGKey(seed + 1), ecfg, target_params=target)
  # Perturb the FC so that features and tokens both matter.
  w = dict(w, fc=w["fc"] + 0.3 * jax.random.normal(jax.random.PRNGKey(seed + 2), w["fc"].shape))
  params = dict(w, embed=target["embed"])
  rng = np.random.default_rng(seed)
  feats = jnp.asarray(rng.normal(size=(B, T, CONFIG.d_model)), jnp.float32)
  toks = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (B, T)), jnp.int32)
  return ecfg, params, feats, toks


def test_pass_zero_is_the_layer_over_the_sequence():
  ecfg, params, feats, toks = _setup()
  B, T, _ = feats.shape
  (p0,) = losses.eagle_unrolled(params, ecfg, feats, toks, 1)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  ref, _ = eagle.eagle_forward(params, ecfg, feats, toks, pos, KVCache.init(ecfg, B, T))
  np.testing.assert_allclose(np.asarray(p0), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("s,j", [(5, 1), (7, 2), (11, 3), (3, 3)])
def test_pass_j_equals_the_draft_chain(s, j):
  """Pass j at position s == verify-time cache of positions <= s-j, then j chained draft steps fed with the
  layer's own predicted features (and the sequence's tokens)."""
  ecfg, params, feats, toks = _setup(seed=s + j)
  B, T, _ = feats.shape
  preds = losses.eagle_unrolled(params, ecfg, feats, toks, j + 1)
  n = s - j + 1  # verified pairs 0 .. s-j
  cache = KVCache.init(ecfg, B, T)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
  out, cache = eagle.eagle_forward(params, ecfg, feats[:, :n], toks[:, :n], pos, cache)
  cache = cache.replace(lengths=cache.lengths + n)
  feat = out[:, -1]
  for i in range(1, j + 1):
    p = s - j + i
    out, cache = eagle.eagle_forward(params, ecfg, feat[:, None], toks[:, p:p + 1], jnp.full((B, 1), p, jnp.int32),
                                     cache)
    cache = cache.replace(lengths=cache.lengths + 1)
    feat = out[:, 0]
  np.testing.assert_allclose(np.asarray(preds[j][:, s]), np.asarray(feat), atol=1e-5)
  # And not what pass j-1 predicts there (the passes differ).
  assert not np.allclose(np.asarray(preds[j - 1][:, s]), np.asarray(feat), atol=1e-3)


def test_loss_reports_every_pass():
  ecfg, params, feats, toks = _setup()
  weights = {k: v for k, v in params.items() if k != "embed"}
  rows = params["embed"]
  frozen = {"embed": params["embed"], "rows": rows}
  mask = jnp.ones(toks.shape, bool)
  loss, m = losses.eagle_loss(weights, frozen, feats, toks, mask, cfg=ecfg, passes=3)
  assert {"top1_h0", "top1_h1", "top1_h2", "kl_h2"} <= set(m)
  loss1, _ = losses.eagle_loss(weights, frozen, feats, toks, mask, cfg=ecfg, passes=1)
  assert np.isfinite(float(loss)) and float(loss) != float(loss1)


@pytest.mark.parametrize("window", [None, 5])
def test_target_features_are_the_cached_forward(window):
  """Training's features come from forward(cache=None); they equal the cached forward's hidden states."""
  from spec_jax.models.transformer import forward
  cfg = tiny_gemma_config(sliding_window=window)  # T = 12 > window: the local layers' window matters
  params = init_params(cfg, jax.random.PRNGKey(4))
  toks = jnp.asarray(np.random.default_rng(4).integers(3, cfg.vocab_size, (2, 12)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  _, want, _ = forward(params, toks, pos, KVCache.init(cfg, 2, 12), config=cfg, compute_logits=False)
  got = losses.target_features(params, cfg, toks)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
