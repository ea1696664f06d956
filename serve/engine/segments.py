"""The engine's view of traffic segments: which rule of the speculative config's policy (and which canary arm) a
request falls in, the switchback window a loop is dispatched in, and the crediting of every hand-over to its
(segment, arm) in the metrics and the live A/B (serve/engine/live_ab.py). The engine thread writes; GET
/admin/speculation/report reads under the lock."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from serve.engine import live_ab
from spec_jax.spec_policy import Features


class Segments:

  def __init__(self, spec_config, switchback, metrics, now: float):
    self.policy = getattr(spec_config, "policy", None)
    self.canary = getattr(spec_config, "canary", None)
    names = list(self.policy.names if self.policy is not None else ("default",))
    if self.canary is not None:
      names += [n for n in self.canary.policy.names if n not in names]
    self.names = tuple(names)
    self.metrics, self.switchback = metrics, switchback
    self.schedule = live_ab.Schedule(switchback, now) if switchback is not None else None
    self.live = (live_ab.LiveAB(switchback, windows_of=live_ab.window_count(self.schedule))
                 if switchback is not None else None)
    self.canary_ab = (live_ab.LiveAB(switchback or live_ab.SwitchbackConfig(), live_ab.CANARY, live_ab.STABLE)
                      if self.canary is not None else None)
    self._t0 = now
    self._lock = threading.Lock()  # the live stats: written by the engine thread, read by /admin
    self._window = -1  # the switchback window of now (as of the last tick)
    self._verdicts: dict = {}  # segment -> live verdict, recomputed once per window (the guardrails read them)

  def to_json(self) -> dict:
    return {"policy": None if self.policy is None else self.policy.to_json(),
            "canary": None if self.canary is None else self.canary.to_json(),
            "switchback": None if self.switchback is None else dataclasses.asdict(self.switchback)}

  def classify(self, req, busy: int, k_max: int) -> None:
    """The request's segment and draft cap (the policy's first matching rule) at `busy` slots held with it, and
    its canary arm; its device request gets the cap."""
    spec = req.spec
    f = Features(temperature=float(spec.sampling.temperature), prompt_tokens=len(req.prompt_ids),
                 max_tokens=spec.max_new, busy_slots=busy, segment=spec.tag)
    policy = self.policy
    if self.canary is not None:
      req.canary = self.canary.takes(live_ab.content_key(spec))
      req.canary_segment = self.canary.policy.pick(f).name
      if req.canary:
        policy = self.canary.policy
    if policy is None:
      req.segment, req.policy_k = "default", k_max
    else:
      rule = policy.pick(f)
      req.segment, req.policy_k = rule.name, rule.k
    if not req.speculate:
      req.policy_k = 0
    req.device_req = req.device_req.replace(draft_cap=np.int32(min(req.policy_k, k_max)))

  def tick(self, now: float) -> None:
    """The switchback window now; at a new one, count it and refresh the live verdicts the guardrails read."""
    if self.schedule is None:
      return
    w = self.schedule.window(now)
    if w != self._window:
      self._window = w
      self.metrics.switchback_windows.labels(arm=self.schedule.arm(w)).inc()
      with self._lock:
        self._verdicts = {seg: self.live.verdict(seg) for seg in self.names}

  def now(self) -> tuple:
    """(window, arm) of now: what a loop dispatched now runs in."""
    w = max(self._window, 0)
    return w, self.schedule.arm(w) if self.schedule is not None else live_ab.ON

  @property
  def verdict_of(self):
    """segment -> its live verdict, for the guardrails (None without switchback)."""
    return self._verdicts.get if self.live is not None else None

  def restart(self, segments) -> None:
    """Segments that switched off or began a probe: their live A/B measures afresh."""
    if self.live is None:
      return
    with self._lock:
      for seg in segments:
        self.live.reset(seg, self._window)
        self._verdicts.pop(seg, None)

  def credit(self, req, dispatched: tuple, now: float, **obs) -> None:
    """Credit a request's hand-over (and its end, once) to its segment and arm: metrics and the live A/B."""
    window, arm = dispatched
    seg, m = req.segment, self.metrics
    ended = req.finished and not req.ended_counted
    if ended:
      req.ended_counted = True
      obs.update(finished=int(not req.failed), failed=int(req.failed))
    if obs.get("tokens"):
      req.arms.add(arm)
      m.seg_tokens.labels(segment=seg, arm=arm).inc(obs["tokens"])
    for x in obs.get("itl") or ():
      m.seg_itl.labels(segment=seg, arm=arm).observe(x)
    if obs.get("steps"):
      m.seg_steps.labels(segment=seg, arm=arm).inc(obs["steps"])
    if obs.get("drafted"):
      m.seg_draft_tokens.labels(segment=seg, arm=arm).inc(obs["drafted"])
    if obs.get("accepted"):
      m.seg_accepted_tokens.labels(segment=seg, arm=arm).inc(obs["accepted"])
    if obs.get("ttft") is not None:
      m.seg_ttft.labels(segment=seg, arm=arm).observe(obs["ttft"])
    if ended:
      m.seg_requests.labels(segment=seg, arm=arm, outcome="failed" if req.failed else "finished").inc()
      if not req.failed and req.first_at is not None and req.n_tokens > 1:
        tpot_arm = next(iter(req.arms)) if len(req.arms) == 1 else "mixed"
        m.seg_tpot.labels(segment=seg, arm=tpot_arm).observe((req.last_at - req.first_at) / (req.n_tokens - 1))
    if self.live is None and self.canary_ab is None:
      return
    with self._lock:
      if self.live is not None:
        self.live.add(seg, arm, window, **obs)
      if self.canary_ab is not None and req.canary is not None:
        w = window if self.schedule is not None else int((now - self._t0) // self.canary_ab.cfg.window_s)
        self.canary_ab.add(req.canary_segment, live_ab.CANARY if req.canary else live_ab.STABLE, w, **obs)

  def report(self, switch, method: str, k_max: int) -> dict:
    """GET /admin/speculation/report: per segment, the live verdict (keep / roll back / neutral, the deciding
    metric, its interval, the sample counts) and each arm's measurements; the canary's comparison beside it."""
    with self._lock:
      ks = {r.name: r.k for r in self.policy.rules} if self.policy is not None else {"default": k_max}
      out = {"method": method, "switchback": None, "segments": {}, "canary": None}
      rep = {}
      if self.live is not None:
        w = max(self._window, 0)
        out["switchback"] = {**dataclasses.asdict(self.switchback), "window": self._window,
                             "arm": self.schedule.arm(w),
                             "windows": {a: self.schedule.count(a, 0, w) for a in (live_ab.ON, live_ab.OFF)}}
        rep = self.live.report(self.names)
      for seg in self.names:
        g = switch.guards.get(seg)
        out["segments"][seg] = {"num_speculative_tokens": ks.get(seg), "guardrails": None if g is None else g.mode,
                                "enabled": switch.segment_on(seg), **rep.get(seg, {})}
      if self.canary_ab is not None:
        out["canary"] = {"fraction": self.canary.fraction, "segments": self.canary_ab.report(self.canary.policy.names)}
    return out
