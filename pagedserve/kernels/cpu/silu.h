// SiLU on 8 float32 lanes, shared by the fused ops (silu_mul) and the GEMM that stores the gate/up
// projection as silu(gate)·up, so both give the same bits. Both libraries are built with
// -ffp-contract=off: the separate multiplies and adds below must not become fused multiply-adds.
#pragma once
#include <immintrin.h>

namespace silu {

// exp(x): Cephes-style range reduction and a degree-6 polynomial, ~1 ulp.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// silu(g) = g / (1 + exp(-g))
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

#ifdef __AVX512F__
// exp8 and silu8 on 16 lanes, the same operations in the same order (every one is exactly rounded;
// the last, y * 2^fx, as one scalef, which rounds the same product), so each lane's bits are exp8's / silu8's: silu_mul may run 16 lanes at a time and still match the
// GEMM's 8-lane epilogue.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
  x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, _mm512_mul_ps(x, x)), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  // y * 2^fx in one instruction (fx is a whole number in [-126, 127]): the product exp8 rounds
  return _mm512_scalef_ps(y, fx);
}

inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

}  // namespace silu
