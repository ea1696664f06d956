"""Medusa and EAGLE proposers: lossless greedy decoding (random and trained heads), sampled decoding runs, the
head offsets, reduced draft vocabularies and head checkpoints."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax.config import SamplingParams
from spec_jax.batch import generate
from spec_jax.models.transformer import init_params
from spec_jax.checkpoints import heads as head_ckpt
from spec_jax.proposers import eagle, medusa, vocab
from spec_jax.proposers.base import ProposeContext
from spec_jax.proposers.registry import Target, build_proposer, default_heads_path
from spec_jax.spec_config import SpecConfig
from tests.conftest import tiny_gemma_config, tiny_llama_config

CONFIG = tiny_gemma_config(eos_ids=(1,))
D2T = jnp.asarray(np.arange(3, 97, 2), jnp.int32)  # a reduced draft vocabulary of 47 ids


@functools.lru_cache(maxsize=None)
def _params(seed=0, config=CONFIG):
  return init_params(config, jax.random.PRNGKey(seed))


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:  # a repeated span so that heads that copy get accepted sometimes
    span = rng.integers(3, CONFIG.vocab_size, max(n // 2, 1)).tolist()
    out.append(([2] + span * 3)[:n])
  return out


def _medusa(params, d2t=None, k=3, seed=1, config=CONFIG):
  heads = medusa.init_params(jax.random.PRNGKey(seed), config.d_model, 4, scale=1.0)
  heads = dict(heads, b=0.3 * jax.random.normal(jax.random.PRNGKey(seed + 1), heads["b"].shape))
  return (medusa.MedusaProposer(vocab_size=config.vocab_size, num_heads=4, k=k, reduced=d2t is not None),
          medusa.runtime_params(heads, params, d2t))


def _eagle(params, d2t=None, k=3, seed=2, config=CONFIG):
  ecfg = eagle.layer_config(config, 48)
  w = eagle.init_params(jax.random.PRNGKey(seed), ecfg, target_params=params)
  return (eagle.EagleProposer(config=ecfg, vocab_size=config.vocab_size, k=k, reduced=d2t is not None),
          eagle.runtime_params(w, params, d2t))


def _distilled(params, d2t=None, k=3, seed=3, config=CONFIG):
  """A distilled draft: 1 random layer and final norm, the target's embedding, a (reduced) head."""
  from spec_jax.proposers import draft
  w = init_params(config.replace(num_layers=1), jax.random.PRNGKey(seed))
  w = {"layers": w["layers"], "final_norm": w["final_norm"]}
  cfg = config.replace(num_layers=1)
  return draft.DraftModelProposer(config=cfg, k=k), draft.runtime_params(w, params, d2t)


@pytest.mark.parametrize("make,d2t,adaptive", [
    (_medusa, None, False), (_medusa, D2T, False), (_eagle, None, False), (_eagle, D2T, True),
    (_distilled, None, False), (_distilled, D2T, True)])
def test_greedy_is_lossless_with_random_heads(make, d2t, adaptive):
  params = _params()
  prompts = _prompts(0, [5, 13, 3])  # batch > 1, rows of different lengths
  base = generate(params, CONFIG, prompts, max_new_tokens=18)
  proposer, pparams = make(params, d2t)
  spec = generate(params, CONFIG, prompts, max_new_tokens=18, proposer=proposer, proposer_params=pparams,
                  adaptive_k=adaptive)
  assert spec.token_ids == base.token_ids
  assert spec.finish_reasons == base.finish_reasons
  assert spec.stats["drafted_tokens"] > 0


def test_untied_target_and_sampled_decoding_run():
  cfg = tiny_llama_config(vocab_size=CONFIG.vocab_size)
  params = _params(3, cfg)
  prompts = _prompts(1, [6, 9])
  base = generate(params, cfg, prompts, max_new_tokens=12)
  proposer, pparams = _eagle(params, D2T, config=cfg)
  assert generate(params, cfg, prompts, max_new_tokens=12, proposer=proposer, proposer_params=pparams,
                  adaptive_k=False).token_ids == base.token_ids
  sampling = SamplingParams.stack([(0.9, 0, 1.0), (0.7, 20, 0.9)])
  for make in (_medusa, _eagle):
    proposer, pparams = make(params, D2T, config=cfg)
    res = generate(params, cfg, prompts, max_new_tokens=12, sampling=sampling, proposer=proposer,
                   proposer_params=pparams, adaptive_k=False, seed=5)
    assert all(len(t) == 12 or r == "stop" for t, r in zip(res.token_ids, res.finish_reasons))
    assert all(0 <= x < cfg.vocab_size for t in res.token_ids for x in t)
    assert res.stats["drafted_tokens"] > 0


def test_reduced_vocab_draw_maps_ids_and_scatters_q():
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 2, len(D2T)))
  sampling = SamplingParams.stack([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)])
  tok, q = vocab.draw(jax.random.PRNGKey(1), logits, sampling, D2T, CONFIG.vocab_size)
  tok, q = np.asarray(tok), np.asarray(q)
  assert q.shape == (3, 2, CONFIG.vocab_size)
  assert np.isin(tok, np.asarray(D2T)).all()
  outside = np.setdiff1d(np.arange(CONFIG.vocab_size), np.asarray(D2T))
  assert (q[..., outside] == 0).all()
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
  assert (np.take_along_axis(q, tok[..., None], -1) > 0).all()  # the drawn token has mass under q
  greedy = np.asarray(D2T)[np.argmax(np.asarray(logits[0]), -1)]
  assert (tok[0] == greedy).all()


def test_d2t_round_trip_and_frequency_order():
  counts = np.zeros(CONFIG.vocab_size, np.int64)
  counts[[5, 9, 40, 41]] = [10, 30, 20, 20]
  d2t = head_ckpt.make_d2t(counts, 3)
  assert d2t.tolist() == [9, 40, 41]  # the 3 most frequent, ties to the lower id, sorted by id
  t2d = head_ckpt.t2d(d2t, CONFIG.vocab_size)
  assert (t2d[d2t] == np.arange(3)).all()
  assert (np.delete(t2d, d2t) == -1).all()
  with pytest.raises(ValueError, match="duplicate"):
    head_ckpt.check_d2t([3, 3], CONFIG.vocab_size)
  with pytest.raises(ValueError, match="lie in"):
    head_ckpt.check_d2t([3, 97], CONFIG.vocab_size)


def test_medusa_offsets():
  """Zero blocks make every head the target's own head on the hidden at lengths-2, which predicted the last
  committed token: so all drafts repeat it. And the loss scores head i at t against token t+2+i."""
  params = _params()
  heads = medusa.init_params(jax.random.PRNGKey(0), CONFIG.d_model, 4)  # W = 0, b = 0
  proposer = medusa.MedusaProposer(vocab_size=CONFIG.vocab_size, num_heads=4, k=4)
  from train.losses import target_features
  seq = jnp.asarray([_prompts(4, [12])[0]])
  hidden = target_features(params, CONFIG, seq)
  L = 9
  want = int(jnp.argmax(vocab.project(hidden[0, L - 2], vocab.output_rows(params))))
  tokens = seq.at[0, L - 1].set(want)
  ctx = ProposeContext(tokens, jnp.asarray([L]), SamplingParams.make(1), hidden[:, L - 2])
  draft, _ = proposer.propose(medusa.runtime_params(heads, params), (), ctx, 4, jax.random.PRNGKey(0))
  assert np.asarray(draft.tokens).tolist() == [[want] * 4]

  from train.losses import medusa_loss
  V = 16
  toks = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 12)), jnp.int32)
  hid = 20.0 * jax.nn.one_hot(jnp.pad(toks[:, 2:], ((0, 0), (0, 2))), V)  # hidden at t encodes token t+2
  frozen = {"rows": jnp.eye(V)}
  _, m = medusa_loss(medusa.init_params(jax.random.PRNGKey(0), V, 2), frozen, hid, toks, jnp.ones_like(toks, bool))
  assert float(m["top1_h0"]) == 1.0
  assert float(m["loss_h0"]) < 1e-3 < float(m["loss_h1"])


def test_head_checkpoint_round_trip_and_errors(tmp_path):
  params = _params()
  heads = medusa.init_params(jax.random.PRNGKey(5), CONFIG.d_model, 4, scale=1.0)
  path = head_ckpt.save_heads(str(tmp_path / "m"), "medusa", heads, CONFIG, {"num_heads": 4}, D2T)
  assert path.endswith(".safetensors") and os.path.exists(str(tmp_path / "m.json"))
  prop, pp = build_proposer(SpecConfig("medusa", 3, model=str(tmp_path / "m")), Target(CONFIG, params))
  assert prop.reduced and prop.num_heads == 4
  np.testing.assert_array_equal(np.asarray(pp["d2t"]), np.asarray(D2T))
  bf16 = np.asarray(jnp.asarray(heads["w"], jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(pp["heads"]["w"]), bf16)  # stored as bfloat16
  # Another target (different width): a clear error naming the target.
  other = CONFIG.replace(d_model=48, name="other")
  with pytest.raises(ValueError, match="trained for target 'tiny-gemma'"):
    build_proposer(SpecConfig("medusa", 3, model=str(tmp_path / "m")), Target(other, _params(0, other)))
  with pytest.raises(ValueError, match="'medusa' head checkpoint, but a 'eagle'"):
    build_proposer(SpecConfig("eagle", 3, model=str(tmp_path / "m")), Target(CONFIG, params))
  # Wrong shape for the same target: the metadata says 4 heads, the weights hold 3.
  three = medusa.init_params(jax.random.PRNGKey(5), CONFIG.d_model, 3)
  head_ckpt.save_heads(str(tmp_path / "bad"), "medusa", three, CONFIG, {"num_heads": 4})
  with pytest.raises(ValueError, match="tensor 'b' has shape \\(3, 32\\), expected \\(4, 32\\)"):
    build_proposer(SpecConfig("medusa", 3, model=str(tmp_path / "bad")), Target(CONFIG, params))
  with pytest.raises(ValueError, match="at most 4 tokens"):
    build_proposer(SpecConfig("medusa", 5, model=str(tmp_path / "m")), Target(CONFIG, params))
  # EAGLE round trip with its layer shapes checked.
  ecfg = eagle.layer_config(CONFIG, 48)
  w = eagle.init_params(jax.random.PRNGKey(1), ecfg)
  head_ckpt.save_heads(str(tmp_path / "e"), "eagle", w, CONFIG, {"mlp_dim": 48})
  prop, pp = build_proposer(SpecConfig("eagle", 2, model=str(tmp_path / "e")), Target(CONFIG, params))
  assert prop.config.mlp_dim == 48 and not prop.reduced and pp["rows"].shape == (CONFIG.vocab_size, 32)
  with pytest.raises(ValueError, match="is an EAGLE-1 head"):  # vLLM's method eagle3 names EAGLE-3 heads only
    build_proposer(SpecConfig("eagle3", 2, model=str(tmp_path / "e")), Target(CONFIG, params))
  head_ckpt.save_heads(str(tmp_path / "e2"), "eagle", w, CONFIG, {"mlp_dim": 64})
  with pytest.raises(ValueError, match="tensor 'layer/down' has shape \\(48, 32\\), expected \\(64, 32\\)"):
    build_proposer(SpecConfig("eagle", 2, model=str(tmp_path / "e2")), Target(CONFIG, params))
  # A distilled draft: its layer count comes from the metadata, its shapes are checked against the target's.
  _, dp = _distilled(params, D2T)
  w = {"layers": dp["layers"], "final_norm": dp["final_norm"]}
  head_ckpt.save_heads(str(tmp_path / "d"), "draft", w, CONFIG, {"num_layers": 1}, D2T)
  prop, pp = build_proposer(SpecConfig("draft", 2, model=str(tmp_path / "d")), Target(CONFIG, params))
  assert prop.config.num_layers == 1 and pp["rows"].shape == (len(D2T), 32)
  head_ckpt.save_heads(str(tmp_path / "d2"), "draft", w, CONFIG, {"num_layers": 2}, D2T)
  with pytest.raises(ValueError, match="tensor 'layers/attn_norm' has shape \\(1, 32\\), expected \\(2, 32\\)"):
    build_proposer(SpecConfig("draft", 2, model=str(tmp_path / "d2")), Target(CONFIG, params))


def test_int8_storage_halves_the_file_and_loads_the_stored_values(tmp_path):
  """storage="int8": every matrix as int8 with a per-row scale; loading gives q * scale (within half a step of
  the trained value), norms stay bfloat16, and a scale without its int8 tensor (or the reverse) is refused."""
  from spec_jax.checkpoints import safetensors_io
  params = _params()
  _, dp = _distilled(params, D2T)
  w = {"layers": dp["layers"], "final_norm": dp["final_norm"]}
  bf = head_ckpt.save_heads(str(tmp_path / "bf"), "draft", w, CONFIG, {"num_layers": 1}, D2T)
  q8 = head_ckpt.save_heads(str(tmp_path / "q8"), "draft", w, CONFIG, {"num_layers": 1}, D2T, storage="int8")
  flat = safetensors_io.read(q8)
  assert flat["layers/q"].dtype == np.int8 and flat["layers/attn_norm"].dtype != np.int8
  # The tiny model's norms and d2t weigh as much as its matrices; the matrices alone are halved.
  mats = [k for k, v in flat.items() if v.dtype == np.int8]
  assert sum(flat[k].nbytes for k in mats) == sum(np.asarray(w["layers"][k.split("/")[1]]).size for k in mats)
  _, _, _ = head_ckpt.load_heads(bf, CONFIG, "draft")
  meta, got, _ = head_ckpt.load_heads(q8, CONFIG, "draft")
  assert meta["storage"] == "int8"
  for name in ("q", "down"):
    want = np.asarray(w["layers"][name], np.float32)
    step = np.max(np.abs(want), axis=-1, keepdims=True) / 127.0
    err = np.abs(np.asarray(got["layers"][name]) - want)
    assert np.all(err <= 0.5 * step + 1e-7) and np.max(err) > 0  # rounded, not stored exactly
  np.testing.assert_array_equal(np.asarray(got["layers"]["q"]),
                                flat["layers/q"].astype(np.float32) * flat["layers/q:scale"])
  prop, pp = build_proposer(SpecConfig("draft", 2, model=str(tmp_path / "q8")), Target(CONFIG, params))
  assert prop.config.num_layers == 1
  del flat["layers/q:scale"]
  safetensors_io.write(str(tmp_path / "bad.safetensors"), flat)
  os.replace(str(tmp_path / "q8.json"), str(tmp_path / "bad.json"))
  with pytest.raises(ValueError, match="int8 tensor has no :scale"):
    head_ckpt.load_heads(str(tmp_path / "bad"), CONFIG, "draft")
  with pytest.raises(ValueError, match="storage must be"):
    head_ckpt.save_heads(str(tmp_path / "x"), "draft", w, CONFIG, {"num_layers": 1}, D2T, storage="int4")


# ------------------------------------------------------------------------------------------- Gemma 3 270M

def _distill_gemma3_draft(config, params, prompts, path):
  """A few training steps of the 2-layer draft on the prompts, exported (int8, as the shipped one) and loaded
  back: the pipeline that made heads/draft_gemma3_270m (train -> export -> load), at toy scale."""
  from configs.train_draft_gemma3_270m import get_config
  from train import data as data_lib
  from train.main import build_task
  from train.trainer import Trainer, TrainSpec
  toks, mask = data_lib.pack(prompts, 64)
  d2t = head_ckpt.make_d2t(np.bincount(toks[mask], minlength=config.vocab_size), 512)
  task, init, frozen, meta = build_task(get_config(), config, params, d2t)
  spec = TrainSpec(steps=3, batch_size=len(prompts), lr=1e-4, warmup=1, eval_every=3, save_every=3,
                   workdir=os.path.join(path, "work"), progress=False)
  final, _ = Trainer(task, spec, log=lambda s: None).fit(init, frozen, data_lib.Dataset(toks, mask, toks, mask))
  head_ckpt.save_heads(os.path.join(path, "draft"), "draft", final, config, meta, d2t, storage="int8")
  return build_proposer(SpecConfig("draft", 4, model=os.path.join(path, "draft")), Target(config, params))


def gemma3_chat_prompts(tok) -> list:
  """Three short chat prompts (math, code, explanation) as Gemma 3 token ids: the real-model lossless checks."""
  texts = ["Natalia sold clips to 48 of her friends. How many clips did she sell in two months?",
           "Write a Python function that returns the squares of a list of numbers.",
           "Explain what a hash table is in two sentences."]
  return [tok.encode(tok.apply_chat_template([t])) for t in texts]


def assert_gemma3_greedy_lossless(config, params, prompts, runs):
  """Every proposer in `runs` ({name: (proposer, params)}) decodes `prompts` greedily to plain decoding's tokens,
  accepting some drafts (chains here, trees in tests/test_tree_decode.py)."""
  base = generate(params, config, prompts, max_new_tokens=32)
  for method, (proposer, pparams) in runs.items():
    res = generate(params, config, prompts, max_new_tokens=32, proposer=proposer, proposer_params=pparams,
                   adaptive_k=False)
    assert res.token_ids == base.token_ids, method
    assert res.stats["accepted_tokens"] > 0, method


@pytest.mark.slow
def test_gemma3_greedy_with_medusa_eagle_and_drafts_is_lossless(gemma3_f32, gemma3_tokenizer):
  config, params = gemma3_f32
  # (The early-exit self-draft's real-model check is tests/test_tree_decode.py's, as a tree.)
  runs = {}
  for method in ("medusa", "eagle", "eagle3", "draft"):  # every shipped checkpoint
    kind, stem = method.rstrip("3"), default_heads_path(method)
    if not os.path.exists(stem + ".safetensors"):
      pytest.fail(f"the shipped {method} checkpoint is missing: {stem}")
    runs[method] = build_proposer(SpecConfig(kind, 4, model=stem), Target(config, params))
  assert_gemma3_greedy_lossless(config, params, gemma3_chat_prompts(gemma3_tokenizer), runs)


# make test-full: the draft the pipeline trains and exports decodes as the shipped one (the case above) does;
# training the draft kind is tests/train/test_trainer.py's, its int8 export and load this file's tiny case above.
@pytest.mark.slow
@pytest.mark.full
def test_gemma3_greedy_with_a_freshly_distilled_draft_is_lossless(gemma3_f32, gemma3_tokenizer, tmp_path):
  config, params = gemma3_f32
  prompts = gemma3_chat_prompts(gemma3_tokenizer)
  toy_draft = _distill_gemma3_draft(config, params, prompts, str(tmp_path))
  assert_gemma3_greedy_lossless(config, params, prompts, {"toy_draft": toy_draft})


def test_eagle_cache_matches_a_cache_free_recompute():
  """At every step of a real (adaptive) decode loop, the EAGLE feature that drafts the first token equals the
  one recomputed from scratch over all committed pairs: the zero-copy cache bookkeeping keeps the cache in
  sync through accepts, rejections, k = 0 steps and finished rows."""
  import dataclasses
  from spec_jax.cache import KVCache
  from train.losses import target_features

  diffs = []

  @dataclasses.dataclass(frozen=True)
  class Checked(eagle.EagleProposer):
    def propose(self, params, state, ctx, k, key):
      B, S = ctx.tokens.shape
      L = ctx.lengths
      tok0 = jnp.take_along_axis(ctx.tokens, (L - 1)[:, None], axis=1)
      inc, _ = eagle.eagle_forward(params, self.config, ctx.last_hidden[:, None], tok0, (L - 2)[:, None],
                                   state.cache.replace(lengths=L - 2))
      F = target_features(params["target"], CONFIG, ctx.tokens)  # causal: positions < L are exact
      nxt = jnp.concatenate([ctx.tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
      pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
      ref, _ = eagle.eagle_forward(params, self.config, F, nxt, pos, KVCache.init(self.config, B, S))
      ref = jnp.take_along_axis(ref, (L - 2)[:, None, None], axis=1)
      jax.debug.callback(lambda d: diffs.append(float(d)), jnp.max(jnp.abs(ref - inc)))
      return super().propose(params, state, ctx, k, key)

  params = _params(1)
  proposer, pparams = _eagle(params, D2T, k=3)
  proposer = Checked(config=proposer.config, vocab_size=proposer.vocab_size, k=3, reduced=True)
  prompts = _prompts(2, [4, 11, 7])
  base = generate(params, CONFIG, prompts, max_new_tokens=[6, 16, 11])
  res = generate(params, CONFIG, prompts, max_new_tokens=[6, 16, 11], proposer=proposer,
                 proposer_params=dict(pparams, target=params), adaptive_k=True, costs=[1.0, 1.01, 1.02])
  assert res.token_ids == base.token_ids
  assert len(diffs) >= 3 and max(diffs) < 1e-4, diffs
