"""Automatic rollback of speculation: switch it off when it stops paying, probe after a cool-down, turn it back on.

  --guardrails='{"acceptance_floor": 0.3, "acceptance_for_s": 10, "itl_p95_ratio": 1.0, "baseline_every_s": 60}'

Three trips, each optional (a key that is absent disables it):
- acceptance: the acceptance rate (accepted / drafted tokens) over the last `acceptance_window_s` stays below
  `acceptance_floor` for `acceptance_for_s` seconds (windows with fewer than `min_drafted` drafted tokens say
  nothing).
- latency: the p95 inter-token latency over the last `itl_window_s` exceeds `itl_p95_ratio` x the baseline's.
  The baseline's p95 is measured on the live traffic in short k = 0 windows (`baseline_window_s` long, every
  `baseline_every_s`), because a number measured at another load or on another day does not compare.
- live A/B (`"live_ab": true`, with the server's `--switchback` windows, serve/engine/live_ab.py): the segment's live
  verdict says roll back.
- KV dtype (`kv_tau_baseline`, with an 8-bit `--kv_cache_dtype`): the segment's live tau (1 + accepted / drafts,
  drafts = verify steps that drafted, over the last `acceptance_window_s`) stays below
  (1 - `kv_tau_margin`) x its baseline for `acceptance_for_s` seconds. The baseline is the tau the same pair
  reached on the same segment with the cache in the activation dtype (`auto`): a number for every segment or
  {segment: tau}, read off `serve.check_pair` (tau_auto at the traffic's temperature) or off GET
  /admin/speculation's live `tau` of a server run under `auto`. Under `auto` this trip is inert (there was no
  change of KV dtype) and the status only shows the live tau to record.
The guardrails act per segment of the speculative config's policy (one state machine each; without a policy, one
segment, "default"): a segment that trips is switched off alone, and its k = 0 baseline windows hold only its rows.
After a trip speculation stays off for `cooldown_s`, then a probe turns it on for `probe_s` and judges the same
two conditions over the probe alone: it passes (speculation stays on) or speculation goes off for another
cool-down. The engine logs and counts every switch (`spec_jax:speculation_switches_total{segment, enabled,
reason}`).

This class is pure bookkeeping over (time, observations): the engine feeds it and applies its decisions.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Optional

import numpy as np

from spec_jax.spec_config import read_json_arg

ON, BASELINE, OFF, PROBE = "on", "baseline_window", "off", "probe"
log = logging.getLogger("spec_jax.engine")


@dataclasses.dataclass(frozen=True)
class GuardrailConfig:
  acceptance_floor: float | None = None
  acceptance_window_s: float = 10.0
  acceptance_for_s: float = 10.0
  min_drafted: int = 32
  itl_p95_ratio: float | None = None
  itl_window_s: float = 10.0
  min_itl_samples: int = 32
  baseline_every_s: float = 60.0
  baseline_window_s: float = 2.0
  cooldown_s: float = 60.0
  probe_s: float = 5.0
  live_ab: bool = False
  kv_tau_baseline: float | dict | None = None  # tau under --kv_cache_dtype auto: a number or {segment: tau}
  kv_tau_margin: float = 0.05  # trip when the 8-bit cache's tau < (1 - margin) x that baseline

  @classmethod
  def parse(cls, text: str | None) -> "GuardrailConfig | None":
    """Inline JSON or a JSON file; None or '' means no automatic guardrails."""
    if text is None or not text.strip():
      return None
    obj = read_json_arg(text, "--guardrails")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(obj) - set(fields)
    if unknown:
      raise ValueError(f"--guardrails: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
    for key, v in obj.items():
      if v is None and key in ("acceptance_floor", "itl_p95_ratio", "kv_tau_baseline"):
        continue
      if key == "kv_tau_baseline":
        _check_taus(v)
        continue
      if key == "live_ab":
        if not isinstance(v, bool):
          raise ValueError(f"--guardrails: live_ab must be true or false, got {v!r}")
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
        raise ValueError(f"--guardrails: {key} must be a number >= 0, got {v!r}")
    cfg = cls(**obj)
    if not cfg.kv_tau_margin < 1:
      raise ValueError(f"--guardrails: kv_tau_margin must be in [0, 1), got {cfg.kv_tau_margin!r}")
    if (cfg.acceptance_floor is None and cfg.itl_p95_ratio is None and not cfg.live_ab
        and cfg.kv_tau_baseline is None):
      raise ValueError("--guardrails: set acceptance_floor, itl_p95_ratio, live_ab and/or kv_tau_baseline")
    return cfg

  def tau_baseline(self, segment: str) -> float | None:
    """The segment's tau under `auto` (None: no KV-dtype trip for it)."""
    b = self.kv_tau_baseline
    return b.get(segment) if isinstance(b, dict) else b


def _check_taus(v) -> None:
  """A tau is >= 1 (the bonus token): a number, or {segment: number}."""
  items = v.items() if isinstance(v, dict) else [("", v)]
  for seg, t in items:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 1:
      raise ValueError(f"--guardrails: kv_tau_baseline{'[' + repr(seg) + ']' if seg else ''} must be a tau >= 1 "
                       f"(1 + accepted / drafts, measured under --kv_cache_dtype auto), got {t!r}")


def p95(xs) -> float:
  return float(np.percentile(np.asarray(xs, np.float64), 95))


class Guardrails:
  """State machine on -> (trip) off -> (cool-down) probe -> on | off; on -> baseline window -> on."""

  def __init__(self, cfg: GuardrailConfig, now: float, tau_baseline: float | None = None):
    """tau_baseline: the segment's tau under --kv_cache_dtype auto, given only when the cache is 8-bit now (the
    KV-dtype trip watches it); None disables that trip."""
    self.cfg = cfg
    self.tau_baseline = tau_baseline
    self.reset(now)
    self.baseline_p95: float | None = None

  def reset(self, now: float) -> None:
    """Back to monitoring (the admin switch turned speculation on)."""
    self.mode = ON
    self.since = now
    self.next_baseline = now  # measure a baseline as soon as there is traffic
    self._acc = collections.deque()  # (t, drafted, accepted, drafts) while speculation is on
    self._itl = collections.deque()  # (t, itl) while speculation is on
    self._base_itl: list = []
    self._below_since: dict = {}  # reason -> since when its condition has held (acceptance_floor, kv_dtype_tau)

  @property
  def speculation_on(self) -> bool:
    return self.mode in (ON, PROBE)

  def observe(self, now: float, drafted: int, accepted: int, itl: list, drafts: int = 0) -> None:
    """One engine iteration's hand-overs: drafted/accepted token deltas, per-token ITL samples, and the verify
    steps that drafted (`drafts`, for tau)."""
    if self.mode == BASELINE:
      self._base_itl.extend(itl)
    elif self.mode in (ON, PROBE):
      if drafted:
        self._acc.append((now, drafted, accepted, drafts))
      self._itl.extend((now, x) for x in itl)
    horizon = now - max(self.cfg.acceptance_window_s, self.cfg.itl_window_s, self.cfg.probe_s)
    while self._acc and self._acc[0][0] < horizon:
      self._acc.popleft()
    while self._itl and self._itl[0][0] < horizon:
      self._itl.popleft()

  def tau(self, now: float, window: float | None = None) -> float | None:
    """1 + accepted / drafts over the last `window` seconds (acceptance_window_s); None under min_drafted."""
    recent = [x for x in self._acc if x[0] >= now - (self.cfg.acceptance_window_s if window is None else window)]
    drafted, drafts = sum(x[1] for x in recent), sum(x[3] for x in recent)
    if drafted < self.cfg.min_drafted or not drafts:
      return None
    return 1.0 + sum(x[2] for x in recent) / drafts

  def _held(self, reason: str, below, now: float) -> bool:
    """Whether `below` (None: nothing measured, which neither starts nor ends a spell) has held for
    acceptance_for_s since it first did."""
    if below:
      return now - self._below_since.setdefault(reason, now) >= self.cfg.acceptance_for_s
    if below is not None:
      self._below_since.pop(reason, None)
    return False

  def _failing(self, now: float, acc_window: float, itl_window: float):
    """-> (acceptance too low, tau too far below the `auto` baseline, ITL too high); each None when unknown."""
    c = self.cfg
    low = tau_low = high = None
    if c.acceptance_floor is not None:
      d = sum(x[1] for x in self._acc if x[0] >= now - acc_window)
      a = sum(x[2] for x in self._acc if x[0] >= now - acc_window)
      if d >= c.min_drafted:
        low = a / d < c.acceptance_floor
    if self.tau_baseline is not None:
      tau = self.tau(now, acc_window)
      if tau is not None:
        tau_low = tau < (1.0 - c.kv_tau_margin) * self.tau_baseline
    if c.itl_p95_ratio is not None and self.baseline_p95 is not None:
      xs = [x for t, x in self._itl if t >= now - itl_window]
      if len(xs) >= c.min_itl_samples:
        high = p95(xs) > c.itl_p95_ratio * self.baseline_p95
    return low, tau_low, high

  def decide(self, now: float, live: Optional[dict] = None):
    """-> (enabled, reason) when speculation should switch (or a probe passed), else None. live: the segment's
    live A/B verdict (serve/engine/live_ab.py), consulted with `live_ab`."""
    c = self.cfg
    if self.mode == ON and c.live_ab and live is not None and live["verdict"] == "roll back":
      return self._go(OFF, now, False, f"live_ab_{live['metric']}")
    if self.mode == ON:
      low, tau_low, high = self._failing(now, c.acceptance_window_s, c.itl_window_s)
      for reason, below in (("acceptance_floor", low), ("kv_dtype_tau", tau_low)):
        if self._held(reason, below, now):
          return self._go(OFF, now, False, reason)
      if high:
        return self._go(OFF, now, False, "itl_p95")
      traffic = any(t >= now - c.itl_window_s for t, _ in self._itl)
      if c.itl_p95_ratio is not None and now >= self.next_baseline and traffic:
        self._base_itl = []
        return self._go(BASELINE, now, False, "baseline_window")
    elif self.mode == BASELINE:
      if now - self.since >= c.baseline_window_s:
        if len(self._base_itl) >= min(c.min_itl_samples, 8):
          self.baseline_p95 = p95(self._base_itl)
          self.next_baseline = now + c.baseline_every_s
        else:  # too little traffic to measure: try again soon
          self.next_baseline = now + c.baseline_window_s
        self._itl.clear()  # compare against samples taken after the window only
        return self._go(ON, now, True, "baseline_done")
    elif self.mode == OFF:
      if now - self.since >= c.cooldown_s:
        self._acc.clear()
        self._itl.clear()
        return self._go(PROBE, now, True, "probe")
    elif self.mode == PROBE:
      if now - self.since >= c.probe_s:
        low, tau_low, high = self._failing(now, now - self.since, now - self.since)
        if low or tau_low or high:
          why = "acceptance" if low else "kv_dtype_tau" if tau_low else "itl_p95"
          return self._go(OFF, now, False, f"probe_failed_{why}")
        if low is None and tau_low is None and high is None and now - self.since < 10 * c.probe_s:
          return None  # nothing measured yet (no traffic): keep probing
        self._below_since.clear()
        self.next_baseline = max(self.next_baseline, now)
        self.mode, self.since = ON, now
        return (True, "probe_passed")
    return None

  def _go(self, mode: str, now: float, enabled: bool, reason: str):
    self.mode, self.since = mode, now
    return (enabled, reason)


class SpeculationSwitch:
  """Whether rows may speculate now: the admin switch (off is sticky: the guardrails cannot turn it back on; on
  hands control back to them), one guardrail state machine per policy segment, and the tuned config's band for the
  current occupancy. The engine holds its lock around `set_admin` and `tick` (the HTTP thread and the engine
  thread both call in)."""

  def __init__(self, guard_cfg: "GuardrailConfig | None", spec_config, k_max: int, metrics, segments=("default",),
               now: float = 0.0, kv_cache_dtype: str = "auto"):
    """kv_cache_dtype: the server's --kv_cache_dtype; an 8-bit one arms each segment's KV-dtype trip against its
    kv_tau_baseline (a baseline naming a segment the policy lacks is an error)."""
    self.spec_config, self.k_max, self.metrics = spec_config, k_max, metrics
    self.kv_cache_dtype = kv_cache_dtype
    base = guard_cfg.kv_tau_baseline if guard_cfg is not None else None
    if isinstance(base, dict) and set(base) - set(segments):
      raise ValueError(f"--guardrails: kv_tau_baseline names segments {sorted(set(base) - set(segments))} the "
                       f"policy does not have ({list(segments)})")
    watch = lambda s: guard_cfg.tau_baseline(s) if kv_cache_dtype != "auto" else None
    self.guards = ({s: Guardrails(guard_cfg, now, watch(s)) for s in segments} if guard_cfg is not None else {})
    self.admin_on = True
    for s in segments:
      metrics.segment_enabled.labels(segment=s).set(1.0)

  def set_admin(self, enabled: bool, now: float) -> bool:
    """-> whether it changed."""
    if enabled == self.admin_on:
      return False
    self.admin_on = enabled
    if enabled:
      for g in self.guards.values():
        g.reset(now)
    log.info("speculation %s (admin)", "on" if enabled else "off")
    self.metrics.speculation_switches.labels(segment="all", enabled=str(enabled).lower(), reason="admin").inc()
    return True

  def allowed(self) -> bool:
    """The admin switch (what `spec_jax:speculation_enabled` shows; segments have their own gauge)."""
    return self.admin_on and self.k_max > 0

  def segment_on(self, segment: str) -> bool:
    g = self.guards.get(segment)
    return self.allowed() and (g is None or g.speculation_on)

  def k_at(self, busy: int) -> int:
    """The per-concurrency table's k at `busy` running requests (the loop's largest k without one)."""
    if self.spec_config is not None and busy:
      return min(self.spec_config.k_at(busy), self.k_max)
    return self.k_max

  def observe(self, segment: str, now: float, drafted: int, accepted: int, itl: list, drafts: int = 0) -> None:
    g = self.guards.get(segment)
    if g is not None:
      g.observe(now, drafted, accepted, itl, drafts)

  def tick(self, now: float, live=None) -> list:
    """Let each segment's guardrails decide (live: segment -> its live verdict, or None); log and count a switch.
    -> [(segment, enabled, reason)] of the switches made."""
    if not self.admin_on or self.k_max == 0:
      return []
    events = []
    for seg, g in self.guards.items():
      verdict = live(seg) if live is not None and g.cfg.live_ab else None
      event = g.decide(now, verdict)
      if event is None:
        continue
      enabled, reason = event
      if reason == "probe_passed":
        log.info("guardrails[%s]: probe passed, speculation stays on", seg)
        continue
      base = g.baseline_p95
      log.info("guardrails[%s]: speculation %s (%s)%s", seg, "on" if enabled else "off", reason,
               f": {verdict['detail']}" if reason.startswith("live_ab") else
               f": tau under {self.kv_cache_dtype} fell more than {g.cfg.kv_tau_margin:.0%} below "
               f"{g.tau_baseline:.2f} (auto)" if reason.endswith("kv_dtype_tau") else
               f", baseline p95 ITL {base * 1e3:.1f} ms" if base else "")
      self.metrics.speculation_switches.labels(segment=seg, enabled=str(enabled).lower(), reason=reason).inc()
      self.metrics.segment_enabled.labels(segment=seg).set(1.0 if g.speculation_on else 0.0)
      if base is not None:
        self.metrics.baseline_itl_p95.set(base)
      events.append((seg, enabled, reason))
    return events

  def status(self, busy: int, now: float | None = None) -> dict:
    """tau: each segment's live tau over its acceptance window (what to record as kv_tau_baseline under auto)."""
    now = time.monotonic() if now is None else now
    guards = {s: {"mode": g.mode, "baseline_itl_p95_s": g.baseline_p95, "tau": g.tau(now),
                  "kv_tau_baseline": g.tau_baseline} for s, g in self.guards.items()}
    return {"admin_enabled": self.admin_on, "kv_cache_dtype": self.kv_cache_dtype, "enabled": self.allowed() and self.k_at(busy) > 0
            and any(self.segment_on(s) for s in (self.guards or {"default": 0})),
            "guardrails": guards or None}
