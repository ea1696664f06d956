"""A draft model with the target's vocabulary: its own KV cache, k autoregressive steps inside the step.

Two drafts plug in here: the early-exit self-draft (the target's first layers, its final norm and head) and a
distilled draft (a few layers trained with KL to the target, sharing its frozen embedding; train/). A draft
whose params hold "rows"/"d2t" drafts over a reduced vocabulary (vocab.py): its head is N rows of the target's
output matrix instead of all 262k, which is most of a small draft's cost.

Cache bookkeeping without copies: the state is the draft's KV cache, whose `lengths` say how many leading slots
hold entries for committed tokens. Drafting re-feeds the last two committed tokens (T = 2), so whatever the
verifier accepted, every slot the next step reads was written for the token now committed there; after a
drafting step the cache is valid up to lengths-2. Steps that draft nothing (adaptive k = 0) do not run the
draft, so before drafting again it catches up on the tokens committed meanwhile, W at a time. The T = 2 feed
also keeps XLA:CPU off its slow single-row bfloat16 path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from spec_jax import quant, scopes
from spec_jax.cache import KVCache
from spec_jax.checkpoints.load import load_config, load_params, load_tokenizer, resolve_model_path
from spec_jax.config import ModelConfig
from spec_jax.models.transformer import forward, param_shapes as tfm_shapes
from spec_jax.prefill import prefill as prefill_fn
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import vocab
from spec_jax.proposers import tree_expand
from spec_jax.proposers.base import PrefillOut
from spec_jax.proposers.tree_expand import DynamicTree
from spec_jax.proposers.chain import draft_chain
from spec_jax.sampling import sample_with_probs


CATCH_UP = 16  # tokens per catch-up forward after steps that drafted nothing


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
  """State: the draft's KVCache (k, v [L', B, Hkv, S, D]; lengths int32[B], the slots valid for committed
  tokens)."""

  config: ModelConfig  # the draft's config (same vocabulary as the target)
  k: int = 4
  impl: str = "xla"
  name: str = "draft"
  tree: Optional[DynamicTree] = None  # top-k token trees grown as EAGLE-2's (k = tree.depth); None: chains
  mesh: Any = None  # set by the loop (LoopSpec): where a Pallas kernel runs per shard
  needs_prompt_hidden: ClassVar[bool] = False

  def __post_init__(self):
    if self.tree is not None and self.k != self.tree.depth:
      raise ValueError(f"a draft tree of depth {self.tree.depth} drafts k = {self.tree.depth}, got k={self.k}")

  def init(self, params, prefill: PrefillOut, capacity: int) -> KVCache:
    """Fill the draft cache with the prompts (the same padded chunks as the target's prefill)."""
    cache = prefill.cache_for(self.config, params["final_norm"].dtype, capacity)
    cache, _ = prefill_fn(params, prefill.prompt_tokens, prefill.prompt_lens, cache, config=self.config,
                          impl=self.impl, chunk=prefill.chunk, mesh=self.mesh, offsets=prefill.offsets)
    return cache

  def insert(self, state: KVCache, slot, row_state: KVCache) -> KVCache:
    return state.insert_row(row_state, slot)

  def catch_up(self, params, cache: KVCache, tokens, upto, width: int = CATCH_UP):
    """Feed committed tokens until cache.lengths >= upto[b] in every row (a no-op when already there)."""
    S = tokens.shape[1]
    width = min(width, S)
    iota = jnp.arange(width, dtype=jnp.int32)[None, :]

    def body(c):
      old = c.lengths
      # A window may re-feed valid slots (same entries again) and run past `upto` (slots rewritten later
      # before they are read); it never crosses the buffer's end, where dynamic_update_slice would clamp.
      s = jnp.minimum(jnp.minimum(c.lengths, upto), S - width)
      feed = jnp.take_along_axis(tokens, s[:, None] + iota, axis=1)
      _, _, c = forward(params, feed, s[:, None] + iota, c.replace(lengths=s), config=self.config,
                        impl=self.impl, compute_logits=False,
                        mesh=self.mesh)
      return c.replace(lengths=jnp.maximum(jnp.minimum(s + width, upto), old))

    return jax.lax.while_loop(lambda c: jnp.any(c.lengths < upto), body, cache)

  def propose(self, params, cache: KVCache, ctx, k, key):
    start = ctx.lengths - 2
    cache = self.catch_up(params, cache, ctx.tokens, start)
    feed = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(2)[None, :], axis=1)
    pos = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    reduced = "rows" in params

    def run(params, toks, pos, cache):
      """-> (logits over the draft's vocabulary, hidden, cache)."""
      logits, hidden, cache = forward(params, toks, pos, cache, config=self.config, impl=self.impl, mesh=self.mesh,
                                      compute_logits=not reduced)
      return (vocab.project(hidden, params["rows"]) if reduced else logits), hidden, cache

    logits, _, cache = run(params, feed, pos, cache.replace(lengths=start))
    cache = cache.replace(lengths=ctx.lengths)

    @scopes.scoped(scopes.SAMPLING)
    def draw(carry, key):
      logits = carry[0]
      if reduced:
        return vocab.draw(key, logits, ctx.sampling, params["d2t"], self.config.vocab_size)
      return sample_with_probs(key, logits, ctx.sampling)

    def advance(carry, tok):
      _, cache = carry
      nxt, _, cache = run(params, tok[:, None], cache.lengths[:, None], cache)
      return nxt[:, 0], cache.replace(lengths=cache.lengths + 1)

    draft, (_, cache) = draft_chain(draw, advance, (logits[:, 1], cache), key, k)
    return draft, cache

  def propose_tree(self, params, cache: KVCache, ctx, key):
    """The chain's re-feed of the last two committed tokens predicts the root's children; each expansion feeds
    the frontier history at positions L - 1 + depth under the tree mask into a throwaway copy of the cache
    (tree_expand.grow). The cache comes back valid for the L committed tokens only."""
    start = ctx.lengths - 2
    cache = self.catch_up(params, cache, ctx.tokens, start)
    feed = jnp.take_along_axis(ctx.tokens, start[:, None] + jnp.arange(2)[None, :], axis=1)
    pos = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    reduced = "rows" in params

    def run(toks, pos, cache, mask=None):
      logits, hidden, cache = forward(params, toks, pos, cache, config=self.config, impl=self.impl, mesh=self.mesh,
                                      compute_logits=not reduced, tree_mask=mask)
      return jax.nn.log_softmax(vocab.project(hidden, params["rows"]) if reduced else logits, axis=-1), cache

    logp, cache = run(feed, pos, cache.replace(lengths=start))
    cache = cache.replace(lengths=ctx.lengths)

    def score(tokens, _, depths, mask):
      return run(tokens, (ctx.lengths - 1)[:, None] + depths, cache, mask)[0], jnp.zeros(tokens.shape, jnp.int8)

    to_target = (lambda i: jnp.take(params["d2t"], i)) if reduced else None
    B = ctx.lengths.shape[0]
    return tree_expand.grow(logp[:, 1], jnp.zeros((B,), jnp.int8), score, self.tree, to_target), cache

  def update(self, params, cache, result):
    if result.tokens.shape[1] == 1:  # a k = 0 step: the draft did not run, its cache is unchanged
      return cache
    new = result.new_lengths - 2
    if self.tree is not None:  # only the two re-fed tokens were written: the rest is caught up next time
      new = jnp.minimum(new, cache.lengths)
    return cache.replace(lengths=jnp.where(result.emitted > 0, new, cache.lengths))


def early_exit_params(target_params: dict, num_layers: int) -> dict:
  """The target's first `num_layers` layers with its final norm and tied head: a free self-draft."""
  return {
      "embed": target_params["embed"], "final_norm": target_params["final_norm"],
      "layers": jax.tree.map(lambda x: x[:num_layers], target_params["layers"]),
      **({"lm_head": target_params["lm_head"]} if "lm_head" in target_params else {}),
  }


def early_exit_proposer(target_config: ModelConfig, target_params: dict, num_layers: int, k: int,
                        impl: str = "xla", tree: Optional[DynamicTree] = None):
  if not 1 <= num_layers < target_config.num_layers:
    raise ValueError(f"early-exit draft needs 1 <= draft_layers < {target_config.num_layers}, got {num_layers}")
  cfg = target_config.replace(num_layers=num_layers, name=f"{target_config.name}-exit{num_layers}")
  return DraftModelProposer(config=cfg, k=k, impl=impl, tree=tree), early_exit_params(target_params, num_layers)


def quantized_self_draft(target_config: ModelConfig, target_params: dict, model_path: str | None, dtype: str,
                         mode: str, k: int, impl: str = "xla", tree: Optional[DynamicTree] = None,
                         vocab_path: str | None = None):
  """qdraft: the target's own architecture and weights, quantized to `mode` (int8 or int4; spec_jax/quant.py),
  as a draft model with its own KV cache. Verification stays with the target's own weights, so the output is
  the target's.

  `vocab_path`: a head checkpoint of kind "vocab" (train/draft_vocab.py): the draft then projects onto those N
  rows of the output matrix instead of all V, and draws and computes q over N ids (vocab.py): 168 of the 270 MB
  an int8 draft step reads on Gemma 3 270M are the 262k-row head. Tokens outside the N can never be drafted
  (acceptance falls); the verifier still corrects them, so the output stays exact. On 2 CPU cores it bought
  3-4 % and cost 11-13 % of τ (BENCHMARKS 19): there the int8 layer stack, not the head, is the draft's cost."""
  if mode not in ("int8", "int4"):
    raise ValueError(f"qdraft quantizes to int8 or int4, got {mode!r}")
  if quant.is_quantized(target_params):
    raise ValueError("qdraft drafts with a quantized copy of a float target; the target is already quantized "
                     "(--quantize): use --quantize=none with --method=qdraft")
  _, qparams = load_params(model_path or None, dtype, mode)
  if vocab_path:
    _, _, d2t = head_ckpt.load_heads(vocab_path, target_config, "vocab")
    if d2t is None:
      raise ValueError(f"{vocab_path}: a draft vocabulary checkpoint without d2t")
    qparams = dict(qparams, rows=vocab.output_rows(qparams, d2t), d2t=d2t)
  cfg = target_config.replace(name=f"{target_config.name}-{mode}")
  return DraftModelProposer(config=cfg, k=k, impl=impl, name="qdraft", tree=tree), qparams


def independent_draft(draft_path: str, target_config: ModelConfig, target_path: str | None, dtype: str, k: int,
                      impl: str = "xla", tree: Optional[DynamicTree] = None):
  """A separately trained model of the target's family as the draft (Qwen2.5-Coder 0.5B for the 1.5B), with its
  own config and KV cache. It must map ids to the same pieces as the target: checked on the vocabulary sizes,
  then on the tokenizers' pieces, before its weights are loaded."""
  draft_path = resolve_model_path(draft_path)
  dcfg = load_config(draft_path)
  if dcfg.vocab_size != target_config.vocab_size:
    raise ValueError(f"draft {draft_path} has a vocabulary of {dcfg.vocab_size} ids and the target "
                     f"{target_config.vocab_size}: a draft model must share the target's tokenizer")
  try:
    same = load_tokenizer(draft_path).vocab_digest() == load_tokenizer(target_path).vocab_digest()
  except FileNotFoundError:
    same = True  # a safetensors directory without tokenizer.model: the sizes agreed, nothing more to compare
  if not same:
    raise ValueError(f"draft {draft_path} has {dcfg.vocab_size} ids like the target, but its tokenizer maps them "
                     "to other pieces: a draft model must share the target's tokenizer")
  _, params = load_params(draft_path, dtype)
  return DraftModelProposer(config=dcfg.replace(name=f"{dcfg.name}-draft"), k=k, impl=impl, tree=tree), params


def param_shapes(target_config: ModelConfig, num_layers: int) -> dict:
  """The trained weights of a distilled draft: its layers and final norm (embedding and head are the target's)."""
  shapes = tfm_shapes(target_config.replace(num_layers=num_layers))
  return {"layers": shapes["layers"], "final_norm": shapes["final_norm"]}


def runtime_params(weights: dict, target_params: dict, d2t=None) -> dict:
  """A distilled draft's weights plus the target's frozen embedding and output rows (all, or d2t's)."""
  out = dict(weights, embed=target_params["embed"])
  if d2t is None:
    if "lm_head" in target_params:
      out["lm_head"] = target_params["lm_head"]
    return out
  return dict(out, rows=vocab.output_rows(target_params, jnp.asarray(d2t, jnp.int32)),
              d2t=jnp.asarray(d2t, jnp.int32))


def load_draft(path: str, target_config: ModelConfig, target_params: dict, k: int, impl: str = "xla",
               tree: Optional[DynamicTree] = None):
  """A distilled draft checkpoint (checkpoints.heads format, kind "draft") -> (proposer, params)."""
  dtype = target_params["final_norm"].dtype
  meta, weights, d2t = head_ckpt.load_heads(path, target_config, "draft", dtype)
  n = int(meta.get("num_layers", 0))
  if not 1 <= n < target_config.num_layers:
    raise ValueError(f"{path}: num_layers must be in [1, {target_config.num_layers}), got {n}")
  head_ckpt.check_shapes(weights, param_shapes(target_config, n), path)
  cfg = target_config.replace(num_layers=n, name=f"{target_config.name}-distill{n}")
  return DraftModelProposer(config=cfg, k=k, impl=impl, tree=tree), runtime_params(weights, target_params, d2t)
