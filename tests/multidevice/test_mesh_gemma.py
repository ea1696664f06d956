"""Gemma 3 270M in float32 on meshes of 8 simulated CPU devices: greedy output token for token the one-device
output (vocabulary, heads and MLP split over `model`; its one KV head whole on every model shard)."""

import pytest

from spec_jax import sharding
from spec_jax.batch import generate
from spec_jax.proposers.ngram import NgramProposer
from tests.proposers.test_medusa_eagle import gemma3_chat_prompts

MAX_NEW = 24


@pytest.mark.slow
def test_gemma3_greedy_on_meshes_equals_one_device(gemma3_f32, gemma3_tokenizer):
  config, params = gemma3_f32
  prompts = gemma3_chat_prompts(gemma3_tokenizer)[:2]
  for proposer, meshes in ((None, ("data:8", "data:4,model:2", "data:2,model:4")), (NgramProposer(k=3),
                                                                                     ("data:2,model:4",))):
    kw = {} if proposer is None else dict(proposer=proposer, adaptive_k=False)
    ref = generate(params, config, prompts, max_new_tokens=MAX_NEW, **kw)
    for text in meshes:
      out = generate(params, config, prompts, max_new_tokens=MAX_NEW, mesh=sharding.make_mesh(text), **kw)
      assert out.token_ids == ref.token_ids, text
      if proposer is not None:
        assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"]
