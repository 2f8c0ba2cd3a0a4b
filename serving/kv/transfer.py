"""KV handoff between engines: prefill/decode disaggregation (DistServe,
OSDI'24; Splitwise, ISCA'24).

A ``prefill`` engine (``EngineConfig.role``) runs a request's prompt under
its own policy, samples the first token and ends the request there with
finish reason "handoff"; before its pages go back to the free stack the
engine copies them into a ``KVHandoff``: the request, its first token, its
sampling parameters (seeded sampling continues exactly: a request's draw
for output index i is ``fold_in(PRNGKey(seed), i)``, ``serving.engine.sampling``),
the page count and the pages' bytes with their sha256. A ``decode`` engine
admits the record (``Engine.add_handoff``) as an arrival whose prompt is
already computed: its frontiers start at the prompt length with one token
emitted, which its policy reads like any other fact of the state, and when
its policy admits the request the pages are written into fresh pages of its
own cache (page ids remapped by its allocator; the reservation charges
them), where the prefix cache registers the full prompt pages after the
first decode step. A decode engine runs a prompt only to recompute after a
recompute preemption.

This module is the one definition of the record, its checks and its
checksum. How a record travels is the caller's: within one process it is a
Python object (its arrays on the host); across processes Ray's object store
carries it (``serving.http.ray_transfer``); the engine core imports no transport.

Shapes: ``k`` and ``v`` are ``[L, num_pages, page_size, kv_heads, head_dim]``
in the KV cache's dtype (bfloat16 caches on CPU are stored as their bits,
uint16), both None for an engine on the simulated executor, which holds no
KV bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Tuple

import numpy as np

from serving.engine.config import SamplingParams
from serving.kv import pages as kv_pages

class ChecksumMismatch(ValueError):
  """A handoff's page bytes (or its fields) do not match its checksum."""


def kv_bytes(model_cfg, config, tokens: int) -> int:
  """Bytes of the KV pages that hold ``tokens`` rows of one request on an
  engine with ``config`` (an ``EngineConfig``): whole pages, all layers, K
  and V, in the cache's dtype. The size a transfer moves."""
  itemsize = 2 if config.kv_cache_dtype == "bfloat16" else 4
  per_page = (2 * model_cfg.n_layers * config.page_size * model_cfg.n_kv_heads
              * model_cfg.head_dim * itemsize)     # ``models.llama.init_kv_cache``'s page
  return kv_pages.pages_for(int(tokens), config.page_size) * per_page


@dataclasses.dataclass(frozen=True)
class KVHandoff:
  """One request handed from a prefill engine to a decode engine.

  Attributes:
    request_id: the request's id (kept across engines).
    prompt_token_ids: the prompt (tuple of ints).
    first_token: the token the prefill engine sampled (output index 0).
    sampling: the request's ``SamplingParams`` (``max_tokens`` counts the
      first token).
    priority, client, slo_ttft_ms, slo_tpot_ms, cache_salt: as given to
      ``Engine.add_request`` (SLOs None for none).
    arrival_ms: the request's arrival on the prefill engine's clock (ms).
    first_token_ms: when the prefill engine emitted the first token (same
      clock).
    first_logprobs: the first token's ``TokenLogprobs`` when the request
      asked for logprobs, else None.
    tokens: KV rows the pages hold (= the prompt length).
    page_size: rows per page.
    num_pages: pages carried, ``ceil(tokens / page_size)``.
    nbytes: bytes of those pages on the sender (also when ``k`` is None).
    k, v: the pages, ``[L, num_pages, page_size, kv_heads, head_dim]``, or
      None (simulated executor).
    checksum: sha256 hex of the fields above and the bytes (``digest``).
  """

  request_id: str
  prompt_token_ids: Tuple[int, ...]
  first_token: int
  sampling: SamplingParams
  priority: int
  client: str
  slo_ttft_ms: Optional[float]
  slo_tpot_ms: Optional[float]
  cache_salt: str
  arrival_ms: float
  first_token_ms: float
  first_logprobs: object
  tokens: int
  page_size: int
  num_pages: int
  nbytes: int
  k: Optional[np.ndarray]
  v: Optional[np.ndarray]
  checksum: str = ""

  def digest(self) -> str:
    """sha256 hex over the request's fields, the first token, the page
    shape and the pages' bytes (what ``checksum`` must equal)."""
    h = hashlib.sha256()
    head = (self.request_id, tuple(int(t) for t in self.prompt_token_ids),
            int(self.first_token), dataclasses.astuple(self.sampling), int(self.tokens),
            int(self.page_size), int(self.num_pages))
    h.update(repr(head).encode())
    for a in (self.k, self.v):
      if a is not None:
        h.update(repr((a.shape, str(a.dtype))).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()

  def sealed(self) -> "KVHandoff":
    """This record with its checksum set."""
    return dataclasses.replace(self, checksum=self.digest())


def zero_handoff(request_id: str, prompt_token_ids, sampling: SamplingParams,
                 engine) -> KVHandoff:
  """A sealed record whose pages are zeros, in the layout ``engine`` (a
  decode ``Engine``) takes: what a launcher's warm-up hands a decode engine
  to compile its programs (the bits of its tokens mean nothing). First
  token 0."""
  c, kv = engine.config, engine.kv
  p = len(prompt_token_ids)
  n = kv_pages.pages_for(p, c.page_size)
  shape = (kv.k.shape[0], n) + tuple(kv.k.shape[2:])
  simulated = c.executor == "simulated"
  k = None if simulated else np.zeros(shape, kv.k.dtype)
  return KVHandoff(
      request_id=request_id, prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
      first_token=0, sampling=sampling, priority=0, client="default", slo_ttft_ms=None,
      slo_tpot_ms=None, cache_salt="", arrival_ms=0.0, first_token_ms=0.0,
      first_logprobs=None, tokens=p, page_size=c.page_size, num_pages=n,
      nbytes=0 if simulated else 2 * k.nbytes, k=k,
      v=None if simulated else np.zeros(shape, kv.v.dtype)).sealed()


def check(h: KVHandoff, *, page_size: int, kv_shape, kv_dtype, simulated: bool,
          max_model_len: int, vocab_size: int) -> None:
  """Refuses a record a decode engine cannot take.

  Args:
    page_size, max_model_len, vocab_size: the receiver's.
    kv_shape: the receiver's cache shape ``[L, num_pages, page_size,
      kv_heads, head_dim]``; kv_dtype: its dtype.
    simulated: the receiver runs the simulated executor (no bytes needed).

  Raises:
    ValueError: a field breaks a rule (named); ChecksumMismatch: the
      record's bytes or fields do not match its checksum.
  """
  name = f"handoff {h.request_id!r}"
  if not isinstance(h, KVHandoff):
    raise ValueError(f"handoff must be a serving.kv.transfer.KVHandoff, got {type(h)}")
  p = len(h.prompt_token_ids)
  if h.tokens != p or p < 1:
    raise ValueError(f"{name}: tokens must equal the prompt length {p} (>= 1), got {h.tokens}")
  if p + 1 >= max_model_len:
    raise ValueError(f"{name}: a prompt of {p} tokens and its first token leave no row for "
                     f"a decode step in the context (max_model_len={max_model_len})")
  if not 0 <= int(h.first_token) < vocab_size:
    raise ValueError(f"{name}: first_token must be in [0, {vocab_size}), got {h.first_token}")
  if h.page_size != page_size:
    raise ValueError(f"{name}: page_size {h.page_size} differs from the receiver's "
                     f"{page_size} (engines of one deployment share the page shape)")
  if h.num_pages != kv_pages.pages_for(p, page_size):
    raise ValueError(f"{name}: num_pages must be ceil({p} / {page_size}) = "
                     f"{kv_pages.pages_for(p, page_size)}, got {h.num_pages}")
  if h.k is None or h.v is None:
    if not simulated:
      raise ValueError(f"{name}: carries no KV bytes (from a simulated engine); a model "
                       f"engine needs them")
  elif not simulated:
    want = (kv_shape[0], h.num_pages) + tuple(kv_shape[2:])
    for label, a in (("k", h.k), ("v", h.v)):
      if tuple(a.shape) != want or a.dtype != kv_dtype:
        raise ValueError(f"{name}: {label} must be {want} {kv_dtype} (the receiver's cache "
                         f"layout), got {tuple(a.shape)} {a.dtype}")
  if h.checksum != h.digest():
    raise ChecksumMismatch(f"{name}: its pages or fields do not match its checksum; "
                           f"refusing to decode from them")


class Transport:
  """How a ``KVHandoff`` travels from a prefill engine to a decode engine:
  ``send`` on the prefill side returns a ticket, ``receive`` on the decode
  side turns the ticket back into the record (the decode engine's
  ``add_handoff`` checks it). Implementations: ``InProcess`` (two engines
  in one process), Ray's object store (``serving.http.ray_transfer``: the ticket is
  an ObjectRef, the bytes staged in host memory) and
  ``jax.experimental.transfer`` where the jaxlib provides it."""

  name = "abstract"

  def send(self, handoff: KVHandoff):
    raise NotImplementedError

  def receive(self, ticket) -> KVHandoff:
    raise NotImplementedError


class InProcess(Transport):
  """Two engines in one process: the ticket is the record, its pages put on
  the receiver's ``device`` (``jax.device_put``; None: left where they
  are, host memory)."""

  name = "in_process"

  def __init__(self, device=None):
    self.device = device

  def send(self, handoff: KVHandoff) -> KVHandoff:
    if self.device is None or handoff.k is None:
      return handoff
    import jax
    return dataclasses.replace(handoff, k=jax.device_put(handoff.k, self.device),
                               v=jax.device_put(handoff.v, self.device))

  def receive(self, ticket: KVHandoff) -> KVHandoff:
    return ticket

