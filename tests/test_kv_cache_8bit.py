"""The 8-bit KV cache (--kv_cache_dtype fp8 / fp8_e5m2 / int8, spec_jax/cache.py): real per-token scales that every
reader applies, a page filled over several calls equal to one written at once, and a forward over T tokens equal
to T one-token forwards (what keeps speculation exact on a quantized target)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.cache import KVCache, kv_storage_dtype
from spec_jax.decode import make_spec
from spec_jax.models.transformer import forward, init_params
from tests.conftest import tiny_gemma_config, tiny_llama_config
from tests.paged import shuffled_table

EIGHT_BIT = ("fp8", "fp8_e5m2", "int8")
# Worst error of one value relative to its vector's largest magnitude: half a step of the 8-bit grid at the top
# (int8: 0.5 / 127; e4m3: 3 mantissa bits; e5m2: 2).
TOL = {"int8": 0.5 / 127 + 1e-6, "fp8": 2.0 ** -4, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
GEMMA = tiny_gemma_config()


def test_unknown_kv_cache_dtype_is_refused():
  with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'"):
    KVCache.init(GEMMA, 1, 8, kv_dtype="fp4")
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    make_spec(GEMMA, kv_cache_dtype="float8")
  make_spec(GEMMA, kv_cache_dtype="int8", impl="pallas_gpu")  # the kernels read the scales (test_kv_cache_kernels)
  assert kv_storage_dtype("fp8") == kv_storage_dtype("fp8_e4m3") == jnp.float8_e4m3fn


def _paged(kv, batch=2, max_len=16, block_size=4, seed=0):
  table, n = shuffled_table(np.random.default_rng(seed), batch, max_len // block_size)
  return KVCache.init(GEMMA, batch, max_len, jnp.float32, block_size=block_size, num_pages=n, pages=table,
                      kv_dtype=kv)


def _write(cache, k, v, splits):
  """k, v [L, B, T, H, D] written in calls of `splits` tokens, each committed before the next."""
  at = 0
  for n in splits:
    cache = cache.write(k[:, :, at:at + n], v[:, :, at:at + n]).advance(jnp.full((k.shape[1],), n))
    at += n
  return cache


@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_large_magnitude_kv_reads_back_within_the_grid_and_pages_appended_equal_written_at_once(kv):
  """K/V of magnitude ~300 (int8's largest value is 127, e4m3's 448): every value read back lies within half a
  step of its vector's own grid, which a reader that took the scale as 1 (or a write that kept none) misses by
  hundreds; and a page filled over several calls (decode appending to a half-full page) holds bit for bit what one
  call writes, scales included (a token's scale is its own)."""
  L, B, T, H, D = GEMMA.num_layers, 2, 13, GEMMA.num_kv_heads, GEMMA.head_dim
  rng = np.random.default_rng(1)
  k = jnp.asarray(300 * rng.standard_normal((L, B, T, H, D)), jnp.float32)
  v = jnp.asarray(rng.uniform(-300, 300, (L, B, T, H, D)), jnp.float32).at[0, 0, 0].set(0.0)  # a zero vector too
  once = _write(_paged(kv), k, v, [T])
  for layer in range(L):
    for got, want in zip(once.layer_view(jnp.int32(layer)), (k[layer], v[layer])):
      want = jnp.swapaxes(want, 1, 2)  # [B, H, T, D]
      err = np.abs(np.asarray(got[:, :, :T]) - np.asarray(want))
      amax = np.max(np.abs(np.asarray(want)), axis=-1, keepdims=True)
      assert np.all(err <= TOL[kv] * amax + 1e-6), (kv, layer, float(np.max(err / np.maximum(amax, 1e-9))))
      assert np.all(np.asarray(got[:, :, T:]) == 0)  # past each length: zero
  assert once.k.dtype == kv_storage_dtype(kv) and once.k_scale.dtype == jnp.float32
  # the scales are real: each vector's largest magnitude sits at the grid's top (127, 448, 57344), not at ~300
  qmax = float(jnp.max(jnp.abs(once.k.astype(jnp.float32))))
  assert qmax == float(jnp.iinfo(jnp.int8).max if kv == "int8" else jnp.finfo(kv_storage_dtype(kv)).max)
  appended = _write(_paged(kv), k, v, [3, 1, 2, 4, 1, 2])
  for a, b in zip(once.pools(), appended.pools()):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_page_bytes_count_the_8_bit_pages_and_their_scales():
  auto, q = _paged("auto"), _paged("int8")
  D = GEMMA.head_dim
  assert q.page_bytes() == auto.page_bytes() // 4 + auto.page_bytes() // D  # f32 -> 1 byte, + 4 bytes per D values
  bf16 = KVCache.init(GEMMA, 2, 16, jnp.bfloat16, block_size=4)
  assert bf16.page_bytes() / q.page_bytes() == pytest.approx(2 / (1 + 4 / D))


@functools.partial(jax.jit, static_argnames=("config",))
def _fwd(params, tokens, positions, cache, config):
  logits, _, cache = forward(params, tokens, positions, cache, config=config)
  return logits, cache.advance(jnp.full((tokens.shape[0],), tokens.shape[1]))


def _chunked(params, config, tokens, cache, splits):
  """Logits [B, T, V] of `tokens` fed in chunks of `splits` tokens, and the cache after."""
  out, at = [], 0
  for n in splits:
    pos = jnp.broadcast_to(jnp.arange(at, at + n, dtype=jnp.int32), (tokens.shape[0], n))
    logits, cache = _fwd(params, tokens[:, at:at + n], pos, cache, config)
    out.append(logits)
    at += n
  return jnp.concatenate(out, axis=1), cache


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_a_forward_over_many_tokens_equals_one_token_at_a_time_on_an_8_bit_cache(kv):
  """The property that keeps verification exact: the T new tokens of a forward (a prefill, a verified chain) see
  each other quantized as a later forward reads them from the pool, so feeding the tokens at once or one by one
  gives the same logits and the same pool, while the 8-bit cache's logits do differ from the full-precision
  one's (the comparison sees quantization)."""
  params = init_params(GEMMA, jax.random.PRNGKey(0))
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, GEMMA.vocab_size, (2, 12)), jnp.int32)
  at_once, c1 = _chunked(params, GEMMA, tokens, _paged(kv), [12])
  stepped, c2 = _chunked(params, GEMMA, tokens, _paged(kv), [5] + [1] * 7)
  full, _ = _chunked(params, GEMMA, tokens, _paged("auto"), [12])
  gap = float(jnp.max(jnp.abs(at_once - full)))
  diff = float(jnp.max(jnp.abs(at_once - stepped)))
  assert diff < 1e-5 and gap > 100 * max(diff, 1e-6), (diff, gap)
  for a, b in zip(c1.pools(), c2.pools()):
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), atol=1e-6)


def _large_kv_params(config, scale):
  """The model's K and V scaled up by `scale` with Q and the output projection scaled down: the same function in
  full precision, with K/V of magnitude ~ scale."""
  p = init_params(config, jax.random.PRNGKey(3))
  lay = dict(p["layers"], k=p["layers"]["k"] * scale, q=p["layers"]["q"] / scale, v=p["layers"]["v"] * scale,
             o=p["layers"]["o"] / scale)
  return dict(p, layers=lay)


@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_a_model_with_kv_of_magnitude_300_reads_its_8_bit_cache_right(kv):
  """Llama layout (no qk-norm), K/V ~300 in every layer: the 8-bit cache's logits stay within quantization noise of
  full precision's (and its top-1 agrees), where a reader taking the scale as 1 is far off."""
  config = tiny_llama_config()
  params = _large_kv_params(config, 300.0)
  tokens = jnp.asarray(np.random.default_rng(4).integers(3, config.vocab_size, (2, 12)), jnp.int32)
  init = lambda kv: KVCache.init(config, 2, 16, jnp.float32, block_size=4, kv_dtype=kv)
  full, cache = _chunked(params, config, tokens, init("auto"), [6, 1, 5])
  assert float(jnp.max(jnp.abs(cache.k))) > 300
  got, _ = _chunked(params, config, tokens, init(kv), [6, 1, 5])
  err = float(jnp.max(jnp.abs(got - full))) / float(jnp.max(jnp.abs(full)))
  assert err < {"int8": 0.02, "fp8": 0.08, "fp8_e5m2": 0.15}[kv], err
  assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(full, -1))) >= 0.9


def test_an_int8_cache_stores_the_keys_of_a_qk_norm_model_over_their_channel_gain():
  """Gemma layout (qk-norm) with one RoPE pair of K channels at a gain of 20 (Gemma 3 270M's k-norm spans 0-24): a
  per-token int8 scale follows that pair and rounds the other channels to a few steps (logits 0.088 of their range
  off, KL 1.0e-3); K stored over its channel gain, the query carrying it, stays at 0.020 / 1.3e-4 (0.063 / 3.9e-4
  compiled with LLVM's optimizations off, as make test's tiny pass does). fp8's relative grid is left as it is."""
  from spec_jax.cache import key_channel_gain
  config, D = GEMMA, GEMMA.head_dim
  p = init_params(config, jax.random.PRNGKey(5))
  kn = jnp.ones_like(p["layers"]["k_norm"]).at[..., 0].set(20.0).at[..., D // 2].set(20.0)
  params = dict(p, layers=dict(p["layers"], k_norm=kn))
  # RoPE pairs channel i with i + D/2 (the RMS of their gains' magnitudes); a zero pair gets 1
  gain = np.asarray(key_channel_gain(kn[0].at[D // 2].set(-20.0).at[1].set(0.0).at[D // 2 + 1].set(0.0)))
  np.testing.assert_allclose(gain[[0, D // 2, 1, D // 2 + 1, 2]], [20, 20, 1, 1, 1], rtol=1e-6)
  tokens = jnp.asarray(np.random.default_rng(6).integers(3, config.vocab_size, (2, 12)), jnp.int32)
  init = lambda kv: KVCache.init(config, 2, 16, jnp.float32, block_size=4, kv_dtype=kv)
  full, _ = _chunked(params, config, tokens, init("auto"), [6, 1, 5])
  got, cache = _chunked(params, config, tokens, init("int8"), [6, 1, 5])
  err = float(jnp.max(jnp.abs(got - full))) / float(jnp.max(jnp.abs(full)))
  a, q = jax.nn.log_softmax(full, -1), jax.nn.log_softmax(got, -1)
  kl = float(jnp.mean(jnp.sum(jnp.exp(a) * (a - q), -1)))
  assert err < 0.08 and kl < 6e-4, (err, kl)
  k, _ = cache.layer_view(jnp.int32(0))  # the pool holds K over the gain: the big pair no larger than the rest
  assert float(jnp.max(jnp.abs(k[..., 0]))) < 3 * float(jnp.max(jnp.abs(k[..., 2:D // 2])))


MAX_NEW = 12
# One case per proposer kind, the two dtypes shared out (each case compiles a whole loop).
LOOP_CASES = [("ngram", "int8"), ("draft", "fp8"), ("eagle", "int8"), ("eagle_tree", "fp8"), ("draft_tree", "int8"),
              ("medusa_tree", "int8"), ("suffix_tree", "fp8")]


def _loop(name, kv):
  """-> (tokens, the committed tokens' raw logprobs, the state's KV caches) of greedy decoding with proposer `name`
  ('none': plain) on a `kv` cache."""
  from spec_jax.batch import start
  from spec_jax.decode import decode_loop
  from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
  from tests.test_slots import _proposer
  params = _params()
  proposer, pparams = _proposer(name, params)
  prompts = _prompts(3, [9, 5, 12])
  spec = make_spec(CONFIG, proposer, adaptive_k=False, kv_cache_dtype=kv, max_logprobs=0)
  both = {"target": params, "proposer": pparams}
  n = len(prompts)
  state = start(both, spec, prompts, max_new_tokens=MAX_NEW, logprobs=([0] * n, [0] * n))
  state = decode_loop(both, state, spec)
  lens, plens = np.asarray(state.lengths), np.asarray(state.prompt_lens)
  toks = [np.asarray(state.tokens)[b, plens[b]:lens[b]].tolist() for b in range(n)]
  lps = [np.asarray(state.logprobs.chosen)[b, plens[b]:lens[b]] for b in range(n)]
  caches = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, KVCache))
            if isinstance(x, KVCache)]
  return toks, lps, caches


_plain = functools.lru_cache(maxsize=None)(lambda kv: _loop("none", kv))


@pytest.mark.parametrize("name,kv", LOOP_CASES)
def test_greedy_speculation_on_an_8_bit_cache_equals_plain_decoding_on_it(name, kv):
  """Chains and trees of every proposer kind over the same quantized target as plain decoding: the same tokens,
  and the same logprobs to float32 noise (a verify forward that let the drafted tokens see each other unquantized
  would differ by the quantization's own error, ~1e-3 here); every cache of the state (the draft model's, the
  EAGLE layer's) is 8-bit."""
  toks, lps, caches = _loop(name, kv)
  ptoks, plps, _ = _plain(kv)
  assert toks == ptoks
  for a, b in zip(lps, plps):
    np.testing.assert_allclose(a, b, atol=2e-5)
  owns_a_cache = name.removesuffix("_tree") in ("draft", "eagle")  # n-gram, Medusa and suffix read the target's only
  assert len(caches) == (2 if owns_a_cache else 1)
  assert all(c.kv_dtype == kv and c.k.dtype == kv_storage_dtype(kv) and c.quantized for c in caches)


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_a_memory_budget_holds_about_twice_the_pages_of_a_bfloat16_cache(name):
  """The server's pool sizing (serve/engine/kv_scheduler.py) counts every cache of the decode state in 8 bits plus the
  scales: a byte budget holds 2 / (1 + 4 / head_dim) times the pages of a bfloat16 cache (head_dim 16 here: 1.6x;
  Gemma 3's 256: 1.97x)."""
  from serve.engine.kv_scheduler import page_bytes, pool_pages
  from tests.proposers.test_medusa_eagle import CONFIG, _params
  from tests.test_slots import _proposer
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
  proposer, pparams = _proposer(name, params)
  both = {"target": params, "proposer": pparams}
  per_page = {kv: page_bytes(both, make_spec(CONFIG, proposer, kv_cache_dtype=kv), rows=2, capacity=32,
                             block_size=4) for kv in ("auto", "int8")}
  (auto, auto_p), (q, q_p) = per_page["auto"], per_page["int8"]
  assert auto / q == pytest.approx(2 / (1 + 4 / CONFIG.head_dim))
  assert (q_p > 0) == (auto_p > 0) and (not q_p or auto_p / q_p == pytest.approx(auto / q))  # the draft's too
  pages = lambda b: pool_pages(num_kv_blocks=0, kv_cache_memory_bytes=1 << 20, bytes_per_page=b, max_num_seqs=2,
                               capacity=32, block_size=4)
  assert pages(q) >= 1.5 * pages(auto)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_poisoned_pages_of_an_8_bit_pool_read_as_nan_and_are_masked_past_the_lengths(kv):
  """slots.fill_pages (--poison_freed_pages) NaNs an 8-bit page's scales as well as its data (int8 cannot hold
  NaN): a read of a poisoned slot shows, and slots past a row's length stay zero however their page was poisoned."""
  from spec_jax import slots
  cache = _paged(kv)
  rng = np.random.default_rng(5)
  shape = (GEMMA.num_layers, 2, 7, GEMMA.num_kv_heads, GEMMA.head_dim)
  cache = _write(cache, *(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)), [7])
  cache = slots.fill_pages(cache, jnp.asarray(cache.pages[1]))
  assert np.isnan(np.asarray(cache.k_scale[..., np.asarray(cache.pages[1])])).all()
  data = np.asarray(cache.k[:, np.asarray(cache.pages[1])].astype(jnp.float32))
  # the data too, with a value the dtype holds (NaN in fp8; int8's most negative value, not a cast NaN)
  assert (data == -128).all() if kv == "int8" else np.isnan(data).all()
  k, v = cache.layer_view(jnp.int32(0))
  assert np.isfinite(np.asarray(k[0])).all() and np.isnan(np.asarray(k[1, :, :7])).all()
  k, v = cache.replace(lengths=jnp.asarray([7, 0], jnp.int32)).layer_view(jnp.int32(0))
  assert np.isfinite(np.asarray(k)).all() and np.isfinite(np.asarray(v)).all() and not np.asarray(k[1]).any()


def test_sampled_speculation_on_an_8_bit_cache_keeps_its_distribution():
  """The first 3 sampled tokens of a draft model's chain have plain decoding's distribution on the same int8 cache
  (chi-square over 1,500 rows each way)."""
  from spec_jax.proposers.draft import DraftModelProposer
  from tests.distribution import assert_same_distribution, sample_plain_and_speculative
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # a tiny vocab: enough samples per cell
  params = init_params(config, jax.random.PRNGKey(3))
  dcfg = config.replace(num_layers=1)
  draft = DraftModelProposer(config=dcfg, k=2)
  dparams = init_params(dcfg, jax.random.PRNGKey(4))
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, dparams, n=500, calls=3,
                                                     kv_cache_dtype="int8")
  assert 0.1 < np.mean(rates) < 0.95  # both accept and reject paths are exercised
  assert_same_distribution(plain, specd)


def test_a_sampled_tree_on_an_8_bit_cache_commits_plain_samplings_tokens():
  """A draft model's token tree (EAGLE-2-style dynamic, its children top-k candidates: deterministic drafts) on an
  int8 cache commits the very tokens plain sampling draws on the same int8 cache with the same seed, row for row
  (tests/distribution.py: stronger than a chi-square; both the target's and the drafter's caches are int8)."""
  from tests.distribution import assert_commits_plain_tokens
  from tests.test_slots import _proposer
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))
  params = init_params(config, jax.random.PRNGKey(3))
  tree, pparams = _proposer("draft_tree", params, config=config)
  rate, _ = assert_commits_plain_tokens(params, config, tree, pparams, n=250, kv_cache_dtype="int8")
  assert 0 < rate < 1, rate  # accepted and rejected nodes both ran
