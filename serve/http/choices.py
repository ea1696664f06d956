"""A request's choices: one per (prompt, sample) of a prompt list and `n`, each its own engine request, and how
their outputs become one OpenAI response or one SSE stream (choices indexed prompt-major, as OpenAI and vLLM
number them), with logprobs, echo and the summed usage.

Each choice is decoded independently: with a seed, sample i of every prompt is its own random stream, seed + i
(spec_jax/streams.py: the same tokens whatever else runs beside it); n > 1 greedy gives n identical choices.
Usage counts each prompt's tokens once and every choice's completion tokens.

`best_of` (completions): best_of samples per prompt, of which the n with the highest cumulative logprob (of the
server's logprobs mode) are returned, as vLLM chose them; usage counts all of them. Refused below n and with
stream, as vLLM refuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from serve.http.protocol import APIError
from serve.http.logprobs_format import Ask, Formatter
from serve.engine.output_stream import Output, Usage


@dataclasses.dataclass
class Choice:
  index: int
  prompt_ids: list
  prompt_text: str  # what echo puts before the completion
  output: Output
  req: Any = None  # the EngineRequest
  first_sample: bool = True  # the prompt's first choice: its prompt tokens count in usage
  prompt_entries: Optional[list] = None  # (logprob, rank, top ids, top values) per prompt token, or None
  text: list = dataclasses.field(default_factory=list)
  ids: list = dataclasses.field(default_factory=list)
  lps: list = dataclasses.field(default_factory=list)
  final: Any = None  # the last Delta (finish reason, usage)
  sent_prefix: bool = False  # streaming: echo already sent
  sent_ids: bool = False  # streaming: prompt_token_ids already sent
  offset: int = 0  # streaming: text offset of the next token (completions' text_offset)

  def add(self, d) -> None:
    self.text.append(d.text)
    self.ids.extend(d.token_ids)
    self.lps.extend(d.logprobs)
    if d.finished:
      self.final = d


def generated_per_prompt(body, max_logprobs: int) -> int:
  """Samples to generate per prompt: best_of when given (checked against n and stream: a 400 naming it), else n."""
  n = body.n or 1
  best_of = getattr(body, "best_of", None)
  if best_of is None:
    return n
  if best_of < n:
    raise APIError(400, f"best_of={best_of} must be at least n={n}", "best_of")
  if best_of > n and body.stream:
    raise APIError(400, "best_of > n cannot stream (the best samples are known only at the end)", "best_of")
  if best_of > n and max_logprobs < 0:
    raise APIError(400, "best_of > n ranks samples by logprob, which this server does not compute "
                   "(--max_logprobs=-1)", "best_of")
  return best_of


def best(choices: list, gen: int, n: int) -> list:
  """Per prompt (gen samples each, in order), the n samples with the highest cumulative logprob (ties: the
  earlier sample), re-indexed prompt-major."""
  if gen == n:
    return choices
  out = []
  for p in range(0, len(choices), gen):
    group = choices[p:p + gen]
    ranked = sorted(range(gen), key=lambda i: (-cumulative_logprob(group[i]), i))[:n]
    for j, i in enumerate(ranked):
      group[i].index = p // gen * n + j
      out.append(group[i])
  return out


def cumulative_logprob(c: Choice) -> float:
  return sum(e[0] for e in c.lps)


def total_usage(choices: list) -> Usage:
  u = Usage(0, 0, 0, 0, 0)
  for c in choices:
    cu = c.final.usage if c.final is not None and c.final.usage is not None else c.req.usage()
    u.prompt_tokens += cu.prompt_tokens if c.first_sample else 0
    u.cached_tokens += cu.cached_tokens if c.first_sample else 0
    u.completion_tokens += cu.completion_tokens
    u.drafted_tokens += cu.drafted_tokens
    u.accepted_tokens += cu.accepted_tokens
    u.drafts += cu.drafts
  return u


def _prompt_lp(fmt: Formatter, c: Choice, ask: Ask) -> dict:
  """Completions' logprobs of the echoed prompt (entries as (logprob, top ids, top values))."""
  entries = [None if e is None else (e[0], e[2], e[3]) for e in c.prompt_entries]
  return fmt.completion(c.prompt_ids, entries, ask.prompt_top)


def _merge(a: dict, b: dict) -> dict:
  return {k: a[k] + b[k] for k in a}


def completion_choice(fmt: Formatter, c: Choice, ask: Ask, with_ids: bool) -> dict:
  text = "".join(c.text)
  lp = None
  if ask.top >= 0:
    start = len(c.prompt_text) if ask.echo else 0
    lp = fmt.completion(c.ids, c.lps, ask.top, offset=start)
    if ask.echo:
      lp = _merge(_prompt_lp(fmt, c, ask), lp)
  out = {"index": c.index, "text": (c.prompt_text if ask.echo else "") + text, "logprobs": lp,
         "finish_reason": c.final.finish_reason}
  return _with_extras(out, fmt, c, ask, with_ids)


def _with_extras(out: dict, fmt: Formatter, c: Choice, ask: Ask, with_ids: bool) -> dict:
  """vLLM's prompt_logprobs and the token ids, where asked: the same on both routes."""
  if ask.vllm_prompt:
    out["prompt_logprobs"] = fmt.vllm_prompt(c.prompt_ids, c.prompt_entries, ask.prompt_top)
  if with_ids:
    out.update(token_ids=c.ids, prompt_token_ids=c.prompt_ids)
  return out


def chat_choice(fmt: Formatter, c: Choice, ask: Ask, with_ids: bool) -> dict:
  out = {"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
         "logprobs": fmt.chat(c.ids, c.lps, ask.top) if ask.top >= 0 else None,
         "finish_reason": c.final.finish_reason}
  return _with_extras(out, fmt, c, ask, with_ids)


def completion_delta(fmt: Formatter, c: Choice, d, ask: Ask, with_ids: bool) -> Optional[dict]:
  """One SSE choice for delta d (None when there is nothing to send); the echo goes first."""
  text, lp = d.text, None
  prefix = ask.echo and not c.sent_prefix
  if prefix:
    c.offset = len(c.prompt_text)  # the completion's tokens start after the echoed prompt
  if ask.top >= 0 and d.token_ids:
    lp = fmt.completion(d.token_ids, d.logprobs, ask.top, offset=c.offset)
  c.offset += sum(len(fmt.text(t)) for t in d.token_ids)  # offsets count token strings, as the whole answer's
  if prefix:
    c.sent_prefix = True
    text = c.prompt_text + text
    if ask.top >= 0:
      lp = _merge(_prompt_lp(fmt, c, ask), lp) if lp else _prompt_lp(fmt, c, ask)
  if not text and not d.token_ids and lp is None:
    return None
  out = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}
  if with_ids:
    out["token_ids"] = d.token_ids
    if not c.sent_ids:  # vLLM sends the prompt's ids once, in the choice's first chunk
      out["prompt_token_ids"], c.sent_ids = c.prompt_ids, True
  return out


def chat_delta(fmt: Formatter, c: Choice, d, ask: Ask, with_ids: bool) -> Optional[dict]:
  if not d.text and not d.token_ids:
    return None
  out = {"index": c.index, "delta": {"content": d.text},
         "logprobs": fmt.chat(d.token_ids, d.logprobs, ask.top) if ask.top >= 0 and d.token_ids else None,
         "finish_reason": None}
  if with_ids:
    out["token_ids"] = d.token_ids
  return out
