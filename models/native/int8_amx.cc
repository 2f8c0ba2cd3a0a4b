// int8 x int8 -> int32 GEMM with the W8A8 rescale on Intel AMX tiles, as an
// XLA FFI custom call (models/amx.py builds, registers and calls it).
//
//   out[m, n] = float32(sum_k a[m, k] * w[layer, k, n]) * (row_scale[m] * col_scale[layer, n])
//
// Integer sums are exact in any order, and the rescale is the same two
// float32 multiplies, rounded to nearest even, as XLA's in models/quant.py
// `linear`, so the result is bitwise that of the XLA path whatever the
// tiling, the thread split or the row count.
//
// w is a stack of layers in the tile layout (models/amx.py `to_tiles`): a
// layer's [K, N] int8 bytes are the B tiles (k block kb of 64 rows, column
// block nb of 16 columns) at byte (nb * K / 64 + kb) * 1024, tile row r
// holding w[64 kb + 4 r + i][16 nb + j] at byte 4 j + i (AMX's VNNI
// layout). The layer is picked by an operand, so a scanned model passes its
// whole stack and no per-layer copy is made.
//
// Tiles (palette 1): C0..C3 int32 16x16 accumulators (two 16-row by two
// 16-column blocks), A4, A5 int8 16 rows x 64 k, B6, B7 int8 tiles. A work
// item is one 32-column block over every row; items run on XLA's intra-op
// pool.
//
// Operands: a s8[M, K], w s8[L, K, N], row_scale f32[M, 1], col_scale
// f32[L, N], layer s32[] (clamped to [0, L)); K % 64 == 0, N % 32 == 0.
// Result: f32[M, N]. `iterserve_amx_available` says whether the CPU has AMX
// int8 and the OS granted this process the tile state.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Built under an AVX2 cap (attention.native_build: XLA_FLAGS'
// --xla_cpu_max_isa=AVX2) the kernel is unavailable, as on a CPU without
// AVX-512 and AMX.
bool AmxUsable() {
#ifdef ITERSERVE_NO_AVX512
  return false;
#else
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512bw")) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool amx_tile = (edx >> 24) & 1, amx_int8 = (edx >> 25) & 1;
    if (!amx_tile || !amx_int8) return false;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#endif
}

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
void ConfigureTiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

struct Problem {
  const int8_t* a;      // [mp, k], rows past m zero
  const int8_t* w;      // [k, n] in the tile layout
  const float* row_scale;
  const float* col_scale;
  float* out;           // [m, n]
  int64_t m, mp, k, n;
};

// Rescales a 16x16 int32 block into out rows [m0, m0 + rows), columns
// [n0, n0 + 16): float32(c) * (row_scale * col_scale), two roundings.
__attribute__((target("avx512f,avx512bw")))
inline void Rescale(const Problem& pb, const int32_t* c, int64_t m0, int64_t rows, int64_t n0) {
  const __m512 cs = _mm512_loadu_ps(pb.col_scale + n0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(pb.row_scale[m0 + r]), cs);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + 16 * r));
    _mm512_storeu_ps(pb.out + (m0 + r) * pb.n + n0, _mm512_mul_ps(v, s));
  }
}

// Columns [n0, n0 + 32) of out for every row.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
void RunColumns(const Problem& pb, int64_t n0) {
  const int64_t kb_n = pb.k / 64;
  const int8_t* b0 = pb.w + (n0 / 16) * kb_n * 1024;
  const int8_t* b1 = b0 + kb_n * 1024;
  alignas(64) int32_t c[4][256];
  for (int64_t m0 = 0; m0 < pb.mp; m0 += 32) {
    const bool two = m0 + 16 < pb.mp;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kb_n; ++kb) {
      const int8_t* a0 = pb.a + m0 * pb.k + kb * 64;
      _tile_loadd(4, a0, pb.k);
      _tile_loadd(6, b0 + kb * 1024, 64);
      _tile_loadd(7, b1 + kb * 1024, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      if (two) {
        _tile_loadd(5, a0 + 16 * pb.k, pb.k);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    const int64_t rows0 = std::min<int64_t>(16, pb.m - m0);
    if (rows0 > 0) {
      Rescale(pb, c[0], m0, rows0, n0);
      Rescale(pb, c[1], m0, rows0, n0 + 16);
    }
    if (two) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      const int64_t rows1 = std::min<int64_t>(16, pb.m - m0 - 16);
      if (rows1 > 0) {
        Rescale(pb, c[2], m0 + 16, rows1, n0);
        Rescale(pb, c[3], m0 + 16, rows1, n0 + 16);
      }
    }
  }
}

// Work shared by the calling thread and the pool's helpers; helpers that
// start after the work is done find nothing and only drop their reference.
struct Shared {
  Problem pb;
  std::vector<int8_t> a_padded;
  int64_t items;
  std::atomic<int64_t> next{0}, done{0};
};

__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
void Drain(Shared& sh) {
  bool configured = false;
  for (;;) {
    const int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= sh.items) break;
    // Other libraries on this thread (XLA's own AMX GEMMs) load their own
    // tile configuration or release the tiles: load ours, release after.
    if (!configured) ConfigureTiles();
    configured = true;
    RunColumns(sh.pb, 32 * i);
    sh.done.fetch_add(1, std::memory_order_release);
  }
  if (configured) _tile_release();
}

ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> a, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> col_scale,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  if (!AmxUsable()) return ffi::Error::Internal("AMX int8 tiles are not available");
  const auto ad = a.dimensions();
  const auto wd = w.dimensions();
  if (ad.size() != 2 || wd.size() != 3 || ad[1] != wd[1])
    return ffi::Error::InvalidArgument("a must be [M, K] and w [L, K, N]");
  const int64_t m = ad[0], num_layers = wd[0], k = wd[1], n = wd[2];
  if (k % 64 != 0 || n % 32 != 0)
    return ffi::Error::InvalidArgument("K must be a multiple of 64 and N of 32");
  if (col_scale.dimensions().size() != 2 || col_scale.dimensions()[1] != n)
    return ffi::Error::InvalidArgument("col_scale must be [L, N]");
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), num_layers - 1);
  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.m = m;
  pb.mp = std::max<int64_t>(16, (m + 15) / 16 * 16);
  pb.k = k;
  pb.n = n;
  pb.w = w.typed_data() + l * k * n;
  pb.row_scale = row_scale.typed_data();
  pb.col_scale = col_scale.typed_data() + l * n;
  pb.out = out->typed_data();
  if (m == 0) return ffi::Error::Success();
  if (pb.mp == m) {
    pb.a = a.typed_data();
  } else {
    sh->a_padded.assign(pb.mp * k, 0);
    std::memcpy(sh->a_padded.data(), a.typed_data(), m * k);
    pb.a = sh->a_padded.data();
  }
  sh->items = n / 32;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), sh->items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { Drain(*sh); });
  Drain(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

extern "C" int iterserve_amx_available() { return AmxUsable() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveInt8Linear, Int8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
