"""Structured outputs: which grammar a request asks for, read from every spelling clients use, as one regular
expression for spec_jax/grammar (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, and the
tool-call grammar of `tool_choice` required or named, serve/http/tools.py). At most one per request; a 400 names the
field whose value cannot be compiled."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Optional

from serve.http import tools
from serve.http.protocol import GRAMMAR_WHY, APIError
from spec_jax.grammar import formats
from spec_jax.grammar.automaton import Compiler, GrammarError

# vLLM's structured_outputs keys (and their guided_* spellings) -> how each becomes a regex
_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "json_object": "json_object"}


def _regex(kind: str, value, field: str) -> str:
  try:
    if kind == "json":
      if isinstance(value, str):
        try:
          value = json.loads(value)
        except json.JSONDecodeError as e:
          raise GrammarError(f"the JSON schema is not valid JSON ({e})") from None
      return formats.json_schema_regex(value)
    if kind == "json_object":
      return formats.json_object_regex()
    if kind == "regex":
      return formats.check_regex(value)
    return formats.choice_regex(value)
  except GrammarError as e:
    raise APIError(400, f"{field}: {e}", field) from None


def _response_format(rf) -> Optional[str]:
  if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
    raise APIError(400, "response_format: an object with a type (text, json_object or json_schema)",
                   "response_format")
  kind = rf["type"]
  if kind == "text":
    return None
  if kind == "json_object":
    return _regex("json_object", None, "response_format")
  if kind == "json_schema":
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
      raise APIError(400, "response_format.json_schema.schema: a JSON schema object is required",
                     "response_format")
    return _regex("json", js["schema"], "response_format")
  raise APIError(400, f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                 "response_format")


def requested_regex(body, extra: dict) -> Optional[tuple[str, str]]:
  """(regex, the field that asked) or None: the request's grammar, from response_format, structured_outputs or
  guided_json / guided_regex / guided_choice. More than one is a 400."""
  found = []
  rf = getattr(body, "response_format", None) if "response_format" in type(body).model_fields \
      else extra.get("response_format")
  if rf is not None:
    rx = _response_format(rf)
    if rx is not None:
      found.append((rx, "response_format"))
  so = extra.get("structured_outputs")
  if so is not None:
    if not isinstance(so, dict):
      raise APIError(400, "structured_outputs: an object with one of json, regex, choice, json_object",
                     "structured_outputs")
    if so.get("grammar") not in (None, False):
      raise APIError(400, f"structured_outputs.grammar is not supported: {GRAMMAR_WHY}", "structured_outputs")
    keys = [k for k, v in so.items() if k in _KINDS and v not in (None, False)]
    unknown = [k for k, v in so.items() if k not in _KINDS and v not in (None, False)
               and k not in ("backend", "disable_fallback")]  # these do not change the output
    if unknown:
      raise APIError(400, f"structured_outputs: {unknown[0]!r} is not supported (json, regex, choice, "
                     "json_object are)", "structured_outputs")
    if len(keys) != 1:
      raise APIError(400, "structured_outputs: exactly one of json, regex, choice, json_object",
                     "structured_outputs")
    found.append((_regex(_KINDS[keys[0]], so[keys[0]], "structured_outputs"), "structured_outputs"))
  for kind in ("json", "regex", "choice"):
    field = f"guided_{kind}"
    if extra.get(field) is not None:
      found.append((_regex(kind, extra[field], field), field))
  if len(found) > 1:
    raise APIError(400, f"{found[1][1]}: one structured output per request ({found[0][1]} is set too)",
                   found[1][1])
  return found[0] if found else None


@dataclasses.dataclass
class Plan:
  """What a request constrains: regex (None: nothing) and the field that asked; tools (name -> function) when
  the answer may be a tool call (tool_choice auto, required or named), shown to the model in a system turn."""
  regex: Optional[str] = None
  field: Optional[str] = None
  tools: Optional[dict] = None


def plan(body, route: str) -> Plan:
  """The request's grammar and tools (400s name the field): tools only on the chat route, and not together with
  another structured output."""
  extra = body.model_extra or {}
  found = requested_regex(body, extra)
  p = Plan(*found) if found else Plan()
  raw_tools, choice = extra.get("tools"), extra.get("tool_choice")
  if route != "chat" or raw_tools in (None, []):
    if choice not in (None, "none"):  # "auto" too, as OpenAI and vLLM refuse it
      raise APIError(400, f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    if route != "chat" and raw_tools not in (None, []):
      raise APIError(400, "tools are for /v1/chat/completions", "tools")
    return p
  listed = tools.check_tools(raw_tools)
  mode = tools.choice_of(choice, listed)
  if mode == "none":
    return p
  if p.regex is not None:
    raise APIError(400, f"tools with {p.field}: one structured output per request", "tools")
  if mode == "auto":
    return Plan(tools=listed)
  return Plan(regex=tools.call_regex(listed, None if mode == "required" else mode), field="tool_choice",
              tools=listed)


class Grammars:
  """A plan's automaton, compiled off the event loop (0.5-10 s for a schema at 262k tokens, then cached): the
  compiler (spec_jax/grammar) is made on first use (~1 s for a 262k vocabulary), and concurrent requests with one
  schema wait on one task (no executor thread each); the Compiler itself also compiles a pattern once."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._compiler = None
    self._compiling: dict = {}  # key -> the task computing it

  async def automaton(self, plan: Plan, limits):
    """The plan's automaton (None without a grammar), or a 400 naming the plan's field."""
    if plan.regex is None:
      return None
    if not limits.structured:
      raise APIError(400, f"{plan.field}: structured outputs are off on this server (--grammar_capacity)",
                     plan.field)
    if self._compiler is None:
      self._compiler = await self._once("compiler", lambda: Compiler(self.tokenizer, limits.stop_ids))
    try:
      return await self._once(("regex", plan.regex), lambda: self._compiler.regex(plan.regex))
    except GrammarError as e:
      raise APIError(400, f"{plan.field}: {e}", plan.field)

  async def _once(self, key, fn):
    """fn() off the event loop, once for all callers that ask for `key` while it runs (a compiled automaton is
    then in the compiler's cache; a failure reaches every waiter, and the next request tries again)."""
    task = self._compiling.get(key)
    if task is None:
      task = self._compiling[key] = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, fn))
      task.add_done_callback(lambda _: self._compiling.pop(key, None))
    return await asyncio.shield(task)
