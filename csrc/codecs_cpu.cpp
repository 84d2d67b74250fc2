// CPU kernels of the activation codecs (tensor-level wrappers + ISA dispatch).
// The loops themselves live in cpu_kernels_impl.h, compiled twice: a baseline build and, on x86-64 with
// GCC, an AVX2+FMA+F16C build (shuffles packing codes, F16C converting fp16 in vector registers) chosen at run
// time. Both must give identical bits (no FMA contraction: -ffp-contract=off), which the tests check against
// the pure-torch reference. (No AVX-512 variant: no machine this was developed on has it, and a variant that
// has never run does not ship.)
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
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// codec_math.h's per-value functions are defined outside the AVX2 variant's target and take its 32-byte
// vectors there: GCC warns that such a call's ABI differs, but they are always inlined (ADACC_HD), so no
// such call exists. (Before the include: the warning points into codec_math.h.)
#pragma GCC diagnostic ignored "-Wpsabi"

#include "codec_math.h"
#include "codecs.h"

namespace adacc {

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
#define ADACC_AVX2 1
namespace cpu_avx2 {
#include "cpu_kernels_impl.h"
}  // namespace cpu_avx2
#undef ADACC_AVX2
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

at::Tensor bad_flag(const std::atomic<bool>& bad) {
  return at::full({1}, bad.load() ? 1 : 0, at::TensorOptions().dtype(at::kInt));
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
  check_grouped_compress(x, group, 4, at::kCPU);
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, packed_bytes(n, group, 4)), scales = floats_like(x, ceil_div(n, group));
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
  check_grouped_decompress("sym_int4_decompress", payload, {scales}, group, 4, out, at::kCPU);
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(sym_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.numel(),
                   group, out.data_ptr<T>());
  });
}

// ----------------------------------------------------------------------------------- asymmetric
Tensors4 asym_int4_compress(const at::Tensor& x, int64_t group) {
  check_grouped_compress(x, group, 4, at::kCPU);
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, packed_bytes(n, group, 4));
  at::Tensor scales = floats_like(x, ceil_div(n, group)), offsets = floats_like(x, ceil_div(n, group));
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
  check_grouped_decompress("asym_int4_decompress", payload, {scales, offsets}, group, 4, out, at::kCPU);
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(asym_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   offsets.data_ptr<float>(), out.numel(), group, out.data_ptr<T>());
  });
}

// --------------------------------------------------------------------------------- channel-wise
Tensors3 chan_int4_compress(const at::Tensor& x) {
  check_rows_input(x, at::kCPU);
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor payload = bytes_like(x, rows * group_bytes(cols, 4)), scales = floats_like(x, cols, true);
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
  check_chan_decompress(payload, scales, out, at::kCPU);
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(chan_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(), out.size(0),
                   out.size(1), out.data_ptr<T>());
  });
}

// ---------------------------------------------------------------------------- outlier-separated
at::Tensor channel_abs_sum(const at::Tensor& x) {
  check_rows_input(x, at::kCPU);
  at::Tensor sums = at::zeros({x.size(1)}, x.options().dtype(at::kDouble));
  if (x.numel()) {
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      ADACC_CPU_CALL(channel_abs_sum<T>, x.data_ptr<T>(), x.size(0), x.size(1), sums.data_ptr<double>());
    });
  }
  return sums;
}

namespace {
// The channel indices of a decompress come from the payload: a damaged or tampered one must not make a
// kernel write outside its output. (On the CPU reading them costs no device sync.)
void check_index_range(const at::Tensor& idx, int64_t cols, const char* fn) {
  if (idx.numel()) {
    TORCH_CHECK(idx.min().item<int32_t>() >= 0 && idx.max().item<int32_t>() < cols, fn,
                ": channel index out of range (damaged payload)");
  }
}
}  // namespace

Tensors4 outlier_int4_compress(const at::Tensor& x, const at::Tensor& idx) {
  check_rows_input(x, at::kCPU);
  check_outlier_index("outlier_int4_compress", idx, at::kCPU);
  const int64_t rows = x.size(0), cols = x.size(1), k = idx.numel();
  check_index_range(idx, cols, "outlier_int4_compress");
  at::Tensor payload = bytes_like(x, rows * group_bytes(cols, 4)), scales = floats_like(x, rows, true);
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
  check_outlier_decompress(payload, scales, outliers, idx, out, at::kCPU);
  check_index_range(idx, out.size(1), "outlier_int4_decompress");
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ADACC_CPU_CALL(outlier_int4_decompress<T>, payload.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                   outliers.data_ptr<T>(), idx.data_ptr<int32_t>(), idx.numel(), out.size(0), out.size(1),
                   out.data_ptr<T>());
  });
}

// ----------------------------------------------------------------------------------- bit masks
Tensors2 bitmask_pack(const at::Tensor& x) {
  check_mask(x, "x", at::kCPU);
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, ceil_div(n, 8));
  std::atomic<bool> bad{false};
  if (n) {
    ADACC_CPU_CALL(bitmask_pack, static_cast<const uint8_t*>(x.data_ptr()), n, payload.data_ptr<uint8_t>(),
                   bad);
  }
  return {payload, bad_flag(bad)};
}

void bitmask_unpack(const at::Tensor& payload, at::Tensor& out) {
  check_mask_unpack(payload, out, at::kCPU);
  const int64_t n = out.numel();
  if (n) ADACC_CPU_CALL(bitmask_unpack, payload.data_ptr<uint8_t>(), n, static_cast<uint8_t*>(out.data_ptr()));
}

// -------------------------------------------------------------------------- stochastic rounding
Tensors4 stochastic_compress(const at::Tensor& x, int64_t group, int64_t bits, int64_t seed) {
  check_grouped_compress(x, group, bits, at::kCPU);
  const int64_t n = x.numel();
  at::Tensor payload = bytes_like(x, packed_bytes(n, group, static_cast<int>(bits)));
  at::Tensor mins = floats_like(x, ceil_div(n, group)), scales = floats_like(x, ceil_div(n, group));
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
  check_grouped_decompress("stochastic_decompress", payload, {mins, scales}, group, bits, out, at::kCPU);
  if (!out.numel()) return;
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      constexpr int B = decltype(b)::value;
      ADACC_CPU_CALL(stochastic_decompress<T ADACC_COMMA B>, payload.data_ptr<uint8_t>(), mins.data_ptr<float>(),
                     scales.data_ptr<float>(), out.numel(), group, out.data_ptr<T>());
    });
  });
}

}  // namespace cpu
}  // namespace adacc
