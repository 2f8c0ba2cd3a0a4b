"""The launchers' workload flags: --trace or the synthetic workload, its
window, time scale, clips and SLOs (``define_workload_flags``), their
checks before any model loads (``check_workload_flags``, the replay span
bound ``check_replay_span``, ``parse_window``) and the workload they give
(``load_workload``)."""

from __future__ import annotations

import math

import numpy as np
from absl import flags

from serving.cli.launch import key_flags_of_caller
from serving.harness import metrics, traces, workloads
from serving.harness import synthetic as synthetic_workloads

FLAGS = flags.FLAGS
# The longest span of arrivals a replay takes, in virtual seconds as
# replayed: a trace window's length x --time_scale (sweep.py: / its rate
# scale), the synthetic workload's arrivals at --rate_scale. The engine's
# clocks are float64 seconds and ms since its start (serving.engine.clocks,
# the VirtualClock), whose resolution falls with the time they hold: 2**-19
# s ~ 2 us at 1e10 s (~300 years). Measured on 13 requests of the Azure conv
# trace, tiny model: the median gap between tokens (3 ms on profile:h100) is
# off by 0.04% at 1e10 s, by 1% at 1e11 s, 5% at 1e12 s, and 0 ms at 1e14 s;
# past ~3e35 s a device epoch's shift overflows float32 ms
# (clocks.EngineClocks.rebase) and the report's JSON gets inf.
MAX_REPLAY_SPAN_S = 1e10


def define_workload_flags() -> None:
  """--trace (or the synthetic default), its window, time scale and clips.
  The caller's ``--help`` lists the flags that choose the workload, its
  clips and its SLOs; ``--helpfull`` the synthetic draws and seed too."""
  flags.DEFINE_string("trace", None, "KIND:PATH with KIND in azure, mooncake, vtc; "
                      "unset = the embedded synthetic Azure-conv workload.")
  flags.DEFINE_integer("num_requests", 32, "Requests of the synthetic default workload.")
  flags.DEFINE_integer("clients", None, "Synthetic: clients c0..cN-1, equally likely.")
  flags.DEFINE_list("client_shares", None, "Synthetic: relative client weights W0,W1,... "
                    "(> 0; ck drawn with probability Wk / sum: 0.6,0.6 is two equal clients).")
  flags.DEFINE_integer("priorities", None, "Synthetic: priorities 0..N-1, equally likely.")
  flags.DEFINE_float("rate_scale", 0.1, "Synthetic default: fraction of the Azure "
                     "conv trace's arrival rate (5.53 req/s).")
  flags.DEFINE_float("time_scale", 1.0, "Multiply inter-arrival gaps (>1 = slower).")
  flags.DEFINE_list("window_s", None, "N: the trace's first N seconds of arrivals; A,B: "
                    "its arrivals in [t0+A, t0+B) seconds, t0 its first arrival.")
  flags.DEFINE_integer("max_requests", None, "Keep at most this many requests.")
  flags.DEFINE_integer("max_prompt_len", None, "Clip longer prompts (counted); default "
                       "512 for the synthetic workload, 1024 for traces.")
  flags.DEFINE_integer("max_output_len", None, "Cap output lengths; default 64 for the "
                       "synthetic workload, 512 for traces.")
  flags.DEFINE_integer("mooncake_block_tokens", None, "Mooncake only: tokens per hash "
                       "block (default 512); smaller shrinks prompts to fit a small "
                       "context and keeps which prompts share which prefix.")
  flags.DEFINE_integer("seed", 0, "Seed for prompt token ids and arrivals.",
                       lower_bound=0, upper_bound=2**32 - 1)
  flags.DEFINE_float("slo_ttft_ms", None, "Every request's TTFT SLO (ms, from arrival).")
  flags.DEFINE_float("slo_tpot_ms", None, "Every request's TPOT/TBT SLO (ms between tokens).")
  flags.DEFINE_string("slo_class", None, "Per-class SLOs NAME:TTFT_MS:TPOT_MS,...; a "
                      "request whose client names a class takes it, the others cycle "
                      "through the classes by arrival index.")
  key_flags_of_caller("trace", "window_s", "time_scale", "max_requests", "num_requests",
                       "rate_scale", "max_prompt_len", "max_output_len", "slo_ttft_ms",
                       "slo_tpot_ms", "slo_class")


def check_workload_flags() -> None:
  """The values of define_workload_flags(), checked before any model loads,
  each refusal naming the flag and its rule (the loaders in
  serving.harness, a Python API, name their arguments instead). A trace's
  rows are read from the file (for its span; one request drawn for
  --window_s), so a window that holds no request, or a time scale that
  stretches the trace too far, is refused now too, not once the model has
  loaded.

  Raises:
    ValueError: an SLO flag not finite and > 0, --slo_class malformed or
      given with --slo_ttft_ms / --slo_tpot_ms, a flag of the other workload
      kind (--window_s, --time_scale, --max_requests, --mooncake_block_tokens
      apply to --trace only; --num_requests, --rate_scale to the synthetic
      workload only), a malformed --trace or one whose file is missing, a
      --window_s not N or A,B with 0 <= A < B finite (``parse_window``) or
      one no request of the trace is in, a --time_scale or --rate_scale not
      finite and > 0, a count or length below 1; a --time_scale or
      --rate_scale that stretches the arrivals (--window_s's length, the
      trace's or the synthetic workload's span) past MAX_REPLAY_SPAN_S
      (``check_replay_span``).
  """
  for name in ("slo_ttft_ms", "slo_tpot_ms"):
    value = FLAGS[name].value
    if value is not None and not (math.isfinite(value) and value > 0):
      raise ValueError(f"--{name} must be finite and > 0 (ms), got {value}")
  if FLAGS.slo_class is not None:
    if FLAGS.slo_ttft_ms is not None or FLAGS.slo_tpot_ms is not None:
      raise ValueError("give either --slo_ttft_ms / --slo_tpot_ms or --slo_class, not both")
    try:
      workloads.parse_slo_classes(FLAGS.slo_class)
    except ValueError as e:               # its messages start with the field, slo_class
      raise ValueError(f"--{e}") from None
  synthetic = FLAGS.trace is None
  given = lambda name: FLAGS[name].present
  wrong = [n for n in (("window_s", "time_scale", "max_requests", "mooncake_block_tokens")
                       if synthetic
                       else ("num_requests", "rate_scale", "clients", "client_shares",
                             "priorities")) if given(n)]
  if wrong:
    raise ValueError(
        f"--{wrong[0]} applies only {'with --trace' if synthetic else 'without --trace'}; "
        + ("the synthetic workload takes --num_requests, --rate_scale, --clients, "
           "--client_shares, --priorities" if synthetic
           else "a trace takes --window_s, --time_scale and --max_requests"))
  if synthetic:
    if FLAGS.num_requests < 1:
      raise ValueError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    try:
      synthetic_workloads.client_shares(FLAGS.clients, FLAGS.client_shares)
    except ValueError as e:               # its messages start with the field
      raise ValueError(f"--{e}") from None
    if not (math.isfinite(FLAGS.rate_scale) and FLAGS.rate_scale > 0):
      raise ValueError(f"--rate_scale must be finite and > 0, got {FLAGS.rate_scale}")
  else:
    loader, path = traces.trace_loader(FLAGS.trace)
    blocks = FLAGS.mooncake_block_tokens
    if blocks is not None and loader is not traces.load_mooncake_trace:
      raise ValueError(f"--mooncake_block_tokens applies only to --trace=mooncake:PATH, "
                       f"got --trace={FLAGS.trace}")
    if blocks is not None and not 1 <= blocks <= traces.MOONCAKE_BLOCK_TOKENS:
      raise ValueError(f"--mooncake_block_tokens must be in [1, "
                       f"{traces.MOONCAKE_BLOCK_TOKENS}], got {blocks}")
    _flag_window()
    if not (math.isfinite(FLAGS.time_scale) and FLAGS.time_scale > 0):
      raise ValueError(f"--time_scale must be finite and > 0 (a factor on the trace's "
                       f"gaps), got {FLAGS.time_scale}")
    traces.trace_loader(FLAGS.trace, check_file=True)
  for name in ("max_requests", "max_prompt_len", "max_output_len", "clients", "priorities"):
    value = FLAGS[name].value
    if value is not None and value < 1:
      raise ValueError(f"--{name} must be >= 1, got {value}")
  # Last, what the flags' values need read from the trace or drawn.
  if synthetic:
    check_scaled_span(FLAGS.rate_scale, f"--rate_scale={FLAGS.rate_scale:g}")
    return
  check_scaled_span(FLAGS.time_scale, f"--time_scale={FLAGS.time_scale:g}")
  if FLAGS.window_s is not None:       # a window with no request: refused now
    loader(path, window_s=_flag_window(), max_requests=1)


def check_replay_span(given: str, what: str, span_s: float) -> None:
  """Refuses a time or rate scale that stretches a replay's arrivals past
  ``MAX_REPLAY_SPAN_S``: ``span_s`` is ``what`` (a window or a trace's
  arrivals) as replayed, in seconds (inf where scaling overflowed): the
  one bound of --time_scale, the synthetic workload's --rate_scale and
  sweep.py's --rate_scales.

  Raises:
    ValueError: naming ``given`` (the flags as typed), the span and the
      bound with its reason.
  """
  if not span_s <= MAX_REPLAY_SPAN_S:
    raise ValueError(f"{given}: {what} would span {span_s:.3g} s as replayed; a replay spans "
                     f"at most {MAX_REPLAY_SPAN_S:g} s of virtual time (the engine's float64 "
                     f"clocks resolve ~2 us there; further on a step of a few ms is off by 1% "
                     f"and more)")


def parse_window(value) -> tuple:
  """A --window_s value, a list flag's strings or one string, as (A, B)
  seconds after the trace's first arrival: ``N`` is its first N seconds
  (0, N), ``A,B`` the arrivals in [A, B).

  Raises:
    ValueError: naming --window_s and its rule: not one or two numbers, or
      not 0 <= A < B with B finite.
  """
  parts = value.split(",") if isinstance(value, str) else list(value)
  try:
    numbers = [float(x) for x in parts]
  except ValueError:
    numbers = []
  if len(numbers) == 1:
    numbers = [0.0] + numbers            # N: the first N seconds
  if len(numbers) != 2 or not 0 <= numbers[0] < numbers[1] < math.inf:
    raise ValueError(f"--window_s must be N > 0 (the trace's first N seconds of arrivals) or "
                     f"A,B with 0 <= A < B (its arrivals in [A, B) seconds after the first), "
                     f"finite, got {','.join(parts)!r}")
  return numbers[0], numbers[1]


def check_scaled_span(scale: float, given: str) -> None:
  """``check_replay_span`` of the flags' workload at ``scale``: a trace's
  --window_s length (or, without it, its arrivals' span, read from the
  file, no prompt drawn) x ``scale`` as a time scale; the synthetic
  workload's arrivals drawn at ``scale`` as its rate scale (one token a
  request: its arrivals do not depend on the lengths). ``given``: the flag
  that set ``scale``, as the user typed it (a launcher that scales the
  workload itself names its own flag).

  Raises:
    ValueError: the span past ``MAX_REPLAY_SPAN_S``, naming ``given``.
  """
  if FLAGS.trace is None:
    try:
      with np.errstate(over="ignore"):
        span = synthetic_workloads.synthetic_azure_conv(
            FLAGS.num_requests, scale, FLAGS.seed, max_prompt_len=1,
            max_output_len=1).duration_s
    except ValueError:      # its flags are checked: an arrival past float64's range
      span = math.inf
    check_replay_span(given, f"the synthetic workload's {FLAGS.num_requests} arrivals", span)
    return
  window = _flag_window()
  if window is not None:
    length = window[1] - window[0]
    given = f"--window_s={','.join(FLAGS.window_s)} x {given}"
    what = f"a window of {length:g} s"
  else:
    length = traces.arrival_span_s(FLAGS.trace)
    what = f"the trace's arrivals ({length:g} s, first to last)"
  check_replay_span(given, what, length * scale)


def _flag_window():
  """--window_s as (A, B), or None when not given (``parse_window``)."""
  return parse_window(FLAGS.window_s) if FLAGS.window_s is not None else None


def load_workload(vocab_size: int, max_model_len: int) -> workloads.Workload:
  """The workload of define_workload_flags(), fitted into the context
  (``workloads.fit_context``: prompt + output <= max_model_len, the output
  keeping min(requested, max_model_len // 2) tokens), with a one-line note
  when that cuts a request.

  Raises:
    ValueError: a flag ``check_workload_flags`` refuses, or a trace file
      that does not read.
  """
  check_workload_flags()
  synthetic = FLAGS.trace is None
  pick = lambda value, default_synthetic, default_trace: value if value is not None else (
      default_synthetic if synthetic else default_trace)
  common = dict(max_prompt_len=pick(FLAGS.max_prompt_len, 512, 1024),
                max_output_len=pick(FLAGS.max_output_len, 64, 512),
                seed=FLAGS.seed, vocab_size=vocab_size)
  workload = workloads.fit_context(_load_flag_workload(synthetic, common), max_model_len)
  note = workloads.fit_note(workload)
  if note:
    print(note)
  return _with_flag_slos(workload)


def slo_flags_given() -> bool:
  return (FLAGS.slo_ttft_ms is not None or FLAGS.slo_tpot_ms is not None
          or FLAGS.slo_class is not None)


def flag_goodput(records, duration_s: float):
  """A run's goodput block when ``slo_flags_given()``: each request judged by
  its own SLOs, the flags' limits named."""
  return metrics.goodput(records, ttft_ms=FLAGS.slo_ttft_ms, tpot_ms=FLAGS.slo_tpot_ms,
                         duration_s=duration_s, per_request=True)


def _with_flag_slos(workload: workloads.Workload) -> workloads.Workload:
  """Declares --slo_ttft_ms / --slo_tpot_ms / --slo_class on every request."""
  if not slo_flags_given():
    return workload
  classes = workloads.parse_slo_classes(FLAGS.slo_class) if FLAGS.slo_class else ()
  return workloads.with_slos(workload, ttft_ms=FLAGS.slo_ttft_ms,
                             tpot_ms=FLAGS.slo_tpot_ms, classes=classes)


def _load_flag_workload(synthetic: bool, common: dict) -> workloads.Workload:
  if synthetic:
    shares = synthetic_workloads.client_shares(FLAGS.clients, FLAGS.client_shares)
    return synthetic_workloads.synthetic_azure_conv(
        FLAGS.num_requests, FLAGS.rate_scale, **common, client_shares=shares,
        num_priorities=FLAGS.priorities or 1)
  loader, path = traces.trace_loader(FLAGS.trace)
  if FLAGS.mooncake_block_tokens is not None:
    common = dict(common, block_tokens=FLAGS.mooncake_block_tokens)
  return loader(path, time_scale=FLAGS.time_scale, window_s=_flag_window(),
                max_requests=FLAGS.max_requests, **common)
