"""Logits -> warped distribution (temperature, then top-k, then top-p), sampling and greedy.

Everything is jittable and vectorized over rows, with per-row `SamplingParams`: logits are `[B, ..., V]` and the
parameters `[B]`, broadcast over the middle axes (so verification logits `[B, k+1, V]` work too).

Semantics
- Tokens are ranked by (logit descending, index ascending), comparing floats as floats (-0.0 == +0.0). Temperature
  does not change the ranking, so it is taken on the raw logits.
- temperature 0 is greedy: the warped distribution is one-hot on the first token of that ranking, i.e. the argmax
  with the lowest index among equal maxima, like `jnp.argmax`.
- Otherwise the logits are divided by the temperature, then top-k (0 or >= V is off) keeps exactly the first k
  tokens of the ranking (a tie at the boundary goes to the lower index), then top-p (1 is off) keeps the shortest
  prefix of the ranking whose mass, under the distribution renormalized over the top-k set, is >= top_p: the token
  that crosses the threshold is kept, and at least one token always is.
- NaN logits are not supported.

Every row's kept set is a prefix of the ranking, so it is stored as a boundary (the logit and index of the last kept
token) and never materialized: the warped logits, the probabilities, and a draw are single fused passes over the
logits. On CPU with V = 262144 memory traffic is the cost, and a full sort of V costs hundreds of ms, so there is
no sort at all:
- all rows greedy: a lax.cond takes an argmax-only path.
- no sampling row uses top-k or top-p: a lax.cond skips filtering (temperature only).
- filtering: `lax.top_k` with `candidates` (256) entries per row resolves every row whose kept set fits in the
  candidates (top_k <= 256; or top-p alone whose nucleus has <= 256 tokens). Only if some row does not fit does a
  lax.cond take the exact fallback, a bisection on the order-preserving integer keys of the logits (about 50
  masked reductions over V per filter): the same kept set as a sort, without the sort. (The fallback also takes
  the rare rows whose boundary logit is exactly 0, because lax.top_k ranks -0.0 below +0.0.)
- a draw is two-level: per-block masses over V, one categorical over the blocks, one inside the chosen block
  (about 2 sqrt(V) random numbers per row instead of V for Gumbel-max over V).
- the passes over V run in chunks of 8 rows (see ranking.map_rows), so [B, k+1, V] verification logits do not allocate
  B (k+1) V temporaries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from spec_jax import streams
from spec_jax.config import SamplingParams
from spec_jax.ranking import (  # noqa: F401 (argmax, probs_at, RowWarp, keep: the public API)
    sort_key, key_to_float, vocab_iota, map_rows, block_size, argmax, RowWarp, keep, probs_at, row_weights)

# Number of top candidates for the fast filtering path.
DEFAULT_CANDIDATES = 256

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------------------
# Filtering
# ----------------------------------------------------------------------------------------------------------------


def _prefix_bisect(x, weights, target):
  """Boundary of the shortest prefix of the ranking of x [N, V] whose total weight is >= target [N] > 0.

  weights [N, V] (or a scalar) >= 0. Returns (v_last float32[N], i_last int32[N]). The bisection runs on the
  integer keys of per-row scalars; every pass over V is a float compare and a masked sum. Assumes the total weight
  is >= target; if rounding makes it fall short, everything is kept.
  """
  n, v = x.shape
  iota = vocab_iota((n, v))
  weights = jnp.broadcast_to(weights, (n, v))
  zero = jnp.zeros((), weights.dtype)
  tgt = target.astype(weights.dtype)

  def mass(mask):
    return jnp.sum(jnp.where(mask, weights, zero), axis=-1)

  # Largest key s with W(x >= value(s)) >= target: value(s) is the logit of the last kept token.
  lo = sort_key(jnp.min(x, axis=-1))  # condition true (assumed)
  hi = sort_key(jnp.max(x, axis=-1)) + jnp.uint32(1)  # condition false (W = 0 < target)

  def value_step(_, c):
    lo, hi = c
    mid = lo + (hi - lo) // jnp.uint32(2)
    ok = mass(x >= key_to_float(mid)[:, None]) >= tgt
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  s, _ = lax.fori_loop(0, 32, value_step, (lo, hi))
  v_last = key_to_float(s)
  above = mass(x > v_last[:, None])
  tie = x == v_last[:, None]

  # Smallest index i such that the tokens above plus the ties with index <= i reach the target.
  def index_step(_, c):
    lo, hi = c
    mid = (lo + hi) // 2
    ok = above + mass(tie & (iota <= mid[:, None])) >= tgt
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  steps = max(1, math.ceil(math.log2(v + 1)))
  _, last = lax.fori_loop(0, steps, index_step, (jnp.full((n,), -1, jnp.int32), jnp.full((n,), v - 1, jnp.int32)))
  return v_last, last


def _keep_all(n, v):
  return jnp.full((n,), _NEG_INF, jnp.float32), jnp.full((n,), v - 1, jnp.int32)


def _bounds_bisect(x, t, top, kk, filt_k, top_p, filt_p):
  """Exact fallback: per-row boundary from bisection over V, no sort."""
  n, v = x.shape
  all_v, all_i = _keep_all(n, v)

  def top_k_bounds():
    vl, il = _prefix_bisect(x, jnp.ones((), jnp.int32), kk)
    return jnp.where(filt_k, vl, all_v), jnp.where(filt_k, il, all_i)

  vk, ik = lax.cond(jnp.any(filt_k), top_k_bounds, lambda: (all_v, all_i))

  def top_p_bounds():
    weights = row_weights(x, vocab_iota(x.shape), RowWarp(t, vk, ik, top, None))
    vl, il = _prefix_bisect(x, weights, top_p * jnp.sum(weights, axis=-1))
    return jnp.where(filt_p, vl, all_v), jnp.where(filt_p, il, all_i)

  vp, ip = lax.cond(jnp.any(filt_p), top_p_bounds, lambda: (all_v, all_i))
  # Both are prefixes of the same ranking: the intersection is the shorter one.
  p_first = (vp > vk) | ((vp == vk) & (ip < ik))
  return jnp.where(p_first, vp, vk), jnp.where(p_first, ip, ik)


def _lse_full(x, w: RowWarp):
  """log sum of exp(x / t) over the kept tokens: one pass over V."""
  s = jnp.sum(row_weights(x, vocab_iota(x.shape), w), axis=-1)
  return jnp.log(s) + w.top / w.temperature


def _lse_all(x, t, top):
  """log sum of exp(x / t) over every token. No mask: XLA:CPU fuses this pass into its reduction, while a masked
  one materializes an N x V temporary first."""
  s = jnp.sum(jnp.exp((x - top[:, None]) / t[:, None]), axis=-1)
  return jnp.log(s) + top / t


def _warp_filtered(x, t, kk, filt_k, top_p, filt_p, candidates, with_lse):
  """Rows where some filter is on (greedy rows are top-1). x: [N, V]."""
  n, v = x.shape
  c = min(candidates, v)
  # The first c tokens of the ranking. The barrier keeps XLA from folding later slices into the sort that top_k
  # becomes, which turns XLA:CPU's fast top-k into a full sort of V (100x slower). One barrier per output: a
  # barrier over top_k's whole (values, indices) tuple is folded onto the top_k itself under SPMD partitioning,
  # which crashes XLA's TopkDecomposer (a CHECK failure, on a mesh only).
  cv, ci = lax.top_k(x, c)
  cv, ci = lax.optimization_barrier(cv), lax.optimization_barrier(ci)
  top = cv[:, 0]
  z = cv / t[:, None]
  j = vocab_iota((n, c))
  in_k = kk <= c
  # top-p mass is relative to the top-k set: normalize over the first kk candidates, or over V when top-k is off.
  lse_cand = jax.nn.logsumexp(jnp.where(j < kk[:, None], z, _NEG_INF), axis=-1)
  need_full = filt_p & ~in_k & (kk >= v)
  all_v, all_i = _keep_all(n, v)
  lse_v = lax.cond(jnp.any(need_full), lambda: _lse_all(x, t, top), lambda: jnp.zeros((n,), jnp.float32))
  lse_norm = jnp.where(in_k, lse_cand, lse_v)
  cum = jnp.cumsum(jnp.where(j < kk[:, None], jnp.exp(z - lse_norm[:, None]), 0.0), axis=-1)
  n_p = 1 + jnp.sum(cum < top_p[:, None], axis=-1)  # c + 1 when the candidates do not reach top_p
  n_keep = jnp.where(filt_k, kk, v)
  n_keep = jnp.where(filt_p, jnp.minimum(n_keep, n_p), n_keep)
  need = filt_k | filt_p
  pos = jnp.clip(n_keep - 1, 0, c - 1)[:, None]
  v_c = jnp.take_along_axis(cv, pos, axis=-1)[:, 0]
  i_c = jnp.take_along_axis(ci, pos, axis=-1)[:, 0]
  # The kept set is within the candidates. A boundary at 0 is left to the fallback: lax.top_k puts +0.0 before
  # -0.0, which is not our index order among equal logits.
  within = (~filt_k | in_k) & (n_keep <= c)
  fast_ok = ~need | (within & (v_c != 0))
  v_last, i_last = lax.cond(
      jnp.all(fast_ok),
      lambda: (jnp.where(need, v_c, all_v), jnp.where(need, i_c, all_i)),
      lambda: _bounds_bisect(x, t, top, kk, filt_k, top_p, filt_p))
  w = RowWarp(t, v_last, i_last, top, None)
  if not with_lse:
    return w
  # Rows kept within the candidates: from the candidates. Rows without a filter: an unmasked pass. Others (the
  # fallback, or a nucleus beyond the candidates): a masked pass.
  lse_kept = jax.nn.logsumexp(jnp.where(j < n_keep[:, None], z, _NEG_INF), axis=-1)
  from_cands = need & within & fast_ok
  zeros = jnp.zeros((n,), jnp.float32)
  lse_open = lax.cond(jnp.any(~need), lambda: _lse_all(x, t, top), lambda: zeros)
  lse_masked = lax.cond(jnp.any(need & ~from_cands), lambda: _lse_full(x, w), lambda: zeros)
  lse = jnp.where(from_cands, lse_kept, jnp.where(need, lse_masked, lse_open))
  return w._replace(lse=lse)


def _warp_unfiltered(x, t, greedy, with_lse):
  """No filters: sampling rows keep everything, greedy rows keep the argmax."""
  n, v = x.shape
  top = jnp.max(x, axis=-1)
  all_v, all_i = _keep_all(n, v)
  i_arg = lax.cond(jnp.any(greedy), lambda: argmax(x), lambda: all_i)
  w = RowWarp(t, jnp.where(greedy, top, all_v), jnp.where(greedy, i_arg, all_i), top, None)
  # A greedy row's one kept token has x = top and t = 1.
  return w._replace(lse=jnp.where(greedy, top, _lse_all(x, t, top))) if with_lse else w


def _warp_greedy(x, with_lse):
  n, _ = x.shape
  i_arg = argmax(x)
  top = jnp.take_along_axis(x, i_arg[:, None], axis=-1)[:, 0]
  return RowWarp(jnp.ones((n,), jnp.float32), top, i_arg, top, top if with_lse else None)


def warp_rows(x: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
              candidates: int = DEFAULT_CANDIDATES, with_lse: bool = True) -> RowWarp:
  """The warped distribution of logits x [N, V] with per-row parameters [N], as a RowWarp.

  `candidates` only changes speed, never the result (up to float32 rounding of the top-p mass).
  """
  return map_rows(lambda *a: _warp_rows(*a, candidates=candidates, with_lse=with_lse),
                   x, temperature, top_k, top_p)


def _warp_rows(x, temperature, top_k, top_p, *, candidates, with_lse):
  n, v = x.shape
  x = x.astype(jnp.float32)
  greedy = temperature <= 0
  t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
  kk = jnp.where((top_k > 0) & (top_k < v), top_k, v).astype(jnp.int32)
  kk = jnp.where(greedy, 1, kk)
  filt_p = ~greedy & (top_p < 1.0)
  filt_k = ~greedy & (kk < v)

  def general():
    return lax.cond(
        jnp.any(filt_k | filt_p),
        lambda: _warp_filtered(x, t, kk, greedy | filt_k, top_p.astype(jnp.float32), filt_p, candidates, with_lse),
        lambda: _warp_unfiltered(x, t, greedy, with_lse),
    )

  return lax.cond(jnp.all(greedy), lambda: _warp_greedy(x, with_lse), general)


def rows(logits: jax.Array, params: SamplingParams):
  """Flatten [B, ..., V] to [N, V] and broadcast the per-row params to [N]."""
  b, v = logits.shape[0], logits.shape[-1]
  per = math.prod(logits.shape[1:-1])

  def rep(a):
    return jnp.broadcast_to(jnp.asarray(a).reshape(b, 1), (b, per)).reshape(-1)

  return logits.reshape(-1, v), rep(params.temperature), rep(params.top_k), rep(params.top_p)


# ----------------------------------------------------------------------------------------------------------------
# Drawing
# ----------------------------------------------------------------------------------------------------------------


def _categorical_two_level(keys, x, weight_fn):
  """int32[N] draws with probability proportional to weight_fn(x_part, index_part) >= 0 for x [N, V], one PRNG key
  per row.

  A block of the vocabulary is drawn with probability proportional to its mass, then a token inside it with
  probability proportional to its weight. weight_fn is elementwise, so the block masses are one fused pass over x
  and only the chosen block is evaluated again. A zero-weight token is never drawn.
  """
  n, v = x.shape
  s = block_size(v)
  index = vocab_iota((n, v))
  if s == 0:  # no good divisor: pad with zero weight
    s = max(1, math.isqrt(v))
    nb = -(-v // s)
    w = jnp.pad(weight_fn(x, index), ((0, 0), (0, nb * s - v)))
    x, index, weight_fn = w, jnp.pad(index, ((0, 0), (0, nb * s - v))), lambda w_, i_: w_
  nb = x.shape[1] // s
  xb, ib = x.reshape(n, nb, s), index.reshape(n, nb, s)
  k_block, k_tok = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  draw = jax.vmap(lambda k, logits: jax.random.categorical(k, logits))
  block = draw(k_block, jnp.log(jnp.sum(weight_fn(xb, ib), axis=-1)))  # [N]
  pick = lambda a: jnp.take_along_axis(a, block[:, None, None], axis=1)[:, 0]  # [N, s]
  tok = draw(k_tok, jnp.log(weight_fn(pick(xb), pick(ib))))
  return (block * s + tok).astype(jnp.int32)


def categorical_from_weights(key: jax.Array, weights: jax.Array) -> jax.Array:
  """int32[N] draws from unnormalized weights [N, V] >= 0 (each row needs some positive weight). key: one key
  (split per row) or one key per row (spec_jax/streams.py)."""
  keys = streams.rows(key, weights.shape[0])
  return map_rows(lambda k, w: _categorical_two_level(k, w.astype(jnp.float32), lambda wp, ip: wp), keys, weights)


def sample_rows(key: jax.Array, x: jax.Array, w: RowWarp) -> jax.Array:
  """int32[N] draws from the warped distribution w of logits x [N, V]; key: one key or one per row."""
  keys = streams.rows(key, x.shape[0])

  def draw(k, xr, *wr):
    wr = RowWarp(*wr, None)
    return _categorical_two_level(k, xr, lambda xp, ip: row_weights(xp, ip, wr))

  return map_rows(draw, keys, x, w.temperature, w.v_last, w.i_last, w.top)


# ----------------------------------------------------------------------------------------------------------------
# Public API on [B, ..., V]
# ----------------------------------------------------------------------------------------------------------------


def warp_logits(logits: jax.Array, params: SamplingParams, *, candidates: int = DEFAULT_CANDIDATES) -> jax.Array:
  """float32 logits [B, ..., V] of the warped distribution: logits / temperature on the kept set, -inf elsewhere.

  Greedy rows keep only the argmax (with its raw logit), so their distribution is one-hot.
  """
  x, t, k, p = rows(logits, params)
  w = warp_rows(x, t, k, p, candidates=candidates, with_lse=False)
  out = jnp.where(keep(x, vocab_iota(x.shape), w), x.astype(jnp.float32) / w.temperature[:, None], _NEG_INF)
  return out.reshape(logits.shape)


def warped_probs(logits: jax.Array, params: SamplingParams, *, candidates: int = DEFAULT_CANDIDATES) -> jax.Array:
  """float32 probabilities [B, ..., V] of the warped distribution (exactly one-hot for greedy rows)."""
  x, t, k, p = rows(logits, params)
  w = warp_rows(x, t, k, p, candidates=candidates, with_lse=True)
  return probs_at(x, vocab_iota(x.shape), w).reshape(logits.shape)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams, *,
           candidates: int = DEFAULT_CANDIDATES) -> jax.Array:
  """int32 tokens [B, ...] for logits [B, ..., V]: argmax for greedy rows, a draw from the warped distribution
  for the others. key: one key (split per distribution) or typed keys [B, ...], one per distribution (a row's
  stream at each position: spec_jax/streams.py)."""
  x, t, k, p = rows(logits, params)
  out = lax.cond(
      jnp.all(t <= 0),
      lambda: argmax(x),
      lambda: sample_rows(key, x, warp_rows(x, t, k, p, candidates=candidates, with_lse=False)),
  )
  return out.reshape(logits.shape[:-1])


def sample_with_probs(key: jax.Array, logits: jax.Array, params: SamplingParams, *,
                      candidates: int = DEFAULT_CANDIDATES) -> tuple[jax.Array, jax.Array]:
  """`sample` and `warped_probs` of the same logits sharing one warp (what a draft model needs)."""
  x, t, k, p = rows(logits, params)
  w = warp_rows(x, t, k, p, candidates=candidates, with_lse=True)
  tokens = lax.cond(jnp.all(t <= 0), lambda: w.i_last, lambda: sample_rows(key, x, w))
  return tokens.reshape(logits.shape[:-1]), probs_at(x, vocab_iota(x.shape), w).reshape(logits.shape)
