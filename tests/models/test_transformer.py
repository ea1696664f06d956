"""The model against itself: cached decoding in chunks equals one full forward without a cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache
from spec_jax.models.transformer import forward, init_params, rope
from tests.conftest import tiny_gemma_config, tiny_llama_config


def _full_forward(params, config, tokens):
  B, T = tokens.shape
  cache = KVCache.init(config, B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  logits, _, _ = forward(params, tokens, pos, cache, config=config)
  return logits


@pytest.mark.parametrize("make_config", [tiny_gemma_config, lambda: tiny_llama_config(qkv_bias=True)])
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_cached_decoding_equals_full_forward(make_config, chunk):
  config = make_config()
  params = init_params(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  lengths = [23, 17]  # past the 8-token window; rows of different lengths
  B, S = len(lengths), 32
  seqs = [rng.integers(3, config.vocab_size, n) for n in lengths]
  full = [np.asarray(_full_forward(params, config, jnp.asarray(s)[None]))[0] for s in seqs]

  # Each row decodes its own sequence in chunks; rows advance in lock-step but have different lengths.
  cache = KVCache.init(config, B, S)
  prefix = [3, 6]  # different prompt lengths per row
  step_fn = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, config=config))
  got = [[None] * n for n in lengths]
  cur = list(prefix)
  # first chunk: each row's prefix, right-padded
  P = max(prefix)
  toks = np.zeros((B, P), np.int32)
  for b in range(B):
    toks[b, :prefix[b]] = seqs[b][:prefix[b]]
  logits, _, cache = step_fn(params, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(P), (B, P)), cache)
  for b in range(B):
    for t in range(prefix[b]):
      got[b][t] = np.asarray(logits[b, t])
  cache = cache.replace(lengths=jnp.asarray(prefix, jnp.int32))
  while min(c < n for c, n in zip(cur, lengths)) or any(c < n for c, n in zip(cur, lengths)):
    toks = np.zeros((B, chunk), np.int32)
    pos = np.zeros((B, chunk), np.int32)
    adv = []
    for b in range(B):
      n = min(chunk, lengths[b] - cur[b])
      toks[b, :n] = seqs[b][cur[b]:cur[b] + n]
      pos[b] = cur[b] + np.arange(chunk)
      adv.append(max(n, 0))
    logits, _, cache = step_fn(params, jnp.asarray(toks), jnp.asarray(pos), cache)
    for b in range(B):
      for t in range(adv[b]):
        got[b][cur[b] + t] = np.asarray(logits[b, t])
    cur = [c + a for c, a in zip(cur, adv)]
    cache = cache.advance(jnp.asarray(adv))
  for b in range(B):
    np.testing.assert_allclose(np.stack(got[b]), full[b], atol=2e-5, rtol=2e-5)


def test_window_changes_the_output():
  """Guards the test above: with a window the far past must not be visible (a no-op window would pass it)."""
  config = tiny_gemma_config()
  params = init_params(config, jax.random.PRNGKey(1))
  toks = jnp.asarray(np.random.default_rng(1).integers(3, 97, (1, 24)))
  a = _full_forward(params, config, toks)
  b = _full_forward(params, config.replace(sliding_window=10_000), toks)
  assert np.allclose(a[:, :8], b[:, :8], atol=1e-5)
  assert not np.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


def test_rope_preserves_norm_and_relative_position():
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 1, 16))
  y = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 1, 16))
  pos_a = jnp.array([[3, 7]])
  pos_b = jnp.array([[10, 14]])
  np.testing.assert_allclose(jnp.linalg.norm(rope(x, pos_a, 100.0), axis=-1), jnp.linalg.norm(x, axis=-1),
                             rtol=1e-5)
  dot = lambda p: jnp.sum(rope(x, p, 100.0)[0, 0] * rope(y, p, 100.0)[0, 1])
  np.testing.assert_allclose(dot(pos_a), dot(pos_b), rtol=1e-4)


def test_return_layers_and_bfloat16():
  config = tiny_gemma_config()
  params = init_params(config, jax.random.PRNGKey(2))
  toks = jnp.asarray([[5, 6, 7, 8]])
  pos = jnp.arange(4)[None]
  cache = KVCache.init(config, 1, 8)
  logits, hidden, _, layers = forward(params, toks, pos, cache, config=config, return_layers=(0, 3))
  assert layers.shape == (2, 1, 4, config.d_model)
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  l16, h16, c16 = forward(p16, toks, pos, KVCache.init(config, 1, 8, jnp.bfloat16), config=config)
  assert h16.dtype == jnp.bfloat16 and c16.k.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(l16), np.asarray(logits), atol=0.15)


def test_bfloat16_head_with_float32_layers():
  """The CPU bfloat16 layout (checkpoints.load.cpu_layout): bf16 embedding/head, f32 layers and activations."""
  from spec_jax.checkpoints.load import cpu_layout
  config = tiny_gemma_config()
  params = init_params(config, jax.random.PRNGKey(3))
  p16 = cpu_layout(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  assert p16["embed"].dtype == jnp.bfloat16 and p16["layers"]["q"].dtype == jnp.float32
  toks, pos = jnp.asarray([[5, 6, 7, 8]]), jnp.arange(4)[None]
  want, _, _ = forward(params, toks, pos, KVCache.init(config, 1, 8), config=config)
  got, hidden, cache = forward(p16, toks, pos, KVCache.init(config, 1, 8), config=config)
  assert hidden.dtype == jnp.float32 and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.15)
