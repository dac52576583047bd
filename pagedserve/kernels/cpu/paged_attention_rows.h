// The row-at-a-time path of the CPU paged-attention kernel: each (query, head) row computes its
// own scores and P·V. It serves decodes (one or a few rows per kv head), where rearranging a
// block for a tiled product would cost more than it saves, and head sizes that are not a
// multiple of 8 (the scalar version).
#pragma once
#include "paged_attention_common.h"

namespace {

template <typename T>
void item_scalar(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t q_first_pos, const Rows& rs,
                 const Shape& s, T* out, float* work) {
  const int64_t D = s.D, R = rs.count();
  float* qf = work;         // [R, D]
  float* acc = qf + R * D;  // [R, D]
  float* sc = acc + R * D;  // [BS]
  std::vector<Row> rows(R);
  for (int64_t r = 0; r < R; ++r) {
    const T* qr = q + (rs.query(r) * s.H + rs.head(r)) * D;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = load1(qr + d) * s.scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    rows[r] = Row{kNegInf, 0.f, acc + r * D};
  }
  const int64_t last = q_first_pos + rs.qn - 1;
  for (int64_t t0 = 0; t0 <= last; t0 += s.BS) {
    const int64_t base = table[t0 / s.BS] * s.BS;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = std::min(s.BS, q_first_pos + rs.query(r) + 1 - t0);  // causal: keys up to own position
      if (n <= 0) continue;
      const int64_t kh = rs.kv_head(r);
      float bm = kNegInf;
      for (int64_t t = 0; t < n; ++t) {
        const T* k = kc + ((base + t) * s.KVH + kh) * D;
        float v = 0.f;
        for (int64_t d = 0; d < D; ++d) v += qf[r * D + d] * load1(k + d);
        sc[t] = v;
        bm = std::max(bm, v);
      }
      Row& row = rows[r];
      const float m = std::max(row.m, bm), alpha = std::exp(row.m - m);
      row.l *= alpha;
      for (int64_t d = 0; d < D; ++d) row.acc[d] *= alpha;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(sc[t] - m);
        row.l += p;
        const T* v = vc + ((base + t) * s.KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) row.acc[d] += p * load1(v + d);
      }
      row.m = m;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    T* o = out + (rs.query(r) * s.H + rs.head(r)) * D;
    for (int64_t d = 0; d < D; ++d) store1(o + d, rows[r].acc[d] / rows[r].l);
  }
}

#ifdef PS_HAVE_AVX2
// acc[0:8*NV] = alpha * acc + sum_t p[t] * v_t[off:off+8*NV] over n tokens (rows `stride` apart).
// The NV accumulators stay in registers and each token adds one independent FMA to every one of
// them, so the FMA latency chains overlap.
template <int NV, typename T>
inline void accumulate_pv(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n) {
  __m256 a[NV];
  const __m256 va = _mm256_set1_ps(alpha);
  for (int c = 0; c < NV; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), va);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(pt, load8(v + t * stride + 8 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

#ifdef PS_HAVE_AVX512
// The same over 16-wide vectors (D a multiple of 16): half the FMAs and loads per token.
template <int NV, typename T>
inline void accumulate_pv16(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n) {
  __m512 a[NV];
  const __m512 va = _mm512_set1_ps(alpha);
  for (int c = 0; c < NV; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), va);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(pt, load16(v + t * stride + 16 * c), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

template <typename T>
inline void accumulate_pv_any(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n,
                              int64_t DV) {
#ifdef PS_HAVE_AVX512
  if (DV % 2 == 0 && DV <= 16) {  // D = 16 .. 128 in 16-wide vectors, all in registers
    switch (DV / 2) {
      case 8: return accumulate_pv16<8>(acc, alpha, p, v, stride, n);
      case 7: return accumulate_pv16<7>(acc, alpha, p, v, stride, n);
      case 6: return accumulate_pv16<6>(acc, alpha, p, v, stride, n);
      case 5: return accumulate_pv16<5>(acc, alpha, p, v, stride, n);
      case 4: return accumulate_pv16<4>(acc, alpha, p, v, stride, n);
      case 3: return accumulate_pv16<3>(acc, alpha, p, v, stride, n);
      case 2: return accumulate_pv16<2>(acc, alpha, p, v, stride, n);
      default: return accumulate_pv16<1>(acc, alpha, p, v, stride, n);
    }
  }
#endif
  for (int64_t c = 0; c < DV; c += 8) {
    float* a = acc + 8 * c;
    const T* vc = v + 8 * c;
    switch (std::min<int64_t>(8, DV - c)) {
      case 8: accumulate_pv<8>(a, alpha, p, vc, stride, n); break;
      case 7: accumulate_pv<7>(a, alpha, p, vc, stride, n); break;
      case 6: accumulate_pv<6>(a, alpha, p, vc, stride, n); break;
      case 5: accumulate_pv<5>(a, alpha, p, vc, stride, n); break;
      case 4: accumulate_pv<4>(a, alpha, p, vc, stride, n); break;
      case 3: accumulate_pv<3>(a, alpha, p, vc, stride, n); break;
      case 2: accumulate_pv<2>(a, alpha, p, vc, stride, n); break;
      default: accumulate_pv<1>(a, alpha, p, vc, stride, n); break;
    }
  }
}

// Per K/V block, three passes over the item's rows: all scores, then all softmax updates, then
// all P·V sums. Rows are independent, so each pass is a set of independent dependency chains the
// CPU overlaps; doing one row end to end instead serialises dot -> max -> exp -> FMA chains and
// ran at an eighth of the FMA rate.
// With `state` (a decode whose first blk0 blocks the shared-prefix pass already summed), each row
// starts from that pass's max, normaliser and sums, at state[head * (D + 2)], and reads only the
// blocks from blk0 on.
template <typename T>
void item_avx2(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t q_first_pos, const Rows& rs,
               const Shape& s, T* out, float* work, int64_t blk0 = 0, const float* state = nullptr) {
  const int64_t D = s.D, DV = D / 8, R = rs.count(), row_stride = s.KVH * D;
  const int64_t BS8 = (s.BS + 7) / 8 * 8;
  float* qf = work;                // [R, D] scaled queries
  float* acc = qf + R * D;         // [R, D]
  float* sp = acc + R * D;         // [R, BS8] scores, then probabilities
  std::vector<Row> rows(R);
  std::vector<int64_t> n_of(R);
  std::vector<float> alpha(R);
  const __m256 vscale = _mm256_set1_ps(s.scale);
  for (int64_t r = 0; r < R; ++r) {
    const T* qr = q + (rs.query(r) * s.H + rs.head(r)) * D;
    for (int64_t c = 0; c < DV; ++c) _mm256_storeu_ps(qf + r * D + 8 * c, _mm256_mul_ps(load8(qr + 8 * c), vscale));
    if (state != nullptr) {
      const float* st = state + rs.head(r) * (D + 2);
      std::copy(st + 2, st + 2 + D, acc + r * D);
      rows[r] = Row{st[0], st[1], acc + r * D};
    } else {
      std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
      rows[r] = Row{kNegInf, 0.f, acc + r * D};
    }
  }
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t last = q_first_pos + rs.qn - 1;
  for (int64_t t0 = blk0 * s.BS; t0 <= last; t0 += s.BS) {
    const T* block_k = kc + table[t0 / s.BS] * s.BS * row_stride;  // token t, kv head kh at + t*row_stride + kh*D
    const T* block_v = vc + table[t0 / s.BS] * s.BS * row_stride;
    // The next block is somewhere else in the pool. Its lines are requested a few at a time
    // between the steps of this block's compute, so memory keeps streaming while the FMAs run:
    // requesting the whole block up front stalls on the full miss queues and leaves the memory
    // idle during the compute that follows (decode ran at ~60 % of stream bandwidth that way).
    BlockPrefetch<T> pf;
    if (t0 + s.BS <= last) {
      const int64_t nb = table[t0 / s.BS + 1] * s.BS * row_stride;
      pf = BlockPrefetch(kc + nb, vc + nb, s.BS, row_stride, rs.kv_head(0) * D, (rs.kv_head(R - 1) + 1) * D,
                         R * ((s.BS + 7) / 8) + R);
    }
    // 1. scores q·k for every row's visible keys of this block (causal: up to the row's own position)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = std::min(s.BS, q_first_pos + rs.query(r) + 1 - t0);
      n_of[r] = n;
      if (n <= 0) continue;
      const T* kb = block_k + rs.kv_head(r) * D;
      const float* qr = qf + r * D;
      for (int64_t c0 = 0; c0 < n; c0 += 8) {
        pf.step();
        const int64_t cnt = std::min<int64_t>(8, n - c0);
        // lanes past the valid keys reuse the chunk's first row (real memory) and are masked below,
        // so the inner loop always runs 8 wide and unrolls
        const T* kr[8];
        for (int j = 0; j < 8; ++j) kr[j] = kb + (c0 + (j < cnt ? j : 0)) * row_stride;
        __m256 dots[8];
#ifdef PS_HAVE_AVX512
        if (DV % 2 == 0) {  // 16-wide products, each folded to 8 lanes for the transpose below
          __m512 d16[8];
          for (int j = 0; j < 8; ++j) d16[j] = _mm512_setzero_ps();
          for (int64_t c = 0; c < DV / 2; ++c) {
            const __m512 qv = _mm512_loadu_ps(qr + 16 * c);
            for (int j = 0; j < 8; ++j) d16[j] = _mm512_fmadd_ps(qv, load16(kr[j] + 16 * c), d16[j]);
          }
          for (int j = 0; j < 8; ++j)
            dots[j] = _mm256_add_ps(_mm512_castps512_ps256(d16[j]), _mm512_extractf32x8_ps(d16[j], 1));
        } else
#endif
        {
          for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
          for (int64_t c = 0; c < DV; ++c) {
            const __m256 qv = _mm256_loadu_ps(qr + 8 * c);
            for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qv, load8(kr[j] + 8 * c), dots[j]);
          }
        }
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(cnt)), _CMP_LT_OQ);
        _mm256_storeu_ps(sp + r * BS8 + c0, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), transpose_sum8(dots), valid));
      }
    }
    // 2. online softmax: new running max, rescale factor for what was summed so far, probabilities
    for (int64_t r = 0; r < R; ++r)
      if (n_of[r] > 0) alpha[r] = softmax_step(sp + r * BS8, (n_of[r] + 7) / 8 * 8, rows[r].m, rows[r].l);
    // 3. acc = alpha * acc + P·V
    for (int64_t r = 0; r < R; ++r)
      if (pf.step(), n_of[r] > 0)
        accumulate_pv_any(rows[r].acc, alpha[r], sp + r * BS8, block_v + rs.kv_head(r) * D, row_stride, n_of[r], DV);
  }
  for (int64_t r = 0; r < R; ++r) {
    T* o = out + (rs.query(r) * s.H + rs.head(r)) * D;
    const float inv = 1.f / rows[r].l;
    for (int64_t d = 0; d < D; ++d) store1(o + d, rows[r].acc[d] * inv);
  }
}
#endif

}  // namespace
