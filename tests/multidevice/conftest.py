"""These tests need 8 devices: tests/test_multidevice.py runs them in a subprocess with 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set before JAX starts)."""

import jax
import pytest

N_DEVICES = 8


def pytest_collection_modifyitems(config, items):
  if jax.device_count() >= N_DEVICES:
    return
  skip = pytest.mark.skip(reason=f"needs {N_DEVICES} devices: run through tests/test_multidevice.py")
  for item in items:  # this hook sees the whole session's items: mark only this folder's
    if item.path.parent.name == "multidevice":
      item.add_marker(skip)
