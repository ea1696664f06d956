"""Prompt lookup against an obvious-loops reference (property test) and on hand-written rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_jax.proposers.ngram_lookup import ngram_draft


def ngram_draft_reference(tokens, lengths, k, ngram_min, ngram_max):
  """For each row: the longest suffix n with an earlier occurrence, its latest one, the k tokens after it."""
  out = np.full((tokens.shape[0], k), -1, dtype=np.int32)
  for b, L in enumerate(int(n) for n in lengths):
    row = [int(t) for t in tokens[b, :L]]
    for n in range(ngram_max, ngram_min - 1, -1):
      if L < n + 1:
        continue
      # Latest earlier occurrence: start i with i + n <= L - 1.
      found = next((i for i in range(L - 1 - n, -1, -1) if row[i:i + n] == row[L - n:]), None)
      if found is None:
        continue
      for t in range(k):
        if found + n + t < L:
          out[b, t] = row[found + n + t]
      break
  return out


def draft(tokens, lengths, k, ngram_min, ngram_max):
  return np.asarray(ngram_draft(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), k=k,
                                ngram_min=ngram_min, ngram_max=ngram_max))


def pad_rows(rows, S, fill=0):
  toks = np.full((len(rows), S), fill, dtype=np.int32)
  for b, r in enumerate(rows):
    toks[b, :len(r)] = r
  return toks, np.array([len(r) for r in rows], dtype=np.int32)


SHAPES = [(1, 6), (3, 12), (4, 24)]


@st.composite
def cases(draw):
  B, S = draw(st.sampled_from(SHAPES))
  vocab = draw(st.integers(1, 4))
  tokens = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=B * S, max_size=B * S)),
                    dtype=np.int32).reshape(B, S)
  lengths = np.array(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)), np.int32)
  if draw(st.booleans()):  # garbage past the lengths: large distinct values (else in-vocabulary ones)
    for b in range(B):
      tokens[b, lengths[b]:] = 1000 + np.arange(S - lengths[b])
  k = draw(st.integers(1, 5))
  ngram_min = draw(st.integers(1, 3))
  ngram_max = draw(st.integers(ngram_min, 4))
  return tokens, lengths, k, ngram_min, ngram_max


@settings(max_examples=250, deadline=None)
@given(cases())
def test_matches_reference(case):
  tokens, lengths, k, nmin, nmax = case
  got = draft(tokens, lengths, k, nmin, nmax)
  assert got.dtype == np.int32 and got.shape == (tokens.shape[0], k)
  np.testing.assert_array_equal(got, ngram_draft_reference(tokens, lengths, k, nmin, nmax))


def test_copy_heavy_row_proposes_copied_continuation():
  passage = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
  # The prompt holds the passage; the generation has started copying it.
  toks, lens = pad_rows([[1, 2] + passage + [3, 4] + passage[:4]], 32)
  np.testing.assert_array_equal(draft(toks, lens, k=4, ngram_min=1, ngram_max=3), [[15, 16, 17, 18]])


def test_most_recent_occurrence_wins():
  # The suffix [5, 6] occurs twice before; the later occurrence is followed by 9.
  toks, lens = pad_rows([[5, 6, 7, 1, 5, 6, 9, 2, 5, 6]], 16)
  np.testing.assert_array_equal(draft(toks, lens, k=2, ngram_min=2, ngram_max=2), [[9, 2]])


def test_longest_ngram_wins():
  # The bigram [2, 3] last matches at 5 (-> 8), the trigram [1, 2, 3] only at 0 (-> 4): the trigram wins.
  toks, lens = pad_rows([[1, 2, 3, 4, 0, 2, 3, 8, 0, 1, 2, 3]], 16)
  np.testing.assert_array_equal(draft(toks, lens, 1, 1, 3), [[4]])
  np.testing.assert_array_equal(draft(toks, lens, 1, 1, 2), [[8]])
  np.testing.assert_array_equal(draft(toks, lens, 1, 3, 3), [[4]])


def test_suffix_itself_is_not_matched():
  # No earlier occurrence of the trailing token: nothing to propose.
  toks, lens = pad_rows([[1, 2, 3, 4]], 8)
  np.testing.assert_array_equal(draft(toks, lens, 3, 1, 2), [[-1, -1, -1]])
  # A run: the suffix [7, 7] may overlap its match at start 1 (ending at L - 2), but not match itself at start 2.
  toks, lens = pad_rows([[0, 7, 7, 7]], 8)
  np.testing.assert_array_equal(draft(toks, lens, 3, 2, 2), [[7, -1, -1]])


def test_near_end_match_is_padded():
  toks, lens = pad_rows([[9, 8, 4, 9, 8]], 10, fill=9)
  np.testing.assert_array_equal(draft(toks, lens, 5, 1, 2), [[4, 9, 8, -1, -1]])


def test_garbage_past_length_is_ignored():
  # Row [1, 2, 3] has no earlier match; the garbage repeats the suffix and would match if it were read.
  toks = np.array([[1, 2, 3, 1, 2, 3, 1, 2, 3, 4]], np.int32)
  np.testing.assert_array_equal(draft(toks, np.array([3], np.int32), 2, 1, 3), [[-1, -1]])
  # With a real match, the continuation stops at the length, not in the garbage. Row [5, 1, 2, 5]:
  toks = np.array([[5, 1, 2, 5, 1, 2, 5, 1, 2, 5]], np.int32)
  np.testing.assert_array_equal(draft(toks, np.array([4], np.int32), 4, 1, 3), [[1, 2, 5, -1]])


def test_short_rows_and_mixed_batch():
  toks, lens = pad_rows([[], [4], [4, 4], [1, 2, 1, 2]], 6, fill=4)
  np.testing.assert_array_equal(draft(toks, lens, 3, 1, 2), [[-1, -1, -1], [-1, -1, -1], [4, -1, -1], [1, 2, -1]])
  # ngram_min = 2 needs a length >= 3.
  np.testing.assert_array_equal(draft(toks, lens, 3, 2, 2)[:3], -np.ones((3, 3), np.int32))


def test_inside_while_loop():
  # Appending the draft's first token each step is a copy loop.
  row = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1]
  toks, lens = pad_rows([row, [7, 7]], 32)

  def body(c):
    t, L, i = c
    d = ngram_draft(t, L, k=2, ngram_min=1, ngram_max=3)
    t = t.at[jnp.arange(2), L].set(jnp.where(d[:, 0] >= 0, d[:, 0], 0))
    return t, L + 1, i + 1

  t, _, _ = jax.jit(lambda t, L: jax.lax.while_loop(lambda c: c[2] < 6, body, (t, L, 0)))(
      jnp.asarray(toks), jnp.asarray(lens))
  t = np.asarray(t)
  np.testing.assert_array_equal(t[0, :16], row + [4, 1, 5, 9, 2, 6])
  np.testing.assert_array_equal(t[1, :8], [7] * 8)


@pytest.mark.parametrize("k,nmin,nmax", [(0, 1, 2), (-1, 1, 2), (2, 0, 2), (2, 3, 2), (2.5, 1, 2), (2, 1, True)])
def test_invalid_args(k, nmin, nmax):
  with pytest.raises(ValueError):
    ngram_draft(jnp.zeros((1, 8), jnp.int32), jnp.array([4], jnp.int32), k=k, ngram_min=nmin, ngram_max=nmax)


def test_invalid_shapes():
  with pytest.raises(ValueError):
    ngram_draft(jnp.zeros((8,), jnp.int32), jnp.array([4]), k=1, ngram_min=1, ngram_max=1)
  with pytest.raises(ValueError):
    ngram_draft(jnp.zeros((2, 8), jnp.int32), jnp.array([4]), k=1, ngram_min=1, ngram_max=1)
  with pytest.raises(ValueError):
    ngram_draft(jnp.zeros((1, 8), jnp.float32), jnp.array([4]), k=1, ngram_min=1, ngram_max=1)
