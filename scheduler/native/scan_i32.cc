// The scheduler's O(R) passes over slot vectors, as XLA FFI custom calls
// (scheduler/scan.py builds, registers and calls them on the CPU):
//
// - IterserveCumsumI32: s32[n] -> s32[n], the inclusive prefix sum,
//   out[i] = in[0] + ... + in[i], wrapping modulo 2**32 as XLA's int32 sum
//   does (the adds are unsigned, so an overflow is defined and gives XLA's
//   bits). Integer sums do not depend on their order: `jnp.cumsum`'s result.
// - IterserveSuffixMinI32: s32[n] -> s32[n], out[i] = min(in[i], ..., in[n-1]),
//   `jax.lax.cummin(in, reverse=True)`'s result.
// - IterserveInversePermutation: s32[n] order -> s32[n] pos with
//   pos[order[i]] = i, `jnp.zeros(n).at[order].set(arange(n))`'s result for
//   a permutation.
// - IterserveStablePartition: (s32[n] order, pred[n] mask) -> (s32[n] walk,
//   s32[] count): order's entries whose mask (indexed by the entry) holds,
//   then the rest, each part in order's order; count = how many hold.
//
// XLA:CPU lowers `jnp.cumsum` to tiled reduce-windows with their pads and
// copies (37 us for 16,384 values on a 2-core Xeon, jitted alone, where one
// pass takes 6 us) and runs a scatter as a loop over its updates; a
// simulated iteration at 16,384 slots takes a dozen prefix sums, four suffix
// minima and five permutation scatters. An order entry outside [0, n) is an error (the
// callers pass permutations of the slots).

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error CumsumI32(ffi::Buffer<ffi::S32> in, ffi::ResultBuffer<ffi::S32> out) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (out->element_count() != in.element_count()) {
    return ffi::Error::InvalidArgument("cumsum_i32: the result must have the operand's size");
  }
  const uint32_t* src = reinterpret_cast<const uint32_t*>(in.typed_data());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out->typed_data());
  uint32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += src[i];
    dst[i] = sum;
  }
  return ffi::Error::Success();
}

ffi::Error SuffixMinI32(ffi::Buffer<ffi::S32> in, ffi::ResultBuffer<ffi::S32> out) {
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (out->element_count() != in.element_count()) {
    return ffi::Error::InvalidArgument("suffix_min_i32: the result must have the operand's size");
  }
  const int32_t* src = in.typed_data();
  int32_t* dst = out->typed_data();
  if (n == 0) return ffi::Error::Success();
  int32_t least = src[n - 1];
  for (int64_t i = n - 1; i >= 0; --i) {
    least = src[i] < least ? src[i] : least;
    dst[i] = least;
  }
  return ffi::Error::Success();
}

ffi::Error InversePermutation(ffi::Buffer<ffi::S32> order, ffi::ResultBuffer<ffi::S32> pos) {
  const int64_t n = static_cast<int64_t>(order.element_count());
  if (pos->element_count() != order.element_count()) {
    return ffi::Error::InvalidArgument(
        "inverse_permutation: the result must have the operand's size");
  }
  const int32_t* src = order.typed_data();
  int32_t* dst = pos->typed_data();
  for (int64_t i = 0; i < n; ++i) dst[i] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = src[i];
    if (at < 0 || at >= n) {
      return ffi::Error::InvalidArgument(
          "inverse_permutation: order[" + std::to_string(i) + "] = " + std::to_string(at) +
          " is outside [0, " + std::to_string(n) + ")");
    }
    dst[at] = static_cast<int32_t>(i);
  }
  return ffi::Error::Success();
}

ffi::Error StablePartition(ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::PRED> mask,
                           ffi::ResultBuffer<ffi::S32> walk, ffi::ResultBuffer<ffi::S32> count) {
  const int64_t n = static_cast<int64_t>(order.element_count());
  if (mask.element_count() != order.element_count() ||
      walk->element_count() != order.element_count()) {
    return ffi::Error::InvalidArgument(
        "stable_partition: order, mask and the result must have one size");
  }
  const int32_t* src = order.typed_data();
  const bool* keep = mask.typed_data();
  int32_t* dst = walk->typed_data();
  int64_t held = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = src[i];
    if (at < 0 || at >= n) {
      return ffi::Error::InvalidArgument(
          "stable_partition: order[" + std::to_string(i) + "] = " + std::to_string(at) +
          " is outside [0, " + std::to_string(n) + ")");
    }
    held += keep[at] ? 1 : 0;
  }
  int64_t first = 0, rest = held;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t slot = src[i];
    dst[keep[slot] ? first++ : rest++] = slot;
  }
  *count->typed_data() = static_cast<int32_t>(held);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveCumsumI32, CumsumI32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveSuffixMinI32, SuffixMinI32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveInversePermutation, InversePermutation,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(IterserveStablePartition, StablePartition,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
