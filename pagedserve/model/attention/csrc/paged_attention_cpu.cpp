// Paged attention for the CPU, reading K/V in place from the block pool (no gather copy).
//
// One kernel serves decodes and prefill chunks alike: sequence b has qn = q_starts[b+1] -
// q_starts[b] query tokens, the last qn positions of its context of seq_lens[b] tokens, and each
// attends causally to its context. (A decode is qn = 1; a prompt chunk after a prefix-cache hit
// or an earlier chunk is qn > 1 with earlier context.) The new tokens' K/V are already in the pool.
//
// Work item = (sequence, kv head, up to kQueryChunk queries). Within an item the context is walked
// block by block with an online softmax, so each K/V block is read from memory once for all the
// queries and the query heads that share the kv head (GQA), and the scores never need a buffer
// the size of the context. Accumulation is float32 whatever the storage type.
//
// The float32/bfloat16 fast path uses AVX2+FMA (8 key scores per vector, a polynomial exp); other
// head sizes and CPUs take a scalar path with the same structure. Plain C ABI, called through
// ctypes, so it builds in a couple of seconds without torch's headers.
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

namespace {

constexpr int64_t kQueryChunk = 8;
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

// ---- scalar path (any head size, any CPU) --------------------------------------------------
// Rows of an item: (query i, head h) for the heads of kv heads [kh0, kh1), query-major.
struct Rows {
  int64_t qn, h0, HH, G;  // HH heads per query, starting at head h0
  int64_t count() const { return qn * HH; }
  int64_t query(int64_t r) const { return r / HH; }
  int64_t head(int64_t r) const { return h0 + r % HH; }
  int64_t kv_head(int64_t r) const { return head(r) / G; }
};

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
// ---- AVX2 path (head size a multiple of 8) ------------------------------------------------
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// exp for arguments <= 0 (scores minus their running max): Cephes-style range reduction and a
// degree-6 polynomial, about 1 ulp; inputs below -87 flush to ~1e-38, which the caller masks.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

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

template <typename T>
inline void accumulate_pv_any(float* acc, float alpha, const float* p, const T* v, int64_t stride, int64_t n,
                              int64_t DV) {
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
template <typename T>
void item_avx2(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t q_first_pos, const Rows& rs,
               const Shape& s, T* out, float* work) {
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
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    rows[r] = Row{kNegInf, 0.f, acc + r * D};
  }
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t last = q_first_pos + rs.qn - 1;
  for (int64_t t0 = 0; t0 <= last; t0 += s.BS) {
    const T* block_k = kc + table[t0 / s.BS] * s.BS * row_stride;  // token t, kv head kh at + t*row_stride + kh*D
    const T* block_v = vc + table[t0 / s.BS] * s.BS * row_stride;
    if (t0 + s.BS <= last) {  // the next block is somewhere else in the pool: fetch it while this one computes
      const int64_t nb = table[t0 / s.BS + 1] * s.BS * row_stride, h0 = rs.kv_head(0), h1 = rs.kv_head(R - 1) + 1;
      for (int64_t t = 0; t < s.BS; ++t)
        for (int64_t off = h0 * D * sizeof(T); off < h1 * D * static_cast<int64_t>(sizeof(T)); off += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + nb + t * row_stride) + off, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vc + nb + t * row_stride) + off, _MM_HINT_T0);
        }
    }
    // 1. scores q·k for every row's visible keys of this block (causal: up to the row's own position)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = std::min(s.BS, q_first_pos + rs.query(r) + 1 - t0);
      n_of[r] = n;
      if (n <= 0) continue;
      const T* kb = block_k + rs.kv_head(r) * D;
      const float* qr = qf + r * D;
      for (int64_t c0 = 0; c0 < n; c0 += 8) {
        const int64_t cnt = std::min<int64_t>(8, n - c0);
        // lanes past the valid keys reuse the chunk's first row (real memory) and are masked below,
        // so the inner loop always runs 8 wide and unrolls
        const T* kr[8];
        for (int j = 0; j < 8; ++j) kr[j] = kb + (c0 + (j < cnt ? j : 0)) * row_stride;
        __m256 dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < DV; ++c) {
          const __m256 qv = _mm256_loadu_ps(qr + 8 * c);
          for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(qv, load8(kr[j] + 8 * c), dots[j]);
        }
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(cnt)), _CMP_LT_OQ);
        _mm256_storeu_ps(sp + r * BS8 + c0, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), transpose_sum8(dots), valid));
      }
    }
    // 2. online softmax: new running max, rescale factor for what was summed so far, probabilities
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = n_of[r];
      if (n <= 0) continue;
      float* sr = sp + r * BS8;
      __m256 mx = _mm256_set1_ps(kNegInf);
      for (int64_t c0 = 0; c0 < n; c0 += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + c0));
      Row& row = rows[r];
      const float m = std::max(row.m, hmax8(mx));
      alpha[r] = row.m == kNegInf ? 0.f : std::exp(row.m - m);
      const __m256 vm = _mm256_set1_ps(m);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c0 = 0; c0 < n; c0 += 8) {
        const __m256 sv = _mm256_loadu_ps(sr + c0);
        // masked lanes hold -inf: exp8 flushes them to ~1e-38, the compare makes them exactly 0
        const __m256 pv = _mm256_and_ps(exp8(_mm256_sub_ps(sv, vm)), _mm256_cmp_ps(sv, _mm256_set1_ps(kNegInf), _CMP_NEQ_OQ));
        _mm256_storeu_ps(sr + c0, pv);
        sum = _mm256_add_ps(sum, pv);
      }
      row.l = row.l * alpha[r] + hsum8(sum);
      row.m = m;
    }
    // 3. acc = alpha * acc + P·V
    for (int64_t r = 0; r < R; ++r)
      if (n_of[r] > 0)
        accumulate_pv_any(rows[r].acc, alpha[r], sp + r * BS8, block_v + rs.kv_head(r) * D, row_stride, n_of[r], DV);
  }
  for (int64_t r = 0; r < R; ++r) {
    T* o = out + (rs.query(r) * s.H + rs.head(r)) * D;
    const float inv = 1.f / rows[r].l;
    for (int64_t d = 0; d < D; ++d) store1(o + d, rows[r].acc[d] * inv);
  }
}
#endif

template <typename T>
void attention(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* seq_lens,
               const int64_t* q_starts, T* out, int64_t B, const Shape& s, int nthreads) {
  // An item covers every kv head of a query chunk, so it walks each K/V block as one contiguous
  // piece of memory. Only when there are too few items to keep the threads busy (one long
  // sequence decoding) are the kv heads split across items.
  int64_t n_chunks = 0;
  for (int64_t b = 0; b < B; ++b) n_chunks += (q_starts[b + 1] - q_starts[b] + kQueryChunk - 1) / kQueryChunk;
  const int64_t want = 4 * static_cast<int64_t>(nthreads);
  const int64_t kv_split = n_chunks >= want ? 1 : std::min(s.KVH, (want + n_chunks - 1) / std::max<int64_t>(n_chunks, 1));
  const int64_t kv_per_item = (s.KVH + kv_split - 1) / kv_split;
  const int64_t G = s.H / s.KVH;
  struct Item {
    int64_t b, i0, i1, kh0, kh1;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qn = q_starts[b + 1] - q_starts[b];
    for (int64_t i0 = 0; i0 < qn; i0 += kQueryChunk)
      for (int64_t kh0 = 0; kh0 < s.KVH; kh0 += kv_per_item)
        items.push_back({b, i0, std::min(qn, i0 + kQueryChunk), kh0, std::min(s.KVH, kh0 + kv_per_item)});
  }
  const size_t work_floats = static_cast<size_t>(kQueryChunk * kv_per_item * G * (2 * s.D + s.BS + 8) + s.BS + 16);
#ifdef PS_HAVE_AVX2
  const bool vec = s.D % 8 == 0;
#endif
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> work(work_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < n_items; ++k) {
      const Item& it = items[k];
      const int64_t qn = q_starts[it.b + 1] - q_starts[it.b];
      const int64_t row0 = q_starts[it.b] + it.i0;
      const T* qp = q + row0 * s.H * s.D;
      T* op = out + row0 * s.H * s.D;
      const int64_t first_pos = seq_lens[it.b] - qn + it.i0;
      const Rows rs{it.i1 - it.i0, it.kh0 * G, (it.kh1 - it.kh0) * G, G};
#ifdef PS_HAVE_AVX2
      if (vec) {
        item_avx2(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
        continue;
      }
#endif
      item_scalar(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
    }
  }
}

}  // namespace

extern "C" {
void paged_attention_f32(const float* q, const float* kc, const float* vc, const int64_t* bt,
                         const int64_t* seq_lens, const int64_t* q_starts, float* out, int64_t B, int64_t H,
                         int64_t KVH, int64_t D, int64_t BS, int64_t MAXB, float scale, int nthreads) {
  attention<float>(q, kc, vc, bt, seq_lens, q_starts, out, B, Shape{H, KVH, D, BS, MAXB, scale}, nthreads);
}
void paged_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                          const int64_t* seq_lens, const int64_t* q_starts, uint16_t* out, int64_t B, int64_t H,
                          int64_t KVH, int64_t D, int64_t BS, int64_t MAXB, float scale, int nthreads) {
  attention<uint16_t>(q, kc, vc, bt, seq_lens, q_starts, out, B, Shape{H, KVH, D, BS, MAXB, scale}, nthreads);
}
// 1 when this build has the vectorised path (for logs and tests)
int paged_attention_vectorized() {
#ifdef PS_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}
}
