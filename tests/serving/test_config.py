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


@pytest.mark.parametrize("field, value, wanted", [
    ("max_num_seqs", "four", "an int"),
    ("max_num_seqs", True, "an int"),               # a bool is not an int
    ("num_pages", 64.0, "an int"),
    ("swap_space_mb", "1024", "a float (or an int)"),
    ("spec_acceptance", False, "a float (or an int)"),
    ("policy", 3, "a str"),
    ("enable_prefix_caching", 1, "a bool"),
    ("max_model_len", None, "an int"),
])
def test_a_value_of_the_wrong_type_is_refused_before_the_rules(field, value, wanted):
  with pytest.raises(ValueError, match=rf"^EngineConfig\.{field} must be {re.escape(wanted)}, "
                                       rf"got {re.escape(repr(value))}$"):
    EngineConfig(**{field: value})


def test_an_int_is_a_float_fields_value():
  config = EngineConfig(swap_space_mb=512, reservation_quantile=1)
  assert (config.swap_space_mb, config.reservation_quantile) == (512, 1)


@pytest.mark.parametrize("text, message", [
    ('{"max_num_seqs": "four"}', "{path}: EngineConfig.max_num_seqs must be an int, got 'four'"),
    ('{"enable_prefix_caching": "no"}',
     "{path}: EngineConfig.enable_prefix_caching must be a bool, got 'no'"),
    ('{"num_pages": null}', "{path}: EngineConfig.num_pages must be an int, got None"),
    ('{"speculative": 5}', "{path}: EngineConfig.speculative must be a str, got 5"),
    ("{truncated", "engine preset '{path}' is not JSON (Expecting property name enclosed in "
                   "double quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", "engine preset '{path}' must hold a JSON object of EngineConfig fields, "
               "got a list"),
])
def test_a_preset_file_of_wrong_types_or_not_json_is_refused_naming_it(tmp_path, text, message):
  """preset_fields refuses what it reads (launch.engine_config reads a
  draft's ``speculative`` from it before the config is built)."""
  path = tmp_path / "engine.json"
  path.write_text(text)
  expected = message.format(path=path)
  for load in (EngineConfig.preset_fields, EngineConfig.preset):
    with pytest.raises(ValueError) as refused:
      load(str(path))
    assert str(refused.value) == expected


def test_a_preset_file_that_is_not_utf8_is_not_json(tmp_path):
  path = tmp_path / "engine.json"
  path.write_bytes(b"\xff\xfe{}")
  with pytest.raises(ValueError, match=rf"^engine preset '{re.escape(str(path))}' is not JSON "):
    EngineConfig.preset(str(path))
