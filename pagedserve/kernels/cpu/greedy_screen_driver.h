// The greedy screen's exact pass: float32 logits of the tokens a screen let through, computed as
// gemm_f32 would (exact_columns), and screen_finish, which picks each row's argmax from them.
//
// Part of gemm_cpu.cpp: included there, inside its anonymous namespace, after the constants and
// the headers it relies on; not a standalone header.
#pragma once

// Float32 logits as gemm_f32 computes them (its tile's k blocks, each a chain of FMAs in k order
// from 0, then added to the blocks before), for `count` tokens v[] of W [n, k] (row-major, the
// same values as gemm_f32's packed panels, where one token's weights would be 64 bytes apart), no
// bias. Eight tokens at a time, so that their chains overlap.
void exact_columns(const float* x, const float* w_rows, int64_t k, int64_t kc_max, const int32_t* v, int64_t count,
                   float* values) {
  constexpr int kLanes = 8;
  for (int64_t c0 = 0; c0 < count; c0 += kLanes) {
    const float* w[kLanes];
    for (int j = 0; j < kLanes; ++j) w[j] = w_rows + static_cast<int64_t>(v[std::min(c0 + j, count - 1)]) * k;
    float out[kLanes] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
      const int64_t k1 = std::min(k, k0 + kc_max);
      float t[kLanes] = {};
      for (int64_t kk = k0; kk < k1; ++kk)
        for (int j = 0; j < kLanes; ++j) t[j] = std::fma(x[kk], w[j][kk], t[j]);
      for (int j = 0; j < kLanes; ++j) out[j] = k0 == 0 ? t[j] + 0.f : (t[j] + 0.f) + out[j];  // store_tile's adds
    }
    for (int j = 0; j < kLanes && c0 + j < count; ++j) values[c0 + j] = out[j];
  }
}

// bfloat16 logits as the vdpbf16ps tile computes and stores them (gemm_bf16kp_bf16out, one k
// block): per token a chain of vdpbf16ps over the k pairs in order from 0, rounded to bfloat16
// once (bf16::round8, the store's own rounding), here widened back to float. 16 tokens at a time,
// one lane each, their weight pairs gathered from W row-major (w_pairs [n][ceil(k/2)] words, a
// word being a k pair with the even k in its low half, as in the panels' lanes). Row-major rather
// than the GEMM's k-pair panels: there a token's pairs are 64 bytes apart, so each token's check
// pulled its panel's whole 16 KB through the caches (W1 bfloat16, ~30 checks per row: the checks
// took ~1/6 of the screen); here its 1 KB are contiguous and each gathered line serves 16 steps.
__attribute__((target("avx512f,avx512bf16"))) void exact_columns_dot(const uint16_t* xb, const uint16_t* w_pairs,
                                                                    int64_t k, const int32_t* v, int64_t count,
                                                                    float* values) {
  const int64_t steps = (k + 1) / 2;
  const int* words = reinterpret_cast<const int*>(w_pairs);
  for (int64_t c0 = 0; c0 < count; c0 += 16) {
    alignas(64) int32_t idx[16];
    for (int j = 0; j < 16; ++j) idx[j] = static_cast<int32_t>(v[std::min<int64_t>(c0 + j, count - 1)] * steps);
    const __m512i at = _mm512_load_si512(idx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t step = 0; step < steps; ++step) {
      const uint32_t lo = xb[2 * step], hi = 2 * step + 1 < k ? xb[2 * step + 1] : 0;
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo | hi << 16));
      const __m512bh w = (__m512bh)_mm512_i32gather_epi32(at, words + step, 4);
      acc = _mm512_dpbf16_ps(acc, a, w);
    }
    alignas(64) float out[16];
    _mm256_store_ps(out, bf16::round8(_mm512_castps512_ps256(acc)));
    _mm256_store_ps(out + 8, bf16::round8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
    for (int64_t j = 0; j < 16 && c0 + j < count; ++j) values[c0 + j] = out[j];
  }
}

// The float32 k blocks gemm_f32 cuts a K-long sum into, on the tile in use.
int64_t f32_k_block(int64_t k) {
  return use_avx512 ? k_block(k, Avx512Tile::k_blocking<float>()) : k_block(k, Avx2Tile::k_blocking<float>());
}

// The screens' last step: merges the threads' thresholds of each row and the tokens that pass the
// merged one, computes those in float32 and writes the first of the largest to out (-1 where the
// row is `bad`, saw a NaN or no finite threshold, or a float32 logit is NaN). Returns how many
// logits were computed.
// exact(row, tokens, count, values) computes the row's logits of the tokens as the head does.
// tie (a bfloat16 head, else null): per row, the part of every bound that keeps tokens whose
// rounded logit may tie the largest, sized for the largest logit possible, ‖h‖·max‖W[v]‖; here it is
// cut to one bfloat16 step of the largest logit's own bound (see keep_from below).
template <typename Exact>
int64_t screen_finish(const std::vector<greedy_screen::ThreadState>& states, int nthreads, int64_t m,
                      std::vector<uint8_t>* bad_rows, const float* tie, Exact&& exact, int64_t* out) {
  std::vector<float> threshold(m, -INFINITY);
  std::vector<uint8_t>& bad = *bad_rows;
  for (int t = 0; t < nthreads; ++t)
    for (int64_t r = 0; r < m; ++r) {
      threshold[r] = std::max(threshold[r], states[t].threshold[r]);
      bad[r] |= states[t].nan[r];
    }
  for (int64_t r = 0; r < m; ++r) bad[r] |= !std::isfinite(threshold[r]);
  // keep_from[r]: the least upper value a token of row r needs. Without `tie`, the threshold. With
  // it: the largest float32 logit L (screen units) lies in [lo, hi], lo = threshold + tie and hi =
  // the largest upper − tie (the bounds without the tie part), so |L| ≤ M = max(|lo|, |hi|). A
  // token whose bfloat16 logit equals round(L) has a float32 logit ≥ L − 2u/(1 − u)·|L| (u = 2⁻⁸,
  // both roundings relative), so it keeps upper − tie ≥ lo − 2⁻⁷·(1 + u)·1.01·M (the 1 % also
  // covers the float rounding of lo, hi and upper), less kTiny thrice: `tie` carries the bounds'
  // kTiny (flushed denormals) too, so L may lie kTiny outside [lo, hi].
  std::vector<double> keep_from(threshold.begin(), threshold.end());
  if (tie != nullptr) {
    std::vector<double> hi(m, -INFINITY);
    for (int t = 0; t < nthreads; ++t)
      for (const auto& c : states[t].kept)
        if (c.upper >= threshold[c.row]) hi[c.row] = std::max(hi[c.row], static_cast<double>(c.upper) - tie[c.row]);
    for (int64_t r = 0; r < m; ++r) {
      if (bad[r]) continue;
      const double lo = static_cast<double>(threshold[r]) + tie[r];
      const double big = std::max(std::fabs(lo), std::fabs(hi[r]));
      const double cut = lo - 0x1p-7 * (1 + 0x1p-8) * 1.01 * big - 3.0 * greedy_screen::kTiny + tie[r];
      if (std::isfinite(cut)) keep_from[r] = std::max(keep_from[r], cut);  // never keeps fewer than needed
    }
  }
  std::vector<int64_t> start(m + 1, 0);
  for (int t = 0; t < nthreads; ++t)
    for (const auto& c : states[t].kept)
      if (c.upper >= keep_from[c.row]) ++start[c.row + 1];
  for (int64_t r = 0; r < m; ++r) start[r + 1] += start[r];
  std::vector<int32_t> tokens(start[m]);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int t = 0; t < nthreads; ++t)
      for (const auto& c : states[t].kept)
        if (c.upper >= keep_from[c.row]) tokens[fill[c.row]++] = c.token;
  }
  int64_t computed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : computed)
  {
    std::vector<float> values;
#pragma omp for schedule(dynamic, 8)
    for (int64_t r = 0; r < m; ++r) {
      if (bad[r]) {
        out[r] = -1;
        continue;
      }
      int32_t* first = tokens.data() + start[r];
      const int64_t count = start[r + 1] - start[r];
      std::sort(first, first + count);  // ascending: the first of equal maxima wins
      values.resize(count);
      computed += count;
      exact(r, first, count, values.data());
      int64_t best = -1;
      float best_value = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        if (std::isnan(values[j])) {
          best = -1;
          break;
        }
        if (best < 0 || values[j] > best_value) best = first[j], best_value = values[j];
      }
      out[r] = best;
    }
  }
  return computed;
}
