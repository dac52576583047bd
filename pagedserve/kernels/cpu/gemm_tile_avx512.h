// The AVX-512 register tile of the float32 GEMM (gemm_cpu.cpp): 8 rows × up to 3 W panels (48
// columns) of out in 24 zmm accumulators.
//
// Why a second tile: on CPUs with AVX-512 (Intel Xeon since Skylake-SP, AMD Zen 4) the AVX2 tile
// uses half of each FMA unit and reaches ~0.6× oneDNN's float32 rate there; this one, with the
// same packed W, matches it (benchmarks/cpu_gemm_ab.py). Per k it loads the three panels' 16-wide
// vectors and broadcasts 8 x values: 24 FMAs for 11 loads, well inside two load ports. The
// panels stay in their packed [N/16][K][16] form (three streams at a stride of K × 16 floats),
// so the weights are packed once whatever tile runs them.
//
// Compiled for AVX-512 through the target attribute, so the library still builds (and runs the
// AVX2 tile) where -march=native has no AVX-512; the caller checks the CPU before calling it.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace avx512 {

constexpr int64_t kMR = 8;       // rows of the tile
constexpr int64_t kPanels = 3;   // W panels (16 columns each) side by side in the tile
constexpr int64_t kCols = kPanels * 16;

// One k row of a W panel as 16 float32 columns. float32 panels are [K][16]. bfloat16 panels are
// packed in k pairs ([K/2][16][2], see gemm_bf16kp_pack): one 64-byte load holds a panel's 16
// columns at k and k + 1, a 32-bit lane being (column c at k, column c at k + 1); shifting the
// lanes left by 16 gives the k row as float32, masking off the low halves the k + 1 row. One
// integer op per 16 widened columns, 24 FMAs per 3; the weights are half the bytes.
//
// Why widen rather than use vdpbf16ps (AVX512-BF16), which multiplies the pairs directly: on the
// Xeons measured here it issues once per two cycles, against two float32 FMAs per cycle (80 vs 166
// GFLOP/s per core), and oneDNN's bfloat16 GEMM, which uses it, runs at ~0.75× this tile there.
// Where vdpbf16ps is the faster one, tile_product_dot below runs instead; float32 x always widens.
template <typename WT>
struct PanelRows;
template <>
struct PanelRows<float> {
  static constexpr int kStep = 1;  // k rows per packed row
  __attribute__((target("avx512f"))) static __m512 row(const float* w, int64_t step, int /*half*/) {
    return _mm512_loadu_ps(w + step * 16);
  }
};
template <>
struct PanelRows<uint16_t> {
  static constexpr int kStep = 2;
  __attribute__((target("avx512f"))) static __m512 row(const uint16_t* w, int64_t step, int half) {
    const __m512i pairs = _mm512_loadu_si512(w + step * 32);
    return _mm512_castsi512_ps(half == 0 ? _mm512_slli_epi32(pairs, 16)
                                         : _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

// tile[8][48] (columns past np × 16 untouched) = packed x [kc, rounded up to the panel's k step][8]
// · np W panel slices, panel j at w + j × panel_stride. Products and sums are float32.
template <int NP, typename WT>
__attribute__((target("avx512f"))) void tile_product_np(const float* x, const WT* w, int64_t panel_stride,
                                                        int64_t kc, float* tile) {
  constexpr int kStep = PanelRows<WT>::kStep;
  __m512 acc[kMR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t step = 0; step < (kc + kStep - 1) / kStep; ++step) {
#pragma GCC unroll 2
    for (int half = 0; half < kStep; ++half) {
      __m512 b[NP];
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) b[j] = PanelRows<WT>::row(w + j * panel_stride, step, half);
      const float* xk = x + (step * kStep + half) * kMR;
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m512 a = _mm512_set1_ps(xk[r]);
#pragma GCC unroll 3
        for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(tile + r * kCols + j * 16, acc[r][j]);
}

// the tile over float32 (WT = float) or k-pair bfloat16 (WT = uint16_t) panels, np of them (1-3)
template <typename WT>
inline void tile_product(const float* x, const WT* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
  if (np == 3)
    tile_product_np<3>(x, w, panel_stride, kc, tile);
  else if (np == 2)
    tile_product_np<2>(x, w, panel_stride, kc, tile);
  else
    tile_product_np<1>(x, w, panel_stride, kc, tile);
}

// The same tile over k-pair bfloat16 panels with bfloat16 x, on vdpbf16ps (AVX512-BF16): each
// instruction multiplies 16 lanes of (k, k + 1) pairs and adds both products to a float32 lane,
// twice the FLOPs of an FMA. Where it issues as often as an FMA (AMD Zen 4: 228 vs 115 GFLOP/s
// per core in a register loop) that doubles the tile's rate; where it issues half as often (the
// Xeons above) it only ties the widening tile, so the library probes which is faster
// (gemm_cpu.cpp, bf16_dot_is_faster). x comes packed as bfloat16 pairs, one 32-bit word per row
// and k pair ([kc/2][8]), broadcast straight from memory into each instruction.
// tile[8][48] (columns past np × 16 untouched) = x pairs [ceil(kc/2)][8] · np k-pair W panel
// slices, panel j at w + j × panel_stride. Products exact, sums float32 (denormals flushed).
template <int NP>
__attribute__((target("avx512f,avx512bf16"))) void tile_product_dot_np(const uint32_t* x, const uint16_t* w,
                                                                      int64_t panel_stride, int64_t kc, float* tile) {
  __m512 acc[kMR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t step = 0; step < (kc + 1) / 2; ++step) {
    __m512bh b[NP];
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + step * 32);
    const uint32_t* xk = x + step * kMR;
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[r]));
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(tile + r * kCols + j * 16, acc[r][j]);
}

inline void tile_product_dot(const uint32_t* x, const uint16_t* w, int64_t panel_stride, int64_t kc, int np,
                             float* tile) {
  if (np == 3)
    tile_product_dot_np<3>(x, w, panel_stride, kc, tile);
  else if (np == 2)
    tile_product_dot_np<2>(x, w, panel_stride, kc, tile);
  else
    tile_product_dot_np<1>(x, w, panel_stride, kc, tile);
}

// The same tile shape over int8 panels with uint8 x, on vpdpbusd (AVX512-VNNI): each instruction
// multiplies 16 lanes of 4 (uint8, int8) pairs and adds the 4 products to an int32 lane, four
// times an FMA's multiply-adds; on AMD Zen 4 it issues as often as an FMA. The sums are exact
// integers. Only the greedy LM-head screen runs it (greedy_screen.h): W int8 packed in k quads
// ([K/4][16][4] per panel, see greedy_screen_int8_pack), x packed as one 32-bit word of 4 k per
// row ([ceil(kc/4)][8]). tile[8][48] receives the int32 sums' bits.
template <int NP>
__attribute__((target("avx512f,avx512vnni"))) void tile_product_vnni_np(const uint32_t* x, const int8_t* w,
                                                                       int64_t panel_stride, int64_t kc,
                                                                       float* tile) {
  __m512i acc[kMR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int64_t step = 0; step < (kc + 3) / 4; ++step) {
    __m512i b[NP];
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_si512(w + j * panel_stride + step * 64);
    const uint32_t* xk = x + step * kMR;
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(xk[r]));
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, b[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) _mm512_storeu_si512(tile + r * kCols + j * 16, acc[r][j]);
}

inline void tile_product_vnni(const uint32_t* x, const int8_t* w, int64_t panel_stride, int64_t kc, int np,
                              float* tile) {
  if (np == 3)
    tile_product_vnni_np<3>(x, w, panel_stride, kc, tile);
  else if (np == 2)
    tile_product_vnni_np<2>(x, w, panel_stride, kc, tile);
  else
    tile_product_vnni_np<1>(x, w, panel_stride, kc, tile);
}

// Packs x for the tiles above: out[k * 8 + r] = row r's k-th 32-bit word, for 8 rows of 16 words
// (row r at src + r × ld_bytes): float32 x values, or the bfloat16 pairs of the vdpbf16ps tile.
// Word by word (pack_x_panel, Avx512DotTile::pack_x) GCC's code moved each word on its own;
// `perf record` put ~3 % of small float32 W2 and ~2 % of bfloat16 W1 there. Here 8 loads, 16
// unpacks and 32 16-byte stores move the 128 words.
__attribute__((target("avx512f"))) inline void pack_x_8x16(const void* src_words, int64_t ld_bytes, void* out_words) {
  const char* src = static_cast<const char*>(src_words);
  float* out = static_cast<float*>(out_words);
  __m512 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // t[2i] lane L: words 4L, 4L + 1 of rows 2i, 2i + 1 interleaved; t[2i + 1]: 4L + 2, 4L + 3
    const __m512 a = _mm512_loadu_ps(src + 2 * i * ld_bytes), b = _mm512_loadu_ps(src + (2 * i + 1) * ld_bytes);
    t[2 * i] = _mm512_unpacklo_ps(a, b);
    t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // u[4h + a] lane L: word 4L + a of rows 4h .. 4h + 3
    const __m512d t0 = _mm512_castps_pd(t[4 * h]), t1 = _mm512_castps_pd(t[4 * h + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * h + 2]), t3 = _mm512_castps_pd(t[4 * h + 3]);
    u[4 * h + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * h + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * h + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
#pragma GCC unroll 4
  for (int a = 0; a < 4; ++a) {
    // 128-bit lane L of u[a] holds rows 0-3 of word 4L + a, of u[4 + a] rows 4-7
    _mm_storeu_ps(out + a * kMR, _mm512_castps512_ps128(u[a]));
    _mm_storeu_ps(out + a * kMR + 4, _mm512_castps512_ps128(u[4 + a]));
    _mm_storeu_ps(out + (4 + a) * kMR, _mm512_extractf32x4_ps(u[a], 1));
    _mm_storeu_ps(out + (4 + a) * kMR + 4, _mm512_extractf32x4_ps(u[4 + a], 1));
    _mm_storeu_ps(out + (8 + a) * kMR, _mm512_extractf32x4_ps(u[a], 2));
    _mm_storeu_ps(out + (8 + a) * kMR + 4, _mm512_extractf32x4_ps(u[4 + a], 2));
    _mm_storeu_ps(out + (12 + a) * kMR, _mm512_extractf32x4_ps(u[a], 3));
    _mm_storeu_ps(out + (12 + a) * kMR + 4, _mm512_extractf32x4_ps(u[4 + a], 3));
  }
}

inline bool vnni_supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"); }

// 12 independent chains of one zmm instruction OP (zmm4..15 += f(zmm0, zmm1)), `iters` rounds, in
// registers: the loops the FMA peak and the vdpbf16ps probe time. In assembly: written with
// intrinsics, GCC folds the identical chains into one.
#define PS_ZMM_CHAINS(OP, iters)                                                                        \
  asm volatile(                                                                                        \
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                              \
      "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"                                                              \
      "vmovaps %%zmm0, %%zmm4\n\t" "vmovaps %%zmm0, %%zmm5\n\t" "vmovaps %%zmm0, %%zmm6\n\t"            \
      "vmovaps %%zmm0, %%zmm7\n\t" "vmovaps %%zmm0, %%zmm8\n\t" "vmovaps %%zmm0, %%zmm9\n\t"            \
      "vmovaps %%zmm0, %%zmm10\n\t" "vmovaps %%zmm0, %%zmm11\n\t" "vmovaps %%zmm0, %%zmm12\n\t"          \
      "vmovaps %%zmm0, %%zmm13\n\t" "vmovaps %%zmm0, %%zmm14\n\t" "vmovaps %%zmm0, %%zmm15\n\t"         \
      "1:\n\t"                                                                                         \
      OP " %%zmm0, %%zmm1, %%zmm4\n\t" OP " %%zmm0, %%zmm1, %%zmm5\n\t"                                 \
      OP " %%zmm0, %%zmm1, %%zmm6\n\t" OP " %%zmm0, %%zmm1, %%zmm7\n\t"                                 \
      OP " %%zmm0, %%zmm1, %%zmm8\n\t" OP " %%zmm0, %%zmm1, %%zmm9\n\t"                                 \
      OP " %%zmm0, %%zmm1, %%zmm10\n\t" OP " %%zmm0, %%zmm1, %%zmm11\n\t"                               \
      OP " %%zmm0, %%zmm1, %%zmm12\n\t" OP " %%zmm0, %%zmm1, %%zmm13\n\t"                               \
      OP " %%zmm0, %%zmm1, %%zmm14\n\t" OP " %%zmm0, %%zmm1, %%zmm15\n\t"                               \
      "dec %[n]\n\t"                                                                                   \
      "jnz 1b\n\t"                                                                                     \
      "vzeroupper\n\t"                                                                                 \
      : [n] "+r"(iters)                                                                                \
      :                                                                                                \
      : "cc", "xmm0", "xmm1", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",  \
        "xmm13", "xmm14", "xmm15")

inline bool dot_supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"); }

inline void fma_chains(int64_t iters) { PS_ZMM_CHAINS("vfmadd231ps", iters); }
#undef PS_ZMM_CHAINS

inline bool supported() { return __builtin_cpu_supports("avx512f"); }

}  // namespace avx512
