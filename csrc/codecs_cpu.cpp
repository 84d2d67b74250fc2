// CPU kernels of the activation codecs (tensor-level wrappers + ISA dispatch).
// The loops themselves live in cpu_kernels_impl.h, compiled twice: a baseline build and, on x86-64 with
// GCC, an AVX2+FMA+F16C build chosen at run time. Both must give identical bits (no FMA contraction:
// -ffp-contract=off), which the tests check against the pure-torch reference.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "adacc_common.h"
#include "codecs.h"

namespace adacc {

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline c10::Half from_float<c10::Half>(float v) { return c10::Half(v); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) { return c10::BFloat16(v); }
// Largest finite value of each output dtype, where decoded values saturate.
template <typename T>
constexpr float dtype_max();
template <>
constexpr float dtype_max<float>() { return FLT_MAX; }
template <>
constexpr float dtype_max<c10::Half>() { return 65504.0f; }
template <>
constexpr float dtype_max<c10::BFloat16>() { return 3.38953139e38f; }  // 0x7F7F

#define ADACC_VEC_BYTES 16
namespace cpu_base {
#include "cpu_kernels_impl.h"
}  // namespace cpu_base
#undef ADACC_VEC_BYTES

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ADACC_HAVE_AVX2_VARIANT 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ADACC_VEC_BYTES 32
namespace cpu_avx2 {
#include "cpu_kernels_impl.h"
}  // namespace cpu_avx2
#undef ADACC_VEC_BYTES
#pragma GCC pop_options
#else
#define ADACC_HAVE_AVX2_VARIANT 0
#endif

namespace cpu {
namespace {

bool cpu_has_avx2() {
#if ADACC_HAVE_AVX2_VARIANT
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<bool> g_use_avx2{cpu_has_avx2()};

// Call kernel `fn` (a template or overload set) from the variant in use.
#if ADACC_HAVE_AVX2_VARIANT
#define ADACC_CPU_CALL(fn, ...)                                   \
  do {                                                            \
    if (g_use_avx2.load(std::memory_order_relaxed))               \
      ::adacc::cpu_avx2::fn(__VA_ARGS__);                         \
    else                                                          \
      ::adacc::cpu_base::fn(__VA_ARGS__);                         \
  } while (0)
#else
#define ADACC_CPU_CALL(fn, ...) ::adacc::cpu_base::fn(__VA_ARGS__)
#endif

#define ADACC_COMMA ,

// Run f(T{}) for the float dtype of x.
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

at::Tensor bad_flag(const std::atomic<bool>& bad) {
  return at::full({1}, bad.load() ? 1 : 0, at::TensorOptions().dtype(at::kInt));
}

at::TensorOptions u8() { return at::TensorOptions().dtype(at::kByte); }
at::TensorOptions f32() { return at::TensorOptions().dtype(at::kFloat); }

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor here, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous() first)");
}

}  // namespace

void set_isa(const std::string& isa) {
  if (isa == "auto") {
    g_use_avx2 = cpu_has_avx2();
  } else if (isa == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "set_isa('avx2'): this build or CPU has no AVX2+FMA+F16C variant");
    g_use_avx2 = true;
  } else if (isa == "base") {
    g_use_avx2 = false;
  } else {
    TORCH_CHECK(false, "set_isa: expected 'auto', 'avx2' or 'base', got '", isa, "'");
  }
}

std::string isa() { return g_use_avx2.load() ? "avx2" : "base"; }

// ------------------------------------------------------------------------------------ symmetric
Tensors3 sym_int4_compress(const at::Tensor& x, int64_t group) {
  check_float_input(x, "x", 1);
  check_cpu(x, "x");
  check_group(group);
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({packed_bytes(n, group, 4)}, u8());
  at::Tensor scales = at::empty({ceil_div(n, group)}, f32());
  std::atomic<bool> bad{false};
  if (n) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(sym_int4_compress<T>, x.data_ptr<T>(), n, group, payload.data_ptr<uint8_t>(),
                     scales.data_ptr<float>(), bad);
    });
  }
  return {payload, scales, bad_flag(bad)};
}

void sym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, int64_t group, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(scales, "scales");
  check_cpu(out, "out");
  check_group(group);
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == packed_bytes(n, group, 4) && scales.numel() == ceil_div(n, group),
              "sym_int4_decompress: payload/scales do not match out's size");
  if (!n) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(sym_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, group,
                   out.data_ptr<T>());
  });
}

// ----------------------------------------------------------------------------------- asymmetric
Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group) {
  check_float_input(x, "x", 1);
  check_cpu(x, "x");
  check_group(group);
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({packed_bytes(n, group, 4)}, u8());
  at::Tensor scales = at::empty({ceil_div(n, group)}, f32());
  at::Tensor offsets = at::empty({ceil_div(n, group)}, f32());
  std::atomic<bool> bad{false};
  if (n) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(asym_int4_compress<T>, x.data_ptr<T>(), n, group, payload.data_ptr<uint8_t>(),
                     scales.data_ptr<float>(), offsets.data_ptr<float>(), bad);
    });
  }
  return {payload, scales, offsets, bad_flag(bad)};
}

void asym_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t group, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(scales, "scales");
  check_cpu(offsets, "offsets");
  check_cpu(out, "out");
  check_group(group);
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == packed_bytes(n, group, 4) && scales.numel() == ceil_div(n, group) &&
                  offsets.numel() == scales.numel(),
              "asym_int4_decompress: payload/scales/offsets do not match out's size");
  if (!n) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(asym_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   offsets.data_ptr<float>(), n, group, out.data_ptr<T>());
  });
}

// --------------------------------------------------------------------------------- channel-wise
Tensors3 chan_int4_compress(const at::Tensor& x) {
  check_float_input(x, "x", 2);
  check_cpu(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor payload = at::empty({rows * group_bytes(cols, 4)}, u8());
  at::Tensor scales = at::zeros({cols}, f32());
  std::atomic<bool> bad{false};
  if (x.numel()) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(chan_int4_compress<T>, x.data_ptr<T>(), rows, cols, payload.data_ptr<uint8_t>(),
                     scales.data_ptr<float>(), bad);
    });
  }
  return {payload, scales, bad_flag(bad)};
}

void chan_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(scales, "scales");
  check_cpu(out, "out");
  TORCH_CHECK(out.dim() == 2, "chan_int4_decompress: out must be 2-D [rows, channels]");
  const int64_t rows = out.size(0), cols = out.size(1);
  TORCH_CHECK(payload.numel() == rows * group_bytes(cols, 4) && scales.numel() == cols,
              "chan_int4_decompress: payload/scales do not match out's shape");
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(chan_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), rows, cols,
                   out.data_ptr<T>());
  });
}

// ---------------------------------------------------------------------------- outlier-separated
at::Tensor channel_abs_sum(const at::Tensor& x) {
  check_float_input(x, "x", 2);
  check_cpu(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor sums = at::zeros({cols}, at::TensorOptions().dtype(at::kDouble));
  if (x.numel()) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(channel_abs_sum<T>, x.data_ptr<T>(), rows, cols, sums.data_ptr<double>());
    });
  }
  return sums;
}

Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx) {
  check_float_input(x, "x", 2);
  check_cpu(x, "x");
  check_cpu(idx, "idx");
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 1, "outlier_int4_compress: idx must be 1-D int32");
  const int64_t rows = x.size(0), cols = x.size(1), k = idx.numel();
  if (k) {
    TORCH_CHECK(idx.min().item<int32_t>() >= 0 && idx.max().item<int32_t>() < cols,
                "outlier_int4_compress: channel index out of range");
  }
  at::Tensor payload = at::empty({rows * group_bytes(cols, 4)}, u8());
  at::Tensor scales = at::zeros({rows}, f32());
  at::Tensor outliers = at::empty({rows, k}, x.options());
  std::atomic<bool> bad{false};
  if (x.numel()) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(outlier_int4_compress<T>, x.data_ptr<T>(), rows, cols, idx.data_ptr<int32_t>(), k,
                     payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), outliers.data_ptr<T>(), bad);
    });
  }
  return {payload, scales, outliers, bad_flag(bad)};
}

void outlier_int4_decompress(const at::Tensor& payload, const at::Tensor& scales, const at::Tensor& outliers,
                             const at::Tensor& idx, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(scales, "scales");
  check_cpu(outliers, "outliers");
  check_cpu(idx, "idx");
  check_cpu(out, "out");
  TORCH_CHECK(out.dim() == 2, "outlier_int4_decompress: out must be 2-D [rows, channels]");
  const int64_t rows = out.size(0), cols = out.size(1), k = idx.numel();
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 1, "outlier_int4_decompress: idx must be 1-D int32");
  TORCH_CHECK(payload.numel() == rows * group_bytes(cols, 4) && scales.numel() == rows &&
                  outliers.numel() == rows * k && outliers.scalar_type() == out.scalar_type(),
              "outlier_int4_decompress: payload/scales/outliers do not match out");
  // The channel indices come from the payload: a damaged or tampered one must not write outside `out`.
  if (k) {
    TORCH_CHECK(idx.min().item<int32_t>() >= 0 && idx.max().item<int32_t>() < cols,
                "outlier_int4_decompress: channel index out of range (damaged payload)");
  }
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(outlier_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   outliers.data_ptr<T>(), idx.data_ptr<int32_t>(), k, rows, cols, out.data_ptr<T>());
  });
}

// ----------------------------------------------------------------------------------- bit masks
Tensors2 bitmask_pack(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBool || x.scalar_type() == at::kByte,
              "bitmask_pack takes a bool or uint8 mask, got ", x.scalar_type());
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({ceil_div(n, 8)}, u8());
  std::atomic<bool> bad{false};
  if (n) {
    ADACC_CPU_CALL(bitmask_pack, static_cast<const uint8_t*>(x.data_ptr()), n, payload.data_ptr<uint8_t>(),
                   bad);
  }
  return {payload, bad_flag(bad)};
}

void bitmask_unpack(const at::Tensor& payload, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kBool || out.scalar_type() == at::kByte,
              "bitmask_unpack writes a bool or uint8 tensor, got ", out.scalar_type());
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == ceil_div(n, 8), "bitmask_unpack: payload does not match out's size");
  if (n) ADACC_CPU_CALL(bitmask_unpack, payload.data_ptr<uint8_t>(), n, static_cast<uint8_t*>(out.data_ptr()));
}

// -------------------------------------------------------------------------- stochastic rounding
namespace {
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
}  // namespace

Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed) {
  check_float_input(x, "x", 1);
  check_cpu(x, "x");
  check_group(group);
  check_bits(bits);
  const int64_t n = x.numel();
  at::Tensor payload = at::empty({packed_bytes(n, group, static_cast<int>(bits))}, u8());
  at::Tensor mins = at::empty({ceil_div(n, group)}, f32());
  at::Tensor scales = at::empty({ceil_div(n, group)}, f32());
  std::atomic<bool> bad{false};
  if (n) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      dispatch_bits(bits, [&](auto b) {
        constexpr int B = decltype(b)::value;
        ADACC_CPU_CALL(stochastic_compress<T ADACC_COMMA B>, x.data_ptr<T>(), n, group, static_cast<uint64_t>(seed),
                       payload.data_ptr<uint8_t>(), mins.data_ptr<float>(), scales.data_ptr<float>(), bad);
      });
    });
  }
  return {payload, mins, scales, bad_flag(bad)};
}

void stochastic_decompress(const at::Tensor& payload, const at::Tensor& mins, const at::Tensor& scales,
                           int64_t group, int64_t bits, at::Tensor& out) {
  check_cpu(payload, "payload");
  check_cpu(mins, "mins");
  check_cpu(scales, "scales");
  check_cpu(out, "out");
  check_group(group);
  check_bits(bits);
  const int64_t n = out.numel();
  TORCH_CHECK(payload.numel() == packed_bytes(n, group, static_cast<int>(bits)) &&
                  scales.numel() == ceil_div(n, group) && mins.numel() == scales.numel(),
              "stochastic_decompress: payload/mins/scales do not match out's size");
  if (!n) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      constexpr int B = decltype(b)::value;
      ADACC_CPU_CALL(stochastic_decompress<T ADACC_COMMA B>, payload.data_ptr<uint8_t>(), mins.data_ptr<float>(),
                     scales.data_ptr<float>(), n, group, out.data_ptr<T>());
    });
  });
}

}  // namespace cpu

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

}  // namespace adacc
