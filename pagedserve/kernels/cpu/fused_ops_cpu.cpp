// Fused element-wise ops of the decoder layer, for the CPU, on float32 or bfloat16 tensors.
//
// torch runs RMSNorm as ~6 ops, rotary embedding as ~14 and SiLU·mul as 3, each a full pass over
// its tensor plus an op dispatch and an OpenMP region; at a 256-sequence decode step that overhead
// is larger than the arithmetic. Each function here is one pass.
//
// Built with -ffp-contract=off: every product and sum is rounded as torch rounds it (no fused
// multiply-adds), so rotary embedding and the KV cache contents are bit-identical to the torch
// path. RMSNorm's sum of squares is summed in a different order (a last-bit difference at most).
// bfloat16 tensors are computed in float32 and rounded to bfloat16 (nearest-even) wherever torch's
// bfloat16 ops round: after each op of the reference (transformers) expression, not once at the
// end, so the fused result is the one torch computes.
// Plain C ABI, called through ctypes (see fused_ops.py).
#include <omp.h>
#include <stdint.h>

#include <cmath>
#include <vector>

#include "bf16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define PS_HAVE_AVX2 1
#include "silu.h"
#endif

namespace {

// Storage types: float32, and bfloat16 as its bits (bf16.h).
inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16::to_float(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = bf16::from_float(v); }
// v as the storage type T would hold it: rounds to bfloat16 between ops of a bfloat16 expression
template <typename T>
inline float round_to(float v) {
  if constexpr (sizeof(T) == 2) return bf16::to_float(bf16::from_float(v));
  return v;
}

// Parallelise only when a call has enough work to pay for waking the other threads.
constexpr int64_t kMinParallelElems = 1 << 15;

inline int threads_for(int64_t elems, int nthreads) { return elems >= kMinParallelElems ? nthreads : 1; }

// Vector loads and stores of either storage type, as float32 lanes; the bfloat16 store rounds as
// from_float does, so a vector loop gives the scalar loop's bits.
#ifdef PS_HAVE_AVX2
inline __m256 load8(const uint16_t* p) { return bf16::load8(p); }
inline void store8(uint16_t* p, __m256 v) { bf16::store8(p, v); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <typename T>
inline __m256 round_to8(__m256 v) {
  if constexpr (sizeof(T) == 2) return bf16::round8(v);
  return v;
}
#endif
#ifdef __AVX512F__
inline __m512 load16(const uint16_t* p) { return bf16::load16(p); }
inline void store16(uint16_t* p, __m512 v) { bf16::store16(p, v); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <typename T>
inline __m512 round_to16(__m512 v) {
  if constexpr (sizeof(T) == 2) return bf16::round16(v);
  return v;
}
#endif

float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef PS_HAVE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  for (int j = 0; j < 8; ++j) s += lanes[j];
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}


// residual (optional, may be null): residual[t] += x[t] first, and the norm is taken of the sum.
// out[t] = weight * (h * 1/sqrt(mean(h^2) + eps)), h = the (updated) residual or x; [T, H] rows
// `x_stride` / `out_stride` elements apart (residual rows are contiguous). bfloat16: the sum, the
// normalised h and the product with the weight are each rounded, as in transformers' RMSNorm.
template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, const T* weight, T* out, int64_t out_stride, int64_t T_,
              int64_t H, float eps, int nthreads) {
#pragma omp parallel num_threads(threads_for(T_ * H, nthreads))
  {
    std::vector<float> row(sizeof(T) == 2 ? H : 0);  // a bfloat16 row widened, for the sum of squares
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      const T* xr = x + t * x_stride;
      const T* h = xr;
      // Each loop: 16 lanes, then 8, then scalars, the same exactly rounded ops in each, so the
      // same bits (the bfloat16 scalar loops do not vectorise on their own: ~1.2x on 512-wide rows).
      if (residual != nullptr) {
        T* r = residual + t * H;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= H; i += 16) store16(r + i, _mm512_add_ps(load16(r + i), load16(xr + i)));
#endif
#ifdef PS_HAVE_AVX2
        for (; i + 8 <= H; i += 8) store8(r + i, _mm256_add_ps(load8(r + i), load8(xr + i)));
#endif
        for (; i < H; ++i) store(r + i, load(r + i) + load(xr + i));
        h = r;
      }
      const float* hf;
      if constexpr (sizeof(T) == 2) {
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= H; i += 16) _mm512_storeu_ps(row.data() + i, load16(h + i));
#endif
#ifdef PS_HAVE_AVX2
        for (; i + 8 <= H; i += 8) _mm256_storeu_ps(row.data() + i, load8(h + i));
#endif
        for (; i < H; ++i) row[i] = load(h + i);
        hf = row.data();
      } else {
        hf = h;
      }
      const float inv = 1.f / std::sqrt(sum_squares(hf, H) / static_cast<float>(H) + eps);
      T* o = out + t * out_stride;
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 inv16 = _mm512_set1_ps(inv);
      for (; i + 16 <= H; i += 16)
        store16(o + i, _mm512_mul_ps(load16(weight + i), round_to16<T>(_mm512_mul_ps(_mm512_loadu_ps(hf + i), inv16))));
#endif
#ifdef PS_HAVE_AVX2
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (; i + 8 <= H; i += 8)
        store8(o + i, _mm256_mul_ps(load8(weight + i), round_to8<T>(_mm256_mul_ps(_mm256_loadu_ps(hf + i), inv8))));
#endif
      for (; i < H; ++i) store(o + i, load(weight + i) * round_to<T>(hf[i] * inv));
    }
  }
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i] for the fused gate/up projection output [T, 2I]
// (bfloat16: silu rounded, then the product).
#ifdef PS_HAVE_AVX2
using silu::silu8;
#endif

template <typename T>
void silu_mul(const T* gu, T* out, int64_t T_, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(threads_for(T_ * I, nthreads)) schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    const T* g = gu + t * 2 * I;
    const T* u = g + I;
    T* o = out + t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    // 16 lanes: ~1.6x the 8-lane loop (the exp polynomial is the cost); the same bits per lane
    for (; i + 16 <= I; i += 16) {
      __m512 s = silu::silu16(load16(g + i));
      if constexpr (sizeof(T) == 2) s = bf16::round16(s);
      store16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
#endif
#ifdef PS_HAVE_AVX2
    for (; i + 8 <= I; i += 8) {
      __m256 s = silu8(load8(g + i));
      if constexpr (sizeof(T) == 2) s = bf16::round8(s);
      store8(o + i, _mm256_mul_ps(s, load8(u + i)));
    }
#endif
    for (; i < I; ++i) {
      const float gv = load(g + i);
      store(o + i, round_to<T>(gv / (1.f + std::exp(-gv))) * load(u + i));
    }
  }
}

// Rotary embedding (rotate-half form) of the fused q/k/v projection output qkv [T, (H + 2 KVH) * D]
// at `positions`, with cos/sin tables [max_pos, D] (float32): q rotated into q_out [T, H, D]; k
// rotated and v copied into the paged caches at `slots` (cache rows [num_slots, KVH, D]). One pass
// instead of the rotation ops plus two index_copy_ calls. bfloat16: the tables are rounded to
// bfloat16 and each product and the sum rounded, as transformers' bfloat16 rotation does.
template <typename T>
void rope_qkv(const T* qkv, const int64_t* positions, const float* cos_t, const float* sin_t, const int64_t* slots,
              T* q_out, T* k_cache, T* v_cache, int64_t T_, int64_t H, int64_t KVH, int64_t D, int nthreads) {
  const int64_t half = D / 2, W = (H + 2 * KVH) * D;
#pragma omp parallel num_threads(threads_for(T_ * W, nthreads))
  {
    std::vector<float> cs(2 * D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_; ++t) {
      const T* row = qkv + t * W;
      int64_t k = 0;
#ifdef __AVX512F__
      for (; k + 16 <= D; k += 16) {
        _mm512_storeu_ps(cs.data() + k, round_to16<T>(_mm512_loadu_ps(cos_t + positions[t] * D + k)));
        _mm512_storeu_ps(cs.data() + D + k, round_to16<T>(_mm512_loadu_ps(sin_t + positions[t] * D + k)));
      }
#endif
      for (; k < D; ++k) {
        cs[k] = round_to<T>(cos_t[positions[t] * D + k]);
        cs[D + k] = round_to<T>(sin_t[positions[t] * D + k]);
      }
      const float* c = cs.data();
      const float* s = c + D;
      T* kdst = k_cache + slots[t] * KVH * D;
      T* vdst = v_cache + slots[t] * KVH * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const T* x = row + h * D;
        T* o = h < H ? q_out + (t * H + h) * D : kdst + (h - H) * D;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= half; i += 16) {  // the scalar loop below, 16 lanes at a time: the same bits
          const __m512 lo = load16(x + i), hi = load16(x + i + half);
          // -hi as a sign flip, as the scalar negation (0 - hi would turn -0 into +0)
          const __m512 neg_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(INT32_MIN)));
          store16(o + i, _mm512_add_ps(round_to16<T>(_mm512_mul_ps(lo, _mm512_loadu_ps(c + i))),
                                       round_to16<T>(_mm512_mul_ps(neg_hi, _mm512_loadu_ps(s + i)))));
          store16(o + i + half, _mm512_add_ps(round_to16<T>(_mm512_mul_ps(hi, _mm512_loadu_ps(c + i + half))),
                                              round_to16<T>(_mm512_mul_ps(lo, _mm512_loadu_ps(s + i + half)))));
        }
#endif
        for (; i < half; ++i) {
          const float lo = load(x + i), hi = load(x + i + half);
          store(o + i, round_to<T>(lo * c[i]) + round_to<T>(-hi * s[i]));
          store(o + i + half, round_to<T>(hi * c[i + half]) + round_to<T>(lo * s[i + half]));
        }
      }
      const T* v = row + (H + KVH) * D;
      for (int64_t i = 0; i < KVH * D; ++i) vdst[i] = v[i];
    }
  }
}

// Index of the largest value of each row of x [R, V], the first one on ties; a NaN counts as the
// largest, as in torch.argmax. bfloat16 rows: greedy sampling straight from a bfloat16 LM head
// (widening to float32 is exact, so the index is the float32 logits' one) reads half the bytes
// and skips the float32 copy.
template <typename T>
void argmax(const T* x, int64_t R, int64_t V, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(threads_for(R * V, nthreads)) schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const T* row = x + r * V;
    int64_t i = 0;
    float m = -INFINITY;
    bool nan = false;
#ifdef PS_HAVE_AVX2
    if (V >= 8) {
      __m256 mv = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
      for (; i + 8 <= V; i += 8) {
        const __m256 v = load8(row + i);
        mv = _mm256_max_ps(mv, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv);
      for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
      nan = _mm256_movemask_ps(unordered) != 0;
    }
#endif
    for (; i < V; ++i) {
      const float v = load(row + i);
      nan = nan || std::isnan(v);
      m = v > m ? v : m;
    }
    // second pass: the first lane holding m (or the first NaN); the row is still in cache
    int64_t best = -1, j = 0;
#ifdef PS_HAVE_AVX2
    const __m256 mset = _mm256_set1_ps(m);
    for (; j + 8 <= V; j += 8) {
      const __m256 v = load8(row + j);
      const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mset, _CMP_EQ_OQ));
      if (hit) {
        best = j + __builtin_ctz(hit);
        break;
      }
    }
#endif
    for (; best < 0 && j < V; ++j) {
      const float v = load(row + j);
      if (nan ? std::isnan(v) : v == m) best = j;
    }
    out[r] = best < 0 ? 0 : best;
  }
}

}  // namespace

extern "C" {

void rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight, float* out,
                  int64_t out_stride, int64_t T, int64_t H, float eps, int nthreads) {
  rms_norm(x, x_stride, residual, weight, out, out_stride, T, H, eps, nthreads);
}
void rms_norm_bf16(const uint16_t* x, int64_t x_stride, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                   int64_t out_stride, int64_t T, int64_t H, float eps, int nthreads) {
  rms_norm(x, x_stride, residual, weight, out, out_stride, T, H, eps, nthreads);
}
void silu_mul_f32(const float* gu, float* out, int64_t T, int64_t I, int nthreads) { silu_mul(gu, out, T, I, nthreads); }
void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t T, int64_t I, int nthreads) {
  silu_mul(gu, out, T, I, nthreads);
}
void rope_qkv_f32(const float* qkv, const int64_t* positions, const float* cos_t, const float* sin_t,
                  const int64_t* slots, float* q_out, float* k_cache, float* v_cache, int64_t T, int64_t H,
                  int64_t KVH, int64_t D, int nthreads) {
  rope_qkv(qkv, positions, cos_t, sin_t, slots, q_out, k_cache, v_cache, T, H, KVH, D, nthreads);
}
void rope_qkv_bf16(const uint16_t* qkv, const int64_t* positions, const float* cos_t, const float* sin_t,
                   const int64_t* slots, uint16_t* q_out, uint16_t* k_cache, uint16_t* v_cache, int64_t T, int64_t H,
                   int64_t KVH, int64_t D, int nthreads) {
  rope_qkv(qkv, positions, cos_t, sin_t, slots, q_out, k_cache, v_cache, T, H, KVH, D, nthreads);
}

// first index of each row's largest value (a NaN counts as the largest), as torch.argmax
void argmax_f32(const float* x, int64_t R, int64_t V, int64_t* out, int nthreads) { argmax(x, R, V, out, nthreads); }
void argmax_bf16(const uint16_t* x, int64_t R, int64_t V, int64_t* out, int nthreads) {
  argmax(x, R, V, out, nthreads);
}

int fused_ops_vectorized() {
#ifdef PS_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}
}
