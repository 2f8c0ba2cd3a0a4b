// Ragged paged attention for packed iterations on the CPU, as an XLA FFI
// custom call (attention/native.py builds, registers and calls it).
//
// Every query row is computed by the same code whatever else shares the
// launch. A row walks its own sequence's key blocks [j * Bk, (j + 1) * Bk)
// in order with a float32 online softmax; within a block:
//   scores  q . k over head_dim in 16 lanes (chunks of 16 dims added in
//           order), the lanes folded by one fixed tree (Reduce16);
//   max     exact in any order;
//   p       exp(s - m) by a fixed polynomial (Exp), not libm's;
//   sum     p in 16 lanes by vector of keys in order, then Reduce16's tree;
//   P@V     key i into accumulator set i % 4 (keys in order within a set),
//           the sets added as (0 + 1) + (2 + 3).
// Which keys a row sees depends only on its position, and vectors of keys
// it does not see are skipped (they would add exact zeros). Nothing depends
// on the batch, the row's neighbours, how its prompt was chunked or how the
// work was split across threads, so a row's bits are batch- and
// chunk-invariant by construction. One binary gives the same bits for a row
// everywhere; another compiler or -march may round differently.
//
// Written with GCC's vector extensions (__builtin_shuffle: g++ only), which
// compile to AVX-512, AVX2 or SSE registers for the -march given; on AVX2
// without AVX-512 a 16-lane value is a pair of 8-lane halves (V below).
//
// Operands (attention/ragged.py's layout):
//   q          f32[T, Hq, D]
//   k_pages    [P, page_size, Hkv, D] f32, or u16 / bf16 holding bfloat16
//   v_pages    same as k_pages
//   kv_lens    s32[S]
//   page_table s32[S, pages_per_seq]
//   cu_q_lens  s32[S + 1]
//   num_seqs   s32[1]
// Attributes: sm_scale f32, soft_cap f32 (0: none), sliding_window s64
// (0: none), block_kv s64 (keys per block, a multiple of page_size).
// Result: f32[T, Hq, D]; rows at or past cu_q_lens[num_seqs] are zero.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;      // one vector: 16 float32 lanes
constexpr int kRowTile = 16;    // query rows per work item

// V: 16 float32 lanes; VI: 16 int32 lanes (masks: -1 / 0). Where the
// target has 512-bit vectors (or no AVX2) they are GCC vector types; on
// AVX2 without AVX-512 a 64-byte vector type has no register and GCC keeps
// every such value in memory (stores in 16-byte pieces read back 32 bytes
// at a time: ~10x slower prompt chunks), so there V and VI are pairs of
// 8-lane halves with the same lane-wise operations: the same bits.
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t VI8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t VH8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t VU8 __attribute__((vector_size(32)));
struct V { V8 lo, hi; };
struct VI { VI8 lo, hi; };
inline V operator+(V a, V b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline V operator-(V a, V b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline V operator*(V a, V b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline V operator+(V a, float b) { return {a.lo + b, a.hi + b}; }
inline V operator-(V a, float b) { return {a.lo - b, a.hi - b}; }
inline V operator*(V a, float b) { return {a.lo * b, a.hi * b}; }
inline V operator*(float a, V b) { return {a * b.lo, a * b.hi}; }
inline VI operator>(V a, V b) { return {a.lo > b.lo, a.hi > b.hi}; }
inline VI operator>(V a, float b) { return {a.lo > b, a.hi > b}; }
inline VI operator!(VI a) { return {!a.lo, !a.hi}; }
inline VI operator&(VI a, VI b) { return {a.lo & b.lo, a.hi & b.hi}; }
inline VI operator+(VI a, int32_t b) { return {a.lo + b, a.hi + b}; }
inline VI operator<<(VI a, int b) { return {a.lo << b, a.hi << b}; }
inline VI operator>=(VI a, int32_t b) { return {a.lo >= b, a.hi >= b}; }
inline VI operator<(VI a, int32_t b) { return {a.lo < b, a.hi < b}; }
inline V Load(const float* p) {
  return {*reinterpret_cast<const V8u*>(p), *reinterpret_cast<const V8u*>(p + 8)};
}
inline void Store(float* p, V v) {
  *reinterpret_cast<V8u*>(p) = v.lo;
  *reinterpret_cast<V8u*>(p + 8) = v.hi;
}
inline V Splat(float x) { return {V8{} + x, V8{} + x}; }
inline VI Iota() { return {VI8{0, 1, 2, 3, 4, 5, 6, 7}, VI8{8, 9, 10, 11, 12, 13, 14, 15}}; }
inline V Select(VI m, V a, V b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
inline float Lane(V v, int i) { return i < 8 ? v.lo[i] : v.hi[i - 8]; }
inline VI ToInt(V x) {
  return {__builtin_convertvector(x.lo, VI8), __builtin_convertvector(x.hi, VI8)};
}
inline V AsFloat(VI x) { return {(V8)x.lo, (V8)x.hi}; }   // bit casts
// 16 bfloat16 bit patterns -> float32 (the bits shifted into the high half).
inline V WidenBf16(const uint16_t* p) {
  const VU8 lo = __builtin_convertvector(*reinterpret_cast<const VH8u*>(p), VU8) << 16;
  const VU8 hi = __builtin_convertvector(*reinterpret_cast<const VH8u*>(p + 8), VU8) << 16;
  return {(V8)lo, (V8)hi};
}
#else
typedef float V __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t VI __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t VU __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t VH __attribute__((vector_size(32), aligned(2), may_alias));

inline V Load(const float* p) { return *reinterpret_cast<const V*>(p); }
inline void Store(float* p, V v) { *reinterpret_cast<V*>(p) = v; }
inline V Splat(float x) { return V{} + x; }
inline VI Iota() { return VI{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
inline V Select(VI m, V a, V b) { return m ? a : b; }
inline float Lane(V v, int i) { return v[i]; }
inline VI ToInt(V x) { return __builtin_convertvector(x, VI); }
inline V AsFloat(VI x) { return reinterpret_cast<const V&>(x); }
inline V WidenBf16(const uint16_t* p) {
  const VU b = __builtin_convertvector(*reinterpret_cast<const VH*>(p), VU) << 16;
  return reinterpret_cast<const V&>(b);
}
#endif

// The dot of one key with q over head_dim: lane l sums q[c][l] * k[c][l]
// over the NC chunks c in order.
template <int NC>
inline V DotLanes(const V* q, const float* k) {
  V t = q[0] * Load(k);
  for (int c = 1; c < NC; ++c) t = t + q[c] * Load(k + c * kLanes);
  return t;
}

// exp(x) lane by lane, branch-free: x = k ln2 + r (|r| <= ln2 / 2), a
// degree-6 polynomial for e^r, scaled by 2^k. Lanes below -87.3 (and -inf)
// give 0; the softmax only passes inputs <= 0.
inline V Exp(V x) {
  const VI zero = !(x > -87.3f);
  x = Select(zero, Splat(0.0f), x);
  const V kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = x - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  V p = Splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V scale = AsFloat((ToInt(kf) + 127) << 23);
  return Select(zero, Splat(0.0f), p * scale);
}

// Lane sums of 16 vectors in one vector (lane i = the sum of a[i]'s lanes),
// by four levels of pairwise folds: every sum is the same tree of adds.
#if defined(__AVX2__) && !defined(__AVX512F__)
// The same four levels on 8-lane halves: level 1 adds each vector's halves;
// levels 2-4 fold within a vector's halves (the lanes as in the other
// definition's shuffles).
inline V8 Fold8(V8 a, V8 b, VI8 lo, VI8 hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
inline V Reduce16(V* a) {
  constexpr VI8 l2_lo = {0, 1, 2, 3, 8, 9, 10, 11}, l2_hi = {4, 5, 6, 7, 12, 13, 14, 15};
  constexpr VI8 l3_lo = {0, 1, 4, 5, 8, 9, 12, 13}, l3_hi = {2, 3, 6, 7, 10, 11, 14, 15};
  constexpr VI8 l4_lo = {0, 2, 4, 6, 8, 10, 12, 14}, l4_hi = {1, 3, 5, 7, 9, 11, 13, 15};
  V b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    V x = a[2 * i], y = a[2 * i + 1];
    // Where a holds plain products (head_dim 16), GCC would fuse them into
    // this add (an fma); the other definition's shuffle keeps multiply and
    // add apart. The empty asm makes the halves opaque, so neither fuses.
    asm("" : "+x"(x.lo), "+x"(x.hi), "+x"(y.lo), "+x"(y.hi));
    b[i] = {x.lo + x.hi, y.lo + y.hi};
  }
  for (int i = 0; i < 4; ++i)
    c[i] = {Fold8(b[2 * i].lo, b[2 * i].hi, l2_lo, l2_hi),
            Fold8(b[2 * i + 1].lo, b[2 * i + 1].hi, l2_lo, l2_hi)};
  for (int i = 0; i < 2; ++i)
    d[i] = {Fold8(c[2 * i].lo, c[2 * i].hi, l3_lo, l3_hi),
            Fold8(c[2 * i + 1].lo, c[2 * i + 1].hi, l3_lo, l3_hi)};
  return {Fold8(d[0].lo, d[0].hi, l4_lo, l4_hi), Fold8(d[1].lo, d[1].hi, l4_lo, l4_hi)};
}
#else
inline V Reduce16(V* a) {
  constexpr VI l1_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr VI l1_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  constexpr VI l2_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  constexpr VI l2_hi = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  constexpr VI l3_lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  constexpr VI l3_hi = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  constexpr VI l4_lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  constexpr VI l4_hi = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  V b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l1_lo) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], l1_hi);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l2_lo) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], l2_hi);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], l3_lo) +
           __builtin_shuffle(c[2 * i], c[2 * i + 1], l3_hi);
  return __builtin_shuffle(d[0], d[1], l4_lo) + __builtin_shuffle(d[0], d[1], l4_hi);
}
#endif

struct Problem {
  const float* q;
  const void* k_pages;
  const void* v_pages;
  bool bf16_pages;
  const int32_t* kv_lens;
  const int32_t* page_table;
  const int32_t* cu_q_lens;
  float* out;
  int64_t num_pages, page_size, hkv, hq, d, pages_per_seq;
  int64_t group, bk, bkp;   // keys per block, padded to whole vectors
  float sm_scale, soft_cap;
  int64_t window;
};

struct Item {
  int32_t seq, row0, rows;
};

// Widens key rows [k0, k0 + nk) of sequence `seq`, every KV head, into
// k[Hkv][bkp][D] and v[Hkv][bkp][D] (float32), reading each key's page row
// (all heads) once; rows from nk to the end of its vector of keys are zero.
template <int NC>
void LoadBlock(const Problem& pb, int seq, int64_t k0, int64_t nk, float* k, float* v) {
  constexpr int64_t d = NC * kLanes;
  const int64_t end = std::min<int64_t>(pb.bkp, (nk + kLanes - 1) / kLanes * kLanes);
  for (int64_t h = 0; h < pb.hkv; ++h) {
    std::fill(k + (h * pb.bkp + nk) * d, k + (h * pb.bkp + end) * d, 0.0f);
    std::fill(v + (h * pb.bkp + nk) * d, v + (h * pb.bkp + end) * d, 0.0f);
  }
  const int32_t* table = pb.page_table + static_cast<int64_t>(seq) * pb.pages_per_seq;
  for (int64_t key = 0; key < nk; ++key) {
    const int64_t pos = k0 + key;
    int64_t page = table[std::min<int64_t>(pos / pb.page_size, pb.pages_per_seq - 1)];
    page = std::min<int64_t>(std::max<int64_t>(page, 0), pb.num_pages - 1);
    const int64_t row = (page * pb.page_size + pos % pb.page_size) * pb.hkv * d;
    for (int64_t h = 0; h < pb.hkv; ++h) {
      const int64_t off = row + h * d;
      float* kd = k + (h * pb.bkp + key) * d;
      float* vd = v + (h * pb.bkp + key) * d;
      if (pb.bf16_pages) {
        const uint16_t* ks = static_cast<const uint16_t*>(pb.k_pages) + off;
        const uint16_t* vs = static_cast<const uint16_t*>(pb.v_pages) + off;
        for (int c = 0; c < NC; ++c) {
          Store(kd + c * kLanes, WidenBf16(ks + c * kLanes));
          Store(vd + c * kLanes, WidenBf16(vs + c * kLanes));
        }
      } else {
        std::memcpy(kd, static_cast<const float*>(pb.k_pages) + off, d * sizeof(float));
        std::memcpy(vd, static_cast<const float*>(pb.v_pages) + off, d * sizeof(float));
      }
    }
  }
}

struct Scratch {
  std::vector<float> k, v, s, m, l, acc;
};

// Up to kMaxPairs (row, query head) pairs of one KV head, each with its own
// query vector, visible keys and softmax state.
constexpr int kMaxPairs = 8;
struct Pairs {
  const float* q[kMaxPairs];
  int64_t vis_lo[kMaxPairs], vis_hi[kMaxPairs];
  float* m[kMaxPairs];
  float* l[kMaxPairs];
  float* acc[kMaxPairs];
};

// P pairs against one block of keys: scores, online-softmax update and P@V,
// over the union of the pairs' visible vectors of keys, so each key and
// value vector loaded serves all P pairs. A pair's keys outside its own
// visible range get score -inf and p = 0 and add exact zeros, so every
// pair's bits are those of the pair alone over its own range (which is the
// definition in the header); how pairs are grouped does not change a bit.
template <int NC, int P>
void PairBlock(const Problem& pb, const Pairs& pr, const float* kb, const float* vb,
               float* s) {
  constexpr int64_t d = NC * kLanes;
  const int64_t bkp = pb.bkp;
  int64_t lo = pr.vis_lo[0], hi = pr.vis_hi[0];
  for (int p = 1; p < P; ++p) {
    lo = std::min(lo, pr.vis_lo[p]);
    hi = std::max(hi, pr.vis_hi[p]);
  }
  // Vectors of keys holding a key some pair sees; the others would add
  // exact zeros to every pair's softmax sums and P@V.
  const int64_t kc_lo = lo / kLanes * kLanes;
  const int64_t kc_hi = (hi + kLanes - 1) / kLanes * kLanes;
  // s[p][key] = fold(lanes of q . k): lanes over head_dim chunks in order,
  // then Reduce16's tree; keys the pair does not see become -inf.
  V mxv[P];
  for (int p = 0; p < P; ++p) mxv[p] = Splat(-INFINITY);
  for (int64_t kc = kc_lo; kc < kc_hi; kc += kLanes) {
    V a[P][kLanes];
    for (int key = 0; key < kLanes; ++key) {
      const float* kr = kb + (kc + key) * d;
      V kk[NC];
      for (int c = 0; c < NC; ++c) kk[c] = Load(kr + c * kLanes);
      for (int p = 0; p < P; ++p) {
        V t = Load(pr.q[p]) * kk[0];
        for (int c = 1; c < NC; ++c) t = t + Load(pr.q[p] + c * kLanes) * kk[c];
        a[p][key] = t;
      }
    }
    const VI idx = Iota() + static_cast<int32_t>(kc);
    for (int p = 0; p < P; ++p) {
      V sv = Reduce16(a[p]) * pb.sm_scale;
      if (pb.soft_cap > 0.0f) {
        alignas(64) float t[kLanes];
        Store(t, sv);
        for (int ln = 0; ln < kLanes; ++ln) t[ln] = pb.soft_cap * std::tanh(t[ln] / pb.soft_cap);
        sv = Load(t);
      }
      const VI vis = (idx >= static_cast<int32_t>(pr.vis_lo[p])) &
                     (idx < static_cast<int32_t>(pr.vis_hi[p]));
      sv = Select(vis, sv, Splat(-INFINITY));
      Store(s + p * bkp + kc, sv);
      mxv[p] = Select(mxv[p] > sv, mxv[p], sv);
    }
  }
  float alpha[P];
  for (int p = 0; p < P; ++p) {
    float mx = -INFINITY;                  // max is exact in any order
    for (int ln = 0; ln < kLanes; ++ln) mx = std::max(mx, Lane(mxv[p], ln));
    const float m_old = *pr.m[p];
    const float m_new = std::max(m_old, mx);
    const float m_safe = std::isinf(m_new) ? 0.0f : m_new;
    float* sp = s + p * bkp;
    V part = Splat(0.0f);
    for (int64_t kc = kc_lo; kc < kc_hi; kc += kLanes) {
      const V e = Exp(Load(sp + kc) - m_safe);
      Store(sp + kc, e);
      part = part + e;
    }
    V fold[kLanes];
    fold[0] = part;
    for (int i = 1; i < kLanes; ++i) fold[i] = Splat(0.0f);
    const float psum = Lane(Reduce16(fold), 0);
    alpha[p] = Lane(Exp(Splat(m_old - m_safe)), 0);
    *pr.l[p] = alpha[p] * *pr.l[p] + psum;
    *pr.m[p] = m_new;
  }
  // P@V: key i of the block goes to accumulator set i % 4 (keys in order
  // within a set), the sets added as (0 + 1) + (2 + 3); keys a pair does
  // not see have p = 0 and add exact zeros. One set at a time, all pairs
  // together, so each value vector is loaded once per call.
  V pv[4][P][NC];
  const int64_t k4_lo = lo / 4 * 4;
  for (int js = 0; js < 4; ++js) {
    V w[P][NC];
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < NC; ++c) w[p][c] = Splat(0.0f);
    for (int64_t key = k4_lo + js; key - js < hi; key += 4) {
      const float* vr = vb + key * d;
      V vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = Load(vr + c * kLanes);
      for (int p = 0; p < P; ++p) {
        const V e = Splat(s[p * bkp + key]);
        for (int c = 0; c < NC; ++c) w[p][c] = w[p][c] + e * vv[c];
      }
    }
    for (int p = 0; p < P; ++p)
      for (int c = 0; c < NC; ++c) pv[js][p][c] = w[p][c];
  }
  for (int p = 0; p < P; ++p) {
    float* ap = pr.acc[p];
    for (int c = 0; c < NC; ++c)
      Store(ap + c * kLanes, alpha[p] * Load(ap + c * kLanes) +
                                 ((pv[0][p][c] + pv[1][p][c]) + (pv[2][p][c] + pv[3][p][c])));
  }
}

template <int NC>
void RunPairs(const Problem& pb, int np, const Pairs& pr, const float* kb,
              const float* vb, float* s) {
  switch (np) {
    case 1: return PairBlock<NC, 1>(pb, pr, kb, vb, s);
    case 2: return PairBlock<NC, 2>(pb, pr, kb, vb, s);
    case 3: return PairBlock<NC, 3>(pb, pr, kb, vb, s);
    case 4: return PairBlock<NC, 4>(pb, pr, kb, vb, s);
    case 5: return PairBlock<NC, 5>(pb, pr, kb, vb, s);
    case 6: return PairBlock<NC, 6>(pb, pr, kb, vb, s);
    case 7: return PairBlock<NC, 7>(pb, pr, kb, vb, s);
    default: return PairBlock<NC, 8>(pb, pr, kb, vb, s);
  }
}

template <int NC>
void RunItem(const Problem& pb, const Item& it, Scratch& sc) {
  constexpr int64_t d = NC * kLanes;
  const int64_t g_n = pb.group, bk = pb.bk, bkp = pb.bkp;
  const int64_t kv_len = pb.kv_lens[it.seq];
  const int64_t q_len = pb.cu_q_lens[it.seq + 1] - pb.cu_q_lens[it.seq];
  const int64_t pos_lo = kv_len - q_len + it.row0;
  const int64_t pos_hi = pos_lo + it.rows - 1;
  const int64_t nrg = static_cast<int64_t>(it.rows) * pb.hq;   // (row, query head)
  sc.k.resize(pb.hkv * bkp * d);
  sc.v.resize(pb.hkv * bkp * d);
  sc.s.resize(kMaxPairs * bkp);
  sc.m.assign(nrg, -INFINITY);
  sc.l.assign(nrg, 0.0f);
  sc.acc.assign(nrg * d, 0.0f);
  float* s = sc.s.data();
  int64_t j_lo = 0;
  if (pb.window > 0) j_lo = std::max<int64_t>(0, pos_lo - pb.window + 1) / bk;
  const int64_t j_hi = pos_hi / bk;
  const int64_t row_base = pb.cu_q_lens[it.seq] + it.row0;
  for (int64_t j = j_lo; j <= j_hi; ++j) {
    const int64_t k0 = j * bk;
    const int64_t nk = std::min<int64_t>(bk, kv_len - k0);
    LoadBlock<NC>(pb, it.seq, k0, nk, sc.k.data(), sc.v.data());
    for (int64_t h = 0; h < pb.hkv; ++h) {
      const float* kb = sc.k.data() + h * bkp * d;
      const float* vb = sc.v.data() + h * bkp * d;
      // (row, query head) pairs that see a key of this block, in order,
      // kMaxPairs at a time.
      Pairs pr;
      int np = 0;
      auto flush = [&] {
        if (np == 0) return;
        RunPairs<NC>(pb, np, pr, kb, vb, s);
        np = 0;
      };
      for (int64_t r = 0; r < it.rows; ++r) {
        const int64_t pos = pos_lo + r;
        // Visible keys of this block: [vis_lo, vis_hi) in block coordinates.
        const int64_t vis_hi = std::min<int64_t>(bk, pos - k0 + 1);
        int64_t vis_lo = 0;
        if (pb.window > 0) vis_lo = std::max<int64_t>(0, pos - pb.window + 1 - k0);
        if (vis_hi <= vis_lo) continue;          // sees nothing here: state kept
        for (int64_t g = 0; g < g_n; ++g) {
          const int64_t rg = r * pb.hq + h * g_n + g;
          pr.q[np] = pb.q + ((row_base + r) * pb.hq + h * g_n + g) * d;
          pr.vis_lo[np] = vis_lo;
          pr.vis_hi[np] = vis_hi;
          pr.m[np] = sc.m.data() + rg;
          pr.l[np] = sc.l.data() + rg;
          pr.acc[np] = sc.acc.data() + rg * d;
          if (++np == kMaxPairs) flush();
        }
      }
      flush();
    }
  }
  for (int64_t r = 0; r < it.rows; ++r) {
    const int64_t row = row_base + r;
    for (int64_t hq = 0; hq < pb.hq; ++hq) {
      const int64_t rg = r * pb.hq + hq;
      float* o = pb.out + (row * pb.hq + hq) * d;
      const float lv = sc.l[rg];
      const float* acc = sc.acc.data() + rg * d;
      for (int64_t i = 0; i < d; ++i) o[i] = lv > 0.0f ? acc[i] / lv : 0.0f;
    }
  }
}

void RunAny(const Problem& pb, const Item& it, Scratch& sc) {
  switch (pb.d) {
    case 16: return RunItem<1>(pb, it, sc);
    case 32: return RunItem<2>(pb, it, sc);
    case 64: return RunItem<4>(pb, it, sc);
    case 128: return RunItem<8>(pb, it, sc);
    case 256: return RunItem<16>(pb, it, sc);
  }
}

// Work shared by the calling thread and the pool's helpers; helpers that
// start after the work is done find nothing and only drop their reference.
struct Shared {
  Problem pb;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Drain(Shared& sh) {
  thread_local Scratch scratch;
  const int64_t n = static_cast<int64_t>(sh.items.size());
  for (;;) {
    const int64_t i = sh.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    RunAny(sh.pb, sh.items[i], scratch);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                           float soft_cap, int64_t sliding_window,
                           int64_t block_kv,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4)
    return ffi::Error::InvalidArgument("q must be rank 3 and pages rank 4");
  const auto kt = k_pages.element_type();
  if (kt != v_pages.element_type())
    return ffi::Error::InvalidArgument("k_pages and v_pages dtypes differ");
  if (kt != ffi::DataType::F32 && kt != ffi::DataType::U16 &&
      kt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("pages must be f32, u16 or bf16");
  if (qd[2] != 16 && qd[2] != 32 && qd[2] != 64 && qd[2] != 128 && qd[2] != 256)
    return ffi::Error::InvalidArgument("head_dim must be 16, 32, 64, 128 or 256");
  auto sh = std::make_shared<Shared>();
  Problem& pb = sh->pb;
  pb.q = q.typed_data();
  pb.k_pages = k_pages.untyped_data();
  pb.v_pages = v_pages.untyped_data();
  pb.bf16_pages = kt != ffi::DataType::F32;
  pb.kv_lens = kv_lens.typed_data();
  pb.page_table = page_table.typed_data();
  pb.cu_q_lens = cu_q_lens.typed_data();
  pb.out = out->typed_data();
  const int64_t t = qd[0];
  pb.hq = qd[1];
  pb.d = qd[2];
  pb.num_pages = kd[0];
  pb.page_size = kd[1];
  pb.hkv = kd[2];
  pb.pages_per_seq = page_table.dimensions()[1];
  pb.group = pb.hq / pb.hkv;
  pb.bk = block_kv;
  pb.bkp = (block_kv + kLanes - 1) / kLanes * kLanes;
  pb.sm_scale = sm_scale;
  pb.soft_cap = soft_cap;
  pb.window = sliding_window;
  const int64_t slots = kv_lens.dimensions()[0];
  const int64_t live = std::min<int64_t>(std::max<int64_t>(num_seqs.typed_data()[0], 0), slots);
  const int64_t rows_used = live > 0 ? pb.cu_q_lens[live] : 0;
  std::fill(pb.out + std::max<int64_t>(0, std::min(rows_used, t)) * pb.hq * pb.d,
            pb.out + t * pb.hq * pb.d, 0.0f);
  for (int64_t s = 0; s < live; ++s) {
    // Rows outside [0, T) are dropped (as the jnp paths' scatter does).
    const int64_t lo = pb.cu_q_lens[s], hi = pb.cu_q_lens[s + 1];
    if (lo < 0 || hi > t || hi < lo) {
      const int64_t a = std::min(std::max<int64_t>(lo, 0), t);
      const int64_t b = std::min(std::max<int64_t>(hi, a), t);
      std::fill(pb.out + a * pb.hq * pb.d, pb.out + b * pb.hq * pb.d, 0.0f);
      continue;
    }
    const int64_t q_len = hi - lo;
    for (int64_t r0 = 0; r0 < q_len; r0 += kRowTile)
      sh->items.push_back(Item{static_cast<int32_t>(s), static_cast<int32_t>(r0),
                               static_cast<int32_t>(std::min<int64_t>(kRowTile, q_len - r0))});
  }
  const int64_t n = static_cast<int64_t>(sh->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { Drain(*sh); });
  Drain(*sh);
  while (sh->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveRaggedAttention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("block_kv")
                                  .Ret<ffi::Buffer<ffi::F32>>());
