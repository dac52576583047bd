// bfloat16 prompt chunks on AMX tiles (CPUs with AMX-BF16, head sizes a multiple of 32).
//
// Why: the tiled path (paged_attention_tiled.h, paged_attention_span.h) widens every bf16 key and
// value to float32 and multiplies on the FMA units: ~90 GFLOP/s on two cores for a 1056-token
// prompt, a third of W3's time with prefix caching off. An AMX tile product does 16 x 16 x 32
// multiply-adds in one instruction, so here the two products of a span (scores = Q K^T, then
// P V) are tile products and what is left is the online softmax between them, in AVX-512.
//
// Per (item, kv head) the rows are the item's queries x the kv head's G query heads, padded to
// whole 16-row groups. Per span of up to 64 keys (as on the span walk) the keys are packed once
// for all row groups, as the tile products want them:
//   KT2[p][t] = (k_t[2p], k_t[2p+1]): a 32-bit transpose of the keys (B of Q K^T)
//   VN[u][d]  = (v_2u[d], v_2u+1[d]): pairs of consecutive tokens' values (B of P V)
// zero past the span's keys. Then per row group: scores into float32 tiles, the span's online
// softmax step per row (scaled there: the queries go in as they are, exact), the probabilities
// rounded to bfloat16 (as torch's own CPU flash attention does for bf16), P V into float32 tiles,
// and the rows' sums rescaled and added in float32. So the products are exact and sum in float32;
// the one extra rounding is of the probabilities.
#pragma once
#include "paged_attention_common.h"
#include "paged_attention_span.h"

#if defined(PS_HAVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#define PS_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kAmxRows = 16;  // rows of every tile here: 16 rows x 64 bytes
constexpr int64_t kAmxSpanKeys = 64;

// Linux hands out the tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the permission is process-wide. Asked once; false when refused.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Every tile here is 16 rows x 64 bytes: tmm0-3 float32 products (16 x 16), tmm4 A (16 x 32
// bf16), tmm5 B (16 pairs x 16 columns).
inline void amx_configure() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 6; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes per row
    cfg[48 + t] = 16;      // rows
  }
  _tile_loadconfig(cfg);
}

// keys per span, blocks per span, and the span's width (whole 32-key chunks: the K of P V)
inline int64_t amx_span_blocks(int64_t BS) { return std::max<int64_t>(1, kAmxSpanKeys / BS); }
inline int64_t amx_span_width(int64_t BS) { return (amx_span_blocks(BS) * BS + 31) / 32 * 32; }

inline bool amx_path(const Shape& s) { return s.D % 32 == 0; }

// floats of work one (item, kv head) needs for `rows` rows
inline size_t amx_work_floats(int64_t rows, const Shape& s) {
  const int64_t RP = (rows + kAmxRows - 1) / kAmxRows * kAmxRows, D = s.D, SW = amx_span_width(s.BS);
  // acc, Qp (bf16: half), KT2, VN, scores of a group, P of a group (bf16), its P V, m, l, alpha, n_of
  return static_cast<size_t>(RP * D + RP * D / 2 + D / 2 * SW + SW / 2 * D + kAmxRows * SW + kAmxRows * SW / 2 +
                             kAmxRows * D + 5 * RP + 64);
}

// KT2[p * SW + t] = the dim pair p of key t (rows `stride` apart in blocks of BS), 0 for t >= nk
inline void amx_pack_keys(const uint16_t* const* kblk, int64_t BS, int64_t stride, int64_t nk, int64_t D, int64_t SW,
                          uint32_t* KT2) {
  for (int64_t t0 = 0; t0 < SW; t0 += 8) {
    const uint16_t* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = t0 + j < nk ? kblk[(t0 + j) / BS] + (t0 + j) % BS * stride : nullptr;
    for (int64_t p0 = 0; p0 < D / 2; p0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = rows[j] != nullptr ? _mm256_loadu_ps(reinterpret_cast<const float*>(rows[j] + 2 * p0)) : _mm256_setzero_ps();
      transpose8x8(r);  // (moves 32-bit lanes, whatever they hold)
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(KT2 + (p0 + j) * SW + t0), r[j]);
    }
  }
}

// VN[u * D + d] = (v_{2u}[d], v_{2u+1}[d]) for the span's token pairs, 0 for tokens >= nk
inline void amx_pack_values(const uint16_t* const* vblk, int64_t BS, int64_t stride, int64_t nk, int64_t D, int64_t SW,
                            uint32_t* VN) {
  // lane 2i takes element i of a, lane 2i+1 element i of b (index bit 5 picks b); lo: i < 16, hi: i >= 16
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
    hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t u = 0; u < SW / 2; ++u) {
    const int64_t t = 2 * u;
    const uint16_t* a = t < nk ? vblk[t / BS] + t % BS * stride : nullptr;
    const uint16_t* b = t + 1 < nk ? vblk[(t + 1) / BS] + (t + 1) % BS * stride : nullptr;
    uint32_t* row = VN + u * D;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i va = a != nullptr ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
      const __m512i vb = b != nullptr ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(row + d0, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(row + d0 + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// exp(x) for finite x <= 0 to about 3e-6 relative: 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, 2^f by
// its degree-5 Taylor polynomial, 2^n by scalef (which also takes large n to 0). Half the
// instructions of exp16; the probabilities it feeds are rounded to bfloat16 (~2e-3) anyway.
inline __m512 exp16_for_bf16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One online-softmax step for a row's raw scores sr[0, SW) of which the first n >= 1 are seen:
// scaled here (scale > 0, so the scaled max is the max scaled), updates the running max m and
// normaliser l, writes the probabilities as bfloat16 to pr[0, SW) (0 past n) and returns the
// factor that rescales what was summed before. (softmax_span's arithmetic, with the scale fused
// into the subtraction and no float32 probabilities stored.)
inline float amx_softmax_row(const float* sr, int64_t SW, int64_t n, float scale, float& m, float& l, uint16_t* pr) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t c = 0; c < SW; c += 16) mx = _mm512_mask_max_ps(mx, lanes_below(n - c), mx, _mm512_loadu_ps(sr + c));
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx) * scale);
  const float alpha = m == kNegInf ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - mnew)));
  const __m512 vm = _mm512_set1_ps(mnew), vs = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < SW; c += 32) {
    const __m512 p0 = _mm512_maskz_mov_ps(lanes_below(n - c), exp16_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c), vs, vm)));
    const __m512 p1 =
        _mm512_maskz_mov_ps(lanes_below(n - c - 16), exp16_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c + 16), vs, vm)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512bh two = _mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(pr + c, reinterpret_cast<const __m512i&>(two));
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = mnew;
  return alpha;
}

// The item's rows of one kv head (queries i of the item's qn, heads h_first + g of G): the same
// contract as kv_head_tiled, on tiles. The caller has configured the tiles on this thread.
inline void kv_head_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                        int64_t q_first_pos, int64_t qn, int64_t h_first, int64_t G, const Shape& s, uint16_t* out,
                        float* work) {
  const int64_t D = s.D, RK = qn * G, RP = (RK + kAmxRows - 1) / kAmxRows * kAmxRows, SW = amx_span_width(s.BS);
  const int64_t stride = s.KVH * D, NB = amx_span_blocks(s.BS), hoff = h_first / G * D;
  float* acc = work;                                          // [RP, D]
  uint16_t* Qp = reinterpret_cast<uint16_t*>(acc + RP * D);  // [RP, D] bf16
  uint32_t* KT2 = reinterpret_cast<uint32_t*>(Qp + RP * D);  // [D/2, SW]
  uint32_t* VN = KT2 + D / 2 * SW;                            // [SW/2, D]
  float* S = reinterpret_cast<float*>(VN + SW / 2 * D);       // [16, SW]
  uint16_t* P = reinterpret_cast<uint16_t*>(S + kAmxRows * SW);  // [16, SW] bf16
  float* PV = reinterpret_cast<float*>(P + kAmxRows * SW);    // [16, D]
  float *m = PV + kAmxRows * D, *l = m + RP, *alpha = l + RP;
  int64_t* n_of = reinterpret_cast<int64_t*>(alpha + RP + (RP & 1));  // [RP]

  for (int64_t r = 0; r < RP; ++r) {
    uint16_t* qr = Qp + r * D;
    if (r < RK) std::copy(q + ((r / G) * s.H + h_first + r % G) * D, q + ((r / G) * s.H + h_first + r % G + 1) * D, qr);
    else std::fill(qr, qr + D, 0);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + RP * D, 0.f);

  const int64_t last = q_first_pos + qn - 1, end = last + 1, blk1 = last / s.BS + 1;
  const uint16_t* kblk[kAmxSpanKeys];
  const uint16_t* vblk[kAmxSpanKeys];
  for (int64_t b0 = 0; b0 < blk1; b0 += NB) {
    const int64_t nb = std::min(NB, blk1 - b0), t0 = b0 * s.BS, nk = std::min(nb * s.BS, end - t0);
    for (int64_t j = 0; j < nb; ++j) {
      kblk[j] = kc + table[b0 + j] * s.BS * stride + hoff;
      vblk[j] = vc + table[b0 + j] * s.BS * stride + hoff;
    }
    for (int64_t r = 0; r < RP; ++r) n_of[r] = r < RK ? std::min(nk, q_first_pos + r / G + 1 - t0) : 0;
    amx_pack_keys(kblk, s.BS, stride, nk, D, SW, KT2);
    amx_pack_values(vblk, s.BS, stride, nk, D, SW, VN);
    for (int64_t g0 = 0; g0 < RP; g0 += kAmxRows) {
      // rows are in query order, so the group's last real row sees the most keys
      if (n_of[std::min(RK, g0 + kAmxRows) - 1] <= 0) continue;
      // scores of the group's 16 rows, 64 keys (four tiles) at a time
      for (int64_t c0 = 0; c0 < SW; c0 += 64) {
        const int nt = static_cast<int>(std::min<int64_t>(4, (SW - c0) / 16));
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p0 = 0; p0 < D; p0 += 32) {
          _tile_loadd(4, Qp + g0 * D + p0, D * 2);
          const uint32_t* bk = KT2 + p0 / 2 * SW + c0;
          _tile_loadd(5, bk, SW * 4);
          _tile_dpbf16ps(0, 4, 5);
          if (nt > 1) { _tile_loadd(5, bk + 16, SW * 4); _tile_dpbf16ps(1, 4, 5); }
          if (nt > 2) { _tile_loadd(5, bk + 32, SW * 4); _tile_dpbf16ps(2, 4, 5); }
          if (nt > 3) { _tile_loadd(5, bk + 48, SW * 4); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, S + c0, SW * 4);
        if (nt > 1) _tile_stored(1, S + c0 + 16, SW * 4);
        if (nt > 2) _tile_stored(2, S + c0 + 32, SW * 4);
        if (nt > 3) _tile_stored(3, S + c0 + 48, SW * 4);
      }
      // the softmax step per row; probabilities to bfloat16 (0 for keys a row does not see)
      for (int64_t i = 0; i < kAmxRows; ++i) {
        const int64_t r = g0 + i, n = n_of[r];
        float* sr = S + i * SW;
        uint16_t* pr = P + i * SW;
        if (n <= 0) {
          std::fill(pr, pr + SW, 0);
          alpha[r] = 1.f;
          continue;
        }
        alpha[r] = amx_softmax_row(sr, SW, n, s.scale, m[r], l[r], pr);
      }
      // P V of the group, 64 dims (four tiles) at a time
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nt = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < SW; k0 += 32) {
          _tile_loadd(4, P + k0, SW * 2);
          const uint32_t* bv = VN + k0 / 2 * D + d0;
          _tile_loadd(5, bv, D * 4);
          _tile_dpbf16ps(0, 4, 5);
          if (nt > 1) { _tile_loadd(5, bv + 16, D * 4); _tile_dpbf16ps(1, 4, 5); }
          if (nt > 2) { _tile_loadd(5, bv + 32, D * 4); _tile_dpbf16ps(2, 4, 5); }
          if (nt > 3) { _tile_loadd(5, bv + 48, D * 4); _tile_dpbf16ps(3, 4, 5); }
        }
        _tile_stored(0, PV + d0, D * 4);
        if (nt > 1) _tile_stored(1, PV + d0 + 16, D * 4);
        if (nt > 2) _tile_stored(2, PV + d0 + 32, D * 4);
        if (nt > 3) _tile_stored(3, PV + d0 + 48, D * 4);
      }
      // acc = alpha * acc + P V, per row
      for (int64_t i = 0; i < kAmxRows; ++i) {
        const int64_t r = g0 + i;
        if (r >= RK) break;
        const __m512 al = _mm512_set1_ps(alpha[r]);
        float* ar = acc + r * D;
        const float* pv = PV + i * D;
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(ar + d, _mm512_fmadd_ps(_mm512_loadu_ps(ar + d), al, _mm512_loadu_ps(pv + d)));
      }
    }
  }
  for (int64_t r = 0; r < RK; ++r) {
    uint16_t* o = out + ((r / G) * s.H + h_first + r % G) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) store1(o + d, acc[r * D + d] * inv);
  }
}

inline void item_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                     int64_t q_first_pos, const Rows& rs, const Shape& s, uint16_t* out, float* work) {
  for (int64_t h = rs.h0; h < rs.h0 + rs.HH; h += rs.G)
    kv_head_amx(q, kc, vc, table, q_first_pos, rs.qn, h, rs.G, s, out, work);
}

}  // namespace
#endif
