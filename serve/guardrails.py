"""Automatic rollback of speculation: switch it off when it stops paying, probe after a cool-down, turn it back on.

  --guardrails='{"acceptance_floor": 0.3, "acceptance_for_s": 10, "itl_p95_ratio": 1.0, "baseline_every_s": 60}'

Two trips, each optional (a key that is absent disables it):
- acceptance: the acceptance rate (accepted / drafted tokens) over the last `acceptance_window_s` stays below
  `acceptance_floor` for `acceptance_for_s` seconds (windows with fewer than `min_drafted` drafted tokens say
  nothing).
- latency: the p95 inter-token latency over the last `itl_window_s` exceeds `itl_p95_ratio` x the baseline's.
  The baseline's p95 is measured on the live traffic in short k = 0 windows (`baseline_window_s` long, every
  `baseline_every_s`), because a number measured at another load or on another day does not compare.
After a trip speculation stays off for `cooldown_s`, then a probe turns it on for `probe_s` and judges the same
two conditions over the probe alone: it passes (speculation stays on) or speculation goes off for another
cool-down. The engine logs and counts every switch (`spec_jax:speculation_switches_total{enabled, reason}`).

This class is pure bookkeeping over (time, observations): the engine feeds it and applies its decisions.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

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
      if v is None and key in ("acceptance_floor", "itl_p95_ratio"):
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
        raise ValueError(f"--guardrails: {key} must be a number >= 0, got {v!r}")
    cfg = cls(**obj)
    if cfg.acceptance_floor is None and cfg.itl_p95_ratio is None:
      raise ValueError("--guardrails: set acceptance_floor and/or itl_p95_ratio")
    return cfg


def p95(xs) -> float:
  return float(np.percentile(np.asarray(xs, np.float64), 95))


class Guardrails:
  """State machine on -> (trip) off -> (cool-down) probe -> on | off; on -> baseline window -> on."""

  def __init__(self, cfg: GuardrailConfig, now: float):
    self.cfg = cfg
    self.reset(now)
    self.baseline_p95: float | None = None

  def reset(self, now: float) -> None:
    """Back to monitoring (the admin switch turned speculation on)."""
    self.mode = ON
    self.since = now
    self.next_baseline = now  # measure a baseline as soon as there is traffic
    self._acc = collections.deque()  # (t, drafted, accepted) while speculation is on
    self._itl = collections.deque()  # (t, itl) while speculation is on
    self._base_itl: list = []
    self._below_since: float | None = None

  @property
  def speculation_on(self) -> bool:
    return self.mode in (ON, PROBE)

  def observe(self, now: float, drafted: int, accepted: int, itl: list) -> None:
    """One engine iteration's hand-overs: drafted/accepted token deltas and per-token ITL samples."""
    if self.mode == BASELINE:
      self._base_itl.extend(itl)
    elif self.mode in (ON, PROBE):
      if drafted:
        self._acc.append((now, drafted, accepted))
      self._itl.extend((now, x) for x in itl)
    horizon = now - max(self.cfg.acceptance_window_s, self.cfg.itl_window_s, self.cfg.probe_s)
    while self._acc and self._acc[0][0] < horizon:
      self._acc.popleft()
    while self._itl and self._itl[0][0] < horizon:
      self._itl.popleft()

  def _failing(self, now: float, acc_window: float, itl_window: float):
    """-> (acceptance too low or None when unknown, ITL too high or None when unknown)."""
    c = self.cfg
    low = high = None
    if c.acceptance_floor is not None:
      d = sum(x[1] for x in self._acc if x[0] >= now - acc_window)
      a = sum(x[2] for x in self._acc if x[0] >= now - acc_window)
      if d >= c.min_drafted:
        low = a / d < c.acceptance_floor
    if c.itl_p95_ratio is not None and self.baseline_p95 is not None:
      xs = [x for t, x in self._itl if t >= now - itl_window]
      if len(xs) >= c.min_itl_samples:
        high = p95(xs) > c.itl_p95_ratio * self.baseline_p95
    return low, high

  def decide(self, now: float):
    """-> (enabled, reason) when speculation should switch (or a probe passed), else None."""
    c = self.cfg
    if self.mode == ON:
      low, high = self._failing(now, c.acceptance_window_s, c.itl_window_s)
      if low:
        self._below_since = now if self._below_since is None else self._below_since
        if now - self._below_since >= c.acceptance_for_s:
          return self._go(OFF, now, False, "acceptance_floor")
      elif low is not None:
        self._below_since = None
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
        low, high = self._failing(now, now - self.since, now - self.since)
        if low or high:
          return self._go(OFF, now, False, "probe_failed_acceptance" if low else "probe_failed_itl_p95")
        if low is None and high is None and now - self.since < 10 * c.probe_s:
          return None  # nothing measured yet (no traffic): keep probing
        self._below_since = None
        self.next_baseline = max(self.next_baseline, now)
        self.mode, self.since = ON, now
        return (True, "probe_passed")
    return None

  def _go(self, mode: str, now: float, enabled: bool, reason: str):
    self.mode, self.since = mode, now
    return (enabled, reason)


class SpeculationSwitch:
  """Whether the loop speculates now: the admin switch (off is sticky: the guardrails cannot turn it back on; on
  hands control back to them), the guardrails, and the tuned config's band for the current occupancy. The engine
  holds its lock around `set_admin` and `tick` (the HTTP thread and the engine thread both call in)."""

  def __init__(self, guard: "Guardrails | None", spec_config, k_max: int, metrics):
    self.guard, self.spec_config, self.k_max, self.metrics = guard, spec_config, k_max, metrics
    self.admin_on = True

  def set_admin(self, enabled: bool, now: float) -> bool:
    """-> whether it changed."""
    if enabled == self.admin_on:
      return False
    self.admin_on = enabled
    if enabled and self.guard is not None:
      self.guard.reset(now)
    log.info("speculation %s (admin)", "on" if enabled else "off")
    self.metrics.speculation_switches.labels(enabled=str(enabled).lower(), reason="admin").inc()
    return True

  def allowed(self) -> bool:
    """The admin switch and the guardrails (what `spec_jax:speculation_enabled` shows)."""
    return self.admin_on and (self.guard is None or self.guard.speculation_on)

  def wanted(self, busy: int) -> bool:
    """Speculate at `busy` running requests?"""
    on = self.allowed()
    if on and self.spec_config is not None and busy:
      on = self.spec_config.k_at(busy) > 0
    return on and self.k_max > 0

  def tick(self, now: float) -> None:
    """Let the guardrails decide; log and count a switch."""
    if self.guard is None or not self.admin_on or self.k_max == 0:
      return
    event = self.guard.decide(now)
    if event is None:
      return
    enabled, reason = event
    if reason == "probe_passed":
      log.info("guardrails: probe passed, speculation stays on")
      return
    base = self.guard.baseline_p95
    log.info("guardrails: speculation %s (%s)%s", "on" if enabled else "off", reason,
             f", baseline p95 ITL {base * 1e3:.1f} ms" if base else "")
    self.metrics.speculation_switches.labels(enabled=str(enabled).lower(), reason=reason).inc()
    if base is not None:
      self.metrics.baseline_itl_p95.set(base)

  def status(self, busy: int) -> dict:
    g = self.guard
    return {"admin_enabled": self.admin_on, "enabled": self.wanted(busy),
            "guardrails": None if g is None else {"mode": g.mode, "baseline_itl_p95_s": g.baseline_p95}}
