// The decode path of the CPU paged-attention kernel on AVX-512 for bfloat16 caches: one query per
// sequence, head size 64 or 128, up to 8 query heads per kv head.
//
// The row path (paged_attention_rows.h) spends ~0.9 us of compute per 16-token block of the small
// model (8 heads, 4 kv heads) even with the block in cache; a bfloat16 block is 16 KB, which
// memory delivers in about half that, so bfloat16 decodes were compute-bound. Here the G query
// heads of a kv head go through each K/V row together, so every row is loaded and widened once
// for all of them (the row path does it once per head), and the scores of 16 (head, key) pairs
// leave their accumulators through one 16-way add tree instead of 8-way trees per head: ~0.65 us
// per block, 1.2-1.5x the row path on decode batches (cpu_attention_ab.py --dtype bfloat16).
// Where the vdpbf16ps walk runs (paged_attention_dot.h), the scores here run on vdpbf16ps too:
// 1.03-1.11x on W1-/W2-decode (Zen 4), the K rows no longer widened.
// Float32 stays on the row path: its blocks are twice the bytes, decodes there run at ~90 % of
// stream bandwidth already, and this kernel's loads pace the memory worse (0.8-0.97x out of
// cache, W1 ~4 % slower end to end).
#pragma once
#include "paged_attention_common.h"
#include "paged_attention_dot.h"

#ifdef PS_HAVE_AVX512
namespace {

// Lane i of the result = the sum of the 16 lanes of x[i]: a 4-level add tree, 45 instructions.
// The tree leaves slot s's sum in lane 4 * (s % 4) + s / 4, so slot s is fed x[4 * (s % 4) + s / 4]
// (the same permutation) and the lanes come out in order.
inline __m512 transpose_sum16(const __m512* x) {
  auto in = [x](int s) { return x[4 * (s % 4) + s / 4]; };
  __m512 t[8], u[4], v[2];
#pragma GCC unroll 8
  for (int a = 0; a < 8; ++a) {  // 16 -> 8: each 256-bit half holds 8 partial sums of one slot
    const __m512 p = in(2 * a), q = in(2 * a + 1);
    t[a] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
  }
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b)  // 8 -> 4: each 128-bit quarter holds 4 partials of slot 4b + quarter
    u[b] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * b], t[2 * b + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * b], t[2 * b + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
  for (int c = 0; c < 2; ++c)  // 4 -> 2: pairs of partials
    v[c] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * c], u[2 * c + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * c], u[2 * c + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One decode (query row q [H, D] at position seq_len - 1) for kv heads [kh0, kh1) and their
// G query heads each; DV = D / 16. With `state` (a shared-prefix decode), every head starts from
// the shared pass's max, normaliser and sums at state[head * (D + 2)] and blocks from blk0 on.
// kDot (bfloat16 on AVX512-BF16, where use_bf16_dot): the scores on vdpbf16ps, the query and
// key rows as bfloat16 pairs (no widening; products exact, sums float32) and the scale applied to
// each finished score, as in paged_attention_dot.h; P·V stays on float32 FMAs with float32
// probabilities, so a decode's result differs from the FMA scores' only by float32 rounding.
template <int G, int DV, typename T, bool kDot = false>
void item_decode(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t seq_len, int64_t kh0,
                 int64_t kh1, const Shape& s, T* out, float* work, int64_t blk0, const float* state) {
  constexpr int D = 16 * DV;
  constexpr int KC = 16 / G;  // keys per score chunk: G * KC (head, key) sums share one add tree
  constexpr int GV = 16 / G < DV ? 16 / G : DV;
  constexpr int CV = GV >= 8 ? 8 : GV >= 4 ? 4 : GV >= 2 ? 2 : 1;  // V vectors per P·V pass (divides DV)
  constexpr int kSpan = 16;  // tokens per online-softmax step
  const int64_t row_stride = s.KVH * D, nkh = kh1 - kh0;
  float* qf = work;              // [nkh][G][D] scaled queries
  float* acc = qf + nkh * G * D;  // [nkh][G][D]
  float* ml = acc + nkh * G * D;  // [nkh][G][2] running max, normaliser
  constexpr int kScRow = (kSpan + KC + 15) / 16 * 16;  // a head's scores: a span plus a chunk's overhang
  float* sc = ml + (2 * nkh * G + 15) / 16 * 16;        // [nkh * G][kScRow], (work is not 64-byte aligned: unaligned accesses)
  float* alpha = sc + nkh * G * kScRow;                 // [nkh * G]
  for (int64_t i = 0; i < nkh * G; ++i) {
    const int64_t h = kh0 * G + i;
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(qf + i * D + 16 * c, _mm512_mul_ps(load16(q + h * D + 16 * c),
                                                                               _mm512_set1_ps(s.scale)));
    if (state != nullptr) {
      const float* st = state + h * (D + 2);
      ml[2 * i] = st[0], ml[2 * i + 1] = st[1];
      std::copy(st + 2, st + 2 + D, acc + i * D);
    } else {
      ml[2 * i] = kNegInf, ml[2 * i + 1] = 0.f;
      std::fill(acc + i * D, acc + (i + 1) * D, 0.f);
    }
  }
  for (int64_t t0 = blk0 * s.BS; t0 < seq_len; t0 += s.BS) {
    const int64_t boff = table[t0 / s.BS] * s.BS * row_stride;
    // the next block's lines, requested a few at a time between the steps of this one (see item_avx2)
    BlockPrefetch<T> pf;
    const int64_t bn = std::min(s.BS, seq_len - t0);
    if (t0 + s.BS < seq_len) {
      const int64_t nb = table[t0 / s.BS + 1] * s.BS * row_stride;
      pf = BlockPrefetch(kc + nb, vc + nb, s.BS, row_stride, kh0 * D, kh1 * D,
                         (bn + kSpan - 1) / kSpan * nkh * ((kSpan + KC - 1) / KC + kSpan / 4 * (DV / CV)));
    }
    for (int64_t j = 0; j < bn; j += kSpan) {
      const int64_t n = std::min<int64_t>(kSpan, bn - j);
      const __mmask16 valid = lanes_below(n);
      // Three passes over the item's kv heads, as in item_avx2: the softmax step is a long chain
      // (max tree, exp, sum tree) that the CPU overlaps across heads only when they come together.
      // 1. scores of every head for the span's n keys, KC keys at a time
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        const int64_t i0 = (kh - kh0) * G;
        const T* kb = kc + boff + j * row_stride + kh * D;
        __m512 qv[G][DV];
        if constexpr (!kDot) {
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < DV; ++c) qv[g][c] = _mm512_loadu_ps(qf + (i0 + g) * D + 16 * c);
        }
        for (int64_t k0 = 0; k0 < n; k0 += KC) {
          pf.step();
          __m512 a[16];
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
          // keys past n reuse the span's last valid row (real memory); masked below
          const T* kr[KC];
#pragma GCC unroll 16
          for (int k = 0; k < KC; ++k) kr[k] = kb + std::min<int64_t>(k0 + k, n - 1) * row_stride;
          if constexpr (kDot) {
#ifdef PS_HAVE_BF16_DOT
            const T* qb = q + kh * G * D;  // the G heads' bfloat16 rows, unscaled
#pragma GCC unroll 4
            for (int c = 0; c < DV / 2; ++c)
#pragma GCC unroll 16
              for (int k = 0; k < KC; ++k) {
                __m512i kv = _mm512_loadu_si512(kr[k] + 32 * c);
                PS_KEEP16(kv);
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g)
                  a[g * KC + k] = _mm512_dpbf16_ps(a[g * KC + k], (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c),
                                                   (__m512bh)kv);
              }
#endif
          } else {
#pragma GCC unroll 8
            for (int c = 0; c < DV; ++c)
#pragma GCC unroll 16
              for (int k = 0; k < KC; ++k) {
                __m512 kv = load16(kr[k] + 16 * c);
                PS_KEEP16(kv);  // one load for the G heads, not one folded into each FMA
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g) a[g * KC + k] = _mm512_fmadd_ps(qv[g][c], kv, a[g * KC + k]);
              }
          }
          __m512 r = transpose_sum16(a);  // lane g * KC + k: head g, key k0 + k
          if constexpr (kDot) r = _mm512_mul_ps(r, _mm512_set1_ps(s.scale));
          alignas(64) float lanes[16];
          _mm512_store_ps(lanes, r);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
            for (int k = 0; k < KC; ++k) sc[(i0 + g) * kScRow + k0 + k] = lanes[g * KC + k];
        }
      }
      // 2. online softmax step per head; its scores become probabilities (0 past n)
      for (int64_t i = 0; i < nkh * G; ++i) {
        float* sr = sc + i * kScRow;
        float& m = ml[2 * i];
        float& l = ml[2 * i + 1];
        const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), valid, sr);
        const float mnew = std::max(m, _mm512_reduce_max_ps(sv));
        // (exp16 of a broadcast, not std::exp: no call in the chain)
        alpha[i] = m == kNegInf ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(m - mnew)));
        const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
        _mm512_storeu_ps(sr, p);
        l = l * alpha[i] + _mm512_reduce_add_ps(p);
        m = mnew;
      }
      // 3. acc = alpha * acc + P·V, CV vectors of D per pass (G * CV accumulators in registers)
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        const int64_t i0 = (kh - kh0) * G;
        const T* vb = vc + boff + j * row_stride + kh * D;
#pragma GCC unroll 8
        for (int c0 = 0; c0 < DV; c0 += CV) {
          __m512 av[G][CV];
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c)
              av[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (i0 + g) * D + 16 * (c0 + c)), _mm512_set1_ps(alpha[i0 + g]));
          for (int64_t t = 0; t < n; ++t) {
            if ((t & 3) == 0) pf.step();
            const T* vr = vb + t * row_stride + 16 * c0;
            __m512 vv[CV];
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c) {
              vv[c] = load16(vr + 16 * c);
              PS_KEEP16(vv[c]);
            }
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) {
              const __m512 p = _mm512_set1_ps(sc[(i0 + g) * kScRow + t]);
#pragma GCC unroll 8
              for (int c = 0; c < CV; ++c) av[g][c] = _mm512_fmadd_ps(p, vv[c], av[g][c]);
            }
          }
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
            for (int c = 0; c < CV; ++c) _mm512_storeu_ps(acc + (i0 + g) * D + 16 * (c0 + c), av[g][c]);
        }
      }
    }
  }
  for (int64_t i = 0; i < nkh * G; ++i) {
    T* o = out + (kh0 * G + i) * D;
    const float inv = 1.f / ml[2 * i + 1];
    for (int d = 0; d < D; ++d) store1(o + d, acc[i * D + d] * inv);
  }
}

template <typename T>
using DecodeFn = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, const Shape&, T*,
                          float*, int64_t, const float*);

template <int DV, typename T, bool kDot = false>
DecodeFn<T> decode_for_group(int64_t G) {
  switch (G) {
    case 1: return item_decode<1, DV, T, kDot>;
    case 2: return item_decode<2, DV, T, kDot>;
    case 3: return item_decode<3, DV, T, kDot>;
    case 4: return item_decode<4, DV, T, kDot>;
    case 5: return item_decode<5, DV, T, kDot>;
    case 6: return item_decode<6, DV, T, kDot>;
    case 7: return item_decode<7, DV, T, kDot>;
    case 8: return item_decode<8, DV, T, kDot>;
    default: return nullptr;
  }
}

// The decode kernel for this dtype and shape, or null (the row path takes the rest).
template <typename T>
DecodeFn<T> decode_kernel(const Shape& s) {
  if constexpr (sizeof(T) == 4) {  // float32: the row path (see the top of this file)
    return nullptr;
  } else {
    const int64_t G = s.H / s.KVH;
#ifdef PS_HAVE_BF16_DOT
    if (use_bf16_dot) {
      if (s.D == 64) return decode_for_group<4, T, true>(G);
      if (s.D == 128) return decode_for_group<8, T, true>(G);
    }
#endif
    if (s.D == 64) return decode_for_group<4, T>(G);
    if (s.D == 128) return decode_for_group<8, T>(G);
    return nullptr;
  }
}

}  // namespace
#endif
