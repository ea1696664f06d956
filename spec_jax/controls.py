"""Sampling controls, exact under speculation: logit_bias, min_tokens, repetition / frequency / presence penalties,
min_p, and per-request stop_token_ids and ignore_eos.

A control at a verified position depends on every token before it, the drafts accepted before it in the same step
included. So `apply` processes the target's logits at each position (a chain's k + 1, a tree's nodes) with the
counts of that position's own context: the committed tokens (read from the row's token buffer) plus the drafted
tokens on its path. Verification then runs on the processed logits, so the distribution it checks and corrects
from at every position is exactly the one plain decoding (k = 0, the same function) uses there: greedy output is
token-identical, sampled output is distributed identically. The drafter's q is left as it is (verification uses
the q the drafter sampled from, so that stays exact).

Order, as vLLM's V1 sampler applies them: logit_bias and min_tokens, then the penalties (repetition on prompt and
output tokens: a positive logit divided by r, a negative one multiplied; then frequency x count and presence x
(count > 0) subtracted over output tokens), then, for sampled rows, min_p (keep tokens with p >= min_p x p_max
after temperature, i.e. logit >= max logit + temperature x ln min_p) before top-k / top-p. min_tokens masks the
stop tokens (the model's and the row's stop_token_ids) while fewer than min_tokens tokens have been generated.
ignore_eos: the model's stop tokens do not end the row (its stop_token_ids still do).

Per row, static sizes: up to MAX_BIAS logit_bias entries and MAX_STOP stop_token_ids (-1 pads). Rows without any
control cost nothing: a lax.cond skips the work when no row of the batch has one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

MAX_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP = 16


@struct.dataclass
class Controls:
  """Per-row controls [B] (bias_* and stop_ids [B, MAX_*], -1 padded)."""

  presence: jax.Array  # float32
  frequency: jax.Array  # float32
  repetition: jax.Array  # float32, 1 = off
  min_p: jax.Array  # float32, 0 = off
  min_tokens: jax.Array  # int32
  ignore_eos: jax.Array  # bool
  bias_ids: jax.Array  # int32 [B, MAX_BIAS]
  bias_vals: jax.Array  # float32 [B, MAX_BIAS]
  stop_ids: jax.Array  # int32 [B, MAX_STOP]
  # Structured output: each row's grammar automaton and state (spec_jax/grammar/rows.py), None for a batch that
  # constrains no row (the grammar code is then not traced at all).
  grammar: Any = None

  @classmethod
  def make(cls, batch: int, *, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0,
           min_p: float = 0.0, min_tokens: int = 0, ignore_eos: bool = False, logit_bias: Optional[dict] = None,
           stop_token_ids: Sequence[int] = (), vocab_size: Optional[int] = None) -> "Controls":
    """`batch` rows with the same controls; ValueError naming the field on bad input."""
    validate(presence=presence, frequency=frequency, repetition=repetition, min_p=min_p, min_tokens=min_tokens,
             logit_bias=logit_bias, stop_token_ids=stop_token_ids, vocab_size=vocab_size)
    ids = np.full((MAX_BIAS,), -1, np.int32)
    vals = np.zeros((MAX_BIAS,), np.float32)
    for i, (t, v) in enumerate(sorted((int(t), float(v)) for t, v in (logit_bias or {}).items())):
      ids[i], vals[i] = t, v
    stops = np.full((MAX_STOP,), -1, np.int32)
    stops[:len(stop_token_ids)] = np.asarray(list(stop_token_ids), np.int32)
    full = lambda v, dt: jnp.full((batch,), v, dt)
    return cls(presence=full(presence, jnp.float32), frequency=full(frequency, jnp.float32),
               repetition=full(repetition, jnp.float32), min_p=full(min_p, jnp.float32),
               min_tokens=full(min_tokens, jnp.int32), ignore_eos=full(bool(ignore_eos), jnp.bool_),
               bias_ids=jnp.tile(jnp.asarray(ids)[None], (batch, 1)),
               bias_vals=jnp.tile(jnp.asarray(vals)[None], (batch, 1)),
               stop_ids=jnp.tile(jnp.asarray(stops)[None], (batch, 1)))

  @classmethod
  def stack(cls, rows: Sequence["Controls"]) -> "Controls":
    """One-row (or more) Controls -> one batch."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *rows)

  def active(self) -> jax.Array:
    """bool[B]: the row's logits need processing (stop ids and ignore_eos act at commit only)."""
    return ((self.presence != 0) | (self.frequency != 0) | (self.repetition != 1) | (self.min_p > 0)
            | (self.min_tokens > 0) | jnp.any(self.bias_ids >= 0, axis=1))


def validate(*, presence=0.0, frequency=0.0, repetition=1.0, min_p=0.0, min_tokens=0, logit_bias=None,
             stop_token_ids=(), vocab_size=None) -> None:
  """Host-side checks, vLLM's ranges; the error names the field."""
  # The library's own, for direct callers; the server checks a request once, in serve/engine/request_spec.py.
  for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
    if not np.isfinite(v) or not -2.0 <= v <= 2.0:
      raise ValueError(f"{name} must be in [-2, 2], got {v}")
  if not np.isfinite(repetition) or repetition <= 0:
    raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {repetition}")
  if not np.isfinite(min_p) or not 0.0 <= min_p <= 1.0:
    raise ValueError(f"min_p must be in [0, 1], got {min_p}")
  if int(min_tokens) != min_tokens or not 0 <= min_tokens < 2 ** 31:
    raise ValueError(f"min_tokens must be an integer in [0, 2^31), got {min_tokens}")
  bias = logit_bias or {}
  if len(bias) > MAX_BIAS:
    raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_BIAS}")
  vocab = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
  keys = [t for t in bias if not _is_id(t, vocab_size)]
  if keys:  # every bad key named, not only the first
    raise field_error("logit_bias", f"logit_bias keys must be token ids in {vocab}; these are not: "
                      + ", ".join(repr(t) for t in keys[:20]) + (f" (and {len(keys) - 20} more)" if len(keys) > 20
                                                                  else ""))
  values = [f"{v!r} for token {t}" for t, v in bias.items()
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or not -100 <= v <= 100]
  if values:
    raise field_error("logit_bias", "logit_bias values must be numbers in [-100, 100], got " + ", ".join(values[:20]))
  if len(stop_token_ids) > MAX_STOP:
    raise ValueError(f"stop_token_ids has {len(stop_token_ids)} entries; at most {MAX_STOP}")
  bad = [t for t in stop_token_ids if isinstance(t, bool) or not _is_id(t, vocab_size)]
  if bad:
    raise field_error("stop_token_ids", f"stop_token_ids must be token ids in {vocab}; these are not: "
                      + ", ".join(repr(t) for t in bad))


def _is_id(t, vocab_size) -> bool:
  """A token id (an int, or a string of one: logit_bias's JSON keys) inside the vocabulary."""
  try:
    tid = int(t)
  except (TypeError, ValueError):
    return False
  return (tid == t or str(tid) == str(t).strip()) and 0 <= tid and (vocab_size is None or tid < vocab_size)


def field_error(field: str, message: str) -> ValueError:
  """A ValueError that names its request field (the server's 400 sets `param` from it)."""
  e = ValueError(message)
  e.field = field
  return e


def _committed_counts(tokens, lengths, prompt_lens, vocab: int):
  """(output token counts int32[B, V], seen bool[B, V]: prompt or output) from the committed token buffer."""
  B, S = tokens.shape
  pos = jnp.arange(S, dtype=jnp.int32)[None, :]
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, S))
  committed = pos < lengths[:, None]
  out = committed & (pos >= prompt_lens[:, None])
  counts = jnp.zeros((B, vocab), jnp.int32).at[rows, tokens].add(out.astype(jnp.int32), mode="drop")
  seen = jnp.zeros((B, vocab), jnp.int32).at[rows, tokens].add(committed.astype(jnp.int32), mode="drop") > 0
  return counts, seen


def _stop_table(c: Controls, stop_ids: tuple, vocab: int):
  """bool[B, V]: the row's stop tokens (the model's and its stop_token_ids)."""
  B = c.stop_ids.shape[0]
  t = jnp.zeros((B, vocab), jnp.bool_)
  if stop_ids:
    t = t.at[:, jnp.asarray(stop_ids, jnp.int32)].set(True, mode="drop")
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], c.stop_ids.shape)
  return t.at[rows, jnp.where(c.stop_ids >= 0, c.stop_ids, vocab)].set(True, mode="drop")


def _penalize(x, counts, seen, c: Controls, shape):
  """Repetition, then frequency and presence, elementwise; counts/seen broadcast against x."""
  r = c.repetition.reshape(shape)
  x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
  return x - c.frequency.reshape(shape) * counts.astype(jnp.float32) - c.presence.reshape(shape) * (counts > 0)


def apply(logits, c: Controls, temperature, tokens, lengths, prompt_lens, path_tokens, path_mask, depth,
          stop_ids: tuple):
  """The processed logits [B, T, V] (float32) at every position of a step, or the logits as they are when no row
  has a control. tokens int32[B, S], lengths, prompt_lens [B]: the committed rows; path_tokens int32[B, T]: the
  token each position feeds (0: the last committed, then drafts; < 0: none); path_mask bool[B, T, T]
  (path_mask[b, t, j]: token j is on position t's path, itself included); depth int32[B, T]: drafts before each
  position's prediction.

  Nothing of size [B, T, V] is built but the logits: the committed counts [B, V] broadcast over positions, and
  the few positions whose path holds a drafted token get their exact value written over (scatter)."""
  B, T, V = logits.shape

  def run(x):
    x = x.astype(jnp.float32)
    counts, seen = _committed_counts(tokens, lengths, prompt_lens, V)
    # logit_bias
    nb = c.bias_ids.shape[1]
    b3 = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, nb))
    t3 = jnp.broadcast_to(jnp.arange(T)[None, :, None], (B, T, nb))
    ids = jnp.broadcast_to(c.bias_ids[:, None, :], (B, T, nb))
    x = x.at[b3, t3, jnp.where(ids >= 0, ids, V)].add(jnp.broadcast_to(c.bias_vals[:, None, :], (B, T, nb)),
                                                       mode="drop")
    # min_tokens: no stop token while fewer than min_tokens have been generated
    early = ((lengths - prompt_lens)[:, None] + depth) < c.min_tokens[:, None]  # [B, T]
    x = jnp.where(early[:, :, None] & _stop_table(c, stop_ids, V)[:, None, :], -jnp.inf, x)
    # The path's drafted tokens, per position: (b, t, j) for token j on t's path (j = 0 is committed already).
    j = jnp.arange(T)[None, None, :]
    tok = jnp.broadcast_to(path_tokens[:, None, :], (B, T, T))
    on = path_mask & (j > 0) & (tok >= 0)
    b = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, T))
    t = jnp.broadcast_to(jnp.arange(T)[None, :, None], (B, T, T))
    safe = jnp.maximum(tok, 0)
    x_path = x[b, t, safe]  # before the penalties
    # per (b, t, j): how often token j appears on t's path (duplicates write the same value)
    same = (tok[..., :, None] == tok[..., None, :]) & on[..., None, :]  # [B, T, T(j), T(j')]
    n_path = jnp.sum(same, axis=-1)
    cnt = counts[b, safe] + n_path
    shape3 = (B, 1, 1)
    x = _penalize(x, counts[:, None, :], seen[:, None, :], c, shape3)
    exact = _penalize(x_path, cnt, jnp.ones_like(on), c, shape3)
    x = x.at[b, t, jnp.where(on, safe, V)].set(exact, mode="drop")
    # min_p (sampled rows): relative to the best token after temperature
    tt = temperature[:, None, None]
    use = (c.min_p > 0)[:, None, None] & (tt > 0)
    thr = jnp.max(x, axis=-1, keepdims=True) + tt * jnp.log(jnp.maximum(c.min_p, 1e-30))[:, None, None]
    return jnp.where(use & (x < thr), -jnp.inf, x)

  return jax.lax.cond(jnp.any(c.active()), run, lambda x: x.astype(jnp.float32), logits)


def chain_path(last, draft_tokens):
  """(path_tokens [B, k+1], path_mask [B, k+1, k+1], depth [B, k+1]) of a chain step."""
  feed = jnp.concatenate([last, draft_tokens], axis=1)
  T = feed.shape[1]
  i = jnp.arange(T)
  mask = jnp.broadcast_to(i[None, :, None] >= i[None, None, :], (feed.shape[0], T, T))
  return feed, mask, jnp.broadcast_to(i[None, :], feed.shape).astype(jnp.int32)


def is_stop(out, c: Controls, stop_ids: tuple):
  """bool like out [B, T]: the token ends its row (the model's stop tokens unless ignore_eos; the row's own)."""
  model = jnp.isin(out, jnp.asarray(stop_ids or (-1,), jnp.int32)) & ~c.ignore_eos[:, None]
  return model | jnp.any(out[:, :, None] == c.stop_ids[:, None, :], axis=-1)
