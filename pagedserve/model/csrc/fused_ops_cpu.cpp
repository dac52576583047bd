// Fused float32 element-wise ops of the decoder layer, for the CPU.
//
// torch runs RMSNorm as ~6 ops, rotary embedding as ~14 and SiLU·mul as 3, each a full pass over
// its tensor plus an op dispatch and an OpenMP region; at a 256-sequence decode step that overhead
// is larger than the arithmetic. Each function here is one pass.
//
// Built with -ffp-contract=off: every product and sum is rounded as torch rounds it (no fused
// multiply-adds), so rotary embedding and the KV cache contents are bit-identical to the torch
// path. RMSNorm's sum of squares is summed in a different order (a last-bit difference at most).
// Plain C ABI, called through ctypes (see model/cpu_fused.py).
#include <omp.h>
#include <stdint.h>

#include <cmath>

#if defined(__AVX2__)
#include <immintrin.h>
#define PS_HAVE_AVX2 1
#endif

namespace {

// Parallelise only when a call has enough work to pay for waking the other threads.
constexpr int64_t kMinParallelElems = 1 << 15;

inline int threads_for(int64_t elems, int nthreads) { return elems >= kMinParallelElems ? nthreads : 1; }

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

// exp(x) for float32 lanes: Cephes-style range reduction and a degree-6 polynomial, ~1 ulp.
#ifdef PS_HAVE_AVX2
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
#endif

}  // namespace

extern "C" {

// residual (optional, may be null): residual[t] += x[t] first, and the norm is taken of the sum.
// out[t] = weight * (h * 1/sqrt(mean(h^2) + eps)), h = the (updated) residual or x; [T, H] rows
// `x_stride` / `out_stride` floats apart (residual rows are contiguous).
void rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight, float* out,
                  int64_t out_stride, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(threads_for(T * H, nthreads)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * x_stride;
    const float* h = xr;
    if (residual != nullptr) {
      float* r = residual + t * H;
      for (int64_t i = 0; i < H; ++i) r[i] = r[i] + xr[i];
      h = r;
    }
    const float inv = 1.f / std::sqrt(sum_squares(h, H) / static_cast<float>(H) + eps);
    float* o = out + t * out_stride;
    for (int64_t i = 0; i < H; ++i) o[i] = weight[i] * (h[i] * inv);
  }
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i] for the fused gate/up projection output [T, 2I].
void silu_mul_f32(const float* gu, float* out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(threads_for(T * I, nthreads)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
#ifdef PS_HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

// Rotary embedding (rotate-half form) of the fused q/k/v projection output qkv [T, (H + 2 KVH) * D]
// at `positions`, with cos/sin tables [max_pos, D]: q rotated into q_out [T, H, D]; k rotated and v
// copied into the paged caches at `slots` (cache rows [num_slots, KVH, D]). One pass instead of
// the rotation ops plus two index_copy_ calls.
void rope_qkv_f32(const float* qkv, const int64_t* positions, const float* cos_t, const float* sin_t,
                  const int64_t* slots, float* q_out, float* k_cache, float* v_cache, int64_t T, int64_t H,
                  int64_t KVH, int64_t D, int nthreads) {
  const int64_t half = D / 2, W = (H + 2 * KVH) * D;
#pragma omp parallel for num_threads(threads_for(T * W, nthreads)) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv + t * W;
    const float* c = cos_t + positions[t] * D;
    const float* s = sin_t + positions[t] * D;
    float* kdst = k_cache + slots[t] * KVH * D;
    float* vdst = v_cache + slots[t] * KVH * D;
    for (int64_t h = 0; h < H + KVH; ++h) {
      const float* x = row + h * D;
      float* o = h < H ? q_out + (t * H + h) * D : kdst + (h - H) * D;
      for (int64_t i = 0; i < half; ++i) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
    }
    const float* v = row + (H + KVH) * D;
    for (int64_t i = 0; i < KVH * D; ++i) vdst[i] = v[i];
  }
}

// Index of the largest value of each row of x [R, V], the first one on ties; a NaN counts as the
// largest, as in torch.argmax.
void argmax_f32(const float* x, int64_t R, int64_t V, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(threads_for(R * V, nthreads)) schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x + r * V;
    int64_t i = 0;
    float m = -INFINITY;
    bool nan = false;
#ifdef PS_HAVE_AVX2
    if (V >= 8) {
      __m256 mv = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
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
      nan = nan || std::isnan(row[i]);
      m = row[i] > m ? row[i] : m;
    }
    int64_t best = 0;
    for (int64_t j = 0; j < V; ++j)
      if (nan ? std::isnan(row[j]) : row[j] == m) {
        best = j;
        break;
      }
    out[r] = best;
  }
}

int fused_ops_vectorized() {
#ifdef PS_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}
}
