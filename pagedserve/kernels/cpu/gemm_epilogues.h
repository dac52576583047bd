// Epilogues: how a finished float32 tile is stored (float32 or bfloat16 out, + bias, added to
// earlier k blocks) and the SiLU·mul epilogue that stores silu(gate) · up straight from the tile.
//
// Part of gemm_cpu.cpp: included there, inside its anonymous namespace, after the constants and
// the headers it relies on; not a standalone header.
#pragma once

// Lanes [0, n) of a mask for maskload/maskstore.
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// out[rows][cols] (row stride ldo) = tile (row stride ld_tile) (+ out, when accumulating a later k
// block) (+ bias, on the first k block); rows and cols cut the tile at the matrix edges. Whole
// 16-column panels on zmm where the build has AVX-512 (tile rows 64-byte aligned: both tiles' are),
// then eight columns at a time, the last chunk masked.
void store_tile(const float* tile, int64_t ld_tile, float* out, int64_t ldo, int64_t rows, int64_t cols,
                const float* bias, bool accumulate) {
  int64_t c = 0;
#ifdef __AVX512F__
  for (; c + 16 <= cols; c += 16) {  // whole 16-column panels on zmm
    const __m512 b = bias != nullptr && !accumulate ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + r * ldo + c;
      __m512 v = _mm512_add_ps(_mm512_load_ps(tile + r * ld_tile + c), b);
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(o));
      _mm512_storeu_ps(o, v);
    }
  }
#endif
  for (; c < cols; c += 8) {
    const bool whole = cols - c >= 8;
    const __m256i mask = first_lanes(cols - c);
    const __m256 b = bias != nullptr && !accumulate ? _mm256_maskload_ps(bias + c, mask) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + r * ldo + c;
      __m256 v = _mm256_add_ps(_mm256_load_ps(tile + r * ld_tile + c), b);
      if (whole) {
        if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(o));
        _mm256_storeu_ps(o, v);
      } else {
        if (accumulate) v = _mm256_add_ps(v, _mm256_maskload_ps(o, mask));
        _mm256_maskstore_ps(o, mask, v);
      }
    }
  }
}

// The same for a bfloat16 out (one k block only: nothing to accumulate), each value rounded to
// nearest even as torch rounds float32 to bfloat16 (NaN → a quiet NaN).
void store_tile(const float* tile, int64_t ld_tile, uint16_t* out, int64_t ldo, int64_t rows, int64_t cols,
                const float* bias, bool /*accumulate*/) {
  int64_t c = 0;
#ifdef __AVX512F__
  // whole 16-column panels on zmm: one conversion instruction per 16 values with AVX512-BF16
  // (bf16::pack16) where the 8-lane rounding takes ~8 integer ops per 8
  for (; c + 16 <= cols; c += 16) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r)
      bf16::store16(out + r * ldo + c, _mm512_add_ps(_mm512_load_ps(tile + r * ld_tile + c), b));
  }
#endif
  for (; c < cols; c += 8) {
    const int64_t n = std::min<int64_t>(8, cols - c);
    const __m256 b = bias != nullptr ? _mm256_maskload_ps(bias + c, first_lanes(n)) : _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m128i packed = bf16::pack8(_mm256_add_ps(_mm256_load_ps(tile + r * ld_tile + c), b));
      uint16_t* o = out + r * ldo + c;
      if (n == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
      } else {
        alignas(16) uint16_t lanes[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
        for (int64_t j = 0; j < n; ++j) o[j] = lanes[j];
      }
    }
  }
}

// The gate/up projection's epilogue: W packed with each 16-column panel holding 8 gate columns
// then the same 8 up columns (cpu_gemm.NativeGateUp), so a tile's columns c..c+15 become out's
// columns c/2..c/2+7 = silu(gate) · up, and the [T, 2I] product is never stored. One k block
// only. The same arithmetic as the fused ops' silu_mul (silu.h), so the bits match gemm + silu_mul;
// bfloat16: gate and up rounded as the GEMM would store them, silu rounded, then the product.
template <typename OT>
void store_tile_silu_mul(const float* tile, int64_t ld_tile, OT* out, int64_t ldo, int64_t rows, int64_t cols) {
  int64_t c0 = 0, r0 = 0;
#ifdef __AVX512F__
  // On zmm, 16 outputs per silu16 (the same bits per lane as silu8): two panels' 8 + 8 gates and
  // 8 + 8 ups give 16 adjacent outputs of a row; a last odd panel pairs two rows. Against the
  // 8-lane loop the gate/up GEMM (small model, bfloat16, 256 rows) ran ~1.02-1.04x.
  auto silu_mul16 = [](__m512 a, __m512 b) {  // a, b: panels of 8 gates then 8 ups → 16 outputs
    const __m512 g = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 u = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    if constexpr (sizeof(OT) == 2) return _mm512_mul_ps(bf16::round16(silu::silu16(bf16::round16(g))), bf16::round16(u));
    else return _mm512_mul_ps(silu::silu16(g), u);
  };
  for (; c0 + 32 <= cols; c0 += 32)
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = silu_mul16(_mm512_load_ps(tile + r * ld_tile + c0), _mm512_load_ps(tile + r * ld_tile + c0 + 16));
      if constexpr (sizeof(OT) == 2) bf16::store16(out + r * ldo + c0 / 2, v);
      else _mm512_storeu_ps(out + r * ldo + c0 / 2, v);
    }
  if (c0 + 16 == cols)
    for (; r0 + 2 <= rows; r0 += 2) {
      const __m512 v = silu_mul16(_mm512_load_ps(tile + r0 * ld_tile + c0), _mm512_load_ps(tile + (r0 + 1) * ld_tile + c0));
      OT* o = out + r0 * ldo + c0 / 2;
      if constexpr (sizeof(OT) == 2) {
        const __m256i packed = bf16::pack16(v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + ldo), _mm256_extracti128_si256(packed, 1));
      } else {
        _mm256_storeu_ps(o, _mm512_castps512_ps256(v));
        _mm256_storeu_ps(o + ldo, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));  // (AVX512F only)
      }
    }
#endif
  for (int64_t c = c0; c < cols; c += 16)
    for (int64_t r = c == c0 ? r0 : 0; r < rows; ++r) {  // (rows the pairs above left)
      __m256 g = _mm256_load_ps(tile + r * ld_tile + c), u = _mm256_load_ps(tile + r * ld_tile + c + 8);
      OT* o = out + r * ldo + c / 2;
      if constexpr (sizeof(OT) == 2) {
        const __m256 s = bf16::round8(silu::silu8(bf16::round8(g)));
        bf16::store8(o, _mm256_mul_ps(s, bf16::round8(u)));
      } else {
        _mm256_storeu_ps(o, _mm256_mul_ps(silu::silu8(g), u));
      }
    }
}
