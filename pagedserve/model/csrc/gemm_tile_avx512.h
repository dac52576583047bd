// The AVX-512 register tile of the float32 GEMM (gemm_cpu.cpp): 8 rows × up to 3 W panels (48
// columns) of out in 24 zmm accumulators.
//
// Why a second tile: on CPUs with AVX-512 (Intel Xeon since Skylake-SP, AMD Zen 4) the AVX2 tile
// uses half of each FMA unit and reaches ~0.6× oneDNN's float32 rate there; this one, with the
// same packed W, passes it (benchmarks/cpu_gemm_ab.py). Per k it loads the three panels' 16-wide
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

// tile[8][48] (columns past np × 16 untouched) = packed x [kc][8] · np W panel slices, panel j
// at w + j × panel_stride, each [kc][16]
template <int NP>
__attribute__((target("avx512f"))) void tile_product_np(const float* x, const float* w, int64_t panel_stride,
                                                        int64_t kc, float* tile) {
  __m512 acc[kMR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    __m512 b[NP];
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_ps(w + j * panel_stride + kk * 16);
#pragma GCC unroll 8
    for (int r = 0; r < kMR; ++r) {
      const __m512 a = _mm512_set1_ps(x[kk * kMR + r]);
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(tile + r * kCols + j * 16, acc[r][j]);
}

inline void tile_product(const float* x, const float* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
  if (np == 3)
    tile_product_np<3>(x, w, panel_stride, kc, tile);
  else if (np == 2)
    tile_product_np<2>(x, w, panel_stride, kc, tile);
  else
    tile_product_np<1>(x, w, panel_stride, kc, tile);
}

// The same tile over bfloat16 W panels packed in k pairs ([K/2][16][2], see gemm_bf16kp_pack):
// one 64-byte load holds a panel's 16 columns at k and k + 1, a 32-bit lane being (column c at
// k, column c at k + 1). Shifting the lanes left by 16 gives the k row as float32, masking off
// the low halves the k + 1 row: one integer op per 16 widened columns, 24 FMAs per 3. Products
// and sums are float32, as in the float32 tile; the weights are half the bytes.
//
// Why not vdpbf16ps (AVX512-BF16), which multiplies the pairs directly: on the Xeons measured
// here it issues once per two cycles, against two float32 FMAs per cycle (benchmarks/
// cpu_gemm_ab.py: 80 vs 166 GFLOP/s per core), and oneDNN's bfloat16 GEMM, which uses it,
// runs at ~0.7× its own float32 rate there.
// tile[8][48] = packed x [kc rounded up to even][8] · np W panel slices ([kc/2][16][2] each)
template <int NP>
__attribute__((target("avx512f"))) void tile_product_bf16_np(const float* x, const uint16_t* w,
                                                             int64_t panel_stride, int64_t kpairs, float* tile) {
  __m512 acc[kMR][NP];
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
#pragma GCC unroll 8
  for (int r = 0; r < kMR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512 b[NP];
#pragma GCC unroll 3
      for (int j = 0; j < NP; ++j) {
        const __m512i pairs = _mm512_loadu_si512(w + j * panel_stride + kp * 32);
        b[j] = _mm512_castsi512_ps(half == 0 ? _mm512_slli_epi32(pairs, 16) : _mm512_and_si512(pairs, high_halves));
      }
      const float* xk = x + (2 * kp + half) * kMR;
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

inline void tile_product_bf16(const float* x, const uint16_t* w, int64_t panel_stride, int64_t kpairs, int np,
                              float* tile) {
  if (np == 3)
    tile_product_bf16_np<3>(x, w, panel_stride, kpairs, tile);
  else if (np == 2)
    tile_product_bf16_np<2>(x, w, panel_stride, kpairs, tile);
  else
    tile_product_bf16_np<1>(x, w, panel_stride, kpairs, tile);
}

// 12 independent chains of 16-wide FMAs, `iters` rounds, in registers (the FMA peak's loop). In
// assembly: written with intrinsics, GCC folds the identical chains into one.
inline void fma_chains(int64_t iters) {
  asm volatile(
      "vxorps %%zmm0, %%zmm0, %%zmm0\n\t"
      "vxorps %%zmm1, %%zmm1, %%zmm1\n\t"
      "vmovaps %%zmm0, %%zmm4\n\t" "vmovaps %%zmm0, %%zmm5\n\t" "vmovaps %%zmm0, %%zmm6\n\t"
      "vmovaps %%zmm0, %%zmm7\n\t" "vmovaps %%zmm0, %%zmm8\n\t" "vmovaps %%zmm0, %%zmm9\n\t"
      "vmovaps %%zmm0, %%zmm10\n\t" "vmovaps %%zmm0, %%zmm11\n\t" "vmovaps %%zmm0, %%zmm12\n\t"
      "vmovaps %%zmm0, %%zmm13\n\t" "vmovaps %%zmm0, %%zmm14\n\t" "vmovaps %%zmm0, %%zmm15\n\t"
      "1:\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm4\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm5\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm6\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm7\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm8\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm9\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm10\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm11\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm12\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm13\n\t"
      "vfmadd231ps %%zmm0, %%zmm1, %%zmm14\n\t" "vfmadd231ps %%zmm0, %%zmm1, %%zmm15\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : [n] "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13",
        "xmm14", "xmm15");
}

inline bool supported() { return __builtin_cpu_supports("avx512f"); }

}  // namespace avx512
