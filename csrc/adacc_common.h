// Shared definitions of the codec kernels (CPU and CUDA): constants and the payload layout. The
// arithmetic on values and groups is in codec_math.h.
//
// The numerical conventions are those of megatron_adacc/codecs/reference.py, the pure-torch oracle the
// tests compare against bit for bit:
//   * values are read as float32; scales and offsets are float32; no fused multiply-add
//     (codec_math.h's fmul_rn, fadd_rn, ...);
//   * rounding is round-half-to-even, applied after clamping to the code range;
//   * groups are packed independently, each from a byte boundary; value j of a byte sits in bits
//     [j*bits, (j+1)*bits); padding bits are zero; a 4-bit code q in [-8, 7] is stored as q + 8;
//   * scales below kTinyScale are flushed to zero (see codecs/base.py: TINY_SCALE);
//   * finite input decodes to finite output: a group whose range max - min overflows float32 is worked
//     on at kQuarter of its values, an overflowing decode is redone at kQuarter and saturated, and every
//     decode saturates at the output dtype's largest finite value (see reference.py's conventions).
#pragma once

#include <cstdint>

// Functions of both devices. On the host always inlined: the CPU kernels are compiled once per
// instruction set (cpu_kernels_impl.h), and only inlined code is vectorized for the caller's.
#if defined(__CUDACC__)
#define ADACC_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define ADACC_HD inline __attribute__((always_inline))
#else
#define ADACC_HD inline
#endif

namespace adacc {

constexpr float kTinyScale = 7.888609052210118e-31f;  // 2**-100, exactly representable
// Exact power of two: scaling by it commutes with rounding, so a quarter-scale computation gives the
// float32 result of unbounded arithmetic, and a quarter of any two finite floats' difference is finite.
constexpr float kQuarter = 0.25f;

ADACC_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of one full group of `group` values at `bits` bits (groups start on byte boundaries).
ADACC_HD int64_t group_bytes(int64_t group, int bits) { return ceil_div(group * bits, 8); }

// Bytes of n values packed in groups (the last group may be short).
ADACC_HD int64_t packed_bytes(int64_t n, int64_t group, int bits) {
  if (n == 0) return 0;
  return (n / group) * group_bytes(group, bits) + ceil_div((n % group) * bits, 8);
}

}  // namespace adacc
