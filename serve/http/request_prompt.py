"""A request body's prompt, as vLLM reads it: truncate_prompt_tokens, the chat template's add_generation_prompt /
continue_final_message, and chat echo. (Its output budget: serve/engine/request_spec.py.)"""

from __future__ import annotations

from serve.http.protocol import APIError


def truncated(ids: list, body, limits) -> list:
  """vLLM's truncate_prompt_tokens: the last N prompt tokens (truncation_side "right": the first N); -1 keeps what
  the context holds with room for one token."""
  n = body.truncate_prompt_tokens
  if n is None:
    return ids
  if n == 0:
    raise APIError(400, "truncate_prompt_tokens: a number of tokens >= 1, or -1 (the context's)",
                   "truncate_prompt_tokens")
  if n == -1:
    n = max(limits.max_new_for(0) - 1, 1)
  return ids[:n] if body.truncation_side == "right" else ids[-n:]


def chat_prompt(tokenizer, turns: list, body) -> str:
  """The chat template's text: a new model turn opened unless add_generation_prompt is false; with
  continue_final_message the last (assistant) turn left open, cut after its content, as vLLM renders it."""
  opened = body.add_generation_prompt is not False
  if body.continue_final_message:
    if opened:
      raise APIError(400, "continue_final_message needs add_generation_prompt: false", "continue_final_message")
    if turns[-1]["role"] not in ("assistant", "model"):
      raise APIError(400, "continue_final_message continues an assistant turn: the last message is "
                     f"{turns[-1]['role']!r}", "continue_final_message")
  text = tokenizer.apply_chat_template(turns, add_generation_prompt=opened)
  if body.continue_final_message:
    content = turns[-1]["content"].strip()
    end = text.rfind(content)
    if not content or end < 0:
      raise APIError(400, "continue_final_message: the last message's content is empty", "continue_final_message")
    text = text[:end + len(content)]
  return text


def chat_echo(body) -> str:
  """vLLM's chat echo: the last message's content when it is an assistant turn (the answer continues it)."""
  last = body.messages[-1]
  if not body.echo or last.role not in ("assistant", "model"):
    return ""
  return last.content if isinstance(last.content, str) else "".join(p.text for p in last.content or ())

