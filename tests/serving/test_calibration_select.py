"""The shipped CPU calibration follows the machine (``calibrations.select_calibration``):
the fingerprint's kind picks one, and where none holds one line says so and
names ``scripts/calibrate.py``."""

from models.config import get_config
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig

_BASE = ["fpu", "sse2", "avx", "fma"]
AVX2_EPYC = {"backend": "cpu", "kind": "cpu", "count": 1, "cpu": "AMD EPYC", "cpus": 2,
             "id": "not-shipped", "flags": _BASE + ["avx2"]}
AVX512_EPYC = dict(AVX2_EPYC, flags=_BASE + ["avx2", "avx512f", "avx512bw"])
XEON = dict(AVX512_EPYC, cpu="Intel(R) Xeon(R) Processor")
XEON_AVX2 = dict(AVX2_EPYC, cpu="Intel(R) Xeon(R) Processor")    # no shipped calibration
GPU = {"backend": "gpu", "kind": "NVIDIA H100 80GB HBM3", "count": 1, "id": "gpu"}
SMOLLM2 = cost_lib.model_costs(get_config("smollm2-135m"), "float32")
OTHER = cost_lib.model_costs(get_config("tiny"), "float32")


def test_machine_kind_reads_the_widest_isa():
  assert cal_lib.machine_kind(AVX2_EPYC) == {"cpu": "AMD EPYC", "cpus": 2, "isa": "avx2"}
  assert cal_lib.machine_kind(AVX512_EPYC)["isa"] == "avx512"
  assert cal_lib.machine_kind(dict(AVX2_EPYC, flags=["sse2"]))["isa"] == "baseline"
  assert cal_lib.machine_kind(GPU) is None
  assert cal_lib.machine_kind({k: v for k, v in AVX2_EPYC.items() if k != "flags"}) is None


def test_each_kind_gets_its_own_calibration():
  path, line = cal_lib.select_calibration(AVX2_EPYC, SMOLLM2)
  assert path.name == "cost_model_cpu_avx2.json" and line == ""
  # The documented fidelity case's engine (cpu_default) is the model it holds for.
  engine = cost_lib.engine_model_costs(get_config("smollm2-135m"),
                                       EngineConfig.preset("cpu_default"))
  assert cal_lib.select_calibration(AVX2_EPYC, engine)[0].name == "cost_model_cpu_avx2.json"
  for costs in (SMOLLM2, OTHER, None):
    path, line = cal_lib.select_calibration(AVX512_EPYC, costs)
    assert path.name == "cost_model_cpu.json" and line == ""
    path, line = cal_lib.select_calibration(XEON, costs)      # two models: any model
    assert path.name == "cost_model_cpu_xeon.json" and line == ""


def test_none_holds_is_said_naming_calibrate():
  for fp, costs, why in ((XEON_AVX2, SMOLLM2, "none of this machine's kind (Intel(R) Xeon(R) "
                                               "Processor, 2 CPUs, AVX2; shipped: AMD EPYC, 2 "
                                               "CPUs, AVX-512; AMD EPYC, 2 CPUs, AVX2; "
                                               "Intel(R) Xeon(R) Processor, 2 CPUs, AVX-512)"),
                         (GPU, SMOLLM2, "none of this machine's kind (not a CPU;"),
                         (AVX2_EPYC, OTHER, "cannot predict this model: "
                                            "cost_model_cpu_avx2.json (fitted on smollm2-135m "
                                            "only)")):
    path, line = cal_lib.select_calibration(fp, costs)
    assert path is None
    assert line.startswith("cost model: no shipped CPU calibration holds here, ")
    assert why in line and "scripts/calibrate.py" in line and "\n" not in line


def test_resolve_swaps_the_default_for_the_machines_and_says_so_once():
  lines = []
  model = cal_lib.resolve(cal_lib.load(), SMOLLM2, fingerprint=AVX2_EPYC, say=lines.append)
  assert model.meta["path"] == "cost_model_cpu_avx2.json"
  assert model.coef_ms == cal_lib.load(cal_lib.CALIBRATION_DIR
                                       / "cost_model_cpu_avx2.json").coef_ms
  # AVX2_EPYC records no flags hash: nothing compared differs but the id.
  assert lines == ["cost model: cost_model_cpu_avx2.json, the shipped calibration for this "
                   "machine's kind (AMD EPYC, 2 CPUs, AVX2), made on a machine of this kind with "
                   "another fingerprint (id 44f9d5b4d575 vs not-shipped): its times may not hold "
                   "here"]
  lines.clear()
  model = cal_lib.resolve(cal_lib.load(), SMOLLM2, fingerprint=XEON_AVX2, say=lines.append)
  assert model.meta["path"] == "cost_model_cpu.json"
  said = [line for line in lines if "calibrat" in line]
  assert len(said) == 1 and "scripts/calibrate.py" in said[0]
  # A calibration named explicitly is kept, whatever the machine.
  lines.clear()
  named = cal_lib.load(cal_lib.DEFAULT_CALIBRATION)
  assert cal_lib.resolve(named, SMOLLM2, fingerprint=AVX2_EPYC,
                         say=lines.append).meta["path"] == "cost_model_cpu.json"
  assert "chosen" not in named.meta


def test_the_shipped_calibration_and_how_its_machine_differs_are_one_line():
  """Which shipped calibration is used, for which machine kind, and how the
  machine it was made on differs from this one, in one line (it was two:
  "the shipped calibration for this machine", then "calibrated on another
  device than this one")."""
  made = cal_lib.load().meta["device"]            # stored without its flag list
  other_flags = dict(AVX512_EPYC, flags_sha="0123456789ab", id="here")
  lines = []
  cal_lib.resolve(cal_lib.load(), SMOLLM2, fingerprint=other_flags, say=lines.append)
  assert lines == [f"cost model: cost_model_cpu.json, the shipped calibration for this machine's "
                   f"kind (AMD EPYC, 2 CPUs, AVX-512), made on a machine of this kind with other "
                   f"CPU feature flags (id {made['id']} vs here): its times may not hold here"]
  # Both flag lists known: the flags that differ are named.
  xeon = cal_lib.load(cal_lib.CALIBRATION_DIR / "cost_model_cpu_xeon.json").meta["device"]
  flags = sorted(set(xeon["flags"]) - {"avx512_fp16"} | {"new_flag"})
  lines.clear()
  cal_lib.resolve(cal_lib.load(), SMOLLM2, fingerprint=dict(xeon, flags=flags, flags_sha="x",
                                                            id="here"), say=lines.append)
  assert lines == ["cost model: cost_model_cpu_xeon.json, the shipped calibration for this "
                   "machine's kind (Intel(R) Xeon(R) Processor, 2 CPUs, AVX-512), made on a "
                   "machine of this kind with other CPU feature flags (this one lacks "
                   "avx512_fp16; has new_flag) (id dc306fe970da vs here): its times may not "
                   "hold here"]
  # Made on this very fingerprint: nothing differs to say.
  lines.clear()
  cal_lib.resolve(cal_lib.load(), SMOLLM2, fingerprint=dict(made, flags=AVX512_EPYC["flags"]),
                  say=lines.append)
  assert lines == [f"cost model: cost_model_cpu.json, the shipped calibration for this machine "
                   f"(AMD EPYC, 2 CPUs, AVX-512), made on a machine of this fingerprint (id "
                   f"{made['id']})"]
