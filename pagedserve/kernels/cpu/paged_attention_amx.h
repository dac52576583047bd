// bfloat16 prompt chunks on AMX tiles (CPUs with AMX-BF16, head sizes a multiple of 32).
//
// Why: the tiled path (paged_attention_tiled.h, paged_attention_span.h) widens every bf16 key and
// value to float32 and multiplies on the FMA units: ~90 GFLOP/s on two cores for a 1056-token
// prompt, a third of W3's time with prefix caching off. An AMX tile product does 16 x 16 x 32
// multiply-adds in one instruction, so here the two products of a span (scores = Q K^T, then
// P V) are tile products and what is left is the online softmax between them, in AVX-512.
//
// The same core (amx_rows) also runs the cascade pass of decodes that share prefix blocks
// (shared_prefix_amx): there the rows are the member sequences' queries, and all see every key.
// Per (item, kv head) the rows are the item's queries x the kv head's G query heads, in groups
// of 16. The products run transposed, scores^T = K Q^T and (P V)^T = V^T P^T, so a key's scores
// for a group's 16 rows fill one zmm and the online softmax (max, exp, sum, rescale) is 16-row
// vector work with no horizontal reductions. Per group, once per item, Q^T as dim pairs (the B of
// K Q^T); per span of up to 64 keys, once for all groups: the keys as rows (the A of K Q^T) and
// V^T (the A of V^T P^T, via a 32-bit transpose split into even and odd dims), zero past the
// span's keys. Per group and span: scores^T into float32 tiles, the softmax step (scaled there:
// the queries go in as they are, exact), the probabilities rounded to bfloat16 pairs (the B of
// V^T P^T; torch's own CPU flash attention also rounds them for bf16), (P V)^T into float32
// tiles, and the sums rescaled and added in float32. So the products are exact and sum in
// float32; the one extra rounding is of the probabilities. Against the row-major form of the
// same products (scores per row, horizontal max and sum per row and span): 1.07-1.12x on a
// 1056-token prompt.
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

// a span is the span walk's (span_blocks blocks, paged_attention_span.h), its width rounded up to
// whole 32-key chunks (the K of P V)
inline int64_t amx_span_width(int64_t BS) { return (span_blocks(BS) * BS + 31) / 32 * 32; }

inline bool amx_path(const Shape& s) { return s.D % 32 == 0; }

// floats of work one (item, kv head) needs for `rows` rows
inline size_t amx_work_floats(int64_t rows, const Shape& s) {
  const int64_t NG = (rows + kAmxRows - 1) / kAmxRows, D = s.D, SW = amx_span_width(s.BS);
  // per group: sums^T, max, normaliser, query positions, Q^T pairs; per span: K rows, V^T, the
  // 32-bit transpose V^T is made from, scores^T, P^T pairs, (P V)^T
  return static_cast<size_t>(NG * (D * 16 + 3 * 16 + D / 2 * 16) + 3 * SW * D / 2 + SW * 16 + SW / 2 * 16 + D * 16 + 64);
}

// VT[d * SW + t] = v_t[d], 0 for t >= nk: the dim pairs' transpose W, each row of pairs split into
// its even and odd dims
inline void amx_pack_values_t(const uint16_t* const* vblk, int64_t BS, int64_t stride, int64_t nk, int64_t D,
                              int64_t SW, uint32_t* W, uint16_t* VT) {
  transpose_span_pairs(vblk, BS, stride, nk, D, SW, W);
  alignas(64) uint16_t even_idx[32], odd_idx[32];
  for (int i = 0; i < 32; ++i) even_idx[i] = static_cast<uint16_t>(2 * i), odd_idx[i] = static_cast<uint16_t>(2 * i + 1);
  const __m512i ev = _mm512_load_si512(even_idx), od = _mm512_load_si512(odd_idx);
  for (int64_t p = 0; p < D / 2; ++p)
    for (int64_t t = 0; t < SW; t += 32) {
      const __m512i a = _mm512_loadu_si512(W + p * SW + t), b = _mm512_loadu_si512(W + p * SW + t + 16);
      _mm512_storeu_si512(VT + 2 * p * SW + t, _mm512_permutex2var_epi16(a, ev, b));
      _mm512_storeu_si512(VT + (2 * p + 1) * SW + t, _mm512_permutex2var_epi16(a, od, b));
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

// r[c] lane i = r[i] lane c on entry: a 16 x 16 float32 transpose (unpacks, then 128-bit lane
// shuffles)
inline void transpose16x16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: rows 4i..4i+3 at column 4L + k
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 x2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), x3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(x0, x2, 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(x1, x3, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(x0, x2, 0xDD);
    r[12 + k] = _mm512_shuffle_f32x4(x1, x3, 0xDD);
  }
}

// 16 lanes stored as bfloat16, each rounded exactly as store1 rounds it
inline void store16_rne(uint16_t* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// The tile products of both steps: C_j = sum_c A_jc B_c for the nt <= 4 output tiles j (tmm0-3),
// A_jc the 16 x 32 bf16 block at rows 16j.., columns 32c.. of the row-major `a` (lda elements a
// row; tmm4), B_c the 16 pairs x 16 columns at b + 256c (tmm5, loaded once per c for all j);
// C_j (16 x 16 float32) stored at out + 256j.
inline void amx_tile_products(int nt, const uint16_t* a, int64_t lda, int64_t kchunks, const uint32_t* b, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < kchunks; ++c) {
    _tile_loadd(5, b + 256 * c, 64);
    const uint16_t* ac = a + 32 * c;
    _tile_loadd(4, ac, lda * 2);
    _tile_dpbf16ps(0, 4, 5);
    if (nt > 1) { _tile_loadd(4, ac + 16 * lda, lda * 2); _tile_dpbf16ps(1, 4, 5); }
    if (nt > 2) { _tile_loadd(4, ac + 32 * lda, lda * 2); _tile_dpbf16ps(2, 4, 5); }
    if (nt > 3) { _tile_loadd(4, ac + 48 * lda, lda * 2); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, out, 64);
  if (nt > 1) _tile_stored(1, out + 256, 64);
  if (nt > 2) _tile_stored(2, out + 512, 64);
  if (nt > 3) _tile_stored(3, out + 768, 64);
}

// Rows of one kv head over keys [0, end) of `table`, on tiles: row r's query is row_q(r) (head
// size D) at position row_pos(r) (it sees keys up to there; INT32_MAX: all of them), rows sorted by
// position. finish(g, m, l, accT) takes group g's 16 rows' max, normaliser and sums [D][16]. The
// caller has configured the tiles on this thread.
// The products are transposed, scores^T = K Q^T and (P V)^T = V^T P^T, so that a row's scores
// lie down a column: one zmm holds a key's scores for the 16 rows of a group, and the softmax's
// max, sum and rescale are 16-row vector operations with no horizontal reductions.
template <typename RowQ, typename RowPos, typename Finish>
inline void amx_rows(int64_t RK, RowQ row_q, RowPos row_pos, const uint16_t* kc, const uint16_t* vc,
                     const int64_t* table, int64_t end, int64_t kv_head, const Shape& s, float* work, Finish finish) {
  const int64_t D = s.D, NG = (RK + kAmxRows - 1) / kAmxRows, SW = amx_span_width(s.BS);
  const int64_t stride = s.KVH * D, NB = span_blocks(s.BS), hoff = kv_head * D;
  float* accT = work;                                                  // [NG][D][16]
  float* m = accT + NG * D * 16;                                       // [NG][16]
  float* l = m + NG * 16;                                              // [NG][16]
  int32_t* qpos = reinterpret_cast<int32_t*>(l + NG * 16);             // [NG][16]
  uint32_t* QT2 = reinterpret_cast<uint32_t*>(qpos + NG * 16);         // [NG][D/2][16]
  uint16_t* Kp = reinterpret_cast<uint16_t*>(QT2 + NG * D / 2 * 16);   // [SW][D]
  uint16_t* VT = Kp + SW * D;                                          // [D][SW]
  uint32_t* W = reinterpret_cast<uint32_t*>(VT + SW * D);              // [D/2][SW]
  float* ST = reinterpret_cast<float*>(W + D / 2 * SW);                // [SW][16]
  uint32_t* PT2 = reinterpret_cast<uint32_t*>(ST + SW * 16);           // [SW/2][16]
  float* OT = reinterpret_cast<float*>(PT2 + SW / 2 * 16);             // [D][16]

  // per group: Q^T as dim pairs (B of K Q^T), state; padding rows have zero queries and see
  // every key (their scores are 0, finite; their results are dropped)
  for (int64_t g = 0; g < NG; ++g) {
    const uint16_t* rows[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = g * 16 + i;
      rows[i] = r < RK ? row_q(r) : nullptr;
      qpos[g * 16 + i] = r < RK ? row_pos(r) : std::numeric_limits<int32_t>::max();
    }
    uint32_t* qt = QT2 + g * D / 2 * 16;
    for (int64_t r0 = 0; r0 < 16; r0 += 8)
      for (int64_t p0 = 0; p0 < D / 2; p0 += 8) {
        __m256 v[8];
        for (int j = 0; j < 8; ++j)
          v[j] = rows[r0 + j] != nullptr ? _mm256_loadu_ps(reinterpret_cast<const float*>(rows[r0 + j] + 2 * p0))
                                         : _mm256_setzero_ps();
        transpose8x8(v);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(qt + (p0 + j) * 16 + r0), v[j]);
      }
    std::fill(accT + g * D * 16, accT + (g + 1) * D * 16, 0.f);
    std::fill(m + g * 16, m + (g + 1) * 16, kNegInf);
    std::fill(l + g * 16, l + (g + 1) * 16, 0.f);
  }
  alignas(64) uint16_t il_idx[32];  // (even lanes 0-15 | odd lanes 0-15) -> pairs
  for (int i = 0; i < 16; ++i) il_idx[2 * i] = static_cast<uint16_t>(i), il_idx[2 * i + 1] = static_cast<uint16_t>(16 + i);
  const __m512i il = _mm512_load_si512(il_idx);
  const __m512 vs = _mm512_set1_ps(s.scale);

  const int64_t blk1 = (end - 1) / s.BS + 1;
  const uint16_t* kblk[kSpanKeys];
  const uint16_t* vblk[kSpanKeys];
  for (int64_t b0 = 0; b0 < blk1; b0 += NB) {
    const int64_t nb = std::min(NB, blk1 - b0), t0 = b0 * s.BS, nk = std::min(nb * s.BS, end - t0);
    for (int64_t j = 0; j < nb; ++j) {
      kblk[j] = kc + table[b0 + j] * s.BS * stride + hoff;
      vblk[j] = vc + table[b0 + j] * s.BS * stride + hoff;
    }
    for (int64_t t = 0; t < SW; ++t) {  // (D % 32 == 0: whole zmm moves, not a memmove call per row)
      uint16_t* kr = Kp + t * D;
      const uint16_t* src = t < nk ? kblk[t / s.BS] + t % s.BS * stride : nullptr;
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(kr + d, src != nullptr ? _mm512_loadu_si512(src + d) : _mm512_setzero_si512());
    }
    amx_pack_values_t(vblk, s.BS, stride, nk, D, SW, W, VT);
    for (int64_t g = 0; g < NG; ++g) {
      // rows are in query order: the group's last real row sees the most
      if (qpos[std::min(RK, (g + 1) * 16) - 1] < t0) continue;
      const uint32_t* qt = QT2 + g * D / 2 * 16;
      // scores^T: 16 keys x 16 rows per tile, four tiles (64 keys) at a time
      for (int64_t c0 = 0; c0 < SW; c0 += 64)
        amx_tile_products(static_cast<int>(std::min<int64_t>(4, (SW - c0) / 16)), Kp + c0 * D, D, D / 32, qt,
                          ST + c0 * 16);
      // the online-softmax step of the 16 rows at once; key t is seen by the rows whose query
      // sits at or after it (keys past the span's nk lie past every real query)
      const __m512i qp = _mm512_loadu_si512(qpos + g * 16);
      const bool all_see = t0 + nk - 1 <= qpos[g * 16];  // the group's first row sees all nk keys
      auto seen_by = [&](int64_t t) -> __mmask16 {  // the rows that see key t of the span
        if (t >= nk) return 0;  // (padding: zero keys past the span's own)
        return all_see ? 0xFFFF : _mm512_cmpge_epi32_mask(qp, _mm512_set1_epi32(static_cast<int32_t>(t0 + t)));
      };
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int64_t t = 0; t < nk; ++t) mx = _mm512_mask_max_ps(mx, seen_by(t), mx, _mm512_loadu_ps(ST + t * 16));
      float* mg = m + g * 16;
      float* lg = l + g * 16;
      const __m512 mold = _mm512_loadu_ps(mg), mnew = _mm512_max_ps(mold, _mm512_mul_ps(mx, vs));
      const __m512 alpha = exp16(_mm512_sub_ps(mold, mnew));  // (exp16 takes -inf to ~0)
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < SW; t += 2) {
        const __mmask16 s0 = seen_by(t), s1 = seen_by(t + 1);
        const __m512 p0 = _mm512_maskz_mov_ps(s0, exp16_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(ST + t * 16), vs, mnew)));
        const __m512 p1 =
            _mm512_maskz_mov_ps(s1, exp16_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(ST + (t + 1) * 16), vs, mnew)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512bh two = _mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(PT2 + t / 2 * 16, _mm512_permutexvar_epi16(il, reinterpret_cast<const __m512i&>(two)));
      }
      _mm512_storeu_ps(lg, _mm512_fmadd_ps(_mm512_loadu_ps(lg), alpha, sum));
      _mm512_storeu_ps(mg, mnew);
      // (P V)^T: 16 dims x 16 rows per tile, four tiles (64 dims) at a time
      float* acc = accT + g * D * 16;
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        amx_tile_products(static_cast<int>(std::min<int64_t>(4, (D - d0) / 16)), VT + d0 * SW, SW, SW / 32, PT2,
                          OT + d0 * 16);
      for (int64_t d = 0; d < D; ++d)
        _mm512_storeu_ps(acc + d * 16, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d * 16), alpha, _mm512_loadu_ps(OT + d * 16)));
    }
  }
  for (int64_t g = 0; g < NG; ++g) finish(g, m + g * 16, l + g * 16, accT + g * D * 16);
}

// The item's rows of one kv head (queries i of the item's qn, heads h_first + g of G, row i * G +
// g): the same contract as kv_head_tiled.
inline void kv_head_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                        int64_t q_first_pos, int64_t qn, int64_t h_first, int64_t G, const Shape& s, uint16_t* out,
                        float* work) {
  const int64_t D = s.D, RK = qn * G;
  auto row_q = [&](int64_t r) { return q + ((r / G) * s.H + h_first + r % G) * D; };
  auto row_pos = [&](int64_t r) { return static_cast<int32_t>(q_first_pos + r / G); };
  // out = sums / normaliser: 16 dims x 16 rows at a time, scaled, transposed to rows, rounded as
  // store1 rounds (the bits of the scalar loop, ~10x fewer instructions)
  auto finish = [&](int64_t g, const float* m, const float* l, const float* acc) {
    const int64_t nrows = std::min<int64_t>(16, RK - g * 16);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(l));
    uint16_t* orow[16];
    for (int64_t i = 0; i < nrows; ++i) orow[i] = out + (row_q(g * 16 + i) - q);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) v[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + j) * 16), inv);
      transpose16x16(v);
      for (int64_t i = 0; i < nrows; ++i) store16_rne(orow[i] + d0, v[i]);
    }
  };
  amx_rows(RK, row_q, row_pos, kc, vc, table, q_first_pos + qn, h_first / G, s, work, finish);
}

// Shared-prefix (cascade) decode on tiles: shared_prefix_tiled's contract (the decodes of
// `members` read their `blocks` common full blocks together, kv head kh; each row's max,
// normaliser and sums go to state for the decode path to continue from), with the probabilities
// rounded to bfloat16 for the P V product as on the prompt path (and in torch's CPU flash
// attention). Every row sees every shared key.
inline void shared_prefix_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                              const int64_t* q_starts, const int64_t* members, int64_t n_members, int64_t blocks,
                              int64_t kh, const Shape& s, float* state, float* work) {
  const int64_t D = s.D, G = s.H / s.KVH, RK = n_members * G;
  auto row_q = [&](int64_t r) { return q + (q_starts[members[r / G]] * s.H + kh * G + r % G) * D; };
  auto row_pos = [](int64_t) { return std::numeric_limits<int32_t>::max(); };
  auto finish = [&](int64_t g, const float* m, const float* l, const float* acc) {
    for (int64_t i = 0; i < std::min<int64_t>(16, RK - g * 16); ++i) {
      const int64_t r = g * 16 + i;
      float* o = state + (members[r / G] * s.H + kh * G + r % G) * (D + 2);
      o[0] = m[i];
      o[1] = l[i];
      for (int64_t d = 0; d < D; ++d) o[2 + d] = acc[d * 16 + i];
    }
  };
  amx_rows(RK, row_q, row_pos, kc, vc, table, blocks * s.BS, kh, s, work, finish);
}

inline void item_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                     int64_t q_first_pos, const Rows& rs, const Shape& s, uint16_t* out, float* work) {
  for (int64_t h = rs.h0; h < rs.h0 + rs.HH; h += rs.G)
    kv_head_amx(q, kc, vc, table, q_first_pos, rs.qn, h, rs.G, s, out, work);
}

}  // namespace
#endif
