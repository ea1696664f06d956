"""Programs over several CPU devices dispatched back to back, with no host read between them, finish.

XLA:CPU (jaxlib 0.10) can deadlock there: one device's thread never reaches a collective's rendezvous, and after
60 s the process aborts ("Expected 8 threads to join the rendezvous, but only 7 of them arrived"). spec_jax waits
for each program on a mesh of CPU devices (sharding.settled); this file is the regression test. Without the wait,
this loop deadlocked in every run tried (2026-12-02)."""

import jax
import numpy as np

from spec_jax import sharding, slots
from spec_jax.decode import decode_loop, make_spec
from spec_jax.models.transformer import init_params
from tests.conftest import tiny_gemma_config
from tests.test_slots import _proposer

CONFIG = tiny_gemma_config(vocab_size=128, eos_ids=(1,))
ROUNDS = 150


def test_insert_and_step_back_to_back_on_a_mesh():
  mesh = sharding.make_mesh("data:4,model:2")
  params = init_params(CONFIG, jax.random.PRNGKey(0))
  prop, pp = _proposer("draft", params, CONFIG)
  spec = make_spec(CONFIG, prop, adaptive_k=False, mesh=mesh)
  both = sharding.shard_params({"target": params, "proposer": pp}, mesh)
  state = slots.empty_state(both, spec, batch=4, capacity=128)
  req = slots.make_request([2, 5, 6, 7, 5, 6, 7], max_new=100, spec=spec, capacity=128)
  for i in range(ROUNDS):  # an insert and one step per round; nothing read on the host until the end
    state = slots.insert(both, state, i % 4, req, spec)
    state = decode_loop(both, state, spec, 1)
  snap = slots.snapshot(state)
  assert int(snap.step) == ROUNDS
  assert not np.asarray(snap.done).any()  # every slot is still decoding its last request
