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
// Plain C ABI, called through ctypes (see gemm.py). The tiles, epilogues, driver and the greedy
// screen's exact pass live in the headers included below, one job each.
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

#include "gemm_tile_avx2.h"

#include "gemm_epilogues.h"

#include "gemm_driver.h"

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

#include "greedy_screen_driver.h"

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
