"""The one list of speculation methods: each name maps to how its proposer is built.

Adding a proposer takes its own file and one `register` call (an entry below, or the caller's own module before
it parses flags): `serve.generate`, the server (`--speculative_config={"method": ...}`), `serve.evaluate`,
`serve.calibrate` and the load matrix read the names from here. `serve.aot` compiles the built-in methods only
(it needs each proposer's parameter shapes without weights).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer

HEADS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "heads")


@dataclasses.dataclass(frozen=True)
class Target:
  """The model a proposer drafts for."""
  config: Any
  params: Any
  impl: str = "xla"
  model_path: Optional[str] = None  # its checkpoint (qdraft quantizes it; an independent draft checks it)
  dtype: str = "float32"
  kv_cache_dtype: str = "auto"  # every KV cache of the decode state (--kv_cache_dtype)


@dataclasses.dataclass(frozen=True)
class BuildArgs:
  """What a builder gets: the speculative config (spec_jax/spec_config.py), the target, and the DynamicTree the
  registry built when the method builds trees and eagle_topk > 1."""
  spec: Any  # SpecConfig
  target: Target
  tree: Any = None

  @property
  def k(self) -> int:
    return self.spec.num_speculative_tokens


@dataclasses.dataclass(frozen=True)
class Method:
  build: Callable[[BuildArgs], tuple]  # -> (proposer, proposer_params)
  trees: bool = False  # takes eagle_topk > 1 (token trees); False: chains only
  dynamic_tree: bool = False  # the registry builds its DynamicTree (EAGLE-2 style) from topk, depth and nodes


METHODS: dict[str, Method] = {}


def register(name: str, method: Method) -> None:
  """Make `name` a method everywhere. A name registered twice is an error (two proposers under one name)."""
  if name in METHODS and METHODS[name] is not method:
    raise ValueError(f"method {name!r} is already registered")
  METHODS[name] = method


def default_heads_path(method: str) -> str:
  """The checkpoint for Gemma 3 270M that ships in git: heads/<method>_gemma3_270m.{safetensors,json} (medusa,
  eagle, eagle3 and the int8 distilled draft; configs/train_<method>_gemma3_270m.py make them)."""
  return os.path.normpath(os.path.join(HEADS_DIR, f"{method}_gemma3_270m"))


def build_proposer(spec, target: Target):
  """-> (proposer, proposer_params) for a SpecConfig's method."""
  if spec.method not in METHODS:
    raise ValueError(f"unknown method {spec.method!r}; choose one of {tuple(METHODS)}")
  entry = METHODS[spec.method]
  k, topk, nodes = spec.num_speculative_tokens, spec.eagle_topk, spec.num_draft_tokens
  if spec.method == "none":
    return entry.build(BuildArgs(spec, target))
  if k < 1:
    raise ValueError(f"num_speculative_tokens must be >= 1 for method {spec.method!r}, got {k}")
  if topk < 1 or nodes < 0:
    raise ValueError(f"eagle_topk must be >= 1 and num_draft_tokens >= 0, got {topk} and {nodes}")
  if topk > 1 and not entry.trees:
    trees = ", ".join(m for m, e in METHODS.items() if e.trees)
    raise ValueError(f"token trees (eagle_topk > 1) are for {trees}; {spec.method} drafts chains")
  if topk > 1 and nodes and nodes < k + 1:
    raise ValueError(f"num_draft_tokens={nodes} cannot hold a tree of depth {k} (needs >= {k + 1})")
  tree = None
  if topk > 1 and entry.dynamic_tree:
    from spec_jax.proposers.tree_expand import DynamicTree
    tree = DynamicTree(topk=topk, depth=k, nodes=nodes or 1 + k * topk)
  return entry.build(BuildArgs(spec, target, tree))


def is_checkpoint(stem: str) -> bool:
  """Is `stem` one of our trainer's checkpoints (<stem>.safetensors beside <stem>.json)? (A published head is a
  directory: spec_jax/checkpoints/published.py.)"""
  return os.path.isfile(stem + ".json") and os.path.isfile(stem + ".safetensors")


def _ngram(a: BuildArgs):
  return NgramProposer(k=a.k, ngram_min=a.spec.prompt_lookup_min, ngram_max=a.spec.prompt_lookup_max), {}


def _suffix(a: BuildArgs):
  from spec_jax.proposers.suffix import SuffixProposer
  s = a.spec
  return SuffixProposer(k=a.k, history=s.suffix_history_tokens, max_depth=s.suffix_decoding_max_tree_depth,
                        spec_factor=s.suffix_decoding_max_spec_factor, sharing=s.suffix_sharing, tree=a.tree), {}


def _published(a: BuildArgs):
  """A published head directory (spec_jax/checkpoints/published.py detects its format), or None."""
  from spec_jax.checkpoints import published
  model = a.spec.model
  if not model or is_checkpoint(model) or not published.is_published(model):
    return None
  if a.spec.method == "medusa" and a.spec.eagle_topk > 1:
    raise ValueError(f"{model}: a published Medusa head has no per-rank accuracy to choose a tree from; "
                     "use eagle_topk=1 (chains)")
  t = a.target
  return published.load(model, a.spec.method, t.config, t.params, a.k, t.impl, a.tree)


def _medusa(a: BuildArgs):
  from spec_jax.proposers.medusa import load_medusa
  t = a.target
  loaded = _published(a)
  if loaded is not None:
    return loaded
  return load_medusa(a.spec.model or default_heads_path("medusa"), t.config, t.params, a.k, a.spec.eagle_topk,
                     a.spec.num_draft_tokens)


def _eagle(a: BuildArgs):
  from spec_jax.proposers.eagle import load_eagle
  t = a.target
  loaded = _published(a)
  if loaded is not None:
    return loaded
  return load_eagle(a.spec.model or default_heads_path("eagle"), t.config, t.params, a.k, t.impl, a.tree)


def _eagle3(a: BuildArgs):
  """vLLM's method "eagle3": an EAGLE-3 head ('' = heads/eagle3_gemma3_270m), ours or a published one's
  directory. `eagle` loads either kind from its checkpoint; this one refuses a head without feature layers, so a
  config that says eagle3 gets EAGLE-3."""
  from spec_jax.proposers.eagle import load_eagle
  t, path = a.target, a.spec.model or default_heads_path("eagle3")
  loaded = _published(a)
  proposer, params = loaded or load_eagle(path, t.config, t.params, a.k, t.impl, a.tree)
  if not proposer.feature_layers:
    raise ValueError(f"method eagle3: {path} is an EAGLE-1 head (no feature layers); use method eagle for it")
  return proposer, params


def _qdraft(a: BuildArgs):
  """The target drafting for itself through its own weights quantized to `quantization` (loaded from the
  target's checkpoint, cached like the target's), over all ids, or over the draft vocabulary `model` names."""
  from spec_jax.proposers.draft import quantized_self_draft
  t = a.target
  return quantized_self_draft(t.config, t.params, t.model_path, t.dtype, a.spec.quantization, a.k, t.impl, a.tree,
                              vocab_path=a.spec.model or None)


def _draft(a: BuildArgs):
  """`model` one of our distilled draft checkpoints ('' = the one in heads/), or an independent model sharing the
  target's vocabulary (a .gguf, an HF directory or a packaged model's name); `draft_layers` = N > 0: the
  early-exit self-draft of the target's first N layers."""
  from spec_jax.proposers.draft import early_exit_proposer, independent_draft, load_draft
  t, model = a.target, a.spec.model
  if a.spec.draft_layers:
    if model:
      raise ValueError("model and draft_layers both name a draft; give one")
    return early_exit_proposer(t.config, t.params, a.spec.draft_layers, a.k, t.impl, a.tree)
  if model and not is_checkpoint(model):
    return independent_draft(model, t.config, t.model_path, t.dtype, a.k, t.impl, a.tree)
  return load_draft(model or default_heads_path("draft"), t.config, t.params, a.k, t.impl, a.tree)


register("none", Method(lambda a: (NoneProposer(), {})))
register("ngram", Method(_ngram))
register("suffix", Method(_suffix, trees=True, dynamic_tree=True))
register("draft", Method(_draft, trees=True, dynamic_tree=True))
register("medusa", Method(_medusa, trees=True))
register("eagle", Method(_eagle, trees=True, dynamic_tree=True))
register("eagle3", Method(_eagle3, trees=True, dynamic_tree=True))
register("qdraft", Method(_qdraft, trees=True, dynamic_tree=True))
