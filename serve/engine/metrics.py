"""Prometheus metrics of the server, under the `spec_jax:` prefix, in the shape of vLLM's, and every one of them
again under vLLM's own prefix `vllm:` (the same series, renamed at each scrape), so that vLLM's Grafana
dashboards and load tools read them unchanged. Both, always, rather than a flag: the duplicate costs only scrape
bytes, and neither this project's dashboards and tests nor a vLLM one need a server restarted to find theirs.
vLLM's request histograms (prompt and generation tokens, n, max_tokens, inference / prefill / decode time),
iteration_tokens_total and cache_config_info have vLLM's names and meanings.

The speculation counters follow vLLM's `vllm/v1/spec_decode/metrics.py`, so dashboards and load tools that read
vLLM read these too: a draft is one (request, step) that proposed at least one token; draft tokens are the tokens
proposed; accepted tokens those the target kept; accepted per position counts acceptances of draft position p
(p = 0 is the first drafted token), so accepted_per_pos{p} <= num_drafts and sum_p accepted_per_pos = accepted.

Latencies are engine-side: measured when the engine hands tokens to a request's output, which is when the HTTP
layer can send them. One engine iteration can hand a request several tokens at once (speculation commits up to
k + 1 per step, and a loop call runs several steps), so an inter-token latency is per token: a hand-over of n
tokens dt after the previous one adds n samples of dt / n. Time per output token is per request:
(last token time - first token time) / (tokens - 1).

Per segment and arm (`spec_jax:segment_*{segment, arm}`): the same measurements split by the request's segment of
the speculative config's policy (its rule's name, "default" without one; never request text, so the label set is
bounded by the policy) and by the arm that produced them: "on" / "off" for switchback windows (serve/engine/live_ab.py),
"on" when there are none; a request's TPOT is credited to one arm only when all its tokens came from it ("mixed"
otherwise).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import Metric

PREFIX = "spec_jax:"
VLLM_PREFIX = "vllm:"
# vLLM's buckets for token counts and request phases (vllm/v1/metrics/loggers.py's shapes: 1-2-5 steps)
_TOKENS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))
_PHASE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
          960.0, 1920.0, 7680.0)
# Latency buckets in seconds: from a fast CPU step (a few ms) to a long queue wait.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0)
_HOST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class Metrics:
  """One registry per server, so several servers (or tests) in one process never share counters."""

  def __init__(self, k_max: int, device_memory_available: bool = False):
    r = self.registry = CollectorRegistry()
    p = PREFIX
    # The standard process_* series (CPU seconds, resident and virtual memory, open fds), unprefixed as everywhere.
    ProcessCollector(registry=r)
    # Speculation (vLLM names).
    self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Draft proposals: (request, step) pairs that drafted.",
                              registry=r)
    self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
    self.num_accepted_tokens = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
    self.accepted_from_history = Counter(f"{p}spec_decode_num_accepted_tokens_from_history",
                                         "Of the accepted draft tokens, those drafted from other requests' text "
                                         "(method suffix's shared history); the rest came from the request's own.",
                                         registry=r)
    self.accepted_per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by draft position.", ["position"], registry=r)
    for pos in range(max(k_max, 0)):
      self.accepted_per_pos.labels(position=str(pos))
    self.steps_by_k = Counter(f"{p}spec_decode_steps", "Engine loop steps, by the number of tokens drafted (k).",
                              ["k"], registry=r)
    self.speculation_enabled = Gauge(f"{p}speculation_enabled", "1 when speculation is on (the admin switch and "
                                     "the guardrails of some segment), else 0.", registry=r)
    self.speculation_switches = Counter(f"{p}speculation_switches", "Speculation switched on or off, per segment "
                                        "(\"all\": the admin switch).", ["segment", "enabled", "reason"], registry=r)
    self.segment_enabled = Gauge(f"{p}segment_speculation_enabled", "1 when a segment's guardrails let it speculate.",
                                 ["segment"], registry=r)
    # Per segment and arm (see the module docstring).
    sa = ["segment", "arm"]
    self.seg_ttft = Histogram(f"{p}segment_time_to_first_token_seconds", "Arrival to first token.", sa,
                              buckets=_LATENCY, registry=r)
    self.seg_itl = Histogram(f"{p}segment_inter_token_latency_seconds", "Per-token gap between token hand-overs.", sa,
                             buckets=_LATENCY, registry=r)
    self.seg_tpot = Histogram(f"{p}segment_request_time_per_output_token_seconds",
                              "(last token - first token) / (tokens - 1), per request.", sa, buckets=_LATENCY,
                              registry=r)
    self.seg_tokens = Counter(f"{p}segment_generation_tokens", "Tokens handed to requests.", sa, registry=r)
    self.seg_steps = Counter(f"{p}segment_verify_steps", "Verify steps of the segment's rows (tokens / steps = "
                             "acceptance length).", sa, registry=r)
    self.seg_draft_tokens = Counter(f"{p}segment_spec_decode_num_draft_tokens", "Tokens drafted.", sa, registry=r)
    self.seg_accepted_tokens = Counter(f"{p}segment_spec_decode_num_accepted_tokens", "Draft tokens accepted.", sa,
                                       registry=r)
    self.seg_requests = Counter(f"{p}segment_requests", "Requests ended, by outcome (finished or failed).",
                                sa + ["outcome"], registry=r)
    self.switchback_windows = Counter(f"{p}switchback_windows", "Switchback windows begun, by arm.", ["arm"],
                                      registry=r)
    self.baseline_itl_p95 = Gauge(f"{p}baseline_itl_p95_seconds",
                                  "p95 inter-token latency measured in the last k = 0 window (guardrails).",
                                  registry=r)
    # Latencies.
    self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY, registry=r)
    self.itl = Histogram(f"{p}inter_token_latency_seconds", "Per-token gap between token hand-overs.",
                         buckets=_LATENCY, registry=r)
    self.tpot = Histogram(f"{p}request_time_per_output_token_seconds",
                          "(last token - first token) / (tokens - 1), per request.", buckets=_LATENCY, registry=r)
    self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY, registry=r)
    self.queue_time = Histogram(f"{p}request_queue_time_seconds", "Arrival to slot insert.", buckets=_LATENCY,
                                registry=r)
    self.host_time = Histogram(f"{p}engine_host_seconds",
                               "Host work per engine iteration (scheduling, dispatch, detokenizing), device waits "
                               "excluded.", buckets=_HOST, registry=r)
    # Step time split, sampled by the engine's timing probe (serve/engine/timing_probe.py): share = proposer / step.
    self.proposer_time = Counter(f"{p}proposer_time_seconds",
                                 "Sum over timing probes of one propose() on the live batch.", registry=r)
    self.step_time = Counter(f"{p}step_time_seconds",
                             "Sum over timing probes of one decode step (draft, verify, commit) on the live batch.",
                             registry=r)
    self.timing_probes = Counter(f"{p}timing_probes", "Timing probes taken.", registry=r)
    # Device memory, only where JAX reports it (GPU, TPU; not CPU).
    self.device_memory = self.device_memory_peak = None
    if device_memory_available:
      self.device_memory = Gauge(f"{p}device_memory_bytes", "Device memory in use (first local device).",
                                 registry=r)
      self.device_memory_peak = Gauge(f"{p}device_memory_peak_bytes", "Peak device memory in use.", registry=r)
    # Load.
    self.running = Gauge(f"{p}num_requests_running", "Requests in a decode slot.", registry=r)
    self.waiting = Gauge(f"{p}num_requests_waiting", "Requests in the waiting queue.", registry=r)
    self.slots_in_use = Gauge(f"{p}num_slots_in_use", "Decode slots held by a request.", registry=r)
    self.slots_total = Gauge(f"{p}num_slots", "Decode slots (--max_num_seqs).", registry=r)
    # The paged KV pool (serve/engine/kv_scheduler.py), vLLM's names; the prefix counters count tokens.
    self.kv_cache_usage = Gauge(f"{p}kv_cache_usage_perc", "Fraction of the KV pool's pages requests hold (1 = full).",
                                registry=r)
    self.num_preemptions = Counter(f"{p}num_preemptions", "Requests preempted for KV pages (resumed by recompute).",
                                   registry=r)
    self.prefix_cache_queries = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                        registry=r)
    self.prefix_cache_hits = Counter(f"{p}prefix_cache_hits", "Of those, tokens whose KV pages were reused.",
                                     registry=r)
    self.kv_proposer_bytes = Gauge(f"{p}kv_cache_proposer_bytes", "KV bytes the proposer's caches hold in the "
                                   "pages requests hold (its share of each page).", registry=r)
    self.kv_pages = Gauge(f"{p}kv_cache_pages", "Pages in the KV pool (the null page not counted).", registry=r)
    self.kv_page_bytes = Gauge(f"{p}kv_cache_page_bytes", "Bytes of one KV page, by holder.", ["holder"], registry=r)
    # Outcomes.
    self.finished = Counter(f"{p}request_success", "Finished requests, by finish reason.", ["finished_reason"],
                            registry=r)
    self.errors = Counter(f"{p}request_errors", "Requests answered with an error, by kind.", ["kind"], registry=r)
    self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
    self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens handed to requests.", registry=r)
    for reason in ("stop", "length", "abort"):
      self.finished.labels(finished_reason=reason)
    # vLLM's per-request histograms (observed when a request ends; n per HTTP request)
    self.request_prompt_tokens = Histogram(f"{p}request_prompt_tokens", "Prompt tokens per finished request.",
                                           buckets=_TOKENS, registry=r)
    self.request_generation_tokens = Histogram(f"{p}request_generation_tokens",
                                               "Generated tokens per finished request.", buckets=_TOKENS, registry=r)
    self.request_params_n = Histogram(f"{p}request_params_n", "The n of each request.", buckets=(1, 2, 5, 10, 20),
                                      registry=r)
    self.request_params_max_tokens = Histogram(f"{p}request_params_max_tokens", "The output budget of each "
                                               "finished request (max_tokens, or the default).", buckets=_TOKENS,
                                               registry=r)
    self.request_inference_time = Histogram(f"{p}request_inference_time_seconds", "Slot insert to finish.",
                                            buckets=_PHASE, registry=r)
    self.request_prefill_time = Histogram(f"{p}request_prefill_time_seconds", "Slot insert to first token.",
                                          buckets=_PHASE, registry=r)
    self.request_decode_time = Histogram(f"{p}request_decode_time_seconds", "First token to finish.",
                                         buckets=_PHASE, registry=r)
    self.iteration_tokens = Histogram(f"{p}iteration_tokens_total", "Tokens per engine iteration: prompt tokens "
                                      "inserted and tokens handed to requests.", buckets=_TOKENS, registry=r)
    self.cache_config = Gauge(f"{p}cache_config_info", "The KV cache's settings (vLLM's labels), value 1.",
                              ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)
    self.vllm_view = CollectorRegistry(auto_describe=False)
    self.vllm_view.register(_Renamed(r, PREFIX, VLLM_PREFIX))

  def observe_request_end(self, req, now: float) -> None:
    """vLLM's per-request histograms, at a request's end (finished or aborted; a request that never got a slot
    has no phases)."""
    self.request_prompt_tokens.observe(len(req.prompt_ids))
    self.request_generation_tokens.observe(req.n_tokens)
    self.request_params_max_tokens.observe(req.max_new)
    if req.admitted_at is not None:
      self.request_inference_time.observe(now - req.admitted_at)
      if req.first_at is not None:
        self.request_prefill_time.observe(req.first_at - req.admitted_at)
        self.request_decode_time.observe(now - req.first_at)

  def observe_occupancy(self, running: int, waiting: int) -> None:
    """Requests in slots and in the queue (every slot a running request holds is in use)."""
    self.running.set(running)
    self.slots_in_use.set(running)
    self.waiting.set(waiting)

  def observe_steps(self, ks: tuple, new_uses) -> None:
    """Loop steps since the last snapshot, per option (`new_uses[i]` steps drafted `ks[i]` tokens)."""
    for k, n in zip(ks, new_uses):
      if n > 0:
        self.steps_by_k.labels(k=str(k)).inc(int(n))

  def observe_drafts(self, drafted: int, accepted: int, drafts: int, accepted_at) -> None:
    """One request's speculation since its last snapshot: tokens drafted and accepted, drafting steps, and
    accepted tokens per draft position (`accepted_at[j]`: at position j)."""
    if drafted:
      self.num_draft_tokens.inc(drafted)
      self.num_drafts.inc(drafts)
    if accepted:
      self.num_accepted_tokens.inc(accepted)
      for pos in accepted_at.nonzero()[0]:
        self.accepted_per_pos.labels(position=str(pos)).inc(int(accepted_at[pos]))

  def render(self) -> bytes:
    return generate_latest(self.registry) + generate_latest(self.vllm_view)


class _Renamed:
  """A registry's families whose names start with `old`, under `new` instead (samples and all)."""

  def __init__(self, registry, old: str, new: str):
    self.registry, self.old, self.new = registry, old, new

  def collect(self):
    for fam in self.registry.collect():
      if not fam.name.startswith(self.old):
        continue
      out = Metric(self.new + fam.name[len(self.old):], fam.documentation, fam.type, fam.unit)
      out.samples = [s._replace(name=self.new + s.name[len(self.old):]) for s in fam.samples]
      yield out
