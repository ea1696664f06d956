"""Tool calls for a chat template without a tool format (Gemma 3's has none).

The format we chose: the tools are listed in a system turn (Gemma's template folds it into the first user turn)
with the instruction to answer a call with one JSON object and nothing else, `{"name": ..., "arguments": {...}}`,
the shape most function-calling models use. tool_choice:
- "none": the tools are not shown; plain text.
- "auto" (the default with tools): unconstrained; an answer that is exactly one call to a listed tool with
  arguments valid against its schema (the call's grammar matches the whole text) returns as `tool_calls`, any
  other answer as text.
- "required" / a named function: the output is constrained to a call (any listed tool / that one) whose
  arguments follow the function's `parameters` schema, so it always parses and validates (unless max_tokens cuts
  it: finish_reason "length").
One call per answer (parallel_tool_calls changes nothing). Earlier calls and results in `messages` (an assistant
turn's `tool_calls`, `tool` turns) are rendered as the call's JSON and as a user turn quoting the result.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from serve.http.protocol import APIError
from spec_jax.grammar import formats
from spec_jax.grammar.automaton import GrammarError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_tools(tools) -> dict:
  """name -> function dict ({name, description, parameters}); a 400 naming `tools` on anything malformed."""
  if not isinstance(tools, list) or not tools:
    raise APIError(400, "tools: a non-empty list of {type: function, function: {...}}", "tools")
  out = {}
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
      raise APIError(400, f"tools[{i}]: each tool is {{type: function, function: {{name, parameters}}}}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
      raise APIError(400, f"tools[{i}].function.name: 1-64 letters, digits, _ or -", "tools")
    if not isinstance(fn.get("parameters"), dict):
      raise APIError(400, f"tools[{i}].function.parameters: a JSON schema is required (function {name!r} has "
                     "none)", "tools")
    if name in out:
      raise APIError(400, f"tools[{i}]: the function name {name!r} is listed twice", "tools")
    out[name] = fn
  return out


def choice_of(tool_choice, tools: dict) -> str:
  """'none' | 'auto' | 'required' | a function's name."""
  if tool_choice is None:
    return "auto"
  if tool_choice in ("none", "auto", "required"):
    return tool_choice
  fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
  name = fn.get("name") if isinstance(fn, dict) else None
  if not isinstance(name, str):
    raise APIError(400, "tool_choice: none, auto, required or {type: function, function: {name}}", "tool_choice")
  if name not in tools:
    raise APIError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
  return name


def call_regex(tools: dict, only: Optional[str] = None) -> str:
  """The grammar of one call (to `only`, or to any tool), a 400 naming `tools` if a schema cannot compile."""
  names = [only] if only else list(tools)
  parts = []
  for name in names:
    schema = {"type": "object", "required": ["name", "arguments"],
              "properties": {"name": {"enum": [name]}, "arguments": nested(tools[name]["parameters"], _ARGS)}}
    try:
      parts.append(formats.json_schema_regex(schema))
    except GrammarError as e:
      raise APIError(400, f"tools: function {name!r}: {e}", "tools") from None
  return parts[0] if len(parts) == 1 else "(" + "|".join(f"({p})" for p in parts) + ")"


_ARGS = "#/properties/arguments"  # where a function's parameters sit in the call's schema


def nested(schema, at: str):
  """A schema moved to `at` inside another: its local references (`#/$defs/X`, `#` itself), which pydantic writes
  for every nested model, re-pointed there, so they resolve against the schema they were written for. Other
  references (remote ones) are left as they are."""
  if isinstance(schema, dict):
    return {k: at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else nested(v, at)
            for k, v in schema.items()}
  if isinstance(schema, list):
    return [nested(v, at) for v in schema]
  return schema


def system_turn(tools: dict) -> str:
  listed = [{"name": n, "description": f.get("description", ""), "parameters": f["parameters"]}
            for n, f in tools.items()]
  return ("You can call these functions:\n" + json.dumps(listed, ensure_ascii=False) + "\nTo call one, answer with "
          'only a JSON object {"name": <function name>, "arguments": {...}} and nothing else. Otherwise answer '
          "normally.")


def render(messages: list, tools: Optional[dict]) -> list:
  """OpenAI messages (dicts) -> turns the chat template takes: tool calls as their JSON, tool results as user
  turns; the tools' system turn first when `tools` is given; neighbouring turns of one role joined."""
  turns = [{"role": "system", "content": system_turn(tools)}] if tools else []
  for m in messages:
    role, content = m["role"], m.get("content")
    if isinstance(content, list):
      content = "".join(p.get("text", "") for p in content)
    if role == "tool":
      turns.append({"role": "user", "content": f"Result of the call {m.get('tool_call_id') or ''}: {content}"})
    elif role == "assistant" and m.get("tool_calls"):
      calls = [json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])})
               for c in m["tool_calls"]]
      turns.append({"role": "assistant", "content": ((content or "") + "\n".join(calls)).strip()})
    else:
      turns.append({"role": role, "content": content or ""})
  merged: list = []  # Gemma's template takes one system turn and alternating turns: join neighbours of a role
  for t in turns:
    same = merged and (merged[-1]["role"] == t["role"] or {merged[-1]["role"], t["role"]} == {"assistant", "model"})
    if same:
      merged[-1] = {"role": merged[-1]["role"], "content": merged[-1]["content"] + "\n\n" + t["content"]}
    else:
      merged.append(dict(t))
  return merged


def parse_call(text: str, tools: dict) -> Optional[dict]:
  """The OpenAI tool_calls entry when `text` is exactly one valid call, else None."""
  t = text.strip()
  for name in tools:
    if re.fullmatch(call_regex(tools, name), t):
      args = json.loads(t)["arguments"]
      return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
  return None
