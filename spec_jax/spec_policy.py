"""The segment policy of a speculative config: which requests speculate, and how far, decided at admission.

  "policy": [{"match": {"temperature": "zero", "prompt_tokens": [0, 256]}, "num_speculative_tokens": 4},
             {"match": {"segment": "code"}, "num_speculative_tokens": 2, "name": "code"},
             {"match": {}, "num_speculative_tokens": 0}]

An ordered list of rules; the first rule whose every match key holds wins, and the last rule matches everything
(the default closes the list). Match keys, all features known when a request is admitted:
- `temperature`: "zero" (greedy) or "nonzero";
- `prompt_tokens`, `max_tokens`, `busy_slots`: [lo, hi) buckets (hi null = no bound); busy_slots counts the
  requests holding a slot, this one included;
- `segment`: the request's tag (`extra_body={"segment": "code"}`), compared as is; a request with a structured
  output (a grammar) and no tag of its own is tagged "structured".
A rule's `num_speculative_tokens` caps the row's draft length (0: the row never drafts); the adaptive controller
still picks the batch's k per step, and a row drafts min(that k, its cap). A rule's segment label (its `name`, or
one made from its match) names it in metrics and the live report, so label values come from the policy and never
from request text.

`canary` (beside `policy`): {"fraction": 0.1, "policy": [...]} applies a new policy to that share of requests, by
a hash of the request's content, so a retry lands in the same arm; the rest keep `policy`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

MATCH_KEYS = ("temperature", "prompt_tokens", "max_tokens", "segment", "busy_slots")
RULE_KEYS = ("match", "num_speculative_tokens", "name")
BUCKET_KEYS = ("prompt_tokens", "max_tokens", "busy_slots")
MAX_RULES = 32  # a policy is short; its rules are label values


@dataclasses.dataclass(frozen=True)
class Features:
  """What a rule can match, known at admission."""
  temperature: float
  prompt_tokens: int
  max_tokens: int
  busy_slots: int
  segment: str = ""


@dataclasses.dataclass(frozen=True)
class Rule:
  name: str
  k: int
  temperature: Optional[str] = None  # "zero" | "nonzero"
  prompt_tokens: Optional[tuple] = None  # (lo, hi | None)
  max_tokens: Optional[tuple] = None
  busy_slots: Optional[tuple] = None
  segment: Optional[str] = None

  def matches(self, f: Features) -> bool:
    if self.temperature is not None and (f.temperature == 0.0) != (self.temperature == "zero"):
      return False
    for key in BUCKET_KEYS:
      b = getattr(self, key)
      if b is not None and not (b[0] <= getattr(f, key) and (b[1] is None or getattr(f, key) < b[1])):
        return False
    return self.segment is None or f.segment == self.segment

  def to_json(self) -> dict:
    m = {}
    for key in MATCH_KEYS:
      v = getattr(self, key)
      if v is not None:
        m[key] = list(v) if isinstance(v, tuple) else v
    return {"match": m, "num_speculative_tokens": self.k, "name": self.name}


@dataclasses.dataclass(frozen=True)
class Policy:
  rules: tuple  # of Rule; the last matches everything

  def pick(self, f: Features) -> Rule:
    for r in self.rules:
      if r.matches(f):
        return r
    return self.rules[-1]  # unreachable: the last rule matches everything

  @property
  def names(self) -> tuple:
    return tuple(r.name for r in self.rules)

  @property
  def k_max(self) -> int:
    return max(r.k for r in self.rules)

  def to_json(self) -> list:
    return [r.to_json() for r in self.rules]


@dataclasses.dataclass(frozen=True)
class Canary:
  fraction: float
  policy: Policy

  def takes(self, content: bytes) -> bool:
    """Whether a request with this content (prompt ids, sampling, tag) goes to the canary arm."""
    h = int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "big")
    return h / 2.0 ** 64 < self.fraction

  def to_json(self) -> dict:
    return {"fraction": self.fraction, "policy": self.policy.to_json()}


def _bucket(v, where: str, key: str) -> tuple:
  if (not isinstance(v, (list, tuple)) or len(v) != 2 or isinstance(v[0], bool) or not isinstance(v[0], int)
      or not (v[1] is None or (isinstance(v[1], int) and not isinstance(v[1], bool)))):
    raise ValueError(f"{where}: {key} must be a [lo, hi) bucket of integers (hi may be null), got {v!r}")
  lo, hi = int(v[0]), (None if v[1] is None else int(v[1]))
  if lo < 0 or (hi is not None and hi <= lo):
    raise ValueError(f"{where}: {key} bucket [{lo}, {hi}) is empty or negative")
  return (lo, hi)


def _label(m: dict) -> str:
  if not m:
    return "default"
  parts = []
  for key in MATCH_KEYS:
    if key in m:
      v = m[key]
      parts.append(f"{key}={v[0]}-{'' if v[1] is None else v[1]}" if key in BUCKET_KEYS else f"{key}={v}")
  return ",".join(parts)


def parse_policy(rules, what: str = "policy", k_max: Optional[int] = None) -> Policy:
  """A JSON list of rules -> Policy; ValueError naming the rule on bad input. k_max: the largest k a rule may ask
  for (the config's num_speculative_tokens), None: any."""
  if not isinstance(rules, (list, tuple)) or not rules:
    raise ValueError(f"{what}: expected a non-empty list of rules, got {rules!r}")
  if len(rules) > MAX_RULES:
    raise ValueError(f"{what}: {len(rules)} rules; at most {MAX_RULES}")
  out, names = [], set()
  for i, r in enumerate(rules):
    where = f"{what}[{i}]"
    if not isinstance(r, dict):
      raise ValueError(f"{where}: a rule is an object {{\"match\": {{...}}, \"num_speculative_tokens\": k}}, "
                       f"got {r!r}")
    unknown = set(r) - set(RULE_KEYS)
    if unknown:
      raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {list(RULE_KEYS)}")
    m = r.get("match", {})
    if not isinstance(m, dict):
      raise ValueError(f"{where}: match must be an object, got {m!r}")
    unknown = set(m) - set(MATCH_KEYS)
    if unknown:
      raise ValueError(f"{where}: unknown match keys {sorted(unknown)}; known: {list(MATCH_KEYS)}")
    k = r.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"{where}: num_speculative_tokens must be an integer >= 0 (0: off), got {k!r}")
    if k_max is not None and k > k_max:
      raise ValueError(f"{where}: num_speculative_tokens {k} exceeds the config's num_speculative_tokens {k_max}")
    fields = {}
    if "temperature" in m:
      if m["temperature"] not in ("zero", "nonzero"):
        raise ValueError(f"{where}: temperature must be \"zero\" or \"nonzero\", got {m['temperature']!r}")
      fields["temperature"] = m["temperature"]
    for key in BUCKET_KEYS:
      if key in m:
        fields[key] = _bucket(m[key], where, key)
    if "segment" in m:
      if not isinstance(m["segment"], str) or not m["segment"]:
        raise ValueError(f"{where}: segment must be a non-empty string, got {m['segment']!r}")
      fields["segment"] = m["segment"]
    name = r.get("name")
    if name is None:
      name = _label({key: fields[key] for key in fields})
    if not isinstance(name, str) or not name or len(name) > 80 or not name.isprintable():
      raise ValueError(f"{where}: name must be a printable string of 1-80 characters, got {name!r}")
    if name in names:
      raise ValueError(f"{where}: segment name {name!r} is used twice; give the rules distinct names")
    names.add(name)
    out.append(Rule(name=name, k=k, **fields))
  if any(getattr(out[-1], key) is not None for key in MATCH_KEYS):
    raise ValueError(f"{what}[{len(out) - 1}]: the last rule must match every request (\"match\": {{}}), so "
                     "that the policy decides for all traffic")
  return Policy(tuple(out))


def parse_canary(obj, what: str = "canary", k_max: Optional[int] = None) -> Canary:
  if not isinstance(obj, dict) or set(obj) != {"fraction", "policy"}:
    raise ValueError(f"{what}: expected {{\"fraction\": f, \"policy\": [...]}}, got {obj!r}")
  f = obj["fraction"]
  if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
    raise ValueError(f"{what}: fraction must be a number in (0, 1), got {f!r}")
  return Canary(float(f), parse_policy(obj["policy"], f"{what}.policy", k_max))
