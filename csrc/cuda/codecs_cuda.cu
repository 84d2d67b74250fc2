// CUDA kernels of the activation codecs. Same signatures, layouts and float32 arithmetic as the CPU
// kernels (csrc/cpu_kernels_impl.h) and the pure-torch reference (megatron_adacc/codecs/reference.py):
// every multiply/add/divide is an explicit round-to-nearest intrinsic (__fmul_rn, ...) so that nvcc cannot
// fuse or reorder it, and rounding to codes uses __float2int_rn (half to even).
//
// Layout of the work:
//   * per-group codecs (symmetric, asymmetric, stochastic, outlier rows): one warp per group; lanes stride
//     over the group (coalesced), min/max are reduced with shuffles (exact in any order), then each lane
//     packs whole bytes;
//   * per-channel statistics (channel-wise scales, outlier abs-sums): one thread per channel over a chunk
//     of rows (warps read consecutive channels: coalesced), chunk partials reduced in chunk order, so the
//     float64 sums do not depend on the launch;
//   * element-wise decode and bit masks: one thread per packed byte, grid-stride loops.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "adacc_common.h"
#include "codecs.h"

namespace adacc {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int64_t kRowChunk = 256;  // same chunking as the CPU kernels

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(c10::Half v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
// Decoded values saturate at the output dtype's largest finite value (as from_float on the CPU): a code
// may decode up to half a step beyond its group's extreme value, which must not become Inf.
template <typename T>
__device__ __forceinline__ float dtype_max();
template <>
__device__ __forceinline__ float dtype_max<float>() { return FLT_MAX; }
template <>
__device__ __forceinline__ float dtype_max<c10::Half>() { return 65504.0f; }
template <>
__device__ __forceinline__ float dtype_max<c10::BFloat16>() { return 3.38953139e38f; }  // 0x7F7F
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  const float big = dtype_max<T>();
  return T(v < -big ? -big : (v > big ? big : v));  // round to nearest even for Half and BFloat16
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ bool not_finite(float v) { return !(fabsf(v) <= FLT_MAX); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Min, max and NaN/Inf flag of a group of len >= 1 values; every lane gets the result.
template <typename T>
__device__ __forceinline__ void warp_minmax_bad(const T* x, int64_t len, int lane, float& mn, float& mx,
                                                bool& bad) {
  float a = to_f(x[0]), b = a;
  bool f = false;
  for (int64_t j = lane; j < len; j += 32) {
    const float v = to_f(x[j]);
    a = fmaxf(a, v);
    b = fminf(b, v);
    f |= not_finite(v);
  }
  mx = warp_max(a);
  mn = warp_min(b);
  bad = __any_sync(kFullMask, f);
}

__device__ __forceinline__ float symmetric_scale(float mn, float mx) {
  const float pos = __fdiv_rn(mx > 0.0f ? mx : 0.0f, 7.0f);
  const float neg = __fdiv_rn(-(mn < 0.0f ? mn : 0.0f), 8.0f);
  const float s = pos > neg ? pos : neg;
  return s < kTinyScale ? 0.0f : s;
}
__device__ __forceinline__ float flush_tiny(float s) { return s < kTinyScale ? 0.0f : s; }
__device__ __forceinline__ float inverse(float s) { return s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f; }

// (mx - mn) / levels and the factor k (1, or kQuarter where mx - mn overflows) at which the group's values
// are taken so that their codes do not overflow either; 1-bit scales saturate (reference._range_scale).
__device__ __forceinline__ float range_scale(float mn, float mx, float levels, float& k) {
  k = __fsub_rn(mx, mn) > FLT_MAX ? kQuarter : 1.0f;
  const float s = flush_tiny(__fdiv_rn(__fdiv_rn(__fsub_rn(__fmul_rn(mx, k), __fmul_rn(mn, k)), levels), k));
  return s > FLT_MAX ? FLT_MAX : s;
}

// q * s + o, redone at a quarter and saturated where it overflows (reference._affine_decode).
__device__ __forceinline__ float affine_decode(float q, float s, float o) {
  const float v = __fadd_rn(__fmul_rn(q, s), o);
  if (fabsf(v) <= FLT_MAX) return v;
  const float lim = FLT_MAX * kQuarter;
  const float w = __fadd_rn(__fmul_rn(q, __fmul_rn(s, kQuarter)), __fmul_rn(o, kQuarter));
  return __fmul_rn(w < -lim ? -lim : (w > lim ? lim : w), 4.0f);
}

__device__ __forceinline__ int32_t code4(float v) {
  int32_t q = __float2int_rn(v);
  q = q < -8 ? -8 : q;
  q = q > 7 ? 7 : q;
  return q + 8;
}

__device__ __forceinline__ void flag_bad(int32_t* bad) { atomicOr(bad, 1); }

int64_t blocks_for(int64_t work, int64_t per_block = kThreads) {
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, per_block), 1 << 20));
}

// ------------------------------------------------------------------------- symmetric / asymmetric
template <typename T, bool ASYM>
__global__ void int4_group_compress_kernel(const T* __restrict__ x, int64_t n, int64_t group,
                                           uint8_t* __restrict__ payload, float* __restrict__ scales,
                                           float* __restrict__ offsets, int32_t* bad) {
  const int lane = threadIdx.x & 31;
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, 4);
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t off = g * group;
    const int64_t len = imin(group, n - off);
    const T* xg = x + off;
    float mn, mx;
    bool is_bad;
    warp_minmax_bad(xg, len, lane, mn, mx, is_bad);
    if (is_bad && lane == 0) flag_bad(bad);
    float s, o = 0.0f, k = 1.0f;
    if (ASYM) {
      s = range_scale(mn, mx, 15.0f, k);
      o = __fdiv_rn(__fadd_rn(__fmul_rn(mn, k), __fmul_rn(8.0f, __fmul_rn(s, k))), k);
    } else {
      s = symmetric_scale(mn, mx);
    }
    const float ok = __fmul_rn(o, k), inv = inverse(__fmul_rn(s, k));
    if (lane == 0) {
      scales[g] = s;
      if (ASYM) offsets[g] = o;
    }
    uint8_t* out = payload + g * gb;
    const int64_t nbytes = ceil_div(len, 2);
    for (int64_t j = lane; j < nbytes; j += 32) {
      const float v0 = to_f(xg[2 * j]);
      const int32_t lo = code4(__fmul_rn(ASYM ? __fsub_rn(__fmul_rn(v0, k), ok) : v0, inv));
      int32_t hi = 0;
      if (2 * j + 1 < len) {
        const float v1 = to_f(xg[2 * j + 1]);
        hi = code4(__fmul_rn(ASYM ? __fsub_rn(__fmul_rn(v1, k), ok) : v1, inv));
      }
      out[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename T, bool ASYM>
__global__ void int4_group_decompress_kernel(const uint8_t* __restrict__ payload, const float* __restrict__ scales,
                                             const float* __restrict__ offsets, int64_t n, int64_t group,
                                             T* __restrict__ out) {
  // One thread per packed byte; the group of byte b is found from the group's byte count.
  const int64_t gb = group_bytes(group, 4);
  const int64_t total = packed_bytes(n, group, 4);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = b / gb;
    const int64_t e = g * group + 2 * (b - g * gb);  // first element of this byte
    const int64_t end = imin(g * group + group, n);
    const int32_t byte = payload[b];
    const float s = scales[g];
    const float o = ASYM ? offsets[g] : 0.0f;
    const float q0 = static_cast<float>((byte & 15) - 8), q1 = static_cast<float>((byte >> 4) - 8);
    out[e] = from_f<T>(ASYM ? affine_decode(q0, s, o) : __fmul_rn(q0, s));
    if (e + 1 < end) out[e + 1] = from_f<T>(ASYM ? affine_decode(q1, s, o) : __fmul_rn(q1, s));
  }
}

// ------------------------------------------------------------------------------ per-channel stats
template <typename T>
__global__ void column_minmax_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, float* __restrict__ pmx,
                                     float* __restrict__ pmn, int32_t* bad) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t r0 = chunk * kRowChunk, r1 = imin(rows, r0 + kRowChunk);
  float a = to_f(x[r0 * cols + c]), b = a;
  bool f = false;
  for (int64_t r = r0; r < r1; ++r) {
    const float v = to_f(x[r * cols + c]);
    a = fmaxf(a, v);
    b = fminf(b, v);
    f |= not_finite(v);
  }
  pmx[chunk * cols + c] = a;
  pmn[chunk * cols + c] = b;
  if (f) flag_bad(bad);
}

__global__ void column_scale_kernel(const float* __restrict__ pmx, const float* __restrict__ pmn, int64_t nchunks,
                                    int64_t cols, float* __restrict__ scales, float* __restrict__ inv) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float a = pmx[c], b = pmn[c];
  for (int64_t ch = 1; ch < nchunks; ++ch) {
    a = fmaxf(a, pmx[ch * cols + c]);
    b = fminf(b, pmn[ch * cols + c]);
  }
  scales[c] = symmetric_scale(b, a);
  inv[c] = inverse(scales[c]);
}

template <typename T>
__global__ void chan_quantize_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, const float* __restrict__ inv,
                                     uint8_t* __restrict__ payload) {
  const int64_t rb = group_bytes(cols, 4);
  const int64_t total = rows * rb;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = b / rb, c = 2 * (b - r * rb);
    const T* xr = x + r * cols;
    const int32_t lo = code4(__fmul_rn(to_f(xr[c]), inv[c]));
    const int32_t hi = c + 1 < cols ? code4(__fmul_rn(to_f(xr[c + 1]), inv[c + 1])) : 0;
    payload[b] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

template <typename T>
__global__ void chan_decompress_kernel(const uint8_t* __restrict__ payload, const float* __restrict__ scales,
                                       int64_t rows, int64_t cols, T* __restrict__ out) {
  const int64_t rb = group_bytes(cols, 4);
  const int64_t total = rows * rb;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = b / rb, c = 2 * (b - r * rb);
    const int32_t byte = payload[b];
    T* y = out + r * cols;
    y[c] = from_f<T>(__fmul_rn(static_cast<float>((byte & 15) - 8), scales[c]));
    if (c + 1 < cols) y[c + 1] = from_f<T>(__fmul_rn(static_cast<float>((byte >> 4) - 8), scales[c + 1]));
  }
}

template <typename T>
__global__ void column_abs_sum_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, double* __restrict__ part) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t r0 = chunk * kRowChunk, r1 = imin(rows, r0 + kRowChunk);
  double acc = 0.0;
  for (int64_t r = r0; r < r1; ++r) acc = __dadd_rn(acc, static_cast<double>(fabsf(to_f(x[r * cols + c]))));
  part[chunk * cols + c] = acc;
}

__global__ void sum_chunks_kernel(const double* __restrict__ part, int64_t nchunks, int64_t cols,
                                  double* __restrict__ sums) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  double s = 0.0;
  for (int64_t ch = 0; ch < nchunks; ++ch) s = __dadd_rn(s, part[ch * cols + c]);
  sums[c] = s;
}

// ------------------------------------------------------------------------------- outlier-separated
template <typename T>
__global__ void outlier_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                    const uint8_t* __restrict__ is_outlier, uint8_t* __restrict__ payload,
                                    float* __restrict__ scales, int32_t* bad) {
  const int lane = threadIdx.x & 31;
  const int64_t rb = group_bytes(cols, 4);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    // The row's first dense value seeds every lane: neutral for min/max, also for lanes without columns.
    const float seed_value = is_outlier[0] ? 0.0f : to_f(xr[0]);
    float a = seed_value, b = seed_value;
    bool f = false;
    for (int64_t c = lane; c < cols; c += 32) {
      const float raw = to_f(xr[c]);
      f |= not_finite(raw);
      const float v = is_outlier[c] ? 0.0f : raw;
      a = fmaxf(a, v);
      b = fminf(b, v);
    }
    const float mx = warp_max(a), mn = warp_min(b);
    if (__any_sync(kFullMask, f) && lane == 0) flag_bad(bad);
    const float s = symmetric_scale(mn, mx);
    const float inv = inverse(s);
    if (lane == 0) scales[r] = s;
    uint8_t* out = payload + r * rb;
    for (int64_t j = lane; j < rb; j += 32) {
      const int64_t c = 2 * j;
      const float d0 = is_outlier[c] ? 0.0f : to_f(xr[c]);
      const int32_t lo = code4(__fmul_rn(d0, inv));
      int32_t hi = 0;
      if (c + 1 < cols) {
        const float d1 = is_outlier[c + 1] ? 0.0f : to_f(xr[c + 1]);
        hi = code4(__fmul_rn(d1, inv));
      }
      out[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename T>
__global__ void gather_outliers_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                       const int32_t* __restrict__ idx, int64_t k, T* __restrict__ outliers) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k;
    outliers[i] = x[r * cols + idx[i - r * k]];
  }
}

template <typename T>
__global__ void scatter_outliers_kernel(const T* __restrict__ outliers, int64_t rows, int64_t cols,
                                        const int32_t* __restrict__ idx, int64_t k, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k;
    const int32_t c = idx[i - r * k];
    // Indices come from the payload; checking them on the host would cost a sync per tensor, so a damaged
    // one is skipped here instead of writing outside `out`.
    if (c >= 0 && c < cols) out[r * cols + c] = outliers[i];
  }
}

// ------------------------------------------------------------------------------------- bit masks
__global__ void bitmask_pack_kernel(const uint8_t* __restrict__ x, int64_t n, uint8_t* __restrict__ out, int32_t* bad) {
  const int64_t nbytes = ceil_div(n, 8);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nbytes;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t b = 0, high = 0;
    const int64_t e0 = 8 * i;
    const int m = static_cast<int>(imin(8, n - e0));
    for (int j = 0; j < m; ++j) {
      const uint32_t v = x[e0 + j];
      high |= v;
      b |= (v & 1u) << j;
    }
    out[i] = static_cast<uint8_t>(b);
    if (high & 0xFEu) flag_bad(bad);
  }
}

__global__ void bitmask_unpack_kernel(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[e] = (in[e >> 3] >> (e & 7)) & 1;
  }
}

// --------------------------------------------------------------------------- stochastic rounding
template <typename T, int BITS>
__global__ void stochastic_compress_kernel(const T* __restrict__ x, int64_t n, int64_t group, uint64_t seed,
                                           uint8_t* __restrict__ payload, float* __restrict__ mins,
                                           float* __restrict__ scales, int32_t* bad) {
  constexpr int per_byte = 8 / BITS;
  constexpr int32_t qmax = (1 << BITS) - 1;
  const int lane = threadIdx.x & 31;
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, BITS);
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t off = g * group;
    const int64_t len = imin(group, n - off);
    const T* xg = x + off;
    float mn, mx;
    bool is_bad;
    warp_minmax_bad(xg, len, lane, mn, mx, is_bad);
    if (is_bad && lane == 0) flag_bad(bad);
    mn = __fadd_rn(mn, 0.0f);  // -0.0 -> +0.0, as on the CPU
    float k;
    const float s = range_scale(mn, mx, static_cast<float>(qmax), k);
    const float mk = __fmul_rn(mn, k), inv = inverse(__fmul_rn(s, k));
    if (lane == 0) {
      mins[g] = mn;
      scales[g] = s;
    }
    uint8_t* out = payload + g * gb;
    const int64_t nbytes = ceil_div(len * BITS, 8);
    for (int64_t j = lane; j < nbytes; j += 32) {
      uint32_t byte = 0;
      for (int t = 0; t < per_byte; ++t) {
        const int64_t e = j * per_byte + t;
        if (e < len) {
          const float tv = __fmul_rn(__fsub_rn(__fmul_rn(to_f(xg[e]), k), mk), inv);
          int32_t q = __float2int_rz(tv);
          const float frac = __fsub_rn(tv, static_cast<float>(q));
          const float u = __fmul_rn(static_cast<float>(uniform24(seed, static_cast<uint64_t>(off + e))), 0x1p-24f);
          q += u < frac ? 1 : 0;
          q = q < qmax ? q : qmax;
          byte |= static_cast<uint32_t>(q) << (t * BITS);
        }
      }
      out[j] = static_cast<uint8_t>(byte);
    }
  }
}

template <typename T, int BITS>
__global__ void stochastic_decompress_kernel(const uint8_t* __restrict__ payload, const float* __restrict__ mins,
                                             const float* __restrict__ scales, int64_t n, int64_t group,
                                             T* __restrict__ out) {
  constexpr int per_byte = 8 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t gb = group_bytes(group, BITS);
  const int64_t total = packed_bytes(n, group, BITS);
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < total;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = b / gb;
    const int64_t e0 = g * group + per_byte * (b - g * gb);
    const int64_t end = imin(g * group + group, n);
    const uint32_t byte = payload[b];
    const float s = scales[g], mn = mins[g];
    for (int t = 0; t < per_byte; ++t) {
      if (e0 + t < end)
        out[e0 + t] = from_f<T>(affine_decode(static_cast<float>((byte >> (t * BITS)) & mask), s, mn));
    }
  }
}

// ------------------------------------------------------------------------------------- host side
template <typename F>
void dispatch_float(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK(false, "codec kernels take float32, float16 or bfloat16 tensors, got ", st);
  }
}

template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: check_bits(bits);
  }
}

void check_cuda(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor here, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous() first)");
}

at::Tensor new_flag(const at::Tensor& like) { return at::zeros({1}, like.options().dtype(at::kInt)); }
at::TensorOptions u8(const at::Tensor& like) { return like.options().dtype(at::kByte); }
at::TensorOptions f32(const at::Tensor& like) { return like.options().dtype(at::kFloat); }

#define ADACC_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

template <bool ASYM>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int4_group_compress(const at::Tensor& x, int64_t group) {
  check_float_input(x, "x", 1);
  check_cuda(x, "x");
  check_group(group);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({packed_bytes(n, group, 4)}, u8(x));
  at::Tensor scales = at::empty({ceil_div(n, group)}, f32(x));
  at::Tensor offsets = at::empty({ASYM ? ceil_div(n, group) : 0}, f32(x));
  at::Tensor bad = new_flag(x);
  if (n) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      int4_group_compress_kernel<T, ASYM><<<blocks_for(ceil_div(n, group), kWarpsPerBlock), kThreads, 0, stream>>>(
          x.data_ptr<T>(), n, group, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
          ASYM ? offsets.data_ptr<float>() : nullptr, bad.data_ptr<int32_t>());
      ADACC_CHECK_LAUNCH();
    });
  }
  return {payload, scales, offsets, bad};
}

template <bool ASYM>
void int4_group_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor* offsets,
                           int64_t group, at::Tensor& out) {
  check_cuda(payload, "payload");
  check_cuda(scales, "scales");
  check_cuda(out, "out");
  check_group(group);
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == packed_bytes(n, group, 4) && scales.numel() == ceil_div(n, group),
              "int4 decompress: payload/scales do not match out's size");
  if (!n) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    int4_group_decompress_kernel<T, ASYM><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
        payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), ASYM ? offsets->data_ptr<float>() : nullptr, n,
        group, out.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
  });
}

}  // namespace

// ---------------------------------------------------------------------------------- entry points
Tensors3 sym_int4_compress(const at::Tensor& x, int64_t group) {
  auto [payload, scales, offsets, bad] = int4_group_compress<false>(x, group);
  return {payload, scales, bad};
}

void sym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, int64_t group, at::Tensor& out) {
  int4_group_decompress<false>(payload, scales, nullptr, group, out);
}

Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group) { return int4_group_compress<true>(x, group); }

void asym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t group, at::Tensor& out) {
  check_cuda(offsets, "offsets");
  TORCH_CHECK(offsets.numel() == scales.numel(), "asym_int4_decompress: offsets do not match scales");
  int4_group_decompress<true>(payload, scales, &offsets, group, out);
}

Tensors3 chan_int4_compress(const at::Tensor& x) {
  check_float_input(x, "x", 2);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor payload = at::empty({rows * group_bytes(cols, 4)}, u8(x));
  at::Tensor scales = at::zeros({cols}, f32(x));
  at::Tensor bad = new_flag(x);
  if (!x.numel()) return {payload, scales, bad};
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  TORCH_CHECK(nchunks <= 65535, "chan_int4_compress: too many rows (", rows, ") for one launch");
  at::Tensor pmx = at::empty({nchunks, cols}, f32(x)), pmn = at::empty({nchunks, cols}, f32(x));
  at::Tensor inv = at::empty({cols}, f32(x));
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(ceil_div(cols, kThreads)), static_cast<unsigned>(nchunks));
    column_minmax_kernel<T><<<grid, kThreads, 0, stream>>>(x.data_ptr<T>(), rows, cols, pmx.data_ptr<float>(),
                                                          pmn.data_ptr<float>(), bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
    column_scale_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(pmx.data_ptr<float>(), pmn.data_ptr<float>(),
                                                                   nchunks, cols, scales.data_ptr<float>(),
                                                                   inv.data_ptr<float>());
    ADACC_CHECK_LAUNCH();
    chan_quantize_kernel<T><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
        x.data_ptr<T>(), rows, cols, inv.data_ptr<float>(), payload.data_ptr<uint8_t>());
    ADACC_CHECK_LAUNCH();
  });
  return {payload, scales, bad};
}

void chan_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, at::Tensor& out) {
  check_cuda(payload, "payload");
  check_cuda(scales, "scales");
  check_cuda(out, "out");
  TORCH_CHECK(out.dim() == 2, "chan_int4_decompress: out must be 2-D [rows, channels]");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t rows = out.size(0), cols = out.size(1);
  TORCH_CHECK(payload.numel() == rows * group_bytes(cols, 4) && scales.numel() == cols,
              "chan_int4_decompress: payload/scales do not match out's shape");
  if (!out.numel()) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    chan_decompress_kernel<T><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
        payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), rows, cols, out.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
  });
}

at::Tensor channel_abs_sum(const at::Tensor& x) {
  check_float_input(x, "x", 2);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor sums = at::zeros({cols}, x.options().dtype(at::kDouble));
  if (!x.numel()) return sums;
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  TORCH_CHECK(nchunks <= 65535, "channel_abs_sum: too many rows (", rows, ") for one launch");
  at::Tensor part = at::empty({nchunks, cols}, x.options().dtype(at::kDouble));
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(ceil_div(cols, kThreads)), static_cast<unsigned>(nchunks));
    column_abs_sum_kernel<T><<<grid, kThreads, 0, stream>>>(x.data_ptr<T>(), rows, cols, part.data_ptr<double>());
    ADACC_CHECK_LAUNCH();
    sum_chunks_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(part.data_ptr<double>(), nchunks, cols,
                                                                 sums.data_ptr<double>());
    ADACC_CHECK_LAUNCH();
  });
  return sums;
}

Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx) {
  check_float_input(x, "x", 2);
  check_cuda(x, "x");
  check_cuda(idx, "idx");
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 1, "outlier_int4_compress: idx must be 1-D int32");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1), k = idx.numel();
  at::Tensor payload = at::empty({rows * group_bytes(cols, 4)}, u8(x));
  at::Tensor scales = at::zeros({rows}, f32(x));
  at::Tensor outliers = at::empty({rows, k}, x.options());
  at::Tensor bad = new_flag(x);
  if (!x.numel()) return {payload, scales, outliers, bad};
  at::Tensor is_outlier = at::zeros({cols}, u8(x));
  if (k) is_outlier.index_fill_(0, idx.to(at::kLong), 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    outlier_rows_kernel<T><<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
        x.data_ptr<T>(), rows, cols, is_outlier.data_ptr<uint8_t>(), payload.data_ptr<uint8_t>(),
        scales.data_ptr<float>(), bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
    if (k) {
      gather_outliers_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(
          x.data_ptr<T>(), rows, cols, idx.data_ptr<int32_t>(), k, outliers.data_ptr<T>());
      ADACC_CHECK_LAUNCH();
    }
  });
  return {payload, scales, outliers, bad};
}

void outlier_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& outliers,
                             const at::Tensor& idx, at::Tensor& out) {
  check_cuda(payload, "payload");
  check_cuda(scales, "scales");
  check_cuda(outliers, "outliers");
  check_cuda(idx, "idx");
  check_cuda(out, "out");
  TORCH_CHECK(out.dim() == 2, "outlier_int4_decompress: out must be 2-D [rows, channels]");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t rows = out.size(0), cols = out.size(1), k = idx.numel();
  TORCH_CHECK(idx.scalar_type() == at::kInt, "outlier_int4_decompress: idx must be int32");
  TORCH_CHECK(payload.numel() == rows * group_bytes(cols, 4) && scales.numel() == rows &&
                  outliers.numel() == rows * k && outliers.scalar_type() == out.scalar_type(),
              "outlier_int4_decompress: payload/scales/outliers do not match out");
  if (!out.numel()) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    // The dense rows decode exactly like the channel-wise layout with one scale per row: reuse the
    // per-group decoder with group = cols (rows start on byte boundaries in both).
    int4_group_decompress_kernel<T, false><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
        payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, rows * cols, cols, out.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
    if (k) {
      scatter_outliers_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(
          outliers.data_ptr<T>(), rows, cols, idx.data_ptr<int32_t>(), k, out.data_ptr<T>());
      ADACC_CHECK_LAUNCH();
    }
  });
}

Tensors2 bitmask_pack(const at::Tensor& x) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBool || x.scalar_type() == at::kByte,
              "bitmask_pack takes a bool or uint8 mask, got ", x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({ceil_div(n, 8)}, u8(x));
  at::Tensor bad = new_flag(x);
  if (n) {
    bitmask_pack_kernel<<<blocks_for(payload.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<const uint8_t*>(x.data_ptr()), n, payload.data_ptr<uint8_t>(), bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
  }
  return {payload, bad};
}

void bitmask_unpack(const at::Tensor& payload, at::Tensor& out) {
  check_cuda(payload, "payload");
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kBool || out.scalar_type() == at::kByte,
              "bitmask_unpack writes a bool or uint8 tensor, got ", out.scalar_type());
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == ceil_div(n, 8), "bitmask_unpack: payload does not match out's size");
  if (!n) return;
  bitmask_unpack_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      payload.data_ptr<uint8_t>(), n, static_cast<uint8_t*>(out.data_ptr()));
  ADACC_CHECK_LAUNCH();
}

Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed) {
  check_float_input(x, "x", 1);
  check_cuda(x, "x");
  check_group(group);
  check_bits(bits);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({packed_bytes(n, group, static_cast<int>(bits))}, u8(x));
  at::Tensor mins = at::empty({ceil_div(n, group)}, f32(x));
  at::Tensor scales = at::empty({ceil_div(n, group)}, f32(x));
  at::Tensor bad = new_flag(x);
  if (n) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      dispatch_bits(bits, [&](auto b) {
        constexpr int B = decltype(b)::value;
        stochastic_compress_kernel<T, B><<<blocks_for(ceil_div(n, group), kWarpsPerBlock), kThreads, 0, stream>>>(
            x.data_ptr<T>(), n, group, static_cast<uint64_t>(seed), payload.data_ptr<uint8_t>(),
            mins.data_ptr<float>(), scales.data_ptr<float>(), bad.data_ptr<int32_t>());
        ADACC_CHECK_LAUNCH();
      });
    });
  }
  return {payload, mins, scales, bad};
}

void stochastic_decompress(const at::Tensor& payload, const at::Tensor& mins, const at::Tensor& scales,
                           int64_t group, int64_t bits, at::Tensor& out) {
  check_cuda(payload, "payload");
  check_cuda(mins, "mins");
  check_cuda(scales, "scales");
  check_cuda(out, "out");
  check_group(group);
  check_bits(bits);
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == packed_bytes(n, group, static_cast<int>(bits)) &&
                  scales.numel() == ceil_div(n, group) && mins.numel() == scales.numel(),
              "stochastic_decompress: payload/mins/scales do not match out's size");
  if (!n) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      constexpr int B = decltype(b)::value;
      stochastic_decompress_kernel<T, B><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
          payload.data_ptr<uint8_t>(), mins.data_ptr<float>(), scales.data_ptr<float>(), n, group,
          out.data_ptr<T>());
      ADACC_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace adacc
