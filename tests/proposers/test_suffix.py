"""The suffix proposer: lossless (greedy and sampled), drafts from an earlier request's output through the shared
history, keeps tenants apart unless sharing is global, survives its ring wrapping, and runs through
serve.generate."""

import functools

import jax
import numpy as np
import pytest

from spec_jax import slots
from spec_jax.batch import generate
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import init_params
from spec_jax.proposers.ngram import NgramProposer
from spec_jax.proposers.suffix import SuffixProposer, forget_tenant
from tests.conftest import tiny_gemma_config, tiny_llama_config
from tests.distribution import assert_commits_plain_tokens

CONFIG = tiny_gemma_config(eos_ids=(1,))
CAPACITY = 128
# The tiny Gemma repeats one token after a few (n-gram drafts that well); this tiny Llama's greedy text varies more,
# so that what an earlier request wrote is worth something.
LLAMA = tiny_llama_config(eos_ids=(1,))


@functools.lru_cache(maxsize=None)
def _params(seed=0):
  return init_params(CONFIG, jax.random.PRNGKey(seed))


def _prompts(rng, lengths):
  return [[2] + rng.integers(3, CONFIG.vocab_size, n - 1).tolist() for n in lengths]


@pytest.mark.parametrize("seed", range(2))
def test_greedy_is_lossless(seed):
  params = _params(seed)
  rng = np.random.default_rng(seed)
  span = rng.integers(3, CONFIG.vocab_size, 5).tolist()
  prompts = [[2] + span * 3, _prompts(rng, [9])[0], [2] + span * 2 + [7], _prompts(rng, [4])[0]]
  base = generate(params, CONFIG, prompts, max_new_tokens=24)
  # a small ring, so that it wraps during the run
  spec = generate(params, CONFIG, prompts, max_new_tokens=24, proposer=SuffixProposer(k=4, history=16),
                  adaptive_k=False)
  assert spec.token_ids == base.token_ids
  assert spec.finish_reasons == base.finish_reasons
  assert spec.stats["drafted_tokens"] > 0


def test_sampling_commits_the_plain_samplers_tokens():
  # Its drafts are deterministic: token identity with plain sampling (tests/distribution.py), not a chi-square.
  config = tiny_gemma_config(vocab_size=8, eos_ids=(99,))  # a tiny vocab: repeats, so the history drafts
  params = init_params(config, jax.random.PRNGKey(3))
  rate, _ = assert_commits_plain_tokens(params, config, SuffixProposer(k=2, history=32), {}, n=500)
  assert 0.0 < rate < 0.95


def _serial(proposer, requests, *, batch=2):
  """Run (prompt, tenant) requests one after another through slot 0 of a slot state (greedy) -> per request
  (tokens, drafted, accepted, accepted from the history), and the state."""
  params = {"target": init_params(LLAMA, jax.random.PRNGKey(2)), "proposer": {}}
  spec = make_spec(LLAMA, proposer, adaptive_k=False)
  state = slots.empty_state(params, spec, batch=batch, capacity=CAPACITY)
  out = []
  for prompt, tenant in requests:
    req = slots.make_request(prompt, max_new=40, spec=spec, capacity=CAPACITY, tenant=tenant)
    state = slots.insert(params, state, np.int32(0), req, spec)
    state = decode_loop(params, state, spec)
    snap = jax.device_get(slots.snapshot(state))
    n = int(snap.lengths[0])
    from_hist = int(state.pstate.accepted_hist[0]) if isinstance(proposer, SuffixProposer) else 0
    out.append((snap.tokens[0, len(prompt):n].tolist(), int(snap.drafted[0]), int(snap.accepted[0]), from_hist))
    state = slots.release(state, np.int32(0))
  return out, state


def _prompt():
  return _prompts(np.random.default_rng(8), [12])[0]


def test_a_repeated_request_drafts_from_the_history():
  p = _prompt()
  (a, b), _ = _serial(SuffixProposer(k=4), [(p, 0), (p, 0)])
  (na, nb), _ = _serial(NgramProposer(k=4, ngram_max=3), [(p, 0), (p, 0)])
  assert a[0] == b[0] == na[0] == nb[0]  # greedy: the same answer each time
  assert b[3] > 0 and b[3] > a[3]
  # accepted tokens per step (tau - 1) well above prompt-only n-gram's on the same traffic
  assert b[2] >= 0.6 * len(b[0]) and b[2] > 2 * max(nb[2], 1)


def test_tenants_do_not_share_unless_global():
  p = _prompt()
  (a, b), state = _serial(SuffixProposer(k=4), [(p, 1), (p, 2)])
  (_, own), _ = _serial(SuffixProposer(k=4), [(_prompts(np.random.default_rng(8), [12])[0], 1), (p, 2)])
  assert b[0] == a[0]
  assert b[3] == 0  # nothing accepted from tenant 1's history
  assert (b[1], b[2]) == (own[1], own[2])  # as if tenant 1 had never asked
  (_, g), _ = _serial(SuffixProposer(k=4, sharing="global"), [(p, 1), (p, 2)])
  assert g[3] > 0 and g[2] > b[2]
  # a tenant's id given to another after forget_tenant: the history holds nothing of the first one
  state = forget_tenant(state, 1)
  assert not (np.asarray(state.pstate.owner) == 1).any()


from tests.serve.test_server import tiny_model  # noqa: E402,F401 (a fixture)


def test_serve_generate_method_suffix(tiny_model, tmp_path):  # noqa: F811
  import json
  from tests.proposers.test_plugin_proposer import PROMPTS, _generate
  out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
  r = _generate(tiny_model, tmp_path, "--method=suffix", "--num_speculative_tokens=3", "--compare", "--noadaptive",
                "--suffix_history_tokens=64", f"--output={out}", f"--summary_json={summary}")
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(records) == len(PROMPTS)
  assert all(x["token_ids"] == x["baseline_token_ids"] for x in records)
  s = json.loads(summary.read_text())
  assert s["run"]["method"] == "suffix" and s["speculative"]["drafted_tokens"] > 0


def test_the_server_keeps_tenants_apart(tiny_model):  # noqa: F811
  from tests.serve.test_server import MODEL, metric, reference_greedy, tiny_server
  s = tiny_server(tiny_model, '--speculative_config={"method": "suffix", "num_speculative_tokens": 4}')
  name = "spec_jax:spec_decode_num_accepted_tokens_from_history_total"
  prompt = "the quick brown fox jumps over a lazy dog while"
  try:
    with s.http() as h:
      def ask(tenant):
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                                            "return_token_ids": True, "tenant": tenant})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
      want = reference_greedy(tiny_model, prompt, 40)
      assert ask("a") == want and ask("b") == want
      assert metric(s.metrics(), name) == 0  # b drafted nothing from a's answer
      assert ask("a") == want
      assert metric(s.metrics(), name) > 0  # its own tenant's history: drafted from it
  finally:
    assert s.stop() == 0, s.log()[-3000:]


def test_tenant_table_reuses_the_least_recently_used_idle_id():
  from serve.engine.tenants import TenantTable
  t = TenantTable(size=3, num_slots=2)
  assert t.acquire("a") == (0, None) and t.acquire("b") == (1, None) and t.acquire("c") == (2, None)
  t.release(1)
  t.release(2)
  assert t.acquire("a") == (0, None)  # known: its id again
  assert t.acquire("d") == (1, 1)  # a is running; b is the least recently used idle one: its id is cleared first
  t.release(0)
  t.release(0)
  assert t.acquire("e") == (2, 2)  # c was used before a


# The chain (width 1) in make test-full: the tree below takes the same slots, history and verify path on Gemma,
# and this file's tiny cases run the suffix chain through slots in make test.
@pytest.mark.slow
@pytest.mark.parametrize("width", [pytest.param(1, marks=pytest.mark.full), 2])
def test_gemma3_through_slots_is_lossless_and_a_repeat_drafts_from_the_history(gemma3_f32, gemma3_tokenizer, width):
  """Gemma 3 270M (float32) through a long-lived slot state: four requests, the last repeating the first one's
  prompt, each token-identical to plain greedy decoding; the repeat accepts drafts from the first one's answer.
  Chains, and trees of the 2 latest different continuations."""
  from spec_jax.proposers.tree_expand import DynamicTree
  from spec_jax.slot_table import SlotTable
  from tests.proposers.test_medusa_eagle import gemma3_chat_prompts
  config, params = gemma3_f32
  prompts = gemma3_chat_prompts(gemma3_tokenizer)
  max_new, capacity = 32, 256
  want = generate(params, config, prompts, max_new_tokens=max_new).token_ids
  tree = DynamicTree(topk=width, depth=4, nodes=1 + 4 * width) if width > 1 else None
  spec = make_spec(config, SuffixProposer(k=4, tree=tree), adaptive_k=False)
  table = SlotTable({"target": params, "proposer": {}}, spec, num_slots=2, capacity=capacity)
  got = {}
  for wave in ([0, 1], [2, 0]):  # the second wave's request 0 repeats the first wave's
    for i in wave:
      table.insert(i, slots.make_request(prompts[i], max_new=max_new, spec=spec, capacity=capacity))
    snap, held = table.run(max_new + 1)
    snap = jax.device_get(snap)
    for slot, i in held.items():
      assert snap.done[slot]
      got.setdefault(i, []).append((snap.tokens[slot, len(prompts[i]):snap.lengths[slot]].tolist(),
                                    int(snap.accepted[slot]), int(snap.accepted_from_history[slot])))
      table.release(slot)
  for i, runs in got.items():
    for tokens, _, _ in runs:
      assert tokens == want[i], i
  (first, _, first_hist), (repeat, repeat_acc, repeat_hist) = got[0]
  assert repeat_hist > 0 and repeat_hist > first_hist
  assert repeat_acc >= 0.5 * len(repeat)  # most of the repeat came from drafts


def _longest(corpus, query, ends, max_depth):
  """(end, n): the longest (<= max_depth), then latest, match of query's tail ending at one of `ends`."""
  best = (-1, 0)
  for j in ends:
    n = 0
    while n < min(max_depth, len(query)) and j - n >= 0 and corpus[j - n] == query[-1 - n]:
      n += 1
    if n and n >= best[1]:
      best = (j, n)
  return best


def test_the_history_wraps_without_corrupting_the_drafts():
  """A 16-token ring after ~5 wraps, fed in uneven steps: it holds exactly the last 16 tokens appended, oldest
  first from the write position, and every draft equals a plain-Python longest match over them (matches and
  continuations across the ring's physical end included)."""
  import jax.numpy as jnp
  from spec_jax.proposers.base import PrefillOut, ProposeContext, VerifyResult
  H, k, max_depth = 16, 4, 5
  p = SuffixProposer(k=k, history=H, max_depth=max_depth, spec_factor=4.0)
  rng = np.random.default_rng(0)
  motif = [10, 11, 12, 13, 14, 15, 16]
  stream = [t for _ in range(30) for t in (motif[:rng.integers(3, 7)] + [int(rng.integers(20, 40))])]
  first = jnp.asarray([[50, 0], [stream[0], 0]], jnp.int32)
  state = p.init({}, PrefillOut(first, first, jnp.asarray([1, 1]), jnp.asarray([0, 0]), None, None), 8)
  log, i = [stream[0]], 1
  while i < 85:
    n = int(rng.integers(1, k + 2))
    chunk = stream[i:i + n]
    toks = jnp.asarray([[0] * (k + 1), chunk + [0] * (k + 1 - len(chunk))], jnp.int32)
    res = VerifyResult(toks, jnp.asarray([0, len(chunk) - 1]), jnp.asarray([0, len(chunk)]), None, None)
    state = p.update({}, state, res)
    log += chunk
    i += n
  ring = [int(x) for x in np.roll(np.asarray(state.hist[1]), -int(state.pos[1]) % H)]
  assert ring == log[-H:]
  propose = jax.jit(lambda st, ctx: p.propose({}, st, ctx, k, None)[0].tokens)
  checked = 0
  for start in range(len(log) - 3):
    for m in (1, 2, 3):
      query = [60, 61] + log[start:start + m]  # 60, 61 occur nowhere: only the history matches
      ctx = ProposeContext(jnp.asarray([query + [0] * (16 - len(query)), [0] * 16], jnp.int32),
                           jnp.asarray([len(query), 1]), None, None)
      got = [int(t) for t in propose(state, ctx)[0] if t >= 0]
      j, n = _longest(ring, query, [j for j in range(H - 1)], max_depth)
      want = [] if n == 0 else [t for t in ring[j + 1:j + 1 + min(k, 4 * n)]]
      assert got == want, (query, ring)
      checked += bool(want)
  assert checked > 50
