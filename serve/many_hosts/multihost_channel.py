"""The multi-host server's channel (serve/many_hosts/multihost.py): a TCP connection from each follower to process 0 (its port
published in jax.distributed's key-value store), length-prefixed pickles of (name, numpy arguments) from process 0,
heartbeats both ways, and the watchdog threads that stop a process whose peer died or went silent (os._exit with
one clear line: its engine may be stuck in a collective with the dead host)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time
from typing import Optional

import jax
from jax._src import distributed

log = logging.getLogger("spec_jax.multihost")
BEAT_S = 1.0  # heartbeat period on the channel, both ways
KEY = "spec_jax/serve/"


def kv():
  return distributed.global_state.client


def _send(sock: socket.socket, payload: bytes) -> None:
  sock.sendall(struct.pack("!Q", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray()
  while len(buf) < n:
    chunk = sock.recv(min(n - len(buf), 1 << 20))
    if not chunk:
      raise ConnectionError("connection closed")
    buf += chunk
  return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
  (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
  return _recv_exact(sock, n)


_LEADERS: list = []  # this process's Leader, once connected: fatal() tells its followers why first


def fatal(message: str) -> None:
  """Stop this process now with one clear line: a collective with a dead peer would never return, and
  jax.distributed's exit barrier would wait for it. On the leader, the live followers get the reason and exit
  with it before this process (and with it the coordination service) goes, so their last line is always ours."""
  me = jax.process_index()
  log.error("%s", message)
  print(f"error: process {me}: {message}", file=sys.stderr, flush=True)
  for leader in _LEADERS:
    leader.abort(message)
  logging.shutdown()
  os._exit(1)


class Leader:
  """Process 0's end: one connection per follower, calls out, heartbeats both ways."""

  role = "leader"

  def __init__(self, n: int, timeout_s: int, beat_timeout_s: float):
    self.n, self.beat_timeout = n, beat_timeout_s
    self._lock = threading.RLock()  # re-entrant: send() failing on a dead follower calls fatal(), then abort()
    self._last_sent = time.monotonic()
    self.stopping = threading.Event()
    self.sent = {"messages": 0, "calls": 0, "bytes": 0, "seconds": 0.0}  # the channel's cost (benchmarks/probes/multihost.py)
    srv = socket.create_server(("", 0), backlog=n)
    host = (_kv_coordinator_host() or socket.gethostname())
    kv().key_value_set(f"{KEY}channel", f"{host}:{srv.getsockname()[1]}")
    srv.settimeout(timeout_s)
    self.peers: dict[int, socket.socket] = {}
    try:
      while len(self.peers) < n - 1:
        conn, _ = srv.accept()
        conn.settimeout(timeout_s)
        pid = json.loads(_recv(conn))["process"]
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peers[pid] = conn
    except socket.timeout:
      raise ValueError(f"followers {sorted(set(range(1, n)) - set(self.peers))} did not connect to the leader's "
                       f"channel within {timeout_s} s") from None
    finally:
      srv.close()
    self._closed = set()
    for pid, conn in self.peers.items():
      conn.settimeout(beat_timeout_s)
      threading.Thread(target=self._watch, args=(pid, conn), name=f"multihost-watch-{pid}", daemon=True).start()
    threading.Thread(target=self._beat, name="multihost-beat", daemon=True).start()
    _LEADERS.append(self)

  def abort(self, why: str, wait_s: float = 3.0) -> None:
    """Tell every live follower that the leader stops and why, then wait (bounded) until they closed. Best
    effort: a send stuck on a dead follower's full socket holds the lock, and then the followers learn it from the
    channel closing instead."""
    self.stopping.set()  # the followers closing is expected now: no second fatal() from _watch
    if not self._lock.acquire(timeout=1.0):
      return
    try:
      payload = pickle.dumps(("abort", why), protocol=5)
      for conn in self.peers.values():
        try:
          conn.settimeout(1.0)
          _send(conn, payload)
        except OSError:
          pass  # that follower is the dead one
    finally:
      self._lock.release()
    end = time.monotonic() + wait_s
    while len(self._closed) < len(self.peers) and time.monotonic() < end:
      time.sleep(0.02)

  def send(self, msg: tuple) -> None:
    t0 = time.perf_counter()
    payload = pickle.dumps(msg, protocol=5)
    with self._lock:
      for pid, conn in self.peers.items():
        try:
          _send(conn, payload)
        except OSError as e:
          fatal(f"follower process {pid} is gone ({type(e).__name__}: {e}); stopping the server")
      self._last_sent = time.monotonic()
      s = self.sent
      s["messages"] += 1
      s["calls"] += msg[0] == "call"
      s["bytes"] += len(payload)
      s["seconds"] += time.perf_counter() - t0

  def _beat(self) -> None:
    while not self.stopping.is_set():
      time.sleep(BEAT_S / 2)
      if time.monotonic() - self._last_sent >= BEAT_S:
        self.send(("beat",))

  def _watch(self, pid: int, conn: socket.socket) -> None:
    """A follower's heartbeats; its connection closing or going silent stops the server."""
    try:
      while True:
        _recv(conn)
    except socket.timeout:
      why = f"sent no heartbeat for {self.beat_timeout:g} s (--heartbeat_timeout)"
    except (OSError, ConnectionError) as e:
      why = f"closed its connection ({e})"
    self._closed.add(pid)
    if self.stopping.is_set():
      return
    fatal(f"follower process {pid} {why}: it died or hangs; stopping the server (process 0) so that no host "
          f"waits in a collective forever")

  def stop(self, wait_s: float = 30.0) -> None:
    """A normal stop: the followers exit after the calls sent so far; wait (bounded) until they closed."""
    self.stopping.set()
    self.send(("stop",))
    end = time.monotonic() + wait_s
    while len(self._closed) < len(self.peers) and time.monotonic() < end:
      time.sleep(0.05)
    s = self.sent
    log.info("channel: %d messages (%d calls), %.2f MiB, %.3f s sending", s["messages"], s["calls"],
             s["bytes"] / 2**20, s["seconds"])


def _kv_coordinator_host() -> Optional[str]:
  addr = distributed.global_state.coordinator_address  # process 0 runs the coordinator service
  return addr.rsplit(":", 1)[0].strip("[]") if addr else None


class Follower:
  """A follower's end: a reader thread (the watchdog) fills a queue that `follow` runs."""

  role = "follower"

  def __init__(self, me: int, timeout_s: int, beat_timeout_s: float):
    self.me, self.beat_timeout = me, beat_timeout_s
    addr = kv().blocking_key_value_get(f"{KEY}channel", timeout_s * 1000)
    host, port = addr.rsplit(":", 1)
    try:
      self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as e:
      raise ValueError(f"process {me} could not connect to the leader's channel at {addr}: {e}") from None
    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send(self.sock, json.dumps({"process": me}).encode())
    self.sock.settimeout(beat_timeout_s)
    self.calls: queue.Queue = queue.Queue()
    self._lock = threading.Lock()
    threading.Thread(target=self._read, name="multihost-read", daemon=True).start()
    threading.Thread(target=self._beat, name="multihost-beat", daemon=True).start()

  def _read(self) -> None:
    try:
      while True:
        msg = pickle.loads(_recv(self.sock))
        if msg[0] == "abort":
          fatal(f"the leader (process 0) stopped: {msg[1]}")
        if msg[0] != "beat":
          self.calls.put(msg)
        if msg[0] == "stop":
          return
    except socket.timeout:
      why = f"sent nothing for {self.beat_timeout:g} s (--heartbeat_timeout)"
    except (OSError, ConnectionError) as e:
      why = f"closed the channel ({e})"
    except Exception as e:  # not a message of this code: a different version on this host?
      why = f"sent a message this process cannot read ({type(e).__name__}: {e})"
    fatal(f"the leader (process 0) {why}: it died or hangs; stopping this follower")

  def _beat(self) -> None:
    while True:
      time.sleep(BEAT_S)
      try:
        with self._lock:
          _send(self.sock, b"b")
      except OSError:
        return  # the reader names the failure

  def stop(self, wait_s: float = 0.0) -> None:
    self.sock.close()
