// CPU kernel bodies. NOT a normal header: codecs_cpu.cpp includes it twice, inside namespace
// adacc::cpu_base and (on x86-64 GCC) inside adacc::cpu_avx2 under `#pragma GCC target("avx2,fma,f16c")`,
// then picks one at run time.
//
// All arithmetic on values and groups is codec_math.h's, shared with the CUDA kernels: its per-value
// functions run here on vector lanes (VecLanes) and on the tails' single values. What is here is the
// traversal (groups and rows split across threads), the reductions, and how codes and values move between
// memory and lanes: packing codes into bytes, unpacking them, and dtype conversion.
//
// Three choices make the kernels run near memory speed for float32, float16 and bfloat16 alike:
//   * a group's range comes from integer reductions of its raw bits (group_range): no conversion, twice
//     the lanes for 16-bit dtypes, and the NaN/Inf check comes free;
//   * a decode is a table look-up: a group's 2**BITS values are computed once, by codec_math.h's
//     functions on each code, then every byte of payload becomes its values by shuffles;
//   * 16-bit values convert in registers (F16C for float16, shifts for bfloat16), never through a buffer.
//
// Requires (from the includer): ADACC_VEC_BYTES; ADACC_AVX2 for the AVX2 + F16C variant, which uses
// <immintrin.h>; <ATen/Parallel.h>, <algorithm>, <atomic>, <cfloat>, <cmath>, <cstring>, <type_traits>, <utility>,
// <vector> and codec_math.h.

// GCC/Clang vector extensions: explicit lanes, ADACC_VEC_BYTES wide (16 = SSE2 in the baseline variant,
// 32 = AVX in the AVX2 one).
constexpr int kVecLanes = ADACC_VEC_BYTES / 4;
typedef float vfl __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef int32_t vil __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef uint32_t vu32 __attribute__((vector_size(ADACC_VEC_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(ADACC_VEC_BYTES / 2)));  // kVecLanes 16-bit values

// kVecLanes values at once, for codec_math.h's per-value functions (ScalarLanes' interface).
struct VecLanes {
  using F = vfl;
  using I = vil;
  using U = vu32;
  static I bits(F v) { return reinterpret_cast<I>(v); }
  static I trunc(F v) { return __builtin_convertvector(v, vil); }
  static F to_float(I v) { return __builtin_convertvector(v, vfl); }
  static F to_float(U v) { return __builtin_convertvector(reinterpret_cast<vil>(v), vfl); }  // v < 2**31
  static I one_if(I mask) { return -mask; }  // a true lane of a comparison is -1
};

// The lanes of an argument: one value (float32 or int32) or a vector of them.
template <typename V>
using lanes_of = std::conditional_t<std::is_arithmetic_v<V>, ScalarLanes, VecLanes>;

// ------------------------------------------------------------------------------ dtype conversion
// kVecLanes values from p as float32 lanes, each exactly to_float of its value.
static inline vfl load_lanes(const float* p) {
  vfl v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline vfl load_lanes(const c10::BFloat16* p) {  // bf16 is the top half of a float32
#ifdef ADACC_AVX2  // one widening load: GCC splits its __builtin_convertvector into two halves
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vfl>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vfl>(__builtin_convertvector(h, vu32) << 16);
#endif
}
static inline vfl load_lanes(const c10::Half* p) {
#ifdef ADACC_AVX2
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfl v;
  for (int l = 0; l < kVecLanes; ++l) v[l] = to_float(p[l]);
  return v;
#endif
}

// Store float32 lanes v to p narrowed as from_float<T> narrows each. MAYBE_NAN = false where no lane can be
// NaN, whose narrowing is the special case.
template <bool MAYBE_NAN = true>
static inline void store_lanes(float* p, vfl v) {
  std::memcpy(p, &v, sizeof(v));
}
template <bool MAYBE_NAN = true>
static inline void store_lanes(c10::BFloat16* p, vfl v) {
  // c10's round to nearest even, lane by lane: the bits plus 0x7FFF and the kept part's lowest bit; NaN
  // becomes 0x7FC0.
  const vu32 u = reinterpret_cast<vu32>(v);
  vu32 r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  if constexpr (MAYBE_NAN) r = v != v ? vu32{} + 0x7FC0u : r;
#ifdef ADACC_AVX2  // r < 2**16: a saturating pack keeps it
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(reinterpret_cast<__m256i>(r), reinterpret_cast<__m256i>(r)), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(h));
#else
  const vu16 h = __builtin_convertvector(r, vu16);
  std::memcpy(p, &h, sizeof(h));
#endif
}
template <bool MAYBE_NAN = true>
static inline void store_lanes(c10::Half* p, vfl v) {
#ifdef ADACC_AVX2
  // c10 makes every NaN sign | 0x7E00, F16C keeps its payload: lanes holding one are narrowed one by one.
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (!MAYBE_NAN || _mm256_testz_ps(nan, nan)) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return;
  }
#endif
  for (int l = 0; l < kVecLanes; ++l) p[l] = from_float<c10::Half>(v[l]);
}

// ------------------------------------------------------------------------------------ ranges
// The raw bits of an element dtype: float formats store sign and magnitude, so values of one sign are
// ordered by their bits, and NaN and Inf are the bits from the exponent's all-ones up (kInf), of either sign.
template <typename E>
struct RawBits;
template <>
struct RawBits<float> {
  using B = uint32_t;
  static constexpr B kInf = 0x7F800000u;
  static float value(B b) {
    float f;
    std::memcpy(&f, &b, sizeof(f));
    return f;
  }
};
template <>
struct RawBits<c10::BFloat16> {
  using B = uint16_t;
  static constexpr B kInf = 0x7F80u;
  static float value(B b) { return RawBits<float>::value(static_cast<uint32_t>(b) << 16); }
};
template <>
struct RawBits<c10::Half> {
  using B = uint16_t;
  static constexpr B kInf = 0x7C00u;
  static float value(B b) { return to_float(c10::Half(b, c10::Half::from_bits())); }
};

struct Range {
  float mn, mx;
  bool bad;  // a NaN or Inf among the values (mn and mx are then meaningless)
};

// Three integer reductions of raw bits B give a range: the largest as signed (the largest positive value,
// if any), and the largest and smallest as unsigned (the most negative value, if any, and the value
// nearest zero of the values' one sign otherwise). Integer lanes need no conversion, and hold two 16-bit
// values where a float32 lane holds one. (Which zero a range of zeros of both signs gives does not matter:
// every group formula returns the same for either.)
template <typename B>
struct BitsRange {
  std::make_signed_t<B> smax;
  B umax, umin;

  explicit BitsRange(B b) : smax(static_cast<std::make_signed_t<B>>(b)), umax(b), umin(b) {}
  void add(B b) {
    const auto s = static_cast<std::make_signed_t<B>>(b);
    smax = s > smax ? s : smax;
    umax = b > umax ? b : umax;
    umin = b < umin ? b : umin;
  }
  void add(const BitsRange& o) {
    smax = o.smax > smax ? o.smax : smax;
    umax = o.umax > umax ? o.umax : umax;
    umin = o.umin < umin ? o.umin : umin;
  }
  template <typename E>
  Range range() const {
    constexpr B kSign = static_cast<B>(B{1} << (8 * sizeof(B) - 1));
    const float mx = RawBits<E>::value(smax >= 0 ? static_cast<B>(smax) : umin);
    const float mn = RawBits<E>::value(umax >= kSign ? umax : umin);
    const bool bad = smax >= static_cast<std::make_signed_t<B>>(RawBits<E>::kInf) || umax >= (kSign | RawBits<E>::kInf);
    return Range{mn, mx, bad};
  }
};

// op over all lanes of v, in lane 0: a tree of rotations by half the lanes, a quarter, ...
template <size_t W, typename V, typename Op, size_t... I>
static inline V rotate_op(V v, Op op, std::index_sequence<I...>) {
  return op(v, __builtin_shufflevector(v, v, ((I + W) % sizeof...(I))...));
}
template <size_t W, size_t N, typename V, typename Op>
static inline V reduce_tree(V v, Op op) {
  if constexpr (W == 0)
    return v;
  else
    return reduce_tree<W / 2, N>(rotate_op<W>(v, op, std::make_index_sequence<N>{}), op);
}

// Vectors of an element dtype's raw bits, unsigned (U) and signed (S), and the values one holds.
template <typename E>
struct BitsVec {
  using B = typename RawBits<E>::B;
  typedef B U __attribute__((vector_size(ADACC_VEC_BYTES)));
  typedef std::make_signed_t<B> S __attribute__((vector_size(ADACC_VEC_BYTES)));
  static constexpr size_t kLanes = ADACC_VEC_BYTES / sizeof(B);
};

// The range of x[0, n), n >= 1.
template <typename E>
static inline Range group_range(const E* x, int64_t n) {
  using B = typename RawBits<E>::B;
  using vb = typename BitsVec<E>::U;
  using vs = typename BitsVec<E>::S;
  constexpr size_t kLanes = BitsVec<E>::kLanes;
  const B* u = reinterpret_cast<const B*>(x);
  BitsRange<B> acc(u[0]);
  int64_t i = 0;
  if (n >= static_cast<int64_t>(2 * kLanes)) {  // two sets of accumulators: the reductions' latency overlaps
    vs smax0 = vs{} + acc.smax, smax1 = smax0;
    vb umax0 = vb{} + acc.umax, umax1 = umax0, umin0 = umax0, umin1 = umax0;
    for (; i + static_cast<int64_t>(2 * kLanes) <= n; i += 2 * kLanes) {
      vb a, b;
      std::memcpy(&a, u + i, sizeof(a));
      std::memcpy(&b, u + i + kLanes, sizeof(b));
      const vs sa = reinterpret_cast<vs>(a), sb = reinterpret_cast<vs>(b);
      smax0 = sa > smax0 ? sa : smax0;
      smax1 = sb > smax1 ? sb : smax1;
      umax0 = a > umax0 ? a : umax0;
      umax1 = b > umax1 ? b : umax1;
      umin0 = a < umin0 ? a : umin0;
      umin1 = b < umin1 ? b : umin1;
    }
    const auto max = [](auto a, auto b) { return a > b ? a : b; };
    const auto min = [](auto a, auto b) { return a < b ? a : b; };
    acc.smax = reduce_tree<kLanes / 2, kLanes>(max(smax0, smax1), max)[0];
    acc.umax = reduce_tree<kLanes / 2, kLanes>(max(umax0, umax1), max)[0];
    acc.umin = reduce_tree<kLanes / 2, kLanes>(min(umin0, umin1), min)[0];
  }
  for (; i < n; ++i) acc.add(u[i]);
  return acc.template range<E>();
}

// ------------------------------------------------------------------------ codes <-> payload bytes
// Codes of BITS bits (1, 2, 4 or 8) sit BITS apart in the payload, value j of a byte in its bits
// [j * BITS, (j + 1) * BITS) (codec_math.h's put_field / field). The AVX2 variant moves 32 codes at a time
// between those bits and one byte per code, by shifts and packs; the rest is per value.
#ifdef ADACC_AVX2
// The 32 codes of `codes` (one per byte, each below 2**BITS) as 4 * BITS payload bytes at out.
template <int BITS>
static inline void store_fields(__m256i codes, uint8_t* out) {
  if constexpr (BITS == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), codes);
  } else if constexpr (BITS == 1) {
    const uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(codes, 7)));
    std::memcpy(out, &m, 4);
  } else if constexpr (BITS == 4) {
    // Each 16-bit lane c0 | c1 << 8 becomes c0 | c1 << 4 in its low byte.
    __m256i v = _mm256_and_si256(_mm256_or_si256(codes, _mm256_srli_epi16(codes, 4)), _mm256_set1_epi16(0xFF));
    v = _mm256_permute4x64_epi64(_mm256_packus_epi16(v, v), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(v));
  } else {
    static_assert(BITS == 2, "codes of 1, 2, 4 or 8 bits");
    // Pairs of 2-bit codes into 4 bits (16-bit lanes), then pairs of those into bytes (32-bit lanes).
    __m256i v = _mm256_and_si256(_mm256_or_si256(codes, _mm256_srli_epi16(codes, 6)), _mm256_set1_epi16(0xFF));
    v = _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi32(v, 12)), _mm256_set1_epi32(0xFF));
    v = _mm256_packus_epi16(_mm256_packus_epi32(v, v), v);  // dword 0 of each half: its 4 bytes
    const uint32_t lo = static_cast<uint32_t>(_mm256_cvtsi256_si32(v));
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(v, 4));
    std::memcpy(out, &lo, 4);
    std::memcpy(out + 4, &hi, 4);
  }
}

// The 32 codes in the 4 * BITS payload bytes at in, one per byte in order.
template <int BITS>
static inline __m256i load_fields(const uint8_t* in) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  } else if constexpr (BITS == 1) {
    uint32_t w;
    std::memcpy(&w, in, 4);
    // Byte k of w to bytes 8k..8k+7, then each keeps its own bit.
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(w)),
                                          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(1));
  } else {
    static_assert(BITS == 4 || BITS == 2, "codes of 1, 2, 4 or 8 bits");
    // Each byte splits into its low and high field, interleaved: twice the fields, half as wide.
    const auto split = [](__m128i b, int width, __m128i mask, __m128i& lo, __m128i& hi) {
      const __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, width), mask);
      lo = _mm_unpacklo_epi8(l, h);
      hi = _mm_unpackhi_epi8(l, h);
    };
    __m128i lo, hi;
    if constexpr (BITS == 4) {
      split(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)), 4, _mm_set1_epi8(0x0F), lo, hi);
    } else {
      __m128i nibbles, unused;
      split(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)), 4, _mm_set1_epi8(0x0F), nibbles, unused);
      split(nibbles, 2, _mm_set1_epi8(0x03), lo, hi);
    }
    return _mm256_set_m128i(hi, lo);
  }
}
#endif

// ------------------------------------------------------------------------------ value blocks
// The encode loops take kBlock values at a time, as kBlockVecs float32 vectors. Which value a lane holds
// follows the dtype's cheapest load: under AVX2, bfloat16 is widened by unpacking within 128-bit halves
// (two instructions for 16 values, where a widening load takes four), so its vectors hold values 0-3 and
// 8-11, 4-7 and 12-15, and so on; block_index and in_block_order put other per-value data in the same lanes.
#ifdef ADACC_AVX2
constexpr int kBlock = 32;
#else
constexpr int kBlock = 8;  // whole bytes at any BITS
#endif
constexpr int kBlockVecs = kBlock / kVecLanes;

template <typename E>
constexpr bool kUnpackedBlock =
#ifdef ADACC_AVX2
    std::is_same_v<E, c10::BFloat16>;
#else
    false;
#endif

// Offset from the block's first value of the value in lane l of vector k.
template <typename E>
constexpr int32_t lane_offset(int k, int l) {
  if constexpr (kUnpackedBlock<E>)
    return 16 * (k / 2) + 4 * (k % 2) + 8 * (l / 4) + l % 4;
  else
    return k * kVecLanes + l;
}

template <typename E>
static inline void load_block(const E* x, vfl (&v)[kBlockVecs]) {
#ifdef ADACC_AVX2
  if constexpr (kUnpackedBlock<E>) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h));
      v[2 * h] = reinterpret_cast<vfl>(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
      v[2 * h + 1] = reinterpret_cast<vfl>(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
    }
    return;
  }
#endif
#pragma GCC unroll 8
  for (int k = 0; k < kBlockVecs; ++k) v[k] = load_lanes(x + k * kVecLanes);
}

// Vector k's lanes' offsets.
template <typename E>
static inline vil block_index(int k) {
  vil idx;
  for (int l = 0; l < kVecLanes; ++l) idx[l] = lane_offset<E>(k, l);
  return idx;
}

// p[0, n) rearranged so that the vectors of each whole block hold what its values' lanes do (the rest as is).
template <typename E>
static inline std::vector<float> in_block_order(const float* p, int64_t n) {
  std::vector<float> out(p, p + n);
  for (int64_t j = 0; j + kBlock <= n; j += kBlock)
    for (int k = 0; k < kBlockVecs; ++k)
      for (int l = 0; l < kVecLanes; ++l) out[j + k * kVecLanes + l] = p[j + lane_offset<E>(k, l)];
  return out;
}

// The block's codes c (each below 2**BITS), packed BITS bits each at out.
template <int BITS, typename E>
static inline void store_block_codes(const vil (&c)[kBlockVecs], uint8_t* out) {
#ifdef ADACC_AVX2
  const __m256i ab = _mm256_packus_epi32(reinterpret_cast<__m256i>(c[0]), reinterpret_cast<__m256i>(c[1]));
  const __m256i cd = _mm256_packus_epi32(reinterpret_cast<__m256i>(c[2]), reinterpret_cast<__m256i>(c[3]));
  const __m256i bytes = _mm256_packus_epi16(ab, cd);  // packs work within 128-bit halves
  if constexpr (kUnpackedBlock<E>)  // qwords hold values 0-7, 16-23, 8-15, 24-31
    store_fields<BITS>(_mm256_permute4x64_epi64(bytes, 0xD8), out);
  else  // dwords hold values 0-3, 8-11, 16-19, 24-27, 4-7, ...
    store_fields<BITS>(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), out);
#else
  constexpr int per_byte = 8 / BITS;
  uint64_t packed = 0;  // kBlock = 8 values: BITS bytes
  for (int k = 0; k < kBlockVecs; ++k) {
    for (int l = 0; l < kVecLanes; ++l) {
      const int j = lane_offset<E>(k, l);
      packed |= static_cast<uint64_t>(put_field<BITS>(c[k][l], j % per_byte)) << (8 * (j / per_byte));
    }
  }
  std::memcpy(out, &packed, BITS);
#endif
}

// Codes of x[0, n), packed BITS bits each from out[0]; the last byte's unused bits are zero. code(v, j, k)
// gives them: v one value (x[j] as float32; k = 0), or vector k of the block at j (see value blocks).
// `ahead` (or null) is what the caller reads next, n values like x: it is fetched into the cache meanwhile. A
// group's values are read from memory by its range pass, then again (from the cache) here; without this
// nothing is fetched while the codes are computed, and memory and compute take turns.
template <int BITS, typename E, typename Code>
static inline void encode(const E* x, int64_t n, uint8_t* out, Code code, const E* ahead = nullptr) {
  constexpr int per_byte = 8 / BITS;
  constexpr int kLine = 64;  // bytes of a cache line
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    vfl v[kBlockVecs];
    vil c[kBlockVecs];
    if (ahead != nullptr) {
      for (int b = 0; b < kBlock * static_cast<int>(sizeof(E)); b += kLine)
        __builtin_prefetch(reinterpret_cast<const char*>(ahead + j) + b);
    }
    load_block(x + j, v);
#pragma GCC unroll 8  // k constant in each copy: the lanes' offsets fold into constants
    for (int k = 0; k < kBlockVecs; ++k) c[k] = code(v[k], j, k);
    store_block_codes<BITS, E>(c, out + j / per_byte);
  }
  for (; j < n; j += per_byte) {
    uint32_t b = 0;
    for (int t = 0; t < per_byte && j + t < n; ++t) b |= put_field<BITS>(code(to_float(x[j + t]), j + t, 0), t);
    out[j / per_byte] = static_cast<uint8_t>(b);
  }
}

// A group's decoded values, value[c] = what code c decodes to in the output dtype T.
template <typename T>
struct CodeTable {
  T value[16];
};

// out[0, n) from the BITS-bit codes at in (BITS <= 4): one look-up of each code in tab.
template <int BITS, typename T>
static inline void decode_table(const uint8_t* in, int64_t n, const CodeTable<T>& tab, T* out) {
  constexpr int per_byte = 8 / BITS;
  int64_t j = 0;
#ifdef ADACC_AVX2
  if (n >= 32) {
    if constexpr (sizeof(T) == 2) {
      // Shuffles look up bytes: one table for the values' low bytes and one for their high bytes.
      alignas(16) uint8_t lo[16], hi[16];
      for (int c = 0; c < 16; ++c) {
        uint16_t b;
        std::memcpy(&b, &tab.value[c], 2);
        lo[c] = static_cast<uint8_t>(b);
        hi[c] = static_cast<uint8_t>(b >> 8);
      }
      const __m256i tlo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lo)));
      const __m256i thi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(hi)));
      for (; j + 32 <= n; j += 32) {
        const __m256i codes = load_fields<BITS>(in + j / per_byte);
        const __m256i l = _mm256_shuffle_epi8(tlo, codes), h = _mm256_shuffle_epi8(thi, codes);
        const __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h);  // 0-7 16-23, 8-15 24-31
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j + 16), _mm256_permute2x128_si256(a, b, 0x31));
      }
    } else {
      // Two 8-value tables, picked between by bit 3 of the code.
      const __m256 t0 = _mm256_loadu_ps(reinterpret_cast<const float*>(tab.value));
      const __m256 t1 = _mm256_loadu_ps(reinterpret_cast<const float*>(tab.value) + 8);
      for (; j + 32 <= n; j += 32) {
        const __m256i codes = load_fields<BITS>(in + j / per_byte);
        const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
        for (int k = 0; k < 4; ++k) {
          const __m256i idx = _mm256_cvtepu8_epi32(k & 1 ? _mm_srli_si128(halves[k / 2], 8) : halves[k / 2]);
          __m256 v = _mm256_permutevar8x32_ps(t0, idx);
          if constexpr (BITS == 4)
            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(t1, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
          _mm256_storeu_ps(reinterpret_cast<float*>(out + j + 8 * k), v);
        }
      }
    }
  }
#endif
  for (; j < n; ++j) out[j] = tab.value[field<BITS>(in[j / per_byte], static_cast<int>(j % per_byte))];
}

// The BITS-bit codes of values [j, j + kBlock) at in, as int32 vectors in value order.
template <int BITS>
static inline void load_block_codes(const uint8_t* in, int64_t j, vil (&c)[kBlockVecs]) {
#ifdef ADACC_AVX2
  const __m256i codes = load_fields<BITS>(in + j * BITS / 8);
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  c[0] = reinterpret_cast<vil>(_mm256_cvtepu8_epi32(lo));
  c[1] = reinterpret_cast<vil>(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  c[2] = reinterpret_cast<vil>(_mm256_cvtepu8_epi32(hi));
  c[3] = reinterpret_cast<vil>(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  constexpr int per_byte = 8 / BITS;
  for (int k = 0; k < kBlockVecs; ++k) {
    int32_t lanes[kVecLanes];  // then copied whole: GCC takes a vector filled lane by lane as uninitialized
    for (int l = 0; l < kVecLanes; ++l) {
      const int64_t e = j + k * kVecLanes + l;
      lanes[l] = static_cast<int32_t>(field<BITS>(in[e / per_byte], static_cast<int>(e % per_byte)));
    }
    std::memcpy(&c[k], lanes, sizeof(lanes));
  }
#endif
}

// out[0, len) of one group from its BITS-bit codes at in. value(code, guard) decodes a code (one int32, or
// a vector of them) to float32 by codec_math.h's arithmetic, guard a std::bool_constant. 16-bit outputs and
// guarded groups (see needs_guard) look the codes up in a table of the group's 2**BITS values; float32
// outputs of other groups are computed in lanes, which costs no more than a look-up of 32-bit values.
template <int BITS, typename T, typename Value>
static inline void decode_group(const uint8_t* in, int64_t len, T* out, bool guarded, Value value) {
  constexpr int per_byte = 8 / BITS;
  if constexpr (std::is_same_v<T, float>) {
    if (!guarded) {
      int64_t j = 0;
      for (; j + kBlock <= len; j += kBlock) {
        vil c[kBlockVecs];
        load_block_codes<BITS>(in, j, c);
#pragma GCC unroll 8
        for (int k = 0; k < kBlockVecs; ++k) store_lanes(out + j + k * kVecLanes, value(c[k], std::false_type{}));
      }
      for (; j < len; ++j)
        out[j] = value(static_cast<int32_t>(field<BITS>(in[j / per_byte], static_cast<int>(j % per_byte))),
                       std::false_type{});
      return;
    }
  }
  if constexpr (BITS == 8) {
    for (int64_t j = 0; j < len; ++j) out[j] = from_float<T>(value(static_cast<int32_t>(in[j]), std::true_type{}));
  } else {
    CodeTable<T> tab{};
    for (int32_t c = 0; c < (1 << BITS); ++c) tab.value[c] = from_float<T>(value(c, std::true_type{}));
    decode_table<BITS>(in, len, tab, out);
  }
}

// -------------------------------------------------------------------------------- traversal
// Elements per parallel task: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kTaskElems = 1 << 15;

static inline int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, kTaskElems / std::max<int64_t>(elems_per_item, 1));
}

// f(std::true_type) where `flag`, else f(std::false_type): one loop instance of each.
template <typename F>
static inline void with_guard(bool flag, F&& f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// Run f(g, off, len) for every group of n values in parallel; f returns whether the group held NaN or Inf,
// which sets any_bad.
template <typename F>
static inline void for_each_group(int64_t n, int64_t group, std::atomic<bool>& any_bad, F&& f) {
  at::parallel_for(0, ceil_div(n, group), grain_for(group), [&](int64_t begin, int64_t end) {
    bool bad = false;
    for (int64_t g = begin; g < end; ++g) bad |= f(g, g * group, std::min(group, n - g * group));
    if (bad) any_bad.store(true, std::memory_order_relaxed);
  });
}

// The values after group [off, off + len) of x[0, n), where a group's loop reads next; null after the last.
template <typename E>
static inline const E* next_group(const E* x, int64_t n, int64_t off, int64_t len) {
  return off + 2 * len <= n ? x + off + len : nullptr;
}

// Run f(g, off, len) for every group of n values in parallel.
template <typename F>
static inline void for_each_group_range(int64_t n, int64_t group, F&& f) {
  at::parallel_for(0, ceil_div(n, group), grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) f(g, g * group, std::min(group, n - g * group));
  });
}

// ------------------------------------------------------------------------------------ symmetric
// One symmetric group x[0, len): its codes at out, its scale returned through `scale`; true where it holds
// NaN or Inf. `ahead`: see encode.
template <typename T>
static inline bool sym_group(const T* x, int64_t len, uint8_t* out, float& scale, const T* ahead) {
  const Range r = group_range(x, len);
  const Affine a = symmetric_group(r.mn, r.mx);
  scale = a.scale;
  encode<4>(
      x, len, out, [inv = a.inv](auto v, int64_t, int) { return sym_code4<lanes_of<decltype(v)>>(v, inv); }, ahead);
  return r.bad;
}

// Decode the symmetric 4-bit codes of out[0, len) at scale s.
template <typename T>
static inline void decode_sym(const uint8_t* in, int64_t len, float s, T* out) {
  decode_group<4>(in, len, out, needs_guard<T>(-8.0f, 7.0f, s, 0.0f), [s](auto code, auto guard) {
    using L = lanes_of<decltype(code)>;
    return sym_value<T, decltype(guard)::value, L>(L::to_float(code - 8), s);  // nibble()'s signed code
  });
}

template <typename T>
void sym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                       std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group(n, group, any_bad, [&](int64_t g, int64_t off, int64_t len) {
    return sym_group(x + off, len, payload + g * gb, scales[g], next_group(x, n, off, len));
  });
}

template <typename T>
void sym_int4_decompress(const uint8_t* payload, const float* scales, int64_t n, int64_t group, T* out) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    decode_sym(payload + g * gb, len, scales[g], out + off);
  });
}

// ----------------------------------------------------------------------------------- asymmetric
template <typename T>
void asym_int4_compress(const T* x, int64_t n, int64_t group, uint8_t* payload, float* scales,
                        float* offsets, std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group(n, group, any_bad, [&](int64_t g, int64_t off, int64_t len) {
    const Range r = group_range(x + off, len);
    const Affine a = asymmetric_group(r.mn, r.mx);
    scales[g] = a.scale;
    offsets[g] = a.offset;
    with_guard(a.k != 1.0f, [&](auto scaled) {
      encode<4>(
          x + off, len, payload + g * gb,
          [&a](auto v, int64_t, int) { return affine_code4<decltype(scaled)::value, lanes_of<decltype(v)>>(v, a); },
          next_group(x, n, off, len));
    });
    return r.bad;
  });
}

template <typename T>
void asym_int4_decompress(const uint8_t* payload, const float* scales, const float* offsets, int64_t n,
                          int64_t group, T* out) {
  const int64_t gb = group_bytes(group, 4);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    const float s = scales[g], o = offsets[g];
    decode_group<4>(payload + g * gb, len, out + off, needs_guard<T>(-8.0f, 7.0f, s, o), [s, o](auto code, auto guard) {
      using L = lanes_of<decltype(code)>;
      return affine_value<T, decltype(guard)::value, L>(L::to_float(code - 8), s, o);
    });
  });
}

// --------------------------------------------------------------------------------- channel-wise
// Row chunks of the column reductions. A fixed chunk size keeps the float64 sums of channel_abs_sum
// independent of the thread count (ranges are exact in any order anyway).
constexpr int64_t kRowChunk = 256;

// Column reductions run down a chunk of rows one tile of kTileVecs vectors' columns at a time, the tile's
// accumulators in registers: one load per vector of values, where accumulators in memory would cost a load
// and a store each.
constexpr int kTileVecs = 4;

// For each tile of whole vectors of x's columns (x [rows, cols] of element type E) and each chunk of rows:
// f(ch, c, r0, r1) reduces columns [c, c + kTileVecs * lanes) of rows [r0, r1); tail(ch, c, r0, r1) does
// column c alone where no whole tile is left.
template <typename E, typename Tile, typename Tail>
static inline void for_each_column_tile(int64_t rows, int64_t cols, int64_t lanes, Tile&& tile, Tail&& tail) {
  at::parallel_for(0, ceil_div(rows, kRowChunk), 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t r0 = ch * kRowChunk, r1 = std::min(rows, r0 + kRowChunk);
      int64_t c = 0;
      for (; c + kTileVecs * lanes <= cols; c += kTileVecs * lanes) tile(ch, c, r0, r1);
      for (; c < cols; ++c) tail(ch, c, r0, r1);
    }
  });
}

// Per-chunk column ranges of x ([rows, cols]) into part ([nchunks, cols]).
template <typename T>
static inline void column_ranges(const T* x, int64_t rows, int64_t cols, BitsRange<typename RawBits<T>::B>* part) {
  using B = typename RawBits<T>::B;
  using vb = typename BitsVec<T>::U;
  using vs = typename BitsVec<T>::S;
  constexpr int64_t kLanes = BitsVec<T>::kLanes;
  const B* u = reinterpret_cast<const B*>(x);
  const auto load = [&](int64_t r, int64_t c) {
    vb v;
    std::memcpy(&v, u + r * cols + c, sizeof(v));
    return v;
  };
  const auto tile = [&](int64_t ch, int64_t c, int64_t r0, int64_t r1) {
    vs smax[kTileVecs];
    vb umax[kTileVecs], umin[kTileVecs];
#pragma GCC unroll 4
    for (int t = 0; t < kTileVecs; ++t) {
      umax[t] = umin[t] = load(r0, c + t * kLanes);
      smax[t] = reinterpret_cast<vs>(umax[t]);
    }
    for (int64_t r = r0 + 1; r < r1; ++r) {
#pragma GCC unroll 4
      for (int t = 0; t < kTileVecs; ++t) {
        const vb b = load(r, c + t * kLanes);
        const vs sb = reinterpret_cast<vs>(b);
        smax[t] = sb > smax[t] ? sb : smax[t];
        umax[t] = b > umax[t] ? b : umax[t];
        umin[t] = b < umin[t] ? b : umin[t];
      }
    }
    for (int t = 0; t < kTileVecs; ++t) {
      for (int l = 0; l < kLanes; ++l) {
        BitsRange<B>& p = part[ch * cols + c + t * kLanes + l];
        p.smax = smax[t][l];
        p.umax = umax[t][l];
        p.umin = umin[t][l];
      }
    }
  };
  for_each_column_tile<T>(rows, cols, kLanes, tile, [&](int64_t ch, int64_t c, int64_t r0, int64_t r1) {
    BitsRange<B> acc(u[r0 * cols + c]);
    for (int64_t r = r0 + 1; r < r1; ++r) acc.add(u[r * cols + c]);
    part[ch * cols + c] = acc;
  });
}

template <typename T>
void chan_int4_compress(const T* x, int64_t rows, int64_t cols, uint8_t* payload, float* scales,
                        std::atomic<bool>& any_bad) {
  using B = typename RawBits<T>::B;
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  std::vector<BitsRange<B>> part(nchunks * cols, BitsRange<B>(0));
  std::vector<float> inv(cols);  // per channel, and in the lanes of its values
  column_ranges(x, rows, cols, part.data());
  bool bad = false;
  for (int64_t c = 0; c < cols; ++c) {
    BitsRange<B> acc = part[c];
    for (int64_t ch = 1; ch < nchunks; ++ch) acc.add(part[ch * cols + c]);
    const Range r = acc.template range<T>();
    bad |= r.bad;
    scales[c] = symmetric_scale(r.mn, r.mx);
    inv[c] = inverse(scales[c]);
  }
  if (bad) any_bad.store(true, std::memory_order_relaxed);
  const std::vector<float> lane_inv = in_block_order<T>(inv.data(), cols);
  const int64_t rb = group_bytes(cols, 4);
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto code = [&](auto v, int64_t c, int k) {
        if constexpr (std::is_same_v<decltype(v), float>)
          return sym_code4(v, inv[c]);
        else
          return sym_code4<VecLanes>(v, load_lanes(lane_inv.data() + c + k * kVecLanes));
      };
      encode<4>(x + r * cols, cols, payload + r * rb, code, next_group(x, rows * cols, r * cols, cols));
    }
  });
}

template <typename T>
void chan_int4_decompress(const uint8_t* payload, const float* scales, int64_t rows, int64_t cols, T* out) {
  const int64_t rb = group_bytes(cols, 4);
  bool guarded = false, finite = true;  // finite scales make finite values
  for (int64_t c = 0; c < cols; ++c) {
    guarded |= needs_guard<T>(-8.0f, 7.0f, scales[c], 0.0f);
    finite &= !not_finite(scales[c]);
  }
  with_guard(guarded, [&](auto guard) {
    constexpr bool G = decltype(guard)::value;
    with_guard(!finite, [&](auto maybe_nan) {
    at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint8_t* in = payload + r * rb;
        T* y = out + r * cols;
        int64_t c = 0;
        for (; c + kBlock <= cols; c += kBlock) {
          vil q[kBlockVecs];
          load_block_codes<4>(in, c, q);
#pragma GCC unroll 8
          for (int k = 0; k < kBlockVecs; ++k) {
            const int64_t e = c + k * kVecLanes;
            store_lanes<decltype(maybe_nan)::value>(
                y + e, sym_value<T, G, VecLanes>(VecLanes::to_float(q[k] - 8), load_lanes(scales + e)));
          }
        }
        for (; c < cols; ++c) y[c] = from_float<T>(sym_value<T, G>(nibble(in[c / 2], static_cast<int>(c & 1)), scales[c]));
      }
    });
    });
  });
}

// ---------------------------------------------------------------------------- outlier-separated
typedef double vdb __attribute__((vector_size(ADACC_VEC_BYTES)));  // half a vfl's lanes, as float64

// Lanes [FIRST, FIRST + kVecLanes / 2) of v as float64.
template <int FIRST, size_t... I>
static inline vdb widen_half(vfl v, std::index_sequence<I...>) {
#ifdef ADACC_AVX2  // one conversion: GCC converts a __builtin_convertvector two lanes at a time
  return reinterpret_cast<vdb>(_mm256_cvtps_pd(FIRST ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v)));
#else
  return __builtin_convertvector(__builtin_shufflevector(v, v, (FIRST + I)...), vdb);
#endif
}

template <typename T>
void channel_abs_sum(const T* x, int64_t rows, int64_t cols, double* sums) {
  const int64_t nchunks = ceil_div(rows, kRowChunk);
  std::vector<double> part(nchunks * cols, 0.0);
  constexpr int kHalf = kVecLanes / 2;
  // Each column's float64 sum adds its rows in order from 0, whatever the tiling: the sums do not depend on it.
  const auto tile = [&](int64_t ch, int64_t c, int64_t r0, int64_t r1) {
    vdb acc[2 * kTileVecs] = {};
    for (int64_t r = r0; r < r1; ++r) {
#pragma GCC unroll 4
      for (int t = 0; t < kTileVecs; ++t) {
        const vu32 bits = reinterpret_cast<vu32>(load_lanes(x + r * cols + c + t * kVecLanes)) & 0x7FFFFFFFu;
        const vfl v = reinterpret_cast<vfl>(bits);  // |value|
        acc[2 * t] += widen_half<0>(v, std::make_index_sequence<kHalf>{});
        acc[2 * t + 1] += widen_half<kHalf>(v, std::make_index_sequence<kHalf>{});
      }
    }
    std::memcpy(part.data() + ch * cols + c, acc, sizeof(acc));
  };
  for_each_column_tile<T>(rows, cols, kVecLanes, tile, [&](int64_t ch, int64_t c, int64_t r0, int64_t r1) {
    double acc = 0.0;
    for (int64_t r = r0; r < r1; ++r) acc += static_cast<double>(std::fabs(to_float(x[r * cols + c])));
    part[ch * cols + c] = acc;
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
    std::vector<T> dense_row(cols);  // the row with its outlier channels zeroed (dense_value)
    T* dense = dense_row.data();
    bool bad = false;
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      std::memcpy(dense, xr, cols * sizeof(T));
      for (int64_t i = 0; i < k; ++i) {
        const T v = xr[idx[i]];
        outliers[r * k + i] = v;
        bad |= not_finite(to_float(v));  // the dense values no longer show them
        dense[idx[i]] = from_float<T>(dense_value(to_float(v), true));
      }
      bad |= sym_group(dense, cols, payload + r * rb, scales[r], next_group(x, rows * cols, r * cols, cols));
    }
    if (bad) any_bad.store(true, std::memory_order_relaxed);
  });
}

template <typename T>
void outlier_int4_decompress(const uint8_t* payload, const float* scales, const T* outliers, const int32_t* idx,
                             int64_t k, int64_t rows, int64_t cols, T* out) {
  const int64_t rb = group_bytes(cols, 4);
  at::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* y = out + r * cols;
      decode_sym(payload + r * rb, cols, scales[r], y);
      for (int64_t i = 0; i < k; ++i) y[idx[i]] = outliers[r * k + i];
    }
  });
}

// ----------------------------------------------------------------------------------- bit masks
static inline void bitmask_pack(const uint8_t* x, int64_t n, uint8_t* out, std::atomic<bool>& any_bad) {
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    uint64_t high = 0;  // every mask byte OR-ed: a bit above bit 0 means a value > 1
    int64_t i = begin;
#ifdef ADACC_AVX2
    __m256i any = _mm256_setzero_si256();
    for (; i + 4 <= end; i += 4) {  // 32 mask bytes: bit 0 of each to bit 7, gathered by movemask
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * i));
      any = _mm256_or_si256(any, v);
      const uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
      std::memcpy(out + i, &m, 4);
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), any);
    high = lanes[0] | lanes[1] | lanes[2] | lanes[3];
#endif
    for (; i < end; ++i) {
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
  const int64_t full = n / 8;
  at::parallel_for(0, full, kTaskElems / 8, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef ADACC_AVX2
    for (; i + 4 <= end; i += 4) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), load_fields<1>(in + i));
#endif
    for (; i < end; ++i) {
      uint64_t v = 0;  // byte i's eight bits as eight 0/1 bytes
      for (int j = 0; j < 8; ++j) v |= static_cast<uint64_t>(field<1>(in[i], j)) << (8 * j);
      std::memcpy(out + 8 * i, &v, 8);
    }
  });
  for (int64_t e = 8 * full; e < n; ++e) out[e] = static_cast<uint8_t>(field<1>(in[full], static_cast<int>(e - 8 * full)));
}

// -------------------------------------------------------------------------- stochastic rounding
template <typename T, int BITS>
void stochastic_compress(const T* x, int64_t n, int64_t group, uint64_t seed, uint8_t* payload, float* mins,
                         float* scales, std::atomic<bool>& any_bad) {
  const int64_t gb = group_bytes(group, BITS);
  for_each_group(n, group, any_bad, [&](int64_t g, int64_t off, int64_t len) {
    const Range r = group_range(x + off, len);
    const Affine a = stochastic_group(r.mn, r.mx, static_cast<float>((1 << BITS) - 1));
    mins[g] = a.offset;
    scales[g] = a.scale;
    with_guard(a.k != 1.0f, [&](auto scaled) {
      encode<BITS>(x + off, len, payload + g * gb, [&](auto v, int64_t j, int k) {
        constexpr bool S = decltype(scaled)::value;
        const uint64_t index = static_cast<uint64_t>(off + j);  // positions >= 0: x >= mn and inv >= 0
        if constexpr (std::is_same_v<decltype(v), float>) {
          return stochastic_code<BITS>(code_position<S>(v, a), uniform24(seed, index));
        } else {
          const vil lanes = block_index<T>(k);
          vu32 rnd;
          const uint32_t lo = static_cast<uint32_t>(index);
          if (lo <= UINT32_MAX - (kBlock - 1)) {  // the block's values share the index's high half
            rnd = uniform24_halves<VecLanes>(seed, lo + reinterpret_cast<vu32>(lanes), static_cast<uint32_t>(index >> 32));
          } else {
            for (int l = 0; l < kVecLanes; ++l) rnd[l] = uniform24(seed, index + static_cast<uint64_t>(lanes[l]));
          }
          return stochastic_code<BITS, VecLanes>(code_position<S, VecLanes>(v, a), rnd);
        }
      }, next_group(x, n, off, len));
    });
    return r.bad;
  });
}

template <typename T, int BITS>
void stochastic_decompress(const uint8_t* payload, const float* mins, const float* scales, int64_t n,
                           int64_t group, T* out) {
  const int64_t gb = group_bytes(group, BITS);
  for_each_group_range(n, group, [&](int64_t g, int64_t off, int64_t len) {
    const float s = scales[g], mn = mins[g];
    const bool guarded = needs_guard<T>(0.0f, static_cast<float>((1 << BITS) - 1), s, mn);
    decode_group<BITS>(payload + g * gb, len, out + off, guarded, [s, mn](auto code, auto guard) {
      using L = lanes_of<decltype(code)>;
      return affine_value<T, decltype(guard)::value, L>(L::to_float(code), s, mn);
    });
  });
}
