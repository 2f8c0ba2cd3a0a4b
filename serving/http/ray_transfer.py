"""How a ``KVHandoff`` travels between engine actors: the two
``serving.kv.transfer.Transport``s across processes.

``ObjectStore`` (the default, the CPU path CI runs): the prefill actor
``ray.put``s the record (its pages in host memory) and the ticket is the
ObjectRef; the front hands the reference to the decode actor, which
``ray.get``s the record from the object store (Ray moves the bytes between
nodes; they never pass the front).

``JaxTransfer`` (``jax.experimental.transfer``, where the jaxlib has it):
each actor runs a transfer server; the prefill actor offers the pages
(``await_pull``) and the ticket is small (the server's address, a pull id
and the record without its pages); the decode actor pulls them onto its
device and turns them into the record again, which ``add_handoff`` checks
(checksum included). The engine's record holds the pages on the host, so
here they go host -> device -> peer device -> host; a device-resident
export would skip the host copies. A record offered but never pulled (its
request aborted in transfer) stays with the sender's server.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Dict, Optional

import numpy as np
import ray

from serving.kv import transfer

# Seconds a decode actor waits for a record's bytes.
RECEIVE_TIMEOUT_S = 60.0
TRANSPORTS = ("object_store", "jax_transfer")


class ObjectStore(transfer.Transport):
  """The record through Ray's object store (module docstring)."""

  name = "object_store"

  def send(self, handoff: transfer.KVHandoff):
    return ray.put(handoff)

  def receive(self, ticket) -> transfer.KVHandoff:
    return ray.get(ticket, timeout=RECEIVE_TIMEOUT_S)


def jax_transfer_unavailable() -> Optional[str]:
  """Why ``JaxTransfer`` cannot run with this jaxlib (None: it can)."""
  try:
    from jax.experimental import transfer as jax_transfer
  except ImportError as e:
    return f"jax.experimental.transfer does not import: {e}"
  if not hasattr(jax_transfer, "start_transfer_server"):
    return "jax.experimental.transfer has no start_transfer_server"
  return None


class JaxTransfer(transfer.Transport):
  """The pages device to device with ``jax.experimental.transfer``
  (module docstring); ``host``: the address peers reach this actor on."""

  name = "jax_transfer"

  def __init__(self, host: str = "127.0.0.1"):
    reason = jax_transfer_unavailable()
    if reason is not None:
      raise RuntimeError(f"--kv_transport=jax_transfer: {reason}")
    import jax
    from jax.experimental import transfer as jax_transfer

    self.device = jax.devices()[0]
    self.server = jax_transfer.start_transfer_server(self.device.client, f"{host}:0",
                                                     [f"{host}:0"])
    self._connections: Dict[str, object] = {}
    self._ids = itertools.count((os.getpid() & 0xFFFF) << 32)

  def send(self, handoff: transfer.KVHandoff):
    if handoff.k is None:                   # a simulated engine's record: no bytes
      return ("record", handoff)
    import jax

    uuid = next(self._ids)
    arrays = [jax.device_put(handoff.k, self.device), jax.device_put(handoff.v, self.device)]
    self.server.await_pull(uuid, arrays)
    specs = [(a.shape, str(a.dtype)) for a in (handoff.k, handoff.v)]
    return ("pull", self.server.address(), uuid, specs,
            dataclasses.replace(handoff, k=None, v=None))

  def receive(self, ticket) -> transfer.KVHandoff:
    if ticket[0] == "record":
      return ticket[1]
    import jax

    _, address, uuid, specs, bare = ticket
    connection = self._connections.get(address)
    if connection is None:
      connection = self._connections[address] = self.server.connect(address)
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    k, v = connection.pull(uuid, [jax.ShapeDtypeStruct(shape, np.dtype(dtype),
                                                       sharding=sharding)
                                  for shape, dtype in specs])
    return dataclasses.replace(bare, k=np.asarray(k), v=np.asarray(v))


def make_transport(name: str) -> transfer.Transport:
  """The transport named ``name`` (one of ``TRANSPORTS``).

  Raises:
    ValueError: an unknown name. RuntimeError: jax_transfer without
      ``jax.experimental.transfer``.
  """
  if name == "object_store":
    return ObjectStore()
  if name == "jax_transfer":
    return JaxTransfer()
  raise ValueError(f"--kv_transport must be one of {TRANSPORTS}, got {name!r}")
