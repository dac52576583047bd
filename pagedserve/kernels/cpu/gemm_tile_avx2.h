// The AVX2 register tile: 6 rows × 16 columns of out in 12 ymm registers (inline assembly),
// float32 and bfloat16 (widened) weights.
//
// Part of gemm_cpu.cpp: included there, inside its anonymous namespace, after the constants and
// the headers it relies on; not a standalone header.
#pragma once

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
