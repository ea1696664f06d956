"""What a request asks for (a JSON schema, any JSON object, a regex, a choice of strings) as the regular
expression the automaton is compiled from (spec_jax/grammar/automaton.py).

JSON schemas go through outlines-core's translator (`build_regex_from_schema`): objects list their properties in
the schema's order, whitespace is at most one space where JSON allows it, and `{"type": "object"}` with no
properties (json_object) is any JSON object nested a few levels deep: JSON itself is not regular, so depth is
bounded. GrammarError names what cannot be compiled.
"""

from __future__ import annotations

import json

from spec_jax.grammar.automaton import MAX_REGEX_CHARS, GrammarError

_SPECIAL = set("\\.^$|?*+()[]{}-/#&~ ")


def escape(text: str) -> str:
  """A literal for outlines-core's regex dialect (Rust's regex syntax: punctuation escaped, space too)."""
  return "".join("\\" + ch if ch in _SPECIAL else ch for ch in text)


def json_schema_regex(schema) -> str:
  from outlines_core.json_schema import build_regex_from_schema  # lazy: heavy, only this path (outlines_core)
  if isinstance(schema, bool) or not isinstance(schema, dict):
    raise GrammarError("the JSON schema must be an object")
  try:
    return build_regex_from_schema(json.dumps(schema))
  except Exception as e:  # outlines-core raises ValueError / TypeError with the unsupported part
    raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None


def json_object_regex() -> str:
  return json_schema_regex({"type": "object"})


def choice_regex(choices) -> str:
  if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
    raise GrammarError("the choices must be a non-empty list of non-empty strings")
  return "(" + "|".join(escape(c) for c in choices) + ")"


def check_regex(pattern) -> str:
  if not isinstance(pattern, str) or not pattern:
    raise GrammarError("the regex must be a non-empty string")
  if len(pattern) > MAX_REGEX_CHARS:
    raise GrammarError(f"the regex has {len(pattern)} characters; at most {MAX_REGEX_CHARS}")
  return pattern
