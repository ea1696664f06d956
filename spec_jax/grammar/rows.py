"""The grammar rows of a decode state: each row's automaton (spec_jax/grammar/automaton.py) and its state, as
arrays the jitted loop reads.

GrammarRows [B]: classes int32[B, V], table int32[B, S, C] (-1 padded to the batch's capacity S x C), forced
int32[B, S], state int32[B]: the automaton state after the row's committed tokens (-1: the row is not
constrained). A batch with no constrained row carries no GrammarRows at all (Controls.grammar None): no cost.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from spec_jax.grammar.automaton import TokenAutomaton


@struct.dataclass
class GrammarRows:
  classes: jax.Array
  table: jax.Array
  forced: jax.Array
  state: jax.Array

  @property
  def capacity(self) -> tuple:
    return tuple(self.table.shape[1:])

  @classmethod
  def make(cls, automata: Sequence[Optional[TokenAutomaton]], vocab: int,
           capacity: Optional[tuple] = None) -> "GrammarRows":
    """One row per entry (None: unconstrained). capacity (S, C): the padded table size (None: the largest
    automaton's); ValueError when an automaton does not fit it."""
    S = max([a.num_states for a in automata if a is not None] + [1])
    C = max([a.num_classes for a in automata if a is not None] + [1])
    if capacity is not None:
      if S > capacity[0] or C > capacity[1]:
        raise ValueError(f"the grammar compiles to {S} states x {C} token classes; this server holds at most "
                         f"{capacity[0]} x {capacity[1]} (--grammar_capacity)")
      S, C = capacity
    B = len(automata)
    classes = np.zeros((B, vocab), np.int32)
    table = np.full((B, S, C), -1, np.int32)
    forced = np.full((B, S), -1, np.int32)
    state = np.full((B,), -1, np.int32)
    for b, a in enumerate(automata):
      if a is None:
        continue
      if a.classes.shape[0] != vocab:
        raise ValueError(f"the grammar was compiled for a vocabulary of {a.classes.shape[0]}, not {vocab}")
      classes[b] = a.classes
      table[b, :a.num_states, :a.num_classes] = a.table
      forced[b, :a.num_states] = a.forced
      state[b] = a.initial
    return cls(classes=jnp.asarray(classes), table=jnp.asarray(table), forced=jnp.asarray(forced),
               state=jnp.asarray(state))


def grammar_controls(controls, automaton: Optional[TokenAutomaton], capacity: Optional[tuple], vocab: int):
  """A one-row Controls with the row's grammar at a state's capacity (None: the state has no grammar rows, so a
  grammar is a ValueError). An unconstrained row carries none: `slots.insert` gives it a blank row on device."""
  if automaton is None:
    return controls
  if capacity is None:
    raise ValueError("structured outputs are off on this server (start it with --grammar_capacity)")
  return controls.replace(grammar=GrammarRows.make([automaton], vocab, tuple(capacity)))


def blank_like(g: GrammarRows, rows: int) -> GrammarRows:
  """Unconstrained rows (state -1) shaped as `g`'s, built on device (inside jit)."""
  return GrammarRows(classes=jnp.zeros((rows,) + g.classes.shape[1:], jnp.int32),
                     table=jnp.full((rows,) + g.table.shape[1:], -1, jnp.int32),
                     forced=jnp.full((rows,) + g.forced.shape[1:], -1, jnp.int32),
                     state=jnp.full((rows,), -1, jnp.int32))


DEAD = -2  # a path state after a token the grammar does not allow (never verified: that draft is rejected)


def _step(g: GrammarRows, states, tokens):
  """Next states [B, ...] from states [B, ...] (< 0 stays: -1 unconstrained, DEAD) by tokens [B, ...]."""
  B = states.shape[0]
  bi = jnp.arange(B).reshape((B,) + (1,) * (states.ndim - 1))
  cls = g.classes[bi, jnp.maximum(tokens, 0)]
  nxt = g.table[bi, jnp.maximum(states, 0), cls]
  nxt = jnp.where(nxt >= 0, nxt, DEAD)
  return jnp.where(states >= 0, jnp.where(tokens >= 0, nxt, DEAD), states)


def path_states(g: GrammarRows, tokens, parents):
  """int32[B, T]: the automaton state after each node's path, node 0 (the last committed token) being the row's
  state; tokens int32[B, T] (node 0's ignored; < 0: no node), parents int32[B, T] (< own index; node 0's -1).
  A chain is the tree whose parents are i - 1."""
  B, T = tokens.shape
  out = jnp.zeros((B, T), jnp.int32).at[:, 0].set(g.state)
  for i in range(1, T):  # T is a chain's k + 1 or a tree's node count: small and static
    par = jnp.take_along_axis(out, jnp.maximum(parents[:, i:i + 1], 0), axis=1)[:, 0]
    out = out.at[:, i].set(_step(g, par, tokens[:, i]))
  return out


def chain_parents(B: int, T: int):
  return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :] - 1, (B, T))


def mask(logits, g: GrammarRows, states):
  """logits [B, T, V] with the tokens position t's state does not allow at -inf (positions whose state is < 0
  unchanged: unconstrained rows, and dead paths, which verification never reaches)."""
  B = logits.shape[0]

  def run(x):
    bi = jnp.arange(B)[:, None, None]
    row = g.table[bi, jnp.maximum(states, 0)[:, :, None], g.classes[:, None, :]]  # [B, T, V]
    return jnp.where((states >= 0)[:, :, None] & (row < 0), -jnp.inf, x)

  return jax.lax.cond(jnp.any(g.state >= 0), run, lambda x: x, logits)


def advance(g: GrammarRows, out, n_emit) -> GrammarRows:
  """The rows' states after committing out[b, :n_emit[b]]."""
  s = g.state
  for j in range(out.shape[1]):
    s = jnp.where(j < n_emit, _step(g, s, out[:, j]), s)
  return g.replace(state=s)


def advance_over(g: GrammarRows, tokens, start, stop) -> GrammarRows:
  """The rows' states after tokens[b, start[b]:stop[b]] (a loop: the span may be long, e.g. a recomputed row's
  streamed tokens)."""
  def body(j, s):
    tok = jnp.take_along_axis(tokens, jnp.clip(j, 0, tokens.shape[1] - 1)[:, None], axis=1)[:, 0]
    return jnp.where(j < stop, _step(g, s, tok), s)
  n = jnp.max(stop - start)
  s = jax.lax.fori_loop(0, n, lambda i, s: body(start + i, s), g.state)
  return g.replace(state=s)


def forced_chain(g: GrammarRows, drafts, draft_probs):
  """Drafts [B, k] with every position the grammar forces (after the drafts before it) replaced by the forced
  token, and draft_probs [B, k, V] (None: deterministic drafts) one-hot there: the q that drew it. Positions
  after a draft the grammar does not allow are left to the proposer (they are never verified)."""
  B, k = drafts.shape
  s = g.state
  outs, is_forced = [], []
  for j in range(k):
    f = jnp.where(s >= 0, g.forced[jnp.arange(B), jnp.maximum(s, 0)], -1)
    tok = jnp.where(f >= 0, f, drafts[:, j])
    outs.append(tok)
    is_forced.append(f >= 0)
    s = _step(g, s, tok)
  tokens = jnp.stack(outs, axis=1) if k else drafts
  if draft_probs is not None and k:
    forced = jnp.stack(is_forced, axis=1)
    onehot = jax.nn.one_hot(tokens, draft_probs.shape[-1], dtype=draft_probs.dtype)
    draft_probs = jnp.where(forced[:, :, None], onehot, draft_probs)
  return tokens, draft_probs


def forced_tree(g: GrammarRows, tokens, parents):
  """Tree drafts [B, N] (node 0 the root; < 0: no node) with the grammar's forced tokens drafted: where the state
  after a node's path forces a token f and none of its children drafts f already, the first child whose draft the
  grammar does not allow there drafts f instead (a sure rejection becomes a likely acceptance; the children it
  allows keep their drafts, since f's bytes only begin theirs). Where the grammar leaves f alone, every other child
  is such a child. Verification is exact whatever the tree holds (deterministic children: the target's own draw
  is matched). The states follow the new tokens (nodes come after their parents)."""
  B, N = tokens.shape
  rows = jnp.arange(B)
  states = jnp.zeros((B, N), jnp.int32).at[:, 0].set(g.state)
  out = tokens
  for i in range(1, N):  # N is the tree's node count: small and static
    s = states[rows, jnp.maximum(parents[:, i], 0)]
    f = jnp.where(s >= 0, g.forced[rows, jnp.maximum(s, 0)], -1)
    siblings = (parents == parents[:, i:i + 1]) & (tokens >= 0)  # [B, N], node i among them when it is a node
    refused = siblings & (_step(g, jnp.broadcast_to(s[:, None], (B, N)), tokens) < 0)
    first_refused = jnp.any(refused, axis=1) & (jnp.argmax(refused, axis=1) == i)
    has_f = jnp.any(siblings & (tokens == f[:, None]), axis=1)
    tok = jnp.where((f >= 0) & first_refused & ~has_f, f, tokens[:, i])
    out = out.at[:, i].set(tok)
    states = states.at[:, i].set(_step(g, s, tok))
  return out
