"""The model against itself: cached decoding in chunks equals one full forward without a cache."""

import re

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


@pytest.mark.parametrize("make_config", [tiny_gemma_config, lambda: tiny_llama_config(qkv_bias=True)])
def test_cache_free_forward_equals_cached_forward(make_config):
  """forward(cache=None), training's whole-sequence forward, is the cached forward without a cache."""
  config = make_config()
  params = init_params(config, jax.random.PRNGKey(5))
  toks = jnp.asarray(np.random.default_rng(5).integers(3, config.vocab_size, (2, 20)))  # 20 > the 8-token window
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  want = forward(params, toks, pos, KVCache.init(config, 2, 24), config=config, return_layers=(0, 2))
  got = forward(params, toks, cache=None, config=config, return_layers=(0, 2))
  assert got[2] is None
  for g, w in zip(got[:2] + got[3:], want[:2] + want[3:]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


def _ynn_dots_of_broadcasts(hlo: str) -> list:
  """Fused computations that XLA:CPU hands to YNNPACK (`__ynn_fusion`) in which a dot reads a broadcast."""
  bodies = dict(re.findall(r"^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M))
  bad = []
  for name in re.findall(r"calls=(%[\w.\-]+)[^\n]*__ynn_fusion", hlo):
    body = bodies.get(name, "")
    bcasts = re.findall(r"(%[\w.\-]+) = \S+ broadcast\(", body)
    dots = [line.split(" dot(", 1)[1] for line in body.splitlines() if " dot(" in line]
    bad += [name for d in dots if any(re.search(re.escape(b) + r"[,)]", d) for b in bcasts)]
  return bad


def test_gradients_through_a_fresh_cache_are_finite():
  """The case that gave NaN gradients (distilling a draft through the cached forward, B = 8, T = 192): a cache
  made inside the jitted function. XLA:CPU then fused the backward's dot with the zero cache's broadcast into
  a YNNPACK fusion that reads garbage (see reference.attention_xla_split); B = 8, T = 128 makes it fuse so on
  jaxlib 0.10. The garbage is whatever memory holds (NaN only in some runs), so the compiled program is checked
  for that fusion, and the gradients against the cache-free forward's."""
  config = tiny_gemma_config(num_layers=2, d_model=16, num_heads=4, head_dim=16, mlp_dim=16)
  params = init_params(config, jax.random.PRNGKey(6))
  B, T = 8, 128
  toks = jnp.asarray(np.random.default_rng(6).integers(3, config.vocab_size, (B, T)))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))

  def loss(p, cached):
    cache = KVCache.init(config, B, T) if cached else None
    _, hidden, _ = forward(p, toks, pos, cache, config=config, compute_logits=False)
    return jnp.mean(hidden ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  assert _ynn_dots_of_broadcasts(grad.lower(params, True).compile().as_text()) == []
  got, want = grad(params, True), grad(params, False)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-4)
