// bfloat16 <-> float32 for the CPU libraries (gemm_cpu.cpp, fused_ops_cpu.cpp): bfloat16 is the
// high half of a float32, so widening is a shift; narrowing rounds to nearest, ties to even, and
// turns a NaN into the quiet NaN 0x7fc0, exactly as torch converts float32 to bfloat16.
#pragma once
#include <stdint.h>

#include <cmath>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace bf16 {

inline float to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

inline uint16_t from_float(float v) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  if (std::isnan(v)) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX2__)
// 8 bfloat16 at p as float32 lanes
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// float32 lanes rounded as from_float, each bfloat16 in the low half of its 32-bit lane
inline __m256i bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
// the 8 rounded values packed into 16 bytes
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// one conversion instruction, as pack16 below (the same bits under the engine's FTZ/DAZ)
inline __m128i pack8(__m256 v) {
  const __m128i r = reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v));
  return _mm_mask_blend_epi16(_mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm_set1_epi16(0x7fc0));
}
// v as bfloat16 would hold it, widened back
inline __m256 round8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(pack8(v)), 16));
}
#else
inline __m128i pack8(__m256 v) {
  const __m256i r = bits8(v);  // each lane < 65536, so the unsigned saturation keeps it
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
// v as bfloat16 would hold it, widened back
inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits8(v), 16)); }
#endif
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack8(v)); }
#endif

#if defined(__AVX512F__)
// the 16-lane forms of load8 / bits8 / store8 / round8
inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512i bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
}
// the 16 rounded values packed into 32 bytes. With AVX512-BF16 one conversion instruction rounds
// them (to nearest, ties to even, as bits16): the same bits for every input but subnormals, which
// it flushes to zero; the engine runs with flush-to-zero and denormals-are-zero set (engine.py),
// where no arithmetic result is subnormal and a subnormal input reads as zero anyway. Its quieted
// NaNs become 0x7fc0 as above. ~1.2x silu_mul's bfloat16 loop.
inline __m256i pack16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm256_set1_epi16(0x7fc0));
#else
  return _mm512_cvtepi32_epi16(bits16(v));
#endif
}
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack16(v)); }
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pack16(v)), 16));
}
#endif

}  // namespace bf16
