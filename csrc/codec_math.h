// The codecs' arithmetic on one value or one group, for both devices: the CPU kernels
// (cpu_kernels_impl.h) and the CUDA kernels (cuda/codecs_cuda.cu) call these functions and restate none
// of them, so the CPU kernels' bit-for-bit tests against megatron_adacc/codecs/reference.py cover the
// arithmetic the GPU runs. What stays per device is how values are reached: loops and vector lanes on
// the CPU, launch geometry and warp reductions on the GPU, and the min/max/NaN reductions of each.
//
// Every float operation is an explicit round-to-nearest one (fmul_rn, ...): on the device the _rn
// intrinsics, which nvcc never contracts into a fused multiply-add whatever --fmad says; on the host the
// plain operators, which the build's -ffp-contract=off keeps unfused. The order of operations is
// reference.py's, line for line.
//
// The per-value functions (codes, the counter hash) take their lanes as a template argument: one value
// (ScalarLanes, the default: the CUDA kernels and the CPU kernels' tails) or a CPU vector of values
// (cpu_kernels_impl.h's VecLanes, the same interface). The CPU's vector loops thus run this source too.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adacc_common.h"

namespace adacc {

// ------------------------------------------------------------------------- float32, never fused
ADACC_HD float fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ADACC_HD float fsub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ADACC_HD float fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ADACC_HD float fdiv_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

#if !defined(__CUDACC__)
// The same on CPU vector lanes (GCC/Clang vector extensions; either operand may be one value, which is
// broadcast): plain operators, kept unfused by -ffp-contract=off like the scalar ones.
template <typename A, typename B>
inline __attribute__((always_inline)) auto fadd_rn(A a, B b) -> decltype(a + b) { return a + b; }
template <typename A, typename B>
inline __attribute__((always_inline)) auto fsub_rn(A a, B b) -> decltype(a - b) { return a - b; }
template <typename A, typename B>
inline __attribute__((always_inline)) auto fmul_rn(A a, B b) -> decltype(a * b) { return a * b; }
#endif

ADACC_HD bool not_finite(float v) { return !(fabsf(v) <= FLT_MAX); }  // true for NaN and +-Inf

// ------------------------------------------------------------------------------------- lanes
// One value. A vector type with the same members runs the per-value functions on vector lanes: comparisons
// then give lane masks, which `one_if` takes, and ?: selects lane by lane.
struct ScalarLanes {
  using F = float;
  using I = int32_t;
  using U = uint32_t;
  ADACC_HD static I bits(F v) {  // the float's bit pattern
#ifdef __CUDA_ARCH__
    return __float_as_int(v);
#else
    I b;
    std::memcpy(&b, &v, sizeof(b));
    return b;
#endif
  }
  ADACC_HD static I trunc(F v) { return static_cast<I>(v); }  // toward zero
  ADACC_HD static F to_float(I v) { return static_cast<F>(v); }
  ADACC_HD static F to_float(U v) { return static_cast<F>(v); }
  ADACC_HD static I one_if(bool c) { return c ? 1 : 0; }
};

// ------------------------------------------------------------------------------- element dtypes
// Every input dtype widens to float32 exactly; narrowing rounds to nearest even (c10's conversions,
// which are __host__ __device__).
ADACC_HD float to_float(float v) { return v; }
ADACC_HD float to_float(c10::Half v) { return static_cast<float>(v); }
ADACC_HD float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
ADACC_HD T from_float(float v) {
  return T(v);
}

// Largest finite value of each output dtype, where decoded values saturate.
template <typename T>
ADACC_HD constexpr float dtype_max();
template <>
ADACC_HD constexpr float dtype_max<float>() { return FLT_MAX; }
template <>
ADACC_HD constexpr float dtype_max<c10::Half>() { return 65504.0f; }
template <>
ADACC_HD constexpr float dtype_max<c10::BFloat16>() { return 3.38953139e38f; }  // 0x7F7F

// ------------------------------------------------------------------------------ overflow tests
// The operand of a test against the largest finite value, hidden from the optimizer. GCC 13 and 14 at -O3
// reason backwards from such a test: q * s < -FLT_MAX makes q * s -Inf, hence s +-Inf (a finite product that
// overflows is forgotten), and then fold the group's other values with that s: 0 * s to NaN, 7 * s to Inf (an
// fp32 group whose scale is FLT_MAX / 8 or more decoded to NaN; GCC 12 and clang 19 are right). A test of a
// copy the optimizer knows nothing about gives it nothing to reason from; the copy costs no instruction.
template <typename V>
ADACC_HD V overflow_operand(V v) {
#if defined(__CUDA_ARCH__)
#elif defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  asm("" : "+m"(v));
#endif
  return v;
}

// ------------------------------------------------------------------------------ group parameters
ADACC_HD float flush_tiny(float s) { return s < kTinyScale ? 0.0f : s; }
ADACC_HD float inverse(float s) { return s > 0.0f ? fdiv_rn(1.0f, s) : 0.0f; }

// Scale of the symmetric codecs: max(max(mx, 0) / 7, -min(mn, 0) / 8), flushed to 0 below kTinyScale.
ADACC_HD float symmetric_scale(float mn, float mx) {
  const float pos = fdiv_rn(mx > 0.0f ? mx : 0.0f, 7.0f);
  const float neg = fdiv_rn(-(mn < 0.0f ? mn : 0.0f), 8.0f);
  return flush_tiny(pos > neg ? pos : neg);
}

// (mx - mn) / levels, and the factor k (1, or kQuarter where mx - mn overflows) at which the group's
// values are taken so that their codes do not overflow either (reference._range_scale). With one level
// (1-bit stochastic) an overflowing range has no float32 scale: it saturates at FLT_MAX.
ADACC_HD float range_scale(float mn, float mx, float levels, float& k) {
  k = overflow_operand(fsub_rn(mx, mn)) > FLT_MAX ? kQuarter : 1.0f;
  // exactly (mx - mn) / levels where k == 1
  const float s = overflow_operand(flush_tiny(fdiv_rn(fdiv_rn(fsub_rn(fmul_rn(mx, k), fmul_rn(mn, k)), levels), k)));
  return s > FLT_MAX ? FLT_MAX : s;
}

// An affine group: value v sits at code position (v * k - offset_k) * inv, and code q decodes to
// q * scale + offset. k is 1 except for groups whose range overflows (see range_scale).
struct Affine {
  float scale, offset, k, offset_k, inv;
};

// Symmetric 4-bit groups: code q decodes to q * scale, and no value is offset or scaled by k.
ADACC_HD Affine symmetric_group(float mn, float mx) {
  const float s = symmetric_scale(mn, mx);
  return Affine{s, 0.0f, 1.0f, 0.0f, inverse(s)};
}

// Asymmetric 4-bit groups: codes -8..7 span [mn, mx]; offset is the value of code 0.
ADACC_HD Affine asymmetric_group(float mn, float mx) {
  Affine a;
  a.scale = range_scale(mn, mx, 15.0f, a.k);
  a.offset = fdiv_rn(fadd_rn(fmul_rn(mn, a.k), fmul_rn(8.0f, fmul_rn(a.scale, a.k))), a.k);
  a.offset_k = fmul_rn(a.offset, a.k);
  a.inv = inverse(fmul_rn(a.scale, a.k));
  return a;
}

// Stochastic groups of `levels` + 1 codes from 0 at mn. The stored minimum is `offset`: mn with -0.0
// made +0.0, because which signed zero a min reduction returns depends on its order.
ADACC_HD Affine stochastic_group(float mn, float mx, float levels) {
  Affine a;
  a.offset = fadd_rn(mn, 0.0f);
  a.scale = range_scale(a.offset, mx, levels, a.k);
  a.offset_k = fmul_rn(a.offset, a.k);
  a.inv = inverse(fmul_rn(a.scale, a.k));
  return a;
}

// Code position of v in group a. SCALED = false where k == 1: the multiply by 1 is exact, so skipping
// it changes no result and saves one multiply per value.
template <bool SCALED, class L = ScalarLanes>
ADACC_HD typename L::F code_position(typename L::F v, const Affine& a) {
  if constexpr (SCALED) v = fmul_rn(v, a.k);
  return fmul_rn(fsub_rn(v, a.offset_k), a.inv);
}

// -------------------------------------------------------------------------------- counter hash
// MurmurHash3's 32-bit finalizer; uniform24 is the counter-based generator of the stochastic codec
// (reference.uniform24). A pure function of (seed, index): the random stream does not depend on thread
// count, block size or device.
template <class L = ScalarLanes>
ADACC_HD typename L::U fmix32(typename L::U h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The same of the index's 32-bit halves: a loop over indices that share their high half stays in 32-bit lanes.
template <class L = ScalarLanes>
ADACC_HD typename L::U uniform24_halves(uint64_t seed, typename L::U index_lo, uint32_t index_hi) {
  const typename L::U a = fmix32<L>(index_lo ^ static_cast<uint32_t>(seed));
  const typename L::U b = fmix32<L>(a + (index_hi ^ static_cast<uint32_t>(seed >> 32)));
  return b >> 8;
}

ADACC_HD uint32_t uniform24(uint64_t seed, uint64_t index) {
  return uniform24_halves(seed, static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32));
}

// ------------------------------------------------------------------------------------ encoding
// round(clamp(v, -8, 7)) + 8 as an int in [0, 15], read from the bits of v + kCodeMagic. For v in
// [-2**22 - 8, 2**22 - 8) that sum lies in [2**23, 2**24), where float32's spacing is 1: the addition
// rounds v to an integer, half to even (kCodeMagic is even), and the sum's bits are kCodeBits + 8 +
// round(v). Clamping the bits to [kCodeBits, kCodeBits + 15] clamps round(v) to [-8, 7]; a v beyond that
// interval leaves the binade on its side (the bits of floats of one sign grow with their magnitude, and
// a negative sum's are negative as int32), so every finite v gets its code. (On vector lanes the bits
// are read without a conversion, and each clamp, written with its constant second, is one max or min.)
constexpr float kCodeMagic = 12582920.0f;  // 1.5 * 2**23 + 8
constexpr int32_t kCodeBits = 0x4B400000;  // the bits of 1.5 * 2**23

template <class L = ScalarLanes>
ADACC_HD typename L::I code4(typename L::F v) {
  typename L::I b = L::bits(fadd_rn(v, kCodeMagic));
  b = b > kCodeBits ? b : kCodeBits;
  b = b > kCodeBits + 15 ? kCodeBits + 15 : b;
  return b - kCodeBits;
}

// v at inverse scale inv (one for the group, or one per lane).
template <class L = ScalarLanes, typename S>
ADACC_HD typename L::I sym_code4(typename L::F v, S inv) { return code4<L>(fmul_rn(v, inv)); }

template <bool SCALED, class L = ScalarLanes>
ADACC_HD typename L::I affine_code4(typename L::F v, const Affine& a) {
  return code4<L>(code_position<SCALED, L>(v, a));
}

// Stochastic rounding of code position t >= 0: up with probability frac(t), by the draw r = uniform24 of
// (seed, value index), capped at the group's last code.
template <int BITS, class L = ScalarLanes>
ADACC_HD typename L::I stochastic_code(typename L::F t, typename L::U r) {
  constexpr int32_t qmax = (1 << BITS) - 1;
  const typename L::I q = L::trunc(t);
  const typename L::F frac = fsub_rn(t, L::to_float(q));
  const typename L::F u = fmul_rn(L::to_float(r), 0x1p-24f);
  const typename L::I up = q + L::one_if(u < frac);
  return up > qmax ? qmax : up;
}

// Value j of a byte sits in bits [j * BITS, (j + 1) * BITS).
template <int BITS>
ADACC_HD uint32_t put_field(uint32_t code, int j) { return code << (j * BITS); }
template <int BITS>
ADACC_HD uint32_t field(uint32_t byte, int j) { return (byte >> (j * BITS)) & ((1u << BITS) - 1u); }

ADACC_HD uint8_t pack_nibbles(int32_t lo, int32_t hi) { return static_cast<uint8_t>(lo | (hi << 4)); }
// The signed code q in [-8, 7] of nibble j (0: low, 1: high), as a float.
ADACC_HD float nibble(uint32_t byte, int j) {
  return static_cast<float>(static_cast<int32_t>(field<4>(byte, j)) - 8);
}

// The outlier codec quantizes each row with its outlier channels zeroed (they are stored exactly).
ADACC_HD float dense_value(float v, bool is_outlier) { return is_outlier ? 0.0f : v; }

// ------------------------------------------------------------------------------------ decoding
// A GUARDED decode gives the reference's finite result where q * s (+ o) overflows: it redoes an
// overflowing q * s + o at a quarter, and saturates at the output dtype's largest finite value (a code
// may lie half a step past its group's extreme value). Rounding is monotone in q, so a group whose lowest
// and highest codes decode within that value needs no guard: only groups at the dtype's extremes pay.
template <typename T, class L = ScalarLanes>
ADACC_HD typename L::F saturated(typename L::F v) {
  v = overflow_operand(v);
  v = v > dtype_max<T>() ? dtype_max<T>() : v;
  return v < -dtype_max<T>() ? -dtype_max<T>() : v;
}

template <typename T>
ADACC_HD bool needs_guard(float qlo, float qhi, float s, float o) {
  return !(fabsf(overflow_operand(fadd_rn(fmul_rn(qlo, s), o))) <= dtype_max<T>() &&
           fabsf(overflow_operand(fadd_rn(fmul_rn(qhi, s), o))) <= dtype_max<T>());
}

// q * s as a float32 that narrows to T without overflow where GUARDED (s: one scale, or one per lane).
template <typename T, bool GUARDED, class L = ScalarLanes, typename S>
ADACC_HD typename L::F sym_value(typename L::F q, S s) {
  const typename L::F v = fmul_rn(q, s);
  return GUARDED ? saturated<T, L>(v) : v;
}

// q * s + o (reference._affine_decode): an overflow is redone at a quarter, saturated, times four. (The
// unguarded decode runs on vector lanes too.)
template <typename T, bool GUARDED, class L = ScalarLanes>
ADACC_HD typename L::F affine_value(typename L::F q, float s, float o) {
  const typename L::F v = fadd_rn(fmul_rn(q, s), o);
  if constexpr (!GUARDED) {
    return v;
  } else {
    const float lim = FLT_MAX * kQuarter;
    const float w = overflow_operand(fadd_rn(fmul_rn(q, fmul_rn(s, kQuarter)), fmul_rn(o, kQuarter)));
    const bool finite = fabsf(overflow_operand(v)) <= FLT_MAX;
    return saturated<T>(finite ? v : fmul_rn(w < -lim ? -lim : (w > lim ? lim : w), 4.0f));
  }
}

// ---------------------------------------------------------------------------------- bit masks
// Eight 0/1 bytes (little-endian uint64) -> one byte, bit j from byte j: the multiply moves byte j's bit 0
// to bit 56 + j without carries (each partial product lands on a distinct bit), the shift keeps them.
ADACC_HD uint8_t gather_bits(uint64_t v) {
  return static_cast<uint8_t>(((v & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
}
// Any byte of v above 1: not a 0/1 mask.
ADACC_HD bool mask_bytes_bad(uint64_t v) { return (v & 0xFEFEFEFEFEFEFEFEull) != 0; }

}  // namespace adacc
