"""Gemma 3 270M in float32 on meshes of 8 simulated CPU devices: greedy output token for token the one-device
output (vocabulary, heads and MLP split over `model`; its one KV head whole on every model shard). The
one-device references are computed once per method in the process (the cases run in one subprocess,
tests/test_multidevice.py)."""

import pytest

from spec_jax import sharding
from spec_jax.batch import generate
from spec_jax.proposers.ngram import NgramProposer
from tests.proposers.test_medusa_eagle import gemma3_chat_prompts

MAX_NEW = 24


# make test runs each split of the model (over 2 and 4 devices) once; make test-full the rest (marked full).
CASES = [(None, "data:4,model:2"), ("ngram", "data:2,model:4"),
         pytest.param(None, "data:8", marks=pytest.mark.full),
         pytest.param(None, "data:2,model:4", marks=pytest.mark.full)]


@pytest.fixture(scope="module")
def one_device():
  """method -> the one-device run, filled by the first case that needs it (the cases share one subprocess)."""
  return {}


@pytest.mark.slow
@pytest.mark.parametrize("method,mesh_text", CASES)
def test_gemma3_greedy_on_meshes_equals_one_device(gemma3_f32, gemma3_tokenizer, one_device, method, mesh_text):
  config, params = gemma3_f32
  prompts = gemma3_chat_prompts(gemma3_tokenizer)[:2]
  kw = {} if method is None else dict(proposer=NgramProposer(k=3), adaptive_k=False)
  if method not in one_device:
    one_device[method] = generate(params, config, prompts, max_new_tokens=MAX_NEW, **kw)
  ref = one_device[method]
  out = generate(params, config, prompts, max_new_tokens=MAX_NEW, mesh=sharding.make_mesh(mesh_text), **kw)
  assert out.token_ids == ref.token_ids, mesh_text
  if method is not None:
    assert out.stats["accepted_tokens"] == ref.stats["accepted_tokens"]
