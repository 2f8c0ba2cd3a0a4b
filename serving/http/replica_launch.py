"""Starting the replica servers a router front places on, and the front over
them (``serving.http.replicas.ReplicaFront``).

``run_front`` spawns ``serve.py`` replica processes on the ports after the
front's (``spawn_replica``: each one's stderr relayed with a ``[replica i]``
prefix, its last lines kept), waits until every one answers ``/health``
(``wait_ready``: a replica that exits first is reported at once, naming its
last stderr line, e.g. the flag it refused) and serves the front until
interrupted; the replicas stop with it. ``run_remote_front`` serves the front
over replica servers that already run (``--replica_urls``,
``parse_replica_urls``): nothing is spawned or stopped.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import subprocess
import sys
import threading
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


class ReplicaExited(RuntimeError):
  """A replica process exited before it was ready.

  Attributes:
    replica: its index; status: its exit status (negative: killed by that
    signal; 2: it refused its flags); last_line: its last stderr line ("" if
    none).
  """

  def __init__(self, replica: int, url: str, status: int, last_line: str):
    reason = last_line.removeprefix("error: ") if last_line else "no error output"
    super().__init__(f"replica {replica} ({url}) exited with status {status} before it "
                     f"was ready: {reason}")
    self.replica, self.status, self.last_line = replica, status, last_line


def _relay_stderr(process: subprocess.Popen, label: str) -> None:
  """Copies the replica's stderr to ours, each line prefixed by ``[label]``,
  and keeps its last lines in ``process.stderr_tail``."""
  for raw in process.stderr:          # drained to the end, or the replica would block
    line = raw.decode(errors="replace").rstrip("\n")
    process.stderr_tail.append(line)
    with contextlib.suppress(Exception):      # our stderr closed or replaced
      print(f"[{label}] {line}", file=sys.stderr, flush=True)


def spawn_replica(argv: Sequence[str], port: int, cwd: Optional[str] = None,
                  label: Optional[str] = None) -> subprocess.Popen:
  """Starts one replica server: ``argv`` plus ``--port=port`` (in ``cwd``).

  Its stderr goes to ours, each line prefixed by ``[label]`` (default
  ``replica :port``); the process keeps its last 20 stderr lines in
  ``stderr_tail`` (``wait_ready`` names the last one when it exits early).
  """
  process = subprocess.Popen([*argv, f"--port={port}"], cwd=cwd, stderr=subprocess.PIPE)
  process.stderr_tail = collections.deque(maxlen=20)
  process.stderr_relay = threading.Thread(
      target=_relay_stderr, args=(process, label or f"replica :{port}"), daemon=True)
  process.stderr_relay.start()
  return process


def _last_stderr_line(process: subprocess.Popen) -> str:
  relay = getattr(process, "stderr_relay", None)
  if relay is not None:
    relay.join(timeout=5)              # the pipe ends when the process has exited
  tail = [line for line in getattr(process, "stderr_tail", ()) if line.strip()]
  return tail[-1].strip() if tail else ""


def wait_ready(urls: Sequence[str], processes: Sequence[Optional[subprocess.Popen]],
               timeout_s: float = 600.0) -> List[dict]:
  """Waits until every replica answers ``/health``; returns each one's
  ``/engine`` facts. Every replica is checked each round, so one that exits
  is reported at once, not after the others are ready.

  Raises:
    ReplicaExited: a replica process exited first (names its last stderr
      line, e.g. the flag it refused).
    RuntimeError: not every replica was ready within timeout_s.
  """
  deadline = time.monotonic() + timeout_s
  facts: Dict[int, dict] = {}
  while True:
    for i, (url, process) in enumerate(zip(urls, processes)):
      if i in facts:
        continue
      if process is not None and process.poll() is not None:
        raise ReplicaExited(i, url, process.returncode, _last_stderr_line(process))
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

def run_front(replica_argv: Sequence[str], num_replicas: int, *, host: str, port: int,
              policy: str, cost: RouteCost, route_log: Optional[str], max_waiting: int,
              ready_timeout_s: float = 1800.0, sock: Optional[socket.socket] = None,
              access: Access = Access()) -> None:
  """Spawns ``num_replicas`` replica servers on ``port + 1 ...`` and serves the
  front on ``host:port`` (on ``sock`` when given: bound before anything
  loads, ``serving.http.server.bind_socket``) until interrupted (the replicas
  stop with it).

  Raises:
    ValueError: num_replicas < 1.
    ReplicaExited: a replica exited before it was ready (the others are
      stopped).
    RuntimeError: a replica was not ready within ready_timeout_s (all are
      stopped).
  """
  import logging

  logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request
  if num_replicas < 1:
    raise ValueError(f"--replicas must be >= 1 for a front, got {num_replicas}")
  ports = [port + 1 + i for i in range(num_replicas)]
  processes = [spawn_replica(replica_argv, p, label=f"replica {i}")
               for i, p in enumerate(ports)]
  urls = [f"http://127.0.0.1:{p}" for p in ports]
  try:
    facts = wait_ready(urls, processes, ready_timeout_s)
  except BaseException:
    for process in processes:
      if process.poll() is None:
        process.terminate()
    for process in processes:
      with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
    raise
  front = ReplicaFront(urls, processes, facts, policy=policy, cost=cost,
                       route_log=route_log, max_waiting=max_waiting, access=access)
  print(f"routing {front.model_name!r} over {num_replicas} replicas ({policy}) on "
        f"http://{host}:{port}/v1", flush=True)
  serve_forever(front.app, sock if sock is not None else bind_socket(host, port))


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
  facts = wait_ready(urls, [None] * len(urls), ready_timeout_s)
  front = ReplicaFront(urls, [None] * len(urls), facts, policy=policy, cost=cost,
                       route_log=route_log, max_waiting=max_waiting, shared_clock=False,
                       access=access)
  print(f"routing {front.model_name!r} over {len(urls)} replicas at {', '.join(urls)} "
        f"({policy}) on http://{host}:{port}/v1", flush=True)
  serve_forever(front.app, sock if sock is not None else bind_socket(host, port))
