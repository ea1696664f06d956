"""Gemma 3's chat template as plain string building, so prompts match the model's own template exactly.

`Tokenizer.apply_chat_template` calls this; it lives apart because it is about the conversation format, not the
vocabulary.
"""

from __future__ import annotations

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
  if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
    raise TypeError("turns must be a list of strings or of {'role', 'content'} dicts")
  if len(turns) == 0:
    raise ValueError("apply_chat_template needs at least one turn")
  messages: list[tuple[str, str]] = []
  for k, turn in enumerate(turns):
    if isinstance(turn, str):
      messages.append(("user" if k % 2 == 0 else "model", turn))
    elif isinstance(turn, Mapping):
      role = turn.get("role")
      if role not in ("user", "model", "assistant", "system"):
        raise ValueError(f"turn {k}: unknown role {role!r} (expected user, model, assistant or system)")
      messages.append(("model" if role == "assistant" else str(role), _content_text(turn.get("content"), k)))
    else:
      raise TypeError(f"turn {k}: expected str or dict, got {type(turn).__name__}")

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
