"""Constrained decoding in the loop: every output valid, and speculative output exactly plain constrained
decoding's (greedy identical for chains and trees; the sampled distribution the same)."""

import functools
import json

import numpy as np
import pytest

from spec_jax.batch import generate
from spec_jax.controls import Controls
from spec_jax.grammar import automaton, formats
from spec_jax.grammar.rows import GrammarRows
from tests.grammar.vocab import token_bytes
from tests.proposers.test_medusa_eagle import CONFIG, _params, _prompts
from tests.test_slots import _proposer

STOPS = (1,)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"enum": [7, 30, 65]},
                                            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
          "required": ["name", "age", "tags"]}
GRAMMARS = {"schema": formats.json_schema_regex(SCHEMA), "choice": formats.choice_regex(["yes", "no", "maybe"]),
            "regex": "[a-e]{2,5}(-[0-9]+)?", "json_object": formats.json_object_regex()}


@functools.lru_cache(maxsize=None)
def _auto(name):
  return automaton.from_regex(GRAMMARS[name], token_bytes(CONFIG.vocab_size), STOPS)


def _text(ids):
  tb = token_bytes(CONFIG.vocab_size)
  return b"".join(tb[i] for i in ids if i not in STOPS).decode()


def _controls(autos):
  n = len(autos)
  return Controls.stack([Controls.make(1)] * n).replace(grammar=GrammarRows.make(autos, CONFIG.vocab_size))


def _valid(name, ids, finish):
  """Finished by a stop token: the text before it is in the grammar (and parses, for the JSON ones); cut at the
  token limit: a prefix of the grammar's language (the one way to get an incomplete output, as OpenAI's)."""
  a = _auto(name)
  if finish == "length":
    s = a.initial
    for t in ids:
      s = a.next_state(s, t)
    return s >= 0
  if not ids or ids[-1] not in STOPS or not a.accepts(ids[:-1]):
    return False
  if name in ("schema", "json_object"):
    json.loads(_text(ids))
  return True


def test_automaton_allows_exactly_the_continuations_of_the_grammar():
  a = _auto("choice")
  tb = token_bytes(CONFIG.vocab_size)
  first = {tb[t] for t in a.allowed(a.initial)}
  assert first == {b"y", b"yes", b"n", b"no", b"m", b"maybe"}
  s = a.next_state(a.next_state(a.initial, tb.index(b"m")), tb.index(b"a"))
  assert {tb[t] for t in a.allowed(s)} == {b"y"}  # "ma" + "y" + "be": one way on
  assert a.forced[s] == tb.index(b"y")
  s_yes = a.next_state(a.initial, tb.index(b"yes"))
  assert list(a.allowed(s_yes)) == [1]  # complete: only the stop token
  assert a.accepts([tb.index(b"no")]) and not a.accepts([tb.index(b"n")])
  assert a.num_classes < 20  # 97 tokens, a handful of behaviours


def test_bad_grammars_say_why():
  with pytest.raises(automaton.GrammarError, match="cannot be compiled"):
    automaton.from_regex("(unclosed", token_bytes(CONFIG.vocab_size), STOPS)
  with pytest.raises(automaton.GrammarError, match="at most"):
    formats.check_regex("a" * (automaton.MAX_REGEX_CHARS + 1))
  with pytest.raises(automaton.GrammarError, match="non-empty list"):
    formats.choice_regex([])
  with pytest.raises(automaton.GrammarError, match="JSON schema"):
    formats.json_schema_regex({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "eagle_tree", "medusa_tree"])
def test_greedy_constrained_is_valid_and_speculation_equals_plain(method):
  params = _params(1)
  names = ["schema", "choice", "regex", "json_object", None]
  prompts = _prompts(7, [11, 8, 14, 9, 10])
  autos = [None if n is None else _auto(n) for n in names]
  c = _controls(autos)
  plain = generate(params, CONFIG, prompts, max_new_tokens=60, stop_ids=STOPS, controls=c)
  for name, ids, fin in zip(names, plain.token_ids, plain.finish_reasons):
    if name is not None:
      assert _valid(name, ids, fin), (name, _text(ids))
      assert fin == "stop" or name == "json_object", (name, _text(ids))  # the others end within the limit
  free = generate(params, CONFIG, prompts, max_new_tokens=60, stop_ids=STOPS)
  assert free.token_ids[-1] == plain.token_ids[-1]  # the unconstrained row is untouched
  assert free.token_ids[0] != plain.token_ids[0]
  if method == "none":
    return
  proposer, pparams = _proposer(method, params)
  spec = generate(params, CONFIG, prompts, max_new_tokens=60, stop_ids=STOPS, controls=c, proposer=proposer,
                  proposer_params=pparams, adaptive_k=False)
  assert spec.token_ids == plain.token_ids
  assert spec.stats["drafted_tokens"] > 0


def test_forced_tokens_are_bytes_every_continuation_begins_with():
  """After `"a`, JSON allows `"` then an optional space before `:`: the token `":"` is allowed and every allowed
  token is a prefix of it, yet `" :` may follow, so only `"` is forced. Two ids with the same bytes: the later
  (SentencePiece's byte-fallback pieces come first)."""
  tb = [None, None, b'"', b"a", b":", b" ", b'":"', b"b", b"{", b"{"]
  a = automaton.from_regex('\\{"a"[ ]?:[ ]?"b"', tb, (1,))
  assert a.forced[a.initial] == 9
  s = a.initial
  for t in (9, 2, 3):  # {"a
    s = a.next_state(s, t)
  assert {tb[t] for t in a.allowed(s)} == {b'"', b'":"'} and a.forced[s] == 2
  s = a.next_state(s, 2)  # {"a": a space or the colon
  assert a.forced[s] == -1
  assert a.forced[a.next_state(s, 5)] == 4  # {"a" : the colon


def test_forced_tokens_fill_a_refused_child_of_a_tree():
  """At each node the forced token takes the place of the first child the grammar refuses, unless a child drafts
  it already; children it allows keep their drafts; a node's state follows its new parent."""
  import jax.numpy as jnp
  from spec_jax.grammar import rows as grammar_rows
  tb = [None, None, b'"', b"a", b":", b" ", b'":"', b"b", b"{", b"{"]
  a = automaton.from_regex('\\{"a"[ ]?:[ ]?"b"', tb, (1,))
  g = GrammarRows.make([a] * 3, len(tb))
  #            root  1  2  3 (child of 1)  4 (child of 2)
  parents = [[-1, 0, 0, 1, 2]] * 3
  tokens = [[0, 3, 5, 7, 7],  # both children refused: the first drafts "{" (9); below it '"' (2) is forced
            [0, 8, 3, 7, 7],  # "{" as id 8 is allowed and kept; the refused second child drafts 9
            [0, 3, 9, 7, 7]]  # a child drafts 9 already: nothing changes but below it
  got = np.asarray(grammar_rows.forced_tree(g, jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32)))
  assert got.tolist() == [[0, 9, 5, 2, 7], [0, 8, 9, 2, 2], [0, 3, 9, 7, 2]]


@pytest.mark.parametrize("method", ["eagle_tree", "medusa_tree"])
def test_trees_draft_the_forced_tokens(method):
  """Grammar-forced tokens are drafts in trees too: more drafts accepted than with the forced table blanked, and
  the output is plain constrained decoding's either way."""
  import dataclasses
  params = _params(1)
  names = ["schema", "schema", "json_object", "choice"]
  prompts = _prompts(5, [11, 8, 14, 9])
  proposer, pparams = _proposer(method, params)
  plain = generate(params, CONFIG, prompts, max_new_tokens=40, stop_ids=STOPS,
                   controls=_controls([_auto(n) for n in names]))
  accepted = {}
  for forced in (True, False):
    autos = [_auto(n) if forced else dataclasses.replace(_auto(n), forced=np.full_like(_auto(n).forced, -1))
             for n in names]
    spec = generate(params, CONFIG, prompts, max_new_tokens=40, stop_ids=STOPS, controls=_controls(autos),
                    proposer=proposer, proposer_params=pparams, adaptive_k=False)
    assert spec.token_ids == plain.token_ids
    accepted[forced] = spec.stats["accepted_tokens"]
  assert accepted[True] > accepted[False] + 10, accepted


def test_sampled_constrained_keeps_the_distribution_with_forced_drafts_and_controls():
  """With a penalty and min_p as well, on 8 tokens: plain constrained decoding against a sampling draft model (its
  q, one-hot where the grammar forces a token) by chi-square on the first 3 sampled tokens, and against n-gram
  (deterministic drafts) by token identity."""
  import jax
  from spec_jax.config import SamplingParams
  from spec_jax.models.transformer import init_params
  from spec_jax.proposers.draft import DraftModelProposer
  from spec_jax.proposers.ngram import NgramProposer
  from tests.conftest import tiny_gemma_config
  from tests.distribution import PROMPT, assert_commits_plain_tokens, assert_same_distribution
  from tests.distribution import sample_plain_and_speculative
  config = tiny_gemma_config(vocab_size=8, eos_ids=(1,))
  params = init_params(config, jax.random.PRNGKey(3))
  dcfg = config.replace(num_layers=1)
  tb = [None, None, b"a", b"b", b"c", b"ab", b"ba", b"ca"]
  auto = automaton.from_regex("(ab|ba|c){6,}", tb, (1,))  # ends no sooner than the 4th token
  assert (auto.forced >= 0).any()  # after "a", "b" or "ba": "ba" is drafted
  n = 500
  c = Controls.stack([Controls.make(1, presence=0.5, min_p=0.05, vocab_size=8)] * n)
  c = c.replace(grammar=GrammarRows.make([auto] * n, 8))
  samp = SamplingParams.make(n, temperature=1.0)
  draft = DraftModelProposer(config=dcfg, k=2)
  plain, specd, rates = sample_plain_and_speculative(params, config, draft, init_params(dcfg, jax.random.PRNGKey(4)),
                                                     n=n, calls=4, sampling=samp, controls=c)
  assert np.mean(rates) > 0.02
  assert_same_distribution(plain, specd)
  # n-gram's drafts are deterministic: token identity with plain sampling (tests/distribution.py)
  rate, plain_ngram = assert_commits_plain_tokens(params, config, NgramProposer(k=2), {}, n=n, sampling=samp,
                                                  controls=c)
  assert rate > 0.02
  for rows in (plain, plain_ngram):
    for row in rows[:50]:  # every sample is a prefix the grammar allows
      s = auto.initial
      for t in row:
        s = auto.next_state(s, int(t))
      assert s >= 0
  # the grammar changes this distribution: unconstrained, "a" is followed by other than "b" or "ba"
  no_stop = Controls.stack([Controls.make(1, min_tokens=3, vocab_size=8)] * n)  # 3 tokens in every row
  free = np.array(generate(params, config, [PROMPT] * n, max_new_tokens=3, sampling=samp, seed=100,
                           controls=no_stop).token_ids)
  after_a = lambda x: x[x[:, 0] == 2, 1]
  assert not set(after_a(free)) <= {3, 6} and set(after_a(plain)) <= {3, 6} and len(after_a(plain))


def test_concurrent_callers_of_one_pattern_share_one_compile(tmp_path):
  """A burst of requests with one schema (agents) compiles it once: the other callers wait for that compile and
  get the same automaton; a bad pattern's error is not cached."""
  import threading
  from concurrent.futures import ThreadPoolExecutor
  from spec_jax.checkpoints.load import load_tokenizer
  from tests.serve.test_server import write_tiny_model
  write_tiny_model(tmp_path / "tiny.gguf")
  comp = automaton.Compiler(load_tokenizer(str(tmp_path / "tiny.gguf")))
  schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 12} for i in range(6)},
            "required": [f"f{i}" for i in range(6)]}
  pattern = formats.json_schema_regex(schema)
  start = threading.Barrier(6)

  def call(p):
    start.wait()
    return comp.regex(p)

  with ThreadPoolExecutor(6) as pool:
    got = list(pool.map(call, [pattern] * 6))
  assert comp.compiles == 1 and all(a is got[0] for a in got)
  assert comp.regex(pattern) is got[0] and comp.compiles == 1  # cached
  for n in (2, 3):  # a bad pattern: its error every time, never cached
    with pytest.raises(automaton.GrammarError):
      comp.regex("(unclosed")
    assert comp.compiles == n
