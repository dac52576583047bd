// Float32 GEMM for the linear layers on AVX2 + FMA CPUs: out[M, N] = x[M, K] · W[N, K]ᵀ (+ bias).
//
// Why our own: oneDNN's float32 GEMM reaches ~60-80 % of this class of CPU's FMA peak on the
// decoder's shapes (M = 32..2048 rows, K = 512..3000, N = 512..32000), and the linears are
// 55-75 % of a CPU workload's time. The layout below keeps the FMA units ~90 % busy on them.
//
// Layout (the classic Goto/BLIS decomposition, sized for 32 KB L1 and 512 KB L2 per core):
//   - W is packed once, at load time, into panels of 16 output columns: [N/16][K][16]. A panel's
//     K-slice is contiguous, so the kernel reads it as two aligned 8-wide vectors per k.
//   - x is packed per call, a block of up to kRowBlock rows × kc columns at a time, into panels
//     of 6 rows: [rows/6][kc][6], zero-padded, so the kernel broadcasts from one sequential stream.
//   - The micro-kernel keeps a 6 × 16 tile of out in 12 ymm registers and adds, per k, the outer
//     product of 6 broadcast x values and the two W vectors: 12 FMAs for 8 loads. It is written
//     in inline assembly because GCC spills one of the 12 accumulators when it allocates them.
//   - Threads take the panels of W a few at a time (each panel is read by one thread); they share
//     the packed x block, or each packs its own copy where that measured faster (gemm_tiles).
//   - On CPUs with AVX-512 the driver runs an 8-row × 48-column zmm tile instead, over the same
//     packed W (gemm_tile_avx512.h): the ymm tile uses half of each FMA unit there.
// Sums run over k in order within a kc block, then block by block: float32 throughout.
// Plain C ABI, called through ctypes (see model/cpu_gemm.py).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "gemm_tile_avx512.h"
#include "greedy_screen.h"
#include "silu.h"

namespace {

constexpr int64_t kMR = 6;           // rows of the register tile
constexpr int64_t kNR = 16;          // columns of the register tile = the width of a W panel
// K above kMaxKBlock is cut into blocks of about kKBlock. Each block after the first re-reads and
// re-writes the output, so fewer, longer blocks win even though a panel's slice (kc × 16 floats,
// 64 KB at kc = 1024) then sits in L2 rather than L1: on the medium model's shapes (K = 1024 and
// 2816) kc ≈ 1024 measured 3-7 % faster than kc ≈ 512, the same on the small model's. The AVX2
// tile and the AVX-512 float32 tile go further where L2 allows (their k_blocking).
constexpr int64_t kMaxKBlock = 1100;
constexpr int64_t kKBlock = 1024;
constexpr int64_t kRowBlock = 510;  // rows of x packed at a time (a multiple of kMR): 2 MB at kc = 1024

// One k step of the tile: two W vectors, six broadcasts, twelve FMAs into ymm4..ymm15.
#define PS_GEMM_STEP(i)                                                                                  \
  "vmovaps " #i "*64(%[w]), %%ymm0\n\t"                                                                  \
  "vmovaps " #i "*64+32(%[w]), %%ymm1\n\t"                                                               \
  "vbroadcastss " #i "*24+0(%[x]), %%ymm2\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm4\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm5\n\t"                                                               \
  "vbroadcastss " #i "*24+4(%[x]), %%ymm3\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm3, %%ymm6\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm3, %%ymm7\n\t"                                                               \
  "vbroadcastss " #i "*24+8(%[x]), %%ymm2\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm8\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm9\n\t"                                                               \
  "vbroadcastss " #i "*24+12(%[x]), %%ymm3\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm3, %%ymm10\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm3, %%ymm11\n\t"                                                              \
  "vbroadcastss " #i "*24+16(%[x]), %%ymm2\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm12\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm13\n\t"                                                              \
  "vbroadcastss " #i "*24+20(%[x]), %%ymm3\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm3, %%ymm14\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm3, %%ymm15\n\t"

// tile[6][16] = packed x [kc][6] · packed W slice [kc][16]
void tile_product(const float* x, const float* w, int64_t kc, float* tile) {
  int64_t k4 = kc / 4, k1 = kc % 4;
  asm volatile(
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "vxorps %%ymm12, %%ymm12, %%ymm12\n\t"
      "vxorps %%ymm13, %%ymm13, %%ymm13\n\t"
      "vxorps %%ymm14, %%ymm14, %%ymm14\n\t"
      "vxorps %%ymm15, %%ymm15, %%ymm15\n\t"
      "test %[k4], %[k4]\n\t"
      "jz 2f\n\t"
      "1:\n\t"  // (no software prefetch: the panels stream in order and a prefetch costs a load slot, -3-7 %)
      PS_GEMM_STEP(0) PS_GEMM_STEP(1) PS_GEMM_STEP(2) PS_GEMM_STEP(3)
      "add $256, %[w]\n\t"
      "add $96, %[x]\n\t"
      "dec %[k4]\n\t"
      "jnz 1b\n\t"
      "2:\n\t"
      "test %[k1], %[k1]\n\t"
      "jz 4f\n\t"
      "3:\n\t"
      PS_GEMM_STEP(0)
      "add $64, %[w]\n\t"
      "add $24, %[x]\n\t"
      "dec %[k1]\n\t"
      "jnz 3b\n\t"
      "4:\n\t"
      "vmovaps %%ymm4, 0(%[t])\n\t"
      "vmovaps %%ymm5, 32(%[t])\n\t"
      "vmovaps %%ymm6, 64(%[t])\n\t"
      "vmovaps %%ymm7, 96(%[t])\n\t"
      "vmovaps %%ymm8, 128(%[t])\n\t"
      "vmovaps %%ymm9, 160(%[t])\n\t"
      "vmovaps %%ymm10, 192(%[t])\n\t"
      "vmovaps %%ymm11, 224(%[t])\n\t"
      "vmovaps %%ymm12, 256(%[t])\n\t"
      "vmovaps %%ymm13, 288(%[t])\n\t"
      "vmovaps %%ymm14, 320(%[t])\n\t"
      "vmovaps %%ymm15, 352(%[t])\n\t"
      : [x] "+r"(x), [w] "+r"(w), [k4] "+r"(k4), [k1] "+r"(k1)
      : [t] "r"(tile)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef PS_GEMM_STEP

// The same tile over a bfloat16 W panel (see gemm_bf16_pack for its interleaved layout): per k,
// one 32-byte load holds the 16 columns; a shift by 16 turns the even slots (columns 0-7) into
// float32, and masking off the low halves turns the odd slots (columns 8-15) into float32. Two
// integer ops per 12 FMAs, on ports the FMAs don't use; half the weight bytes of float32.
#define PS_GEMM_STEP_BF16(i)                                                                             \
  "vmovdqa " #i "*32(%[w]), %%ymm1\n\t"                                                                  \
  "vpslld $16, %%ymm1, %%ymm0\n\t"                                                                       \
  "vpand %%ymm3, %%ymm1, %%ymm1\n\t"                                                                     \
  "vbroadcastss " #i "*24+0(%[x]), %%ymm2\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm4\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm5\n\t"                                                               \
  "vbroadcastss " #i "*24+4(%[x]), %%ymm2\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm6\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm7\n\t"                                                               \
  "vbroadcastss " #i "*24+8(%[x]), %%ymm2\n\t"                                                           \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm8\n\t"                                                               \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm9\n\t"                                                               \
  "vbroadcastss " #i "*24+12(%[x]), %%ymm2\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm10\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm11\n\t"                                                              \
  "vbroadcastss " #i "*24+16(%[x]), %%ymm2\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm12\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm13\n\t"                                                              \
  "vbroadcastss " #i "*24+20(%[x]), %%ymm2\n\t"                                                          \
  "vfmadd231ps %%ymm0, %%ymm2, %%ymm14\n\t"                                                              \
  "vfmadd231ps %%ymm1, %%ymm2, %%ymm15\n\t"

// tile[6][16] = packed x [kc][6] (float32) · packed bfloat16 W slice [kc][16]
void tile_product(const float* x, const uint16_t* w, int64_t kc, float* tile) {
  int64_t k4 = kc / 4, k1 = kc % 4;
  asm volatile(
      "vpcmpeqd %%ymm3, %%ymm3, %%ymm3\n\t"
      "vpslld $16, %%ymm3, %%ymm3\n\t"  // 0xffff0000 in every lane: keeps a lane's high bfloat16
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "vxorps %%ymm12, %%ymm12, %%ymm12\n\t"
      "vxorps %%ymm13, %%ymm13, %%ymm13\n\t"
      "vxorps %%ymm14, %%ymm14, %%ymm14\n\t"
      "vxorps %%ymm15, %%ymm15, %%ymm15\n\t"
      "test %[k4], %[k4]\n\t"
      "jz 2f\n\t"
      "1:\n\t"
      PS_GEMM_STEP_BF16(0) PS_GEMM_STEP_BF16(1) PS_GEMM_STEP_BF16(2) PS_GEMM_STEP_BF16(3)
      "add $128, %[w]\n\t"
      "add $96, %[x]\n\t"
      "dec %[k4]\n\t"
      "jnz 1b\n\t"
      "2:\n\t"
      "test %[k1], %[k1]\n\t"
      "jz 4f\n\t"
      "3:\n\t"
      PS_GEMM_STEP_BF16(0)
      "add $32, %[w]\n\t"
      "add $24, %[x]\n\t"
      "dec %[k1]\n\t"
      "jnz 3b\n\t"
      "4:\n\t"
      "vmovaps %%ymm4, 0(%[t])\n\t"
      "vmovaps %%ymm5, 32(%[t])\n\t"
      "vmovaps %%ymm6, 64(%[t])\n\t"
      "vmovaps %%ymm7, 96(%[t])\n\t"
      "vmovaps %%ymm8, 128(%[t])\n\t"
      "vmovaps %%ymm9, 160(%[t])\n\t"
      "vmovaps %%ymm10, 192(%[t])\n\t"
      "vmovaps %%ymm11, 224(%[t])\n\t"
      "vmovaps %%ymm12, 256(%[t])\n\t"
      "vmovaps %%ymm13, 288(%[t])\n\t"
      "vmovaps %%ymm14, 320(%[t])\n\t"
      "vmovaps %%ymm15, 352(%[t])\n\t"
      : [x] "+r"(x), [w] "+r"(w), [k4] "+r"(k4), [k1] "+r"(k1)
      : [t] "r"(tile)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef PS_GEMM_STEP_BF16

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

inline float to_float(float v) { return v; }
inline float to_float(uint16_t h) { return bf16::to_float(h); }

// rows ≤ MR of x (row stride ldx), columns [0, kc), as float32 [kc_padded][MR], zero-padded past
// `rows` and past kc
template <int64_t MR, typename XT>
void pack_x_panel(const XT* x, int64_t ldx, int64_t rows, int64_t kc, int64_t kc_padded, float* out) {
  for (int64_t k = 0; k < kc_padded; ++k)
    for (int64_t r = 0; r < MR; ++r) out[k * MR + r] = r < rows && k < kc ? to_float(x[r * ldx + k]) : 0.f;
}

// The packed-x block, reused across calls (one per calling thread), 64-byte aligned.
float* x_block_buffer(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats + 16) buf.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~static_cast<uintptr_t>(63));
}

// How a tile cuts K: one block up to `max`, else blocks of about `target`.
struct KBlocking {
  int64_t max = kMaxKBlock, target = kKBlock;
};

// k blocks as long as half of L2 holds `per_k` bytes per k (a tile's W slice and x panel) where
// that is longer than the default, else the default
inline KBlocking l2_k_blocking(int64_t per_k) {
  static const int64_t l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // bytes; 0 or -1 where unknown
  const int64_t fits = l2 > 0 ? l2 / 2 / per_k / 4 * 4 : 0;
  return fits > kMaxKBlock ? KBlocking{fits, fits} : KBlocking{};
}

// the length of the k blocks of a K-long sum, as even as whole blocks allow
int64_t k_block(int64_t k, KBlocking kb) {
  if (k <= kb.max) return k;
  const int64_t blocks = (k + kb.target - 1) / kb.target;
  return ((k + blocks - 1) / blocks + 3) / 4 * 4;
}

// The register tiles the driver below runs: how many rows and W panels one covers, how many k
// rows a packed W panel has (w_k: bfloat16 k pairs round K up to even) and so how long a packed x
// panel of kc columns is, how to run it, and how many rows of x to pack at a time (a multiple of
// the tile's rows; ~2 MB at kc = 1024).
template <int64_t MR, int64_t KStep>
struct TileShape {
  static constexpr int64_t kMR = MR;
  template <typename WT>
  static KBlocking k_blocking() { return {}; }
  static int64_t w_k(int64_t k) { return (k + KStep - 1) / KStep * KStep; }
  static int64_t x_panel_elems(int64_t kc) { return MR * w_k(kc); }
  template <typename XT>
  static void pack_x(const XT* x, int64_t ldx, int64_t rows, int64_t kc, float* out) {
    pack_x_panel<MR>(x, ldx, rows, kc, w_k(kc), out);
  }
};
struct Avx2Tile : TileShape<6, 1> {
  static constexpr int64_t kPanels = 1, kCols = kPanels * kNR, kRowBlock = 510;
  // k blocks as long as a W panel's slice and an x panel (kc × (16 weights + 6 floats)) fit in
  // half of L2: the down projection (K = 2816) then runs in one block where L2 is 512 KB (AMD
  // Zen 2/3). Against blocks of ~1024, a pass over the medium model's 12 layers of float32
  // weights (larger than L3, as in the engine) measured 1.08× at 16 rows, 1.05× at 32, 1.02-1.03×
  // at 64-256; bfloat16 weights 0.997-1.01×; the small model's (K = 1536) 1.01-1.05×.
  template <typename WT>
  static KBlocking k_blocking() {
    return l2_k_blocking(kNR * static_cast<int64_t>(sizeof(WT)) + kMR * static_cast<int64_t>(sizeof(float)));
  }
  template <typename WT>
  static void product(const float* x, const WT* w, int64_t /*panel_stride*/, int64_t kc, int /*np*/, float* tile) {
    tile_product(x, w, kc, tile);
  }
};
// The float32 AVX-512 tile's k blocks, as the bfloat16 tiles' below: as long as half of L2 holds a
// group's W slice and an x panel (2340 with 1 MB of L2), so the small model's down projection
// (K = 1536) runs in one block instead of two of 768, whose second re-read and re-wrote the out
// tile: down 1.02-1.11x at 32-2048 rows, the medium model's (K = 2816, two blocks instead of
// three) 1.02-1.04x (benchmarks/cpu_gemm_lib_ab.py, Zen 4, 1 MB L2).
struct Avx512Tile : TileShape<avx512::kMR, 1> {
  static constexpr int64_t kPanels = avx512::kPanels, kCols = avx512::kCols, kRowBlock = 512;
  template <typename WT>
  static KBlocking k_blocking() { return l2_k_blocking(kCols * 4 + kMR * 4); }
  // float32 x: whole 8-row panels 16 k at a time through pack_x_8x16, the rest value by value
  template <typename XT>
  static void pack_x(const XT* x, int64_t ldx, int64_t rows, int64_t kc, float* out) {
    int64_t k0 = 0;
    if constexpr (std::is_same_v<XT, float>)
      if (rows == kMR)
        for (; k0 + 16 <= kc; k0 += 16) avx512::pack_x_8x16(x + k0, ldx * 4, out + k0 * kMR);
    pack_x_panel<kMR>(x + k0, ldx, rows, kc - k0, w_k(kc) - k0, out + k0 * kMR);
  }
  static void product(const float* x, const float* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
    avx512::tile_product(x, w, panel_stride, kc, np, tile);
  }
};
// The AVX-512 bfloat16 tiles' k blocks (both tiles, so that one k limit says which shapes store
// bfloat16 straight from the tiles): as long as half of L2 holds a group's W slice (48 bfloat16
// columns) and an x panel (8 rows, float32 for the widening tile), 4096 with 1 MB of L2. One
// block keeps every sum in registers and lets a K above ~1100 (the small model's down projection,
// K = 1536; the medium's, 2816) store bfloat16 from the tiles instead of a float32 out that torch
// then converts: the down projection at 1024-2048 rows ran ~0.9x oneDNN's rate in two blocks.
inline KBlocking bf16_tile_k_blocking() { return l2_k_blocking(avx512::kCols * 2 + avx512::kMR * 4); }

struct Avx512Bf16Tile : TileShape<avx512::kMR, 2> {
  static constexpr int64_t kPanels = avx512::kPanels, kCols = avx512::kCols, kRowBlock = 512;
  template <typename WT>
  static KBlocking k_blocking() { return bf16_tile_k_blocking(); }
  static void product(const float* x, const uint16_t* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
    avx512::tile_product(x, w, panel_stride, kc, np, tile);
  }
};

// The vdpbf16ps tile: x packed as bfloat16 pairs, a 32-bit word (k even in the low half, as in
// the W lanes) per row and k pair, [ceil(kc/2)][8] words in the float-sized slots of the x block.
struct Avx512DotTile : TileShape<avx512::kMR, 2> {
  static constexpr int64_t kPanels = avx512::kPanels, kCols = avx512::kCols, kRowBlock = 512;
  template <typename WT>
  static KBlocking k_blocking() { return bf16_tile_k_blocking(); }
  static int64_t x_panel_elems(int64_t kc) { return kMR * w_k(kc) / 2; }
  static void pack_x(const uint16_t* x, int64_t ldx, int64_t rows, int64_t kc, float* out) {
    uint32_t* pairs = reinterpret_cast<uint32_t*>(out);
    int64_t kp0 = 0;  // whole 8-row panels 16 pairs at a time through pack_x_8x16
    if (rows == kMR)
      for (; 2 * kp0 + 32 <= kc; kp0 += 16) avx512::pack_x_8x16(x + 2 * kp0, ldx * 2, pairs + kp0 * kMR);
    for (int64_t kp = kp0; kp < w_k(kc) / 2; ++kp)
      for (int64_t r = 0; r < kMR; ++r) {
        const uint16_t* xr = x + r * ldx + 2 * kp;
        const uint32_t lo = r < rows && 2 * kp < kc ? xr[0] : 0, hi = r < rows && 2 * kp + 1 < kc ? xr[1] : 0;
        pairs[kp * kMR + r] = lo | hi << 16;
      }
  }
  static void product(const float* x, const uint16_t* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
    avx512::tile_product_dot(reinterpret_cast<const uint32_t*>(x), w, panel_stride, kc, np, tile);
  }
};

// The vpdpbusd tile (the int8 pass of the greedy LM-head screen, greedy_screen.h): x is uint8,
// packed as 4 k values per 32-bit word, [ceil(kc/4)][8] words in the float-sized slots of the x
// block; W int8 in k quads (greedy_screen_int8_pack). The tile receives int32 sums. One k block
// as long as half of L2 holds a group's W slice and x panel (the screen needs one).
struct Avx512VnniTile : TileShape<avx512::kMR, 4> {
  static constexpr int64_t kPanels = avx512::kPanels, kCols = avx512::kCols, kRowBlock = 512;
  template <typename WT>
  static KBlocking k_blocking() { return l2_k_blocking(avx512::kCols + avx512::kMR); }
  static int64_t x_panel_elems(int64_t kc) { return kMR * w_k(kc) / 4; }
  static void pack_x(const uint8_t* x, int64_t ldx, int64_t rows, int64_t kc, float* out) {
    uint32_t* quads = reinterpret_cast<uint32_t*>(out);
    const int64_t full = kc / 4;  // quads inside the row: 4 bytes as they lie (little-endian: k in byte k % 4)
    for (int64_t r = 0; r < kMR; ++r) {
      const uint8_t* xr = x + r * ldx;
      for (int64_t kq = 0; kq < w_k(kc) / 4; ++kq) {
        uint32_t word = 0;
        if (r < rows && kq < full)
          std::memcpy(&word, xr + 4 * kq, 4);
        else
          for (int64_t b = 0; b < 4; ++b)
            if (r < rows && 4 * kq + b < kc) word |= static_cast<uint32_t>(xr[4 * kq + b]) << (8 * b);
        quads[kq * kMR + r] = word;
      }
    }
  }
  static void product(const float* x, const int8_t* w, int64_t panel_stride, int64_t kc, int np, float* tile) {
    avx512::tile_product_vnni(reinterpret_cast<const uint32_t*>(x), w, panel_stride, kc, np, tile);
  }
};

// Requests the next group's W slice (np panels of kc k-rows) into L2, a share per row tile of the
// current item. In the engine every layer's weights come from memory (the model is larger than L3),
// and a group's first row tile waited on them: with bfloat16 weights the decode-sized GEMMs
// (226 rows, eight layers' weights cycled) ran 8-29 % slower than with one warm weight. The next
// group is the next item of this thread's chunk, or the other thread's, which then takes it from
// this core's cache rather than from memory. Only for bfloat16 weights: float32 ones measured no
// gain (cycled layers 8.93 vs 8.96 ms, W1 fp32 33.7 vs 33.0 s); W1 bfloat16 gained 1.09x (18.39
// vs 20.01 s, medians of 7 alternated runs).
template <typename WT>
constexpr bool kPrefetchNextGroup = sizeof(WT) == 2;  // bfloat16 weights (see above)

template <typename WT>
class NextGroupPrefetch {
 public:
  NextGroupPrefetch() = default;
  NextGroupPrefetch(const WT* w, int64_t panel_stride, int64_t kc, int64_t np, int64_t steps)
      : w_(reinterpret_cast<const char*>(w)), panel_bytes_(panel_stride * static_cast<int64_t>(sizeof(WT))),
        lines_per_panel_((kc * kNR * static_cast<int64_t>(sizeof(WT)) + 63) / 64), total_(np * lines_per_panel_),
        per_step_((total_ + steps - 1) / std::max<int64_t>(steps, 1)) {}
  // (the next line kept as a panel and a line within it: a division per line cost ~2 % of the
  // bfloat16 GEMMs' time)
  void step() {
    for (int64_t e = 0; e < per_step_ && done_ < total_; ++e, ++done_) {
      _mm_prefetch(w_ + panel_ * panel_bytes_ + line_ * 64, _MM_HINT_T1);
      if (++line_ == lines_per_panel_) line_ = 0, ++panel_;
    }
  }

 private:
  const char* w_ = nullptr;
  int64_t panel_bytes_ = 0, lines_per_panel_ = 1, total_ = 0, per_step_ = 0, done_ = 0, panel_ = 0, line_ = 0;
};

// The driver: runs the tiles of x[m, k] · Wᵀ (k ≥ 1) over the threads and hands each finished
// tile to store(tile, row, rows, col, cols, k0): tile rows [row, row + rows) and columns [col, col +
// cols) of the product's k block starting at k0, row stride Tile::kCols.
template <typename Tile, typename XT, typename WT, typename Store>
void gemm_tiles(const XT* x, int64_t ldx, int64_t m, int64_t k, const WT* w_packed, int64_t n, int nthreads,
                Store&& store) {
  constexpr int64_t MR = Tile::kMR;
  const int64_t panels = (n + kNR - 1) / kNR, groups = (panels + Tile::kPanels - 1) / Tile::kPanels;
  const int64_t kc_max = k_block(k, Tile::template k_blocking<WT>()), wk = Tile::w_k(k);
  const int64_t row_block = std::min(Tile::kRowBlock, (m + MR - 1) / MR * MR);
  const int64_t xp_floats = row_block / MR * Tile::x_panel_elems(std::max<int64_t>(kc_max, 1));
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, groups)));
  // Each thread packs the whole x block for itself, or the threads pack one copy between them.
  // A shared copy is read half from the other core's caches (the block, up to ~1 MB, does not
  // stay in L2 beside the W slices), and the packing needs a barrier before the products; a
  // private copy costs the packing once per thread. Private measured 1.02-1.04x faster on float32
  // weights at 64-1024 rows and on bfloat16 weights at 1024 rows, and 0.97-0.99x on bfloat16 at
  // 256 rows, whose products are twice as fast per packed value (cpu_gemm_lib_ab.py, Zen 4, 2
  // threads). Each thread's products per packed value scale with its share of the columns, so a
  // private copy also needs at least 256 of them per thread (many threads on a narrow W would
  // spend more on packing than the shared copy loses).
  const bool private_x =
      threads > 1 && n >= 256 * threads && (sizeof(WT) == sizeof(float) || row_block >= 512);
  float* shared_xp = private_x ? nullptr : x_block_buffer(xp_floats);
  // Work items are (group of panels, slice of row panels), handed out a few at a time, not split
  // in equal halves up front: on a shared machine one core is often slower, and a static split
  // leaves the other waiting for it. Rows are sliced when there are too few groups for the last
  // items to end close together (o_proj of the small model: 11 groups for 2 threads, one thread
  // doing 6 while the other waits after 5); each slice then re-reads its group's W slice from
  // cache. Float32 weights slice down to 32 items per thread: with 8, the medium model's float32
  // linears at 1024 rows (43 groups for qkv, 22 for o) ran 1.03-1.08x slower, waiting at each k
  // block's end. Other weights (bfloat16, the int8 screen's) stay at 8: bfloat16 items are half
  // as long, and at 128-256 rows the extra slices cost 1-3 % (qkv, o, down of the small model).
  const int64_t per_thread = sizeof(WT) == sizeof(float) ? 32 : 8;
  const int64_t max_row_panels = (row_block + MR - 1) / MR;
  const int64_t row_slices = groups >= per_thread * threads
                                 ? 1
                                 : std::min(max_row_panels, (per_thread * threads + groups - 1) / groups);
  const int64_t items = groups * row_slices;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8, items / (8 * threads)));
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float tile[MR * Tile::kCols];
    float* xp = private_x ? x_block_buffer(xp_floats) : shared_xp;
    for (int64_t r0 = 0; r0 < m; r0 += row_block) {
      const int64_t rows = std::min(row_block, m - r0), row_panels = (rows + MR - 1) / MR;
      for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, k - k0), x_panel = Tile::x_panel_elems(kc);
        auto pack = [&](int64_t i) {
          Tile::pack_x(x + (r0 + i * MR) * ldx + k0, ldx, std::min(MR, rows - i * MR), kc, xp + i * x_panel);
        };
        if (private_x) {
          for (int64_t i = 0; i < row_panels; ++i) pack(i);
        } else {
          // (the panel loop's implicit barrier: every thread is done with the previous block of xp)
#pragma omp for schedule(static)
          for (int64_t i = 0; i < row_panels; ++i) pack(i);
        }
        const int64_t per_slice = (row_panels + row_slices - 1) / row_slices;
#pragma omp for schedule(dynamic, chunk)
        for (int64_t item = 0; item < items; ++item) {
          const int64_t g = item / row_slices, i0 = item % row_slices * per_slice;
          const int64_t p = g * Tile::kPanels;
          const WT* wp = w_packed + (p * wk + k0) * kNR;
          const int np = static_cast<int>(std::min(Tile::kPanels, panels - p));
          const int64_t cols = std::min(np * kNR, n - p * kNR);
          const int64_t i_end = std::min(row_panels, i0 + per_slice);
          NextGroupPrefetch<WT> pf;
          if constexpr (kPrefetchNextGroup<WT>)
            if (i_end >= row_panels && p + Tile::kPanels < panels)
              pf = NextGroupPrefetch<WT>(w_packed + ((p + Tile::kPanels) * wk + k0) * kNR, wk * kNR, kc,
                                         std::min(Tile::kPanels, panels - p - Tile::kPanels), i_end - i0);
          for (int64_t i = i0; i < i_end; ++i) {
            pf.step();
            Tile::product(xp + i * x_panel, wp, wk * kNR, kc, np, tile);
            store(static_cast<const float*>(tile), r0 + i * MR, std::min(MR, rows - i * MR), p * kNR, cols, k0);
          }
        }
      }
    }
  }
}

// out[m, n] (row stride ldo) = x[m, k] (row stride ldx) · Wᵀ + bias (bias may be null), with W
// packed by gemm_f32_pack (WT = float) or gemm_bf16_pack (WT = uint16_t, bfloat16 bits); x is
// float32 or bfloat16 (XT); sums are float32, out float32 or (OT = uint16_t, only where k fits
// one k block) bfloat16.
// kSiluMul: out[m, n / 2] = silu(gate) · up instead, W packed as store_tile_silu_mul reads it
// (no bias, k one block).
template <typename Tile, bool kSiluMul = false, typename XT, typename WT, typename OT>
void gemm(const XT* x, int64_t ldx, int64_t m, int64_t k, const WT* w_packed, int64_t n, const float* bias,
          OT* out, int64_t ldo, int nthreads) {
  if (m <= 0 || n <= 0) return;
  if (k == 0) {  // no products: out = bias (or 0)
    alignas(64) float zeros[8 * kNR] = {};
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; j += kNR)
        store_tile(zeros, kNR, out + r * ldo + j, ldo, 1, std::min(kNR, n - j), bias != nullptr ? bias + j : nullptr,
                   false);
    return;
  }
  gemm_tiles<Tile>(x, ldx, m, k, w_packed, n, nthreads,
                   [&](const float* tile, int64_t row, int64_t rows, int64_t col, int64_t cols, int64_t k0) {
                     if constexpr (kSiluMul)
                       store_tile_silu_mul(tile, Tile::kCols, out + row * ldo + col / 2, ldo, rows, cols);
                     else
                       store_tile(tile, Tile::kCols, out + row * ldo + col, ldo, rows, cols,
                                  bias != nullptr ? bias + col : nullptr, k0 > 0);
                   });
}

// 12 independent chains of 8-wide FMAs, `iters` rounds, all in registers (the FMA peak's loop).
void fma_chains_avx2(int64_t iters) {
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vmovaps %%ymm0, %%ymm4\n\t" "vmovaps %%ymm0, %%ymm5\n\t" "vmovaps %%ymm0, %%ymm6\n\t"
      "vmovaps %%ymm0, %%ymm7\n\t" "vmovaps %%ymm0, %%ymm8\n\t" "vmovaps %%ymm0, %%ymm9\n\t"
      "vmovaps %%ymm0, %%ymm10\n\t" "vmovaps %%ymm0, %%ymm11\n\t" "vmovaps %%ymm0, %%ymm12\n\t"
      "vmovaps %%ymm0, %%ymm13\n\t" "vmovaps %%ymm0, %%ymm14\n\t" "vmovaps %%ymm0, %%ymm15\n\t"
      "1:\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm4\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm5\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm6\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm7\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm8\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm9\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm10\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm11\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm12\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm13\n\t"
      "vfmadd231ps %%ymm0, %%ymm1, %%ymm14\n\t" "vfmadd231ps %%ymm0, %%ymm1, %%ymm15\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [n] "+r"(iters)
      :
      : "cc", "xmm0", "xmm1", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13",
        "xmm14", "xmm15");
}

// Which tile float32 GEMMs run: AVX-512 where the CPU has it, unless gemm_f32_set_avx512(0).
bool use_avx512 = avx512::supported();

// Whether this CPU's vdpbf16ps outruns its float32 FMAs by enough to pay for the dot tile, read
// from CPUID rather than timed, so that bfloat16 results never depend on how busy the host was at
// start: AMD cores with AVX512-BF16 (Zen 4 and later) issue vdpbf16ps as often as an FMA (timed
// ratio ~2 in FLOPs); the AVX512-BF16 Xeons measured issue it at half that rate (~0.5), and the
// ones with AMX send bfloat16 layers to oneDNN anyway.
bool bf16_dot_by_cpuid() { return avx512::dot_supported() && __builtin_cpu_is("amd"); }

// Whether k-pair bfloat16 GEMMs with bfloat16 x run the vdpbf16ps tile: as gemm_bf16kp_set_dot
// forced it (0 / 1), else by CPUID (above).
int forced_bf16_dot = -1;
const bool cpuid_bf16_dot = bf16_dot_by_cpuid();
bool bf16_dot() { return forced_bf16_dot >= 0 ? forced_bf16_dot == 1 : cpuid_bf16_dot; }

// k-pair bfloat16 GEMM with bfloat16 x, on the tile bf16_dot() picks; out float32 or bfloat16
template <bool kSiluMul = false, typename OT>
void gemm_bf16kp_bf16x(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint16_t* w_packed, int64_t n,
                       const float* bias, OT* out, int64_t ldo, int nthreads) {
  if (bf16_dot())
    gemm<Avx512DotTile, kSiluMul>(x, ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
  else
    gemm<Avx512Bf16Tile, kSiluMul>(x, ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
}

// w [n, k] (row-major) → out [ceil(n/16)][ceil(k/G)][16][G]: per panel and group of G k values,
// each column's G values side by side (k pairs of bfloat16 or k quads of int8 in a 32-bit lane),
// zero-padded past n and k.
template <int G, typename T>
void pack_k_groups(const T* w, int64_t n, int64_t k, T* out, int nthreads) {
  const int64_t panels = (n + kNR - 1) / kNR, wk = (k + G - 1) / G * G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < wk; ++kk)
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + j;
        out[p * wk * kNR + kk / G * G * kNR + j * G + kk % G] = col < n && kk < k ? w[col * k + kk] : T{0};
      }
}

// Float32 logits as gemm_f32 computes them (its tile's k blocks, each a chain of FMAs in k order
// from 0, then added to the blocks before), for `count` tokens v[] of W [n, k] (row-major, the
// same values as gemm_f32's packed panels, where one token's weights would be 64 bytes apart), no
// bias. Eight tokens at a time, so that their chains overlap.
void exact_columns(const float* x, const float* w_rows, int64_t k, int64_t kc_max, const int32_t* v, int64_t count,
                   float* values) {
  constexpr int kLanes = 8;
  for (int64_t c0 = 0; c0 < count; c0 += kLanes) {
    const float* w[kLanes];
    for (int j = 0; j < kLanes; ++j) w[j] = w_rows + static_cast<int64_t>(v[std::min(c0 + j, count - 1)]) * k;
    float out[kLanes] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
      const int64_t k1 = std::min(k, k0 + kc_max);
      float t[kLanes] = {};
      for (int64_t kk = k0; kk < k1; ++kk)
        for (int j = 0; j < kLanes; ++j) t[j] = std::fma(x[kk], w[j][kk], t[j]);
      for (int j = 0; j < kLanes; ++j) out[j] = k0 == 0 ? t[j] + 0.f : (t[j] + 0.f) + out[j];  // store_tile's adds
    }
    for (int j = 0; j < kLanes && c0 + j < count; ++j) values[c0 + j] = out[j];
  }
}

// bfloat16 logits as the vdpbf16ps tile computes and stores them (gemm_bf16kp_bf16out, one k
// block): per token a chain of vdpbf16ps over the k pairs in order from 0, rounded to bfloat16
// once (bf16::round8, the store's own rounding), here widened back to float. 16 tokens at a time,
// one lane each, their weight pairs gathered from W row-major (w_pairs [n][ceil(k/2)] words, a
// word being a k pair with the even k in its low half, as in the panels' lanes). Row-major rather
// than the GEMM's k-pair panels: there a token's pairs are 64 bytes apart, so each token's check
// pulled its panel's whole 16 KB through the caches (W1 bfloat16, ~30 checks per row: the checks
// took ~1/6 of the screen); here its 1 KB are contiguous and each gathered line serves 16 steps.
__attribute__((target("avx512f,avx512bf16"))) void exact_columns_dot(const uint16_t* xb, const uint16_t* w_pairs,
                                                                    int64_t k, const int32_t* v, int64_t count,
                                                                    float* values) {
  const int64_t steps = (k + 1) / 2;
  const int* words = reinterpret_cast<const int*>(w_pairs);
  for (int64_t c0 = 0; c0 < count; c0 += 16) {
    alignas(64) int32_t idx[16];
    for (int j = 0; j < 16; ++j) idx[j] = static_cast<int32_t>(v[std::min<int64_t>(c0 + j, count - 1)] * steps);
    const __m512i at = _mm512_load_si512(idx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t step = 0; step < steps; ++step) {
      const uint32_t lo = xb[2 * step], hi = 2 * step + 1 < k ? xb[2 * step + 1] : 0;
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(lo | hi << 16));
      const __m512bh w = (__m512bh)_mm512_i32gather_epi32(at, words + step, 4);
      acc = _mm512_dpbf16_ps(acc, a, w);
    }
    alignas(64) float out[16];
    _mm256_store_ps(out, bf16::round8(_mm512_castps512_ps256(acc)));
    _mm256_store_ps(out + 8, bf16::round8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
    for (int64_t j = 0; j < 16 && c0 + j < count; ++j) values[c0 + j] = out[j];
  }
}

// The float32 k blocks gemm_f32 cuts a K-long sum into, on the tile in use.
int64_t f32_k_block(int64_t k) {
  return use_avx512 ? k_block(k, Avx512Tile::k_blocking<float>()) : k_block(k, Avx2Tile::k_blocking<float>());
}

// The screens' last step: merges the threads' thresholds of each row and the tokens that pass the
// merged one, computes those in float32 and writes the first of the largest to out (-1 where the
// row is `bad`, saw a NaN or no finite threshold, or a float32 logit is NaN). Returns how many
// logits were computed.
// exact(row, tokens, count, values) computes the row's logits of the tokens as the head does.
// tie (a bfloat16 head, else null): per row, the part of every bound that keeps tokens whose
// rounded logit may tie the largest, sized for the largest logit possible, ‖h‖·max‖W[v]‖; here it is
// cut to one bfloat16 step of the largest logit's own bound (see keep_from below).
template <typename Exact>
int64_t screen_finish(const std::vector<greedy_screen::ThreadState>& states, int nthreads, int64_t m,
                      std::vector<uint8_t>* bad_rows, const float* tie, Exact&& exact, int64_t* out) {
  std::vector<float> threshold(m, -INFINITY);
  std::vector<uint8_t>& bad = *bad_rows;
  for (int t = 0; t < nthreads; ++t)
    for (int64_t r = 0; r < m; ++r) {
      threshold[r] = std::max(threshold[r], states[t].threshold[r]);
      bad[r] |= states[t].nan[r];
    }
  for (int64_t r = 0; r < m; ++r) bad[r] |= !std::isfinite(threshold[r]);
  // keep_from[r]: the least upper value a token of row r needs. Without `tie`, the threshold. With
  // it: the largest float32 logit L (screen units) lies in [lo, hi], lo = threshold + tie and hi =
  // the largest upper − tie (the bounds without the tie part), so |L| ≤ M = max(|lo|, |hi|). A
  // token whose bfloat16 logit equals round(L) has a float32 logit ≥ L − 2u/(1 − u)·|L| (u = 2⁻⁸,
  // both roundings relative), so it keeps upper − tie ≥ lo − 2⁻⁷·(1 + u)·1.01·M (the 1 % also
  // covers the float rounding of lo, hi and upper), less kTiny thrice: `tie` carries the bounds'
  // kTiny (flushed denormals) too, so L may lie kTiny outside [lo, hi].
  std::vector<double> keep_from(threshold.begin(), threshold.end());
  if (tie != nullptr) {
    std::vector<double> hi(m, -INFINITY);
    for (int t = 0; t < nthreads; ++t)
      for (const auto& c : states[t].kept)
        if (c.upper >= threshold[c.row]) hi[c.row] = std::max(hi[c.row], static_cast<double>(c.upper) - tie[c.row]);
    for (int64_t r = 0; r < m; ++r) {
      if (bad[r]) continue;
      const double lo = static_cast<double>(threshold[r]) + tie[r];
      const double big = std::max(std::fabs(lo), std::fabs(hi[r]));
      const double cut = lo - 0x1p-7 * (1 + 0x1p-8) * 1.01 * big - 3.0 * greedy_screen::kTiny + tie[r];
      if (std::isfinite(cut)) keep_from[r] = std::max(keep_from[r], cut);  // never keeps fewer than needed
    }
  }
  std::vector<int64_t> start(m + 1, 0);
  for (int t = 0; t < nthreads; ++t)
    for (const auto& c : states[t].kept)
      if (c.upper >= keep_from[c.row]) ++start[c.row + 1];
  for (int64_t r = 0; r < m; ++r) start[r + 1] += start[r];
  std::vector<int32_t> tokens(start[m]);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int t = 0; t < nthreads; ++t)
      for (const auto& c : states[t].kept)
        if (c.upper >= keep_from[c.row]) tokens[fill[c.row]++] = c.token;
  }
  int64_t computed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : computed)
  {
    std::vector<float> values;
#pragma omp for schedule(dynamic, 8)
    for (int64_t r = 0; r < m; ++r) {
      if (bad[r]) {
        out[r] = -1;
        continue;
      }
      int32_t* first = tokens.data() + start[r];
      const int64_t count = start[r + 1] - start[r];
      std::sort(first, first + count);  // ascending: the first of equal maxima wins
      values.resize(count);
      computed += count;
      exact(r, first, count, values.data());
      int64_t best = -1;
      float best_value = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        if (std::isnan(values[j])) {
          best = -1;
          break;
        }
        if (best < 0 || values[j] > best_value) best = first[j], best_value = values[j];
      }
      out[r] = best;
    }
  }
  return computed;
}

}  // namespace

extern "C" {

// 1 when this CPU runs the kernel (AVX2 and FMA), else 0.
int gemm_f32_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0; }

// Floats of the packed form of an [n, k] weight (n rounded up to whole panels).
int64_t gemm_f32_packed_size(int64_t n, int64_t k) { return (n + kNR - 1) / kNR * kNR * k; }

// w [n, k] (row-major) → out [ceil(n/16)][k][16], the last panel zero-padded. out 32-byte aligned.
void gemm_f32_pack(const float* w, int64_t n, int64_t k, float* out, int nthreads) {
  const int64_t panels = (n + kNR - 1) / kNR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + j;
        out[(p * k + kk) * kNR + j] = col < n ? w[col * k + kk] : 0.f;
      }
}

// out[m, n] (row stride ldo) = x[m, k] (row stride ldx) · Wᵀ + bias (bias may be null), with W
// packed by gemm_f32_pack.
void gemm_f32(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w_packed, int64_t n, const float* bias,
              float* out, int64_t ldo, int nthreads) {
  if (use_avx512)
    gemm<Avx512Tile>(x, ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
  else
    gemm<Avx2Tile>(x, ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
}

// The width of the float32 tile in use: 512 (AVX-512) or 256 (AVX2).
int gemm_f32_vector_bits() { return use_avx512 ? 512 : 256; }

// Chooses the float32 tile: 1 = AVX-512 if this CPU has it, 0 = AVX2 (for A/B runs and tests).
// Returns the width now in use.
int gemm_f32_set_avx512(int on) {
  use_avx512 = on != 0 && avx512::supported();
  return gemm_f32_vector_bits();
}

// Elements (bfloat16) of the packed form of an [n, k] bfloat16 weight: the same panels as float32.
int64_t gemm_bf16_packed_size(int64_t n, int64_t k) { return gemm_f32_packed_size(n, k); }

// w [n, k] bfloat16 (row-major) → out [ceil(n/16)][k][16] bfloat16, the last panel zero-padded.
// Within a k row the 16 columns are interleaved, slot 2j = column j and slot 2j+1 = column 8 + j,
// so a 32-bit lane holds column j in its low half and column 8 + j in its high half (see the
// bfloat16 tile). out 32-byte aligned.
void gemm_bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads) {
  const int64_t panels = (n + kNR - 1) / kNR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + (j % 2 == 0 ? j / 2 : kNR / 2 + j / 2);
        out[(p * k + kk) * kNR + j] = col < n ? w[col * k + kk] : 0;
      }
}

// out[m, n] float32 = x[m, k] · Wᵀ + bias, W bfloat16 packed by gemm_bf16_pack, x bfloat16
// (x_is_bf16 = 1) or float32, bias float32 or null. Products and sums in float32.
void gemm_bf16(const void* x, int x_is_bf16, int64_t ldx, int64_t m, int64_t k, const uint16_t* w_packed, int64_t n,
               const float* bias, float* out, int64_t ldo, int nthreads) {
  if (x_is_bf16)
    gemm<Avx2Tile>(static_cast<const uint16_t*>(x), ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
  else
    gemm<Avx2Tile>(static_cast<const float*>(x), ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
}

// 1 when this CPU runs the k-pair bfloat16 functions below (AVX-512), else 0.
int gemm_bf16kp_supported() { return avx512::supported() ? 1 : 0; }

// Elements (bfloat16) of the k-pair packed form of an [n, k] bfloat16 weight: whole panels, k
// rounded up to even.
int64_t gemm_bf16kp_packed_size(int64_t n, int64_t k) { return (n + kNR - 1) / kNR * kNR * ((k + 1) / 2 * 2); }

// w [n, k] bfloat16 (row-major) → out [ceil(n/16)][ceil(k/2)][16][2]: per panel and k pair, each
// column's two k values side by side in a 32-bit lane (see the AVX-512 bfloat16 tile),
// zero-padded past n and k. out 64-byte aligned.
void gemm_bf16kp_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads) {
  pack_k_groups<2>(w, n, k, out, nthreads);
}

// out[m, n] float32 = x[m, k] · Wᵀ + bias, W packed by gemm_bf16kp_pack, x bfloat16 (x_is_bf16 =
// 1) or float32, bias float32 or null. Products and sums in float32.
void gemm_bf16kp(const void* x, int x_is_bf16, int64_t ldx, int64_t m, int64_t k, const uint16_t* w_packed,
                 int64_t n, const float* bias, float* out, int64_t ldo, int nthreads) {
  if (x_is_bf16)
    gemm_bf16kp_bf16x(static_cast<const uint16_t*>(x), ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
  else
    gemm<Avx512Bf16Tile>(static_cast<const float*>(x), ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
}

// 1 when gemm_bf16kp_bf16out takes this k (it fits one k block), else 0.
int gemm_bf16kp_bf16out_takes(int64_t k) { return k <= bf16_tile_k_blocking().max ? 1 : 0; }

// gemm_bf16kp with x bfloat16 and out bfloat16, each float32 sum (+ bias) rounded once as it is
// stored: no float32 out to write, read back and convert. k must fit one k block (above).
// Returns 0, or -1 (nothing computed) when k does not fit: the binding raises then.
int gemm_bf16kp_bf16out(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint16_t* w_packed, int64_t n,
                        const float* bias, uint16_t* out, int64_t ldo, int nthreads) {
  if (!gemm_bf16kp_bf16out_takes(k)) return -1;
  gemm_bf16kp_bf16x(x, ldx, m, k, w_packed, n, bias, out, ldo, nthreads);
  return 0;
}

// 1 when the silu_mul GEMMs below take a gate/up projection of this shape (n = 2I with I a
// multiple of 8, k in one k block), else 0.
int gemm_silu_mul_takes(int64_t n, int64_t k) { return n % 16 == 0 && k <= kMaxKBlock ? 1 : 0; }

// out[m, n / 2] (row stride ldo) = silu(gate) · up of x[m, k] · Wᵀ, W the gate/up projection
// [n, k] packed by gemm_f32_pack with its rows in NativeGateUp's order (8 gate rows, the same 8 up
// rows, ...). Returns 0, or -1 (nothing computed) when the shape fails gemm_silu_mul_takes.
int gemm_f32_silu_mul(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w_packed, int64_t n,
                      float* out, int64_t ldo, int nthreads) {
  if (!gemm_silu_mul_takes(n, k)) return -1;
  if (use_avx512)
    gemm<Avx512Tile, true>(x, ldx, m, k, w_packed, n, nullptr, out, ldo, nthreads);
  else
    gemm<Avx2Tile, true>(x, ldx, m, k, w_packed, n, nullptr, out, ldo, nthreads);
  return 0;
}

// The same for bfloat16 x and out, W packed by gemm_bf16kp_pack.
int gemm_bf16kp_silu_mul(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const uint16_t* w_packed, int64_t n,
                         uint16_t* out, int64_t ldo, int nthreads) {
  if (!gemm_silu_mul_takes(n, k)) return -1;
  gemm_bf16kp_bf16x<true>(x, ldx, m, k, w_packed, n, nullptr, out, ldo, nthreads);
  return 0;
}

// Which tile k-pair GEMMs with bfloat16 x run: 1 = vdpbf16ps (where the CPU has AVX512-BF16), 0 =
// widening to float32 FMAs, -1 = by CPUID (the default, bf16_dot_by_cpuid). Returns 1 when
// the vdpbf16ps tile is now in use. For A/B runs and tests.
int gemm_bf16kp_set_dot(int mode) {
  forced_bf16_dot = mode < 0 ? -1 : mode > 0 && avx512::dot_supported() ? 1 : 0;
  return bf16_dot() ? 1 : 0;
}

// 1 when k-pair GEMMs with bfloat16 x run the vdpbf16ps tile, else 0.
int gemm_bf16kp_dot() { return bf16_dot() ? 1 : 0; }

// The FMA units' peak, GFLOP/s over `nthreads` threads, at the width of the float32 tile in use:
// each thread runs 12 independent chains of FMAs (enough to cover the FMA latency on both units)
// from registers and times itself after a barrier; the rates add up. Best of 3 tries of ~40 ms.
double fma_peak_gflops(int nthreads) {
  constexpr int64_t kIters = 10000000;
  const bool wide = use_avx512;
  double best = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    double total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
#pragma omp barrier
      const double t0 = omp_get_wtime();
      if (wide)
        avx512::fma_chains(kIters);
      else
        fma_chains_avx2(kIters);
      total += static_cast<double>(kIters) * 12 * (wide ? 32 : 16) / (omp_get_wtime() - t0) / 1e9;
    }
    best = std::max(best, total);
  }
  return best;
}

// The exact argmax of each row of x[m, k] · Wᵀ (W float32 [n, k] row-major, w_rows, as gemm_f32
// computes the product from its packed panels; no bias), through a bfloat16 screen of it (greedy_screen.h): xb = x rounded to bfloat16 (row stride
// ldxb), wb = W rounded to bfloat16 and packed by gemm_bf16kp_pack (k_pairs = 1, run on the tile
// gemm_bf16kp picks for bfloat16 x) or gemm_bf16_pack (k_pairs = 0, the AVX2 tile); w_norms[n] =
// ‖W[v]‖₂ rounded up; coef the bound's factor. out[r] = the first index of the largest float32
// logit, bit for bit as gemm_f32 + argmax give it, or -1 where the row holds a non-finite value
// (the caller computes that row in full). Returns the number of logits computed in float32.
int64_t greedy_screen_argmax(const float* x, int64_t ldx, const uint16_t* xb, int64_t ldxb, int64_t m, int64_t k,
                             const float* w_rows, const uint16_t* wb_packed, int k_pairs, int64_t n,
                             const float* w_norms, double coef, int64_t* out, int nthreads) {
  if (m <= 0) return 0;
  nthreads = std::max(1, nthreads);
  std::vector<float> beta(m);
  for (int64_t r = 0; r < m; ++r)  // rounded up from double, so that float arithmetic only widens the bound
    beta[r] = std::nextafter(static_cast<float>(coef * greedy_screen::norm2(x + r * ldx, k)), INFINITY);
  thread_local std::vector<greedy_screen::ThreadState> states;  // reused across calls from this thread
  if (static_cast<int>(states.size()) < nthreads) states.resize(nthreads);
  for (int t = 0; t < nthreads; ++t) states[t].reset(m);
  // (a pointer: inside the lambda, run by the pool's threads, `states` would name their own copies)
  greedy_screen::ThreadState* state = states.data();
  const auto take = [&](const float* tile, int64_t ld, int64_t row, int64_t rows, int64_t col, int64_t cols) {
    greedy_screen::take_tile(tile, ld, row, rows, col, cols, beta.data(), w_norms, &state[omp_get_thread_num()]);
  };
  if (!k_pairs)
    gemm_tiles<Avx2Tile>(xb, ldxb, m, k, wb_packed, n, nthreads,
                         [&](const float* t, int64_t r, int64_t rs, int64_t c, int64_t cs, int64_t) {
                           take(t, Avx2Tile::kCols, r, rs, c, cs);
                         });
  else if (bf16_dot())
    gemm_tiles<Avx512DotTile>(xb, ldxb, m, k, wb_packed, n, nthreads,
                              [&](const float* t, int64_t r, int64_t rs, int64_t c, int64_t cs, int64_t) {
                                take(t, Avx512DotTile::kCols, r, rs, c, cs);
                              });
  else
    gemm_tiles<Avx512Bf16Tile>(xb, ldxb, m, k, wb_packed, n, nthreads,
                               [&](const float* t, int64_t r, int64_t rs, int64_t c, int64_t cs, int64_t) {
                                 take(t, Avx512Bf16Tile::kCols, r, rs, c, cs);
                               });
  std::vector<uint8_t> bad(m, 0);
  for (int64_t r = 0; r < m; ++r) bad[r] = !std::isfinite(beta[r]);
  const int64_t kc_max = f32_k_block(k);
  return screen_finish(states, nthreads, m, &bad, nullptr, [&](int64_t r, const int32_t* v, int64_t count, float* values) {
    exact_columns(x + r * ldx, w_rows, k, kc_max, v, count, values);
  }, out);
}

// 1 when this CPU runs the int8 screen below (AVX512-VNNI) and it takes this k (one k block).
int greedy_screen_int8_takes(int64_t k) {
  return avx512::vnni_supported() && k <= Avx512VnniTile::k_blocking<int8_t>().max ? 1 : 0;
}

// Bytes of the k-quad packed form of an [n, k] int8 weight: whole panels, k rounded up to 4.
int64_t greedy_screen_int8_packed_size(int64_t n, int64_t k) { return (n + kNR - 1) / kNR * kNR * ((k + 3) / 4 * 4); }

// q [n, k] int8 (row-major) → out [ceil(n/16)][ceil(k/4)][16][4], zero-padded past n and k.
void greedy_screen_int8_pack(const int8_t* q, int64_t n, int64_t k, int8_t* out, int nthreads) {
  pack_k_groups<4>(q, n, k, out, nthreads);
}

// greedy_screen_argmax's contract through an int8 screen (vpdpbusd): W quantised per token,
// q_w = W / sw[v] rounded, packed by greedy_screen_int8_pack; colsum128[v] = 128 · Σ q_w[v];
// f[v] = ‖W[v] − sw[v]·q_w[v]‖₂ and wn[v] = ‖W[v]‖₂, rounded up; g the head's sums' factor
// (greedy_head.py derives the bound). Each row is quantised here as uint8 (q + 128), at the scale
// among a few clipping levels that leaves the smallest error.
// A float32 head: W float32 row-major in w_rows, xb and w_pairs null, rho 0. A bfloat16 head (the
// vdpbf16ps tile storing bfloat16): x is xb widened, W is w_pairs (bfloat16 row-major, k rounded
// up to even with a zero: [n][ceil(k/2)] k-pair words), w_rows null, and
// rho·‖h‖₂ bounds one bfloat16 step of the largest logit, so that every token whose rounded logit
// can tie the largest stays in; out then picks as argmax over the head's bfloat16 logits.
int64_t greedy_screen_int8_argmax(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w_rows,
                                  const int8_t* wq_packed, int64_t n, const int32_t* colsum128, const float* sw,
                                  const float* f, const float* wn, double g, const uint16_t* xb, int64_t ldxb,
                                  const uint16_t* w_pairs, double rho, int64_t* out, int nthreads) {
  if (m <= 0) return 0;
  if (!greedy_screen_int8_takes(k)) return -1;  // nothing computed: the binding raises
  nthreads = std::max(1, nthreads);
  thread_local std::vector<uint8_t> xq;
  xq.resize(m * k);
  std::vector<float> a(m), c(m), t(m);
  std::vector<uint8_t> bad(m, 0);
  uint8_t* q = xq.data();
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    const greedy_screen::RowQuant rq = greedy_screen::quantise_row_int8(x + r * ldx, k, q + r * k);
    if (!rq.finite) {
      bad[r] = 1;
      std::fill(q + r * k, q + (r + 1) * k, 128);
      continue;
    }
    const float sx = rq.sx;
    const double e2 = rq.e2, h2 = rq.h2, q2 = rq.q2;
    // |h·w − h'·w'| ≤ ‖h'‖·‖f‖ + ‖e‖·‖w‖, h' = sx·q and e = h − h'; the float32 sums add g·‖h‖·‖w‖;
    // in the screen's units (÷ sx), with 1 % on top, rounded up
    a[r] = std::nextafter(static_cast<float>(1.01 * std::sqrt(q2)), INFINITY);
    c[r] = std::nextafter(static_cast<float>(1.01 * (std::sqrt(e2) + g * std::sqrt(h2)) / sx), INFINITY);
    t[r] = std::nextafter(static_cast<float>(0.5 * rho * std::sqrt(h2) / sx), INFINITY) + greedy_screen::kTiny;
    bad[r] = !std::isfinite(a[r]) || !std::isfinite(c[r]) || !std::isfinite(t[r]);
  }
  thread_local std::vector<greedy_screen::ThreadState> states;  // reused across calls from this thread
  if (static_cast<int>(states.size()) < nthreads) states.resize(nthreads);
  for (int t = 0; t < nthreads; ++t) states[t].reset(m);
  greedy_screen::ThreadState* state = states.data();  // (the pool's threads would see their own `states`)
  const greedy_screen::Int8Tokens tokens{colsum128, sw, f, wn};
  gemm_tiles<Avx512VnniTile>(q, k, m, k, wq_packed, n, nthreads,
                             [&](const float* tl, int64_t r, int64_t rs, int64_t cl, int64_t cs, int64_t) {
                               greedy_screen::take_tile_int8(tl, Avx512VnniTile::kCols, r, rs, cl, cs, tokens, a.data(),
                                                             c.data(), t.data(), &state[omp_get_thread_num()]);
                             });
  if (xb != nullptr)
    return screen_finish(states, nthreads, m, &bad, t.data(), [&](int64_t r, const int32_t* v, int64_t count, float* values) {
      exact_columns_dot(xb + r * ldxb, w_pairs, k, v, count, values);
    }, out);
  const int64_t kc_max = f32_k_block(k);
  return screen_finish(states, nthreads, m, &bad, nullptr, [&](int64_t r, const int32_t* v, int64_t count, float* values) {
    exact_columns(x + r * ldx, w_rows, k, kc_max, v, count, values);
  }, out);
}

}  // extern "C"
