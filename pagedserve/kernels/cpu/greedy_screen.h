// The exact argmax of a float32 LM head from a cheap screen of it (gemm_cpu.cpp,
// greedy_screen_argmax and greedy_screen_int8_argmax; runner/greedy_head.py says why and when, and
// derives the bounds).
//
// For one row h of the final hidden states: s[v] is the screen's logit of token v and
// |s[v] − l[v]| ≤ b[v], where l[v] is what the float32 GEMM gives. The token the float32 logits
// pick satisfies s[v] + b[v] ≥ max_u (s[u] − b[u]), so the exact argmax is among the tokens that
// pass this test, and only they are computed again in float32, bit for bit as the GEMM does.
//
// The screen is never stored: each finished GEMM tile (up to 8 rows × 48 tokens) goes through
// take_tile*, which keeps per row its thread's running threshold, max (s − b) so far, and the
// tokens whose s + b reaches it. A running threshold is never above the final one, so every token
// the final test keeps has been kept; the few extra are dropped once the threads are merged. Most
// tiles hold no token that reaches the threshold, and then none can raise it either (s − b ≤
// s + b), so a tile costs one compare per token unless something in it is within reach.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace greedy_screen {

// absolute slack for flushed denormals (bfloat16 inputs and float32 results below 2^-126)
constexpr float kTiny = 0x1p-100f;

struct Candidate {
  int32_t row, token;
  float upper;  // s + b
};

// One thread's running state over the screen's tiles.
struct ThreadState {
  std::vector<float> threshold;  // per row: max (s − b) over the tiles this thread has seen
  std::vector<uint8_t> nan;      // per row: a NaN seen in the screen
  std::vector<Candidate> kept;

  void reset(int64_t m) {
    threshold.assign(m, -INFINITY);
    nan.assign(m, 0);
    kept.clear();
  }
};

// Keeps the tokens first + j for each bit j set in `bits`, with their upper values u[j].
inline void keep(ThreadState* st, int64_t row, int64_t first, uint32_t bits, const float* u) {
  while (bits != 0) {
    const int j = __builtin_ctz(bits);
    st->kept.push_back({static_cast<int32_t>(row), static_cast<int32_t>(first + j), u[j]});
    bits &= bits - 1;
  }
}

inline float max_lane(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The bfloat16 screen's tile (float32 sums): rows [row, row + rows), tokens [col, col + cols), row
// stride ld; b[v] = beta[row] · wn[v] + kTiny. 8 lanes (AVX2: the screen also runs on AVX2 CPUs).
inline void take_tile(const float* tile, int64_t ld, int64_t row, int64_t rows, int64_t col, int64_t cols,
                      const float* beta, const float* wn, ThreadState* st) {
  constexpr int kMaxChunks = 6;  // 48 columns
  const int chunks = static_cast<int>((cols + 7) / 8);
  __m256 w[kMaxChunks], valid[kMaxChunks];
  for (int c = 0; c < chunks; ++c) {
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols - 8 * c)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    valid[c] = _mm256_castsi256_ps(lanes);
    w[c] = _mm256_maskload_ps(wn + col + 8 * c, lanes);
  }
  const __m256 tiny = _mm256_set1_ps(kTiny), ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t R = row + r;
    const __m256 vb = _mm256_set1_ps(beta[R]), old = _mm256_set1_ps(st->threshold[R]);
    __m256 s[kMaxChunks], b[kMaxChunks], reach = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      s[c] = _mm256_load_ps(tile + r * ld + 8 * c);
      b[c] = _mm256_add_ps(_mm256_mul_ps(vb, w[c]), tiny);
      // s + b ≥ threshold, or a NaN (not-less-than is true for unordered lanes)
      reach = _mm256_or_ps(reach, _mm256_and_ps(valid[c], _mm256_cmp_ps(_mm256_add_ps(s[c], b[c]), old, _CMP_NLT_UQ)));
    }
    if (_mm256_movemask_ps(reach) == 0) continue;
    __m256 lo_max = ninf, unordered = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      lo_max = _mm256_max_ps(lo_max, _mm256_blendv_ps(ninf, _mm256_sub_ps(s[c], b[c]), valid[c]));
      unordered = _mm256_or_ps(unordered, _mm256_and_ps(valid[c], _mm256_cmp_ps(s[c], s[c], _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(unordered) != 0) st->nan[R] = 1;
    const float thr = std::max(st->threshold[R], max_lane(lo_max));
    st->threshold[R] = thr;
    const __m256 vthr = _mm256_set1_ps(thr);
    for (int c = 0; c < chunks; ++c) {
      const __m256 upper = _mm256_add_ps(s[c], b[c]);
      const int bits = _mm256_movemask_ps(_mm256_and_ps(valid[c], _mm256_cmp_ps(upper, vthr, _CMP_GE_OQ)));
      if (bits == 0) continue;
      alignas(32) float u[8];
      _mm256_store_ps(u, upper);
      keep(st, R, col + 8 * c, static_cast<uint32_t>(bits), u);
    }
  }
}

// The per-token quantities of the int8 screen (greedy_head.py): colsum128[v] = 128 · Σ q_w[v],
// sw[v] its scale, f[v] = ‖W[v] − sw[v]·q_w[v]‖₂ and n[v] = ‖W[v]‖₂ (both rounded up).
struct Int8Tokens {
  const int32_t* colsum128;
  const float *sw, *f, *n;
};

// The int8 screen's tile (vpdpbusd, gemm_tile_avx512.h): int32 sums of (q_h + 128) · q_w, q_h the
// row quantised by its scale sx. s[v] = (sum − 128 · colsum[v]) · sw[v] is the screened logit
// divided by sx (the same order as the logits), and so is the bound, b[v] = a[row] · f[v] +
// c[row] · n[v] + t[row] (a, c and t come with the row, in those units; t covers flushed
// denormals and, for a bfloat16 head, its rounding). 16 lanes (AVX-512).
__attribute__((target("avx512f"))) inline void take_tile_int8(const float* tile, int64_t ld, int64_t row,
                                                              int64_t rows, int64_t col, int64_t cols,
                                                              const Int8Tokens& tok, const float* a,
                                                              const float* c_row, const float* t_row,
                                                              ThreadState* st) {
  constexpr int kMaxChunks = 3;  // 48 columns
  const int chunks = static_cast<int>((cols + 15) / 16);
  __mmask16 valid[kMaxChunks];
  __m512i cs[kMaxChunks];
  __m512 scale[kMaxChunks], f[kMaxChunks], n[kMaxChunks];
  for (int c = 0; c < chunks; ++c) {
    const int64_t left = cols - 16 * c, at = col + 16 * c;
    valid[c] = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    cs[c] = _mm512_maskz_loadu_epi32(valid[c], tok.colsum128 + at);
    scale[c] = _mm512_maskz_loadu_ps(valid[c], tok.sw + at);
    f[c] = _mm512_maskz_loadu_ps(valid[c], tok.f + at);
    n[c] = _mm512_maskz_loadu_ps(valid[c], tok.n + at);
  }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t R = row + r;
    const __m512 va = _mm512_set1_ps(a[R]), vc = _mm512_set1_ps(c_row[R]), tiny = _mm512_set1_ps(t_row[R]);
    const __m512 old = _mm512_set1_ps(st->threshold[R]);
    __m512 s[kMaxChunks], b[kMaxChunks];
    __mmask16 any = 0;
    for (int c = 0; c < chunks; ++c) {
      const __m512i sum = _mm512_sub_epi32(_mm512_load_si512(tile + r * ld + 16 * c), cs[c]);
      s[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale[c]);
      b[c] = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(va, f[c]), _mm512_mul_ps(vc, n[c])), tiny);
      any |= _mm512_mask_cmp_ps_mask(valid[c], _mm512_add_ps(s[c], b[c]), old, _CMP_GE_OQ);
    }
    if (any == 0) continue;  // integer sums: no NaN to look for
    __m512 lo_max = ninf;
    for (int c = 0; c < chunks; ++c) lo_max = _mm512_mask_max_ps(lo_max, valid[c], lo_max, _mm512_sub_ps(s[c], b[c]));
    const float thr = std::max(st->threshold[R], _mm512_reduce_max_ps(lo_max));
    st->threshold[R] = thr;
    const __m512 vthr = _mm512_set1_ps(thr);
    for (int c = 0; c < chunks; ++c) {
      const __m512 upper = _mm512_add_ps(s[c], b[c]);
      const uint32_t bits = _mm512_mask_cmp_ps_mask(valid[c], upper, vthr, _CMP_GE_OQ);
      if (bits == 0) continue;
      alignas(64) float u[16];
      _mm512_store_ps(u, upper);
      keep(st, R, col + 16 * c, bits, u);
    }
  }
}

// The int8 screen's quantisation of one hidden row h of k floats: q[i] = clamp(nearbyint(h[i] / sx),
// ±127) + 128, with sx the step (max |h|, or 4, 3 or 2.5 × the rms, clipped to max |h|, over 127)
// whose error ‖h − sx·q‖₂ is the smallest. Returns sx, that squared error e2, Σq² and ‖h‖₂² (e2
// and ‖h‖₂² summed in double) for the bounds; finite = false (q untouched) where h holds a NaN or
// an infinity. 16 lanes with a masked tail: as scalar code (the double sums keep GCC from
// vectorising it: no reassociation without -ffast-math) it took 5.4 % as many `perf` samples as
// the vpdpbusd tile at 256 rows, 0.4 % now. The sums' order differs from a scalar loop's; the
// bounds carry 1 % of slack for far more.
struct RowQuant {
  float sx = 1.f;
  double e2 = 0, q2 = 0, h2 = 0;
  bool finite = true;
};

// The quantiser's helpers are free functions, not lambdas: a lambda does not inherit its enclosing
// function's target attribute, so on a CPU without AVX-512 (where -march=native does not enable it
// for the whole file) its intrinsics would fail to inline and the library would not build.
__attribute__((target("avx512f"))) inline __mmask16 row_tail_mask(int64_t k, int64_t i) {
  return k - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (k - i)) - 1);
}

__attribute__((target("avx512f"))) inline void widen_halves(__m512 v, __m512d* lo, __m512d* hi) {
  *lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  *hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

__attribute__((target("avx512f"))) inline __m512 quantised_lanes(__m512 v, __m512 scale) {
  const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f), r));
}

__attribute__((target("avx512f"))) inline RowQuant quantise_row_int8(const float* h, int64_t k, uint8_t* q) {
  RowQuant out;
  __m512 amax = _mm512_setzero_ps();
  __m512d h2_lo = _mm512_setzero_pd(), h2_hi = _mm512_setzero_pd();
  const __m512 inf = _mm512_set1_ps(INFINITY);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = row_tail_mask(k, i);
    const __m512 v = _mm512_maskz_loadu_ps(m, h + i), av = _mm512_abs_ps(v);
    if (_mm512_mask_cmp_ps_mask(m, av, inf, _CMP_LT_OQ) != m) {  // a NaN or an infinity
      out.finite = false;
      return out;
    }
    amax = _mm512_max_ps(amax, av);
    __m512d lo, hi;
    widen_halves(v, &lo, &hi);
    h2_lo = _mm512_fmadd_pd(lo, lo, h2_lo);
    h2_hi = _mm512_fmadd_pd(hi, hi, h2_hi);
  }
  const float hmax = _mm512_reduce_max_ps(amax);
  out.h2 = _mm512_reduce_add_pd(_mm512_add_pd(h2_lo, h2_hi));
  const float rms = static_cast<float>(std::sqrt(out.h2 / std::max<int64_t>(k, 1)));
  const float levels[] = {hmax, 4.f * rms, 3.f * rms, 2.5f * rms};
  out.e2 = INFINITY;
  for (const float level : levels) {
    const float scale = std::min(level, hmax) > 0.f ? std::min(level, hmax) / 127.f : 1.f;
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512d ds = _mm512_set1_pd(scale);
    __m512d e_lo = _mm512_setzero_pd(), e_hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(row_tail_mask(k, i), h + i), qi = quantised_lanes(v, vs);
      __m512d v_lo, v_hi, q_lo, q_hi;
      widen_halves(v, &v_lo, &v_hi);
      widen_halves(qi, &q_lo, &q_hi);
      const __m512d d_lo = _mm512_fnmadd_pd(ds, q_lo, v_lo), d_hi = _mm512_fnmadd_pd(ds, q_hi, v_hi);
      e_lo = _mm512_fmadd_pd(d_lo, d_lo, e_lo);
      e_hi = _mm512_fmadd_pd(d_hi, d_hi, e_hi);
    }
    const double err = _mm512_reduce_add_pd(_mm512_add_pd(e_lo, e_hi));
    if (err < out.e2) out.e2 = err, out.sx = scale;
  }
  const __m512 vs = _mm512_set1_ps(out.sx);
  __m512i q2 = _mm512_setzero_si512();  // Σ q² ≤ k · 127²: exact in int32 for k below 130,000
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = row_tail_mask(k, i);
    const __m512i qi = _mm512_cvtps_epi32(quantised_lanes(_mm512_maskz_loadu_ps(m, h + i), vs));
    q2 = _mm512_add_epi32(q2, _mm512_mullo_epi32(qi, qi));
    _mm512_mask_cvtepi32_storeu_epi8(q + i, m, _mm512_add_epi32(qi, _mm512_set1_epi32(128)));
  }
  out.q2 = static_cast<double>(_mm512_reduce_add_epi32(q2));
  return out;
}

// ‖x‖₂ of k floats, in double
inline double norm2(const float* x, int64_t k) {
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

}  // namespace greedy_screen
