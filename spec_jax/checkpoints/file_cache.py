"""Derived files cached next to their source (dequantized weights, tokenizer protos).

A cache entry records the source's fingerprint, so a changed source invalidates it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid

_SAMPLE = 1 << 20  # bytes hashed from each end of the file


def fingerprint(path: str) -> str:
  """Size, mtime and the hash of the first and last MiB: cheap, and it notices a replaced file."""
  st = os.stat(path)
  h = hashlib.sha256()
  h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
  with open(path, "rb") as f:
    h.update(f.read(_SAMPLE))
    if st.st_size > _SAMPLE:
      f.seek(max(st.st_size - _SAMPLE, _SAMPLE))
      h.update(f.read(_SAMPLE))
  return h.hexdigest()[:32]


def cache_path(source: str, suffix: str) -> str:
  """Where a derived file lives: beside the source if writable, else under ~/.cache/spec_jax."""
  d = os.path.dirname(os.path.abspath(source))
  name = os.path.basename(source) + suffix
  if os.access(d, os.W_OK):
    return os.path.join(d, name)
  alt = os.path.join(os.path.expanduser("~/.cache/spec_jax"), hashlib.sha1(d.encode()).hexdigest()[:12])
  os.makedirs(alt, exist_ok=True)
  return os.path.join(alt, name)


def unique_temp_path(path: str) -> str:
  """A name beside `path` that no other writer (process or thread) uses, so writers that race to build the same
  cache never write into one temporary file, and the last rename wins whole. Only a name: the writer creates the
  file, with the usual permissions (mkstemp's would be 0600)."""
  return f"{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def replace_from(tmp: str, path: str, write) -> None:
  """write(tmp), then rename tmp over path (atomic), so a reader sees the old file or the new one, never half;
  the temporary file is removed if writing fails."""
  try:
    write(tmp)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def atomic_write_bytes(path: str, data: bytes) -> None:
  def write(tmp):
    with open(tmp, "wb") as f:
      f.write(data)
  replace_from(unique_temp_path(path), path, write)
