"""An asyncio streaming OpenAI client that times every request the way a user sees it.

Per request: TTFT (send -> first event carrying a token), per-token ITL, TPOT, end-to-end latency, queue time when
the server reports one, and the outcome (ok, error, timeout, rejected with 429, or cut at the point's time bound).

One SSE event may carry several tokens (a speculative step commits up to k + 1 at once). ITL is defined per token:
an event that arrives `gap` seconds after the previous one and carries n tokens contributes n samples of gap / n,
so the ITL samples of a request sum to the time between its first and last event. Tokens that arrive in the first
event are covered by TTFT and give no ITL sample. TPOT = (e2e - TTFT) / (completion_tokens - 1), vLLM's
definition. The raw gaps between events are kept too (`event_gaps`, vLLM's chunk-level "ITL").
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

import httpx

from serve.loadtest.traffic import Request

# usage keys for the request's drafted / accepted token counts (the server's name first, then vLLM-style spellings)
DRAFTED_KEYS = ("drafted_tokens", "num_drafted_tokens", "draft_tokens", "num_draft_tokens")
ACCEPTED_KEYS = ("accepted_tokens", "num_accepted_tokens", "accepted_draft_tokens")
QUEUE_KEYS = ("queue_time", "queue_time_s", "queued_s", "queue_s")


def _first(d: dict, keys) -> Optional[float]:
  for k in keys:
    if isinstance(d, dict) and d.get(k) is not None:
      return d[k]
  return None


def _usage_value(usage: dict, keys) -> Optional[float]:
  v = _first(usage, keys)
  if v is None:
    for sub in ("completion_tokens_details", "speculative", "spec_decode"):
      v = _first(usage.get(sub) or {}, keys)
      if v is not None:
        break
  return v


def _event_tokens(chunk: dict, choice: dict, prev_completion: Optional[int]) -> tuple[Optional[int], str]:
  """Tokens this event carries, and how we know: explicit token ids, logprobs, or cumulative usage."""
  for key in ("token_ids", "tokens"):
    v = choice.get(key)
    if v is None and isinstance(choice.get("delta"), dict):
      v = choice["delta"].get(key)
    if isinstance(v, list):
      return len(v), key
    if isinstance(v, int) and key == "tokens":
      return v, key
  lp = choice.get("logprobs")
  if isinstance(lp, dict):
    if isinstance(lp.get("tokens"), list):
      return len(lp["tokens"]), "logprobs"
    if isinstance(lp.get("content"), list):
      return len(lp["content"]), "logprobs"
  u = chunk.get("usage")
  if isinstance(u, dict) and u.get("completion_tokens") is not None:
    return int(u["completion_tokens"]) - (prev_completion or 0), "usage"
  return None, "text"


def _choice_text(choice: dict) -> str:
  if "text" in choice:
    return choice.get("text") or ""
  d = choice.get("delta") or {}
  return d.get("content") or ""


def finish_record(rec: dict) -> dict:
  """Derive TTFT, ITL and TPOT from the event log (times since send, tokens per event)."""
  times, ntoks = rec.pop("_times"), rec.pop("_ntoks")
  texts = rec.pop("_text_lens")
  total = rec.get("completion_tokens")
  known = all(n is not None for n in ntoks)
  if times and not known:
    # No per-event counts from the server: spread the usage total over events by text length (>= 1 each).
    total_chars = sum(texts) or len(texts)
    tot = total if total is not None else len(times)
    ntoks = [max(1, round(tot * (c or 1) / total_chars)) for c in texts]
    if ntoks and tot >= len(ntoks):  # make them sum to the total exactly
      ntoks[-1] = max(1, tot - sum(ntoks[:-1]))
  if total is None:
    rec["completion_tokens"] = total = sum(n for n in ntoks if n) if times else 0
  rec["tokens_per_event"] = [int(n) for n in ntoks]
  rec["events"] = len(times)
  rec["ttft"] = times[0] if times else None
  gaps = [b - a for a, b in zip(times, times[1:])]
  rec["event_gaps"] = gaps
  itl = []
  for g, n in zip(gaps, ntoks[1:]):
    itl.extend([g / n] * int(n) if n and n > 0 else [])
  rec["itl"] = itl
  if rec["status"] == "ok" and times and total and total > 1:
    rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (total - 1)
  else:
    rec["tpot"] = None
  return rec


async def stream_request(http: httpx.AsyncClient, base_url: str, req: Request, *, model: str, timeout: float,
                         t0: float, sink: list, api_key: str = "", extra: Optional[dict] = None) -> dict:
  """Send one streamed request, append its record to `sink` and return it. Never raises for server-side
  failures; a cancellation (the point's time bound) is recorded as 'cut' and re-raised."""
  rec = {"seq": req.seq, "prompt_id": req.prompt.id, "category": req.prompt.category, "is_chat": req.prompt.is_chat,
         "structured": bool(req.prompt.response_format),
         "max_tokens": req.max_tokens, "sampling": req.sampling, "status": "ok", "http_status": None, "error": None,
         "t_send": None, "e2e": None, "prompt_tokens": None, "completion_tokens": None, "drafted_tokens": None,
         "accepted_tokens": None, "queue_time": None, "finish_reason": None, "token_count_source": None,
         "_times": [], "_ntoks": [], "_text_lens": []}
  if extra:
    rec.update(extra)
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  start = time.perf_counter()
  rec["t_send"] = start - t0
  prev_completion = None
  sources = set()
  try:
    async with asyncio.timeout(timeout):
      async with http.stream("POST", base_url + req.path, json=req.body(model), headers=headers) as resp:
        rec["http_status"] = resp.status_code
        if resp.status_code != 200:
          body = (await resp.aread()).decode("utf-8", "replace")
          rec["status"] = "rejected" if resp.status_code == 429 else "error"
          try:
            rec["error"] = json.loads(body).get("error", {}).get("message", body)[:500]
          except (ValueError, AttributeError):
            rec["error"] = body[:500]
        else:
          async for line in resp.aiter_lines():
            if not line.startswith("data:"):
              continue
            data = line[5:].strip()
            if data == "[DONE]":
              break
            now = time.perf_counter() - start
            chunk = json.loads(data)
            if "error" in chunk:
              rec["status"], rec["error"] = "error", str(chunk["error"])[:500]
              break
            usage = chunk.get("usage")
            if isinstance(usage, dict):
              for field, keys in (("prompt_tokens", ("prompt_tokens",)), ("completion_tokens", ("completion_tokens",)),
                                  ("drafted_tokens", DRAFTED_KEYS), ("accepted_tokens", ACCEPTED_KEYS),
                                  ("queue_time", QUEUE_KEYS)):
                v = _usage_value(usage, keys)
                if v is not None:
                  rec[field] = v
            for choice in chunk.get("choices") or []:
              if choice.get("finish_reason"):
                rec["finish_reason"] = choice["finish_reason"]
              text = _choice_text(choice)
              n, src = _event_tokens(chunk, choice, prev_completion)
              if n is None and not text:
                continue
              if n is not None and n <= 0:
                continue
              sources.add(src)
              rec["_times"].append(now)
              rec["_ntoks"].append(n)
              rec["_text_lens"].append(len(text))
              if src == "usage":
                prev_completion = int(usage["completion_tokens"])
            q = _first(chunk, QUEUE_KEYS)
            if q is not None:
              rec["queue_time"] = q
    rec["e2e"] = time.perf_counter() - start
    if rec["status"] == "ok" and rec["finish_reason"] is None:
      rec["status"], rec["error"] = "error", "stream ended without a finish_reason"
  except TimeoutError:
    rec["status"], rec["error"], rec["e2e"] = "timeout", f"no complete answer within {timeout} s", timeout
  except asyncio.CancelledError:
    rec["status"], rec["error"], rec["e2e"] = "cut", "cut at the point's time bound", time.perf_counter() - start
    rec["token_count_source"] = "/".join(sorted(sources)) or None
    sink.append(finish_record(rec))
    raise
  except (httpx.HTTPError, OSError, ValueError) as e:
    rec["status"], rec["error"], rec["e2e"] = "error", f"{type(e).__name__}: {e}"[:500], time.perf_counter() - start
  rec["token_count_source"] = "/".join(sorted(sources)) or None
  sink.append(finish_record(rec))
  return rec
