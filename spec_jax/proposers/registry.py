"""Build a proposer (and its params) from a method name."""

from __future__ import annotations

import os

from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer

METHODS = ("none", "ngram", "draft", "medusa", "eagle", "qdraft")
HEADS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "heads")


def default_heads_path(method: str) -> str:
  """The checkpoint for Gemma 3 270M that ships in git: heads/<method>_gemma3_270m.{safetensors,json} (medusa,
  eagle, eagle3 and the int8 distilled draft; configs/train_<method>_gemma3_270m.py make them)."""
  return os.path.normpath(os.path.join(HEADS_DIR, f"{method}_gemma3_270m"))


def build_proposer(method: str, *, target_config, target_params, k: int = 4, ngram_min: int = 1,
                   ngram_max: int = 3, draft_layers: int = 0, impl: str = "xla", heads_path: str | None = None,
                   topk: int = 1, num_draft_tokens: int = 0, model_path: str | None = None,
                   dtype: str = "float32", draft_quantize: str = "int8", draft_model: str | None = None):
  """-> (proposer, proposer_params). medusa, eagle and draft load `heads_path` ('' or None: the one in heads/);
  draft with draft_layers = N > 0 is instead the early-exit self-draft of the target's first N
  layers. Trees (SGLang's flags): k is the depth, `topk` the branching (1: chains), `num_draft_tokens` the
  node budget (root included; 0: 1 + k * topk). qdraft is the target drafting for itself through its own
  weights quantized to `draft_quantize` (loaded from `model_path` with `dtype`, cached like the target's), over
  all V ids, or over the draft vocabulary `heads_path` names (a "vocab" checkpoint). draft with `draft_model`
  (a GGUF, an HF safetensors directory or a packaged model's name) is that independent model, which must share
  the target's vocabulary (`model_path` is the target's checkpoint, for the check)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
  if method == "none":
    return NoneProposer(), {}
  if k < 1:
    raise ValueError(f"num_speculative_tokens must be >= 1 for method {method!r}, got {k}")
  if topk < 1 or num_draft_tokens < 0:
    raise ValueError(f"eagle_topk must be >= 1 and num_draft_tokens >= 0, got {topk} and {num_draft_tokens}")
  if topk > 1 and method == "ngram":
    raise ValueError("token trees (eagle_topk > 1) are for medusa, eagle and draft; ngram drafts chains")
  if topk > 1 and num_draft_tokens and num_draft_tokens < k + 1:
    raise ValueError(f"num_draft_tokens={num_draft_tokens} cannot hold a tree of depth {k} (needs >= {k + 1})")
  tree = None
  if topk > 1 and method in ("eagle", "draft", "qdraft"):
    from spec_jax.proposers.tree_expand import DynamicTree
    tree = DynamicTree(topk=topk, depth=k, nodes=num_draft_tokens or 1 + k * topk)
  if method == "ngram":
    return NgramProposer(k=k, ngram_min=ngram_min, ngram_max=ngram_max), {}
  if method == "medusa":
    from spec_jax.proposers.medusa import load_medusa
    return load_medusa(heads_path or default_heads_path(method), target_config, target_params, k, topk,
                       num_draft_tokens)
  if method == "eagle":
    from spec_jax.proposers.eagle import load_eagle
    return load_eagle(heads_path or default_heads_path(method), target_config, target_params, k, impl, tree)
  if method == "qdraft":
    from spec_jax.proposers.draft import quantized_self_draft
    return quantized_self_draft(target_config, target_params, model_path, dtype, draft_quantize, k, impl, tree,
                                vocab_path=heads_path or None)
  from spec_jax.proposers.draft import early_exit_proposer, independent_draft, load_draft
  if draft_model:
    if draft_layers:
      raise ValueError("--draft_model and --draft_layers both name a draft; give one")
    return independent_draft(draft_model, target_config, model_path, dtype, k, impl, tree)
  if draft_layers:
    return early_exit_proposer(target_config, target_params, draft_layers, k, impl, tree)
  return load_draft(heads_path or default_heads_path(method), target_config, target_params, k, impl, tree)
