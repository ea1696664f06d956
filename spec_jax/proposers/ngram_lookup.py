"""Prompt lookup on device: draft what followed the most recent earlier occurrence of a row's trailing n-gram.

It needs no model, so it is the cheapest draft there is, and it wins on copy-heavy text (code edits, summaries,
answers that quote their context). Shapes are static and nothing goes to the host, so it runs inside the jitted
decode loop, vectorized over rows.

All n at once: index a candidate match by the position j of its last token. With L = lengths[b], a match of
length n ending at j means tokens[j - r] == tokens[L - 1 - r] for r < n, so the running AND of the shifted
comparisons over r = 0 .. ngram_max - 1 gives the match mask of every n in ngram_max compares of the whole row.
A match is valid for n - 1 <= j <= L - 2: it lies inside the row and at least one token follows it (which also
rules out the suffix itself). The largest valid j is the most recent occurrence, the longest matching n wins,
and the draft is tokens[j + 1 .. j + k], NO_TOKEN from L on.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

NO_TOKEN = -1  # a draft slot with nothing proposed: verification never accepts it


def _static_int(name: str, value) -> int:
  """k and the n-gram range shape the program, so they must be Python ints (and bools are not)."""
  if isinstance(value, bool):
    raise ValueError(f"{name} must be an int, got bool {value!r}")
  try:
    return operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be a static Python int, got {type(value).__name__} {value!r}") from None


@functools.partial(jax.jit, static_argnames=("k", "ngram_min", "ngram_max"))
def ngram_draft(tokens, lengths, *, k: int, ngram_min: int, ngram_max: int):
  """tokens int[B, S] (row b is tokens[b, :lengths[b]]; the rest is ignored), lengths int[B] in [0, S] ->
  int32[B, k] drafts, NO_TOKEN where nothing matched or where the continuation reaches lengths[b].

  Suffix lengths ngram_max down to ngram_min are tried; among the longest one's occurrences the latest wins.
  """
  k = _static_int("k", k)
  ngram_min = _static_int("ngram_min", ngram_min)
  ngram_max = _static_int("ngram_max", ngram_max)
  if k < 1 or ngram_min < 1 or ngram_max < ngram_min:
    raise ValueError(f"ngram_draft needs k >= 1 and 1 <= ngram_min <= ngram_max, got k={k}, "
                     f"ngram_min={ngram_min}, ngram_max={ngram_max}")
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, S], got {tokens.dtype}{list(tokens.shape)}")
  B, S = tokens.shape
  if lengths.shape != (B,):
    raise ValueError(f"lengths must have shape ({B},), got {lengths.shape}")
  tokens = tokens.astype(jnp.int32)
  if S < 2:  # a match needs lengths >= ngram_min + 1 >= 2
    return jnp.full((B, k), NO_TOKEN, jnp.int32)
  L = lengths.astype(jnp.int32)[:, None]  # [B, 1]
  j = jax.lax.broadcasted_iota(jnp.int32, (B, S), 1)  # candidate match ends
  # suf[:, r] = tokens[L - 1 - r], the suffix from its last token back; clipped, as rows too short for r have no
  # valid j anyway.
  suf = jnp.take_along_axis(tokens, jnp.clip(L - 1 - jnp.arange(ngram_max)[None, :], 0, S - 1), axis=1)
  best_end, _ = longest_match(tokens, suf, j <= L - 2, ngram_min=ngram_min, ngram_max=ngram_max)
  pos = best_end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, k]
  draft = jnp.take_along_axis(tokens, jnp.clip(pos, 0, S - 1), axis=1)
  return jnp.where((best_end[:, None] >= 0) & (pos < L), draft, NO_TOKEN)


def longest_match(corpus, suf, end_ok, *, ngram_min: int, ngram_max: int):
  """The longest, then latest, occurrence in `corpus` of each row's query suffix (prompt lookup's core, shared
  with the suffix proposer's history).

  corpus int32[B or 1, C]; suf int32[B, ngram_max]: suf[:, r] is the query's r-th token from its end (a value no
  corpus token has, e.g. -2, where the query is shorter); end_ok bool[B, C]: where a match may end (a
  continuation follows). -> (best_end int32[B], -1 where none; best_n int32[B], 0 where none).
  """
  B = suf.shape[0]
  C = corpus.shape[1]
  j = jax.lax.broadcasted_iota(jnp.int32, (B, C), 1)
  match = jnp.ones((B, C), bool)  # the suffix's last r tokens end at j
  best_end = jnp.full((B,), -1, jnp.int32)
  best_n = jnp.zeros((B,), jnp.int32)
  for r in range(min(ngram_max, C - 1)):  # n = r + 1 < C: a continuation must follow
    n = r + 1
    # shifted[:, j] = corpus[:, j - r]; its first r columns are filler, never valid (j >= n - 1 = r).
    shifted = jnp.pad(corpus[:, :C - r], ((0, 0), (r, 0)))
    match = match & (shifted == suf[:, r:r + 1])
    if n >= ngram_min:
      end_n = jnp.max(jnp.where(match & (j >= n - 1) & end_ok, j, -1), axis=1)  # latest match of length n
      best_end = jnp.where(end_n >= 0, end_n, best_end)  # a longer match overrides
      best_n = jnp.where(end_n >= 0, n, best_n)
  return best_end, best_n
