"""Serves a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  python scripts/serve.py                          # SmolLM2 on 127.0.0.1:8000
  python scripts/serve.py --port=8001 --max_waiting=128 --engine=cpu_small
  python scripts/serve.py --engine=cpu_small --replicas=2 --router=prefix_aware
      # 2 engines, each a Ray actor (a local Ray; --ray_address=HOST:PORT joins one)
  python scripts/serve.py --engine=cpu_small --prefill_replicas=1 --decode_replicas=1
      # prefill/decode: KV pages handed from one engine actor to the other
  python scripts/serve.py --replica_urls=http://10.0.0.2:8000,http://10.0.0.3:8000
      # a router front over servers already running elsewhere
  python scripts/serve.py --host=0.0.0.0 --allowed_hosts=llm.example.org \
      --api_key_file=keys.txt     # KEY:TENANT lines; see docs/running-safely.md

Endpoints: /v1/completions, /v1/chat/completions (stream true/false),
/v1/models, /v1/models/{id}, /health, /metrics. See serving/http/server.py; with
--replicas=N (or --prefill_replicas=P --decode_replicas=D) each engine is a
Ray actor that Ray starts, restarts and stops (serving/http/ray_engines.py),
and this process is the OpenAI front over them (serving/http/ray_front.py,
placing with serving/http/router.py; GET /router has each request's route
record); with --replica_urls it fronts running servers over HTTP instead
(serving/http/replicas.py; no model loads here; they are health-checked and
rejoin when they come back). Flags are
checked, and the port bound, before any model loads: a bad one is one line,
exit status 2. The engine's death exits with status 1 (after failing every
request in flight), so a supervisor restarts the server.
"""

import errno
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch
from serving.http import guard
from serving.http import replica_launch
from serving.http import router
from serving.http.server import OpenAIServer, bind_socket

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "Model name in the API (default: --model).")
flags.DEFINE_integer("max_waiting", 64, "Requests that may wait for an engine slot; "
                     "past that a request gets HTTP 429.")
flags.DEFINE_bool("warmup", True, "Compile every token bucket, for every slot-table size "
                  "the live bound (engine slots + --max_waiting) can grow the engine to, "
                  "before listening.")
flags.DEFINE_bool("trust_front_headers", False, "Honour the x-iterserve-arrival-s header "
                  "(for servers behind a --replica_urls front on the same host; never for a "
                  "server that clients reach directly).")
flags.DEFINE_integer("replicas", 0, "Engine replicas, each a Ray actor, behind a router "
                     "front on --port (0: one engine, this process).")
flags.DEFINE_integer("prefill_replicas", 0, "Prefill engines (Ray actors); with "
                     "--decode_replicas: prefill/decode disaggregation.")
flags.DEFINE_integer("decode_replicas", 0, "Decode engines (Ray actors); with "
                     "--prefill_replicas.")
flags.DEFINE_string("ray_address", None, "Join the Ray cluster at this address (e.g. "
                    "HOST:6379, or 'auto'); unset: a local Ray with this machine's CPUs.")
flags.DEFINE_float("replica_cpus", 1.0, "CPUs Ray reserves for each engine actor.")
flags.DEFINE_enum("kv_transport", "object_store", ["object_store", "jax_transfer"],
                  "How a prefill engine's KV pages reach a decode engine: Ray's object "
                  "store (host memory), or jax.experimental.transfer (device to device).")
flags.DEFINE_integer("replica_max_restarts", 3, "Times Ray restarts an engine actor that "
                     "died (-1: always).")
flags.DEFINE_list("replica_urls", None, "A router front over replica servers that already "
                  "run (http://HOST:PORT,...): nothing is spawned, no model loads here.")
flags.DEFINE_float("replica_ready_timeout_s", 60.0, "With --replica_urls: seconds to wait "
                   "at startup for every replica to answer /health.")
flags.DEFINE_string("router", "prefix_aware", "Replica placement: prefix_aware (estimated "
                    "finish time with prefix-cache facts) or the round_robin baseline; with "
                    "--prefill_replicas/--decode_replicas, a registered P/D router.")
flags.DEFINE_string("route_log", None, "With --replicas: a JSON line per request (its "
                    "placement decisions and the facts they used).")
# The router's cost model: --route_FIELD sets router.RouteCost.FIELD (its
# default the field's).
_ROUTE_COST_HELP = {
    "prefill_ms_per_token": "Router cost: ms per uncached prompt token.",
    "decode_ms_per_token_per_seq": "Router cost: ms one more live sequence adds to each "
                                   "decode step.",
    "aging": "Router: ms of estimated finish time forgiven per ms a request waits.",
}
for _field, _help in _ROUTE_COST_HELP.items():
  flags.DEFINE_float(f"route_{_field}", getattr(router.RouteCost, _field), _help)
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on every /v1 "
                    "route, /tokenize, /detokenize, /tokenizer_info and /router (/health, "
                    "/metrics and /engine stay open): comma-separated KEY or KEY:TENANT "
                    "entries; a key's TENANT is its requests' fairness identity and "
                    "prefix-cache salt. Unset: the ITERSERVE_API_KEY variable, if set.")
flags.DEFINE_string("api_key_file", None, "--api_key's entries from a file, one a line.")
flags.DEFINE_list("allowed_hosts", None, "Host header names answered ('*': any). Unset: "
                  "the loopback names when --host is a loopback address, else any.")
flags.DEFINE_integer("max_body_bytes", guard.DEFAULT_MAX_BODY_BYTES, "Largest request "
                     "body; past it HTTP 413.")
flags.DEFINE_integer("max_prompt_chars", None, "Longest prompt string (or chat messages' "
                     "text) taken to the tokenizer; past it HTTP 400. Unset: 32 per context "
                     "token.")
launch.define_engine_flags()
_ENGINE_FLAGS = tuple(f.name for f in FLAGS.get_flags_for_module(launch))
# Flags of the front only: a replica gets every other flag given.


def _access() -> guard.Access:
  """The ``guard.Access`` from --api_key (or --api_key_file, or the
  ITERSERVE_API_KEY variable), --allowed_hosts and --max_body_bytes.

  Raises:
    ValueError: both --api_key and --api_key_file, an unreadable file, a
      malformed entry, or --max_body_bytes < 1.
  """
  if FLAGS.api_key is not None and FLAGS.api_key_file is not None:
    raise ValueError("--api_key and --api_key_file exclude each other")
  keys = {}
  if FLAGS.api_key_file is not None:
    try:
      with open(FLAGS.api_key_file) as f:
        keys = guard.parse_api_keys(f.read(), "--api_key_file")
    except OSError as e:
      raise ValueError(f"--api_key_file={FLAGS.api_key_file}: {e.strerror or e}") from None
  elif FLAGS.api_key is not None:
    keys = guard.parse_api_keys(FLAGS.api_key)
  elif os.environ.get("ITERSERVE_API_KEY"):
    keys = guard.parse_api_keys(os.environ["ITERSERVE_API_KEY"], "ITERSERVE_API_KEY")
  if FLAGS.max_body_bytes < 1:
    raise ValueError(f"--max_body_bytes must be >= 1, got {FLAGS.max_body_bytes}")
  if FLAGS.max_prompt_chars is not None and FLAGS.max_prompt_chars < 1:
    raise ValueError(f"--max_prompt_chars must be >= 1, got {FLAGS.max_prompt_chars}")
  if FLAGS.allowed_hosts is not None and not all(FLAGS.allowed_hosts):
    raise ValueError("--allowed_hosts must be non-empty names (or '*')")
  return guard.access_from(keys, FLAGS.host, FLAGS.allowed_hosts, FLAGS.max_body_bytes)


def _pd() -> bool:
  return bool(FLAGS.prefill_replicas or FLAGS.decode_replicas
              or FLAGS["prefill_replicas"].present or FLAGS["decode_replicas"].present)


def _check_pd_flags() -> None:
  """The engine-actor flags: P/D needs both pools (>= 1 each) and excludes
  --replicas; each role's engine config is built (no model loads) so that
  a setting a role refuses is one line now.

  Raises:
    ValueError: naming the flag.
  """
  if not FLAGS.replica_cpus >= 0:
    raise ValueError(f"--replica_cpus must be >= 0, got {FLAGS.replica_cpus}")
  if FLAGS.replica_max_restarts < -1:
    raise ValueError(f"--replica_max_restarts must be >= -1 (-1: always), got "
                     f"{FLAGS.replica_max_restarts}")
  if FLAGS.ray_address is not None and not (FLAGS.replicas or _pd()):
    raise ValueError("--ray_address applies only with --replicas or --prefill_replicas / "
                     "--decode_replicas (engine actors)")
  if FLAGS["kv_transport"].present and not _pd():
    raise ValueError("--kv_transport applies only with --prefill_replicas / "
                     "--decode_replicas")
  if not _pd():
    if FLAGS.replicas:
      launch.engine_config()
    return
  if FLAGS.replicas:
    raise ValueError("--prefill_replicas/--decode_replicas and --replicas exclude each "
                     "other (prefill/decode pools, or mixed replicas)")
  for name in ("prefill_replicas", "decode_replicas"):
    if FLAGS[name].value < 1:
      raise ValueError(f"--{name} must be >= 1 with prefill/decode serving (both pools), "
                       f"got {FLAGS[name].value}")
  if FLAGS.kv_transport == "jax_transfer":
    from serving.http import ray_transfer
    reason = ray_transfer.jax_transfer_unavailable()
    if reason is not None:
      raise ValueError(f"--kv_transport=jax_transfer: {reason}")
  for role in ("prefill", "decode"):
    try:
      launch.engine_config(role=role)
    except (ValueError, TypeError) as e:
      named = cli.flag_named(str(e))
      if named != str(e) or named.startswith("--"):   # a flag's rule, said of the flag
        raise ValueError(f"{named} (for the {role} engines of --{role}_replicas)") from None
      raise ValueError(f"--policy={FLAGS.policy}: cannot run on a {role} engine: {e}"
                       if FLAGS.policy else f"a {role} engine: {e}") from None


def _front_tokenizer():
  """The model's tokenizer, read without its weights (the engine actors
  load those).

  Raises:
    ValueError: naming --model, a model that cannot be found or read.
  """
  if FLAGS.model.startswith(launch.RANDOM_PREFIX):
    return launch.random_model(FLAGS.model, weights=False)[2]
  launch.check_model_spec("--model", FLAGS.model, simulated=FLAGS.executor == "simulated",
                          needs_tokenizer=True)
  from models.loaders import load_config
  return load_config(FLAGS.model)[1]


def _check_flags() -> socket.socket:
  """The flags serve.py checks itself, before any model loads. Returns the
  socket bound to --host:--port (served on once the model is ready, so
  that nothing else can take the port meanwhile).

  Raises:
    ValueError: --port outside [1, 65535] (with --replicas, the replicas'
      ports --port+1..--port+N too), --max_waiting < 0, --replicas < 0, an
      empty --served_model_name, --route_log without --replicas or in a
      directory that does not exist, or --host:--port (or a replica port on
      127.0.0.1) cannot be bound: in use, or not an address of this machine.
  """
  if FLAGS.replicas < 0:
    raise ValueError(f"--replicas must be >= 0 (0: one engine in this process), "
                     f"got {FLAGS.replicas}")
  router.check_router_name(FLAGS.router, pd=_pd(), flag="router")
  _check_pd_flags()
  if FLAGS.replica_urls is not None:
    if FLAGS.replicas or _pd():
      raise ValueError("--replica_urls and --replicas (or --prefill_replicas) exclude each "
                       "other (front running servers, or start engine actors here)")
    replica_launch.parse_replica_urls(",".join(FLAGS.replica_urls))
    engine = [name for name in _ENGINE_FLAGS if FLAGS[name].present]
    if engine:
      raise ValueError(f"--replica_urls: the engine flags {engine} belong to the replica "
                       f"servers, which already run; give them there")
    if not FLAGS.replica_ready_timeout_s > 0:
      raise ValueError(f"--replica_ready_timeout_s must be > 0, got "
                       f"{FLAGS.replica_ready_timeout_s}")
  if FLAGS.served_model_name is not None and not FLAGS.served_model_name:
    raise ValueError("--served_model_name must be non-empty (unset: the --model name)")
  if FLAGS.route_log is not None:
    if not (FLAGS.replicas or _pd()) and FLAGS.replica_urls is None:
      raise ValueError("--route_log applies only with --replicas >= 1, --prefill_replicas "
                       "or --replica_urls (it logs the router front's placements)")
    if not FLAGS.route_log:
      raise ValueError("--route_log must be a file path (unset: no route log)")
    folder = os.path.dirname(os.path.abspath(FLAGS.route_log))
    if not os.path.isdir(folder):
      raise ValueError(f"--route_log={FLAGS.route_log}: the folder {folder} does not exist")
  if not 1 <= FLAGS.port <= 65535:
    raise ValueError(f"--port must be in [1, 65535], got {FLAGS.port}")
  if FLAGS.max_waiting < 0:
    raise ValueError(f"--max_waiting must be >= 0, got {FLAGS.max_waiting}")
  try:
    return bind_socket(FLAGS.host, FLAGS.port)
  except OSError as e:
    flag = (f"--port={FLAGS.port}" if e.errno in (errno.EADDRINUSE, errno.EACCES)
            else f"--host={FLAGS.host}")
    raise ValueError(f"{flag}: cannot listen on {FLAGS.host}:{FLAGS.port} "
                     f"({e.strerror or e})") from None


def main(argv):
  del argv
  access = _access()
  sock = _check_flags()
  cost = router.RouteCost(**{f: FLAGS[f"route_{f}"].value for f in _ROUTE_COST_HELP})
  if FLAGS.replica_urls is not None:
    try:
      urls = replica_launch.parse_replica_urls(",".join(FLAGS.replica_urls))
      replica_launch.run_remote_front(urls, host=FLAGS.host, port=FLAGS.port,
                                      policy=FLAGS.router, cost=cost, route_log=FLAGS.route_log,
                                      max_waiting=FLAGS.max_waiting,
                                      ready_timeout_s=FLAGS.replica_ready_timeout_s, sock=sock,
                                      access=access)
    except (RuntimeError, ValueError) as e:      # not ready in time, or they disagree
      print(f"error: --replica_urls: {e}", file=sys.stderr)
      sys.exit(1)
    return
  if FLAGS.replicas or _pd():
    from serving.http import ray_engines, ray_front

    given = [FLAGS[name].serialize() for name in _ENGINE_FLAGS if FLAGS[name].present]
    capacity = launch.engine_config().max_request_slots + FLAGS.max_waiting
    build = lambda role: ray_engines.FlagsEngine(
        given, FLAGS.warmup, capacity, cwd=os.getcwd(),
        **({} if role == "mixed" else {"role": role}))
    try:
      status = ray_front.run_ray_front(
          build, _front_tokenizer(), FLAGS.served_model_name or FLAGS.model,
          replicas=FLAGS.replicas, prefill_replicas=FLAGS.prefill_replicas,
          decode_replicas=FLAGS.decode_replicas, ray_address=FLAGS.ray_address,
          replica_cpus=FLAGS.replica_cpus, max_restarts=FLAGS.replica_max_restarts,
          kv_transport=FLAGS.kv_transport,
          policy=FLAGS.router, cost=cost, route_log=FLAGS.route_log,
          max_waiting=FLAGS.max_waiting, sock=sock,
          host=FLAGS.host, port=FLAGS.port, access=access,
          max_prompt_chars=FLAGS.max_prompt_chars)
    except RuntimeError as e:                    # an engine actor did not start
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)
    sys.exit(status)
  engine, _, tokenizer = launch.build_engine()
  server = OpenAIServer(engine, tokenizer, FLAGS.served_model_name or FLAGS.model,
                        max_waiting=FLAGS.max_waiting,
                        trust_front_headers=FLAGS.trust_front_headers, access=access,
                        max_prompt_chars=FLAGS.max_prompt_chars)
  if FLAGS.warmup:        # every size the live bound can grow the slot table to
    launch.warmup(engine, num_requests=server.capacity)
  print(f"serving {server.model_name!r} on http://{FLAGS.host}:{FLAGS.port}/v1", flush=True)
  sys.exit(server.serve(sock))


if __name__ == "__main__":
  cli.run(main)
