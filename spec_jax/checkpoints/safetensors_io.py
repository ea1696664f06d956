"""Safetensors files through the `safetensors` package: the one reader and writer of them here.

numpy arrays in and out. bfloat16 is ml_dtypes' type, which the package's numpy API reads and writes once
ml_dtypes has registered it with numpy (imported here for that).
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so BF16 tensors read as ml_dtypes.bfloat16)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from spec_jax.checkpoints import file_cache


class SafetensorsFile:
  """One file, its header checked by the package on opening; tensors are read on demand."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._handle = safe_open(path, framework="numpy")
      self.names = tuple(self._handle.keys())
    except SafetensorError as e:
      raise ValueError(f"{path} is not a readable safetensors file: {e}") from e

  def read(self, name: str) -> np.ndarray:
    try:
      return self._handle.get_tensor(name)
    except (SafetensorError, TypeError) as e:  # TypeError: a dtype numpy does not know
      raise ValueError(f"{self.path}: cannot read tensor {name!r}: {e}") from e


def read(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a file, by name."""
  f = SafetensorsFile(path)
  return {name: f.read(name) for name in f.names}


def write(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
  """Writes atomically (a temporary file, then a rename), so a reader never sees half a file."""
  # The package writes raw buffers: a transposed (non C-contiguous) array would be saved scrambled.
  arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
  file_cache.replace_from(file_cache.unique_temp_path(path), path,
                          lambda tmp: save_file(arrays, tmp, metadata=metadata))
