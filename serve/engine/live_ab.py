"""The live A/B after rollout: switchback windows, per-segment measurements per arm, and the live verdict.

  --switchback='{"window_s": 5, "off_share": 0.25}'

Rows that speculate and rows that do not share a batched step, so comparing them inside one batch is biased
(each pays for the other's drafts). Switchback compares time instead: the server cuts time into windows of
`window_s` and, in a randomised order, switches speculation off for a whole window (`off_share` of the windows,
exactly round(off_share x block) in each block of `block` windows). Every observation (tokens handed over, their
inter-token gaps, verify steps, drafted and accepted tokens, first tokens, finished and failed requests) is
credited to the segment of its request and the arm of the window in which the loop that produced it was
dispatched.

The verdict per segment takes windows as the units (observations inside one window share its load, so they are not
independent): a bootstrap over windows, each arm resampled apart, gives an interval for the on/off ratio of the mean
time per output token (TPOT: pooled gaps / tokens) and of the p95 inter-token latency. It reads like a load-matrix
cell: roll back when more failures, or when either ratio's interval lies wholly above 1 + noise_floor; keep when
the TPOT ratio's lies wholly below 1 - noise_floor; neutral otherwise or with too few windows or tokens.

The same bookkeeping compares a canary policy with the stable one (arms "canary" and "stable", a request's arm by
the hash of its content, spec_jax/spec_policy.py); there the windows only group observations for the bootstrap.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np

from spec_jax.spec_config import read_json_arg

ON, OFF = "on", "off"
CANARY, STABLE = "canary", "stable"


@dataclasses.dataclass(frozen=True)
class SwitchbackConfig:
  window_s: float = 5.0
  off_share: float = 0.25
  block: int = 8  # windows per shuffled block
  seed: int = 0
  min_windows: int = 4  # per arm, before a verdict
  min_tokens: int = 64  # per arm, before a verdict
  noise_floor: float = 0.03
  confidence: float = 0.9
  resamples: int = 300
  keep_windows: int = 720  # per segment and arm: the oldest are dropped (an hour at 5 s windows)
  max_extra_failure_rate: float = 0.0

  @classmethod
  def parse(cls, text: Optional[str]) -> "SwitchbackConfig | None":
    if text is None or not str(text).strip():
      return None
    obj = read_json_arg(str(text), "--switchback")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(obj) - fields
    if unknown:
      raise ValueError(f"--switchback: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
    for key, v in obj.items():
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
        raise ValueError(f"--switchback: {key} must be a number >= 0, got {v!r}")
    cfg = cls(**obj)
    if not 0.0 < cfg.off_share < 1.0:
      raise ValueError(f"--switchback: off_share must be in (0, 1), got {cfg.off_share}")
    if cfg.window_s <= 0 or cfg.block < 2 or cfg.min_windows < 2 or not 0.5 <= cfg.confidence < 1:
      raise ValueError("--switchback: need window_s > 0, block >= 2, min_windows >= 2, 0.5 <= confidence < 1")
    n_off = round(cfg.off_share * cfg.block)
    if not 0 < n_off < cfg.block:
      raise ValueError(f"--switchback: off_share {cfg.off_share} leaves no off (or no on) window in a block of "
                       f"{cfg.block}; raise block")
    return dataclasses.replace(cfg, block=int(cfg.block), seed=int(cfg.seed), resamples=int(cfg.resamples),
                               min_windows=int(cfg.min_windows), keep_windows=int(cfg.keep_windows))


class Schedule:
  """Window i of `window_s` seconds from `t0` is on or off; each block of windows holds exactly round(off_share x
  block) off windows in a seeded random order."""

  def __init__(self, cfg: SwitchbackConfig, t0: float):
    self.cfg, self.t0 = cfg, t0
    self._rng = np.random.default_rng(cfg.seed)
    self._arms: list = []

  def window(self, now: float) -> int:
    return max(0, int((now - self.t0) // self.cfg.window_s))

  def arm(self, i: int) -> str:
    while len(self._arms) <= i:
      n_off = round(self.cfg.off_share * self.cfg.block)
      block = [OFF] * n_off + [ON] * (self.cfg.block - n_off)
      self._rng.shuffle(block)
      self._arms.extend(block)
    return self._arms[i]

  def count(self, arm: str, first: int, last: int) -> int:
    """Windows of `arm` in [first, last]."""
    self.arm(last)
    return sum(1 for a in self._arms[first:last + 1] if a == arm)


@dataclasses.dataclass
class _Window:
  tokens: int = 0
  itl: list = dataclasses.field(default_factory=list)
  steps: int = 0
  drafted: int = 0
  accepted: int = 0
  ttft: list = dataclasses.field(default_factory=list)
  finished: int = 0
  failed: int = 0


def _pct(x, q) -> Optional[float]:
  return float(np.percentile(np.asarray(x, np.float64), q)) if len(x) else None


class LiveAB:
  """Per (segment, arm): per-window accumulators; `verdict(segment)` compares `treatment` against `control`."""

  def __init__(self, cfg: SwitchbackConfig, treatment: str = ON, control: str = OFF,
               windows_of=None):
    self.cfg, self.treatment, self.control = cfg, treatment, control
    self._w: dict = collections.defaultdict(collections.OrderedDict)  # (segment, arm) -> window -> _Window
    self._since: dict = {}  # segment -> first window counted (after a reset)
    self._windows_of = windows_of  # (arm, first, last) -> windows of that arm elapsed (switchback), or None
    self._last_window = 0
    self._cache: dict = {}

  def add(self, segment: str, arm: str, window: int, *, tokens: int = 0, itl=(), steps: int = 0, drafted: int = 0,
          accepted: int = 0, ttft: Optional[float] = None, finished: int = 0, failed: int = 0) -> None:
    self._since.setdefault(segment, window)
    if window < self._since[segment]:
      return  # produced before the segment's last reset
    self._last_window = max(self._last_window, window)
    ws = self._w[(segment, arm)]
    w = ws.get(window)
    if w is None:
      w = ws[window] = _Window()
      while len(ws) > self.cfg.keep_windows:
        ws.popitem(last=False)
    w.tokens += tokens
    w.itl.extend(itl)
    w.steps += steps
    w.drafted += drafted
    w.accepted += accepted
    if ttft is not None:
      w.ttft.append(ttft)
    w.finished += finished
    w.failed += failed
    self._cache.pop(segment, None)

  def reset(self, segment: str, window: int) -> None:
    """Forget a segment's measurements (its guardrails switched it; a probe measures afresh)."""
    for arm in (self.treatment, self.control):
      self._w.pop((segment, arm), None)
    self._since[segment] = window + 1
    self._cache.pop(segment, None)

  def segments(self) -> list:
    return sorted({s for s, _ in self._w})

  def cell(self, segment: str, arm: str) -> dict:
    ws = list(self._w.get((segment, arm), {}).values())
    itl = [x for w in ws for x in w.itl]
    ttft = [x for w in ws for x in w.ttft]
    tokens, steps = sum(w.tokens for w in ws), sum(w.steps for w in ws)
    drafted, accepted = sum(w.drafted for w in ws), sum(w.accepted for w in ws)
    finished, failed = sum(w.finished for w in ws), sum(w.failed for w in ws)
    if self._windows_of is not None:
      first = self._since.get(segment, 0)
      n_windows = self._windows_of(arm, first, max(self._last_window, first))
      seconds = n_windows * self.cfg.window_s
    else:
      n_windows = len(ws)
      seconds = len(ws) * self.cfg.window_s
    return {"windows": n_windows, "windows_with_data": len(ws), "output_tokens": tokens, "itl_samples": len(itl),
            "tpot_mean": float(np.sum(itl) / len(itl)) if itl else None,
            "itl_p50": _pct(itl, 50), "itl_p95": _pct(itl, 95), "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95),
            "output_tok_s": tokens / seconds if seconds else None,
            "acceptance_length": tokens / steps if steps else None,
            "acceptance_rate": accepted / drafted if drafted else None, "drafted_tokens": drafted,
            "accepted_tokens": accepted, "finished": finished, "failed": failed,
            "error_rate": failed / (finished + failed) if finished + failed else 0.0}

  def _boot(self, segment: str, metric) -> Optional[tuple]:
    """-> (ratio treatment/control, lo, hi) of `metric(list of windows' itl lists)` by a bootstrap over windows."""
    a = [np.asarray(w.itl) for w in self._w.get((segment, self.treatment), {}).values() if w.itl]
    b = [np.asarray(w.itl) for w in self._w.get((segment, self.control), {}).values() if w.itl]
    if not a or not b:
      return None
    point = metric(np.concatenate(a)) / metric(np.concatenate(b))
    rng = np.random.default_rng(len(a) * 7919 + len(b))
    ratios = []
    for _ in range(self.cfg.resamples):
      ra = np.concatenate([a[i] for i in rng.integers(0, len(a), len(a))])
      rb = np.concatenate([b[i] for i in rng.integers(0, len(b), len(b))])
      ratios.append(metric(ra) / metric(rb))
    tail = (1.0 - self.cfg.confidence) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(point), float(lo), float(hi)

  def verdict(self, segment: str) -> dict:
    """The segment's live verdict, in the load matrix's cell format plus the interval and the sample counts."""
    if segment in self._cache:
      return self._cache[segment]
    c = self.cfg
    t, k = self.cell(segment, self.treatment), self.cell(segment, self.control)
    counts = {f"{arm}_{key}": cell[key] for arm, cell in ((self.treatment, t), (self.control, k))
              for key in ("windows_with_data", "output_tokens", "itl_samples", "finished", "failed")}

    def out(verdict, metric, detail, **kw):
      res = {"verdict": verdict, "metric": metric, "detail": detail, "counts": counts, **kw}
      self._cache[segment] = res
      return res

    n_t = sum(1 for w in self._w.get((segment, self.treatment), {}).values() if w.itl)
    n_k = sum(1 for w in self._w.get((segment, self.control), {}).values() if w.itl)
    if min(n_t, n_k) < c.min_windows or min(t["output_tokens"], k["output_tokens"]) < c.min_tokens:
      return out("neutral", "samples", f"too few samples: {n_t} {self.treatment} / {n_k} {self.control} windows "
                 f"with tokens (need {c.min_windows}), {t['output_tokens']} / {k['output_tokens']} tokens (need "
                 f"{c.min_tokens})")
    if t["failed"] and t["error_rate"] > k["error_rate"] + c.max_extra_failure_rate + 1e-12:
      return out("roll back", "failure_rate", f"failed requests {t['error_rate']:.1%} vs {k['error_rate']:.1%}",
                 value=t["error_rate"], base=k["error_rate"])
    tpot = self._boot(segment, np.mean)
    p95 = self._boot(segment, lambda x: np.percentile(x, 95))
    for name, r in (("itl_p95", p95), ("tpot_mean", tpot)):
      if r is not None and r[1] > 1.0 + c.noise_floor:
        return out("roll back", name, f"{name} {r[0]:.2f}x {self.control} (interval {r[1]:.2f}-{r[2]:.2f}x, "
                   f"{c.confidence:.0%})", value=t[name], base=k[name], ratio=r[0], interval=[r[1], r[2]])
    if tpot is not None and tpot[2] < 1.0 - c.noise_floor:
      return out("keep", "tpot_mean", f"mean TPOT {tpot[0]:.2f}x {self.control} (interval {tpot[1]:.2f}-"
                 f"{tpot[2]:.2f}x, {c.confidence:.0%})", value=t["tpot_mean"], base=k["tpot_mean"], ratio=tpot[0],
                 interval=[tpot[1], tpot[2]])
    r = tpot or (None, None, None)
    return out("neutral", "tpot_mean", "within noise" + (f": mean TPOT {r[0]:.2f}x (interval {r[1]:.2f}-"
                                                         f"{r[2]:.2f}x)" if r[0] else ""),
               value=t["tpot_mean"], base=k["tpot_mean"], ratio=r[0], interval=[r[1], r[2]] if r[0] else None)

  def report(self, segments=None) -> dict:
    out = {}
    for s in segments if segments is not None else self.segments():
      out[s] = {**self.verdict(s), "arms": {self.treatment: self.cell(s, self.treatment),
                                            self.control: self.cell(s, self.control)}}
    return out


def content_key(spec) -> bytes:
  """What a canary hashes: the request's content (serve/engine/request_spec.py RequestSpec), not its seed, so a retry
  lands in the same arm."""
  s = spec.sampling
  head = f"{int(spec.max_new)}|{float(s.temperature):.6g}|{int(s.top_k)}|{float(s.top_p):.6g}|{spec.tag}|".encode()
  return head + np.asarray(list(spec.prompt_ids), np.int64).tobytes()


def window_count(schedule: Schedule):
  """LiveAB's `windows_of` for a switchback schedule."""
  return lambda arm, first, last: schedule.count(arm, first, last)

