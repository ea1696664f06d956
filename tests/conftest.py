"""Shared fixtures: tiny random models of the Gemma 3 and Llama layouts, and the real Gemma 3 270M."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# JAX's persistent compilation cache, shared by the xdist workers and every subprocess the tests start (servers,
# the 8-device files, pod evaluation): compiling, not running, is most of this suite's time, and many programs
# recur across files and processes. Entries are keyed by the program, JAX's version and the XLA flags, so a stale
# one is never used; a new machine starts cold (BUILD.md gives both times). Set before JAX is imported: JAX reads
# these at import, and subprocesses inherit them. JAX_COMPILATION_CACHE_DIR= (empty) turns it off.
COMPILATION_CACHE_DIR = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                              os.path.expanduser("~/.cache/spec_jax/xla_tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
COMPILATION_CACHE_BYTES = 1 << 30  # a run that starts above this prunes to half, oldest first (one cold run: ~130 MB)

import sys  # noqa: E402
import tempfile  # noqa: E402

import filelock  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from spec_jax.config import ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# For subprocesses that run only tiny models: compiling, not running, is their cost, so LLVM's optimizations are
# off (the 8-device decode file: 266 -> 201 s, one run each, 2026-12-02).
TINY_MODEL_XLA_FLAGS = "--xla_backend_optimization_level=0"


def tiny_gemma_config(**kw) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=16, mlp_dim=64,
              sliding_window=8, global_every=2, query_pre_attn_scalar=16.0, max_seq_len=256, bos_id=2,
              eos_ids=(1,), pad_id=0, name="tiny-gemma")
  base.update(kw)
  return ModelConfig(**base)


def tiny_llama_config(**kw) -> ModelConfig:
  base = dict(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
              activation="silu", post_norms=False, qk_norm=False, qkv_bias=False, rope_base=10000.0,
              sliding_window=None, query_pre_attn_scalar=None, embed_scale=False, tie_embeddings=False,
              max_seq_len=256, bos_id=2, eos_ids=(1,), pad_id=0, name="tiny-llama")
  base.update(kw)
  return ModelConfig(**base)


def _outside_reads_guard():
  """An audit hook that refuses, and records, any read of a sibling of the repository (the old layout read a
  data folder beside the checkout, which a user's clone does not have). Only where the checkout's parent folder is its own: where
  it also holds the home folder, the temp folder or Python (a clone in / or in ~), a sibling read cannot be told
  from a system one, and `make test-standalone` (a copy in an empty folder) is the guard."""
  parent = os.path.dirname(ROOT)
  places = [os.path.expanduser("~"), tempfile.gettempdir(), sys.base_prefix, sys.prefix]
  if parent == os.path.dirname(parent) or any(
      os.path.abspath(p).startswith(parent + os.sep) and not os.path.abspath(p).startswith(ROOT + os.sep)
      for p in places):
    return []
  seen = []

  def hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir") or not args or args[0] is None or isinstance(args[0], int):
      return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path.startswith(parent + os.sep) and path != ROOT and not path.startswith(ROOT + os.sep):
      seen.append(path)
      raise PermissionError(f"the tests read outside the repository: {path}")

  sys.addaudithook(hook)
  return seen


OUTSIDE_READS = _outside_reads_guard()


@pytest.fixture(autouse=True)
def _no_reads_outside_the_repository():
  before = len(OUTSIDE_READS)
  yield
  if len(OUTSIDE_READS) > before:
    pytest.fail(f"read outside the repository: {OUTSIDE_READS[before:]}")


@pytest.fixture(scope="session")
def gemma3_gguf_path():
  from spec_jax.checkpoints.gguf_loader import default_model_path
  return default_model_path()


@pytest.fixture(scope="session")
def gemma3_f32(gemma3_gguf_path):
  from spec_jax.checkpoints.gguf_loader import load_gguf
  return load_gguf(gemma3_gguf_path, dtype=jnp.float32)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf_path):
  from spec_jax.checkpoints.load import load_tokenizer
  return load_tokenizer(gemma3_gguf_path)


def _memory_map_count() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: nothing to count
    return 0


@pytest.fixture(autouse=True)
def _free_compiled_programs():
  """Drop JAX's compiled programs once the process holds many memory maps.

  XLA:CPU JIT-compiles every kernel into its own few pages, and the maps stay until the executable is freed. The
  full suite compiles thousands of programs; at Linux's default vm.max_map_count (65530) the next compile
  segfaults. Clearing JAX's caches frees them (measured: 6542 maps -> 605)."""
  yield
  if _memory_map_count() > 20000:
    jax.clear_caches()
    import gc
    gc.collect()


def prune_compilation_cache(path: str, limit: int) -> None:
  """Above `limit` bytes, delete the oldest-written entries down to limit / 2. JAX's own eviction
  (jax_compilation_cache_max_size) rescans the whole folder under a lock on every write, which costs more than it
  saves at thousands of entries; once per run is enough here."""
  try:
    entries = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(path) if e.is_file())
  except FileNotFoundError:
    return
  total = sum(size for _, size, _ in entries)
  if total <= limit:
    return
  for _, size, p in entries:
    if total <= limit // 2:
      break
    try:
      os.remove(p)
    except FileNotFoundError:  # a concurrent run (the 8-device subprocess) pruned it first
      pass
    total -= size


def pytest_configure(config):
  if COMPILATION_CACHE_DIR and not hasattr(config, "workerinput"):  # the main process only, not each xdist worker
    prune_compilation_cache(COMPILATION_CACHE_DIR, COMPILATION_CACHE_BYTES)


# The files holding the suite's longest tests (whole loops compiled over 8 devices, the Qwen pair, many-proposer
# files, process pairs) go first, so that neither xdist worker is left running one of them alone at the end. The
# two files of many-device processes are apart, since those run one at a time (below).
LONGEST_FIRST = ("test_multidevice.py", "test_tree_decode.py", "proposers/test_medusa_eagle.py", "test_sampled_law.py",
                 "test_bfloat16_spec.py", "e2e/test_qwen25.py", "serve/test_loadtest_matrix.py",
                 "test_evaluate_pod.py", "test_slots.py", "test_quant.py")


def pytest_collection_modifyitems(config, items):
  rank = {os.path.join(ROOT, "tests", f): i for i, f in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: files stay whole, the rest in order


MANY_DEVICES_LOCK = os.path.join(tempfile.gettempdir(), "spec_jax_tests_many_devices.lock")


@pytest.fixture(autouse=True)
def _one_many_device_run_at_a_time(request):
  """Tests marked many_devices run processes that simulate 4-8 CPU devices; they take turns across the xdist
  workers, since 8 simulated devices per process are already 4 per core. (Two that overlapped once both aborted
  in a collective's rendezvous; the likelier cause was XLA:CPU's dispatch deadlock, see sharding.settle.)"""
  if request.node.get_closest_marker("many_devices") is None:
    yield
    return
  with filelock.FileLock(MANY_DEVICES_LOCK):
    yield
