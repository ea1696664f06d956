"""Prompt-lookup (n-gram) drafting, fully on device.

The proposer looks for the most recent earlier occurrence of the row's trailing
n-gram inside the row's own token buffer (prompt + generated tokens) and
proposes the ``k`` tokens that followed that occurrence.  It needs no model,
so it is the cheapest draft source there is, and it works well on copy-heavy
workloads (code editing, summarisation, retrieval-augmented answers).

Everything is static-shaped and vectorised over rows, so :func:`ngram_draft`
can be traced inside ``jax.lax.while_loop`` / ``jax.jit`` with no host round
trips.

Algorithm (all n at once)
-------------------------
Index a candidate match by the position ``j`` of its *last* token.  With
``L = lengths[b]``, a match of length ``n`` ending at ``j`` means::

    tokens[j - r] == tokens[L - 1 - r]    for r = 0 .. n-1

Let ``e_r[j] = tokens[j - r] == tokens[L - 1 - r]`` (one shifted comparison of
the whole row against a per-row scalar).  The match mask for length ``n`` is
the running AND ``e_0 & e_1 & ... & e_{n-1}``, so a single pass over
``r = 0 .. ngram_max-1`` yields the masks for every ``n`` — ``ngram_max``
vectorised compares in total.  A match is valid when ``n - 1 <= j <= L - 2``:
it starts at or after position 0 and ends strictly before the suffix's last
token, so at least one token follows it (this also excludes the suffix
itself, which ends at ``L - 1``, and everything past ``L``).  The most recent
occurrence is the largest valid ``j`` (a max-reduction over
``where(mask, iota, -1)``); the longest matching ``n`` wins.  The draft is
``tokens[j + 1 : j + 1 + k]`` with positions ``>= L`` replaced by ``-1``.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

__all__ = ["ngram_draft", "NO_TOKEN"]

#: Value used for draft positions that have no proposal.
NO_TOKEN = -1


def _static_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a static Python int, got {type(value).__name__} {value!r}"
        ) from None


def _validate(k, ngram_min, ngram_max) -> tuple[int, int, int]:
    k = _static_int("k", k)
    ngram_min = _static_int("ngram_min", ngram_min)
    ngram_max = _static_int("ngram_max", ngram_max)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if ngram_min < 1:
        raise ValueError(f"ngram_min must be >= 1, got {ngram_min}")
    if ngram_max < ngram_min:
        raise ValueError(
            f"ngram_max must be >= ngram_min, got ngram_min={ngram_min}, ngram_max={ngram_max}"
        )
    return k, ngram_min, ngram_max


@functools.partial(jax.jit, static_argnames=("k", "ngram_min", "ngram_max"))
def ngram_draft(tokens, lengths, *, k: int, ngram_min: int, ngram_max: int):
    """Propose ``k`` tokens per row by prompt lookup.

    Args:
      tokens: int[B, S]; ``tokens[b, :lengths[b]]`` is row ``b``'s buffer
        (prompt + generated so far).  Entries at or past ``lengths[b]`` are
        ignored.
      lengths: int[B], each in ``[0, S]``.
      k: number of draft tokens (static, >= 1).
      ngram_min, ngram_max: inclusive range of suffix lengths to try
        (static, ``1 <= ngram_min <= ngram_max``).  The longest matching
        suffix length wins; among its occurrences the most recent one wins.

    Returns:
      int32[B, k] draft tokens; ``-1`` (:data:`NO_TOKEN`) where there is no
      match, or where the continuation would read at or past ``lengths[b]``.
    """
    k, ngram_min, ngram_max = _validate(k, ngram_min, ngram_max)
    tokens = jnp.asarray(tokens)
    lengths = jnp.asarray(lengths)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [B, S], got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array, got {tokens.dtype}")
    B, S = tokens.shape
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {lengths.shape}")

    tokens = tokens.astype(jnp.int32)
    if S < 2:  # a match needs lengths >= ngram_min + 1 >= 2
        return jnp.full((B, k), NO_TOKEN, jnp.int32)
    L = lengths.astype(jnp.int32)[:, None]  # [B, 1]
    j = jax.lax.broadcasted_iota(jnp.int32, (B, S), 1)  # candidate match end

    # Suffix tokens, last first: suf[:, r] = tokens[L - 1 - r].  Indices are
    # clipped; rows too short for a given r have no valid j anyway.
    suf_idx = jnp.clip(L - 1 - jnp.arange(ngram_max, dtype=jnp.int32)[None, :], 0, S - 1)
    suf = jnp.take_along_axis(tokens, suf_idx, axis=1)  # [B, ngram_max]

    best_end = jnp.full((B,), -1, jnp.int32)  # end of the chosen match, -1 = none
    acc = None
    # A match of length n needs L >= n + 1 <= S, so n > S - 1 can never match.
    for r in range(min(ngram_max, S - 1)):
        n = r + 1
        if r == 0:
            shifted = tokens
        else:
            # shifted[:, j] = tokens[:, j - r]; the first r columns are filler
            # (never valid since j >= n - 1 >= r is required below).
            shifted = jnp.pad(tokens[:, : S - r], ((0, 0), (r, 0)))
        eq = shifted == suf[:, r : r + 1]
        acc = eq if acc is None else acc & eq
        if n < ngram_min:
            continue
        valid = acc & (j >= n - 1) & (j <= L - 2)
        end_n = jnp.max(jnp.where(valid, j, -1), axis=1)  # most recent match
        # Longer n overrides shorter ones when it matches.
        best_end = jnp.where(end_n >= 0, end_n, best_end)

    # Continuation: tokens[best_end + 1 + t], valid while < L.
    pos = best_end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, k]
    draft = jnp.take_along_axis(tokens, jnp.clip(pos, 0, S - 1), axis=1)
    ok = (best_end[:, None] >= 0) & (pos < L)
    return jnp.where(ok, draft, NO_TOKEN).astype(jnp.int32)
