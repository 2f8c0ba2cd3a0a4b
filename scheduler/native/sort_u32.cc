// Ascending sort of a u32[n] vector, as an XLA FFI custom call
// (scheduler/keys.py `sort_u32` builds, registers and calls it on the CPU).
//
// The policies' key order (keys.key_order) sorts one packed u32 word per
// slot (key bits above the slot's bits), so every value is distinct and any
// correct sort gives the same result as XLA's. XLA:CPU's comparison sort
// took 356 us at 8,192 values and 840 us at 16,384 on a 2-core Xeon (jitted
// alone), a quarter of a simulated iteration at that slot-table size. This is a least-significant-digit radix sort in
// 8-bit digits: one pass builds the four digits' histograms, then one
// scatter pass per digit, skipping a digit that is the same in every value
// (the packed keys' high bits are often zero): O(n) per pass.
//
// Operand: u32[n] (any n >= 0). Result: u32[n], the operand's values in
// ascending order (stable, though distinct values make that moot).

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kDigits = 4;
constexpr int kBins = 256;

ffi::Error SortU32(ffi::Buffer<ffi::U32> in, ffi::ResultBuffer<ffi::U32> out) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (out->element_count() != in.element_count()) {
    return ffi::Error::InvalidArgument("sort_u32: the result must have the operand's size");
  }
  const uint32_t* src = in.typed_data();
  uint32_t* dst = out->typed_data();
  if (n == 0) return ffi::Error::Success();

  uint32_t count[kDigits][kBins] = {};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = src[i];
    ++count[0][v & 0xff];
    ++count[1][(v >> 8) & 0xff];
    ++count[2][(v >> 16) & 0xff];
    ++count[3][v >> 24];
  }
  int passes[kDigits];
  int num_passes = 0;
  for (int d = 0; d < kDigits; ++d) {
    const uint32_t first = (src[0] >> (8 * d)) & 0xff;
    if (count[d][first] != static_cast<uint32_t>(n)) passes[num_passes++] = d;
  }
  if (num_passes == 0) {                      // every value the same
    std::memcpy(dst, src, n * sizeof(uint32_t));
    return ffi::Error::Success();
  }
  // Ping-pong between dst and a scratch buffer so that the last pass writes dst.
  thread_local std::vector<uint32_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  const uint32_t* from = src;
  for (int p = 0; p < num_passes; ++p) {
    const int d = passes[p];
    uint32_t* to = ((num_passes - 1 - p) % 2 == 0) ? dst : scratch.data();
    uint32_t start[kBins];
    uint32_t sum = 0;
    for (int b = 0; b < kBins; ++b) {
      start[b] = sum;
      sum += count[d][b];
    }
    const int shift = 8 * d;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t v = from[i];
      to[start[(v >> shift) & 0xff]++] = v;
    }
    from = to;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveSortU32, SortU32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());
