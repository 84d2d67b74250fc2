// CUDA kernels of the activation codecs. Same signatures, layouts and float32 arithmetic as the CPU
// kernels and the pure-torch reference (megatron_adacc/codecs/reference.py): every value and group is
// computed by the functions of codec_math.h, which the CPU kernels share, so this file holds only launch
// geometry and the reductions (warp shuffles, chunked column partials).
//
// Layout of the work:
//   * per-group codecs (symmetric, asymmetric, stochastic, outlier rows): one warp per group; lanes stride
//     over the group (coalesced), min/max are reduced with shuffles (exact in any order), then each lane
//     packs whole bytes;
//   * per-channel statistics (channel-wise scales, outlier abs-sums): one thread per channel over a chunk
//     of rows (warps read consecutive channels: coalesced), chunk partials reduced in chunk order, so the
//     float64 sums do not depend on the launch;
//   * element-wise decode and bit masks: one thread per packed byte, grid-stride loops.
//
// Decodes always take codec_math.h's GUARDED path: on the CPU skipping it per group pays off in
// vectorized loops, here the check would cost as much as the guard.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "codec_math.h"
#include "codecs.h"

namespace adacc {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int64_t kRowChunk = 256;  // same chunking as the CPU kernels

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ void flag_bad(int32_t* bad) { atomicOr(bad, 1); }

// Group g of x (n values in groups of `group`) as one warp sees it: where it starts, how long it is, and
// its min and max, which every lane gets; NaN/Inf in it is flagged in `bad`.
struct WarpGroup {
  int64_t off, len;
  float mn, mx;
};

template <typename T>
__device__ __forceinline__ WarpGroup warp_group(const T* x, int64_t n, int64_t group, int64_t g, int32_t* bad) {
  const int lane = threadIdx.x & 31;
  WarpGroup w{g * group, imin(group, n - g * group), 0.0f, 0.0f};
  float a = to_float(x[w.off]), b = a;
  bool f = false;
  for (int64_t j = lane; j < w.len; j += 32) {
    const float v = to_float(x[w.off + j]);
    a = fmaxf(a, v);
    b = fminf(b, v);
    f |= not_finite(v);
  }
  w.mx = warp_max(a);
  w.mn = warp_min(b);
  if (__any_sync(kFullMask, f) && lane == 0) flag_bad(bad);
  return w;
}

int64_t blocks_for(int64_t work, int64_t per_block = kThreads) {
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, per_block), 1 << 20));
}

#define ADACC_GRID_STRIDE(i, count)                                                                   \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
#define ADACC_WARP_STRIDE(g, count)                                                                       \
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; g < (count); \
       g += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock)

// ------------------------------------------------------------------------- symmetric / asymmetric
// The 4-bit code of v in its group: symmetric (v * inv) or asymmetric (affine, always scaled by k).
template <bool ASYM>
__device__ __forceinline__ int32_t group_code4(float v, const Affine& a) {
  return ASYM ? affine_code4<true>(v, a) : sym_code4(v, a.inv);
}

template <typename T, bool ASYM>
__global__ void int4_group_compress_kernel(const T* __restrict__ x, int64_t n, int64_t group,
                                           uint8_t* __restrict__ payload, float* __restrict__ scales,
                                           float* __restrict__ offsets, int32_t* bad) {
  const int lane = threadIdx.x & 31;
  const int64_t gb = group_bytes(group, 4);
  ADACC_WARP_STRIDE(g, ceil_div(n, group)) {
    const WarpGroup w = warp_group(x, n, group, g, bad);
    const T* xg = x + w.off;
    const Affine a = ASYM ? asymmetric_group(w.mn, w.mx) : symmetric_group(w.mn, w.mx);
    if (lane == 0) {
      scales[g] = a.scale;
      if (ASYM) offsets[g] = a.offset;
    }
    uint8_t* out = payload + g * gb;
    for (int64_t j = lane; j < ceil_div(w.len, 2); j += 32) {
      const int32_t hi = 2 * j + 1 < w.len ? group_code4<ASYM>(to_float(xg[2 * j + 1]), a) : 0;
      out[j] = pack_nibbles(group_code4<ASYM>(to_float(xg[2 * j]), a), hi);
    }
  }
}

template <typename T, bool ASYM>
__global__ void int4_group_decompress_kernel(const uint8_t* __restrict__ payload, const float* __restrict__ scales,
                                             const float* __restrict__ offsets, int64_t n, int64_t group,
                                             T* __restrict__ out) {
  // One thread per packed byte; the group of byte b is found from the group's byte count.
  const int64_t gb = group_bytes(group, 4);
  ADACC_GRID_STRIDE(b, packed_bytes(n, group, 4)) {
    const int64_t g = b / gb;
    const int64_t e = g * group + 2 * (b - g * gb);  // first element of this byte
    const int64_t end = imin(g * group + group, n);
    const float s = scales[g];
    for (int j = 0; j < 2 && e + j < end; ++j) {
      const float q = nibble(payload[b], j);
      out[e + j] = from_float<T>(ASYM ? affine_value<T, true>(q, s, offsets[g]) : sym_value<T, true>(q, s));
    }
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
  float a = to_float(x[r0 * cols + c]), b = a;
  bool f = false;
  for (int64_t r = r0; r < r1; ++r) {
    const float v = to_float(x[r * cols + c]);
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
  ADACC_GRID_STRIDE(b, rows * rb) {
    const int64_t r = b / rb, c = 2 * (b - r * rb);
    const T* xr = x + r * cols;
    const int32_t hi = c + 1 < cols ? sym_code4(to_float(xr[c + 1]), inv[c + 1]) : 0;
    payload[b] = pack_nibbles(sym_code4(to_float(xr[c]), inv[c]), hi);
  }
}

template <typename T>
__global__ void chan_decompress_kernel(const uint8_t* __restrict__ payload, const float* __restrict__ scales,
                                       int64_t rows, int64_t cols, T* __restrict__ out) {
  const int64_t rb = group_bytes(cols, 4);
  ADACC_GRID_STRIDE(b, rows * rb) {
    const int64_t r = b / rb, c = 2 * (b - r * rb);
    for (int j = 0; j < 2 && c + j < cols; ++j)
      out[r * cols + c + j] = from_float<T>(sym_value<T, true>(nibble(payload[b], j), scales[c + j]));
  }
}

template <typename T>
__global__ void column_abs_sum_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, double* __restrict__ part) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t r0 = chunk * kRowChunk, r1 = imin(rows, r0 + kRowChunk);
  double acc = 0.0;
  for (int64_t r = r0; r < r1; ++r) acc = __dadd_rn(acc, static_cast<double>(fabsf(to_float(x[r * cols + c]))));
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
  ADACC_WARP_STRIDE(r, rows) {
    const T* xr = x + r * cols;
    // The row's first dense value seeds every lane: neutral for min/max, also for lanes without columns.
    float a = dense_value(to_float(xr[0]), is_outlier[0]), b = a;
    bool f = false;
    for (int64_t c = lane; c < cols; c += 32) {
      const float raw = to_float(xr[c]);
      f |= not_finite(raw);
      a = fmaxf(a, dense_value(raw, is_outlier[c]));
      b = fminf(b, dense_value(raw, is_outlier[c]));
    }
    const float mx = warp_max(a), mn = warp_min(b);
    if (__any_sync(kFullMask, f) && lane == 0) flag_bad(bad);
    const float s = symmetric_scale(mn, mx);
    const float inv = inverse(s);
    if (lane == 0) scales[r] = s;
    uint8_t* out = payload + r * rb;
    for (int64_t j = lane; j < rb; j += 32) {
      const int64_t c = 2 * j;
      const int32_t hi = c + 1 < cols ? sym_code4(dense_value(to_float(xr[c + 1]), is_outlier[c + 1]), inv) : 0;
      out[j] = pack_nibbles(sym_code4(dense_value(to_float(xr[c]), is_outlier[c]), inv), hi);
    }
  }
}

template <typename T>
__global__ void gather_outliers_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                       const int32_t* __restrict__ idx, int64_t k, T* __restrict__ outliers) {
  ADACC_GRID_STRIDE(i, rows * k) {
    const int64_t r = i / k;
    outliers[i] = x[r * cols + idx[i - r * k]];
  }
}

template <typename T>
__global__ void scatter_outliers_kernel(const T* __restrict__ outliers, int64_t rows, int64_t cols,
                                        const int32_t* __restrict__ idx, int64_t k, T* __restrict__ out) {
  ADACC_GRID_STRIDE(i, rows * k) {
    const int64_t r = i / k;
    const int32_t c = idx[i - r * k];
    // Indices come from the payload; checking them on the host would cost a sync per tensor, so a damaged
    // one is skipped here instead of writing outside `out`.
    if (c >= 0 && c < cols) out[r * cols + c] = outliers[i];
  }
}

// ------------------------------------------------------------------------------------- bit masks
__global__ void bitmask_pack_kernel(const uint8_t* __restrict__ x, int64_t n, uint8_t* __restrict__ out, int32_t* bad) {
  ADACC_GRID_STRIDE(i, ceil_div(n, 8)) {
    // The (up to) eight mask bytes of output byte i as one little-endian word, missing bytes zero.
    uint64_t v = 0;
    const int m = static_cast<int>(imin(8, n - 8 * i));
    for (int j = 0; j < m; ++j) v |= static_cast<uint64_t>(x[8 * i + j]) << (8 * j);
    out[i] = gather_bits(v);
    if (mask_bytes_bad(v)) flag_bad(bad);
  }
}

__global__ void bitmask_unpack_kernel(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ out) {
  ADACC_GRID_STRIDE(e, n) { out[e] = static_cast<uint8_t>(field<1>(in[e >> 3], static_cast<int>(e & 7))); }
}

// --------------------------------------------------------------------------- stochastic rounding
template <typename T, int BITS>
__global__ void stochastic_compress_kernel(const T* __restrict__ x, int64_t n, int64_t group, uint64_t seed,
                                           uint8_t* __restrict__ payload, float* __restrict__ mins,
                                           float* __restrict__ scales, int32_t* bad) {
  constexpr int per_byte = 8 / BITS;
  const int lane = threadIdx.x & 31;
  const int64_t gb = group_bytes(group, BITS);
  ADACC_WARP_STRIDE(g, ceil_div(n, group)) {
    const WarpGroup w = warp_group(x, n, group, g, bad);
    const T* xg = x + w.off;
    const Affine a = stochastic_group(w.mn, w.mx, static_cast<float>((1 << BITS) - 1));
    if (lane == 0) {
      mins[g] = a.offset;
      scales[g] = a.scale;
    }
    uint8_t* out = payload + g * gb;
    for (int64_t j = lane; j < ceil_div(w.len * BITS, 8); j += 32) {
      uint32_t byte = 0;
      for (int t = 0; t < per_byte && j * per_byte + t < w.len; ++t) {
        const int64_t e = j * per_byte + t;
        const float pos = code_position<true>(to_float(xg[e]), a);
        byte |= put_field<BITS>(stochastic_code<BITS>(pos, uniform24(seed, static_cast<uint64_t>(w.off + e))), t);
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
  const int64_t gb = group_bytes(group, BITS);
  ADACC_GRID_STRIDE(b, packed_bytes(n, group, BITS)) {
    const int64_t g = b / gb;
    const int64_t e0 = g * group + per_byte * (b - g * gb);
    const int64_t end = imin(g * group + group, n);
    for (int t = 0; t < per_byte && e0 + t < end; ++t) {
      const float q = static_cast<float>(field<BITS>(payload[b], t));
      out[e0 + t] = from_float<T>(affine_value<T, true>(q, scales[g], mins[g]));
    }
  }
}

// ------------------------------------------------------------------------------------- host side
at::Tensor new_flag(const at::Tensor& like) { return at::zeros({1}, like.options().dtype(at::kInt)); }
at::Tensor float_chunks(const at::Tensor& like, int64_t nchunks, int64_t cols) {
  return at::empty({nchunks, cols}, like.options().dtype(at::kFloat));
}

#define ADACC_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

// Grids of the column kernels: blockIdx.y is the row chunk, which CUDA caps at 65535.
dim3 column_grid(const char* fn, int64_t rows, int64_t cols) {
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  TORCH_CHECK(nchunks <= 65535, fn, ": too many rows (", rows, ") for one launch");
  return dim3(static_cast<unsigned>(ceil_div(cols, kThreads)), static_cast<unsigned>(nchunks));
}

template <bool ASYM>
Tensors4 int4_group_compress(const at::Tensor& x, int64_t group) {
  check_grouped_compress(x, group, 4, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, packed_bytes(n, group, 4)), scales = floats_like(x, ceil_div(n, group));
  at::Tensor offsets = floats_like(x, ASYM ? ceil_div(n, group) : 0), bad = new_flag(x);
  if (!n) return {payload, scales, offsets, bad};
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    int4_group_compress_kernel<T, ASYM><<<blocks_for(ceil_div(n, group), kWarpsPerBlock), kThreads, 0,
                                          c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<T>(), n, group, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
        ASYM ? offsets.data_ptr<float>() : nullptr, bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
  });
  return {payload, scales, offsets, bad};
}

template <bool ASYM>
void int4_group_decompress(const uint8_t* payload, const float* scales, const float* offsets, int64_t group,
                           at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    int4_group_decompress_kernel<T, ASYM><<<blocks_for(packed_bytes(out.numel(), group, 4)), kThreads, 0,
                                            c10::cuda::getCurrentCUDAStream()>>>(
        payload, scales, offsets, out.numel(), group, out.data_ptr<T>());
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
  check_grouped_decompress("sym_int4_decompress", payload, {scales}, group, 4, out, at::kCUDA);
  int4_group_decompress<false>(payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, group, out);
}

Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group) { return int4_group_compress<true>(x, group); }

void asym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t group, at::Tensor& out) {
  check_grouped_decompress("asym_int4_decompress", payload, {scales, offsets}, group, 4, out, at::kCUDA);
  int4_group_decompress<true>(payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(),
                              group, out);
}

Tensors3 chan_int4_compress(const at::Tensor& x) {
  check_rows_input(x, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor payload = bytes_like(x, rows * group_bytes(cols, 4)), scales = floats_like(x, cols, true);
  at::Tensor bad = new_flag(x);
  if (!x.numel()) return {payload, scales, bad};
  const dim3 grid = column_grid("chan_int4_compress", rows, cols);
  at::Tensor pmx = float_chunks(x, grid.y, cols), pmn = float_chunks(x, grid.y, cols), inv = floats_like(x, cols);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    column_minmax_kernel<T><<<grid, kThreads, 0, stream>>>(x.data_ptr<T>(), rows, cols, pmx.data_ptr<float>(),
                                                          pmn.data_ptr<float>(), bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
    column_scale_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(pmx.data_ptr<float>(), pmn.data_ptr<float>(),
                                                                   grid.y, cols, scales.data_ptr<float>(),
                                                                   inv.data_ptr<float>());
    ADACC_CHECK_LAUNCH();
    chan_quantize_kernel<T><<<blocks_for(payload.numel()), kThreads, 0, stream>>>(
        x.data_ptr<T>(), rows, cols, inv.data_ptr<float>(), payload.data_ptr<uint8_t>());
    ADACC_CHECK_LAUNCH();
  });
  return {payload, scales, bad};
}

void chan_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, at::Tensor& out) {
  check_chan_decompress(payload, scales, out, at::kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    chan_decompress_kernel<T><<<blocks_for(payload.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.size(0), out.size(1), out.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
  });
}

at::Tensor channel_abs_sum(const at::Tensor& x) {
  check_rows_input(x, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor sums = at::zeros({cols}, x.options().dtype(at::kDouble));
  if (!x.numel()) return sums;
  const dim3 grid = column_grid("channel_abs_sum", rows, cols);
  at::Tensor part = at::empty({grid.y, cols}, x.options().dtype(at::kDouble));
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    column_abs_sum_kernel<T><<<grid, kThreads, 0, stream>>>(x.data_ptr<T>(), rows, cols, part.data_ptr<double>());
    ADACC_CHECK_LAUNCH();
    sum_chunks_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(part.data_ptr<double>(), grid.y, cols,
                                                                 sums.data_ptr<double>());
    ADACC_CHECK_LAUNCH();
  });
  return sums;
}

Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx) {
  check_rows_input(x, at::kCUDA);
  check_outlier_index("outlier_int4_compress", idx, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1), k = idx.numel();
  at::Tensor payload = bytes_like(x, rows * group_bytes(cols, 4)), scales = floats_like(x, rows, true);
  at::Tensor outliers = at::empty({rows, k}, x.options()), bad = new_flag(x);
  if (!x.numel()) return {payload, scales, outliers, bad};
  at::Tensor is_outlier = at::zeros({cols}, x.options().dtype(at::kByte));
  if (k) is_outlier.index_fill_(0, idx.to(at::kLong), 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    outlier_rows_kernel<T><<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
        x.data_ptr<T>(), rows, cols, is_outlier.data_ptr<uint8_t>(), payload.data_ptr<uint8_t>(),
        scales.data_ptr<float>(), bad.data_ptr<int32_t>());
    ADACC_CHECK_LAUNCH();
    if (!k) return;
    gather_outliers_kernel<T><<<blocks_for(rows * k), kThreads, 0, stream>>>(
        x.data_ptr<T>(), rows, cols, idx.data_ptr<int32_t>(), k, outliers.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
  });
  return {payload, scales, outliers, bad};
}

void outlier_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& outliers,
                             const at::Tensor& idx, at::Tensor& out) {
  check_outlier_decompress(payload, scales, outliers, idx, out, at::kCUDA);
  // The dense rows decode like symmetric groups of one row each (rows start on byte boundaries in both).
  // Checking the payload's channel indices here would cost a sync: the scatter skips a damaged one.
  const int64_t rows = out.size(0), cols = out.size(1), k = idx.numel();
  int4_group_decompress<false>(payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), nullptr, cols, out);
  if (!out.numel() || !k) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    scatter_outliers_kernel<T><<<blocks_for(rows * k), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        outliers.data_ptr<T>(), rows, cols, idx.data_ptr<int32_t>(), k, out.data_ptr<T>());
    ADACC_CHECK_LAUNCH();
  });
}

Tensors2 bitmask_pack(const at::Tensor& x) {
  check_mask(x, "x", at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, ceil_div(n, 8)), bad = new_flag(x);
  if (!n) return {payload, bad};
  bitmask_pack_kernel<<<blocks_for(payload.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(x.data_ptr()), n, payload.data_ptr<uint8_t>(), bad.data_ptr<int32_t>());
  ADACC_CHECK_LAUNCH();
  return {payload, bad};
}

void bitmask_unpack(const at::Tensor& payload, at::Tensor& out) {
  check_mask_unpack(payload, out, at::kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  if (!n) return;
  bitmask_unpack_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      payload.data_ptr<uint8_t>(), n, static_cast<uint8_t*>(out.data_ptr()));
  ADACC_CHECK_LAUNCH();
}

Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed) {
  check_grouped_compress(x, group, bits, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, packed_bytes(n, group, static_cast<int>(bits)));
  at::Tensor mins = floats_like(x, ceil_div(n, group)), scales = floats_like(x, ceil_div(n, group));
  at::Tensor bad = new_flag(x);
  if (!n) return {payload, mins, scales, bad};
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      stochastic_compress_kernel<T, decltype(b)::value><<<blocks_for(ceil_div(n, group), kWarpsPerBlock), kThreads,
                                                          0, c10::cuda::getCurrentCUDAStream()>>>(
          x.data_ptr<T>(), n, group, static_cast<uint64_t>(seed), payload.data_ptr<uint8_t>(),
          mins.data_ptr<float>(), scales.data_ptr<float>(), bad.data_ptr<int32_t>());
      ADACC_CHECK_LAUNCH();
    });
  });
  return {payload, mins, scales, bad};
}

void stochastic_decompress(const at::Tensor& payload, const at::Tensor& mins, const at::Tensor& scales,
                           int64_t group, int64_t bits, at::Tensor& out) {
  check_grouped_decompress("stochastic_decompress", payload, {mins, scales}, group, bits, out, at::kCUDA);
  const c10::cuda::CUDAGuard guard(out.device());
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      stochastic_decompress_kernel<T, decltype(b)::value><<<blocks_for(payload.numel()), kThreads, 0,
                                                            c10::cuda::getCurrentCUDAStream()>>>(
          payload.data_ptr<uint8_t>(), mins.data_ptr<float>(), scales.data_ptr<float>(), out.numel(), group,
          out.data_ptr<T>());
      ADACC_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace adacc
