"""Which grammar library fits the jitted loop: compile time and per-step mask cost at Gemma 3's 262k vocabulary
for llguidance and xgrammar (host masks), beside outlines-core's token automaton (benchmarks/reports/grammar).

  .venv/bin/python -m benchmarks.probes.grammar_libraries --dump /tmp/gemma_tb.pkl    # Gemma's token bytes
  python3 -m venv /tmp/venv-grammar && /tmp/venv-grammar/bin/pip install llguidance xgrammar outlines-core numpy
  /tmp/venv-grammar/bin/python benchmarks/probes/grammar_libraries.py /tmp/gemma_tb.pkl
(outlines-core inside spec_jax: spec_jax.grammar.automaton.Compiler(load_tokenizer()).regex(...) timed.)
"""
import json
import pickle
import sys
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                           "rating": {"type": "number"}, "kind": {"enum": ["book", "film", "song"]}},
          "required": ["title", "year", "tags", "rating", "kind"]}
DOC = b'{"title": "Dune", "year": 1965, "tags": ["sf", "desert"], "rating": 4.5, "kind": "book"}'


def main():
  if sys.argv[1] == "--dump":
    from spec_jax.checkpoints.load import load_tokenizer
    from spec_jax.grammar.token_bytes import token_bytes
    t = load_tokenizer()
    pickle.dump((token_bytes(t), t.eos_id), open(sys.argv[2], "wb"))
    return
  tb, eos = pickle.load(open(sys.argv[1], "rb"))
  V = len(tb)
  toks = [b if b is not None else b"" for b in tb]
  first = {}
  for i, b in enumerate(tb):
    if b:
      first.setdefault(b, i)

  def encode(s):  # longest match: a tokenization the grammars accept
    s = s if isinstance(s, bytes) else s.encode()
    out, p = [], 0
    while p < len(s):
      for n in range(min(16, len(s) - p), 0, -1):
        if s[p:p + n] in first:
          out.append(first[s[p:p + n]])
          p += n
          break
      else:
        p += 1
    return out

  seq = encode(DOC)
  import llguidance
  import llguidance.numpy as lnp

  class Tok:
    eos_token_id, bos_token_id, tokens = eos, 2, toks
    special_token_ids = [i for i, b in enumerate(tb) if b is None]

    def __call__(self, s):
      return encode(s)

  t = time.time()
  m = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok())),
                           llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
  print("llguidance compile s", round(time.time() - t, 3))
  bm, ts = lnp.allocate_token_bitmask(1, V), []
  for tok in seq:
    t = time.perf_counter()
    lnp.fill_next_token_bitmask(m, bm, 0)
    ts.append(time.perf_counter() - t)
    assert m.consume_token(tok), m.get_error()
  print("llguidance mask ms median", round(np.median(ts) * 1e3, 3), "max", round(max(ts) * 1e3, 3))
  import xgrammar as xgr
  comp = xgr.GrammarCompiler(xgr.TokenizerInfo(toks, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[eos]))
  t = time.time()
  mt = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA)))
  print("xgrammar compile s", round(time.time() - t, 3))
  bm, ts = xgr.allocate_token_bitmask(1, V), []
  for tok in seq:
    t = time.perf_counter()
    mt.fill_next_token_bitmask(bm, 0)
    ts.append(time.perf_counter() - t)
    assert mt.accept_token(tok)
  print("xgrammar mask ms median", round(np.median(ts) * 1e3, 3), "max", round(max(ts) * 1e3, 3))


if __name__ == "__main__":
  main()
