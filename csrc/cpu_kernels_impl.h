// CPU kernel bodies. NOT a normal header: codecs_cpu.cpp includes it twice, inside namespace
// adacc::cpu_base and (on x86-64 GCC) inside adacc::cpu_avx2 under `#pragma GCC target("avx2,fma,f16c")`,
// then picks one at run time. The loops are plain loops over fixed-width lanes, which the compiler
// vectorizes for whichever instruction set is in effect; the one use of intrinsics is fp16 conversion
// (F16C, where the includer defines ADACC_F16C), which no compiler vectorizes from c10's scalar code.
//
// All arithmetic on values and groups is codec_math.h's, shared with the CUDA kernels; what is here is the
// traversal (groups and rows split across threads, float32 blocks) and the min/max/NaN reductions.
//
// Requires (from the includer): <ATen/Parallel.h>, <algorithm>, <atomic>, <cfloat>, <cmath>, <cstring>,
// <type_traits>, <vector>, <immintrin.h> where ADACC_F16C is defined, and codec_math.h.

// GCC/Clang vector extensions: explicit lanes, ADACC_VEC_BYTES wide (16 = SSE2 in the baseline variant,
// 32 = AVX in the AVX2 one; the includer defines it). Min/max reductions are not auto-vectorized without
// -ffast-math, which would change results.
constexpr int kVecLanes = ADACC_VEC_BYTES / 4;
typedef float vfl __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef int32_t vil __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef uint32_t vu32 __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(ADACC_VEC_BYTES / 2)));

// ------------------------------------------------------------------------------ dtype conversion
// fp16 values are widened to float32 and narrowed back a block at a time with F16C: c10's per-value fp16
// conversion is a dozen integer operations and branches that no compiler vectorizes, which held the fp16
// kernels to a quarter of copy bandwidth. Results equal to_float / from_float bit for bit. bf16 needs no
// block: its conversions are a shift and a rounding add, which the loops vectorize in registers (a float32
// block would only add a store and a load per value; see load_lanes for the min/max pass).
constexpr int64_t kBlock = 512;  // values per stack buffer: 2 KB of float32, which stays in L1

static inline void widen(const c10::Half* x, int64_t n, float* out) {
  int64_t i = 0;
#ifdef ADACC_F16C
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = to_float(x[i]);
}

static inline void narrow(const float* v, int64_t n, c10::Half* out) {
  int64_t i = 0;
#ifdef ADACC_F16C
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(v + i);
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    if (!_mm256_testz_ps(nan, nan)) break;  // c10 makes every NaN sign | 0x7E00, F16C keeps its payload
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) out[i] = from_float<c10::Half>(v[i]);
}

// What the loops read and write for tensors of dtype T: float32 blocks for fp16, T itself otherwise.
template <typename T>
using lanes_t = std::conditional_t<std::is_same_v<T, c10::Half>, float, T>;

// Run f(v, blen, b0) on x[b0, b0 + blen) as lanes_t<T> values, block by block, for x[0, len).
template <typename T, typename F>
static inline void for_each_block(const T* x, int64_t len, F&& f) {
  alignas(64) float buf[std::is_same_v<T, c10::Half> ? kBlock : 1];
  for (int64_t b0 = 0; b0 < len; b0 += kBlock) {
    const int64_t blen = std::min(kBlock, len - b0);
    if constexpr (std::is_same_v<T, c10::Half>) {
      widen(x + b0, blen, buf);
      f(static_cast<const float*>(buf), blen, b0);
    } else {
      f(x + b0, blen, b0);
    }
  }
}

// Run f(y, blen, b0) to write out[b0, b0 + blen) as lanes_t<T> values y, block by block, for out[0, len):
// y is out itself, or for fp16 a float32 buffer narrowed into out afterwards.
template <typename T, typename F>
static inline void decode_blocks(T* out, int64_t len, F&& f) {
  alignas(64) float buf[std::is_same_v<T, c10::Half> ? kBlock : 1];
  for (int64_t b0 = 0; b0 < len; b0 += kBlock) {
    const int64_t blen = std::min(kBlock, len - b0);
    if constexpr (std::is_same_v<T, c10::Half>) {
      f(static_cast<float*>(buf), blen, b0);
      narrow(buf, blen, out + b0);
    } else {
      f(out + b0, blen, b0);
    }
  }
}

// --------------------------------------------------------------------------------- reductions
// kVecLanes values from p as float32 lanes.
static inline vfl load_lanes(const float* p) {
  vfl v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline vfl load_lanes(const c10::BFloat16* p) {  // bf16 is the top half of a float32
#ifdef ADACC_F16C
  // One widening load: GCC splits __builtin_convertvector's into two halves.
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vfl>(w);
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vfl>(__builtin_convertvector(h, vu32) << 16);
#endif
}

// Min, max and a NaN/Inf flag of n >= 1 float32 or bf16 values in one pass (two accumulator sets for ILP).
template <typename E>
static inline void minmax_bad(const E* x, int64_t n, float& mn_out, float& mx_out, bool& bad_out) {
  vfl mx0 = vfl{} + to_float(x[0]), mn0 = mx0, mx1 = mx0, mn1 = mx0;
  vil bad0 = vil{}, bad1 = vil{};
  int64_t i = 0;
  for (; i + 2 * kVecLanes <= n; i += 2 * kVecLanes) {
    const vfl a = load_lanes(x + i), b = load_lanes(x + i + kVecLanes);
    mx0 = a > mx0 ? a : mx0;
    mn0 = a < mn0 ? a : mn0;
    mx1 = b > mx1 ? b : mx1;
    mn1 = b < mn1 ? b : mn1;
    bad0 |= (a - a) != 0.0f;  // NaN for NaN and +-Inf, 0 otherwise
    bad1 |= (b - b) != 0.0f;
  }
  mx0 = mx1 > mx0 ? mx1 : mx0;
  mn0 = mn1 < mn0 ? mn1 : mn0;
  bad0 |= bad1;
  float a = mx0[0], b = mn0[0];
  int32_t f = bad0[0];
  for (int l = 1; l < kVecLanes; ++l) {
    a = mx0[l] > a ? mx0[l] : a;
    b = mn0[l] < b ? mn0[l] : b;
    f |= bad0[l];
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    a = v > a ? v : a;
    b = v < b ? v : b;
    f |= not_finite(v);
  }
  mx_out = a;
  mn_out = b;
  bad_out = f != 0;
}

// The same for len >= 1 values of any dtype, block by block. Seeded like the one pass, by x[0]; a later
// block's NaN seed is then dropped by the comparisons as a NaN inside a block is: the one-pass result.
template <typename T>
static inline void group_minmax_bad(const T* x, int64_t len, float& mn, float& mx, bool& bad) {
  mn = mx = to_float(x[0]);
  bad = false;
  for_each_block(x, len, [&](const auto* v, int64_t blen, int64_t) {
    float a, b;
    bool f;
    minmax_bad(v, blen, b, a, f);
    mx = a > mx ? a : mx;
    mn = b < mn ? b : mn;
    bad |= f;
  });
}

// f(std::true_type) where `flag`, else f(std::false_type): one loop instance of each.
template <typename F>
static inline void with_guard(bool flag, F&& f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// Elements per parallel task: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kTaskElems = 1 << 15;

static inline int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, kTaskElems / std::max<int64_t>(elems_per_item, 1));
}

// fp16 groups up to this many values are widened once, for the min/max pass and the encoding pass both (a
// 64 KB buffer stays in L2); larger ones are widened again, block by block, for the second pass.
constexpr int64_t kWideMax = 1 << 14;

// One group's values for its encoding pass: `wide` is the group as lanes_t<T> (x itself but for fp16), or
// nullptr for an fp16 group too large to keep widened.
template <typename T>
struct GroupValues {
  const T* x;
  const lanes_t<T>* wide;
  int64_t len;

  // Run f(v, blen, b0) on the values [b0, b0 + blen) as lanes_t<T>, covering the group.
  template <typename F>
  void blocks(F&& f) const {
    if (wide != nullptr)
      f(wide, len, 0);
    else
      for_each_block(x, len, f);
  }
};

// Run f(g, values, mn, mx) for every group of x in parallel once its min and max are known; NaN or Inf
// anywhere sets any_bad.
template <typename T, typename F>
static inline void for_each_group(const T* x, int64_t n, int64_t group, std::atomic<bool>& any_bad, F&& f) {
  constexpr bool kHalf = std::is_same_v<T, c10::Half>;
  at::parallel_for(0, ceil_div(n, group), grain_for(group), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kHalf ? std::min(group, kWideMax) : 0);
    bool bad_here = false;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group, len = std::min(group, n - off);
      GroupValues<T> values{x + off, nullptr, len};
      float mn, mx;
      bool bad;
      if constexpr (!kHalf) {
        values.wide = x + off;
      } else if (len <= kWideMax) {
        widen(x + off, len, buf.data());
        values.wide = buf.data();
      }
      if (values.wide != nullptr)
        minmax_bad(values.wide, len, mn, mx, bad);
      else
        group_minmax_bad(x + off, len, mn, mx, bad);
      bad_here |= bad;
      f(g, values, mn, mx);
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

// Run f(g, off, len) for every group of n values in parallel.
template <typename F>
static inline void for_each_group_range(int64_t n, int64_t group, F&& f) {
  at::parallel_for(0, ceil_div(n, group), grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) f(g, g * group, std::min(group, n - g * group));
  });
}

// ----------------------------------------------------------------------------- 4-bit packing
// 4-bit codes code(v[j], j) of n values, two per byte. The codes go through a byte buffer first: both
// loops then vectorize over contiguous lanes, where computing codes in pairs needs lane shuffles per value.
template <typename E, typename Code>
static inline void pack4(const E* __restrict__ v, int64_t n, uint8_t* __restrict__ out, Code code) {
  alignas(64) uint8_t codes[kBlock + 1];
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t blen = std::min(kBlock, n - b0);
    for (int64_t j = 0; j < blen; ++j) codes[j] = static_cast<uint8_t>(code(to_float(v[b0 + j]), b0 + j));
    codes[blen] = 0;  // the high nibble of an odd count's last byte
    uint8_t* __restrict__ o = out + b0 / 2;
    for (int64_t j = 0; j < (blen + 1) / 2; ++j) o[j] = pack_nibbles(codes[2 * j], codes[2 * j + 1]);
  }
}

// Symmetric codes of n values at inverse scale inv.
template <typename E>
static inline void pack_sym4(const E* v, int64_t n, float inv, uint8_t* out) {
  pack4(v, n, out, [inv](float x, int64_t) { return sym_code4(x, inv); });
}

// The n values value(q, j) of the 4-bit codes q in `in`, narrowed to y's type.
template <typename O, typename Value>
static inline void unpack4(const uint8_t* __restrict__ in, int64_t n, O* __restrict__ y, Value value) {
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    y[2 * j] = from_float<O>(value(nibble(in[j], 0), 2 * j));
    y[2 * j + 1] = from_float<O>(value(nibble(in[j], 1), 2 * j + 1));
  }
  if (n & 1) y[n - 1] = from_float<O>(value(nibble(in[pairs], 0), n - 1));
}

// Decode the symmetric 4-bit codes of out[0, n) at scale s.
template <typename T>
static inline void decode_sym4(const uint8_t* in, int64_t n, float s, T* out) {
  with_guard(needs_guard<T>(-8.0f, 7.0f, s, 0.0f), [&](auto guard) {
    constexpr bool G = decltype(guard)::value;
    decode_blocks(out, n, [&](auto* y, int64_t blen, int64_t b0) {
      unpack4(in + b0 / 2, blen, y, [s](float q, int64_t) { return sym_value<T, G>(q, s); });
    });
  });
}

// ------------------------------------------------------------------------------------ symmetric
template <typename T>
void sym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                       std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group(x, n, group, any_bad, [&](int64_t g, const GroupValues<T>& values, float mn, float mx) {
    const Affine a = symmetric_group(mn, mx);
    scales[g] = a.scale;
    values.blocks([&](const auto* v, int64_t blen, int64_t b0) {
      pack_sym4(v, blen, a.inv, payload + g * gb + b0 / 2);
    });
  });
}

template <typename T>
void sym_int4_decompress(const uint8_t* payload, const float* scales, int64_t n, int64_t group, T* out) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    decode_sym4(payload + g * gb, len, scales[g], out + off);
  });
}

// ----------------------------------------------------------------------------------- asymmetric
template <typename T>
void asym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                        float* offsets, std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group(x, n, group, any_bad, [&](int64_t g, const GroupValues<T>& values, float mn, float mx) {
    const Affine a = asymmetric_group(mn, mx);
    scales[g] = a.scale;
    offsets[g] = a.offset;
    with_guard(a.k != 1.0f, [&](auto scaled) {
      constexpr bool S = decltype(scaled)::value;
      values.blocks([&](const auto* v, int64_t blen, int64_t b0) {
        pack4(v, blen, payload + g * gb + b0 / 2, [a](float y, int64_t) { return affine_code4<S>(y, a); });
      });
    });
  });
}

template <typename T>
void asym_int4_decompress(const uint8_t* payload, const float* scales, const float* offsets, int64_t n,
                          int64_t group, T* out) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    const float s = scales[g], o = offsets[g];
    with_guard(needs_guard<T>(-8.0f, 7.0f, s, o), [&](auto guard) {
      constexpr bool G = decltype(guard)::value;
      decode_blocks(out + off, len, [&](auto* y, int64_t blen, int64_t b0) {
        unpack4(payload + g * gb + b0 / 2, blen, y, [s, o](float q, int64_t) { return affine_value<T, G>(q, s, o); });
      });
    });
  });
}

// --------------------------------------------------------------------------------- channel-wise
// Row chunks of the column reductions. A fixed chunk size keeps the float64 sums of channel_abs_sum
// independent of the thread count (min/max are exact in any order anyway).
constexpr int64_t kRowChunk = 256;

// Per-chunk column max and min of x ([rows, cols]) into pmx / pmn ([nchunks, cols]); NaN/Inf sets any_bad.
template <typename T>
static inline void column_minmax(const T* x, int64_t rows, int64_t cols, float* pmx, float* pmn,
                                 std::atomic<bool>& any_bad) {
  at::parallel_for(0, ceil_div(rows, kRowChunk), 1, [&](int64_t begin, int64_t end) {
    bool bad_here = false;
    for (int64_t ch = begin; ch < end; ++ch) {
      float* mx = pmx + ch * cols;
      float* mn = pmn + ch * cols;
      const int64_t r0 = ch * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      for (int64_t c = 0; c < cols; ++c) mx[c] = mn[c] = to_float(x[r0 * cols + c]);
      for (int64_t r = r0; r < r1; ++r) {
        for_each_block(x + r * cols, cols, [&](const auto* v, int64_t blen, int64_t c0) {
          float* __restrict__ bmx = mx + c0;
          float* __restrict__ bmn = mn + c0;
          int32_t bad = 0;
          for (int64_t c = 0; c < blen; ++c) {
            const float vc = to_float(v[c]);
            bmx[c] = vc > bmx[c] ? vc : bmx[c];
            bmn[c] = vc < bmn[c] ? vc : bmn[c];
            bad |= not_finite(vc);
          }
          bad_here |= bad != 0;
        });
      }
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T>
void chan_int4_compress(const T* x, int64_t rows, int64_t cols, uint8_t* payload, float* scales,
                        std::atomic<bool>& any_bad) {
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  std::vector<float> pmx(nchunks * cols), pmn(nchunks * cols), inv(cols);
  column_minmax(x, rows, cols, pmx.data(), pmn.data(), any_bad);
  for (int64_t c = 0; c < cols; ++c) {
    float a = pmx[c], b = pmn[c];
    for (int64_t ch = 1; ch < nchunks; ++ch) {
      a = std::max(a, pmx[ch * cols + c]);
      b = std::min(b, pmn[ch * cols + c]);
    }
    scales[c] = symmetric_scale(b, a);
    inv[c] = inverse(scales[c]);
  }
  const int64_t rb = group_bytes(cols, 4);
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for_each_block(x + r * cols, cols, [&](const auto* v, int64_t blen, int64_t c0) {
        const float* inv_c = inv.data() + c0;
        pack4(v, blen, payload + r * rb + c0 / 2, [inv_c](float y, int64_t c) { return sym_code4(y, inv_c[c]); });
      });
    }
  });
}

template <typename T>
void chan_int4_decompress(const uint8_t* payload, const float* scales, int64_t rows, int64_t cols, T* out) {
  const int64_t rb = group_bytes(cols, 4);
  bool guarded = false;
  for (int64_t c = 0; c < cols; ++c) guarded |= needs_guard<T>(-8.0f, 7.0f, scales[c], 0.0f);
  with_guard(guarded, [&](auto guard) {
    constexpr bool G = decltype(guard)::value;
    at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        decode_blocks(out + r * cols, cols, [&](auto* y, int64_t blen, int64_t c0) {
          const float* s = scales + c0;
          unpack4(payload + r * rb + c0 / 2, blen, y, [s](float q, int64_t c) { return sym_value<T, G>(q, s[c]); });
        });
      }
    });
  });
}

// ---------------------------------------------------------------------------- outlier-separated
template <typename T>
void channel_abs_sum(const T* x, int64_t rows, int64_t cols, double* sums) {
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  std::vector<double> part(nchunks * cols, 0.0);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      double* acc = part.data() + ch * cols;
      const int64_t r0 = ch * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      for (int64_t r = r0; r < r1; ++r) {
        for_each_block(x + r * cols, cols, [&](const auto* v, int64_t blen, int64_t c0) {
          for (int64_t c = 0; c < blen; ++c) acc[c0 + c] += static_cast<double>(std::fabs(to_float(v[c])));
        });
      }
    }
  });
  for (int64_t c = 0; c < cols; ++c) {
    double s = 0.0;
    for (int64_t ch = 0; ch < nchunks; ++ch) s += part[ch * cols + c];
    sums[c] = s;
  }
}

template <typename T>
void outlier_int4_compress(const T* x, int64_t rows, int64_t cols, const int32_t* idx, int64_t k,
                           uint8_t* payload, float* scales, T* outliers, std::atomic<bool>& any_bad) {
  const int64_t rb = group_bytes(cols, 4);
  std::vector<uint8_t> is_outlier(cols, 0);
  for (int64_t i = 0; i < k; ++i) is_outlier[idx[i]] = 1;
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> dense_row(cols);  // the row as float32, its outlier channels zero
    float* __restrict__ dense = dense_row.data();
    int32_t bad_here = 0;
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + r * cols;
      for_each_block(xr, cols, [&](const auto* v, int64_t blen, int64_t c0) {
        int32_t bad = 0;
        for (int64_t c = 0; c < blen; ++c) {
          const float vc = to_float(v[c]);
          bad |= not_finite(vc);  // outlier channels included: the dense values no longer show them
          dense[c0 + c] = dense_value(vc, is_outlier[c0 + c]);
        }
        bad_here |= bad;
      });
      for (int64_t i = 0; i < k; ++i) outliers[r * k + i] = xr[idx[i]];
      float mn, mx;
      bool dense_bad;  // already in bad_here
      minmax_bad(dense, cols, mn, mx, dense_bad);
      const float s = symmetric_scale(mn, mx);
      scales[r] = s;
      pack_sym4(dense, cols, inverse(s), payload + r * rb);
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T>
void outlier_int4_decompress(const uint8_t* payload, const float* scales, const T* outliers, const int32_t* idx,
                             int64_t k, int64_t rows, int64_t cols, T* out) {
  const int64_t rb = group_bytes(cols, 4);
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* y = out + r * cols;
      decode_sym4(payload + r * rb, cols, scales[r], y);
      for (int64_t i = 0; i < k; ++i) y[idx[i]] = outliers[r * k + i];
    }
  });
}

// ----------------------------------------------------------------------------------- bit masks
static inline void bitmask_pack(const uint8_t* x, int64_t n, uint8_t* out, std::atomic<bool>& any_bad) {
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    uint64_t high = 0;  // every mask byte OR-ed: a bit above bit 0 means a value > 1
    for (int64_t i = begin; i < end; ++i) {
      uint64_t v;
      std::memcpy(&v, x + 8 * i, 8);
      high |= v;
      out[i] = gather_bits(v);
    }
    if (mask_bytes_bad(high)) any_bad.store(true, std::memory_order_relaxed);
  });
  if (n % 8) {
    uint64_t v = 0;  // the last, short byte's values; the missing ones are zero
    std::memcpy(&v, x + 8 * full, n % 8);
    out[full] = gather_bits(v);
    if (mask_bytes_bad(v)) any_bad.store(true, std::memory_order_relaxed);
  }
}

static inline void bitmask_unpack(const uint8_t* in, int64_t n, uint8_t* out) {
  // Byte → its eight 0/1 bytes, as one 64-bit store.
  static const auto table = [] {
    std::vector<uint64_t> t(256);
    for (uint32_t b = 0; b < 256; ++b) {
      uint64_t v = 0;
      for (int j = 0; j < 8; ++j) v |= static_cast<uint64_t>(field<1>(b, j)) << (8 * j);
      t[b] = v;
    }
    return t;
  }();
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(out + 8 * i, &table[in[i]], 8);
  });
  if (n % 8) std::memcpy(out + 8 * full, &table[in[full]], n % 8);
}

// -------------------------------------------------------------------------- stochastic rounding
template <int BITS>
static inline void pack_codes(const uint8_t* codes, int64_t len, uint8_t* out) {
  constexpr int per_byte = 8 / BITS;
  for (int64_t i = 0; i < ceil_div(len, per_byte); ++i) {
    uint32_t b = 0;
    for (int j = 0; j < per_byte; ++j) b |= put_field<BITS>(codes[i * per_byte + j], j);
    out[i] = static_cast<uint8_t>(b);
  }
}

template <typename T, int BITS>
void stochastic_compress(const T* x, int64_t n, int64_t group, uint64_t seed, uint8_t* payload, float* mins,
                         float* scales, std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, BITS);
  for_each_group(x, n, group, any_bad, [&](int64_t g, const GroupValues<T>& values, float mn, float mx) {
    const Affine a = stochastic_group(mn, mx, static_cast<float>((1 << BITS) - 1));
    mins[g] = a.offset;
    scales[g] = a.scale;
    with_guard(a.k != 1.0f, [&](auto scaled) {
      constexpr bool S = decltype(scaled)::value;
      // Codes go through a stack buffer of kBlock, a multiple of 8 / BITS: every block but the last fills
      // whole bytes, and the last one's padding codes are zeroed so that pack_codes packs whole bytes.
      alignas(64) uint8_t codes[kBlock];
      values.blocks([&](const auto* v, int64_t vlen, int64_t v0) {
        for (int64_t b0 = 0; b0 < vlen; b0 += kBlock) {
          const int64_t blen = std::min(kBlock, vlen - b0);
          const uint64_t base = static_cast<uint64_t>(g * group + v0 + b0);
          const uint32_t lo = static_cast<uint32_t>(base), hi = static_cast<uint32_t>(base >> 32);
          if (lo <= UINT32_MAX - kBlock) {  // no carry into the high half within the block
            for (int64_t j = 0; j < blen; ++j) {  // positions >= 0: x >= mn and inv >= 0
              const uint32_t r = uniform24_halves(seed, lo + static_cast<uint32_t>(j), hi);
              codes[j] = static_cast<uint8_t>(stochastic_code<BITS>(code_position<S>(to_float(v[b0 + j]), a), r));
            }
          } else {
            for (int64_t j = 0; j < blen; ++j) {
              const uint32_t r = uniform24(seed, base + static_cast<uint64_t>(j));
              codes[j] = static_cast<uint8_t>(stochastic_code<BITS>(code_position<S>(to_float(v[b0 + j]), a), r));
            }
          }
          for (int64_t j = blen; j % (8 / BITS) != 0; ++j) codes[j] = 0;
          pack_codes<BITS>(codes, blen, payload + g * gb + (v0 + b0) * BITS / 8);
        }
      });
    });
  });
}

template <typename T, int BITS>
void stochastic_decompress(const uint8_t* payload, const float* mins, const float* scales, int64_t n,
                           int64_t group, T* out) {
  constexpr int per_byte = 8 / BITS;
  const int64_t gb = group_bytes(group, BITS);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    const float s = scales[g], mn = mins[g];
    with_guard(needs_guard<T>(0.0f, static_cast<float>((1 << BITS) - 1), s, mn), [&](auto guard) {
      constexpr bool G = decltype(guard)::value;
      decode_blocks(out + off, len, [&](auto* y, int64_t blen, int64_t b0) {
        using O = std::remove_pointer_t<decltype(y)>;
        const uint8_t* in = payload + g * gb + b0 * BITS / 8;
        const int64_t full = blen / per_byte;
        for (int64_t i = 0; i < full; ++i) {
          for (int j = 0; j < per_byte; ++j)
            y[i * per_byte + j] = from_float<O>(affine_value<T, G>(static_cast<float>(field<BITS>(in[i], j)), s,
                                                                   mn));
        }
        for (int64_t j = full * per_byte; j < blen; ++j) {
          const float q = static_cast<float>(field<BITS>(in[full], static_cast<int>(j - full * per_byte)));
          y[j] = from_float<O>(affine_value<T, G>(q, s, mn));
        }
      });
    });
  });
}
