// Shared parts of the CPU paged-attention kernel (paged_attention_cpu.cpp): element access for
// float32 and bfloat16, the item shapes, and the AVX2 helpers both paths use.
#pragma once
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PS_HAVE_AVX2 1
#endif
// The library is built for the CPU it runs on (-march=native): where that has AVX-512 (F and DQ),
// the decode row path uses 16-wide vectors for its dot products and P·V sums (head sizes that are
// a multiple of 16).
#if defined(PS_HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define PS_HAVE_AVX512 1
#endif

// Pins a loaded vector in a register. GCC otherwise folds a vector that several FMAs share into
// each of them as a reloaded memory operand, which makes the inner loops load-bound.
#define PS_KEEP(v) __asm__("" : "+x"(v))
#define PS_KEEP16(v) __asm__("" : "+v"(v))  // the same for a zmm (any of the 32)

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {  // bfloat16 -> float32
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) {  // float32 -> bfloat16, round to nearest even
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  *p = static_cast<uint16_t>(bits >> 16);
}

struct Shape {
  int64_t H, KVH, D, BS, MAXB;
  float scale;
};

// Running softmax state of one (query, head) row: max, normaliser, weighted sum of V.
struct Row {
  float m, l;
  float* acc;  // [D]
};

// Rows of an item: (query i, head h) for the heads of kv heads [kh0, kh1), query-major.
struct Rows {
  int64_t qn, h0, HH, G;  // HH heads per query, starting at head h0
  int64_t count() const { return qn * HH; }
  int64_t query(int64_t r) const { return r / HH; }
  int64_t head(int64_t r) const { return h0 + r % HH; }
  int64_t kv_head(int64_t r) const { return head(r) / G; }
};

#ifdef PS_HAVE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
#ifdef PS_HAVE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

// exp for arguments <= 0 (scores minus their running max): Cephes-style range reduction and a
// degree-6 polynomial, about 1 ulp; inputs below -87 flush to ~1e-38, which the caller masks.
// exp8 and exp16 share these constants, so the two widths round alike.
namespace exp_poly {
constexpr float kMinArg = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 = kLn2Hi + kLn2Lo
constexpr float kC[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_max_ps(x, _mm256_set1_ps(kMinArg));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kC[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kC[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// out[0..8) = the 8x8 transpose of rows r[0..8)
inline void transpose8x8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#ifdef PS_HAVE_AVX512
// lanes [0, n) of a 16-lane mask
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

// exp16 is exp8 on 16 lanes (same reduction and polynomial).
inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(kMinArg));
  const __m512 fx =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kC[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kC[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
// lane j of the result = sum of the lanes of a[j]
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One online-softmax step over a row's scores sr[0, width), width a multiple of 8, keys the row
// cannot see holding -inf: updates the running max m and normaliser l, turns the scores into
// probabilities in place (exactly 0 for the -inf ones: exp8 flushes them to ~1e-38, the compare
// zeroes them) and returns the factor that rescales what was summed before.
inline float softmax_step(float* sr, int64_t width, float& m, float& l) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 mx = ninf;
  for (int64_t c0 = 0; c0 < width; c0 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + c0));
  const float mnew = std::max(m, hmax8(mx));
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mnew);
  const __m256 vm = _mm256_set1_ps(mnew);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < width; c0 += 8) {
    const __m256 sv = _mm256_loadu_ps(sr + c0);
    const __m256 pv = _mm256_and_ps(exp8(_mm256_sub_ps(sv, vm)), _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(sr + c0, pv);
    sum = _mm256_add_ps(sum, pv);
  }
  l = l * alpha + hsum8(sum);
  m = mnew;
  return alpha;
}

// Requests one K/V block's lines for the item's kv heads [e0, e1) (element offsets within a token
// row) into L2, spread over `calls` calls of step(): each issues the next slice of lines.
template <typename T>
class BlockPrefetch {
 public:
  BlockPrefetch() = default;
  BlockPrefetch(const T* k, const T* v, int64_t tokens, int64_t row_stride, int64_t e0, int64_t e1, int64_t calls)
      : k_(reinterpret_cast<const char*>(k + e0)), v_(reinterpret_cast<const char*>(v + e0)),
        row_bytes_(row_stride * static_cast<int64_t>(sizeof(T))),
        lines_per_row_(((e1 - e0) * static_cast<int64_t>(sizeof(T)) + 63) / 64), total_(tokens * lines_per_row_),
        per_call_((total_ + calls - 1) / std::max<int64_t>(calls, 1)) {}
  void step() {
    for (int64_t left = std::min(per_call_, total_ - done_); left > 0; --left, ++done_) {
      _mm_prefetch(k_ + off_, _MM_HINT_T1);
      _mm_prefetch(v_ + off_, _MM_HINT_T1);
      off_ += 64;
      if (++col_ == lines_per_row_) col_ = 0, off_ += row_bytes_ - lines_per_row_ * 64;  // next token's row
    }
  }

 private:
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t row_bytes_ = 0, lines_per_row_ = 1, total_ = 0, per_call_ = 0, done_ = 0, col_ = 0, off_ = 0;
};
#endif

}  // namespace
