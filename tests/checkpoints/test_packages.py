"""Packaged GGUFs joined from chunk packages: order, size and hash checks, the no-op second call, and the errors for a
missing package, a truncated part and a damaged joined file. Uses small synthetic chunk packages on sys.path; the
real Qwen packages are assembled by tests/e2e/test_qwen25.py."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from spec_jax.checkpoints import packages
from spec_jax.checkpoints.load import resolve_model_path

PART = 1000


def _make_packages(root, prefix, chunks):
  for i, data in enumerate(chunks, 1):
    pkg = root / f"{prefix}{i}"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "part01.bin").write_bytes(data)
    (pkg / "__init__.py").write_text(
        "import os\n\ndef get_part_path():\n"
        "  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part01.bin')\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
  prefix = f"fake_chunk_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**6}_part"
  chunks = [bytes([i]) * PART for i in range(1, 3)] + [b"tail" * 10]
  _make_packages(tmp_path / "site", prefix, chunks)
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  whole = b"".join(chunks)
  model = packages.PackagedModel("fake-model", "fake.gguf", prefix, 3, PART, len(whole),
                                 hashlib.sha256(whole).hexdigest(), install_hint="pip install fake")
  monkeypatch.setattr(packages, "CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setitem(packages.PACKAGED, model.name, model)
  yield model, whole, tmp_path / "site"
  for name in [m for m in sys.modules if m.startswith(prefix)]:
    del sys.modules[name]


def test_joins_parts_in_order_and_is_a_no_op_after(fake):
  model, whole, _ = fake
  path = packages.assemble(model.name)
  assert open(path, "rb").read() == whole
  mtime = os.stat(path).st_mtime_ns
  assert resolve_model_path(model.name) == path  # the name works wherever a checkpoint path does
  assert os.stat(path).st_mtime_ns == mtime  # not rewritten


def test_missing_package_names_the_install_command(fake):
  model, _, site = fake
  (site / f"{model.module_prefix}2" / "__init__.py").unlink()
  (site / f"{model.module_prefix}2" / "data" / "part01.bin").unlink()
  (site / f"{model.module_prefix}2" / "data").rmdir()
  (site / f"{model.module_prefix}2").rmdir()
  with pytest.raises(FileNotFoundError, match=r"1 of its 3 chunk packages are not installed.*pip install fake"):
    packages.assemble(model.name)


def test_truncated_part_is_refused(fake):
  model, _, site = fake
  with open(site / f"{model.module_prefix}2" / "data" / "part01.bin", "r+b") as f:
    f.truncate(PART - 7)
  with pytest.raises(ValueError, match=r"part 2 .* has 993 bytes, expected 1000.*reinstall"):
    packages.assemble(model.name)
  assert not os.path.exists(model.path)


def test_same_size_wrong_bytes_fail_the_hash(fake):
  model, _, site = fake
  with open(site / f"{model.module_prefix}1" / "data" / "part01.bin", "r+b") as f:
    f.write(b"\xff")
  with pytest.raises(ValueError, match="sha256"):
    packages.assemble(model.name)
  assert os.listdir(packages.CACHE_DIR) == []  # neither the file nor its temporary is left behind


def test_damaged_joined_file_is_rebuilt(fake):
  model, whole, _ = fake
  path = packages.assemble(model.name)
  with open(path, "r+b") as f:
    f.write(b"\x00\x00")
  assert open(packages.assemble(model.name), "rb").read() == whole


def test_unknown_names_are_clear():
  with pytest.raises(ValueError, match="unknown packaged model"):
    packages.assemble("no-such-model")
  with pytest.raises(FileNotFoundError, match="neither a checkpoint file or directory nor a packaged model"):
    resolve_model_path("qwen2.5-coder-7b-instruct")


def test_pins_match_the_versions_pyproject_installs():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  text = open(os.path.join(root, "pyproject.toml")).read()
  for m in packages.PACKAGED.values():
    dist = m.module_prefix.replace("_", "-")
    for i in range(1, m.num_parts + 1):
      assert f'"{dist}{i}==' in text, f"{dist}{i} is not pinned in the qwen extra"
    assert f'"{dist}{m.num_parts + 1}==' not in text
    assert m.part_size * (m.num_parts - 1) < m.size <= m.part_size * m.num_parts
