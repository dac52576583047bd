// The span walk of the tiled path (paged_attention_span.h) for bfloat16 caches on vdpbf16ps
// (AVX512-BF16): prompt chunks and shared-prefix decodes where the CPU has no AMX but issues
// vdpbf16ps as often as a float32 FMA (AMD Zen 4; the GEMM library's probe decides, and
// cpu_kernels.py passes its answer on through paged_attention_set_bf16_dot).
//
// Why: the 16-wide span walk widens every key and value to float32 and spends one FMA per
// (row, key, dim); on Zen 4 it ran prompt chunks at ~130-160 GFLOP/s of the 232 the FMAs give.
// vdpbf16ps multiplies 16 lanes of bfloat16 pairs and adds both products to a float32 lane, so a
// (row, key) score takes D/2 instructions instead of D, and P·V the same over pairs of tokens.
//  - scores: the queries stay bfloat16 (they are: the model's q is a bfloat16 tensor) and
//    unscaled, the keys are packed per span as 32-bit words of dims (2j, 2j + 1) [D/2][SW] (a
//    32-bit transpose of the key rows), and the scale multiplies each finished score. Products
//    are exact, sums float32: only their grouping and the scale's place differ from the float32
//    walk.
//  - P·V: the probabilities are rounded to bfloat16 (2^-9 of each weight, as on the AMX path and
//    in torch's CPU flash attention), the values packed per span as words of tokens (2i, 2i + 1)
//    for each dim [SW/2][D]. The normaliser sums the unrounded probabilities.
// Keys and values past the span's nk tokens are packed as zeros, so the pool's unused slots
// (anything, NaN included) are never read.
#pragma once
#include "paged_attention_span.h"

#if defined(PS_HAVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PS_HAVE_BF16_DOT 1
namespace {

bool use_bf16_dot = false;  // off until cpu_kernels.py sets it from the GEMM library's probe

// whether bfloat16 tiled work takes this walk: head sizes a multiple of 32 (one zmm of values
// packs 32 dims of a token pair)
inline bool dot_path(const Shape& s) { return use_bf16_dot && s.D % 32 == 0; }

// VP[i * D + d] = the word of tokens (2i, 2i + 1) of the span at dim d, for the pairs i < (nk + 1) / 2
// (a token at or past nk: 0)
inline void pack_span_values(const uint16_t* const* vblk, int64_t BS, int64_t stride, int64_t nk, int64_t D,
                             uint32_t* VP) {
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int w = 0; w < 16; ++w) {  // word w: (row a, row b) at dim w (lo) or 16 + w (hi) of a 32-dim chunk
    lo_idx[2 * w] = static_cast<int16_t>(w), lo_idx[2 * w + 1] = static_cast<int16_t>(32 + w);
    hi_idx[2 * w] = static_cast<int16_t>(16 + w), hi_idx[2 * w + 1] = static_cast<int16_t>(48 + w);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  auto row = [&](int64_t t) { return vblk[t / BS] + t % BS * stride; };
  for (int64_t t = 0; t < nk; t += 2) {
    const uint16_t* a = row(t);
    const uint16_t* b = t + 1 < nk ? row(t + 1) : nullptr;
    uint32_t* out = VP + t / 2 * D;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i va = _mm512_loadu_si512(a + d0);
      const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d0, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(out + d0 + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// s[r * SW + c] = scale * sum_j qp[r][j] . KP[j][c] for NR <= 6 rows (query words qp, DP per row)
// and the 16 * NK <= 64 columns from KP
template <int NR, int NK>
inline void dot_scores_tile(const uint32_t* qp, int64_t DP, const uint32_t* KP, int64_t SW, float scale, float* s) {
  PS_SPAN_ROWS(PS_TILE_ZERO)
  for (int64_t j = 0; j < DP; ++j) {
    const uint32_t* kp = KP + j * SW;
    __m512i k0 = _mm512_loadu_si512(kp), k1 = k0, k2 = k0, k3 = k0;
    if (NK > 1) k1 = _mm512_loadu_si512(kp + 16);
    if (NK > 2) k2 = _mm512_loadu_si512(kp + 32);
    if (NK > 3) k3 = _mm512_loadu_si512(kp + 48);
    PS_KEEP16(k0);
    PS_KEEP16(k1);
    PS_KEEP16(k2);
    PS_KEEP16(k3);
#define PS_DOT(i)                                                                            \
  if (NR > i) {                                                                              \
    const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * DP + j]));        \
    a##i##0 = _mm512_dpbf16_ps(a##i##0, b, (__m512bh)k0);                                   \
    if (NK > 1) a##i##1 = _mm512_dpbf16_ps(a##i##1, b, (__m512bh)k1);                       \
    if (NK > 2) a##i##2 = _mm512_dpbf16_ps(a##i##2, b, (__m512bh)k2);                       \
    if (NK > 3) a##i##3 = _mm512_dpbf16_ps(a##i##3, b, (__m512bh)k3);                       \
  }
    PS_SPAN_ROWS(PS_DOT)
#undef PS_DOT
  }
  const __m512 sc = _mm512_set1_ps(scale);
#define PS_STORE(i)                                                              \
  a##i##0 = _mm512_mul_ps(a##i##0, sc), a##i##1 = _mm512_mul_ps(a##i##1, sc);     \
  a##i##2 = _mm512_mul_ps(a##i##2, sc), a##i##3 = _mm512_mul_ps(a##i##3, sc);     \
  PS_TILE_STORE(i, NK, s + i * SW)
  PS_SPAN_ROWS(PS_STORE)
#undef PS_STORE
}

// acc[r][c .. c + 16 NV) = alpha[r] * acc + sum_{i < np} pp[r][i] . VP[i][c ..] for NR <= 6 rows:
// pp[r] the row's probabilities as bfloat16 pairs (words, row stride ldP), np token pairs
template <int NR, int NV>
inline void dot_pv_tile(float* acc, int64_t D, const float* alpha, const uint32_t* pp, int64_t ldP,
                        const uint32_t* VP, int64_t np, int64_t c) {
#define PS_LOAD(i) PS_TILE_LOAD_SCALED(i, NV, acc + i * D + c, alpha[i])
  PS_SPAN_ROWS(PS_LOAD)
#undef PS_LOAD
  for (int64_t i = 0; i < np; ++i) {
    const uint32_t* v = VP + i * D + c;
    __m512i v0 = _mm512_loadu_si512(v), v1 = v0, v2 = v0, v3 = v0;
    if (NV > 1) v1 = _mm512_loadu_si512(v + 16);
    if (NV > 2) v2 = _mm512_loadu_si512(v + 32);
    if (NV > 3) v3 = _mm512_loadu_si512(v + 48);
    PS_KEEP16(v0);
    PS_KEEP16(v1);
    PS_KEEP16(v2);
    PS_KEEP16(v3);
#define PS_DOT(i_)                                                                           \
  if (NR > i_) {                                                                             \
    const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i_ * ldP + i]));     \
    a##i_##0 = _mm512_dpbf16_ps(a##i_##0, b, (__m512bh)v0);                                 \
    if (NV > 1) a##i_##1 = _mm512_dpbf16_ps(a##i_##1, b, (__m512bh)v1);                     \
    if (NV > 2) a##i_##2 = _mm512_dpbf16_ps(a##i_##2, b, (__m512bh)v2);                     \
    if (NV > 3) a##i_##3 = _mm512_dpbf16_ps(a##i_##3, b, (__m512bh)v3);                     \
  }
    PS_SPAN_ROWS(PS_DOT)
#undef PS_DOT
  }
#define PS_STORE(i) PS_TILE_STORE(i, NV, acc + i * D + c)
  PS_SPAN_ROWS(PS_STORE)
#undef PS_STORE
}

// scores of all `rows` rows over the span's first `cols` columns (a multiple of 16)
inline void dot_span_scores(const uint32_t* qp, int64_t rows, int64_t D, const uint32_t* KP, int64_t SW, int64_t cols,
                            float scale, float* s) {
  const int64_t DP = D / 2;
  for (int64_t c = 0; c < cols; c += 64) {
    const int64_t nk = std::min<int64_t>(4, (cols - c) / 16);
    for (int64_t r = 0; r < rows; r += kSpanTileRows) {
      const uint32_t* qr = qp + r * DP;
      const uint32_t* kp = KP + c;
      float* sr = s + r * SW + c;
      with_tile_shape(std::min(kSpanTileRows, rows - r), nk, [&](auto NR, auto NK) {
        dot_scores_tile<decltype(NR)::value, decltype(NK)::value>(qr, DP, kp, SW, scale, sr);
      });
    }
  }
}

// P·V of all rows (probabilities as bfloat16 pairs, row stride SW words); rows are in query
// order, so a tile's last row sees the most keys and the others' extra probabilities are 0
inline void dot_span_pv(float* acc, int64_t rows, int64_t D, const float* alpha, const uint32_t* pp, int64_t SW,
                        const uint32_t* VP, const int64_t* n_of) {
  for (int64_t r = 0; r < rows; r += kSpanTileRows) {
    const int64_t nr = std::min(kSpanTileRows, rows - r), n = n_of[r + nr - 1];
    if (n <= 0) continue;
    const int64_t np = (n + 1) / 2;  // an odd n's last pair: probability 0 past n (and value 0 past nk)
    for (int64_t c = 0; c < D; c += 64) {
      const int64_t nv = std::min<int64_t>(4, (D - c) / 16);
      float* ar = acc + r * D;
      const float* al = alpha + r;
      const uint32_t* pr = pp + r * SW;
      with_tile_shape(nr, nv, [&](auto NR, auto NV) {
        dot_pv_tile<decltype(NR)::value, decltype(NV)::value>(ar, D, al, pr, SW, VP, np, c);
      });
    }
  }
}

// Rounds n floats (n a multiple of 16) to bfloat16 in place: element i lands at ((uint16_t*) x)[i].
// Each chunk is read before its bytes are written, below anything still unread.
inline void narrow_in_place(float* x, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(x);
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512 lo = _mm512_loadu_ps(x + c), hi = _mm512_loadu_ps(x + c + 16);
    _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  if (c < n) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + c)));
}

// span_walk (paged_attention_span.h) on vdpbf16ps, for a state whose rows were started unscaled
// (TileState with dot set): the same spans, fill_n and online softmax; the queries are narrowed
// back to bfloat16 in place first (exact: they are bfloat16 values), and the transposed-keys
// buffer [D][SW] floats holds the packed keys [D/2][SW] and values [SW/2][D] words.
template <typename State, typename FillN>
void span_walk_dot(State& st, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t blk0, int64_t blk1,
                   int64_t end, int64_t hoff, const Shape& s, FillN fill_n) {
  const int64_t D = s.D, RK = st.RK, stride = s.KVH * D, NB = span_blocks(s.BS), SW = span_width(s.BS);
  narrow_in_place(st.qf, RK * D);
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(st.qf);
  uint32_t* KP = reinterpret_cast<uint32_t*>(st.KT);
  uint32_t* VP = KP + D / 2 * SW;
  const uint16_t* kblk[kSpanKeys];
  const uint16_t* vblk[kSpanKeys];
  for (int64_t b0 = blk0; b0 < blk1; b0 += NB) {
    const int64_t nb = std::min(NB, blk1 - b0), t0 = b0 * s.BS, nk = std::min(nb * s.BS, end - t0);
    span_block_rows(kc, vc, table, b0, nb, hoff, s, kblk, vblk);
    fill_n(t0, nk);
    transpose_span_pairs(kblk, s.BS, stride, nk, D, SW, KP);  // KP[j * SW + t]: dims (2j, 2j + 1) of key t
    pack_span_values(vblk, s.BS, stride, nk, D, VP);
    dot_span_scores(qp, RK, D, KP, SW, (nk + 15) / 16 * 16, s.scale, st.sp);
    for (int64_t r = 0; r < RK; ++r) {
      float* sr = st.sp + r * SW;
      const int64_t n = st.n_of[r];
      if (n <= 0) {
        std::fill(sr, sr + SW, 0.f);  // (zero bits: zero bfloat16 probabilities too)
        st.alpha[r] = 1.f;
        continue;
      }
      st.alpha[r] = softmax_span(sr, SW, n, st.m[r], st.l[r]);
      narrow_in_place(sr, SW);
    }
    dot_span_pv(st.acc, RK, D, st.alpha, reinterpret_cast<const uint32_t*>(st.sp), SW, VP, st.n_of);
  }
}

}  // namespace
#endif
