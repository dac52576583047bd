// Spans of blocks for the tiled path (prompt chunks, shared-prefix decodes): up to kSpanKeys keys
// from consecutive blocks per online-softmax step. The span's shape and its key transpose serve
// both walks; the rest of this file is the AVX-512 walk (head sizes a multiple of 16), in 6-row x
// 64-column register tiles. The 8-wide walk (AVX2, paged_attention_tiled.h) uses 6 x 16 tiles.
//
// Why: a block-at-a-time walk pays a softmax step per row for every 16-token block: a horizontal
// max, an exp for the rescale factor, the masking pass and a horizontal sum, plus reloading and
// rescaling each row's weighted sums for P·V. On the shapes of prefix-cache hits (W3: 32-token
// suffixes over a 1024-token prefix, and decodes sharing that prefix) that was as much time as the
// products, ~100 GFLOP/s on cores with ~230 GFLOP/s of FMA; on AVX2 (Zen 3) a fresh 1056-token
// prompt's attention ran at ~67 GFLOP/s of ~200. A 64-key span pays those once per 64 keys and
// rows that see the whole span skip the masking, and on AVX-512 the wider tiles load less per FMA:
// a score tile is 6 rows x 64 keys (24 zmm accumulators; per dim 4 key loads and 6 broadcasts for
// 24 FMAs), a P·V tile 6 rows x 64 dims over the span's tokens. Sums are float32 as before; only
// their grouping changes.
#pragma once
#include "paged_attention_common.h"

#include <type_traits>

#ifdef PS_HAVE_AVX2
namespace {

constexpr int64_t kSpanKeys = 64;

// blocks per span, and the span's width rounded up to whole 16-key vectors (the stride of the
// transposed keys and of the score rows)
inline int64_t span_blocks(int64_t BS) { return std::max<int64_t>(1, kSpanKeys / BS); }
inline int64_t span_width(int64_t BS) { return (span_blocks(BS) * BS + 15) / 16 * 16; }

// KT[d * SW + t] = key t of the span (token t % BS of block t / BS, rows `stride` apart) for t < nk,
// 0 for t in [nk, SW)
template <typename T>
inline void transpose_span_keys(const T* const* kblk, int64_t BS, int64_t stride, int64_t nk, int64_t D, int64_t SW,
                                float* KT) {
  for (int64_t t0 = 0; t0 < SW; t0 += 8) {
    const T* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = t0 + j < nk ? kblk[(t0 + j) / BS] + (t0 + j) % BS * stride : nullptr;
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = rows[j] != nullptr ? load8(rows[j] + d0) : _mm256_setzero_ps();
      transpose8x8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(KT + (d0 + j) * SW + t0, r[j]);
    }
  }
}

// W[p * SW + t] = the 32-bit word of dims (2p, 2p + 1) of bfloat16 token t of the span (token t % BS
// of block t / BS, rows `stride` apart) for t < nk, 0 for t in [nk, SW): the rows' words transposed,
// 8 x 8 at a time (the AMX path's keys and values, the vdpbf16ps walk's keys)
inline void transpose_span_pairs(const uint16_t* const* blk, int64_t BS, int64_t stride, int64_t nk, int64_t D,
                                 int64_t SW, uint32_t* W) {
  for (int64_t t0 = 0; t0 < SW; t0 += 8) {
    const uint16_t* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = t0 + j < nk ? blk[(t0 + j) / BS] + (t0 + j) % BS * stride : nullptr;
    for (int64_t p0 = 0; p0 < D / 2; p0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = rows[j] != nullptr ? _mm256_loadu_ps(reinterpret_cast<const float*>(rows[j] + 2 * p0)) : _mm256_setzero_ps();
      transpose8x8(r);  // (moves 32-bit lanes, whatever they hold)
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(W + (p0 + j) * SW + t0), r[j]);
    }
  }
}

// The span at block b0 (nb blocks): where each block's K and V rows of the kv head at element
// offset hoff start, for both walks.
template <typename T>
inline void span_block_rows(const T* kc, const T* vc, const int64_t* table, int64_t b0, int64_t nb, int64_t hoff,
                            const Shape& s, const T** kblk, const T** vblk) {
  const int64_t block_elems = s.BS * s.KVH * s.D;
  for (int64_t j = 0; j < nb; ++j) {
    kblk[j] = kc + table[b0 + j] * block_elems + hoff;
    vblk[j] = vc + table[b0 + j] * block_elems + hoff;
  }
}

}  // namespace
#endif

#ifdef PS_HAVE_AVX512
namespace {

// whether the 16-wide span walk takes this shape (else the 8-wide one, paged_attention_tiled.h)
inline bool span_path(const Shape& s) { return s.D % 16 == 0; }

// The register tiles name every accumulator (see the note in paged_attention_tiled.h): row i of
// a tile holds a##i##0 .. a##i##3, 16 columns each. These macros, shared with the vdpbf16ps tiles
// (paged_attention_dot.h), run X(i) for every row and declare, load and store the accumulators of
// row i for a tile of NR rows and W (<= 4) vectors.
#define PS_SPAN_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PS_TILE_ZERO(i) \
  __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0;
// the accumulators = scale * the W vectors at src (a row's running sums rescaled by its alpha)
#define PS_TILE_LOAD_SCALED(i, W, src, scale)                                  \
  PS_TILE_ZERO(i)                                                              \
  if (NR > i) {                                                                \
    const __m512 al = _mm512_set1_ps(scale);                                   \
    const float* ar = (src);                                                   \
    a##i##0 = _mm512_mul_ps(_mm512_loadu_ps(ar), al);                          \
    if (W > 1) a##i##1 = _mm512_mul_ps(_mm512_loadu_ps(ar + 16), al);          \
    if (W > 2) a##i##2 = _mm512_mul_ps(_mm512_loadu_ps(ar + 32), al);          \
    if (W > 3) a##i##3 = _mm512_mul_ps(_mm512_loadu_ps(ar + 48), al);          \
  }
#define PS_TILE_STORE(i, W, dst)                           \
  if (NR > i) {                                            \
    float* o_ = (dst);                                     \
    _mm512_storeu_ps(o_, a##i##0);                         \
    if (W > 1) _mm512_storeu_ps(o_ + 16, a##i##1);         \
    if (W > 2) _mm512_storeu_ps(o_ + 32, a##i##2);         \
    if (W > 3) _mm512_storeu_ps(o_ + 48, a##i##3);         \
  }

// s[r * SW + c] = sum_d q[r][d] * KT[d][c] for NR <= 6 rows and the 16 * NK <= 64 columns from KT
template <int NR, int NK>
inline void span_scores_tile(const float* q, int64_t D, const float* KT, int64_t SW, float* s) {
  PS_SPAN_ROWS(PS_TILE_ZERO)
  for (int64_t d = 0; d < D; ++d) {
    const float* kt = KT + d * SW;
    __m512 k0 = _mm512_loadu_ps(kt), k1 = k0, k2 = k0, k3 = k0;
    if (NK > 1) k1 = _mm512_loadu_ps(kt + 16);
    if (NK > 2) k2 = _mm512_loadu_ps(kt + 32);
    if (NK > 3) k3 = _mm512_loadu_ps(kt + 48);
    PS_KEEP16(k0);
    PS_KEEP16(k1);
    PS_KEEP16(k2);
    PS_KEEP16(k3);
#define PS_FMA(i)                                               \
  if (NR > i) {                                                 \
    const __m512 b = _mm512_set1_ps(q[i * D + d]);              \
    a##i##0 = _mm512_fmadd_ps(b, k0, a##i##0);                  \
    if (NK > 1) a##i##1 = _mm512_fmadd_ps(b, k1, a##i##1);      \
    if (NK > 2) a##i##2 = _mm512_fmadd_ps(b, k2, a##i##2);      \
    if (NK > 3) a##i##3 = _mm512_fmadd_ps(b, k3, a##i##3);      \
  }
    PS_SPAN_ROWS(PS_FMA)
#undef PS_FMA
  }
#define PS_STORE(i) PS_TILE_STORE(i, NK, s + i * SW)
  PS_SPAN_ROWS(PS_STORE)
#undef PS_STORE
}

// acc[r][c .. c + 16 NV) = alpha[r] * acc + sum_{t < n} p[r][t] * v_t[c ..] for NR <= 6 rows, token t
// of the span being row t % BS of block t / BS (at vblk[t / BS], rows `stride` apart)
template <int NR, int NV, typename T>
inline void span_pv_tile(float* acc, int64_t D, const float* alpha, const float* p, int64_t ldP, const T* const* vblk,
                         int64_t BS, int64_t stride, int64_t n, int64_t c) {
#define PS_LOAD(i) PS_TILE_LOAD_SCALED(i, NV, acc + i * D + c, alpha[i])
  PS_SPAN_ROWS(PS_LOAD)
#undef PS_LOAD
  int64_t t = 0;
  for (int64_t j = 0; t < n; ++j) {
    const T* v = vblk[j] + c;
    for (const int64_t tn = std::min(n, t + BS); t < tn; ++t, v += stride) {
      __m512 v0 = load16(v), v1 = v0, v2 = v0, v3 = v0;
      if (NV > 1) v1 = load16(v + 16);
      if (NV > 2) v2 = load16(v + 32);
      if (NV > 3) v3 = load16(v + 48);
      PS_KEEP16(v0);
      PS_KEEP16(v1);
      PS_KEEP16(v2);
      PS_KEEP16(v3);
#define PS_FMA(i)                                               \
  if (NR > i) {                                                 \
    const __m512 b = _mm512_set1_ps(p[i * ldP + t]);            \
    a##i##0 = _mm512_fmadd_ps(b, v0, a##i##0);                  \
    if (NV > 1) a##i##1 = _mm512_fmadd_ps(b, v1, a##i##1);      \
    if (NV > 2) a##i##2 = _mm512_fmadd_ps(b, v2, a##i##2);      \
    if (NV > 3) a##i##3 = _mm512_fmadd_ps(b, v3, a##i##3);      \
  }
      PS_SPAN_ROWS(PS_FMA)
#undef PS_FMA
    }
  }
#define PS_STORE(i) PS_TILE_STORE(i, NV, acc + i * D + c)
  PS_SPAN_ROWS(PS_STORE)
#undef PS_STORE
}

constexpr int64_t kSpanTileRows = 6;

// Calls f(NR, NV) for run-time nr <= 6 rows and nv <= 4 vectors (score columns or dims), both
// as std::integral_constant, so that each (NR, NV) runs its own fully unrolled register tile.
template <typename F>
inline void with_tile_shape(int64_t nr, int64_t nv, F&& f) {
  auto rows = [&](auto NV) {
    switch (nr) {
      case 6: return f(std::integral_constant<int, 6>{}, NV);
      case 5: return f(std::integral_constant<int, 5>{}, NV);
      case 4: return f(std::integral_constant<int, 4>{}, NV);
      case 3: return f(std::integral_constant<int, 3>{}, NV);
      case 2: return f(std::integral_constant<int, 2>{}, NV);
      default: return f(std::integral_constant<int, 1>{}, NV);
    }
  };
  switch (nv) {
    case 4: return rows(std::integral_constant<int, 4>{});
    case 3: return rows(std::integral_constant<int, 3>{});
    case 2: return rows(std::integral_constant<int, 2>{});
    default: return rows(std::integral_constant<int, 1>{});
  }
}

// scores of all `rows` rows over the span's first `cols` columns (a multiple of 16)
inline void span_scores(const float* q, int64_t rows, int64_t D, const float* KT, int64_t SW, int64_t cols, float* s) {
  for (int64_t c = 0; c < cols; c += 64) {
    const int64_t nk = std::min<int64_t>(4, (cols - c) / 16);
    for (int64_t r = 0; r < rows; r += kSpanTileRows) {
      const float* qr = q + r * D;
      const float* kt = KT + c;
      float* sr = s + r * SW + c;
      with_tile_shape(std::min(kSpanTileRows, rows - r), nk, [&](auto NR, auto NK) {
        span_scores_tile<decltype(NR)::value, decltype(NK)::value>(qr, D, kt, SW, sr);
      });
    }
  }
}

// P·V of all rows; rows are in query order, so a tile's last row sees the most keys and the
// others' extra probabilities are 0
template <typename T>
inline void span_pv(float* acc, int64_t rows, int64_t D, const float* alpha, const float* p, int64_t SW,
                    const T* const* vblk, int64_t BS, int64_t stride, const int64_t* n_of) {
  for (int64_t r = 0; r < rows; r += kSpanTileRows) {
    const int64_t nr = std::min(kSpanTileRows, rows - r), n = n_of[r + nr - 1];
    if (n <= 0) continue;
    for (int64_t c = 0; c < D; c += 64) {
      const int64_t nv = std::min<int64_t>(4, (D - c) / 16);
      float* ar = acc + r * D;
      const float *al = alpha + r, *pr = p + r * SW;
      with_tile_shape(nr, nv, [&](auto NR, auto NV) {
        span_pv_tile<decltype(NR)::value, decltype(NV)::value>(ar, D, al, pr, SW, vblk, BS, stride, n, c);
      });
    }
  }
}

// One online-softmax step over the first n of a row's scores sr[0, SW) (n >= 1): updates the
// running max m and normaliser l, turns scores [0, n) into probabilities and the rest into 0,
// and returns the factor that rescales what was summed before.
inline float softmax_span(float* sr, int64_t SW, int64_t n, float& m, float& l) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t c = 0; c < SW; c += 16) mx = _mm512_mask_max_ps(mx, lanes_below(n - c), mx, _mm512_loadu_ps(sr + c));
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx));
  // (exp16 of a broadcast, not std::exp: no library call per row and span)
  const float alpha = m == kNegInf ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - mnew)));
  const __m512 vm = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < SW; c += 16) {
    const __m512 pv = _mm512_maskz_mov_ps(lanes_below(n - c), exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), vm)));
    _mm512_storeu_ps(sr + c, pv);
    sum = _mm512_add_ps(sum, pv);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mnew;
  return alpha;
}

// Adds blocks [blk0, blk1) of `table` (tokens [blk0*BS, end) of the context, for the kv head at
// element offset hoff of a token row) to the rows' state st (a TileState built with width
// span_width(BS)), a span of blocks at a time. fill_n(t0, nk) sets st.n_of[r], the keys of the
// nk-key span at token t0 that row r sees (<= 0: none).
template <typename State, typename T, typename FillN>
void span_walk(State& st, const T* kc, const T* vc, const int64_t* table, int64_t blk0, int64_t blk1, int64_t end,
               int64_t hoff, const Shape& s, FillN fill_n) {
  const int64_t D = s.D, RK = st.RK, stride = s.KVH * D, NB = span_blocks(s.BS), SW = span_width(s.BS);
  const T* kblk[kSpanKeys];
  const T* vblk[kSpanKeys];
  for (int64_t b0 = blk0; b0 < blk1; b0 += NB) {
    const int64_t nb = std::min(NB, blk1 - b0), t0 = b0 * s.BS, nk = std::min(nb * s.BS, end - t0);
    span_block_rows(kc, vc, table, b0, nb, hoff, s, kblk, vblk);
    fill_n(t0, nk);
    transpose_span_keys(kblk, s.BS, stride, nk, D, SW, st.KT);
    span_scores(st.qf, RK, D, st.KT, SW, (nk + 15) / 16 * 16, st.sp);
    for (int64_t r = 0; r < RK; ++r) {
      float* sr = st.sp + r * SW;
      const int64_t n = st.n_of[r];
      if (n <= 0) {
        std::fill(sr, sr + SW, 0.f);
        st.alpha[r] = 1.f;
        continue;
      }
      st.alpha[r] = softmax_span(sr, SW, n, st.m[r], st.l[r]);
    }
    span_pv(st.acc, RK, D, st.alpha, st.sp, SW, vblk, s.BS, stride, st.n_of);
  }
}

}  // namespace
#endif
