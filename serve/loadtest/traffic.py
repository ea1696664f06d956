"""Traffic: the same request sequence for every arm, its segments, and the load points that replay it.

Every arm sees identical requests in identical order (same prompts, output budgets, sampling settings and seeds),
so a difference between arms is the server's, not the traffic's. Segments are properties of the request known
before it is sent (category, requested output budget) or identical across arms (prompt tokens), so a segment
holds the same requests in every arm.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Optional

from serve.jobs.prompts import DEFAULT_PROMPTS
from spec_jax.datasets import read_jsonl


@dataclasses.dataclass(frozen=True)
class PromptRec:
  id: str
  category: str
  text: str  # the raw prompt, or the first user turn of a chat prompt
  is_chat: bool
  index: int  # position in the prompt file: decides the output budget, stable across arms and points
  response_format: str = ""  # the request's response_format as JSON text ('' = none): the "structured" segment


@dataclasses.dataclass(frozen=True)
class Request:
  seq: int  # position in the point's sequence
  prompt: PromptRec
  max_tokens: int
  sampling: str  # name of the sampling setting
  temperature: float
  top_p: float
  seed: int

  def body(self, model: str, token_ids: bool = True) -> dict:
    """The OpenAI request body: chat prompts go to /v1/chat/completions (the server applies Gemma's template).
    `return_token_ids` (vLLM's extension, which serve.server honours) makes each event say how many tokens it
    carries; without it the client spreads the usage total over events by text length."""
    b = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
         "seed": self.seed, "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
      b["return_token_ids"] = True
    if self.prompt.is_chat:
      b["messages"] = [{"role": "user", "content": self.prompt.text}]
    else:
      b["prompt"] = self.prompt.text
    if self.prompt.response_format:
      b["response_format"] = json.loads(self.prompt.response_format)
    return b

  @property
  def path(self) -> str:
    return "/v1/chat/completions" if self.prompt.is_chat else "/v1/completions"


@dataclasses.dataclass(frozen=True)
class LoadPoint:
  """One cell of the load axis: closed loop at a concurrency, or open loop at a Poisson rate."""
  mode: str  # "closed" or "open"
  level: float  # concurrency (closed) or requests/s (open)
  label: str  # "c1", "c4 (peak)", "poisson 2/s"
  sampling: str
  tag: str = ""  # "low", "medium", "peak", "overload" for closed loop; "" for open loop

  @property
  def key(self) -> str:
    lvl = f"c{int(self.level)}" if self.mode == "closed" else f"r{self.level:g}"
    return f"{self.sampling}/{lvl}"


def load_prompts(path, limit: int = 0, categories=()) -> list[PromptRec]:
  """JSONL with 'prompt' or 'turns' (Spec-Bench reads as is), optional 'response_format' (an OpenAI
  response_format object: the request asks for structured output); several paths (a list, or one string with
  commas) read each in turn: a mix of traffic; '' = serve.jobs.prompts' built-in demo prompts."""
  paths = (path or "").split(",") if isinstance(path, str) or path is None else list(path)
  raw = []
  for p in paths:
    if p:
      raw += read_jsonl(p)  # relative paths: the repository's own files first (configs write them so)
    else:
      raw += [(f"default prompt {i}", r) for i, r in enumerate(DEFAULT_PROMPTS)]
  out = []
  for i, (where, rec) in enumerate(raw):
    pid = str(rec.get("id", rec.get("question_id", i)))
    cat = str(rec.get("category", "")) or "uncategorized"
    rf = rec.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and isinstance(rf.get("type"), str)):
      raise ValueError(f"{where}: 'response_format' must be an object with a 'type'")
    rf = json.dumps(rf, sort_keys=True) if rf else ""
    if "prompt" in rec and isinstance(rec["prompt"], str) and rec["prompt"]:
      out.append(PromptRec(pid, cat, rec["prompt"], False, i, rf))
    elif "turns" in rec and isinstance(rec["turns"], list) and rec["turns"] and rec["turns"][0]:
      out.append(PromptRec(pid, cat, str(rec["turns"][0]), True, i, rf))
    else:
      raise ValueError(f"{where}: a line needs a non-empty 'prompt' or 'turns'")
  if categories:
    out = [p for p in out if p.category in set(categories)]
  if limit:
    out = out[:limit]
  if not out:
    raise ValueError(f"no prompts in {', '.join(p for p in paths if p) or 'the default set'}")
  return out


def split_prompts(prompts: list[PromptRec], split: str, block: int = 1) -> list[PromptRec]:
  """'even' / 'odd': a tuning split and a held-apart one, so a tuned policy is checked on prompts its tuner never
  saw; '' = all. The file is cut in blocks of `block` consecutive prompts (the number of output budgets, which go
  round-robin by position), even blocks in one half and odd ones in the other, so each half sees every budget."""
  if split in ("", None):
    return prompts
  if split not in ("even", "odd"):
    raise ValueError(f"prompt_split must be '', 'even' or 'odd', got {split!r}")
  out = [p for p in prompts if (p.index // max(block, 1)) % 2 == (1 if split == "odd" else 0)]
  if not out:
    raise ValueError(f"no prompts in the {split} split")
  return out


def build_requests(prompts: list[PromptRec], n: int, sampling: dict, output_lengths, seed: int) -> list[Request]:
  """n requests cycling through a seeded shuffle of the prompts. The output budget is output_lengths[i % m] for
  prompt i of the file, so every budget sees a balanced, fixed subset of prompts. A sampling setting with
  `repeats` R > 1 is retry traffic: each prompt is sent R times in a row, each send with its own seed."""
  order = list(range(len(prompts)))
  random.Random(seed).shuffle(order)
  repeats = int(sampling.get("repeats", 1))
  if repeats < 1:
    raise ValueError(f"sampling {sampling['name']!r}: repeats must be >= 1, got {repeats}")
  reqs = []
  for s in range(n):
    p = prompts[order[(s // repeats) % len(order)]]
    reqs.append(Request(seq=s, prompt=p, max_tokens=int(output_lengths[p.index % len(output_lengths)]),
                        sampling=sampling["name"], temperature=float(sampling["temperature"]),
                        top_p=float(sampling.get("top_p", 1.0)), seed=seed * 100003 + s))
  return reqs


def load_points(slots: int, samplings, closed_levels=(), overload_factor: float = 2.0,
                open_rates=()) -> list[LoadPoint]:
  """Closed loop at 1, medium (slots/2), peak (= slots) and overload (overload_factor x slots), unless
  closed_levels lists them explicitly; then open loop at each Poisson rate. Repeated levels are dropped."""
  if closed_levels:
    levels = [(int(c), "") for c in closed_levels]
  else:
    levels = [(1, "low"), (max(2, slots // 2), "medium"), (slots, "peak"),
              (max(slots + 1, int(round(overload_factor * slots))), "overload")]
  seen, pts = set(), []
  for smp in samplings:
    for c, tag in levels:
      tag = tag or ("peak" if c == slots else "overload" if c > slots else "low" if c == 1 else "medium")
      if (c, smp["name"]) in seen:
        continue
      seen.add((c, smp["name"]))
      label = f"c{c}" + (f" ({tag})" if tag in ("peak", "overload") else "")
      pts.append(LoadPoint("closed", float(c), label, smp["name"], tag))
    for r in open_rates:
      pts.append(LoadPoint("open", float(r), f"poisson {r:g}/s", smp["name"], ""))
  return pts


def prompt_len_bucket(tokens: Optional[int], edges) -> str:
  """'<64', '64-255', '>=256' for edges (64, 256); '?' when the server never reported the prompt's length."""
  if tokens is None:
    return "?"
  edges = sorted(int(e) for e in edges)
  if not edges or tokens < edges[0]:
    return f"<{edges[0]}" if edges else "all"
  for lo, hi in zip(edges, edges[1:]):
    if lo <= tokens < hi:
      return f"{lo}-{hi - 1}"
  return f">={edges[-1]}"
