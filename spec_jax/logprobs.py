"""Logprobs of the committed tokens, from the same verify logits that decided them (OpenAI's `logprobs` /
`top_logprobs`, vLLM's `logprobs_mode`).

Every verified position's logits are in hand when the step commits: a chain's k + 1 positions, a tree's accepted
path. For rows that ask, `record` takes the log-softmax there, the committed token's value and the top N (static
N = LoopSpec.max_logprobs), and writes them at the token's own sequence position, beside `tokens`. No extra host
round trip: the host reads them from the snapshot with the tokens. Rows that do not ask cost nothing (a lax.cond
skips the work when no row of the batch asks).

Two modes, as vLLM's `logprobs_mode`:
- RAW (the default, vLLM's default `raw_logprobs`): the model's own log-softmax, before any control or warping.
  Evaluation harnesses (lm-evaluation-harness' loglikelihood) score the model, whatever sampling the request
  names, and speculative and plain decoding agree on it to float32 noise.
- PROCESSED (`processed_logprobs`): the distribution the token was drawn from: after logit_bias, min_tokens,
  the penalties and min_p (spec_jax/controls.py), then temperature, top-k and top-p. Greedy rows take temperature
  1 and no filter (vLLM does the same), so their values stay informative instead of one-hot. Filtered tokens are
  -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax import sharding
from spec_jax.config import SamplingParams
from spec_jax.models.transformer import forward, lm_head
from spec_jax.sampling import warp_logits

RAW, PROCESSED = 0, 1
MODES = {"raw_logprobs": RAW, "processed_logprobs": PROCESSED}
OFF = -1  # LoopSpec.max_logprobs: no buffers, nothing computed


@struct.dataclass
class Logprobs:
  """Per-row logprob buffers of a DecodeState. want int32[B]: top entries the row asks for (-1: no logprobs; 0:
  the committed token's only); mode int32[B] RAW / PROCESSED; chosen float32[B, S]: the logprob of tokens[b, s];
  top_ids int32[B, S, N], top_vals float32[B, S, N]: the N best at position s (S = N = 0 when the loop has none)."""

  want: jax.Array
  mode: jax.Array
  chosen: jax.Array
  top_ids: jax.Array
  top_vals: jax.Array

  @classmethod
  def init(cls, want, mode, capacity: int, max_logprobs: int) -> "Logprobs":
    R = want.shape[0]
    S, N = (capacity, max_logprobs) if max_logprobs >= 0 else (0, 0)
    return cls(want=jnp.asarray(want, jnp.int32), mode=jnp.asarray(mode, jnp.int32),
               chosen=jnp.zeros((R, S), jnp.float32), top_ids=jnp.zeros((R, S, N), jnp.int32),
               top_vals=jnp.zeros((R, S, N), jnp.float32))


def check(want: int, mode: str, max_logprobs: int) -> None:
  """Host-side: ValueError naming the field."""
  if mode not in MODES:
    raise ValueError(f"logprobs_mode must be one of {sorted(MODES)}, got {mode!r}")
  if want > max_logprobs:
    if max_logprobs < 0:
      raise ValueError("logprobs: this server was started without logprobs (--max_logprobs=-1)")
    raise ValueError(f"logprobs: at most {max_logprobs} top logprobs (--max_logprobs), got {want}")


def _processed(logits, sampling: SamplingParams):
  """The warped logits the token was drawn from; greedy rows at temperature 1, unfiltered."""
  greedy = sampling.temperature <= 0
  p = SamplingParams(temperature=jnp.where(greedy, 1.0, sampling.temperature),
                     top_k=jnp.where(greedy, 0, sampling.top_k), top_p=jnp.where(greedy, 1.0, sampling.top_p))
  return warp_logits(logits, p)


def _when(pred, fn, operand):
  """fn(operand) if pred else operand, as a while loop of zero or one trips: XLA:CPU copies the buffers a
  conditional updates (decode.switch_in_place says why), a while loop updates its carry in place."""
  return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros((), bool), fn(c[1])), (pred, operand))[1]


def record(lp: Logprobs, raw, processed, sampling: SamplingParams, out, n_emit, lengths, path=None) -> Logprobs:
  """lp with the committed tokens' logprobs written. raw, processed [B, T', V]: the step's logits before and after
  the controls; path int32[B, T] (None: T = T', position t): the position whose logits decided out[:, t] (a tree's
  accepted nodes; < 0 past the path); out int32[B, T]; n_emit int32[B] tokens committed this step at lengths[b] ...
  (the lengths before the step)."""
  if lp.chosen.shape[1] == 0:
    return lp
  B, T = out.shape
  S, N = lp.top_ids.shape[1:]
  asks = (lp.want >= 0) & (n_emit > 0)

  def run(lp):
    on_path = (lambda a: a) if path is None else \
        (lambda a: jnp.take_along_axis(a, jnp.maximum(path, 0)[:, :, None], axis=1))
    x = on_path(raw).astype(jnp.float32)
    wants_processed = asks & (lp.mode == PROCESSED)
    x = jax.lax.cond(jnp.any(wants_processed),
                     lambda: jnp.where(wants_processed[:, None, None], _processed(on_path(processed), sampling), x),
                     lambda: x)
    x = jax.nn.log_softmax(x, axis=-1)
    chosen = jnp.take_along_axis(x, out[:, :, None], axis=-1)[:, :, 0]
    vals, ids = jax.lax.top_k(x, N)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = jnp.where(asks[:, None] & (t < n_emit[:, None]), lengths[:, None] + t, S)  # S: dropped
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return lp.replace(chosen=lp.chosen.at[rows, pos].set(chosen, mode="drop"),
                      top_ids=lp.top_ids.at[rows, pos].set(ids.astype(jnp.int32), mode="drop"),
                      top_vals=lp.top_vals.at[rows, pos].set(vals, mode="drop"))

  return _when(jnp.any(asks), run, lp)


@functools.partial(jax.jit, static_argnames=("config", "top_n", "block"))
def _prompt_logprobs(params, tokens, config, top_n: int, block: int):
  T = tokens.shape[1]
  positions = jnp.arange(T, dtype=jnp.int32)[None, :]
  _, hidden, _ = forward(params, tokens, positions, None, config=config, compute_logits=False)[:3]

  def one(i):  # `block` positions at a time: [T, V] logits of a long prompt would not fit
    h = jax.lax.dynamic_slice_in_dim(hidden, i * block, block, axis=1)
    nxt = jax.lax.dynamic_slice_in_dim(jnp.pad(tokens, ((0, 0), (0, 1)))[:, 1:], i * block, block, axis=1)
    x = jax.nn.log_softmax(lm_head(params, h).astype(jnp.float32), axis=-1)
    vals, ids = jax.lax.top_k(x, top_n)
    chosen = jnp.take_along_axis(x, nxt[:, :, None], axis=-1)
    rank = 1 + jnp.sum(x > chosen, axis=-1, dtype=jnp.int32)  # vLLM's rank: 1 is the best
    return chosen[:, :, 0], rank, ids, vals

  outs = jax.lax.map(one, jnp.arange(T // block))
  flat = lambda a: jnp.moveaxis(a, 0, 1).reshape((1, T) + a.shape[3:])
  return tuple(flat(a) for a in outs)


def prompt_logprobs(params, config, prompt_ids, top_n: int, *, block: int = 64):
  """The prompt's own logprobs (echo, vLLM's prompt_logprobs), raw: for i >= 1, (logprob of prompt_ids[i] given
  the ones before it, its rank, top_ids [N], top_vals [N]); entry 0 (nothing before it) is None. One forward of
  the prompt without a cache, padded to a multiple of `block` (one program per padded length)."""
  n = len(prompt_ids)
  T = -(-n // block) * block
  tokens = np.zeros((1, T), np.int32)
  tokens[0, :n] = prompt_ids
  # to_host: on many hosts every process runs this (serve/many_hosts/multihost.py) and gathers the rows
  chosen, rank, ids, vals = map(sharding.to_host, _prompt_logprobs(params, tokens, config, max(top_n, 1), block))
  # logits at position i predict token i + 1
  return [None] + [(float(chosen[0, i - 1]), int(rank[0, i - 1]), ids[0, i - 1, :top_n].tolist(),
                    vals[0, i - 1, :top_n].tolist()) for i in range(1, n)]
