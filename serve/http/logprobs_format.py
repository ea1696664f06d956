"""Logprobs as OpenAI's responses spell them (completions' four parallel lists, chat's content entries), and the
request fields that ask for them (`logprobs`, `top_logprobs`, `echo`, vLLM's `prompt_logprobs`).

The values come from the loop (spec_jax/logprobs.py): one (logprob, top ids, top values) entry per token id, in
the order the engine hands the ids over. A token's string is its own decoded text. -inf (a token that processed
mode filtered out) becomes -9999.0, as vLLM writes it, since JSON has no infinity.
"""

from __future__ import annotations

import dataclasses
import math

from serve.http.protocol import APIError

FLOOR = -9999.0


@dataclasses.dataclass(frozen=True)
class Ask:
  """What a request asks for: `top` top entries per generated token (-1: no logprobs), `prompt_top` per prompt
  token (-1: none; completions' echo with logprobs, or vLLM's prompt_logprobs), echo."""
  top: int = -1
  prompt_top: int = -1
  echo: bool = False
  vllm_prompt: bool = False  # the choice gets vLLM's prompt_logprobs list


def ask_of(body, chat: bool, max_logprobs: int) -> Ask:
  """The request's logprob fields -> Ask, or a 400 naming the field."""
  if chat:
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
      raise APIError(400, "logprobs: chat takes true or false (top_logprobs sets how many)", "logprobs")
    if body.top_logprobs and not body.logprobs:
      raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else -1
    echo = False
  else:
    if isinstance(body.logprobs, bool) or (body.logprobs is not None and body.logprobs < 0):
      raise APIError(400, "logprobs: completions take an integer >= 0 (the top entries per token)", "logprobs")
    top = -1 if body.logprobs is None else body.logprobs
    echo = bool(body.echo)
  for name, n in (("logprobs" if not chat else "top_logprobs", top),):
    if n > max_logprobs:
      raise APIError(400, f"{name}={n} is over this server's --max_logprobs={max_logprobs}", name)
  extra = body.model_extra or {}
  prompt_lp = extra.get("prompt_logprobs")
  if prompt_lp is not None and (isinstance(prompt_lp, bool) or not isinstance(prompt_lp, int) or prompt_lp < 0
                                or prompt_lp > max_logprobs):
    raise APIError(400, f"prompt_logprobs must be an integer in [0, {max_logprobs}]", "prompt_logprobs")
  prompt_top = -1
  if echo and top >= 0:
    prompt_top = top
  if prompt_lp is not None:
    prompt_top = max(prompt_top, prompt_lp)
  return Ask(top=top, prompt_top=prompt_top, echo=echo, vllm_prompt=prompt_lp is not None)


def _v(x: float) -> float:
  return FLOOR if math.isinf(x) or math.isnan(x) else float(x)


class Formatter:
  """Token strings (cached per id) and the two response shapes."""

  def __init__(self, tokenizer, as_ids: bool = False):
    self.tokenizer, self.as_ids = tokenizer, as_ids  # as_ids: vLLM's return_tokens_as_token_ids
    self._text: dict = {}

  def text(self, tid: int) -> str:
    if self.as_ids:
      return f"token_id:{int(tid)}"
    s = self._text.get(tid)
    if s is None:  # a special token shows as its piece ("<bos>"), as vLLM's token strings do, not as ""
      special = int(tid) in self.tokenizer.special_ids
      s = self._text[tid] = self.tokenizer.piece_of(int(tid)) if special else self.tokenizer.decode([int(tid)])
    return s

  def completion(self, ids: list, entries: list, top: int, offset: int = 0) -> dict:
    """OpenAI completions' logprobs for tokens `ids` (entries[i] None: no value, as the prompt's first token),
    text offsets counted from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, e in zip(ids, entries):
      s = self.text(tid)
      out["tokens"].append(s)
      out["text_offset"].append(offset)
      offset += len(s)
      if e is None:
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        continue
      lp, top_ids, top_vals = e
      out["token_logprobs"].append(_v(lp))
      best = {s: _v(lp)}  # the chosen token too, as OpenAI's completions include it
      for i, v in zip(top_ids[:top], top_vals[:top]):
        best.setdefault(self.text(i), _v(v))
      out["top_logprobs"].append(best)
    return out

  def chat(self, ids: list, entries: list, top: int) -> dict:
    def one(tid, v):
      s = self.text(tid)
      return {"token": s, "logprob": _v(v), "bytes": list(s.encode("utf-8"))}
    content = []
    for tid, (lp, top_ids, top_vals) in zip(ids, entries):
      content.append({**one(tid, lp), "top_logprobs": [one(i, v) for i, v in zip(top_ids[:top], top_vals[:top])]})
    return {"content": content}

  def vllm_prompt(self, ids: list, entries: list, top: int) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    out = []
    for tid, e in zip(ids, entries):
      if e is None:
        out.append(None)
        continue
      lp, rank, top_ids, top_vals = e
      d = {str(tid): {"logprob": _v(lp), "rank": rank, "decoded_token": self.text(tid)}}
      for r, (i, v) in enumerate(zip(top_ids[:top], top_vals[:top])):
        d.setdefault(str(int(i)), {"logprob": _v(v), "rank": r + 1, "decoded_token": self.text(i)})
      out.append(d)
    return out

