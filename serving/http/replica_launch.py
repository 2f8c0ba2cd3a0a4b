"""Serving the router front (``serving.http.replicas.ReplicaFront``) over
replica servers that already run (``serve.py --replica_urls``):
``parse_replica_urls`` reads the flag, ``wait_ready`` waits until every
replica answers ``/health`` and ``run_remote_front`` serves the front until
interrupted. Nothing is spawned or stopped here: engines the front starts
itself are Ray actors (``serving.http.ray_engines``), which Ray starts,
watches, restarts and stops.
"""

from __future__ import annotations

import socket
import time
from typing import Dict, List, Optional, Sequence

import httpx

from serving.http.guard import Access
from serving.http.replicas import ReplicaFront
from serving.http.router import RouteCost
from serving.http.server import bind_socket, serve_forever


def parse_replica_urls(text: str) -> List[str]:
  """``--replica_urls``: comma-separated ``http://HOST:PORT`` base URLs.

  Returns:
    The URLs, a trailing '/' dropped, in the order given.

  Raises:
    ValueError: empty, an entry that is not http(s)://HOST:PORT (no path,
      query or credentials), or the same URL twice; the message names the
      flag and the entry.
  """
  entries = [e.strip() for e in text.split(",")] if text else []
  if not entries or not all(entries):
    raise ValueError(f"--replica_urls must be comma-separated http://HOST:PORT URLs, "
                     f"got {text!r}")
  urls = []
  for entry in entries:
    try:
      url = httpx.URL(entry) if "://" in entry else None
    except httpx.InvalidURL:
      url = None
    if (url is None or url.scheme not in ("http", "https") or not url.host
        or url.port is None or url.path not in ("", "/") or url.query or url.userinfo):
      raise ValueError(f"--replica_urls: {entry!r} must be http://HOST:PORT (a replica "
                       f"server's root: scheme, host and port, no path)")
    urls.append(entry.rstrip("/"))
  if len(set(urls)) != len(urls):
    raise ValueError(f"--replica_urls names a replica twice: {urls}")
  return urls


def wait_ready(urls: Sequence[str], timeout_s: float = 600.0) -> List[dict]:
  """Waits until every replica answers ``/health``; returns each one's
  ``/engine`` facts.

  Raises:
    RuntimeError: not every replica was ready within timeout_s (names them).
  """
  deadline = time.monotonic() + timeout_s
  facts: Dict[int, dict] = {}
  while True:
    for i, url in enumerate(urls):
      if i in facts:
        continue
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          facts[i] = httpx.get(f"{url}/engine", timeout=10).json()
      except httpx.HTTPError:
        pass
    if len(facts) == len(urls):
      return [facts[i] for i in range(len(urls))]
    if time.monotonic() > deadline:
      late = [urls[i] for i in range(len(urls)) if i not in facts]
      raise RuntimeError(f"replicas {late} not ready within {timeout_s} s")
    time.sleep(0.2)


def run_remote_front(urls: Sequence[str], *, host: str, port: int, policy: str,
                     cost: RouteCost, route_log: Optional[str], max_waiting: int,
                     ready_timeout_s: float = 60.0,
                     sock: Optional[socket.socket] = None, access: Access = Access()) -> None:
  """Serves the front on ``host:port`` over replica servers that already run
  (``serve.py --replica_urls``): nothing is spawned or stopped; each
  replica's facts come from its ``/engine`` once it answers ``/health``;
  they are health-checked and rejoin when they come back (module docstring).

  Raises:
    RuntimeError: a replica did not answer within ready_timeout_s (names it).
    ValueError: the replicas serve different models or page sizes.
  """
  import logging

  logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request
  facts = wait_ready(urls, ready_timeout_s)
  front = ReplicaFront(urls, facts, policy=policy, cost=cost,
                       route_log=route_log, max_waiting=max_waiting, shared_clock=False,
                       access=access)
  print(f"routing {front.model_name!r} over {len(urls)} replicas at {', '.join(urls)} "
        f"({policy}) on http://{host}:{port}/v1", flush=True)
  serve_forever(front.app, sock if sock is not None else bind_socket(host, port))
