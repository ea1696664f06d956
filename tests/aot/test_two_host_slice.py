"""Llama-3 70B on a two-host v5e-16 slice (issue 47): `v5e:4x4,hosts=2` is 16 chips on two 8-chip hosts, and the
trainer's EAGLE step (the frozen target in bfloat16) and the server's slot insert compile across both
hosts on a `model:16` mesh and fit a chip's 16 GiB. Marked aot (the compilers of .venv-aot); the 70B compiles are
aot_full (a minute or more each on 2 busy cores). BENCHMARKS.md has the whole report (serve.aot)."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from serve.compiler import aot_compile, aot_programs as progs
from spec_jax.models.shapes import model_shape

pytestmark = pytest.mark.aot
TOPOLOGY = "v5e:4x4,hosts=2"


def _need_libtpu():
  if importlib.util.find_spec("libtpu") is None:
    if os.environ.get("SPEC_JAX_AOT") == "required":
      pytest.fail("libtpu is not installed in this environment (make install-aot)")
    pytest.skip("libtpu not installed (make install-aot)")


def test_the_topology_names_its_hosts():
  """libtpu's own v5e:4x4 is four hosts of 4 chips; ',hosts=2' gives two hosts of 8, and a host count that does
  not split the chips is refused."""
  _need_libtpu()
  two = aot_compile.target(TOPOLOGY)
  four = aot_compile.target("v5e:4x4")
  hosts = lambda t: sorted(sum(d.process_index == p for d in t.devices) for p in {d.process_index for d in t.devices})
  assert (len(two.devices), hosts(two), two.chip) == (16, [8, 8], "TPU v5 lite")
  assert hosts(four) == [4, 4, 4, 4]
  mesh = aot_compile.mesh_of(list(two.devices), "data:2,model:8")
  assert [{d.process_index for d in row} for row in mesh.devices] == [{0}, {1}]  # a data row per host
  with pytest.raises(RuntimeError):
    aot_compile.target("v5e:4x4,hosts=3")


def _programs():
  tgt = aot_compile.target(TOPOLOGY)
  place = progs.Placement(tgt.devices[0], aot_compile.mesh_of(list(tgt.devices), "model:16"))
  config = model_shape("llama3-70b")
  out = progs.serving_programs(config, place, methods=["none"], k=4, topk=1, nodes=16, max_num_seqs=4,
                               max_model_len=2048, dtype=jnp.bfloat16, impl=tgt.attention_impl,
                               insert_buckets=[16], adaptive=False)
  out += progs.train_programs(config, place, kinds=["eagle"], batch=8, seq_len=512,
                              target_dtype=jnp.bfloat16)
  return tgt, {p.name: p for p in out}


@pytest.mark.aot_full
@pytest.mark.parametrize("name", ["train_step[eagle]", "insert[none, prompt 16]"])
def test_llama3_70b_compiles_and_fits_on_two_hosts(name):
  """Each chip holds a sixteenth of the 70B target (plus what does not split 16 ways: the 8 KV heads' weights and
  cache), not the whole; the program spans both hosts' chips and calls back to no host."""
  _need_libtpu()
  tgt, ps = _programs()
  prog = ps[name]
  rec = aot_compile.compile_program(prog, tgt.devices[0], tgt.capacity_bytes, cost=False)
  assert rec["compiled"], rec.get("error")
  assert rec["fits"], rec["memory"]
  assert rec["host_callbacks"] == []
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(prog.args) if hasattr(x, "dtype"))
  assert whole > 100e9 and rec["memory"]["argument_bytes"] < whole / 8
  mesh = next(x.sharding.mesh for x in jax.tree.leaves(prog.args) if getattr(x, "sharding", None) is not None)
  assert {d.process_index for d in mesh.devices.flat} == {0, 1}
