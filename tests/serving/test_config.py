"""EngineConfig's three parts: every field in exactly one, each part
validating its own fields with an error naming the class and the field, and
the engine's slot programs shared only by engines whose executor part and
table sizes agree."""

import dataclasses
import re

import pytest

from serving.engine.config import EngineConfig, ExecutorConfig, HarnessConfig, SchedulerConfig
from serving.engine import programs


def _names(cls):
  return {f.name for f in dataclasses.fields(cls)}


def test_every_field_belongs_to_exactly_one_part():
  parts = [_names(SchedulerConfig), _names(ExecutorConfig), _names(HarnessConfig)]
  assert set.union(*parts) == _names(EngineConfig)
  assert sum(len(p) for p in parts) == len(_names(EngineConfig))   # disjoint


def test_the_parts_round_trip():
  config = EngineConfig.preset("tiny", policy="vtc", num_pages=33, executor="simulated")
  assert config.scheduler_config == SchedulerConfig(
      **{n: getattr(config, n) for n in _names(SchedulerConfig)})
  assert config.scheduler_config.policy == "vtc"
  assert config.executor_config.num_pages == 33
  assert config.harness_config == HarnessConfig(executor="simulated", cost_model="")
  merged = {**dataclasses.asdict(config.scheduler_config),
            **dataclasses.asdict(config.executor_config),
            **dataclasses.asdict(config.harness_config)}
  assert EngineConfig(**merged) == config


@pytest.mark.parametrize("cls, field, value, rule", [
    (SchedulerConfig, "max_num_seqs", 0, "must be >= 1"),
    (SchedulerConfig, "preemption_mode", "drop", "must be one of"),
    (SchedulerConfig, "force_preempt_every", 1, "must be 0 (off) or >= 2"),
    (ExecutorConfig, "min_bucket", 1, "must be >= 2"),
    (ExecutorConfig, "prefill_chunk_rows", 12, "must be 0 (off) or a positive multiple of 8"),
    (HarnessConfig, "executor", "gpu", "must be one of"),
])
def test_each_part_names_its_class_and_field(cls, field, value, rule):
  with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field} {re.escape(rule)}"):
    cls(**{field: value})
  with pytest.raises(ValueError, match=rf"^EngineConfig\.{field} {re.escape(rule)}"):
    EngineConfig(**{field: value})


def test_a_rule_across_parts_is_checked_on_the_whole():
  SchedulerConfig(watermark_pages=40)            # no KV cache to compare with
  with pytest.raises(ValueError, match=r"^EngineConfig\.num_pages must be > watermark_pages = "
                                       r"40 .* raise num_pages to at least 41 .*, got 32$"):
    EngineConfig(watermark_pages=40, num_pages=32)


def test_scheduler_settings_alone_share_the_slot_programs():
  base = EngineConfig.preset("tiny")
  key = lambda c: (c.executor_config, c.executor, programs._table_sizes(c))
  for field, value in [("policy", "vtc"), ("reservation", "max"), ("preemption_mode", "swap"),
                       ("enable_prefix_caching", False), ("max_queued_requests", 4096)]:
    assert key(dataclasses.replace(base, **{field: value})) == key(base), field
  for field, value in [("num_pages", base.num_pages + 1), ("max_request_slots", 128),
                       ("executor", "simulated"), ("max_num_seqs", base.max_num_seqs - 1)]:
    assert key(dataclasses.replace(base, **{field: value})) != key(base), field
