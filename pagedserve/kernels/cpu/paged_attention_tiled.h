// The tiled path of the CPU paged-attention kernel, for prompt chunks and shared-prefix decodes
// (AVX2, head size a multiple of 8).
//
// With qn queries, the G heads of a kv head give qn*G rows that all read the same K/V, so it is
// worth rearranging once: K is transposed to KT[d][t] and the scores become a small matrix
// product, 6 rows x 16 keys of accumulators with broadcast queries (no horizontal sums), and P·V
// is 6 rows x 16 dims. Both do ~0.7 loads per FMA instead of ~1.1 plus a transpose-sum per 8
// scores. The context is walked a span of blocks (64 keys) per softmax step
// (paged_attention_span.h): on Zen 3 a fresh 1056-token prompt's attention ran 1.15-1.21x faster
// than with one block (16 keys) per step.
// Built with AVX-512, head sizes that are a multiple of 16 walk the spans in 16-wide tiles instead
// (paged_attention_span.h); the rows' state and the callers here are shared.
#pragma once
#include "paged_attention_common.h"
#include "paged_attention_span.h"
#include "paged_attention_dot.h"

#include <type_traits>

namespace {

#ifdef PS_HAVE_AVX2

// The tiles name each accumulator: GCC kept a __m256 array of 12 in memory and stored every
// element on every iteration, which made the loop store-bound.
#define PS_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

#ifdef PS_HAVE_AVX512
// The 16-wide forms of the two tiles below (16 keys, 16 dims: one zmm per row instead of two ymm),
// which they hand their NK == 2 / NV == 2 cases to on CPUs with AVX-512: half the instructions.
template <int NR>
inline void scores_tile16(const float* q, int64_t D, const float* KT, int64_t W, int64_t k0, float* s, int64_t ldS) {
#define PS_DECL(i) __m512 a##i = _mm512_setzero_ps();
  PS_ROWS(PS_DECL)
#undef PS_DECL
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv = _mm512_loadu_ps(KT + d * W + 8 * k0);
    PS_KEEP16(kv);
#define PS_FMA(i) \
  if (NR > i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kv, a##i);
    PS_ROWS(PS_FMA)
#undef PS_FMA
  }
#define PS_STORE(i) \
  if (NR > i) _mm512_storeu_ps(s + i * ldS + 8 * k0, a##i);
  PS_ROWS(PS_STORE)
#undef PS_STORE
}

template <int NR, typename T>
inline void pv_tile16(float* acc, int64_t D, const float* alpha, const float* p, int64_t ldP, const T* const* vblk,
                      int64_t BS, int64_t stride, int64_t n, int64_t c0) {
#define PS_LOAD(i)                                                                        \
  __m512 a##i = _mm512_setzero_ps();                                                      \
  if (NR > i) a##i = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 8 * c0), _mm512_set1_ps(alpha[i]));
  PS_ROWS(PS_LOAD)
#undef PS_LOAD
  int64_t t = 0;
  for (int64_t j = 0; t < n; ++j) {
    const T* v = vblk[j] + 8 * c0;
    for (const int64_t tn = std::min(n, t + BS); t < tn; ++t, v += stride) {
      __m512 vv = load16(v);
      PS_KEEP16(vv);
#define PS_FMA(i) \
  if (NR > i) a##i = _mm512_fmadd_ps(_mm512_set1_ps(p[i * ldP + t]), vv, a##i);
      PS_ROWS(PS_FMA)
#undef PS_FMA
    }
  }
#define PS_STORE(i) \
  if (NR > i) _mm512_storeu_ps(acc + i * D + 8 * c0, a##i);
  PS_ROWS(PS_STORE)
#undef PS_STORE
}
#endif

// s[r][8*k0 ..] (and the next 8 keys when NK == 2) = sum_d q[r][d] * KT[d][..] for NR <= 6 rows
template <int NR, int NK>
inline void scores_tile(const float* q, int64_t D, const float* KT, int64_t W, int64_t k0, float* s, int64_t ldS) {
#ifdef PS_HAVE_AVX512
  if constexpr (NK == 2) return scores_tile16<NR>(q, D, KT, W, k0, s, ldS);
#endif
#define PS_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
  PS_ROWS(PS_DECL)
  for (int64_t d = 0; d < D; ++d) {
    __m256 k0v = _mm256_loadu_ps(KT + d * W + 8 * k0), k1v = k0v;
    if (NK > 1) k1v = _mm256_loadu_ps(KT + d * W + 8 * k0 + 8);
    PS_KEEP(k0v);
    PS_KEEP(k1v);
#define PS_FMA(i)                                                  \
  if (NR > i) {                                                    \
    const __m256 b = _mm256_broadcast_ss(q + i * D + d);           \
    a##i##0 = _mm256_fmadd_ps(b, k0v, a##i##0);                    \
    if (NK > 1) a##i##1 = _mm256_fmadd_ps(b, k1v, a##i##1);        \
  }
    PS_ROWS(PS_FMA)
#undef PS_FMA
  }
#define PS_STORE(i)                                                                  \
  if (NR > i) {                                                                      \
    _mm256_storeu_ps(s + i * ldS + 8 * k0, a##i##0);                                 \
    if (NK > 1) _mm256_storeu_ps(s + i * ldS + 8 * k0 + 8, a##i##1);                 \
  }
  PS_ROWS(PS_STORE)
#undef PS_STORE
#undef PS_DECL
}

// acc[r][8*c0 ..] (and the next 8 dims when NV == 2) = alpha[r] * acc + sum_{t < n} p[r][t] * v_t[..],
// token t of the span being row t % BS of block t / BS (at vblk[t / BS], rows `stride` apart)
template <int NR, int NV, typename T>
inline void pv_tile(float* acc, int64_t D, const float* alpha, const float* p, int64_t ldP, const T* const* vblk,
                    int64_t BS, int64_t stride, int64_t n, int64_t c0) {
#ifdef PS_HAVE_AVX512
  if constexpr (NV == 2) return pv_tile16<NR>(acc, D, alpha, p, ldP, vblk, BS, stride, n, c0);
#endif
#define PS_LOAD(i)                                                                          \
  __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();                      \
  if (NR > i) {                                                                             \
    const __m256 al = _mm256_set1_ps(alpha[i]);                                             \
    a##i##0 = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + 8 * c0), al);                     \
    if (NV > 1) a##i##1 = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + 8 * c0 + 8), al);     \
  }
  PS_ROWS(PS_LOAD)
#undef PS_LOAD
  int64_t t = 0;
  for (int64_t j = 0; t < n; ++j) {
    const T* v = vblk[j] + 8 * c0;
    for (const int64_t tn = std::min(n, t + BS); t < tn; ++t, v += stride) {
      __m256 v0 = load8(v), v1 = v0;
      if (NV > 1) v1 = load8(v + 8);
      PS_KEEP(v0);
      PS_KEEP(v1);
#define PS_FMA(i)                                                  \
  if (NR > i) {                                                    \
    const __m256 b = _mm256_broadcast_ss(p + i * ldP + t);         \
    a##i##0 = _mm256_fmadd_ps(b, v0, a##i##0);                     \
    if (NV > 1) a##i##1 = _mm256_fmadd_ps(b, v1, a##i##1);         \
  }
      PS_ROWS(PS_FMA)
#undef PS_FMA
    }
  }
#define PS_STORE(i)                                                                  \
  if (NR > i) {                                                                      \
    _mm256_storeu_ps(acc + i * D + 8 * c0, a##i##0);                                 \
    if (NV > 1) _mm256_storeu_ps(acc + i * D + 8 * c0 + 8, a##i##1);                 \
  }
  PS_ROWS(PS_STORE)
#undef PS_STORE
}
#undef PS_ROWS

// Row tiles of kTileRows: 6 rows x 2 vectors is 12 independent FMA chains, enough to cover the
// FMA latency (8 chains left the FMA units idle a third of the time), in 15 of the 16 registers.
constexpr int64_t kTileRows = 6;

template <int NK>
inline void scores_rows(const float* q, int64_t rows, int64_t D, const float* KT, int64_t W, int64_t k0, float* s,
                        int64_t ldS) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) scores_tile<kTileRows, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS);
  switch (rows - r) {
    case 5: scores_tile<5, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS); break;
    case 4: scores_tile<4, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS); break;
    case 3: scores_tile<3, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS); break;
    case 2: scores_tile<2, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS); break;
    case 1: scores_tile<1, NK>(q + r * D, D, KT, W, k0, s + r * ldS, ldS); break;
    default: break;
  }
}

// rows are in query order, so the last row of a tile sees the most keys; the others' extra
// probabilities are 0
template <int NV, typename T>
inline void pv_rows(float* acc, int64_t rows, int64_t D, const float* alpha, const float* p, int64_t ldP,
                    const T* const* vblk, int64_t BS, int64_t stride, const int64_t* n_of, int64_t c0) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    const int64_t n = n_of[r + kTileRows - 1];
    if (n > 0) pv_tile<kTileRows, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0);
  }
  const int64_t n = rows > r ? n_of[rows - 1] : 0;
  if (n <= 0) return;
  switch (rows - r) {
    case 5: pv_tile<5, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0); break;
    case 4: pv_tile<4, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0); break;
    case 3: pv_tile<3, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0); break;
    case 2: pv_tile<2, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0); break;
    case 1: pv_tile<1, NV>(acc + r * D, D, alpha + r, p + r * ldP, ldP, vblk, BS, stride, n, c0); break;
    default: break;
  }
}

// The running state of a set of rows of one kv head, carved out of an item's work buffer:
// scaled queries, weighted sums, scores, transposed keys, max, normaliser, rescale factors and
// the keys of the current block each row sees.
struct TileState {
  int64_t RK;
  bool dot;  // the bfloat16 vdpbf16ps walk (paged_attention_dot.h): queries kept unscaled
  float *qf, *acc, *sp, *KT, *m, *l, *alpha;
  int64_t* n_of;
  TileState(float* work, int64_t rk, int64_t D, int64_t W, bool dot_walk = false) : RK(rk), dot(dot_walk) {
    qf = work;          // [RK, D]
    acc = qf + RK * D;  // [RK, D]
    sp = acc + RK * D;  // [RK, W] scores, then probabilities
    KT = sp + RK * W;   // [D, W]
    m = KT + D * W;     // [RK]
    l = m + RK;         // [RK]
    alpha = l + RK;     // [RK]
    n_of = reinterpret_cast<int64_t*>(alpha + RK + (RK & 1));  // [RK]
  }
  // row r starts empty with the query at qr, scaled (unscaled for the dot walk, which scales
  // the scores)
  template <typename T>
  void start_row(int64_t r, const T* qr, int64_t D, float scale) {
    const __m256 vscale = _mm256_set1_ps(dot ? 1.f : scale);
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(qf + r * D + c, _mm256_mul_ps(load8(qr + c), vscale));
    std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
};

// The width of a TileState's score rows and transposed keys: a span of blocks (both walks).
inline int64_t tile_width(const Shape& s) { return span_width(s.BS); }

// Whether a TileState of this dtype and shape takes the vdpbf16ps walk (paged_attention_dot.h).
template <typename T>
inline bool tile_dot(const Shape& s) {
#ifdef PS_HAVE_BF16_DOT
  return std::is_same_v<T, uint16_t> && dot_path(s);
#else
  (void)s;
  return false;
#endif
}

// Adds blocks [blk0, blk1) of `table` (tokens [blk0*BS, end) of the context, for the kv head at
// element offset hoff of a token row) to the rows' state, built with width tile_width(s), a span
// of blocks (up to kSpanKeys keys) per online-softmax step (why: paged_attention_span.h).
// fill_n(t0, nk) sets n_of[r], how many of the nk keys of the span at token t0 row r sees
// (≤ 0: none). Built with AVX-512, head sizes a multiple of 16 take the 16-wide walk instead.
template <typename T, typename FillN>
void tiled_blocks(TileState& st, const T* kc, const T* vc, const int64_t* table, int64_t blk0, int64_t blk1,
                  int64_t end, int64_t hoff, const Shape& s, FillN fill_n) {
#ifdef PS_HAVE_BF16_DOT
  if constexpr (std::is_same_v<T, uint16_t>)
    if (st.dot) return span_walk_dot(st, kc, vc, table, blk0, blk1, end, hoff, s, fill_n);
#endif
#ifdef PS_HAVE_AVX512
  if (span_path(s)) return span_walk(st, kc, vc, table, blk0, blk1, end, hoff, s, fill_n);
#endif
  const int64_t D = s.D, RK = st.RK, stride = s.KVH * D, NB = span_blocks(s.BS), SW = span_width(s.BS);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), ninf = _mm256_set1_ps(kNegInf);
  const T* kblk[kSpanKeys];
  const T* vblk[kSpanKeys];
  BlockPrefetch<T> pf[kSpanKeys];  // the next span's blocks, requested while this one is summed
  for (int64_t b0 = blk0; b0 < blk1; b0 += NB) {
    const int64_t nb = std::min(NB, blk1 - b0), t0 = b0 * s.BS, nk = std::min(nb * s.BS, end - t0);
    const int64_t next = std::min(NB, blk1 - b0 - nb), cols = (nk + 7) / 8 * 8;  // score columns computed
    span_block_rows(kc, vc, table, b0, nb, hoff, s, kblk, vblk);
    for (int64_t j = 0; j < next; ++j) {
      const int64_t off = table[b0 + nb + j] * s.BS * stride;
      pf[j] = BlockPrefetch<T>(kc + off, vc + off, s.BS, stride, hoff, hoff + D, 2);
    }
    fill_n(t0, nk);
    for (int64_t j = 0; j < next; ++j) pf[j].step();
    transpose_span_keys(kblk, s.BS, stride, nk, D, SW, st.KT);
    for (int64_t k0 = 0; k0 < cols / 8; k0 += 2) {
      if (k0 + 2 <= cols / 8) scores_rows<2>(st.qf, RK, D, st.KT, SW, k0, st.sp, SW);
      else scores_rows<1>(st.qf, RK, D, st.KT, SW, k0, st.sp, SW);
    }
    // online softmax per row over the computed columns; probabilities of keys a row cannot see
    // (and of rows that see none) are exactly 0, so the P·V tiles can run every row of a tile to
    // the tile's longest n
    for (int64_t r = 0; r < RK; ++r) {
      float* sr = st.sp + r * SW;
      const int64_t n = st.n_of[r];
      if (n <= 0) {
        std::fill(sr, sr + cols, 0.f);
        st.alpha[r] = 1.f;
        continue;
      }
      if (n < cols) {
        const __m256 vn = _mm256_set1_ps(static_cast<float>(n));
        for (int64_t c0 = 0; c0 < cols; c0 += 8) {
          const __m256 valid = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(c0))), vn, _CMP_LT_OQ);
          _mm256_storeu_ps(sr + c0, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + c0), valid));
        }
      }
      st.alpha[r] = softmax_step(sr, cols, st.m[r], st.l[r]);
    }
    for (int64_t j = 0; j < next; ++j) pf[j].step();
    for (int64_t c0 = 0; c0 < D / 8; c0 += 2) {
      if (c0 + 2 <= D / 8) pv_rows<2>(st.acc, RK, D, st.alpha, st.sp, SW, vblk, s.BS, stride, st.n_of, c0);
      else pv_rows<1>(st.acc, RK, D, st.alpha, st.sp, SW, vblk, s.BS, stride, st.n_of, c0);
    }
  }
}

// One kv head of an item at a time, all of the context, so its working set (queries, sums,
// transposed keys, scores: ~13 KB for 16 rows of 64) stays in L1 next to the streaming block;
// all kv heads at once had 32 KB of queries and sums alone and ran from L2.
template <typename T>
void kv_head_tiled(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t q_first_pos, int64_t qn,
                   int64_t h_first, int64_t G, const Shape& s, T* out, float* work) {
  const int64_t D = s.D;
  // (a decode here, G >= 8, keeps float32 probabilities past a shared prefix, as on its other paths)
  TileState st(work, qn * G, D, tile_width(s), qn > 1 && tile_dot<T>(s));
  for (int64_t i = 0; i < qn; ++i)
    for (int64_t g = 0; g < G; ++g) st.start_row(i * G + g, q + (i * s.H + h_first + g) * D, D, s.scale);
  const int64_t last = q_first_pos + qn - 1;
  tiled_blocks(st, kc, vc, table, 0, last / s.BS + 1, last + 1, h_first / G * D, s, [&](int64_t t0, int64_t n) {
    for (int64_t i = 0; i < qn; ++i)
      for (int64_t g = 0; g < G; ++g) st.n_of[i * G + g] = std::min(n, q_first_pos + i + 1 - t0);
  });
  for (int64_t i = 0; i < qn; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      T* o = out + (i * s.H + h_first + g) * D;
      const float inv = 1.f / st.l[r];
      for (int64_t d = 0; d < D; ++d) store1(o + d, st.acc[r * D + d] * inv);
    }
}

// Shared-prefix (cascade) decode: the decodes of `members` all start with the same `blocks` full
// blocks of the table (a prefix-cache hit shares them), so their queries, G per kv head and
// sequence, are stacked into one set of rows that reads each shared block once, as tiles. Each
// row's state (max, normaliser, sums) goes to state[(b * H + head) * (D + 2)] for the row path
// to continue from over the sequence's own blocks.
template <typename T>
void shared_prefix_tiled(const T* q, const T* kc, const T* vc, const int64_t* table, const int64_t* q_starts,
                         const int64_t* members, int64_t n_members, int64_t blocks, int64_t kh, const Shape& s,
                         float* state, float* work) {
  const int64_t D = s.D, G = s.H / s.KVH;
  TileState st(work, n_members * G, D, tile_width(s), tile_dot<T>(s));
  for (int64_t j = 0; j < n_members; ++j)
    for (int64_t g = 0; g < G; ++g) st.start_row(j * G + g, q + (q_starts[members[j]] * s.H + kh * G + g) * D, D, s.scale);
  tiled_blocks(st, kc, vc, table, 0, blocks, blocks * s.BS, kh * D, s,
               [&](int64_t, int64_t n) { std::fill(st.n_of, st.n_of + st.RK, n); });
  for (int64_t j = 0; j < n_members; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = j * G + g;
      float* o = state + (members[j] * s.H + kh * G + g) * (D + 2);
      o[0] = st.m[r];
      o[1] = st.l[r];
      std::copy(st.acc + r * D, st.acc + (r + 1) * D, o + 2);
    }
}

template <typename T>
void item_tiled(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t q_first_pos, const Rows& rs,
                const Shape& s, T* out, float* work) {
  for (int64_t h = rs.h0; h < rs.h0 + rs.HH; h += rs.G)
    kv_head_tiled(q, kc, vc, table, q_first_pos, rs.qn, h, rs.G, s, out, work);
}
#endif

}  // namespace
