"""Load benchmark of a running OpenAI-compatible server over loopback HTTP.

  python scripts/serve.py --engine=cpu_small &               # the server
  python scripts/bench_serving.py --num_requests=16 --rate_scale=0.5 \
      --max_prompt_len=256 --max_output_len=32 --out=runs/bench_serving.json

Replays the workload of ``replay.py``'s flags (the embedded synthetic one or
``--trace``), each request sent at its arrival time as a streamed
``/v1/completions`` call with the prompt as token ids. Every timestamp is
taken on the client: arrival = the intended send time, a token's time = the
arrival of the SSE chunk that carried its text (a token whose text arrives
with a later chunk, e.g. the first bytes of a split character, gets that
chunk's time; the token count is the response's ``usage``). The report is
``replay.py``'s (``serving.harness.metrics.build_report``); a 429 is recorded as
rejected, any other error as failed. Against a router front
(``serve.py --replicas=N``) the report adds a ``router`` section: the
policy, prefix-cache hit rates per replica and overall, and every request's
route record (its decisions and the facts they used), all of this run's
own: ``GET /router`` is read before and after the run, and only the requests
and counter increases between the two are counted.

A server started with API keys (``serve.py --api_key``) needs one:
``--api_key=KEY``, or the ``OPENAI_API_KEY`` environment variable as
``vllm bench serve`` reads it, goes on every request as ``Authorization:
Bearer KEY``. Against a front with keys, the ``router`` section holds the
key's tenant's route records only (its replica counters are everyone's).

  python scripts/bench_serving.py --n=8 --n_prompt_len=256 --n_max_tokens=32 \
      --out=runs/bench_parallel_sampling.json

``--n`` compares parallel sampling with independent requests instead, in
counts read from the server's ``/metrics`` (no timings): one request with
``n`` choices of a random prompt, then ``n`` independent requests of
another random prompt of the same length sent as one batched body (they
arrive together, so none can take another's pages from the prefix cache).
Per run: prefill tokens computed, prefix-cache hit tokens and the peak KV
pages held (``iterserve:kv_pages_used_peak``); run it on an idle server.
"""

import asyncio
import json
import logging
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import numpy as np
from absl import flags
from prometheus_client.parser import text_string_to_metric_families

from serving import cli
from serving.cli import workload_flags
from serving.harness import metrics
from serving.harness import report_text
from serving.http import replicas
from serving.harness import workloads

FLAGS = flags.FLAGS
flags.DEFINE_string("url", "http://127.0.0.1:8000", "Server base URL, with or without "
                    "the /v1 suffix (http://host:port or http://host:port/v1).")
flags.DEFINE_string("model", None, "Model name to send (default: the server's only model).")
flags.DEFINE_string("out", "runs/bench_serving.json", "Report JSON path.")
flags.DEFINE_float("timeout_s", 1800.0, "Per-request HTTP timeout (s).")
flags.DEFINE_string("api_key", None, "API key sent as 'Authorization: Bearer KEY' on every "
                    "request (default: the OPENAI_API_KEY environment variable; neither: "
                    "no key; --api_key= sends none).")
flags.DEFINE_integer("n", 0, "> 1: compare n parallel samples of one prompt with n "
                     "independent requests (counts only) instead of the workload.")
flags.DEFINE_integer("n_prompt_len", 256, "--n: prompt tokens (random ids).")
flags.DEFINE_integer("n_max_tokens", 32, "--n: output tokens of every choice.")
workload_flags.define_workload_flags()


async def _one(client, spec, model, origin, max_model_len):
  """Sends ``spec`` at its arrival time; returns its RequestRecord. Its
  max_tokens is capped at what the context leaves after the prompt (the
  server refuses more with a 400; the engine stops there in a replay too)."""
  await asyncio.sleep(max(0.0, origin + spec.arrival_s - time.perf_counter()))
  max_tokens = min(spec.max_tokens, max_model_len - len(spec.prompt_token_ids))
  body = {"model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": max_tokens,
          "temperature": 0, "ignore_eos": spec.ignore_eos, "stream": True,
          "stream_options": {"include_usage": True}, "client": spec.client,
          "priority": spec.priority}
  times, usage, finish, outcome, reason = [], None, None, "failed", ""
  try:
    async with client.stream("POST", "/v1/completions", json=body) as r:
      if r.status_code != 200:
        error = json.loads(await r.aread()).get("error", {})
        outcome = "rejected" if r.status_code == 429 else "failed"
        reason = f"HTTP {r.status_code}: {error.get('message', '')}"
      else:
        async for line in r.aiter_lines():
          if not line.startswith("data: ") or line == "data: [DONE]":
            continue
          chunk = json.loads(line[6:])
          if "error" in chunk:
            reason = chunk["error"]["message"]
            break
          for c in chunk["choices"]:
            if c["text"]:
              times.append(time.perf_counter() - origin)
            finish = c["finish_reason"] or finish
          usage = chunk.get("usage") or usage
        if usage is not None and finish is not None:
          outcome, reason = "completed", finish
  except httpx.HTTPError as e:
    reason = f"{type(e).__name__}: {e}"
  n = usage["completion_tokens"] if usage else len(times)
  if outcome == "completed":
    times = (times + times[-1:] * n)[:n] if times else []
    if not times:
      outcome, reason = "failed", "no text streamed"
  else:
    times, n = [], 0
  return metrics.RequestRecord(
      request_id=spec.request_id, client=spec.client, arrival_s=spec.arrival_s,
      first_token_s=times[0] if times else None, token_times_s=times,
      prompt_tokens=len(spec.prompt_token_ids), output_tokens=len(times), outcome=outcome,
      finish_reason=reason, clipped=spec.clipped)


def auth_headers(api_key: Optional[str]) -> dict:
  """The ``Authorization`` header for ``--api_key`` (None: the
  ``OPENAI_API_KEY`` environment variable); {} when neither gives a key."""
  key = os.environ.get("OPENAI_API_KEY") if api_key is None else api_key
  return {"Authorization": f"Bearer {key}"} if key else {}


def base_url(url: str) -> str:
  """The server root from --url: a trailing '/' and '/v1' dropped (the
  OpenAI clients' base_url ends in /v1; this script adds the paths itself).

  Raises:
    ValueError: not an http(s) URL with a host.
  """
  try:
    parsed = httpx.URL(url) if "://" in url else None
  except httpx.InvalidURL:
    parsed = None
  if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
    raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
  root = url.rstrip("/")
  return root.removesuffix("/v1").rstrip("/")


def server_model(root: str, name: Optional[str], headers: Optional[dict] = None) -> dict:
  """The model ``GET {root}/v1/models`` lists as ``name`` (None: the first
  one), with its ``max_model_len`` (vLLM's field) and ``vocab_size``
  (SmolLM2's, with a note, when the server does not say); ``headers``: the
  API key's (``auth_headers``).

  Raises:
    ValueError: the server cannot be reached, refuses the API key (HTTP
      401), its answer is not an OpenAI model list with ``max_model_len``,
      or it does not serve ``name`` (--model; the message lists the served
      names).
  """
  try:
    reply = httpx.get(f"{root}/v1/models", headers=headers, timeout=30)
  except httpx.TransportError as e:
    raise ValueError(f"cannot reach {root} (--url): {type(e).__name__}: {e}") from None
  if reply.status_code == 401:
    given = "the key given was refused" if headers else "none was given"
    raise ValueError(f"{root} needs an API key and {given}: --api_key=KEY or the "
                     f"OPENAI_API_KEY environment variable")
  try:
    cards = reply.raise_for_status().json()["data"]
    served = [card["id"] for card in cards]
    card = cards[served.index(name) if name in served else 0]
    int(card["max_model_len"])
  except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError):
    raise ValueError(f"{root}/v1/models (--url) is not an OpenAI model list with "
                     f"max_model_len: HTTP {reply.status_code} {reply.text[:200]!r}") from None
  if name is not None and name not in served:
    raise ValueError(f"--model={name} is not served by {root}; it serves {served}")
  if "vocab_size" not in card:
    print(f"note: {root}/v1/models gives no vocab_size; prompt ids drawn below "
          f"{workloads.DEFAULT_VOCAB_SIZE} (SmolLM2's)")
  return {"vocab_size": workloads.DEFAULT_VOCAB_SIZE, **card}


def _router_report(root: str, headers: dict) -> Optional[dict]:
  """A router front's ``GET /router``; None from a server that is not one."""
  reply = httpx.get(f"{root}/router", headers=headers, timeout=60)
  return reply.json() if reply.status_code == 200 else None


async def _run(workload, model, root, max_model_len, headers):
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(base_url=root, timeout=FLAGS.timeout_s, limits=limits,
                               headers=headers) as client:
    origin = time.perf_counter()
    records = await asyncio.gather(*[_one(client, s, model, origin, max_model_len)
                                     for s in workload])
    return list(records), time.perf_counter() - origin


# Server counters the --n comparison reads: report name -> /metrics sample.
_N_COUNTS = {"prefill_tokens_computed": "iterserve:prefill_tokens_computed_total",
             "prefix_hit_tokens": "vllm:prefix_cache_hits_total",
             "kv_pages_used_peak": "iterserve:kv_pages_used_peak"}


def _server_counts(root: str, headers: dict) -> dict:
  """The ``_N_COUNTS`` samples of ``GET {root}/metrics``."""
  text = httpx.get(f"{root}/metrics", headers=headers, timeout=60).raise_for_status().text
  samples = {s.name: s.value for f in text_string_to_metric_families(text)
             for s in f.samples}
  return {key: samples[name] for key, name in _N_COUNTS.items()}


def _count_run(root: str, body: dict, headers: dict) -> dict:
  """Sends one completion ``body``; returns its choices, usage and the
  server counts it moved (the peak is the run's own: the server was idle
  before it)."""
  before = _server_counts(root, headers)
  reply = httpx.post(f"{root}/v1/completions", json=body, headers=headers,
                     timeout=FLAGS.timeout_s)
  if reply.status_code != 200:
    raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
  after = _server_counts(root, headers)
  out = {key: int(after[key] - before[key]) for key in ("prefill_tokens_computed",
                                                        "prefix_hit_tokens")}
  out["kv_pages_used_peak"] = int(after["kv_pages_used_peak"])
  out["choices"] = len(reply.json()["choices"])
  out["usage"] = reply.json()["usage"]
  return out


def parallel_sampling(root: str, model: str, vocab_size: int, headers: dict) -> dict:
  """The --n comparison (see the module docstring)."""
  n, length = FLAGS.n, FLAGS.n_prompt_len
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, vocab_size, size=length).tolist() for _ in range(2)]
  common = {"model": model, "max_tokens": FLAGS.n_max_tokens, "temperature": 1.0,
            "seed": 0, "ignore_eos": True}
  runs = {"parallel": _count_run(root, {**common, "prompt": prompts[0], "n": n}, headers),
          "independent": _count_run(root, {**common, "prompt": [prompts[1]] * n}, headers)}
  return {"n": n, "prompt_len": length, "max_tokens": FLAGS.n_max_tokens,
          "server": root, "model": model, "argv": sys.argv[1:], "runs": runs}


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request
  if not FLAGS.timeout_s > 0:
    raise ValueError(f"--timeout_s must be > 0, got {FLAGS.timeout_s}")
  root = base_url(FLAGS.url)
  headers = auth_headers(FLAGS.api_key)
  info = server_model(root, FLAGS.model, headers)
  model = info["id"]
  if FLAGS.n:
    if FLAGS.n < 2 or FLAGS.n_prompt_len < 1 or FLAGS.n_max_tokens < 1:
      raise ValueError(f"--n must be >= 2 and --n_prompt_len, --n_max_tokens >= 1, got "
                       f"{FLAGS.n}, {FLAGS.n_prompt_len}, {FLAGS.n_max_tokens}")
    report = parallel_sampling(root, model, info["vocab_size"], headers)
    print("| run | choices | prefill tokens computed | prefix-hit tokens | "
          "KV pages used (peak) |\n|---|---|---|---|---|")
    for name, run in report["runs"].items():
      print(f"| {name} | {run['choices']} | {run['prefill_tokens_computed']} | "
            f"{run['prefix_hit_tokens']} | {run['kv_pages_used_peak']} |")
    metrics.write_report(FLAGS.out, report)
    print(f"report: {FLAGS.out}")
    return
  workload = workload_flags.load_workload(info["vocab_size"], info["max_model_len"])
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}) against {root} ({model})")
  routed_before = _router_report(root, headers)
  records, duration_s = asyncio.run(_run(workload, model, root, info["max_model_len"],
                                         headers))
  config = {"model": model, "server": root, "client": "HTTP streaming (SSE), "
            "client-side timestamps", "max_model_len": info["max_model_len"],
            "workload": workload.describe()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  print(report_text.format_table(report))
  routed = _router_report(root, headers)
  if routed is not None and routed_before is not None:     # a router front
    report["router"] = summary = replicas.route_summary(routed, routed_before)
    rates = ", ".join(f"{r.get('engine') or 'replica ' + str(r['replica'])}: "
                      f"{r['prefix_cache_hit_rate']:.3f} ({r['placed']} placed)"
                      for r in summary["replicas"])
    print(f"router {summary['policy']}: prefix-cache hit rate "
          f"{summary['prefix_cache_hit_rate']:.3f} ({rates}); re-routed {summary['rerouted']}")
  metrics.write_report(FLAGS.out, report)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
