"""``attention.native_build``: the one build-and-load path of the native
kernels; a build's name follows its source's bytes, and a missing source is
a reason naming the file (not a fallback without one)."""

import pytest

from attention import native, native_build
from models import amx, rowgemm
from scheduler import keys, scan

KERNELS = (native.KERNEL, amx.KERNEL, rowgemm.KERNEL, keys.SORT_KERNEL, scan.SCAN_KERNEL)


def _copy(kernel, tmp_path, text=None):
  source = tmp_path / kernel.source.name
  source.write_bytes(kernel.source.read_bytes() if text is None else text)
  return native_build.Kernel(kernel.name, source, kernel.targets, kernel.probe, kernel.missing)


def test_every_kernel_source_is_a_packaged_cc_file_of_its_package():
  names = [(k.source.parent.parent.name, k.source.parent.name, k.source.name) for k in KERNELS]
  assert names == [("attention", "native", "ragged_cpu.cc"), ("models", "native", "int8_amx.cc"),
                   ("models", "native", "f32_rows.cc"), ("scheduler", "native", "sort_u32.cc"),
                   ("scheduler", "native", "scan_i32.cc")]
  assert all(k.source.is_file() for k in KERNELS)
  targets = [t for k in KERNELS for t, _ in k.targets]
  assert len(targets) == len(set(targets)) == 9


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.source.stem)
def test_the_library_name_hashes_the_source_bytes(kernel, tmp_path):
  same = _copy(kernel, tmp_path)
  name = native_build.library_name(kernel)
  assert name.startswith(kernel.source.stem + "-") and name.endswith(".so")
  assert len(name) == len(kernel.source.stem) + 1 + 20 + 3
  assert native_build.library_name(same) == name          # bytes, not the path
  edited = _copy(kernel, tmp_path, kernel.source.read_bytes() + b"\n// edited\n")
  assert native_build.library_name(edited) != name


def test_the_library_name_follows_the_compiler(monkeypatch):
  name = native_build.library_name(amx.KERNEL)
  monkeypatch.setenv("CXX", "clang++")
  assert native_build.library_name(amx.KERNEL) != name


def test_a_missing_source_is_a_reason_naming_the_file(tmp_path, monkeypatch):
  monkeypatch.setenv("ITERSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
  gone = native_build.Kernel("the float32 row kernel", tmp_path / "f32_rows.cc",
                             rowgemm.KERNEL.targets, rowgemm.KERNEL.probe, rowgemm.KERNEL.missing)
  reason = native_build.load(gone)
  assert reason == (f"the float32 row kernel's source {tmp_path / 'f32_rows.cc'} is missing "
                    f"(No such file or directory): the package was installed without its .cc "
                    f"package data")
  with pytest.raises(native_build.NativeUnavailable, match="is missing"):
    native_build.library_path(gone)
  with pytest.raises(ValueError, match=r"^decode_gemm 'native': the float32 row kernel's source"):
    native_build.resolve_choice("decode_gemm", "native", rowgemm.GEMMS, "native",
                                lambda: native_build.load(gone))
  assert native_build.resolve_choice("decode_gemm", "auto", rowgemm.GEMMS, "native",
                                     lambda: native_build.load(gone)) == "xla"
  assert not (tmp_path / "cache").exists()


def test_a_compiler_that_is_not_there_is_named(tmp_path, monkeypatch):
  monkeypatch.setenv("ITERSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
  with pytest.raises(native_build.NativeUnavailable) as e:
    native_build.library_path(_copy(native.KERNEL, tmp_path))
  assert str(e.value) == f"C++ compiler '{tmp_path / 'no-such-c++'}' not found (set CXX)"


@pytest.mark.skipif(native.unavailable_reason() is not None,
                    reason=f"native kernel: {native.unavailable_reason()}")
def test_a_built_library_is_reused_from_the_cache_and_loaded_once(tmp_path):
  path = native_build.library_path(native.KERNEL)
  assert path.parent == native_build.cache_dir()
  assert path.name == native_build.library_name(native.KERNEL)
  assert native_build.library_path(native.KERNEL) == path      # no rebuild: the same file
  assert native_build.load(native.KERNEL) is None
  assert native_build.load.cache_info().hits >= 1


def test_xlas_instruction_set_cap_caps_the_native_builds(monkeypatch):
  """``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` builds the kernels without AVX-512
  (another library name); a cap of AVX-512 or none changes nothing; the
  last flag wins, as in XLA; a value XLA does not know is refused."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  plain = native_build.library_name(rowgemm.KERNEL)
  assert native_build.max_isa() is None and native_build.build_flags() == native_build.FLAGS
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 "
                                  "--xla_cpu_max_isa=avx512 --xla_cpu_max_isa=avx2")
  assert native_build.max_isa() == "AVX2"
  flags = native_build.build_flags()
  assert flags[:len(native_build.FLAGS)] == native_build.FLAGS
  assert {"-mno-avx512f", "-DITERSERVE_NO_AVX512"} <= set(flags) and "-mno-avx2" not in flags
  capped = native_build.library_name(rowgemm.KERNEL)
  assert capped != plain
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2")
  assert {"-mno-avx2", "-mno-fma", "-DITERSERVE_NO_AVX2"} <= set(native_build.build_flags())
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX512")
  assert native_build.build_flags() == native_build.FLAGS
  assert native_build.library_name(rowgemm.KERNEL) == plain
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=bogus")
  with pytest.raises(ValueError, match=r"--xla_cpu_max_isa must be one of SSE4_2, AVX, AVX2, "
                                       r".*got 'BOGUS'"):
    native_build.build_flags()
