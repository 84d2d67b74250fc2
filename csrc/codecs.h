// Tensor-level entry points of the codec kernels. Signatures and output layouts are those of
// megatron_adacc/codecs/reference.py; bindings.cpp routes each call to the CPU or CUDA version by device.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <type_traits>

namespace adacc {

using Tensors2 = std::tuple<at::Tensor, at::Tensor>;
using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

#define ADACC_DECLARE_KERNELS                                                                            \
  Tensors3 sym_int4_compress(const at::Tensor& x, int64_t group);                                        \
  void sym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, int64_t group,           \
                           at::Tensor& out);                                                             \
  Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group);                                       \
  void asym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& offsets, \
                            int64_t group, at::Tensor& out);                                             \
  Tensors3 chan_int4_compress(const at::Tensor& x);                                                      \
  void chan_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, at::Tensor& out);       \
  at::Tensor channel_abs_sum(const at::Tensor& x);                                                       \
  Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx);                            \
  void outlier_int4_decompress(const at::Tensor& payload, const at::Tensor& scales,                      \
                               const at::Tensor& outliers, const at::Tensor& idx, at::Tensor& out);      \
  Tensors2 bitmask_pack(const at::Tensor& x);                                                            \
  void bitmask_unpack(const at::Tensor& payload, at::Tensor& out);                                       \
  Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed);          \
  void stochastic_decompress(const at::Tensor& payload, const at::Tensor& mins, const at::Tensor& scales, \
                             int64_t group, int64_t bits, at::Tensor& out);

namespace cpu {
ADACC_DECLARE_KERNELS
// Which vectorized variant the CPU kernels run: "avx2" or "base" ("auto" picks by CPU features).
void set_isa(const std::string& isa);
std::string isa();
}  // namespace cpu

#ifdef ADACC_WITH_CUDA
namespace cuda {
ADACC_DECLARE_KERNELS
}  // namespace cuda
#endif

// Run f(T{}) for float dtype st (float, c10::Half or c10::BFloat16).
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

void check_bits(int64_t bits);

// Run f(std::integral_constant<int, B>{}) for a stochastic codec's bits B in {1, 2, 4, 8}.
template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 8:
      f(std::integral_constant<int, 8>{});
      break;
    default:
      check_bits(bits);
  }
}

// Argument checks and outputs of the entry points, shared by both devices (codecs_args.cpp). `dev` is the
// device every tensor of the call must be on; each check's message names the fix.
void check_float_input(const at::Tensor& x, const char* what, int64_t dim);
void check_group(int64_t group);
void check_tensor(const at::Tensor& t, const char* what, at::DeviceType dev);
void check_grouped_compress(const at::Tensor& x, int64_t group, int64_t bits, at::DeviceType dev);
// payload and per-group `params` (scales, offsets, mins) of out.numel() values.
void check_grouped_decompress(const char* fn, const at::Tensor& payload, at::TensorList params, int64_t group,
                              int64_t bits, const at::Tensor& out, at::DeviceType dev);
void check_rows_input(const at::Tensor& x, at::DeviceType dev);  // 2-D [rows, channels]
void check_chan_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& out,
                           at::DeviceType dev);
void check_outlier_index(const char* fn, const at::Tensor& idx, at::DeviceType dev);
void check_outlier_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& outliers,
                              const at::Tensor& idx, const at::Tensor& out, at::DeviceType dev);
void check_mask(const at::Tensor& m, const char* what, at::DeviceType dev);
void check_mask_unpack(const at::Tensor& payload, const at::Tensor& out, at::DeviceType dev);
// 1-D outputs on like's device: uint8, and float32 (zero-filled where `zeroed`).
at::Tensor bytes_like(const at::Tensor& like, int64_t count);
at::Tensor floats_like(const at::Tensor& like, int64_t count, bool zeroed = false);

}  // namespace adacc
