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
class BuildArgs:
  """What a builder gets (serve.generate's flags and vLLM's speculative-config keys map onto these)."""
  target_config: Any
  target_params: Any
  k: int = 4
  ngram_min: int = 1
  ngram_max: int = 3
  draft_layers: int = 0
  impl: str = "xla"
  heads_path: Optional[str] = None  # '' or None: the checkpoint in heads/
  topk: int = 1
  num_draft_tokens: int = 0
  model_path: Optional[str] = None  # the target's checkpoint
  dtype: str = "float32"
  draft_quantize: str = "int8"
  draft_model: Optional[str] = None
  tree: Any = None  # a DynamicTree when the method builds trees and topk > 1


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


def build_proposer(method: str, *, target_config, target_params, k: int = 4, topk: int = 1,
                   num_draft_tokens: int = 0, **kw):
  """-> (proposer, proposer_params) for a registered method; `kw`: the other BuildArgs fields. Trees (SGLang's
  flags): k is the depth, `topk` the branching (1: chains), `num_draft_tokens` the node budget (root included;
  0: 1 + k * topk)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose one of {tuple(METHODS)}")
  entry = METHODS[method]
  if method == "none":
    return entry.build(BuildArgs(target_config, target_params, k=0))
  if k < 1:
    raise ValueError(f"num_speculative_tokens must be >= 1 for method {method!r}, got {k}")
  if topk < 1 or num_draft_tokens < 0:
    raise ValueError(f"eagle_topk must be >= 1 and num_draft_tokens >= 0, got {topk} and {num_draft_tokens}")
  if topk > 1 and not entry.trees:
    trees = ", ".join(m for m, e in METHODS.items() if e.trees)
    raise ValueError(f"token trees (eagle_topk > 1) are for {trees}; {method} drafts chains")
  if topk > 1 and num_draft_tokens and num_draft_tokens < k + 1:
    raise ValueError(f"num_draft_tokens={num_draft_tokens} cannot hold a tree of depth {k} (needs >= {k + 1})")
  tree = None
  if topk > 1 and entry.dynamic_tree:
    from spec_jax.proposers.tree_expand import DynamicTree
    tree = DynamicTree(topk=topk, depth=k, nodes=num_draft_tokens or 1 + k * topk)
  return entry.build(BuildArgs(target_config, target_params, k=k, topk=topk, num_draft_tokens=num_draft_tokens,
                               tree=tree, **kw))


def _ngram(a: BuildArgs):
  return NgramProposer(k=a.k, ngram_min=a.ngram_min, ngram_max=a.ngram_max), {}


def _medusa(a: BuildArgs):
  from spec_jax.proposers.medusa import load_medusa
  return load_medusa(a.heads_path or default_heads_path("medusa"), a.target_config, a.target_params, a.k, a.topk,
                     a.num_draft_tokens)


def _eagle(a: BuildArgs):
  from spec_jax.proposers.eagle import load_eagle
  return load_eagle(a.heads_path or default_heads_path("eagle"), a.target_config, a.target_params, a.k, a.impl,
                    a.tree)


def _qdraft(a: BuildArgs):
  """The target drafting for itself through its own weights quantized to `draft_quantize` (loaded from
  `model_path`, cached like the target's), over all ids, or over the draft vocabulary `heads_path` names."""
  from spec_jax.proposers.draft import quantized_self_draft
  return quantized_self_draft(a.target_config, a.target_params, a.model_path, a.dtype, a.draft_quantize, a.k,
                              a.impl, a.tree, vocab_path=a.heads_path or None)


def _draft(a: BuildArgs):
  """The distilled draft checkpoint; with `draft_layers` = N > 0 the early-exit self-draft of the target's first
  N layers; with `draft_model` an independent model sharing the target's vocabulary."""
  from spec_jax.proposers.draft import early_exit_proposer, independent_draft, load_draft
  if a.draft_model:
    if a.draft_layers:
      raise ValueError("--draft_model and --draft_layers both name a draft; give one")
    return independent_draft(a.draft_model, a.target_config, a.model_path, a.dtype, a.k, a.impl, a.tree)
  if a.draft_layers:
    return early_exit_proposer(a.target_config, a.target_params, a.draft_layers, a.k, a.impl, a.tree)
  return load_draft(a.heads_path or default_heads_path("draft"), a.target_config, a.target_params, a.k, a.impl,
                    a.tree)


register("none", Method(lambda a: (NoneProposer(), {})))
register("ngram", Method(_ngram))
register("draft", Method(_draft, trees=True, dynamic_tree=True))
register("medusa", Method(_medusa, trees=True))
register("eagle", Method(_eagle, trees=True, dynamic_tree=True))
register("qdraft", Method(_qdraft, trees=True, dynamic_tree=True))
