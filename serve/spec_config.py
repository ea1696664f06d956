"""`--speculative_config`: vLLM's speculative-config keys, inline JSON or a JSON file, and per-concurrency k.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
  {"method": "eagle", "num_speculative_tokens": 4, "model": "heads/eagle_gemma3_270m"}
  {}                                                   # speculation off
  {"per_concurrency": {"1": {"method": "ngram", "num_speculative_tokens": 4}, "16": {"num_speculative_tokens": 0}}}

A per-concurrency file (what `serve.loadtest`'s tuner writes) holds one setting per concurrency level. The server
builds one proposer with the largest k and, at occupancy a, allows the k of the entry with the largest
concurrency <= a (the smallest entry below all of them): larger draft lengths get a prohibitive step cost in the
adaptive controller's per-occupancy cost table, and an entry with k = 0 switches speculation off while the
occupancy is in its band. Entries may differ in k but not in method or n-gram settings (one proposer).
"""

from __future__ import annotations

import dataclasses
import json
import os

from spec_jax.proposers.registry import METHODS

# vLLM's spellings of registry names.
METHOD_ALIASES = {"draft_model": "draft", "off": "none", "": "none"}
_ENTRY_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "draft_layers",
               "eagle_topk", "num_draft_tokens", "quantization"}
_TOP_KEYS = _ENTRY_KEYS | {"per_concurrency"}
FORBIDDEN_COST = 1e9  # a step cost the adaptive controller never picks


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  method: str = "none"
  k: int = 0  # the largest draft length
  ngram_min: int = 1
  ngram_max: int = 3
  model: str = ""  # draft / heads checkpoint ('' = the one in heads/)
  draft_layers: int = 0
  eagle_topk: int = 1  # token trees: candidates per node (1 = chains)
  num_draft_tokens: int = 0  # token trees: node budget (0 = 1 + k * eagle_topk)
  quantization: str = "int8"  # qdraft: the draft's weights (int8 or int4)
  per_concurrency: tuple = ()  # ((concurrency, k), ...) sorted; empty: k everywhere

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
    return s


def read_json_arg(text: str, what: str):
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
  v = d.get(key, default)
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise ValueError(f"{what}: {key} must be an integer >= 0, got {v!r}")
  return v


def _entry(d: dict, base: dict, what: str) -> dict:
  unknown = set(d) - _ENTRY_KEYS
  if unknown:
    raise ValueError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(_ENTRY_KEYS)}")
  d = {**base, **d}
  method = d.get("method", "ngram" if d.get("num_speculative_tokens") else "none")
  name = METHOD_ALIASES.get(method.lower(), method.lower()) if isinstance(method, str) else None
  if name not in METHODS:  # the registry as it is now: a method registered after import counts
    raise ValueError(f"{what}: method must be one of {', '.join(m for m in METHODS if m != 'none')}, got {method!r}")
  method = name
  k = _int(d, "num_speculative_tokens", 4 if method != "none" else 0, what)
  if method == "none" or k == 0:
    method, k = "none", 0
  model = d.get("model") or ""
  if not isinstance(model, str):
    raise ValueError(f"{what}: model must be a path string, got {model!r}")
  out = dict(method=method, k=k, ngram_min=_int(d, "prompt_lookup_min", 1, what),
             ngram_max=_int(d, "prompt_lookup_max", 3, what), model=model,
             draft_layers=_int(d, "draft_layers", 0, what), eagle_topk=max(1, _int(d, "eagle_topk", 1, what)),
             num_draft_tokens=_int(d, "num_draft_tokens", 0, what), quantization=d.get("quantization") or "int8")
  if out["quantization"] not in ("int8", "int4"):
    raise ValueError(f"{what}: quantization (qdraft's weights) must be int8 or int4, got {out['quantization']!r}")
  if method == "ngram" and not 1 <= out["ngram_min"] <= out["ngram_max"]:
    raise ValueError(f"{what}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {out['ngram_min']}, "
                     f"{out['ngram_max']}")
  return out


def parse_speculative_config(text: str | None, defaults: dict) -> SpecConfig:
  """`text` empty or None: the run config's method and k (`defaults`, serve.generate's field names)."""
  if text is None or not text.strip():
    d = {"method": defaults.get("method", "none"), "num_speculative_tokens": defaults.get("num_speculative_tokens", 0),
         "prompt_lookup_min": defaults.get("ngram_min", 1), "prompt_lookup_max": defaults.get("ngram_max", 3),
         "model": defaults.get("heads", ""), "draft_layers": defaults.get("draft_layers", 0),
         "eagle_topk": defaults.get("eagle_topk", 1), "num_draft_tokens": defaults.get("num_draft_tokens", 0),
         "quantization": defaults.get("draft_quantize", "int8")}
    return SpecConfig(**_entry(d, {}, "config"))
  what = "--speculative_config"
  obj = read_json_arg(text, what)
  unknown = set(obj) - _TOP_KEYS
  if unknown:
    raise ValueError(f"{what}: unknown keys {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
  if "per_concurrency" not in obj:
    return SpecConfig(**_entry(obj, {}, what))
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
    entries.append((int(key), _entry(d, base, f"{what} per_concurrency[{key}]")))
  entries.sort(key=lambda e: e[0])
  drafting = [e for _, e in entries if e["k"]]
  if not drafting:
    return SpecConfig(per_concurrency=tuple((c, 0) for c, _ in entries))
  first = drafting[0]
  for e in drafting[1:]:
    for field in ("method", "ngram_min", "ngram_max", "model", "draft_layers", "eagle_topk", "num_draft_tokens",
                  "quantization"):
      if e[field] != first[field]:
        raise ValueError(f"{what}: per_concurrency entries must share one proposer; {field} differs "
                         f"({first[field]!r} vs {e[field]!r})")
  return SpecConfig(**{**first, "k": max(e["k"] for e in drafting)},
                    per_concurrency=tuple((c, e["k"]) for c, e in entries))


def cost_table(spec_config: SpecConfig, ks: tuple, batch: int, base=None):
  """float32[batch, len(ks)]: `base` (a calibrated table, or adaptive's default model) with every k above the one
  allowed at each occupancy made prohibitive."""
  import numpy as np

  from spec_jax import adaptive
  table = np.broadcast_to(np.asarray(adaptive.default_costs(ks) if base is None else base, np.float32),
                          (batch, len(ks))).copy()
  for a in range(1, batch + 1):
    allowed = spec_config.k_at(a)
    for j, k in enumerate(ks):
      if k > allowed:
        table[a - 1, j] = FORBIDDEN_COST
  return table
