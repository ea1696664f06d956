"""serve.aot's rule for what counts as a copy of the KV cache among a compiled program's temporaries."""

from serve.compiler.aot_compile import cache_sized


def _t(shape, nbytes):
  return {"bytes": nbytes, "instruction": "x", "shape": shape}


def test_one_slot_cache_copy_is_found_and_scores_are_not():
  layer = (1, 1, 4096, 256)  # one slot: the slot dimension cannot tell a copy apart
  temps = [_t("bf16[18,1,1,4096,256]", 18 * 4096 * 256 * 2),  # the stacked cache
           _t("f32[1,4,64,4096]", 4 * 64 * 4096 * 4),  # attention scores: capacity, no head dim
           _t("f32[8,262144]", 8 * 262144 * 4)]  # sampling
  assert [t["shape"] for t in cache_sized(temps, layer, 2)] == ["bf16[18,1,1,4096,256]"]


def test_many_slots_need_the_slot_dimension_and_half_a_layer():
  layer = (16, 8, 4096, 128)
  half = 16 * 8 * 4096 * 128 * 2 // 2
  temps = [_t("bf16[16,8,4096,128]", 2 * half),  # one layer of K
           _t("bf16[1,8,4096,128]", 2 * half // 16),  # insert's one-row prefill cache
           _t("bf16[4,8,4096,128]", half // 2)]  # a quarter layer: too small to be a copy
  assert [t["shape"] for t in cache_sized(temps, layer, 2)] == ["bf16[16,8,4096,128]"]


def test_a_weight_with_the_same_numbers_is_not_a_cache_copy():
  """Llama-8B's Q projection re-laid out per shard, [L, d_model, heads, head dim] = [32, 4096, 8, 128], beside a
  cache of 8 slots x 4096 tokens x 128: the same numbers, not the cache's trailing (capacity, head dim)."""
  layer = (8, 2, 4096, 128)
  temps = [_t("bf16[32,4096,8,128]", 32 * 4096 * 8 * 128 * 2), _t("bf16[32,8,2,4096,128]", 32 * 8 * 2 * 4096 * 256)]
  assert [t["shape"] for t in cache_sized(temps, layer, 2)] == ["bf16[32,8,2,4096,128]"]


def test_a_copy_of_the_page_pool_is_found():
  """A paged cache: one layer of the pool on a chip is (pages, kv heads, block, head dim); a temporary ending in
  (block, head dim) with the pages and half a pool layer's bytes is a copy, a page-sized one is not."""
  layer, pool = (16, 8, 4096, 128), (4097, 8, 16, 128)
  full = 4097 * 8 * 16 * 128 * 2
  temps = [_t("bf16[32,4097,8,16,128]", 32 * full), _t("bf16[1,8,16,128]", 8 * 16 * 128 * 2),
           _t("bf16[4097,8,16,128]", full)]
  assert [t["shape"] for t in cache_sized(temps, layer, 2, pool=pool)] == ["bf16[32,4097,8,16,128]",
                                                                          "bf16[4097,8,16,128]"]


def test_a_dequantized_or_scale_copy_of_an_8bit_pool_is_found():
  """An 8-bit pool (itemsize 1): a bfloat16 copy of a layer of it (dequantized) is a copy, and so is a copy of its
  float32 scales [.., pages, kv heads, block]; one page's dequantized values and one page's scales are not."""
  layer, pool = (16, 8, 4096, 128), (4097, 8, 16, 128)
  temps = [_t("bf16[4097,8,16,128]", 4097 * 8 * 16 * 128 * 2), _t("f32[32,4097,8,16]", 32 * 4097 * 8 * 16 * 4),
           _t("f32[4097,8,16]", 4097 * 8 * 16 * 4), _t("bf16[1,8,16,128]", 8 * 16 * 128 * 2),
           _t("f32[1,8,16]", 8 * 16 * 4)]
  assert [t["shape"] for t in cache_sized(temps, layer, 1, pool=pool)] == [
      "bf16[4097,8,16,128]", "f32[32,4097,8,16]", "f32[4097,8,16]"]
  # The scales' own layout [L, kv heads, block, pages] copied (whole, or a layer) is a copy too; a kernel's block of
  # 128 pages' scales is not.
  temps = [_t("f32[32,8,16,4097]", 32 * 4097 * 8 * 16 * 4), _t("f32[8,16,4097]", 4097 * 8 * 16 * 4),
           _t("f32[1,16,128]", 16 * 128 * 4)]
  assert [t["shape"] for t in cache_sized(temps, layer, 1, pool=pool)] == ["f32[32,8,16,4097]", "f32[8,16,4097]"]
  # v5e-8's Llama-3 8B chip (one KV head): the whole K-scale pool re-laid out for the kernel, as XLA:TPU did with
  # the old [L, N, Hkv, block] layout (BENCHMARKS.md).
  one_head = (110658, 1, 16, 128)
  temps = [_t("f32[32,110658,1,16]", 32 * 110658 * 16 * 4)]
  assert [t["shape"] for t in cache_sized(temps, (16, 1, 4096, 128), 1, pool=one_head)] == ["f32[32,110658,1,16]"]
  # A bfloat16 pool has no scales: an [.., pages, heads, 16] float32 buffer is not taken for a copy of them.
  assert [t["shape"] for t in cache_sized(temps[1:3], layer, 2, pool=pool)] == []
