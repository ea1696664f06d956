"""The test suite's compilation-cache pruning (tests/conftest.py): the oldest entries go first, down to half the
limit, and nothing goes while the folder is under the limit."""

import os

from tests.conftest import prune_compilation_cache


def _entries(d, sizes):
  for i, n in enumerate(sizes):
    p = d / f"entry{i}-cache"
    p.write_bytes(b"x" * n)
    os.utime(p, (1000 + i, 1000 + i))  # entry0 the oldest


def test_prune_removes_the_oldest_down_to_half_the_limit(tmp_path):
  _entries(tmp_path, [100] * 10)
  prune_compilation_cache(str(tmp_path), limit=500)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["entry8-cache", "entry9-cache"]  # 200 <= 500 / 2


def test_prune_keeps_everything_under_the_limit_and_a_missing_folder(tmp_path):
  _entries(tmp_path, [100] * 5)
  prune_compilation_cache(str(tmp_path), limit=500)
  assert len(list(tmp_path.iterdir())) == 5
  prune_compilation_cache(str(tmp_path / "absent"), limit=500)
