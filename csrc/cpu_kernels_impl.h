// CPU kernel bodies. NOT a normal header: codecs_cpu.cpp includes it twice, inside namespace
// adacc::cpu_base and (on x86-64 GCC) inside adacc::cpu_avx2 under `#pragma GCC target("avx2,fma,f16c")`,
// then picks one at run time. Everything here is written as plain loops over fixed-width lanes so that
// the compiler vectorizes them for whichever instruction set is in effect; there are no intrinsics.
//
// Requires (from the includer): <ATen/Parallel.h>, <algorithm>, <atomic>, <cfloat>, <cmath>, <cstring>,
// <type_traits>, <vector>, adacc_common.h, and adacc::to_float / from_float<T> / dtype_max<T>.

// GCC/Clang vector extensions: explicit float lanes, ADACC_VEC_BYTES wide (16 = SSE2 in the baseline
// variant, 32 = AVX in the AVX2 one; the includer defines it). Min/max reductions are not auto-vectorized
// without -ffast-math, which would change results.
constexpr int kVecLanes = ADACC_VEC_BYTES / 4;
typedef float vfl __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef int32_t vil __attribute__((vector_size(ADACC_VEC_BYTES)));

template <typename T>
static inline vfl load_lanes(const T* p) {
  vfl v;
  for (int l = 0; l < kVecLanes; ++l) v[l] = to_float(p[l]);
  return v;
}
template <>
inline vfl load_lanes<float>(const float* p) {
  vfl v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Min, max and a NaN/Inf flag of n >= 1 values in one pass (two accumulator sets for ILP).
template <typename T>
static inline void minmax_bad(const T* x, int64_t n, float& mn_out, float& mx_out, bool& bad_out) {
  const float first = to_float(x[0]);
  vfl mx0 = vfl{} + first, mn0 = mx0, mx1 = mx0, mn1 = mx0;
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
    f |= !(std::fabs(v) <= FLT_MAX);  // false for NaN and +-Inf
  }
  mx_out = a;
  mn_out = b;
  bad_out = f != 0;
}

// Scale of the symmetric codecs: max(max(mx, 0) / 7, -min(mn, 0) / 8), flushed to 0 below kTinyScale.
static inline float symmetric_scale(float mn, float mx) {
  const float pos = (mx > 0.0f ? mx : 0.0f) / 7.0f;
  const float neg = -(mn < 0.0f ? mn : 0.0f) / 8.0f;
  const float s = pos > neg ? pos : neg;
  return s < kTinyScale ? 0.0f : s;
}

static inline float flush_tiny(float s) { return s < kTinyScale ? 0.0f : s; }
static inline float inverse(float s) { return s > 0.0f ? 1.0f / s : 0.0f; }

// (mx - mn) / levels, and the factor k (1, or kQuarter where mx - mn overflows) at which the group's
// values are taken so that their codes do not overflow either (reference._range_scale). With one level
// (1-bit stochastic) an overflowing range has no float32 scale: it saturates at FLT_MAX.
static inline float range_scale(float mn, float mx, float levels, float& k) {
  k = mx - mn > FLT_MAX ? kQuarter : 1.0f;
  const float s = flush_tiny((mx * k - mn * k) / levels / k);  // exactly (mx - mn) / levels where k == 1
  return s > FLT_MAX ? FLT_MAX : s;
}

// Decoding. A GUARDED decode gives the reference's finite result where q * s (+ o) overflows: it redoes
// an overflowing q * s + o at a quarter, and saturates at the output dtype's largest finite value (a code
// may lie half a step past its group's extreme value). Rounding is monotone in q, so a group whose lowest
// and highest codes decode within that value needs no guard: only groups at the dtype's extremes pay.
template <typename T>
static inline float saturated(float v) {
  return v < -dtype_max<T>() ? -dtype_max<T>() : (v > dtype_max<T>() ? dtype_max<T>() : v);
}

template <typename T>
static inline bool needs_guard(float qlo, float qhi, float s, float o) {
  return !(std::fabs(qlo * s + o) <= dtype_max<T>() && std::fabs(qhi * s + o) <= dtype_max<T>());
}

// f(std::true_type) where guarded, else f(std::false_type): one loop instance of each.
template <typename F>
static inline void with_guard(bool guarded, F&& f) {
  if (guarded)
    f(std::true_type{});
  else
    f(std::false_type{});
}

template <typename T, bool GUARDED>
static inline T decode_sym(float q, float s) {
  return from_float<T>(GUARDED ? saturated<T>(q * s) : q * s);
}

// q * s + o (reference._affine_decode): an overflow is redone at a quarter, saturated, times four.
template <typename T, bool GUARDED>
static inline T decode_affine(float q, float s, float o) {
  const float v = q * s + o;
  if (!GUARDED) return from_float<T>(v);
  const float lim = FLT_MAX * kQuarter;
  const float w = q * (s * kQuarter) + o * kQuarter;
  return from_float<T>(saturated<T>(std::fabs(v) <= FLT_MAX ? v : (w < -lim ? -lim : (w > lim ? lim : w)) * 4.0f));
}

// round(clamp(v, -8, 7)) + 8 as an int in [0, 15].
// Clamping the rounded integer equals rounding the clamped value (integer bounds); v is bounded by the
// scale choice (|v| <= 8 up to rounding) for finite input, and non-finite input is flagged and discarded.
static inline int32_t code4(float v) {
  int32_t q = static_cast<int32_t>((v + kRoundMagic) - kRoundMagic);
  q = q < -8 ? -8 : q;
  q = q > 7 ? 7 : q;
  return q + 8;
}

// Symmetric 4-bit codes of n values x * inv (inv a scalar), packed two per byte.
template <typename T>
static inline void pack_sym4(const T* __restrict__ x, int64_t n, float inv, uint8_t* __restrict__ out) {
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const int32_t lo = code4(to_float(x[2 * j]) * inv);
    const int32_t hi = code4(to_float(x[2 * j + 1]) * inv);
    out[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (n & 1) out[pairs] = static_cast<uint8_t>(code4(to_float(x[n - 1]) * inv));
}

// Same with a per-value inverse scale (channel-wise codec).
template <typename T>
static inline void pack_sym4_per_channel(const T* __restrict__ x, int64_t n, const float* __restrict__ inv,
                                         uint8_t* __restrict__ out) {
  const int64_t pairs = n / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const int32_t lo = code4(to_float(x[2 * j]) * inv[2 * j]);
    const int32_t hi = code4(to_float(x[2 * j + 1]) * inv[2 * j + 1]);
    out[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (n & 1) out[pairs] = static_cast<uint8_t>(code4(to_float(x[n - 1]) * inv[n - 1]));
}

// Decode n symmetric 4-bit codes: (q - 8) * scale.
template <typename T>
static inline void unpack_sym4(const uint8_t* in, int64_t n, float scale, T* out) {
  with_guard(needs_guard<T>(-8.0f, 7.0f, scale, 0.0f), [&](auto guard) {
    constexpr bool G = decltype(guard)::value;
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      const int32_t b = in[j];
      out[2 * j] = decode_sym<T, G>(static_cast<float>((b & 15) - 8), scale);
      out[2 * j + 1] = decode_sym<T, G>(static_cast<float>((b >> 4) - 8), scale);
    }
    if (n & 1) out[n - 1] = decode_sym<T, G>(static_cast<float>((in[pairs] & 15) - 8), scale);
  });
}

// Elements per parallel task: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kTaskElems = 1 << 15;

static inline int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, kTaskElems / std::max<int64_t>(elems_per_item, 1));
}

// ------------------------------------------------------------------------------------ symmetric
template <typename T>
void sym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                       std::atomic<bool>& any_bad) {
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, 4);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    bool bad_here = false;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      const int64_t len = std::min(group, n - off);
      float mn, mx;
      bool bad;
      minmax_bad(x + off, len, mn, mx, bad);
      bad_here |= bad;
      const float s = symmetric_scale(mn, mx);
      scales[g] = s;
      pack_sym4(x + off, len, inverse(s), payload + g * gb);
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T>
void sym_int4_decompress(const uint8_t* payload, const float* scales, int64_t n, int64_t group, T* out) {
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, 4);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      unpack_sym4(payload + g * gb, std::min(group, n - off), scales[g], out + off);
    }
  });
}

// ----------------------------------------------------------------------------------- asymmetric
template <typename T>
void asym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                        float* offsets, std::atomic<bool>& any_bad) {
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, 4);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    bool bad_here = false;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      const int64_t len = std::min(group, n - off);
      float mn, mx;
      bool bad;
      minmax_bad(x + off, len, mn, mx, bad);
      bad_here |= bad;
      float k;
      const float s = range_scale(mn, mx, 15.0f, k);
      const float o = (mn * k + 8.0f * (s * k)) / k;
      const float ok = o * k, inv = inverse(s * k);
      scales[g] = s;
      offsets[g] = o;
      const T* xg = x + off;
      uint8_t* out = payload + g * gb;
      const int64_t pairs = len / 2;
      with_guard(k != 1.0f, [&](auto guard) {
        const float kg = decltype(guard)::value ? k : 1.0f;  // a literal 1 folds away: no multiply per value
        for (int64_t j = 0; j < pairs; ++j) {
          const int32_t lo = code4((to_float(xg[2 * j]) * kg - ok) * inv);
          const int32_t hi = code4((to_float(xg[2 * j + 1]) * kg - ok) * inv);
          out[j] = static_cast<uint8_t>(lo | (hi << 4));
        }
        if (len & 1) out[pairs] = static_cast<uint8_t>(code4((to_float(xg[len - 1]) * kg - ok) * inv));
      });
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T>
void asym_int4_decompress(const uint8_t* payload, const float* scales, const float* offsets, int64_t n,
                          int64_t group, T* out) {
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, 4);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      const int64_t len = std::min(group, n - off);
      const float s = scales[g], o = offsets[g];
      const uint8_t* in = payload + g * gb;
      T* y = out + off;
      const int64_t pairs = len / 2;
      with_guard(needs_guard<T>(-8.0f, 7.0f, s, o), [&](auto guard) {
        constexpr bool G = decltype(guard)::value;
        for (int64_t j = 0; j < pairs; ++j) {
          const int32_t b = in[j];
          y[2 * j] = decode_affine<T, G>(static_cast<float>((b & 15) - 8), s, o);
          y[2 * j + 1] = decode_affine<T, G>(static_cast<float>((b >> 4) - 8), s, o);
        }
        if (len & 1) y[len - 1] = decode_affine<T, G>(static_cast<float>((in[pairs] & 15) - 8), s, o);
      });
    }
  });
}

// --------------------------------------------------------------------------------- channel-wise
// Row chunks of the column reductions. A fixed chunk size keeps the float64 sums of channel_abs_sum
// independent of the thread count (min/max are exact in any order anyway).
constexpr int64_t kRowChunk = 256;

template <typename T>
void chan_int4_compress(const T* x, int64_t rows, int64_t cols, uint8_t* payload, float* scales,
                        std::atomic<bool>& any_bad) {
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  std::vector<float> pmx(nchunks * cols), pmn(nchunks * cols);
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    bool bad_here = false;
    for (int64_t ch = begin; ch < end; ++ch) {
      float* mx = pmx.data() + ch * cols;
      float* mn = pmn.data() + ch * cols;
      const int64_t r0 = ch * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      int32_t bad = 0;
      for (int64_t c = 0; c < cols; ++c) mx[c] = mn[c] = to_float(x[r0 * cols + c]);
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const float v = to_float(xr[c]);
          mx[c] = v > mx[c] ? v : mx[c];
          mn[c] = v < mn[c] ? v : mn[c];
          bad |= !(std::fabs(v) <= FLT_MAX);
        }
      }
      bad_here |= bad != 0;
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
  std::vector<float> inv(cols);
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
    for (int64_t r = begin; r < end; ++r) pack_sym4_per_channel(x + r * cols, cols, inv.data(), payload + r * rb);
  });
}

template <typename T>
void chan_int4_decompress(const uint8_t* payload, const float* scales, int64_t rows, int64_t cols, T* out) {
  const int64_t rb = group_bytes(cols, 4);
  const int64_t pairs = cols / 2;
  bool guarded = false;
  for (int64_t c = 0; c < cols; ++c) guarded |= needs_guard<T>(-8.0f, 7.0f, scales[c], 0.0f);
  with_guard(guarded, [&](auto guard) {
    constexpr bool G = decltype(guard)::value;
    at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* in = payload + r * rb;
        T* y = out + r * cols;
        for (int64_t j = 0; j < pairs; ++j) {
          const int32_t b = in[j];
          y[2 * j] = decode_sym<T, G>(static_cast<float>((b & 15) - 8), scales[2 * j]);
          y[2 * j + 1] = decode_sym<T, G>(static_cast<float>((b >> 4) - 8), scales[2 * j + 1]);
        }
        if (cols & 1) y[cols - 1] = decode_sym<T, G>(static_cast<float>((in[pairs] & 15) - 8), scales[cols - 1]);
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
        const T* xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) acc[c] += static_cast<double>(std::fabs(to_float(xr[c])));
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
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> dense_row(cols);  // the row with its outlier channels zeroed
    float* __restrict__ dense = dense_row.data();
    bool bad_here = false;
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict__ xr = x + r * cols;
      for (int64_t c = 0; c < cols; ++c) dense[c] = to_float(xr[c]);
      for (int64_t i = 0; i < k; ++i) {
        outliers[r * k + i] = xr[idx[i]];
        dense[idx[i]] = 0.0f;
      }
      float mn, mx;
      bool bad;
      minmax_bad(dense, cols, mn, mx, bad);
      bad_here |= bad;
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
      unpack_sym4(payload + r * rb, cols, scales[r], y);
      for (int64_t i = 0; i < k; ++i) y[idx[i]] = outliers[r * k + i];
    }
  });
}

// ----------------------------------------------------------------------------------- bit masks
// Eight 0/1 bytes (little-endian uint64) → one byte, bit j from byte j: the multiply moves byte j's bit 0
// to bit 56 + j without carries (each partial product lands on a distinct bit), the shift keeps them.
static inline uint8_t gather_bits(uint64_t v) {
  return static_cast<uint8_t>((v * 0x0102040810204080ull) >> 56);
}

static inline void bitmask_pack(const uint8_t* x, int64_t n, uint8_t* out, std::atomic<bool>& any_bad) {
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    uint64_t high = 0;  // any bit other than bit 0 set in some byte: a value > 1
    for (int64_t i = begin; i < end; ++i) {
      uint64_t v;
      std::memcpy(&v, x + 8 * i, 8);
      high |= v;
      out[i] = gather_bits(v & 0x0101010101010101ull);
    }
    if (high & 0xFEFEFEFEFEFEFEFEull) any_bad.store(true, std::memory_order_relaxed);
  });
  if (n % 8) {
    uint8_t b = 0;
    for (int64_t j = 0; j < n % 8; ++j) {
      const uint8_t v = x[8 * full + j];
      if (v > 1) any_bad.store(true, std::memory_order_relaxed);
      b |= static_cast<uint8_t>((v & 1) << j);
    }
    out[full] = b;
  }
}

static inline void bitmask_unpack(const uint8_t* in, int64_t n, uint8_t* out) {
  // Byte → its eight 0/1 bytes, as one 64-bit store.
  static const auto table = [] {
    std::vector<uint64_t> t(256);
    for (int b = 0; b < 256; ++b) {
      uint64_t v = 0;
      for (int j = 0; j < 8; ++j) v |= static_cast<uint64_t>((b >> j) & 1) << (8 * j);
      t[b] = v;
    }
    return t;
  }();
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(out + 8 * i, &table[in[i]], 8);
  });
  for (int64_t j = 0; j < n % 8; ++j) out[8 * full + j] = (in[full] >> j) & 1;
}

// -------------------------------------------------------------------------- stochastic rounding
constexpr int64_t kCodeBlock = 512;  // codes computed into a stack buffer, then packed

template <int BITS>
static inline void pack_codes(const uint8_t* codes, int64_t len, uint8_t* out) {
  constexpr int per_byte = 8 / BITS;
  const int64_t full = len / per_byte;
  for (int64_t i = 0; i < full; ++i) {
    uint32_t b = 0;
    for (int j = 0; j < per_byte; ++j) b |= static_cast<uint32_t>(codes[i * per_byte + j]) << (j * BITS);
    out[i] = static_cast<uint8_t>(b);
  }
  if (len % per_byte) {
    uint32_t b = 0;
    for (int64_t j = 0; j < len % per_byte; ++j) b |= static_cast<uint32_t>(codes[full * per_byte + j]) << (j * BITS);
    out[full] = static_cast<uint8_t>(b);
  }
}

template <typename T, int BITS>
void stochastic_compress(const T* x, int64_t n, int64_t group, uint64_t seed, uint8_t* payload, float* mins,
                         float* scales, std::atomic<bool>& any_bad) {
  constexpr int32_t qmax = (1 << BITS) - 1;
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, BITS);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t codes[kCodeBlock];
    bool bad_here = false;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      const int64_t len = std::min(group, n - off);
      float mn, mx;
      bool bad;
      minmax_bad(x + off, len, mn, mx, bad);
      bad_here |= bad;
      mn = mn + 0.0f;  // -0.0 -> +0.0: which signed zero a min returns depends on the order
      float k;
      const float s = range_scale(mn, mx, static_cast<float>(qmax), k);
      const float mk = mn * k, inv = inverse(s * k);
      mins[g] = mn;
      scales[g] = s;
      // kCodeBlock is a multiple of 8 / BITS, so every block but the last fills whole bytes.
      with_guard(k != 1.0f, [&](auto guard) {
        const float kg = decltype(guard)::value ? k : 1.0f;  // a literal 1 folds away: no multiply per value
        for (int64_t b0 = 0; b0 < len; b0 += kCodeBlock) {
          const int64_t blen = std::min(kCodeBlock, len - b0);
          const T* xb = x + off + b0;
          const uint64_t base = static_cast<uint64_t>(off + b0);
          for (int64_t j = 0; j < blen; ++j) {
            const float t = (to_float(xb[j]) * kg - mk) * inv;  // >= 0: x >= mn and inv >= 0
            int32_t q = static_cast<int32_t>(t);
            const float frac = t - static_cast<float>(q);
            const float u = static_cast<float>(uniform24(seed, base + static_cast<uint64_t>(j))) * 0x1p-24f;
            q += u < frac ? 1 : 0;
            codes[j] = static_cast<uint8_t>(q < qmax ? q : qmax);
          }
          pack_codes<BITS>(codes, blen, payload + g * gb + b0 * BITS / 8);
        }
      });
    }
    if (bad_here) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T, int BITS>
void stochastic_decompress(const uint8_t* payload, const float* mins, const float* scales, int64_t n,
                           int64_t group, T* out) {
  constexpr int per_byte = 8 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t ngroups = ceil_div(n, group);
  const int64_t gb = group_bytes(group, BITS);
  at::parallel_for(0, ngroups, grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t off = g * group;
      const int64_t len = std::min(group, n - off);
      const float s = scales[g], mn = mins[g];
      const uint8_t* in = payload + g * gb;
      T* y = out + off;
      const int64_t full = len / per_byte;
      with_guard(needs_guard<T>(0.0f, static_cast<float>(mask), s, mn), [&](auto guard) {
        constexpr bool G = decltype(guard)::value;
        for (int64_t i = 0; i < full; ++i) {
          const uint32_t b = in[i];
          for (int j = 0; j < per_byte; ++j)
            y[i * per_byte + j] = decode_affine<T, G>(static_cast<float>((b >> (j * BITS)) & mask), s, mn);
        }
        for (int64_t j = full * per_byte; j < len; ++j) {
          const uint32_t b = in[j / per_byte];
          y[j] = decode_affine<T, G>(static_cast<float>((b >> ((j % per_byte) * BITS)) & mask), s, mn);
        }
      });
    }
  });
}
