"""The server's Prometheus /metrics: scrape, diff two scrapes, and read speculation counters off the difference.

Counters are read as deltas over one load point (scrape before, scrape after, with no other traffic in between),
so acceptance is that point's, not the process lifetime's. Parsing is prometheus_client's own text parser.
"""

from __future__ import annotations

import math
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "spec_jax:"


class Scrape:
  """Samples of one scrape, keyed by (sample name, sorted label items); plus each family's type."""

  def __init__(self, text: str = ""):
    self.samples: dict[tuple, float] = {}
    self.types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
      self.types[fam.name] = fam.type
      for s in fam.samples:
        if s.name.endswith("_created"):
          continue
        self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

  def names(self) -> set:
    return {n for n, _ in self.samples}

  def find(self, *suffixes: str) -> Optional[str]:
    """The sample name that ends with one of `suffixes` (with or without the counter's '_total')."""
    names = self.names()
    for suf in suffixes:
      for cand in (suf, suf + "_total"):
        for n in sorted(names):
          if n == PREFIX + cand or n == cand or n.endswith(":" + cand):
            return n
    return None

  def value(self, name: Optional[str], **labels) -> Optional[float]:
    """Sum over the samples of `name` whose labels include `labels`; None if there are none."""
    if name is None:
      return None
    want = set((k, str(v)) for k, v in labels.items())
    vals = [v for (n, lab), v in self.samples.items() if n == name and want <= set(lab)]
    return sum(vals) if vals else None

  def by_label(self, name: Optional[str], label: str) -> dict[str, float]:
    out = {}
    if name is None:
      return out
    for (n, lab), v in self.samples.items():
      if n == name:
        d = dict(lab)
        if label in d:
          out[d[label]] = out.get(d[label], 0.0) + v
    return out


def scrape(url: str, timeout: float = 10.0, api_key: str = "") -> Scrape:
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout, headers=headers)
  r.raise_for_status()
  return Scrape(r.text)


async def ascrape(http: httpx.AsyncClient, url: str) -> Scrape:
  r = await http.get(url.rstrip("/") + "/metrics")
  r.raise_for_status()
  return Scrape(r.text)


def delta(before: Scrape, after: Scrape) -> Scrape:
  """after - before for every sample (gauges come out as their change; read gauges off a scrape instead)."""
  d = Scrape()
  d.types = dict(after.types)
  for key, v in after.samples.items():
    d.samples[key] = v - before.samples.get(key, 0.0)
  return d


def histogram_quantile(d: Scrape, base: str, q: float) -> Optional[float]:
  """Prometheus' histogram_quantile over the bucket deltas of `base` (linear inside the bucket)."""
  buckets = d.by_label(base + "_bucket", "le")
  if not buckets:
    return None
  pts = sorted((math.inf if le in ("+Inf", "inf") else float(le), c) for le, c in buckets.items())
  total = pts[-1][1]
  if total <= 0:
    return None
  rank = q * total
  prev_le, prev_c = 0.0, 0.0
  for le, c in pts:
    if c >= rank:
      if math.isinf(le):
        return prev_le
      return prev_le + (le - prev_le) * ((rank - prev_c) / max(c - prev_c, 1e-12))
    prev_le, prev_c = le, c
  return prev_le


def histogram_mean(d: Scrape, base: str) -> Optional[float]:
  s, c = d.value(base + "_sum"), d.value(base + "_count")
  return s / c if s is not None and c else None


def find_hist(s: Scrape, *stems: str) -> Optional[str]:
  """The base name of a histogram whose name contains one of `stems` (e.g. 'time_to_first_token', 'ttft')."""
  bases = sorted(n[:-len("_count")] for n in s.names() if n.endswith("_count"))
  for stem in stems:
    for b in bases:
      if stem in b:
        return b
  return None


def speculation(d: Scrape) -> dict:
  """Acceptance from counter deltas, vLLM's definitions: rate = accepted / drafted tokens; mean acceptance length
  = 1 + accepted / drafts (tokens committed per step); per position p = accepted at p / drafts."""
  drafts = d.value(d.find("spec_decode_num_drafts"))
  draft_tokens = d.value(d.find("spec_decode_num_draft_tokens"))
  accepted = d.value(d.find("spec_decode_num_accepted_tokens"))
  per_pos = d.by_label(d.find("spec_decode_num_accepted_tokens_per_pos"), "position")
  out = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
         "acceptance_rate": (accepted / draft_tokens) if draft_tokens else None,
         "mean_acceptance_length": (1.0 + accepted / drafts) if drafts else None,
         "per_position": {}}
  if drafts:
    out["per_position"] = {int(p): v / drafts for p, v in sorted(per_pos.items(), key=lambda kv: int(kv[0]))}
  return out


def summarize_delta(d: Scrape) -> dict:
  """Everything the report reads off one point's delta: speculation, server-side latency histograms, tokens,
  errors and finish reasons, and proposer time when the server exports it."""
  out = {"speculation": speculation(d)}
  for key, stems in (("ttft", ("time_to_first_token", "ttft")), ("itl", ("inter_token", "itl")),
                     ("tpot", ("time_per_output_token", "tpot")), ("e2e", ("e2e", "request_latency")),
                     ("queue", ("queue",))):
    base = find_hist(d, *stems)
    if base:
      out[f"server_{key}"] = {"name": base, "mean": histogram_mean(d, base),
                              "p50": histogram_quantile(d, base, 0.5), "p95": histogram_quantile(d, base, 0.95),
                              "count": d.value(base + "_count")}
  for key, suffixes in (("generation_tokens", ("generation_tokens", "completion_tokens", "output_tokens")),
                        ("prompt_tokens", ("prompt_tokens",)),
                        ("proposer_seconds", ("proposer_time_seconds", "propose_time_seconds", "proposer_seconds",
                                              "draft_time_seconds")),
                        ("step_seconds", ("step_time_seconds", "engine_step_seconds", "decode_time_seconds",
                                          "step_seconds")),
                        ("timing_probes", ("timing_probes",)),
                        ("oom_events", ("oom_events", "out_of_memory")),
                        ("preemptions", ("num_preemptions",)),  # the paged KV pool (serve/loadtest/report_kv.py)
                        ("prefix_cache_queries", ("prefix_cache_queries",)),
                        ("prefix_cache_hits", ("prefix_cache_hits",))):
    name = d.find(*suffixes)
    if name is None:  # maybe a histogram: use its sum
      base = find_hist(d, *suffixes)
      name = base + "_sum" if base else None
    out[key] = d.value(name)
  if out["proposer_seconds"] is not None and out["step_seconds"]:
    out["proposer_share"] = out["proposer_seconds"] / out["step_seconds"]
  else:
    out["proposer_share"] = None
  host = find_hist(d, "engine_host_seconds")
  out["engine_host_mean_s"] = histogram_mean(d, host) if host else None
  out["steps_by_k"] = {int(k): v for k, v in d.by_label(d.find("spec_decode_steps"), "k").items() if v}
  for key, suffixes, label in (("errors", ("errors", "request_errors", "num_errors"), "kind"),
                               ("finished", ("request_success", "finished_requests", "requests_finished"),
                                ("finished_reason", "finish_reason"))):
    name = d.find(*suffixes)
    out[key] = {}
    for lab in (label,) if isinstance(label, str) else label:
      out[key] = out[key] or (d.by_label(name, lab) if name else {})
    if name and not out[key]:
      v = d.value(name)
      out[key] = {"all": v} if v else {}
  return out


GAUGES = {"running": ("num_requests_running", "requests_running", "running"),
          "waiting": ("num_requests_waiting", "requests_waiting", "waiting"),
          "slots_in_use": ("num_slots_in_use", "slots_in_use", "slots_used"),
          "slots": ("num_slots",),
          "speculation_enabled": ("speculation_enabled", "spec_decode_enabled"),
          "device_memory_bytes": ("device_memory_bytes", "device_memory_in_use_bytes", "memory_bytes_in_use"),
          "kv_usage": ("kv_cache_usage_perc",)}


def gauges(s: Scrape) -> dict:
  return {k: s.value(s.find(*sufs)) for k, sufs in GAUGES.items()}
