"""The speculative config: the one way anything names a method and its settings, with vLLM's keys.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
  {"method": "eagle", "num_speculative_tokens": 4, "model": "heads/eagle_gemma3_270m"}
  {"method": "draft_model", "num_speculative_tokens": 4, "model": "qwen2.5-coder-0.5b"}
  {}                                                   # speculation off
  {"per_concurrency": {"1": {"method": "ngram", "num_speculative_tokens": 4}, "16": {"num_speculative_tokens": 0}}}

The same keys are a config file's `speculative_config` dict, the JSON of `--speculative_config` (inline or a
file), one flag each (serve/jobs/run_flags.py; `model` and `quantization` are `--speculative_model` and
`--speculative_quantization` there, beside the target's `--model` and `--quantize`), the load matrix's arms and
the tuner's output.

`eagle_topk` and `num_draft_tokens` are SGLang's token-tree settings (vLLM has none): num_speculative_tokens is
the tree's depth, eagle_topk the candidates per node (suffix: the continuations; 1 = chains), num_draft_tokens its
node budget, root included (0 = 1 + depth * eagle_topk). `draft_layers` (ours): method=draft with N > 0 drafts
with the target's first N layers.
`suffix_history_tokens` and `suffix_sharing` (ours) size the suffix method's shared history and choose whether
tenants share it (spec_jax/proposers/suffix.py); vLLM's suffix cache counts requests, ours tokens.

A per-concurrency config (what `serve.loadtest`'s tuner writes) holds one setting per concurrency level. The server
builds one proposer with the largest k and, at occupancy a, allows the k of the entry with the largest
concurrency <= a (the smallest entry below all of them). Entries may differ in k but not in the proposer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from spec_jax.proposers import registry
from spec_jax.spec_policy import Canary, Policy, parse_canary, parse_policy

DEFAULT_K = 4  # num_speculative_tokens of a config that names a method and no k


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """A checked speculative config, its defaults these fields' own. SHARED_KEYS are every method's; each other
  key (commented with its method) belongs to one method, whose registry entry declares and checks it (`options`)."""

  method: str = "none"  # a name of spec_jax/proposers/registry.py (or a vLLM alias)
  num_speculative_tokens: int = 0  # the largest draft length (a tree's depth)
  prompt_lookup_min: int = 1  # ngram: shortest suffix to match
  prompt_lookup_max: int = 3  # ngram: longest suffix to match
  model: str = ""  # heads / draft checkpoint, or an independent draft model ('' = the one in heads/)
  draft_layers: int = 0  # draft: N > 0 drafts with the target's first N layers
  eagle_topk: int = 1
  num_draft_tokens: int = 0
  quantization: str = "int8"  # qdraft: the draft's weights (int8 or int4)
  suffix_decoding_max_tree_depth: int = 24  # suffix: the longest suffix matched (vLLM's key)
  suffix_decoding_max_spec_factor: float = 1.0  # suffix: tokens drafted per matched token (vLLM's key)
  suffix_history_tokens: int = 2048  # suffix (ours): the shared history's ring, tokens per slot
  suffix_sharing: str = "tenant"  # suffix (ours): history shared per tenant, or "global" on purpose
  per_concurrency: tuple = ()  # ((concurrency, k), ...) sorted; empty: num_speculative_tokens everywhere
  policy: Optional[Policy] = None  # per-request caps by segment (spec_jax/spec_policy.py); None: k for all
  canary: Optional[Canary] = None  # a new policy for a share of the requests

  @property
  def k(self) -> int:
    """num_speculative_tokens under the name the proposer (proposer.k) and the loop (LoopSpec.ks) give it."""
    return self.num_speculative_tokens

  def k_at(self, occupancy: int) -> int:
    """The k allowed with `occupancy` busy slots."""
    if not self.per_concurrency:
      return self.k
    below = [k for c, k in self.per_concurrency if c <= occupancy]
    return below[-1] if below else self.per_concurrency[0][1]

  def describe(self) -> str:
    if self.method == "none":
      return "off"
    s = f"{self.method} k={self.k}"
    if self.eagle_topk > 1:
      s += f" tree topk={self.eagle_topk} nodes={self.num_draft_tokens or 1 + self.k * self.eagle_topk}"
    if self.per_concurrency:
      s += " per concurrency " + ", ".join(f"{c}:{k}" for c, k in self.per_concurrency)
    if self.policy is not None:
      s += " policy " + ", ".join(f"{r.name}:{r.k}" for r in self.policy.rules)
    if self.canary is not None:
      s += f" canary {self.canary.fraction:g}"
    return s

  def to_json(self) -> dict:
    """The vLLM-style dict that `parse` reads back into this config."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _TABLE_KEYS}
    if self.per_concurrency:
      d["per_concurrency"] = {str(c): {"num_speculative_tokens": k} for c, k in self.per_concurrency}
    if self.policy is not None:
      d["policy"] = self.policy.to_json()
    if self.canary is not None:
      d["canary"] = self.canary.to_json()
    return d


_TABLE_KEYS = ("per_concurrency", "policy", "canary")
ENTRY_KEYS = tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name not in _TABLE_KEYS)
SHARED_KEYS = ("method", "num_speculative_tokens", "model", "eagle_topk", "num_draft_tokens")  # every method's
DEFAULTS = {f.name: f.default for f in dataclasses.fields(SpecConfig)}
_PROPOSER_KEYS = tuple(k for k in ENTRY_KEYS if k != "num_speculative_tokens")


def read_json_arg(text: str, what: str) -> dict:
  """Inline JSON (starting with '{') or the path of a JSON file."""
  text = text.strip()
  if not text.startswith("{"):
    if not os.path.isfile(text):
      raise ValueError(f"{what}: {text!r} is neither inline JSON nor an existing file")
    with open(text, encoding="utf-8") as f:
      text = f.read()
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what}: invalid JSON ({e})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{what}: expected a JSON object, got {type(obj).__name__}")
  return obj


def _int(d: dict, key: str, default: int, what: str) -> int:
  return registry.int_option(key).check(d.get(key, default), what)


def _entry(d: dict, what: str) -> dict:
  """One setting's fields, checked; an absent method with a k is n-gram (vLLM's default), k = 0 is off."""
  unknown = set(d) - set(ENTRY_KEYS)
  if unknown:
    raise ValueError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(ENTRY_KEYS)}")
  method = d.get("method")
  if method is None:
    method = registry.VLLM_DEFAULT if d.get("num_speculative_tokens") else "none"
  name = registry.canonical(method) if isinstance(method, str) else None
  methods = registry.METHODS  # as it is now: a plugin registered after import counts
  if name not in methods:
    raise ValueError(f"{what}: unknown method {method!r}; choose one of {', '.join(m for m in methods if m != 'none')} "
                     "(a plugin's method: import it with --plugins)")
  k = _int(d, "num_speculative_tokens", DEFAULT_K if name != "none" else 0, what)
  if name == "none" or k == 0:
    name, k = "none", 0
  model = d.get("model") or DEFAULTS["model"]
  if not isinstance(model, str):
    raise ValueError(f"{what}: model must be a path string, got {model!r}")
  out = dict(method=name, num_speculative_tokens=k, model=model,
             eagle_topk=max(1, _int(d, "eagle_topk", DEFAULTS["eagle_topk"], what)),
             num_draft_tokens=_int(d, "num_draft_tokens", DEFAULTS["num_draft_tokens"], what))
  for entry in methods.values():  # every method's keys are checked, whichever method drafts
    for option in entry.options:
      out[option.key] = option.check(d.get(option.key, DEFAULTS[option.key]), what)
  if methods[name].check is not None:
    methods[name].check(out, what)
  return out


def _with_policy(obj: dict, what: str) -> SpecConfig:
  """A config with `policy` (and maybe `canary`): its num_speculative_tokens defaults to the largest rule k."""
  base = {k: v for k, v in obj.items() if k not in ("policy", "canary")}
  raw = [obj.get("policy"), (obj.get("canary") or {}).get("policy") if isinstance(obj.get("canary"), dict) else None]
  ks = [r.get("num_speculative_tokens") for p in raw if isinstance(p, list) for r in p if isinstance(r, dict)]
  ks = [k for k in ks if isinstance(k, int) and not isinstance(k, bool)]
  if "num_speculative_tokens" not in base and ks:
    base["num_speculative_tokens"] = max(ks)
  entry = _entry(base, what)
  k = entry["num_speculative_tokens"]
  policy = parse_policy(obj["policy"], f"{what}: policy", k) if "policy" in obj else None
  canary = parse_canary(obj["canary"], f"{what}: canary", k) if "canary" in obj else None
  if canary is not None and policy is None:
    raise ValueError(f"{what}: canary needs a policy beside it (the one the other requests keep)")
  return SpecConfig(**entry, policy=policy, canary=canary)


def from_dict(obj: dict, what: str = "speculative_config") -> SpecConfig:
  """A vLLM-style dict (the keys above, or {"per_concurrency": {...}} with shared keys beside it, or "policy"
  with its rules beside the proposer's keys)."""
  if not isinstance(obj, dict):
    raise ValueError(f"{what}: expected an object, got {type(obj).__name__}")
  if "policy" in obj or "canary" in obj:
    if "per_concurrency" in obj:
      raise ValueError(f"{what}: per_concurrency and policy are two ways to say the same; use policy (its "
                       "busy_slots match key)")
    return _with_policy(obj, what)
  if "per_concurrency" not in obj:
    return SpecConfig(**_entry(obj, what))
  table = obj["per_concurrency"]
  if not isinstance(table, dict) or not table:
    raise ValueError(f"{what}: per_concurrency must be a non-empty object {{concurrency: settings}}")
  base = {k: v for k, v in obj.items() if k != "per_concurrency"}
  entries = []
  for key, d in table.items():
    if not str(key).isdigit() or int(key) < 1:
      raise ValueError(f"{what}: per_concurrency keys are concurrency levels >= 1, got {key!r}")
    if not isinstance(d, dict):
      raise ValueError(f"{what}: per_concurrency[{key}] must be an object")
    entries.append((int(key), _entry({**base, **d}, f"{what} per_concurrency[{key}]")))
  entries.sort(key=lambda e: e[0])
  drafting = [e for _, e in entries if e["num_speculative_tokens"]]
  if not drafting:
    return SpecConfig(per_concurrency=tuple((c, 0) for c, _ in entries))
  first = drafting[0]
  for e in drafting[1:]:
    for field in _PROPOSER_KEYS:
      if e[field] != first[field]:
        raise ValueError(f"{what}: per_concurrency entries must share one proposer; {field} differs "
                         f"({first[field]!r} vs {e[field]!r})")
  return SpecConfig(**{**first, "num_speculative_tokens": max(e["num_speculative_tokens"] for e in drafting)},
                    per_concurrency=tuple((c, e["num_speculative_tokens"]) for c, e in entries))


def parse(text: str, what: str = "--speculative_config") -> SpecConfig:
  """Inline JSON or a JSON file."""
  return from_dict(read_json_arg(text, what), what)
