"""The one list of speculation methods: each name maps to how its proposer is built.

Adding a proposer takes its own file and one `register` call (an entry below, or the caller's own module before
it parses flags): `serve.generate`, the server (`--speculative_config={"method": ...}`), `serve.evaluate`,
`serve.calibrate` and the load matrix read the names from here. An entry also says what every other module asks
about a method (this file is the only switch over method names outside tests: tests/test_method_switch.py): its
own keys of the speculative config (`options`), the head kinds it takes (pair_check, published heads), and its
proposer from shapes alone (`abstract`: what `serve.aot` compiles, without weights; a method without one is not
compiled ahead of time).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from spec_jax import quant
from spec_jax.checkpoints import published
from spec_jax.config import ModelConfig
from spec_jax.models.transformer import param_shapes as target_param_shapes
from spec_jax.proposers import draft, eagle, eagle3_layout, medusa
from spec_jax.proposers.base import NoneProposer
from spec_jax.proposers.ngram import NgramProposer
from spec_jax.proposers.suffix import SuffixProposer
from spec_jax.proposers.tree_expand import DynamicTree
from spec_jax.tree import StaticTree

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
  def k(self) -> int:  # num_speculative_tokens, which the proposer keeps as its k
    return self.spec.num_speculative_tokens


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What an abstract builder gets (serve/compiler/aot_programs.py): the target's config and abstract params, the draft
  length, the kernel, the DynamicTree the registry built (topk > 1 and dynamic_tree) or None, the tree settings,
  and a draft model's config where the caller names one (None: the draft this project trains)."""
  config: ModelConfig
  target: dict
  k: int
  impl: str
  tree: Any = None
  topk: int = 1
  nodes: int = 0
  draft_config: Optional[ModelConfig] = None


@dataclasses.dataclass(frozen=True)
class Option:
  """A speculative-config key of one method (spec_jax/spec_config.py holds its default): `check(value, what)`
  -> the value to keep, or a ValueError naming the key."""
  key: str
  check: Callable[[Any, str], Any]


@dataclasses.dataclass(frozen=True)
class Method:
  build: Callable[[BuildArgs], tuple]  # -> (proposer, proposer_params)
  trees: bool = False  # takes eagle_topk > 1 (token trees); False: chains only
  dynamic_tree: bool = False  # the registry builds its DynamicTree (EAGLE-2 style) from topk, depth and nodes
  abstract: Optional[Callable[[Shapes], tuple]] = None  # -> (proposer, abstract params), from shapes alone
  options: tuple = ()  # its own keys of the speculative config (Option)
  check: Optional[Callable[[dict, str], None]] = None  # the options together, when this method is chosen
  head_kinds: tuple = ()  # the published head kinds it loads (published.py's eagle1 / eagle3 / medusa)
  checkpoint_kind: str = ""  # the kind of this project's head checkpoint it loads ('' = none)
  needs_feature_layers: bool = False  # refuses a head without fused feature layers (EAGLE-3)
  aliases: tuple = ()  # other spellings of its name (vLLM's)


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


def canonical(name: str) -> str:
  """A registered name for `name` or one of its aliases (case-insensitive), or `name` lowered if none."""
  name = name.lower()
  for key, entry in METHODS.items():
    if name in entry.aliases:
      return key
  return name


def dynamic_tree(entry: Method, k: int, topk: int, nodes: int):
  """The DynamicTree the registry builds for an entry that drafts them (topk > 1), or None."""
  if topk > 1 and entry.dynamic_tree:
    return DynamicTree(topk=topk, depth=k, nodes=nodes or 1 + k * topk)
  return None


def build_abstract(method: str, config: ModelConfig, target: dict, *, k: int, topk: int, nodes: int, impl: str,
                   draft_config: Optional[ModelConfig] = None):
  """-> (proposer, abstract params) for `method` from shapes alone (serve/compiler/aot_programs.py), with the shapes of
  the heads this project trains (or publishes in). topk > 1: a token tree of `nodes` nodes, depth k, where the
  method's abstract builder drafts trees."""
  entry = METHODS.get(method)
  if entry is None or entry.abstract is None:
    raise ValueError(f"unknown method {method!r} ahead of time; choose from {abstract_methods()}")
  tree = dynamic_tree(entry, k, topk, nodes) if entry.trees else None
  return entry.abstract(Shapes(config, target, k, impl, tree, topk, nodes, draft_config))


def abstract_methods() -> tuple:
  """The methods serve.aot can build from shapes alone."""
  return tuple(m for m, e in METHODS.items() if e.abstract is not None)


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
  return entry.build(BuildArgs(spec, target, dynamic_tree(entry, k, topk, nodes)))


def is_checkpoint(stem: str) -> bool:
  """Is `stem` one of our trainer's checkpoints (<stem>.safetensors beside <stem>.json)? (A published head is a
  directory: spec_jax/checkpoints/published.py.)"""
  return os.path.isfile(stem + ".json") and os.path.isfile(stem + ".safetensors")


def _ngram(a: BuildArgs):
  return NgramProposer(k=a.k, ngram_min=a.spec.prompt_lookup_min, ngram_max=a.spec.prompt_lookup_max), {}


def _suffix(a: BuildArgs):
  s = a.spec
  return SuffixProposer(k=a.k, history=s.suffix_history_tokens, max_depth=s.suffix_decoding_max_tree_depth,
                        spec_factor=s.suffix_decoding_max_spec_factor, sharing=s.suffix_sharing, tree=a.tree), {}


def _published(a: BuildArgs):
  """A published head directory (spec_jax/checkpoints/published.py detects its format), or None."""
  model = a.spec.model
  if not model or is_checkpoint(model) or not published.is_published(model):
    return None
  if "medusa" in METHODS[a.spec.method].head_kinds and a.spec.eagle_topk > 1:
    raise ValueError(f"{model}: a published Medusa head has no per-rank accuracy to choose a tree from; "
                     "use eagle_topk=1 (chains)")
  t = a.target
  return published.load(model, a.spec.method, METHODS[a.spec.method].head_kinds, t.config, t.params, a.k, t.impl,
                        a.tree)


def _medusa(a: BuildArgs):
  t = a.target
  loaded = _published(a)
  if loaded is not None:
    return loaded
  return medusa.load_medusa(a.spec.model or default_heads_path("medusa"), t.config, t.params, a.k, a.spec.eagle_topk,
                     a.spec.num_draft_tokens)


def _eagle(a: BuildArgs):
  t = a.target
  loaded = _published(a)
  if loaded is not None:
    return loaded
  return eagle.load_eagle(a.spec.model or default_heads_path("eagle"), t.config, t.params, a.k, t.impl, a.tree)


def _eagle3(a: BuildArgs):
  """vLLM's method "eagle3": an EAGLE-3 head ('' = heads/eagle3_gemma3_270m), ours or a published one's
  directory. `eagle` loads either kind from its checkpoint; this one refuses a head without feature layers, so a
  config that says eagle3 gets EAGLE-3."""
  t, path = a.target, a.spec.model or default_heads_path("eagle3")
  loaded = _published(a)
  proposer, params = loaded or eagle.load_eagle(path, t.config, t.params, a.k, t.impl, a.tree)
  if not proposer.feature_layers:
    raise ValueError(f"method eagle3: {path} is an EAGLE-1 head (no feature layers); use method eagle for it")
  return proposer, params


def _qdraft(a: BuildArgs):
  """The target drafting for itself through its own weights quantized to `quantization` (loaded from the
  target's checkpoint, cached like the target's), over all ids, or over the draft vocabulary `model` names."""
  t = a.target
  return draft.quantized_self_draft(t.config, t.params, t.model_path, t.dtype, a.spec.quantization, a.k, t.impl, a.tree,
                              vocab_path=a.spec.model or None)


def _draft(a: BuildArgs):
  """`model` one of our distilled draft checkpoints ('' = the one in heads/), or an independent model sharing the
  target's vocabulary (a .gguf, an HF directory or a packaged model's name); `draft_layers` = N > 0: the
  early-exit self-draft of the target's first N layers."""
  t, model = a.target, a.spec.model
  if a.spec.draft_layers:
    if model:
      raise ValueError("model and draft_layers both name a draft; give one")
    return draft.early_exit_proposer(t.config, t.params, a.spec.draft_layers, a.k, t.impl, a.tree)
  if model and not is_checkpoint(model):
    return draft.independent_draft(model, t.config, t.model_path, t.dtype, a.k, t.impl, a.tree)
  return draft.load_draft(model or default_heads_path("draft"), t.config, t.params, a.k, t.impl, a.tree)


# ---------------------------------------------------------------------------------- options (speculative config)

VLLM_DEFAULT = "ngram"  # the method of a config that gives a k and no method (vLLM's default)


def int_option(key: str, floor: int = 0) -> Option:
  """An integer >= 0 (a bool is not one), raised to `floor`."""
  def check(v, what):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise ValueError(f"{what}: {key} must be an integer >= 0, got {v!r}")
    return max(floor, v)
  return Option(key, check)


def choice_option(key: str, choices: tuple, default: str, about: str = "") -> Option:
  """One of `choices`; an empty value is `default`."""
  def check(v, what):
    v = v or default
    if v not in choices:
      raise ValueError(f"{what}: {key}{about} must be {' or '.join(choices)}, got {v!r}")
    return v
  return Option(key, check)


def _positive_number(key: str) -> Option:
  def check(v, what):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
      raise ValueError(f"{what}: {key} must be a number > 0, got {v!r}")
    return float(v)
  return Option(key, check)


def _ngram_check(opts: dict, what: str) -> None:
  if not 1 <= opts["prompt_lookup_min"] <= opts["prompt_lookup_max"]:
    raise ValueError(f"{what}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {opts['prompt_lookup_min']}, "
                     f"{opts['prompt_lookup_max']}")


# ------------------------------------------------------------------------------- from shapes alone (serve.aot)

DRAFT_VOCAB = 32000  # EAGLE-3's published heads draft over 32k ids


def abstract_params(shapes: dict, dtype) -> dict:
  """A tree of shapes -> jax.ShapeDtypeStruct leaves of `dtype`."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=lambda x: isinstance(x, tuple))


def _dtype(s: Shapes):
  return s.target["final_norm"].dtype


def _medusa_shapes(s: Shapes):
  heads = abstract_params(medusa.param_shapes(s.config.d_model, s.k), _dtype(s))
  static = None
  if s.topk > 1:  # Medusa's construction from per-rank accuracies; a geometric fall-off stands in for measured ones
    static = StaticTree.best([[0.6 * 0.5 ** r for r in range(s.topk)] for _ in range(s.k)],
                             s.nodes or 1 + s.k * s.topk)
  prop = medusa.MedusaProposer(vocab_size=s.config.vocab_size, num_heads=s.k, k=s.k if static is None else static.depth,
                               tree=static)
  return prop, jax.eval_shape(medusa.runtime_params, heads, s.target)


def _eagle_shapes(s: Shapes, name: str, layers: tuple = (), d2t=None):
  cfg = eagle.layer_config(s.config)
  weights = abstract_params(eagle.param_shapes(cfg, len(layers)), _dtype(s))
  prop = eagle.EagleProposer(config=cfg, vocab_size=s.config.vocab_size, k=s.k, reduced=d2t is not None,
                             impl=s.impl, tree=s.tree, feature_layers=layers, name=name)
  return prop, jax.eval_shape(eagle.runtime_params, weights, s.target, d2t)


def _eagle3_shapes(s: Shapes):
  """An EAGLE-3 head fusing the published heads' layers, over a 32k draft vocabulary."""
  d2t = jax.ShapeDtypeStruct((min(DRAFT_VOCAB, s.config.vocab_size),), jnp.int32)
  return _eagle_shapes(s, "eagle3", eagle3_layout.default_feature_layers(s.config), d2t)


def _draft_shapes(s: Shapes):
  if s.draft_config is None:  # the distilled draft this project trains: the target's first two layers' shapes
    weights = abstract_params(draft.param_shapes(s.config, 2), _dtype(s))
    cfg = s.config.replace(num_layers=2, name=f"{s.config.name}-distill2")
    return (draft.DraftModelProposer(config=cfg, k=s.k, impl=s.impl, tree=s.tree),
            jax.eval_shape(draft.runtime_params, weights, s.target))
  if s.draft_config.vocab_size != s.config.vocab_size:
    raise ValueError(f"the draft shape has {s.draft_config.vocab_size} ids, the target {s.config.vocab_size}")
  return (draft.DraftModelProposer(config=s.draft_config, k=s.k, impl=s.impl, tree=s.tree),
          abstract_params(target_param_shapes(s.draft_config), _dtype(s)))


def _qdraft_shapes(s: Shapes):
  """Chains only ahead of time (AOT's tree programs are the heads' and the draft's), int8 weights."""
  qparams = quant.quantize_params(s.target, "int8")  # abstract in, abstract out
  cfg = s.config.replace(name=f"{s.config.name}-int8")
  return draft.DraftModelProposer(config=cfg, k=s.k, impl=s.impl, name="qdraft"), qparams


register("none", Method(lambda a: (NoneProposer(), {}), abstract=lambda s: (NoneProposer(), {}), aliases=("off", "")))
register("ngram", Method(_ngram, abstract=lambda s: (NgramProposer(k=s.k), {}), check=_ngram_check,
                         options=(int_option("prompt_lookup_min"), int_option("prompt_lookup_max"))))
register("suffix", Method(
    # its history is decode state (sized by the proposer), so no parameters; chains only ahead of time
    _suffix, trees=True, dynamic_tree=True, abstract=lambda s: (SuffixProposer(k=s.k), {}),
    options=(int_option("suffix_decoding_max_tree_depth", 1), _positive_number("suffix_decoding_max_spec_factor"),
             int_option("suffix_history_tokens", 2), choice_option("suffix_sharing", ("tenant", "global"), "tenant"))))
register("draft", Method(_draft, trees=True, dynamic_tree=True, abstract=_draft_shapes,
                         options=(int_option("draft_layers"),), aliases=("draft_model",)))
register("medusa", Method(_medusa, trees=True, abstract=_medusa_shapes, head_kinds=("medusa",),
                          checkpoint_kind="medusa"))
register("eagle", Method(_eagle, trees=True, dynamic_tree=True, abstract=lambda s: _eagle_shapes(s, "eagle"),
                         head_kinds=("eagle1", "eagle3"), checkpoint_kind="eagle"))
register("eagle3", Method(_eagle3, trees=True, dynamic_tree=True, abstract=_eagle3_shapes, head_kinds=("eagle3",),
                          checkpoint_kind="eagle", needs_feature_layers=True))
register("qdraft", Method(_qdraft, trees=True, dynamic_tree=True, abstract=_qdraft_shapes,
                          options=(choice_option("quantization", ("int8", "int4"), "int8", " (qdraft's weights)"),)))
