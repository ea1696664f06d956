"""Drive one load point: closed loop (N clients back to back) or open loop (Poisson arrivals), bounded in time.

Each point stops issuing requests when its request count or its time budget is spent, lets requests in flight
finish for `drain_s`, then cuts the rest (recorded as 'cut', not as errors). A sampler polls /metrics gauges and
the server's RSS while the point runs, so memory and slots in use are measured under that load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Optional

import httpx
import psutil

from serve.loadtest import metrics as M
from serve.loadtest.client import stream_request
from serve.loadtest.traffic import LoadPoint, Request


@dataclasses.dataclass
class PointResult:
  records: list
  wall_s: float  # first send -> last completion (or the cut)
  samples: list  # sampler rows: t, rss_bytes, running, waiting, slots_in_use, ...
  before: Optional[M.Scrape] = None
  after: Optional[M.Scrape] = None


def process_rss(pid: Optional[int]) -> Optional[int]:
  """RSS of the server process and its children (psutil), None if unknown or gone."""
  if not pid:
    return None
  try:
    p = psutil.Process(pid)
    rss = p.memory_info().rss
    for c in p.children(recursive=True):
      try:
        rss += c.memory_info().rss
      except psutil.Error:
        pass
    return rss
  except Exception:  # psutil.NoSuchProcess, AccessDenied, or psutil missing
    return None


async def _sampler(http: httpx.AsyncClient, url: str, pid: Optional[int], interval: float, out: list, t0: float):
  while True:
    row = {"t": time.perf_counter() - t0, "rss_bytes": process_rss(pid)}
    try:
      row.update(M.gauges(await M.ascrape(http, url)))
    except (httpx.HTTPError, ValueError):
      pass
    out.append(row)
    await asyncio.sleep(interval)


async def run_point(url: str, point: LoadPoint, requests: list[Request], *, model: str, max_requests: int,
                    max_seconds: float, drain_s: float, request_timeout: float, pid: Optional[int] = None,
                    sample_interval: float = 0.5, api_key: str = "", seed: int = 0, scrape: bool = True,
                    extra: Optional[dict] = None) -> PointResult:
  url = url.rstrip("/")
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  timeout = httpx.Timeout(request_timeout, connect=30.0)
  async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
    before = await M.ascrape(http, url) if scrape else None
    records, samples = [], []
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    todo = iter(requests[:max_requests])
    kw = dict(model=model, timeout=request_timeout, t0=t0, sink=records, api_key=api_key, extra=extra)
    sampler = asyncio.create_task(_sampler(http, url, pid, sample_interval, samples, t0))
    tasks: list[asyncio.Task] = []
    if point.mode == "closed":
      async def worker():
        for req in todo:
          if time.perf_counter() >= deadline:
            return
          await stream_request(http, url, req, **kw)
      tasks = [asyncio.create_task(worker()) for _ in range(int(point.level))]
    else:
      rng = random.Random(seed)
      t_next = t0
      for req in todo:
        t_next += rng.expovariate(point.level)
        if t_next >= deadline:
          break
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        tasks.append(asyncio.create_task(stream_request(http, url, req, **kw)))
    remaining = max(0.0, deadline - time.perf_counter()) + drain_s
    done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    for t in pending:
      t.cancel()
    if pending:
      await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
      if t.exception() is not None:
        raise t.exception()
    ends = [r["t_send"] + r["e2e"] for r in records if r.get("e2e") is not None]
    wall = max(ends) if ends else time.perf_counter() - t0
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await asyncio.sleep(0.2)  # let the server account the last requests before the closing scrape
    after = await M.ascrape(http, url) if scrape else None
  records.sort(key=lambda r: r["seq"])
  return PointResult(records=records, wall_s=wall, samples=samples, before=before, after=after)


async def warmup(url: str, requests: list[Request], *, model: str, concurrency: int, request_timeout: float,
                 api_key: str = "") -> list:
  """Send the warm-up requests at `concurrency`; returns their records (not measured)."""
  pt = LoadPoint("closed", float(concurrency), "warm-up", requests[0].sampling if requests else "", "")
  res = await run_point(url, pt, requests, model=model, max_requests=len(requests), max_seconds=request_timeout,
                        drain_s=0.0, request_timeout=request_timeout, api_key=api_key, scrape=False)
  return res.records
