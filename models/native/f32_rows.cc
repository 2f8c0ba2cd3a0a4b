// float32 GEMM of a few rows against a row-major weight, as an XLA FFI
// custom call (models/rowgemm.py builds, registers and calls it).
//
//   out[m, n] = sum_k x[m, k] * w[k, n]
//
// Every output element is one chain of fused multiply-adds in k order,
// starting from +0: acc = fma(x[m, 0], w[0, n], 0); acc = fma(x[m, 1],
// w[1, n], acc); ... Each fma is exactly rounded, so the result depends on
// the row and the column alone: not on M, on which rows share the call, on
// the register blocking or the thread split, nor on the vector width. A
// row's bits are thus the same in a GEMM of 1 or of 32 rows (tested against
// a numpy reference that runs the same chain).
//
// Two ways to run a call, chosen by the live rows (the bits are the same):
// * at most 4 live rows of a row-major weight (a decode step of 1-4
//   requests: bound by reading the weight): Stream. A work item is a range
//   of columns over every weight row, eight rows at a time (eight
//   sequential read streams), the sums kept in L1.
// * otherwise: a work item is a block of 64 columns over every row, rows in
//   register blocks of up to 6 (6 x 4 zmm accumulators), the weight rows
//   prefetched 32 ahead (row-major rows of one block lie N floats apart);
//   the block's [K, 64] weight panel is read from memory once, from L2 for
//   the next row blocks.
// Items are shared by the calling thread and num_threads - 1 helpers of
// XLA's intra-op pool (one thread per core: a helper more than that shared
// a core with the caller, ~15% slower on 2 cores).
//
// On a CPU without AVX-512F but with AVX2 and FMA (or when built with
// ITERSERVE_NO_AVX512, attention.native_build's AVX2 cap) the same two ways
// run on 8-lane vectors (BlockY, StreamY): a Block item's 64 columns in
// four strips of 16 (2 ymm x up to 6 rows: 12 accumulators of 16
// registers). The fma chains are the same, so the bits are too.
//
// Operands: x f32[M, K], w f32[K, N], live s32[] (rows from `live` on are
// not computed: they are zero). Result: f32[M, N].
// IterserveF32RowsPanels takes w as panels f32[P, K, 64] (panel p holds
// columns [64 p, 64 p + 64), zero past N; rowgemm.to_panels) and returns
// f32[M, 64 P]: the same sums, each item reading one contiguous panel.
// `iterserve_f32_rows_available` says whether the CPU has AVX-512F or AVX2
// with FMA; `iterserve_f32_rows_vector_bits` which path runs (512, 256, 0).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockN = 64;   // columns per work item (4 zmm)
constexpr int kMaxRows = 6;       // rows per register block
constexpr int kStreamRows = 4;    // at most this many live rows: Stream
constexpr int64_t kStreamItems = 4;     // Stream work items per call
constexpr int64_t kStreamCols = 1024;   // most columns of a Stream item
constexpr int64_t kPrefetchRows = 32;   // weight rows read ahead (Block)

bool Has512() {
#ifdef ITERSERVE_NO_AVX512
  return false;
#else
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#endif
}

bool Has256() {
#ifdef ITERSERVE_NO_AVX2
  return false;
#else
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#endif
}

int VectorBits() { return Has512() ? 512 : Has256() ? 256 : 0; }

struct Problem {
  const float* x;   // [m, k]
  const float* w;   // [k, n] row-major, or [ceil(n / 64), k, 64] panels
  float* out;       // [m, n]
  int64_t m, k, n;
  int64_t live;     // rows computed: [0, live); the others are zeroed
  bool panels;
  bool wide;        // AVX-512 (else AVX2 + FMA)
  int64_t stream_cols;   // > 0: Stream items of this many columns
  // Floats between weight rows k and k + 1 of a work item's 64 columns.
  int64_t w_stride() const { return panels ? kBlockN : n; }
  // The first weight float of the item holding column n0.
  const float* w_item(int64_t n0) const { return panels ? w + (n0 / kBlockN) * k * kBlockN : w + n0; }
};

// Rows [m0, m0 + R) and columns [n0, n0 + 64) of out; vector v's lanes
// beyond the weight's columns are masked off (mask[v]: loads read zeros,
// stores skip them). The accumulators are named registers: an array of
// vectors is kept in memory by GCC, a store per fma.
#define ITERSERVE_ROW(r)                                                        \
  if constexpr (R > r) {                                                       \
    const __m512 b = _mm512_set1_ps(x[r * pb.k + k]);                          \
    c##r##0 = _mm512_fmadd_ps(b, w0, c##r##0);                                 \
    c##r##1 = _mm512_fmadd_ps(b, w1, c##r##1);                                 \
    c##r##2 = _mm512_fmadd_ps(b, w2, c##r##2);                                 \
    c##r##3 = _mm512_fmadd_ps(b, w3, c##r##3);                                 \
  }
#define ITERSERVE_STORE(r)                                                      \
  if constexpr (R > r) {                                                       \
    float* o = pb.out + (m0 + r) * pb.n + n0;                                  \
    _mm512_mask_storeu_ps(o, mask[0], c##r##0);                                \
    _mm512_mask_storeu_ps(o + 16, mask[1], c##r##1);                           \
    _mm512_mask_storeu_ps(o + 32, mask[2], c##r##2);                           \
    _mm512_mask_storeu_ps(o + 48, mask[3], c##r##3);                           \
  }

template <int R>
__attribute__((target("avx512f")))
void Block(const Problem& pb, int64_t m0, int64_t n0, const __mmask16* mask) {
  const __m512 z = _mm512_setzero_ps();
  __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  __m512 c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
  __m512 c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
  const float* w = pb.w_item(n0);
  const float* x = pb.x + m0 * pb.k;
  const int64_t stride = pb.w_stride();
  const int64_t ahead = kPrefetchRows * stride;
  for (int64_t k = 0; k < pb.k; ++k, w += stride) {
    if (k + kPrefetchRows < pb.k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead + 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead + 48), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_maskz_loadu_ps(mask[0], w);
    const __m512 w1 = _mm512_maskz_loadu_ps(mask[1], w + 16);
    const __m512 w2 = _mm512_maskz_loadu_ps(mask[2], w + 32);
    const __m512 w3 = _mm512_maskz_loadu_ps(mask[3], w + 48);
    ITERSERVE_ROW(0)
    ITERSERVE_ROW(1)
    ITERSERVE_ROW(2)
    ITERSERVE_ROW(3)
    ITERSERVE_ROW(4)
    ITERSERVE_ROW(5)
  }
  ITERSERVE_STORE(0)
  ITERSERVE_STORE(1)
  ITERSERVE_STORE(2)
  ITERSERVE_STORE(3)
  ITERSERVE_STORE(4)
  ITERSERVE_STORE(5)
}
#undef ITERSERVE_ROW
#undef ITERSERVE_STORE

// Few rows, row-major weight: live rows [0, R) and columns [c0, c1), the
// weight rows streamed whole (k outer), the sums kept in L1. The same fma
// chains in the same k order as Block, so the same bits.
template <int R>
__attribute__((target("avx512f")))
void Stream(const Problem& pb, int64_t c0, int64_t c1) {
  alignas(64) float acc[R][kStreamCols];
  const int64_t cols = c1 - c0;
  const int64_t vectors = (cols + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (cols - 16 * (vectors - 1))) - 1u);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vectors; ++v) _mm512_store_ps(acc[r] + 16 * v, _mm512_setzero_ps());
  const int64_t n = pb.n;
  int64_t k = 0;
  // Eight weight rows at a time: eight sequential read streams.
  for (; k + 8 <= pb.k; k += 8) {
    const float* w = pb.w + k * n + c0;
    __m512 b[R][8];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 8; ++j) b[r][j] = _mm512_set1_ps(pb.x[r * pb.k + k + j]);
    for (int64_t v = 0; v < vectors; ++v) {
      const __mmask16 m = v + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 wv[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * n + 16 * v);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_load_ps(acc[r] + 16 * v);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a = _mm512_fmadd_ps(b[r][j], wv[j], a);
        _mm512_store_ps(acc[r] + 16 * v, a);
      }
    }
  }
  for (; k < pb.k; ++k) {
    const float* w = pb.w + k * n + c0;
    for (int64_t v = 0; v < vectors; ++v) {
      const __mmask16 m = v + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
      const __m512 wv = _mm512_maskz_loadu_ps(m, w + 16 * v);
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(acc[r] + 16 * v, _mm512_fmadd_ps(_mm512_set1_ps(pb.x[r * pb.k + k]), wv,
                                                         _mm512_load_ps(acc[r] + 16 * v)));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vectors; ++v) {
      const __mmask16 m = v + 1 < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
      _mm512_mask_storeu_ps(pb.out + r * pb.n + c0 + 16 * v, m, _mm512_load_ps(acc[r] + 16 * v));
    }
}

// Columns [n0, min(n0 + 64, n)) of out for every live row (rows from
// pb.live on are zero).
__attribute__((target("avx512f")))
void RunColumns(const Problem& pb, int64_t n0) {
  __mmask16 mask[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t lanes = std::clamp<int64_t>(pb.n - n0 - 16 * v, 0, 16);
    mask[v] = static_cast<__mmask16>((1u << lanes) - 1u);
  }
  int64_t m0 = 0;
  for (; m0 + kMaxRows <= pb.live; m0 += kMaxRows) Block<kMaxRows>(pb, m0, n0, mask);
  switch (pb.live - m0) {
    case 1: Block<1>(pb, m0, n0, mask); break;
    case 2: Block<2>(pb, m0, n0, mask); break;
    case 3: Block<3>(pb, m0, n0, mask); break;
    case 4: Block<4>(pb, m0, n0, mask); break;
    case 5: Block<5>(pb, m0, n0, mask); break;
    default: break;
  }
  const __m512 z = _mm512_setzero_ps();
  for (int64_t m = pb.live; m < pb.m; ++m)
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(pb.out + m * pb.n + n0 + 16 * v, mask[v], z);
}

// Item i of a streamed call: columns [i * cols, min((i + 1) * cols, n)).
__attribute__((target("avx512f")))
void RunStream(const Problem& pb, int64_t i) {
  const int64_t c0 = i * pb.stream_cols, c1 = std::min<int64_t>(c0 + pb.stream_cols, pb.n);
  switch (pb.live) {
    case 1: Stream<1>(pb, c0, c1); break;
    case 2: Stream<2>(pb, c0, c1); break;
    case 3: Stream<3>(pb, c0, c1); break;
    case 4: Stream<4>(pb, c0, c1); break;
    default: break;
  }
  const __m512 z = _mm512_setzero_ps();
  for (int64_t m = pb.live; m < pb.m; ++m)
    for (int64_t c = c0; c < c1; c += 16)
      _mm512_mask_storeu_ps(pb.out + m * pb.n + c,
                            static_cast<__mmask16>((1u << std::min<int64_t>(16, c1 - c)) - 1u), z);
}

// ---- AVX2 + FMA: 8-lane vectors ----

// Lanes [0, count) of an 8-lane mask (count clamped to [0, 8]).
__attribute__((target("avx2")))
__m256i LaneMask(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int c = static_cast<int>(std::clamp<int64_t>(count, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane);
}

template <bool Tail>
__attribute__((target("avx2"))) inline __m256 LoadY(const float* p, __m256i mask) {
  if constexpr (Tail) return _mm256_maskload_ps(p, mask);
  else return _mm256_loadu_ps(p);
}

// Rows [m0, m0 + R) and columns [c0, c0 + 8 V) of out: a strip of a Block
// item, R * V <= 12 accumulators (of 16 ymm registers; at least 8, the
// fma latency times its two ports, where R allows). Tail: some of those
// columns lie past the weight's (mask[v]: loads read zeros, stores skip).
#define ITERSERVE_ACC_Y(r)                                                      \
  __m256 c##r##0 = z, c##r##1 = z, c##r##2 = z, c##r##3 = z;                    \
  __m256 c##r##4 = z, c##r##5 = z, c##r##6 = z, c##r##7 = z;
#define ITERSERVE_FMA_Y(r, v)                                                   \
  if constexpr (V > v) c##r##v = _mm256_fmadd_ps(b, w##v, c##r##v);
#define ITERSERVE_ROW_Y(r)                                                      \
  if constexpr (R > r) {                                                       \
    const __m256 b = _mm256_broadcast_ss(x + r * pb.k + k);                    \
    ITERSERVE_FMA_Y(r, 0) ITERSERVE_FMA_Y(r, 1) ITERSERVE_FMA_Y(r, 2)          \
    ITERSERVE_FMA_Y(r, 3) ITERSERVE_FMA_Y(r, 4) ITERSERVE_FMA_Y(r, 5)          \
    ITERSERVE_FMA_Y(r, 6) ITERSERVE_FMA_Y(r, 7)                                \
  }
#define ITERSERVE_STORE1_Y(r, v)                                                \
  if constexpr (V > v) {                                                       \
    if constexpr (Tail) _mm256_maskstore_ps(o + 8 * v, mask[v], c##r##v);      \
    else _mm256_storeu_ps(o + 8 * v, c##r##v);                                 \
  }
#define ITERSERVE_STORE_Y(r)                                                    \
  if constexpr (R > r) {                                                       \
    float* o = pb.out + (m0 + r) * pb.n + c0;                                  \
    ITERSERVE_STORE1_Y(r, 0) ITERSERVE_STORE1_Y(r, 1) ITERSERVE_STORE1_Y(r, 2) \
    ITERSERVE_STORE1_Y(r, 3) ITERSERVE_STORE1_Y(r, 4) ITERSERVE_STORE1_Y(r, 5) \
    ITERSERVE_STORE1_Y(r, 6) ITERSERVE_STORE1_Y(r, 7)                          \
  }

template <int R, int V, bool Tail>
__attribute__((target("avx2,fma")))
void BlockY(const Problem& pb, int64_t m0, int64_t c0, const float* w, int64_t stride,
            const __m256i* mask) {
  static_assert(R * V <= 12 && V <= 8);
  const __m256 z = _mm256_setzero_ps();
  ITERSERVE_ACC_Y(0) ITERSERVE_ACC_Y(1) ITERSERVE_ACC_Y(2)
  ITERSERVE_ACC_Y(3) ITERSERVE_ACC_Y(4) ITERSERVE_ACC_Y(5)
  const float* x = pb.x + m0 * pb.k;
  const int64_t ahead = kPrefetchRows * stride;
  const float* row = w - c0 % kBlockN;   // the item's first column
  const bool first = c0 % kBlockN == 0;
  for (int64_t k = 0; k < pb.k; ++k, w += stride, row += stride) {
    // The first strip fetches the item's whole 256-byte weight rows ahead
    // (the later strips' rows are then in L2), the others their own lines.
    if (k + kPrefetchRows < pb.k) {
      if (first)
        for (int line = 0; line < 4; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(row + ahead + 16 * line), _MM_HINT_T0);
      else
        for (int v = 0; v < V; v += 2)
          _mm_prefetch(reinterpret_cast<const char*>(w + ahead + 8 * v), _MM_HINT_T0);
    }
    const __m256 w0 = LoadY<Tail>(w, mask[0]);
    const __m256 w1 = V > 1 ? LoadY<Tail>(w + 8, mask[1]) : z;
    const __m256 w2 = V > 2 ? LoadY<Tail>(w + 16, mask[2]) : z;
    const __m256 w3 = V > 3 ? LoadY<Tail>(w + 24, mask[3]) : z;
    const __m256 w4 = V > 4 ? LoadY<Tail>(w + 32, mask[4]) : z;
    const __m256 w5 = V > 5 ? LoadY<Tail>(w + 40, mask[5]) : z;
    const __m256 w6 = V > 6 ? LoadY<Tail>(w + 48, mask[6]) : z;
    const __m256 w7 = V > 7 ? LoadY<Tail>(w + 56, mask[7]) : z;
    ITERSERVE_ROW_Y(0)
    ITERSERVE_ROW_Y(1)
    ITERSERVE_ROW_Y(2)
    ITERSERVE_ROW_Y(3)
    ITERSERVE_ROW_Y(4)
    ITERSERVE_ROW_Y(5)
  }
  ITERSERVE_STORE_Y(0)
  ITERSERVE_STORE_Y(1)
  ITERSERVE_STORE_Y(2)
  ITERSERVE_STORE_Y(3)
  ITERSERVE_STORE_Y(4)
  ITERSERVE_STORE_Y(5)
}
#undef ITERSERVE_ACC_Y
#undef ITERSERVE_FMA_Y
#undef ITERSERVE_ROW_Y
#undef ITERSERVE_STORE1_Y
#undef ITERSERVE_STORE_Y

// Rows [m0, m0 + R) of columns [n0, min(n0 + 64, n)), in strips of 8 V;
// item: the item's weight columns [n0, n0 + 64), rows `stride` apart.
template <int R, int V>
__attribute__((target("avx2,fma")))
void RowsY(const Problem& pb, int64_t m0, int64_t n0, const float* item, int64_t stride) {
  for (int64_t c0 = n0; c0 < std::min(n0 + kBlockN, pb.n); c0 += 8 * V) {
    __m256i mask[V];
    for (int v = 0; v < V; ++v) mask[v] = LaneMask(pb.n - c0 - 8 * v);
    const float* w = item + (c0 - n0);
    if (c0 + 8 * V <= pb.n) BlockY<R, V, false>(pb, m0, c0, w, stride, mask);
    else BlockY<R, V, true>(pb, m0, c0, w, stride, mask);
  }
}

// Zeros in columns [c0, c1) of the rows past pb.live.
__attribute__((target("avx2")))
void ZeroDeadY(const Problem& pb, int64_t c0, int64_t c1) {
  for (int64_t m = pb.live; m < pb.m; ++m)
    for (int64_t c = c0; c < c1; c += 8)
      _mm256_maskstore_ps(pb.out + m * pb.n + c, LaneMask(c1 - c), _mm256_setzero_ps());
}

// Columns [n0, min(n0 + 64, n)) of out for every live row: blocks of 6
// rows in strips of 16 columns, the last block's strips as wide as its
// rows leave accumulators for (1 row: all 64 columns; 2-3: 32). (Copying a
// row-major item into a contiguous panel first was no faster.)
__attribute__((target("avx2,fma")))
void RunColumnsY(const Problem& pb, int64_t n0) {
  const float* item = pb.w_item(n0);
  const int64_t stride = pb.w_stride();
  int64_t m0 = 0;
  for (; m0 + kMaxRows <= pb.live; m0 += kMaxRows) RowsY<kMaxRows, 2>(pb, m0, n0, item, stride);
  switch (pb.live - m0) {
    case 1: RowsY<1, 8>(pb, m0, n0, item, stride); break;
    case 2: RowsY<2, 4>(pb, m0, n0, item, stride); break;
    case 3: RowsY<3, 4>(pb, m0, n0, item, stride); break;
    case 4: RowsY<4, 2>(pb, m0, n0, item, stride); break;
    case 5: RowsY<5, 2>(pb, m0, n0, item, stride); break;
    default: break;
  }
  ZeroDeadY(pb, n0, std::min(n0 + kBlockN, pb.n));
}

// Stream on 8-lane vectors: the same order as Stream.
template <int R>
__attribute__((target("avx2,fma")))
void StreamY(const Problem& pb, int64_t c0, int64_t c1) {
  alignas(64) float acc[R][kStreamCols];
  const int64_t cols = c1 - c0;
  const int64_t vectors = (cols + 7) / 8;
  const __m256i tail = LaneMask(cols - 8 * (vectors - 1));
  const __m256i all = LaneMask(8);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vectors; ++v) _mm256_store_ps(acc[r] + 8 * v, _mm256_setzero_ps());
  const int64_t n = pb.n;
  int64_t k = 0;
  // Full vectors load plainly (a masked load costs more), the last one
  // masked where the item's columns end inside it.
  const int64_t full = cols / 8;
  for (; k + 8 <= pb.k; k += 8) {
    const float* w = pb.w + k * n + c0;
    __m256 b[R][8];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 8; ++j) b[r][j] = _mm256_broadcast_ss(pb.x + r * pb.k + k + j);
    for (int64_t v = 0; v < vectors; ++v) {
      __m256 wv[8];
      if (v < full) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) wv[j] = _mm256_loadu_ps(w + j * n + 8 * v);
      } else {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) wv[j] = _mm256_maskload_ps(w + j * n + 8 * v, tail);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256 a = _mm256_load_ps(acc[r] + 8 * v);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) a = _mm256_fmadd_ps(b[r][j], wv[j], a);
        _mm256_store_ps(acc[r] + 8 * v, a);
      }
    }
  }
  for (; k < pb.k; ++k) {
    const float* w = pb.w + k * n + c0;
    for (int64_t v = 0; v < vectors; ++v) {
      const __m256 wv = _mm256_maskload_ps(w + 8 * v, v + 1 < vectors ? all : tail);
      for (int r = 0; r < R; ++r)
        _mm256_store_ps(acc[r] + 8 * v,
                        _mm256_fmadd_ps(_mm256_broadcast_ss(pb.x + r * pb.k + k), wv,
                                        _mm256_load_ps(acc[r] + 8 * v)));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vectors; ++v)
      _mm256_maskstore_ps(pb.out + r * pb.n + c0 + 8 * v, v + 1 < vectors ? all : tail,
                          _mm256_load_ps(acc[r] + 8 * v));
}

__attribute__((target("avx2,fma")))
void RunStreamY(const Problem& pb, int64_t i) {
  const int64_t c0 = i * pb.stream_cols, c1 = std::min<int64_t>(c0 + pb.stream_cols, pb.n);
  switch (pb.live) {
    case 1: StreamY<1>(pb, c0, c1); break;
    case 2: StreamY<2>(pb, c0, c1); break;
    case 3: StreamY<3>(pb, c0, c1); break;
    case 4: StreamY<4>(pb, c0, c1); break;
    default: break;
  }
  ZeroDeadY(pb, c0, c1);
}

// Work shared by the calling thread and the pool's helpers; helpers that
// start after the work is done find nothing and only drop their reference.
struct Shared {
  Problem pb;
  int64_t items;
  std::atomic<int64_t> next{0}, done{0};
};

void Drain(Shared& sh) {
  for (;;) {
    const int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= sh.items) break;
    if (sh.pb.wide) {
      if (sh.pb.stream_cols) RunStream(sh.pb, i);
      else RunColumns(sh.pb, kBlockN * i);
    } else {
      if (sh.pb.stream_cols) RunStreamY(sh.pb, i);
      else RunColumnsY(sh.pb, kBlockN * i);
    }
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Run(ffi::ThreadPool& pool, const float* x, const float* w, float* out, int64_t m,
               int64_t k, int64_t n, int64_t live, bool panels) {
  if (!VectorBits()) return ffi::Error::Internal("this CPU has neither AVX-512F nor AVX2 with FMA");
  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.x = x;
  pb.w = w;
  pb.out = out;
  pb.m = m;
  pb.k = k;
  pb.n = n;
  pb.live = std::min<int64_t>(std::max<int64_t>(live, 0), m);
  pb.panels = panels;
  pb.wide = VectorBits() == 512;
  if (m == 0 || n == 0) return ffi::Error::Success();
  // Up to kStreamRows live rows of a row-major weight: kStreamItems items
  // of whole weight rows' columns (a multiple of 16, at most kStreamCols).
  pb.stream_cols = 0;
  if (!panels && pb.live <= kStreamRows) {
    const int64_t cols = ((n + kStreamItems - 1) / kStreamItems + 15) / 16 * 16;
    if (cols <= kStreamCols) pb.stream_cols = cols;
  }
  sh->items = pb.stream_cols ? (n + pb.stream_cols - 1) / pb.stream_cols
                             : (n + kBlockN - 1) / kBlockN;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, sh->items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { Drain(*sh); });
  Drain(*sh);
  while (sh->done.load(std::memory_order_acquire) < sh->items) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error F32Rows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("x must be [M, K] and w [K, N]");
  return Run(pool, x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1], wd[1],
             live.typed_data()[0], false);
}

ffi::Error F32RowsPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] != kBlockN)
    return ffi::Error::InvalidArgument("x must be [M, K] and w [P, K, 64]");
  return Run(pool, x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1],
             wd[0] * kBlockN, live.typed_data()[0], true);
}

}  // namespace

extern "C" int iterserve_f32_rows_available() { return VectorBits() ? 1 : 0; }
extern "C" int iterserve_f32_rows_vector_bits() { return VectorBits(); }

// Both handlers bind x, w, live and the result alike.
#define ITERSERVE_F32_ROWS_BINDING                                              \
  ffi::Ffi::Bind()                                                             \
      .Ctx<ffi::ThreadPool>()                                                  \
      .Arg<ffi::Buffer<ffi::F32>>()                                            \
      .Arg<ffi::Buffer<ffi::F32>>()                                            \
      .Arg<ffi::Buffer<ffi::S32>>()                                            \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveF32Rows, F32Rows, ITERSERVE_F32_ROWS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveF32RowsPanels, F32RowsPanels, ITERSERVE_F32_ROWS_BINDING);
