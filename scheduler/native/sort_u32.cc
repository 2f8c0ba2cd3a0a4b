// Ascending sort of a u32[n] vector, as an XLA FFI custom call
// (scheduler/keys.py `sort_u32` builds, registers and calls it on the CPU).
//
// The policies' key order (keys.key_order) sorts one packed u32 word per
// slot (key bits above the slot's bits), so every value is distinct and any
// correct sort gives the same result as XLA's. XLA:CPU's comparison sort
// took 356 us at 8,192 values and 840 us at 16,384 on a 2-core Xeon (jitted
// alone), a quarter of a simulated iteration at that slot-table size. This
// is a least-significant-digit radix sort: one pass builds every digit's
// histogram, then one scatter pass per digit, skipping a digit that is the
// same in every value (the packed keys' high bits are often zero): O(n) per
// pass.
//
// Attribute `ordered_low_bits` (b, 0-32): when the low b bits of the values
// strictly ascend along the operand (the key order's words hold the slot
// there, in slot order), the operand is already sorted by them, so a stable
// sort on bits [b, 32) alone gives the full sort: the passes over the slot
// bits are left out (16,384 values, 17 key bits: 112 -> 57 us jitted alone). The
// kernel checks that the low bits ascend and sorts on all 32 bits where
// they do not, so the result is a sort whatever b says. Digits are at most
// 10 bits wide, as few passes as that allows (two for the 18 key bits of a
// 16,384-slot table; four of 8 bits over all 32).
//
// Operand: u32[n] (any n >= 0). Result: u32[n], the operand's values in
// ascending order (stable, though distinct values make that moot).

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxDigitBits = 10;
constexpr int kMaxPasses = (32 + kMaxDigitBits - 1) / kMaxDigitBits;

ffi::Error SortU32(ffi::Buffer<ffi::U32> in, ffi::ResultBuffer<ffi::U32> out,
                   int32_t ordered_low_bits) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (out->element_count() != in.element_count()) {
    return ffi::Error::InvalidArgument("sort_u32: the result must have the operand's size");
  }
  if (ordered_low_bits < 0 || ordered_low_bits > 32) {
    return ffi::Error::InvalidArgument("sort_u32: ordered_low_bits must be in [0, 32]");
  }
  const uint32_t* src = in.typed_data();
  uint32_t* dst = out->typed_data();
  if (n == 0) return ffi::Error::Success();

  int skip = ordered_low_bits;
  if (skip > 0) {
    const uint32_t low = skip == 32 ? 0xffffffffu : ((1u << skip) - 1);
    for (int64_t i = 1; i < n; ++i) {
      if ((src[i] & low) <= (src[i - 1] & low)) {
        skip = 0;                                  // not ascending: sort on every bit
        break;
      }
    }
  }
  if (skip == 32) {                                // distinct and ascending: sorted
    std::memcpy(dst, src, n * sizeof(uint32_t));
    return ffi::Error::Success();
  }
  const int bits = 32 - skip;
  const int digits = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int width = (bits + digits - 1) / digits;
  const uint32_t bins = 1u << width;
  const uint32_t digit_mask = bins - 1;

  thread_local std::vector<uint32_t> count;
  count.assign(static_cast<size_t>(digits) * bins, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = src[i] >> skip;
    for (int d = 0; d < digits; ++d) ++count[d * bins + ((v >> (width * d)) & digit_mask)];
  }
  int passes[kMaxPasses];
  int num_passes = 0;
  for (int d = 0; d < digits; ++d) {
    const uint32_t first = ((src[0] >> skip) >> (width * d)) & digit_mask;
    if (count[d * bins + first] != static_cast<uint32_t>(n)) passes[num_passes++] = d;
  }
  if (num_passes == 0) {                      // every value's sorted digits the same
    std::memcpy(dst, src, n * sizeof(uint32_t));
    return ffi::Error::Success();
  }
  // Ping-pong between dst and a scratch buffer so that the last pass writes dst.
  thread_local std::vector<uint32_t> scratch;
  thread_local std::vector<uint32_t> start;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  start.resize(bins);
  const uint32_t* from = src;
  for (int p = 0; p < num_passes; ++p) {
    const int d = passes[p];
    uint32_t* to = ((num_passes - 1 - p) % 2 == 0) ? dst : scratch.data();
    uint32_t sum = 0;
    for (uint32_t b = 0; b < bins; ++b) {
      start[b] = sum;
      sum += count[d * bins + b];
    }
    const int shift = skip + width * d;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t v = from[i];
      to[start[(v >> shift) & digit_mask]++] = v;
    }
    from = to;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveSortU32, SortU32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int32_t>("ordered_low_bits"));
