"""Weight and config files of published checkpoints: `*.safetensors`, `pytorch_model.bin` read without torch (the
zip's pickle, with only tensors and dicts allowed), and config.json as a JSON object with a clear error."""

from __future__ import annotations

import collections
import glob
import json
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np

from spec_jax.checkpoints import safetensors_io


_TORCH_DTYPES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Storage:
  def __init__(self, dtype):
    self.dtype = dtype


def _rebuild_tensor(storage, offset, size, stride, *_):
  arr = storage
  if not size:
    return arr[offset:offset + 1].reshape(())
  item = arr.itemsize
  return np.lib.stride_tricks.as_strided(arr[offset:], shape=tuple(size), strides=tuple(s * item for s in stride)).copy()


def read_torch_bin(path: str) -> dict:
  """A `torch.save` zip file of a flat {name: tensor} dict -> {name: numpy array}, without torch. Anything in the
  pickle other than tensors, storages and dicts is refused (no code runs)."""
  try:
    zf = zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError) as e:
    raise ValueError(f"{path}: not a readable torch checkpoint (zip): {e}") from e
  with zf:
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
      raise ValueError(f"{path}: not a torch zip checkpoint (no single data.pkl among {names[:5]})")
    root = pkl[0][:-len("data.pkl")]

    class Unpickler(pickle.Unpickler):
      def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
          return _rebuild_tensor
        if module == "collections" and name == "OrderedDict":
          return collections.OrderedDict
        if module == "torch" and name in _TORCH_DTYPES:
          return _Storage(_TORCH_DTYPES[name])
        raise ValueError(f"{path}: the checkpoint's pickle names {module}.{name}, which a weights file does not "
                         "need; refused")

      def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
          raise ValueError(f"{path}: unexpected persistent id {pid!r}")
        _, kind, key, _, numel = pid
        try:
          raw = zf.read(f"{root}data/{key}")
        except (KeyError, zipfile.BadZipFile, OSError, EOFError) as e:
          raise ValueError(f"{path}: storage {key} is missing or truncated: {e}") from e
        dtype = np.dtype(kind.dtype)
        if len(raw) < numel * dtype.itemsize:
          raise ValueError(f"{path}: storage {key} holds {len(raw)} bytes, expected {numel * dtype.itemsize} "
                           "(truncated file?)")
        return np.frombuffer(raw, dtype, count=numel)

    try:
      with zf.open(pkl[0]) as f:
        obj = Unpickler(f).load()
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as e:
      raise ValueError(f"{path}: the checkpoint's pickle cannot be read (truncated file?): {e}") from e
  if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
    raise ValueError(f"{path}: expected a dict of tensors")
  return dict(obj)


def read_weights(directory: str, names: tuple = ()) -> tuple[dict, str]:
  """-> ({name: array}, the file(s) read): `names` if given, else model.safetensors / *.safetensors, else
  pytorch_model.bin."""
  candidates = [os.path.join(directory, n) for n in names] if names else (
      sorted(glob.glob(os.path.join(directory, "*.safetensors"))) or
      [os.path.join(directory, "pytorch_model.bin")])
  found = [p for p in candidates if os.path.isfile(p)]
  if not found:
    want = ", ".join(os.path.basename(p) for p in candidates) if names else "*.safetensors or pytorch_model.bin"
    raise FileNotFoundError(f"{directory}: no weights file ({want})")
  path = found[0]
  out = {}
  for p in (found if path.endswith(".safetensors") and not names else [path]):
    try:
      out.update(read_torch_bin(p) if not p.endswith(".safetensors") else safetensors_io.read(p))
    except ValueError:
      raise
    except Exception as e:  # the safetensors package's own errors (a truncated header or body)
      raise ValueError(f"{p}: cannot read the weights file (truncated or not safetensors?): {e}") from e
  return out, path


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      cfg = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(cfg, dict):
    raise ValueError(f"{path} is not a JSON object")
  return cfg
