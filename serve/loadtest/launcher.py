"""Start `python -m serve.server` for one arm on 127.0.0.1 at a free port, wait for /health, always stop it.

The arm's command line is the shared server flags plus its own --speculative_config, nothing else, so every arm
runs the same model, dtype, slot count and queue; the report prints the flags to show it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import httpx

from spec_jax.datasets import REPO_ROOT as REPO


def parse_port_range(text: str) -> Optional[tuple]:
  """"LO-HI" (inclusive) -> (lo, hi); "" -> None (any free port). ValueError naming the flag otherwise."""
  if not text:
    return None
  lo, sep, hi = str(text).partition("-")
  try:
    lo, hi = int(lo), int(hi)
  except ValueError:
    lo = hi = -1
  if not sep or not 1024 <= lo <= hi <= 65535:
    raise ValueError(f"--port_range must be LO-HI with 1024 <= LO <= HI <= 65535, got {text!r}")
  return lo, hi


def free_port(port_range: Optional[tuple] = None) -> int:
  """A port nothing listens on at 127.0.0.1: any (the OS picks), or the first free one in port_range (LO, HI)."""
  candidates = [0] if port_range is None else range(port_range[0], port_range[1] + 1)
  for port in candidates:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return s.getsockname()[1]
  raise RuntimeError(f"no free port in {port_range[0]}-{port_range[1]}")


def server_argv(flags: dict, speculative_config: Optional[dict], port: int) -> list[str]:
  argv = [sys.executable, "-m", "serve.server", "--host=127.0.0.1", f"--port={port}"]
  for k, v in flags.items():
    if isinstance(v, bool):
      v = str(v).lower()
    argv.append(f"--{k}={v}")
  # Always explicit: an empty flag would mean "the run config's method" (spec_jax/spec_config.py); {} is off.
  argv.append("--speculative_config=" + json.dumps(speculative_config or {}, sort_keys=True))
  return argv


class ServerProcess:
  """A context manager: the server runs between __enter__ (healthy) and __exit__ (stopped, killed if need be)."""

  def __init__(self, flags: dict, speculative_config: Optional[dict], log_path: str, startup_timeout: float = 600.0,
               stop_grace: float = 30.0, env: Optional[dict] = None, port_range: Optional[tuple] = None):
    self.port = free_port(port_range)
    self.url = f"http://127.0.0.1:{self.port}"
    self.argv = server_argv(flags, speculative_config, self.port)
    self.log_path, self.startup_timeout, self.stop_grace = log_path, startup_timeout, stop_grace
    self.env = dict(os.environ, **(env or {}))
    self.proc: Optional[subprocess.Popen] = None
    self.startup_s: Optional[float] = None

  @property
  def pid(self) -> Optional[int]:
    return self.proc.pid if self.proc else None

  def log_tail(self, n: int = 3000) -> str:
    try:
      with open(self.log_path, errors="replace") as f:
        return f.read()[-n:]
    except OSError:
      return ""

  def __enter__(self) -> "ServerProcess":
    os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
    log = open(self.log_path, "w")
    t0 = time.perf_counter()
    self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env)
    log.close()
    try:
      while True:
        if self.proc.poll() is not None:
          raise RuntimeError(f"the server exited with {self.proc.returncode} before it was healthy; log "
                             f"{self.log_path}:\n{self.log_tail()}")
        if time.perf_counter() - t0 > self.startup_timeout:
          raise RuntimeError(f"the server was not healthy within {self.startup_timeout:.0f} s; log {self.log_path}:"
                             f"\n{self.log_tail()}")
        try:
          if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
            break
        except httpx.HTTPError:
          pass
        time.sleep(0.25)
    except BaseException:
      self.stop()
      raise
    self.startup_s = time.perf_counter() - t0
    return self

  def stop(self) -> Optional[int]:
    """SIGTERM (the server drains and exits 0), then SIGKILL after the grace period."""
    if self.proc is None or self.proc.poll() is not None:
      return self.proc.returncode if self.proc else None
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(self.stop_grace)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      return self.proc.wait(10)

  def __exit__(self, *exc):
    self.stop()
    return False
