// The exact argmax of a float32 LM head from a bfloat16 screen of it (gemm_cpu.cpp,
// greedy_screen_argmax; model/greedy_head.py says why and when).
//
// For one row h of the final hidden states: s[v] is the screen's logit of token v (h and W rounded
// to bfloat16, summed in float32) and |s[v] − l[v]| ≤ b[v] = beta · wn[v] + kTiny, where l[v] is
// what the float32 GEMM gives, wn[v] = ‖W[v]‖₂ and beta = coef · ‖h‖₂ (the bound is derived in
// greedy_head.py). The token the float32 logits pick satisfies s[v] + b[v] ≥ max_u (s[u] − b[u]),
// so the exact argmax is among the tokens that pass this test, and only they are computed again
// in float32, bit for bit as the GEMM computes them.
//
// The screen is never stored: each finished GEMM tile (8 rows × up to 48 tokens) raises its
// thread's running threshold of each row, max (s − b) so far, and keeps the tokens whose s + b
// reaches it. A running threshold is never above the final one, so every token the final test
// keeps has been kept; the few extra are dropped once the threads' thresholds are merged.
#pragma once

#include <immintrin.h>
#include <stdint.h>

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

inline float max_lane(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Takes one finished tile of the screen: rows [row, row + rows), tokens [col, col + cols), row
// stride ld (the tile holds at most 48 columns). beta[r]: the bound's factor of row r; wn: the
// weight rows' norms.
inline void take_tile(const float* tile, int64_t ld, int64_t row, int64_t rows, int64_t col, int64_t cols,
                      const float* beta, const float* wn, ThreadState* st) {
  constexpr int kMaxCols = 48;
  const int chunks = static_cast<int>((cols + 7) / 8);
  __m256 w[kMaxCols / 8];
  __m256i valid[kMaxCols / 8];
  for (int c = 0; c < chunks; ++c) {
    valid[c] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols - 8 * c)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    w[c] = _mm256_maskload_ps(wn + col + 8 * c, valid[c]);
  }
  const __m256 tiny = _mm256_set1_ps(kTiny), ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t R = row + r;
    const __m256 vb = _mm256_set1_ps(beta[R]);
    __m256 upper[kMaxCols / 8], lo_max = ninf, unordered = _mm256_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const __m256 s = _mm256_load_ps(tile + r * ld + 8 * c);
      const __m256 b = _mm256_add_ps(_mm256_mul_ps(vb, w[c]), tiny);
      const __m256 in = _mm256_castsi256_ps(valid[c]);
      lo_max = _mm256_max_ps(lo_max, _mm256_blendv_ps(ninf, _mm256_sub_ps(s, b), in));
      upper[c] = _mm256_blendv_ps(ninf, _mm256_add_ps(s, b), in);
      unordered = _mm256_or_ps(unordered, _mm256_and_ps(in, _mm256_cmp_ps(s, s, _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(unordered) != 0) st->nan[R] = 1;
    const float thr = std::max(st->threshold[R], max_lane(lo_max));
    st->threshold[R] = thr;
    const __m256 vthr = _mm256_set1_ps(thr);
    for (int c = 0; c < chunks; ++c) {
      int bits = _mm256_movemask_ps(_mm256_cmp_ps(upper[c], vthr, _CMP_GE_OQ));
      if (bits == 0) continue;
      alignas(32) float u[8];
      _mm256_store_ps(u, upper[c]);
      while (bits != 0) {
        const int j = __builtin_ctz(bits);
        st->kept.push_back({static_cast<int32_t>(R), static_cast<int32_t>(col + 8 * c + j), u[j]});
        bits &= bits - 1;
      }
    }
  }
}

// ‖x‖₂ of k floats, in double
inline double norm2(const float* x, int64_t k) {
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

}  // namespace greedy_screen
