// Argument checks and output tensors of the entry points, one definition for both devices: a CPU and a
// CUDA entry point of the same name accept the same arguments and fail with the same messages.
#include <ATen/ATen.h>

#include "adacc_common.h"
#include "codecs.h"

namespace adacc {

void check_float_input(const at::Tensor& x, const char* what, int64_t dim) {
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              what, ": codec kernels take float32, float16 or bfloat16 tensors, got ", st);
  TORCH_CHECK(x.dim() == dim, what, ": expected a ", dim, "-D tensor, got ", x.dim(), "-D");
}

void check_group(int64_t group) { TORCH_CHECK(group >= 1, "group size must be >= 1, got ", group); }

void check_bits(int64_t bits) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "bits must be 1, 2, 4 or 8, got ", bits);
}

void check_tensor(const at::Tensor& t, const char* what, at::DeviceType dev) {
  TORCH_CHECK(t.device().type() == dev, what, " must be a ", c10::DeviceTypeName(dev), " tensor here, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous() first)");
}

void check_grouped_compress(const at::Tensor& x, int64_t group, int64_t bits, at::DeviceType dev) {
  check_float_input(x, "x", 1);
  check_tensor(x, "x", dev);
  check_group(group);
  check_bits(bits);
}

void check_grouped_decompress(const char* fn, const at::Tensor& payload, at::TensorList params, int64_t group,
                              int64_t bits, const at::Tensor& out, at::DeviceType dev) {
  check_tensor(payload, "payload", dev);
  for (const at::Tensor& p : params) check_tensor(p, "scales/offsets", dev);
  check_tensor(out, "out", dev);
  check_group(group);
  check_bits(bits);
  const int64_t n = out.numel();
  bool sizes_ok = payload.numel() == packed_bytes(n, group, static_cast<int>(bits));
  for (const at::Tensor& p : params) sizes_ok = sizes_ok && p.numel() == ceil_div(n, group);
  TORCH_CHECK(sizes_ok, fn, ": payload/scales/offsets do not match out's size");
}

void check_rows_input(const at::Tensor& x, at::DeviceType dev) {
  check_float_input(x, "x", 2);
  check_tensor(x, "x", dev);
}

void check_chan_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& out,
                           at::DeviceType dev) {
  check_tensor(payload, "payload", dev);
  check_tensor(scales, "scales", dev);
  check_tensor(out, "out", dev);
  TORCH_CHECK(out.dim() == 2, "chan_int4_decompress: out must be 2-D [rows, channels]");
  TORCH_CHECK(payload.numel() == out.size(0) * group_bytes(out.size(1), 4) && scales.numel() == out.size(1),
              "chan_int4_decompress: payload/scales do not match out's shape");
}

void check_outlier_index(const char* fn, const at::Tensor& idx, at::DeviceType dev) {
  check_tensor(idx, "idx", dev);
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 1, fn, ": idx must be 1-D int32");
}

void check_outlier_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& outliers,
                              const at::Tensor& idx, const at::Tensor& out, at::DeviceType dev) {
  check_tensor(payload, "payload", dev);
  check_tensor(scales, "scales", dev);
  check_tensor(outliers, "outliers", dev);
  check_outlier_index("outlier_int4_decompress", idx, dev);
  check_tensor(out, "out", dev);
  TORCH_CHECK(out.dim() == 2, "outlier_int4_decompress: out must be 2-D [rows, channels]");
  const int64_t rows = out.size(0), cols = out.size(1);
  TORCH_CHECK(payload.numel() == rows * group_bytes(cols, 4) && scales.numel() == rows &&
                  outliers.numel() == rows * idx.numel() && outliers.scalar_type() == out.scalar_type(),
              "outlier_int4_decompress: payload/scales/outliers do not match out");
}

void check_mask(const at::Tensor& m, const char* what, at::DeviceType dev) {
  check_tensor(m, what, dev);
  TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kByte,
              "bit masks are bool or uint8 tensors, got ", m.scalar_type(), " for ", what);
}

void check_mask_unpack(const at::Tensor& payload, const at::Tensor& out, at::DeviceType dev) {
  check_tensor(payload, "payload", dev);
  check_mask(out, "out", dev);
  TORCH_CHECK(payload.numel() == ceil_div(out.numel(), 8), "bitmask_unpack: payload does not match out's size");
}

at::Tensor bytes_like(const at::Tensor& like, int64_t count) {
  return at::empty({count}, like.options().dtype(at::kByte));
}

at::Tensor floats_like(const at::Tensor& like, int64_t count, bool zeroed) {
  const auto options = like.options().dtype(at::kFloat);
  return zeroed ? at::zeros({count}, options) : at::empty({count}, options);
}

}  // namespace adacc
