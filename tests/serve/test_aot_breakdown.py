"""serve/compiler/aot_breakdown.py: a compiled step's bytes and time by role, from its optimized HLO text (no compiler for
a TPU needed: a hand-written module in XLA:TPU's notation, and a tiny loop step compiled for this CPU)."""

import jax
import jax.numpy as jnp
import pytest

from serve.compiler import aot_breakdown as bd
from spec_jax import scopes

V5E = "TPU v5 lite"

# A loop whose body: a prefetch of the stacked weights into VMEM (S(1)) read by a layer fusion that slices one
# layer out of it; a Pallas kernel with its declared cost; a conditional whose costlier branch is a sampler sort
# without metadata of its own; the LM head's fusion; an in-place update of a cache.
HLO = """HloModule m

%fused_layer (p0: bf16[4,64,64], p1: f32[8,64]) -> f32[8,64] {
  %p0 = bf16[4,64,64]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = f32[8,64]{1,0:T(8,128)} parameter(1)
  %ds = bf16[1,64,64]{2,1,0:T(8,128)(2,1)S(1)} dynamic-slice(%p0, %c, %c, %c), dynamic_slice_sizes={1,64,64}
  %bc = bf16[64,64]{1,0} bitcast(%ds)
  ROOT %dot = f32[8,64]{1,0} dot(%p1, %bc), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_head (q0: bf16[1000,64], q1: f32[8,64]) -> f32[8,1000] {
  %q0 = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(0)
  %q1 = f32[8,64]{1,0} parameter(1)
  ROOT %hd = f32[8,1000]{1,0} dot(%q1, %q0), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_dus (u0: bf16[4,16,512,64], u1: bf16[4,16,1,64]) -> bf16[4,16,512,64] {
  %u0 = bf16[4,16,512,64]{3,2,1,0} parameter(0)
  %u1 = bf16[4,16,1,64]{3,2,1,0} parameter(1)
  ROOT %dus = bf16[4,16,512,64]{3,2,1,0} dynamic-update-slice(%u0, %u1, %z, %z, %z, %z)
}

%cheap (a: f32[8,1000]) -> f32[8] {
  %a = f32[8,1000]{1,0} parameter(0)
  ROOT %r = f32[8]{0} reduce(%a, %zero), dimensions={1}, to_apply=%add
}

%costly (b: f32[8,1000]) -> f32[8] {
  %b = f32[8,1000]{1,0} parameter(0)
  %s = (f32[8,1000]{1,0}, s32[8,1000]{1,0}) sort(%b, %iota), dimensions={1}, to_apply=%gt
  ROOT %g = f32[8]{0} get-tuple-element(%s), index=0
}

%body (w: (bf16[4,64,64], f32[8,64])) -> (bf16[4,64,64], f32[8,64]) {
  %w = (bf16[4,64,64], f32[8,64]) parameter(0)
  %wt = bf16[4,64,64]{2,1,0:T(8,128)(2,1)} get-tuple-element(%w), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%w), index=1
  %cs = (bf16[4,64,64]{2,1,0:T(8,128)(2,1)S(1)}, bf16[4,64,64]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%wt)
  %cd = bf16[4,64,64]{2,1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %layer = f32[8,64]{1,0} fusion(%cd, %x), kind=kOutput, calls=%fused_layer, metadata={op_name="jit(decode_loop)/while/body/role_target_layers/dot_general"}, backend_config={"window_config":{"estimated_cycles":"3000"}}
  %att = f32[8,64]{1,0} custom-call(%x, %cache), custom_call_target="tpu_custom_call", metadata={op_name="jit(decode_loop)/while/body/role_target_layers/role_attention/spec_attention_tpu/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"4096","transcendentals":"0","bytes_accessed":"2000000","remote_bytes_transferred":"0"}}}
  %head_w = bf16[1000,64]{1,0:T(8,128)(2,1)} parameter(1)
  %logits = f32[8,1000]{1,0} fusion(%head_w, %layer), kind=kOutput, calls=%fused_head, metadata={op_name="jit(decode_loop)/while/body/role_lm_head/dot_general"}
  %cond = (f32[8]{0}) conditional(%pick, %logits, %logits), branch_computations={%cheap, %costly}, metadata={op_name="jit(decode_loop)/while/body/role_sampling/cond"}
  %cache = bf16[4,16,512,64]{3,2,1,0} parameter(2)
  %new = bf16[4,16,1,64]{3,2,1,0} parameter(3)
  %upd = bf16[4,16,512,64]{3,2,1,0} fusion(%cache, %new), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(decode_loop)/while/body/role_pages/dynamic_update_slice"}
  %relayout = bf16[4,64,64]{1,2,0:T(8,128)(2,1)} copy(%wt)
  ROOT %out = (bf16[4,64,64], f32[8,64]) tuple(%wt, %layer)
}

ENTRY %main (p: (bf16[4,64,64], f32[8,64])) -> (bf16[4,64,64], f32[8,64]) {
  %p = (bf16[4,64,64], f32[8,64]) parameter(0)
  %wt0 = bf16[4,64,64]{2,1,0} get-tuple-element(%p), index=0
  %hoisted = bf16[4,64,64]{1,2,0:T(8,128)(2,1)} copy(%wt0)
  ROOT %loop = (bf16[4,64,64], f32[8,64]) while(%p), condition=%cond_c, body=%body
}
"""


def test_roles_bytes_and_branches_of_a_hand_written_step():
  """Each rule on its own instruction: a VMEM prefetch counts the weights once (to the role that reads them) and
  the fusion reading VMEM adds nothing for them; a sliced operand counts its slice; a kernel its declared cost; a
  conditional its costlier branch (the sort, which takes its caller's role); an in-place update its update; a
  copy without a role is a layout change, and one outside the loop is per loop call. Fails if any rule is dropped (e.g. counting VMEM operands, or every
  branch)."""
  out = bd.breakdown(HLO, V5E, optimal_seconds=None)
  roles = out["roles"]
  weights = 4 * 64 * 64 * 2
  # the prefetch reads all 4 layers once; the layer fusion reads its x (f32 8x64) and writes its output
  assert roles["target layers"]["bytes"] == weights + 2 * 8 * 64 * 4
  assert roles["target layers"]["flops"] == 2 * 8 * 64 * 64
  assert roles["attention/KV"]["bytes"] == 2_000_000 and roles["attention/KV"]["flops"] == 4096
  assert roles["LM head"]["bytes"] == 1000 * 64 * 2 + 8 * 64 * 4 + 8 * 1000 * 4
  assert roles["LM head"]["flops"] == 2 * 8 * 1000 * 64
  # the sort branch (reads and writes [8, 1000] values and indices), not the reduce, and in the sampler's role
  assert roles["sampling/verify"]["count"] == 1 and roles["sampling/verify"]["top"][0]["name"] == "s"
  # ... and what it costs beyond the cheaper branch (the reduce: [8, 1000] f32 in, [8] out), reported apart: what
  # a step whose rows take the cheap branch skips
  sort_bytes, reduce_bytes = roles["sampling/verify"]["bytes"], 8 * 1000 * 4 + 8 * 4
  branches = out["branches"]
  assert branches["seconds"] == pytest.approx((sort_bytes - reduce_bytes) / 819e9)
  assert branches["bytes"] == pytest.approx(sort_bytes - reduce_bytes)
  assert [(c["name"], c["role"]) for c in branches["top"]] == [("cond", "sampling/verify")]
  assert branches["top"][0]["op_name"].endswith("role_sampling/cond")
  assert roles["page-table gathers"]["bytes"] == 2 * 4 * 16 * 64 * 2  # the update in, the update written
  assert roles["copies/layout"]["bytes"] == 4 * weights and roles["copies/layout"]["count"] == 2
  # the copy outside the loop is once per loop call, the one inside per step
  assert out["per_call_bytes"] == 2 * weights
  assert roles["rest"]["count"] == 0
  # no optimal_seconds: the seconds are the rooflines, at v5e's bandwidth where bytes dominate
  assert out["scale"] == 1.0
  assert roles["attention/KV"]["seconds"] == pytest.approx(2_000_000 / 819e9)
  assert roles["target layers"]["cycles_seconds"] == pytest.approx(3000 / 1.5e9)
  scaled = bd.breakdown(HLO, V5E, optimal_seconds=2 * out["roofline_seconds"])
  assert sum(r["seconds"] for r in scaled["roles"].values()) == pytest.approx(2 * out["roofline_seconds"])


def test_role_paths():
  """The innermost role scope decides; inside the drafter, its head, its tree work or its layers."""
  D, H, S, T = scopes.DRAFTER, scopes.LM_HEAD, scopes.SAMPLING, scopes.TREE
  assert scopes.role_of_path(f"jit(x)/while/body/{scopes.TARGET_LAYERS}/{scopes.ATTENTION}/p") == "attention/KV"
  assert scopes.role_of_path(f"jit(x)/{D}/{scopes.TARGET_LAYERS}/{H}/dot") == "drafter head"
  assert scopes.role_of_path(f"jit(x)/{D}/{S}/cond/sort") == "drafter head"
  assert scopes.role_of_path(f"jit(x)/{D}/{T}/top_k") == "tree masks/compaction"
  assert scopes.role_of_path(f"jit(x)/{D}/{scopes.ATTENTION}/p") == "drafter layers"
  assert scopes.role_of_path("jit(x)/while/body/add") == ""
  with pytest.raises(ValueError, match="no published figures"):
    bd.breakdown(HLO, "TPU v99", None)


def test_a_compiled_step_is_attributed_by_its_scopes():
  """A tiny Llama's k = 2 n-gram step compiled for this CPU: the LM head's role moves at least the head's weights,
  the target layers' at least their weights, the sampler and the drafter have instructions: the scopes reach the
  compiled program's metadata (XLA:CPU's hoisted float32 converts of the weights carry none, so 'rest' is not
  checked here). ~30 s on the shared 2-core host."""
  from serve.compiler import aot_programs as progs
  from tests.conftest import tiny_llama_config
  config = tiny_llama_config(vocab_size=4096, d_model=64, mlp_dim=128, num_heads=4, num_kv_heads=2, head_dim=16)
  dev = jax.devices("cpu")[0]
  prog = progs.step_program(config, progs.Placement(dev, None), method="ngram", k=2, topk=1, nodes=0, batch=2,
                            max_model_len=64, dtype=jnp.bfloat16, impl="xla")
  text = prog.fn.trace(*prog.args, **prog.kwargs).lower().compile().as_text()
  roles = bd.breakdown(text, V5E, None)["roles"]
  head = 4096 * 64 * 2
  layers = config.num_layers * (64 * (4 + 2 + 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128) * 2
  assert roles["LM head"]["bytes"] >= head
  assert roles["target layers"]["bytes"] >= layers
  assert roles["LM head"]["flops"] >= 2 * 2 * 3 * 4096 * 64  # 2 rows x 3 positions
  assert roles["sampling/verify"]["count"] > 0 and roles["drafter layers"]["count"] > 0


RELAYOUTS = """HloModule r

ENTRY %main (q: bf16[2,256,4,128], k: bf16[2,256,1,128]) -> bf16[2,256,4,128] {
  %q = bf16[2,256,4,128]{3,2,1,0:T(4,128)(2,1)} parameter(0)
  %k = bf16[2,256,1,128]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %copy.88 = bf16[2,256,4,128]{3,1,2,0:T(8,128)(2,1)S(1)} copy(%q)
  %kswap = bf16[2,256,1,128]{3,1,2,0:T(8,128)(2,1)} copy(%k)
  %cs = (bf16[2,256,4,128]{3,2,1,0:T(4,128)(2,1)S(1)}, bf16[2,256,4,128]{3,2,1,0:T(4,128)(2,1)}, u32[]{:S(2)}) copy-start(%q)
  %cd = bf16[2,256,4,128]{3,2,1,0:T(4,128)(2,1)S(1)} copy-done(%cs)
  ROOT %out = bf16[2,256,4,128]{3,2,1,0} add(%copy.88, %cd)
}
"""


def test_weight_relayouts_are_copies_into_another_dimension_order():
  """<1 s. The Q weight copied heads-major (issue 48's copy.541, small) is named; a VMEM prefetch in the same order
  and a swap of a size-1 dimension are not relayouts. Fails if the order is compared with size-1 dimensions kept
  (the K copy would be named) or if copies are not told apart by order (the prefetch would be)."""
  got = bd.weight_relayouts(RELAYOUTS)
  assert [(r["name"], r["input"], r["shape"], r["from"], r["to"]) for r in got] == [
      ("copy.88", "q", "bf16[2,256,4,128]", [3, 2, 1, 0], [3, 1, 2, 0])]
  assert bd.breakdown(RELAYOUTS, V5E, None)["weight_relayouts"] == got


# XLA:GPU's served step: the decode loop (trip count unknown) around the layer scan (known_trip_count 4). Its body:
# a fusion slicing one layer of a stacked weight through a bitcast, a cuBLAS GEMM with its s8 workspace, and a
# Triton kernel (Pallas on GPU declares no cost) reading the stacked KV pool [4, ...].
GPU_HLO = """HloModule g

%fused_ds (p0: bf16[4,64,128], p1: s32[]) -> bf16[1,64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %bc = bf16[4,64,128]{2,1,0} bitcast(%p0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%bc, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
}

%layer (l: (bf16[4,64,128], s32[])) -> (bf16[4,64,128], s32[]) {
  %l = (bf16[4,64,128], s32[]) parameter(0)
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%l), index=0
  %i = s32[] get-tuple-element(%l), index=1
  %x = bf16[8,64]{1,0} parameter(1)
  %pool = bf16[4,32,16,64]{3,2,1,0} parameter(2)
  %slice = bf16[1,64,128]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_ds, metadata={op_name="jit(decode_loop)/while/body/role_target_layers/while/body/dynamic_slice"}
  %gemm = (f32[8,128]{1,0}, s8[33554432]{0}) custom-call(%x, %slice), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(decode_loop)/while/body/role_target_layers/while/body/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %att = f32[8,64]{1,0} custom-call(%x, %pool), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(decode_loop)/while/body/role_target_layers/role_attention/pallas_call"}
  ROOT %o = (bf16[4,64,128], s32[]) tuple(%w, %i)
}

%step (s: (bf16[4,64,128], s32[])) -> (bf16[4,64,128], s32[]) {
  %s = (bf16[4,64,128], s32[]) parameter(0)
  ROOT %layers = (bf16[4,64,128], s32[]) while(%s), condition=%lc, body=%layer, metadata={op_name="jit(decode_loop)/while/body/role_target_layers/while"}, backend_config={"known_trip_count":{"n":"4"}}
}

ENTRY %main (p: (bf16[4,64,128], s32[])) -> (bf16[4,64,128], s32[]) {
  %p = (bf16[4,64,128], s32[]) parameter(0)
  ROOT %loop = (bf16[4,64,128], s32[]) while(%p), condition=%c, body=%step
}
"""


def test_gpu_step_counts_each_layer_its_gemm_without_workspace_and_a_kernel_one_layer_of_the_pool():
  """Fails if the scan is counted once (trips), the cuBLAS workspace counts as traffic, a bitcast hides the
  slice (the whole stacked weight read per layer), a GEMM has no FLOPs, or the Triton kernel reads the whole pool
  per layer."""
  layer = 64 * 128 * 2  # one layer's weight slice
  copy = 2 * layer + 4  # the slice fusion: the slice read, written, and the s32 index
  gemm = 8 * 64 * 2 + layer + 8 * 128 * 4  # x, the slice, the product: no workspace
  kernel = 8 * 64 * 2 + 32 * 16 * 64 * 2 + 8 * 64 * 4  # x, one layer of the pool, the output
  once = bd.breakdown(GPU_HLO, "NVIDIA H200", None)
  assert once["bytes"] == pytest.approx(copy + gemm + 8 * 64 * 2 + 4 * 32 * 16 * 64 * 2 + 8 * 64 * 4)
  out = bd.breakdown(GPU_HLO, "NVIDIA H200", None, trips=True)
  assert out["bytes"] == pytest.approx(4 * (copy + gemm + kernel))
  assert out["flops"] == pytest.approx(4 * 2 * 8 * 128 * 64)
  assert out["roles"]["attention/KV"]["bytes"] == pytest.approx(4 * kernel)


# XLA:TPU's async collective fusion: a collective's buffers threaded through a compute fusion scheduled between its
# start and done (extra operands, extra tuple outputs), whose own result another fusion then reads.
ASYNC_HLO = """HloModule m2

%fused_start (a0: f32[1,40,8]) -> (f32[1,40,8], f32[8,40,8], u32[]) {
  %a0 = f32[1,40,8]{2,1,0} parameter(0)
  %z = f32[8,40,8]{2,1,0} broadcast(%zero), dimensions={}
  %c = u32[]{:S(2)} constant(0)
  ROOT %t = (f32[1,40,8]{2,1,0}, f32[8,40,8]{2,1,0}, u32[]{:S(2)}) tuple(%a0, %z, %c)
}

%fused_proj (p0: bf16[64,64], p1: f32[8,64], c0: f32[1,40,8], c1: f32[8,40,8], c2: u32[]) -> (f32[8,64], f32[1,40,8], f32[8,40,8], u32[]) {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = f32[8,64]{1,0} parameter(1)
  %c0 = f32[1,40,8]{2,1,0} parameter(2)
  %c1 = f32[8,40,8]{2,1,0} parameter(3)
  %c2 = u32[]{:S(2)} parameter(4)
  %d = f32[8,64]{1,0} dot(%p1, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[8,64]{1,0}, f32[1,40,8]{2,1,0}, f32[8,40,8]{2,1,0}, u32[]{:S(2)}) tuple(%d, %c0, %c1, %c2)
}

%fused_neg (n0: f32[8,64]) -> f32[8,64] {
  %n0 = f32[8,64]{1,0} parameter(0)
  ROOT %n = f32[8,64]{1,0} negate(%n0)
}

%fused_done (e0: f32[1,40,8], e1: f32[8,40,8], e2: u32[]) -> f32[8,40,8] {
  %e0 = f32[1,40,8]{2,1,0} parameter(0)
  %e2 = u32[]{:S(2)} parameter(2)
  ROOT %e1 = f32[8,40,8]{2,1,0} parameter(1)
}

ENTRY %main (w: bf16[64,64], x: f32[8,64], g: f32[1,40,8]) -> (f32[8,64], f32[8,40,8]) {
  %w = bf16[64,64]{1,0} parameter(0)
  %x = f32[8,64]{1,0} parameter(1)
  %g = f32[1,40,8]{2,1,0} parameter(2)
  %async-collective-start = (f32[1,40,8]{2,1,0}, f32[8,40,8]{2,1,0}, u32[]{:S(2)}) fusion(%g), kind=kCustom, calls=%fused_start, metadata={op_name="jit(decode_loop)/while/body/role_drafter/all_gather"}
  %s0 = f32[1,40,8]{2,1,0} get-tuple-element(%async-collective-start), index=0
  %s1 = f32[8,40,8]{2,1,0} get-tuple-element(%async-collective-start), index=1
  %s2 = u32[]{:S(2)} get-tuple-element(%async-collective-start), index=2
  %proj = (f32[8,64]{1,0}, f32[1,40,8]{2,1,0}, f32[8,40,8]{2,1,0}, u32[]{:S(2)}) fusion(%w, %x, %s0, %s1, %s2), kind=kOutput, calls=%fused_proj, metadata={op_name="jit(decode_loop)/while/body/role_target_layers/dot_general"}
  %y = f32[8,64]{1,0} get-tuple-element(%proj), index=0
  %r0 = f32[1,40,8]{2,1,0} get-tuple-element(%proj), index=1
  %r1 = f32[8,40,8]{2,1,0} get-tuple-element(%proj), index=2
  %r2 = u32[]{:S(2)} get-tuple-element(%proj), index=3
  %use = f32[8,64]{1,0} fusion(%y), kind=kLoop, calls=%fused_neg, metadata={op_name="jit(decode_loop)/while/body/role_target_layers/neg"}
  %async-collective-done = f32[8,40,8]{2,1,0} fusion(%r0, %r1, %r2), kind=kCustom, calls=%fused_done, metadata={op_name="jit(decode_loop)/while/body/role_drafter/all_gather"}
  ROOT %out = (f32[8,64]{1,0}, f32[8,40,8]{2,1,0}) tuple(%use, %async-collective-done)
}
"""


def test_an_async_collectives_buffers_count_once_not_in_each_fusion_that_carries_them():
  """The projection fusion that carries the collective's buffers is charged its own work only (its weight, input
  and result), and the fusion that reads its result is charged that result; the buffers count at the start and
  done. Fails when a carrying fusion is charged the buffers (XLA:TPU's batch-64 EAGLE-3 step: 5.5 GB of target
  layers that were the draft head's all-gather), or when its own result is taken for a carried buffer."""
  roles = bd.breakdown(ASYNC_HLO, V5E, optimal_seconds=None)["roles"]
  small, big = 1 * 40 * 8 * 4, 8 * 40 * 8 * 4
  assert roles["target layers"]["bytes"] == (64 * 64 * 2 + 8 * 64 * 4 + 8 * 64 * 4) + 2 * 8 * 64 * 4
  # the start reads its input and writes both buffers; the done (whose computation returns its parameter, reading
  # nothing of it) writes the gathered buffer
  assert roles["drafter layers"]["bytes"] + roles["drafter head"]["bytes"] == (small + small + big) + big
