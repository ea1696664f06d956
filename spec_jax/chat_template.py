"""Chat formats: Gemma 3's as plain string building, and any checkpoint's own Jinja template.

`Tokenizer.apply_chat_template` calls these; they live apart because they are about the conversation format, not
the vocabulary. Gemma 3's format is written out.
A GGUF's `tokenizer.chat_template` (Qwen2's ChatML, ...) is rendered with jinja2 the way transformers renders it:
a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` filter that keeps
non-ASCII text, `raise_exception` and `strftime_now`, and the special tokens' texts as variables.
"""

from __future__ import annotations

import datetime
import json
from typing import Mapping, Sequence


def apply_chat_template(turns: Sequence[str] | Sequence[Mapping[str, object]],
                        add_generation_prompt: bool = True) -> str:
  """Gemma 3's chat format, without the leading `<bos>` (encode adds it).

  `turns` is a list of strings, taken as alternating user and model turns starting with the user, or a list of
  {"role", "content"} messages with roles "user", "model" (or "assistant") and an optional first "system"
  message, which Gemma 3 prepends to the first user turn followed by a blank line. Contents are stripped of
  surrounding whitespace, as Gemma 3's template does. Each turn becomes
  `<start_of_turn>{role}\\n{content}<end_of_turn>\\n`; `add_generation_prompt` appends `<start_of_turn>model\\n`.
  """
  messages = [("model" if role == "assistant" else role, content) for role, content in normalize_turns(turns)]

  prefix = ""
  if messages[0][0] == "system":
    if len(messages) < 2:
      raise ValueError("a system message must be followed by a user turn")
    prefix = messages[0][1] + "\n\n"
    messages = messages[1:]
  out = []
  for k, (role, content) in enumerate(messages):
    expected = "user" if k % 2 == 0 else "model"
    if role != expected:
      raise ValueError(f"conversation roles must alternate user/model starting with user; "
                       f"turn {k} is {role!r} where {expected!r} was expected")
    body = (prefix if k == 0 else "") + content.strip()
    out.append(f"<start_of_turn>{role}\n{body}<end_of_turn>\n")
  if add_generation_prompt:
    out.append("<start_of_turn>model\n")
  return "".join(out)


def normalize_turns(turns: Sequence[str] | Sequence[Mapping[str, object]]) -> list[tuple[str, str]]:
  """-> [(role, text)] with roles system, user and assistant ("model" is read as assistant). Strings alternate
  user and assistant, user first."""
  if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
    raise TypeError("turns must be a list of strings or of {'role', 'content'} dicts")
  if len(turns) == 0:
    raise ValueError("apply_chat_template needs at least one turn")
  messages: list[tuple[str, str]] = []
  for k, turn in enumerate(turns):
    if isinstance(turn, str):
      messages.append(("user" if k % 2 == 0 else "assistant", turn))
    elif isinstance(turn, Mapping):
      role = turn.get("role")
      if role not in ("user", "model", "assistant", "system"):
        raise ValueError(f"turn {k}: unknown role {role!r} (expected user, model, assistant or system)")
      messages.append(("assistant" if role == "model" else str(role), _content_text(turn.get("content"), k)))
    else:
      raise TypeError(f"turn {k}: expected str or dict, got {type(turn).__name__}")
  return messages


class JinjaTemplate:
  """A checkpoint's own Jinja chat template, compiled once."""

  def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
    import jinja2  # lazy: heavy, only this path (jinja2)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: heavy, only this path (jinja2)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template does not compile: {e}") from None
    self.source = source
    self._special = dict(special_tokens or {})

  def render(self, turns, add_generation_prompt: bool = True) -> str:
    import jinja2  # lazy: heavy, only this path (jinja2)
    messages = [{"role": r, "content": c} for r, c in normalize_turns(turns)]
    try:
      return self._template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self._special)
    except jinja2.TemplateError as e:  # raise_exception() in the template, or a template bug
      raise ValueError(f"chat template: {e}") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
  import jinja2  # lazy: heavy, only this path (jinja2)
  raise jinja2.TemplateError(message)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def _content_text(content: object, k: int) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
    texts = []
    for item in content:
      if isinstance(item, Mapping) and item.get("type") == "text" and isinstance(item.get("text"), str):
        texts.append(item["text"].strip())
      else:
        raise ValueError(f"turn {k}: only text content parts are supported, got {item!r}")
    return "".join(texts)
  raise ValueError(f"turn {k}: content must be a string, got {type(content).__name__}")
