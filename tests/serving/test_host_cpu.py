"""This machine's CPU from ``/proc/cpuinfo`` (``serving.engine.host_cpu``),
read from written files: the first processor's model name and flags."""

from serving.engine import host_cpu

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Test
flags\t\t: fpu sse2 avx2 fma amx_int8 avx512f amx_bf16
bogomips\t: 4000.00

processor\t: 1
model name\t: Another Model
flags\t\t: fpu avx512_vnni
"""


def test_read_cpuinfo_takes_the_first_processor(tmp_path):
  path = tmp_path / "cpuinfo"
  path.write_text(CPUINFO)
  assert host_cpu.read_cpuinfo(str(path)) == (
      "Intel(R) Xeon(R) Test", ["fpu", "sse2", "avx2", "fma", "amx_int8", "avx512f", "amx_bf16"])


def test_read_cpuinfo_without_the_file_or_its_lines(tmp_path):
  assert host_cpu.read_cpuinfo(str(tmp_path / "absent")) == (None, [])
  path = tmp_path / "cpuinfo"
  path.write_text("processor\t: 0\nFeatures\t: fp asimd\n")      # an ARM kernel's lines
  assert host_cpu.read_cpuinfo(str(path)) == (None, [])


def test_host_cpu_lists_known_extensions_in_their_order(tmp_path, monkeypatch):
  path = tmp_path / "cpuinfo"
  path.write_text(CPUINFO)
  real = host_cpu.read_cpuinfo
  monkeypatch.setattr(host_cpu, "read_cpuinfo", lambda: real(str(path)))
  cpu = host_cpu.host_cpu()
  assert cpu["model"] == "Intel(R) Xeon(R) Test"
  assert cpu["extensions"] == ["avx2", "fma", "avx512f", "amx_bf16", "amx_int8"]
  assert cpu["cores"] >= 1
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert host_cpu.host_cpu()["max_isa"] is None
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=avx2")
  assert host_cpu.host_cpu()["max_isa"] == "AVX2"
