// Tensor-level entry points of the codec kernels. Signatures and output layouts are those of
// megatron_adacc/codecs/reference.py; bindings.cpp routes each call to the CPU or CUDA version by device.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

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

// Argument checks shared by both devices (the message names the fix).
void check_float_input(const at::Tensor& x, const char* what, int64_t dim);
void check_group(int64_t group);
void check_bits(int64_t bits);

}  // namespace adacc
