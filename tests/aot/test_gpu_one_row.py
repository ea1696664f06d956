"""One-row products on XLA:GPU (deviceless, the H200 target): a batch-1 step's weights stay bfloat16. XLA:GPU rewrites
a one-row bfloat16 product with a float32 result as multiply + reduce over a float32 copy of the weight;
kernels.common.gemm_rows gives it two rows (a GEMM) on GPU only."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.aot


def _h200():
  try:
    from serve.compiler import aot_compile
    return aot_compile.target("h200").devices[0]
  except RuntimeError:
    if os.environ.get("SPEC_JAX_AOT") == "required":
      raise
    pytest.skip("the CUDA plugin is not installed (make install-aot)")


def _hlo(fn, *shapes):
  from jax.sharding import SingleDeviceSharding
  from serve.compiler.aot_compile import GPU_OPTIONS
  dev = _h200()
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=SingleDeviceSharding(dev)) for s in shapes]
  with jax.default_device(dev):
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=GPU_OPTIONS).as_text()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_layer_product_and_a_draft_head_read_bfloat16_weights(rows):
  """~5 s. Fails when a one-row product (the MLP's, a draft head's) converts its weight to float32."""
  from spec_jax.models.transformer import dot
  from spec_jax.proposers.vocab import project
  text = _hlo(lambda x, w, head: (dot("btd,df->btf", x, w), project(x[:, 0], head)),
              (rows, 1, 512), (512, 1792), (3000, 512))
  assert not re.search(r"f32\[(1,)?512,1792\]|f32\[3000,512\]", text), "a float32 copy of a weight"
  assert "cublas" in text  # the products are GEMMs
