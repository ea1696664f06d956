"""Derived files cached next to their source (dequantized weights, tokenizer protos).

A cache entry records the source's fingerprint, so a changed source invalidates it.
"""

from __future__ import annotations

import hashlib
import os

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


def atomic_write_bytes(path: str, data: bytes) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)
