"""Structured outputs on Gemma 3 270M (its 262k vocabulary, its tokenizer's bytes): every output valid against
its schema, and n-gram speculation (with grammar-forced drafts) token-identical to plain constrained decoding."""

import json

import pytest

from spec_jax.batch import generate
from spec_jax.controls import Controls
from spec_jax.grammar import automaton, formats
from spec_jax.grammar.rows import GrammarRows

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                      "city": {"type": "string", "maxLength": 20}},
     "required": ["name", "age", "city"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confident": {"type": "boolean"}}, "required": ["sentiment", "confident"]},
]
PROMPTS = ["Describe Alice, 31, from Lyon, as JSON.", "Is 'I loved this film' positive? Answer in JSON.",
           "Give a person record for Bob, aged 45, living in Oslo.", "How does 'the food was cold' sound? JSON."]


@pytest.mark.slow
def test_gemma3_constrained_outputs_are_valid_and_speculation_is_exact(gemma3_f32, gemma3_tokenizer):
  from spec_jax.proposers.ngram import NgramProposer
  config, params = gemma3_f32
  tok = gemma3_tokenizer
  comp = automaton.Compiler(tok, config.eos_ids)
  autos = [comp.regex(formats.json_schema_regex(SCHEMAS[i % 2])) for i in range(len(PROMPTS))]
  prompts = [tok.encode(tok.apply_chat_template([p])) for p in PROMPTS]
  c = Controls.stack([Controls.make(1)] * len(prompts)).replace(grammar=GrammarRows.make(autos, config.vocab_size))
  plain = generate(params, config, prompts, max_new_tokens=48, controls=c)
  spec = generate(params, config, prompts, max_new_tokens=48, controls=c, proposer=NgramProposer(k=4),
                  adaptive_k=False)
  assert spec.token_ids == plain.token_ids
  assert spec.stats["accepted_tokens"] > 0
  for i, (ids, fin) in enumerate(zip(plain.token_ids, plain.finish_reasons)):
    assert fin == "stop", (i, tok.decode(ids))
    value = json.loads(tok.decode(ids[:-1]))
    assert set(value) == set(SCHEMAS[i % 2]["required"]), value
