"""A grammar compiled to a token automaton the decode loop steps on device.

outlines-core compiles a regular expression over bytes into a DFA over *tokens* (`Index`: state x token ->
state, every tokenization of a valid text allowed). We store it in two dense arrays:
- `classes` int32[V]: tokens that behave alike in every state share a class (all the letters-only tokens of a
  free string, say); a 262k vocabulary falls to a few hundred classes;
- `table` int32[S, C]: the next state after a token of class c in state s, or -1 (the token is not allowed).
So the allowed set of state s is `table[s, classes] >= 0` (one gather over V) and the next state one lookup: no
host round trip, no per-step host mask. The model's stop tokens form one class of their own whose entry is the
state itself in accepting states and -1 elsewhere: EOS is allowed exactly where the text is complete.
`forced` int32[S]: a token the grammar forces (its bytes come next whatever the tokenization: `_forced`), -1 where
the grammar leaves a choice: drafted for free.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading

import numpy as np

from spec_jax.grammar.token_bytes import token_bytes

MAX_REGEX_CHARS = 20_000  # larger patterns are refused (a 400): outlines-core's build time grows with them
MAX_TABLE = 8_000_000  # states x classes entries an automaton may hold (32 MB of int32)


class GrammarError(ValueError):
  """The grammar cannot be compiled (the message says why); the server answers 400."""


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
  classes: np.ndarray  # int32[V]
  table: np.ndarray  # int32[S, C]
  forced: np.ndarray  # int32[S]
  initial: int
  stop_token: int  # one of the stop tokens (their class is the stop class)

  @property
  def num_states(self) -> int:
    return self.table.shape[0]

  @property
  def num_classes(self) -> int:
    return self.table.shape[1]

  def next_state(self, state: int, token: int) -> int:
    return int(self.table[state, self.classes[token]]) if state >= 0 else -1

  def allowed(self, state: int) -> np.ndarray:
    """int ids of the tokens allowed in `state` (host side: tests and tools)."""
    return np.nonzero(self.table[state, self.classes] >= 0)[0]

  def accepts(self, tokens) -> bool:
    """Does the token sequence end in an accepting state (stop tokens excluded)?"""
    s = self.initial
    for t in tokens:
      s = self.next_state(s, int(t))
      if s < 0:
        return False
    return bool(self.table[s, self.classes[self.stop_token]] >= 0)


def _column_hash(num_vocab: int, per_state, prime: int) -> np.ndarray:
  """uint64[V]: a hash of each token's column (its next state in every state, -1 where not allowed)."""
  h = np.zeros(num_vocab, np.uint64)
  col = np.empty(num_vocab, np.uint64)
  with np.errstate(over="ignore"):
    for toks, nxt in per_state:
      col.fill(0)
      col[toks] = nxt.astype(np.uint64) + np.uint64(1)
      h = h * np.uint64(prime) + col
  return h


def _forced(table: np.ndarray, classes: np.ndarray, token_bytes: list, limit: int = 64) -> np.ndarray:
  """Per state: the longest allowed token whose bytes every valid continuation begins with, or -1.

  Every allowed token being a byte-prefix of the longest one is not enough: after `"name` Gemma's vocabulary
  allows `"`, `":` and `":"","` (all prefixes of the last), yet the text may go on `": "` too. So a candidate's
  bytes count as forced only when, down every tokenization, each allowed token either starts with the bytes still
  to come or is a prefix of them (and the bytes after it are forced the same way from the state it leads to)."""
  S, C = table.shape
  class_size = np.bincount(classes, minlength=C)
  order = np.argsort(classes, kind="stable")
  starts = np.searchsorted(classes[order], np.arange(C + 1))
  memo: dict = {}

  def allowed(s: int):
    """(class, token) pairs allowed in s, or None when more than `limit` tokens are (a free choice)."""
    ok = np.nonzero(table[s] >= 0)[0]
    if not 0 < class_size[ok].sum() <= limit:
      return None
    return [(c, t) for c in ok for t in order[starts[c]:starts[c + 1]]]

  def comes_next(s: int, rest: bytes) -> bool:
    if not rest:
      return True
    if (s, rest) not in memo:
      pairs, ok = allowed(s), True
      for c, t in pairs or ():
        b = token_bytes[t]
        if not b:  # a stop token: the text may end here
          ok = False
        elif not b.startswith(rest):
          ok = rest.startswith(b) and comes_next(int(table[s, c]), rest[len(b):])
        if not ok:
          break
      memo[(s, rest)] = ok and pairs is not None
    return memo[(s, rest)]

  forced = np.full(S, -1, np.int32)
  for s in range(S):
    pairs = allowed(s)
    if pairs is None or any(not token_bytes[t] for _, t in pairs):
      continue
    # longest first; equal bytes: the highest id (SentencePiece's byte-fallback pieces come first, and a model
    # emits the merged piece)
    for _, t in sorted(pairs, key=lambda p: (-len(token_bytes[p[1]]), -p[1])):
      if comes_next(s, token_bytes[t]):
        forced[s] = t
        break
  return forced


def from_regex(regex: str, token_bytes: list, stop_ids) -> TokenAutomaton:
  """Compile `regex` (outlines-core's dialect) for a vocabulary (`token_bytes`: bytes per id, None for specials;
  spec_jax/grammar/token_bytes.py). GrammarError on a pattern outlines-core rejects or one too large."""
  from outlines_core import Index, Vocabulary  # lazy: heavy, only this path (outlines_core)
  if len(regex) > MAX_REGEX_CHARS:
    raise GrammarError(f"the pattern has {len(regex)} characters; at most {MAX_REGEX_CHARS}")
  V = len(token_bytes)
  stop_ids = sorted(int(t) for t in stop_ids if 0 <= int(t) < V)
  if not stop_ids:
    raise GrammarError("the tokenizer has no stop token to end a constrained output with")
  by_bytes: dict = {}
  for i, b in enumerate(token_bytes):
    if b and i not in stop_ids:
      by_bytes.setdefault(b, []).append(i)
  try:
    index = Index(regex, Vocabulary(stop_ids[0], by_bytes))
  except Exception as e:  # outlines-core raises ValueError / its own errors with the reason
    raise GrammarError(f"the grammar cannot be compiled: {e}") from None
  transitions = index.get_transitions()
  finals = set(index.get_final_states())
  ids = {s: i for i, s in enumerate(sorted(set(transitions) | finals | {index.get_initial_state()}))}
  per_state = []
  for s in sorted(ids, key=ids.get):
    d = transitions.get(s, {})
    toks = np.fromiter(d.keys(), np.int64, len(d))
    nxt = np.fromiter((ids[n] for n in d.values()), np.int64, len(d))
    keep = ~np.isin(toks, stop_ids)  # outlines lists EOS in final states; ours is the stop class below
    per_state.append((toks[keep], nxt[keep]))
  S = len(ids)
  h = np.stack([_column_hash(V, per_state, p) for p in (1_000_003, 998_244_353)], axis=1)
  h[stop_ids] = np.iinfo(np.uint64).max  # the stop tokens: a class of their own
  _, first, classes = np.unique(h, axis=0, return_index=True, return_inverse=True)
  classes = classes.reshape(-1).astype(np.int32)
  C = len(first)
  if S * C > MAX_TABLE:
    raise GrammarError(f"the grammar compiles to {S} states x {C} token classes, over the limit of {MAX_TABLE}")
  table = np.full((S, C), -1, np.int32)
  rep_class = classes  # token -> class; fill per state through the tokens it allows
  for s, (toks, nxt) in enumerate(per_state):
    table[s, rep_class[toks]] = nxt
  stop_class = classes[stop_ids[0]]
  for s in finals:
    table[ids[s], stop_class] = ids[s]
  return TokenAutomaton(classes=classes, table=table, forced=_forced(table, classes, token_bytes),
                        initial=ids[index.get_initial_state()], stop_token=stop_ids[0])


class Compiler:
  """Compiles and caches automata for one tokenizer (compiling a schema at a 262k vocabulary takes 0.5-10 s).
  Thread-safe: callers asking for a pattern that is being compiled wait for that compile (a burst of requests
  with one schema compiles it once); the last CACHE_SIZE automata are kept."""

  CACHE_SIZE = 64

  def __init__(self, tokenizer, stop_ids=None):
    self.token_bytes = token_bytes(tokenizer)
    self.stop_ids = tuple(sorted(tokenizer.stop_ids if stop_ids is None else stop_ids))
    self.vocab_size = len(self.token_bytes)
    self.compiles = 0  # patterns compiled (not served from the cache or another caller's compile)
    self._lock = threading.Lock()
    self._done: collections.OrderedDict = collections.OrderedDict()  # pattern -> automaton, oldest use first
    self._pending: dict = {}  # pattern -> Future of its compile in progress

  def regex(self, pattern: str) -> TokenAutomaton:
    with self._lock:
      if pattern in self._done:
        self._done.move_to_end(pattern)
        return self._done[pattern]
      fut = self._pending.get(pattern)
      mine = fut is None
      if mine:
        fut = self._pending[pattern] = concurrent.futures.Future()
        self.compiles += 1
    if not mine:
      return fut.result()  # another caller's compile (its GrammarError too)
    try:
      out = from_regex(pattern, self.token_bytes, self.stop_ids)
    except BaseException as e:
      with self._lock:
        del self._pending[pattern]
      fut.set_exception(e)
      raise
    with self._lock:
      del self._pending[pattern]
      self._done[pattern] = out
      while len(self._done) > self.CACHE_SIZE:
        self._done.popitem(last=False)
    fut.set_result(out)
    return out
