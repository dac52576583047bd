// Linear layers computed straight from grouped integer weights (no float copy of the weight kept).
//
// One layout serves every integer format pagedserve loads (GGUF Q4_0/Q4_1/Q8_0/K-quants, AWQ,
// GPTQ, compressed-tensors, int8 quantized at load): the weight W [N, K] is stored as integers q
// with, per output row n and group of `group` consecutive input columns, a float32 scale s and an
// optional float32 offset m:
//     W[n, k] = q[n, k] * s[n, k / group] + m[n, k / group]
// bits = 8: q is int8, row-major [N, K].
// bits = 4: q is 0..15, two per byte, in blocks of 32 columns: byte j of a block holds column j in
//           its low nibble and column j + 16 in its high one (GGUF's Q4_0 / Q4_1 order, so those
//           blocks are used as stored); K and the group are multiples of 32.
// Products and sums are float32: x · W is Σ_g s_g (Σ_{k in g} q_k x_k) + Σ_g m_g (Σ_{k in g} x_k),
// the same value as the dequantized weight's product up to the order of the float32 additions.
// Decode-sized batches (a few rows) take qlinear_rows: each weight group is widened to float32 in
// registers once for up to 4 activation rows; it is bound by the bytes of q read from memory.
// Larger batches dequantize into a float32 buffer (quant_dequant) and use a dense GEMM.
// w8a8_linear: int8 weights per output channel times activations quantized per row to int8 on the
// fly, products summed exactly in int32.
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <algorithm>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX2__
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

// Σ_{k in group g} q_k x_k for R activation rows, one output row: the group's integer weights are
// widened once and used for every row.
template <int R>
inline void group_dots(const uint8_t* q, int bits, int64_t k0, int64_t k1, const float* x, int64_t ldx,
                       float* dots) {
#ifdef __AVX2__
    __m256 t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_ps();
    int64_t k = k0;
    if (bits == 4) {
        const __m128i low = _mm_set1_epi8(0x0f);
        for (; k < k1; k += 32) {
            __m128i b = _mm_loadu_si128((const __m128i*)(q + k / 2));
            __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            for (int r = 0; r < R; ++r) {
                const float* xr = x + r * ldx + k;
                t[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), t[r]);
                t[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t[r]);
                t[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t[r]);
                t[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t[r]);
            }
        }
    } else {
        const int8_t* qs = (const int8_t*)q;
        for (; k + 16 <= k1; k += 16) {
            __m128i b = _mm_loadu_si128((const __m128i*)(qs + k));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            for (int r = 0; r < R; ++r) {
                const float* xr = x + r * ldx + k;
                t[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), t[r]);
                t[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t[r]);
            }
        }
        for (; k + 8 <= k1; k += 8) {
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + k))));
            for (int r = 0; r < R; ++r) t[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), t[r]);
        }
    }
    for (int r = 0; r < R; ++r) dots[r] = hsum8(t[r]);
    if (bits == 8) {
        const int8_t* qs = (const int8_t*)q;
        for (; k < k1; ++k)
            for (int r = 0; r < R; ++r) dots[r] += (float)qs[k] * x[r * ldx + k];
    }
#else
    for (int r = 0; r < R; ++r) dots[r] = 0.f;
    for (int64_t k = k0; k < k1; ++k) {
        float w;
        if (bits == 4) {
            int64_t blk = k & ~(int64_t)31, j = k & 31;
            uint8_t b = q[blk / 2 + (j & 15)];
            w = (float)(j < 16 ? (b & 15) : (b >> 4));
        } else {
            w = (float)((const int8_t*)q)[k];
        }
        for (int r = 0; r < R; ++r) dots[r] += w * x[r * ldx + k];
    }
#endif
}

template <int R>
void rows_block(const float* x, int64_t ldx, const uint8_t* q, int bits, int64_t N, int64_t K, int64_t group,
                const float* s, const float* m, const float* xsum, const float* bias, float* y, int64_t ldy,
                int threads) {
    const int64_t G = (K + group - 1) / group;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for num_threads(threads) schedule(static, 8)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* qn = q + n * row_bytes;
        const float* sn = s + n * G;
        float acc[R] = {0};
        float off[R] = {0};
        float dots[R];
        for (int64_t g = 0; g < G; ++g) {
            const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
            group_dots<R>(qn, bits, k0, k1, x, ldx, dots);
            for (int r = 0; r < R; ++r) acc[r] += dots[r] * sn[g];
            if (m)
                for (int r = 0; r < R; ++r) off[r] += m[n * G + g] * xsum[r * G + g];
        }
        const float b = bias ? bias[n] : 0.f;
        for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r] + off[r] + b;
    }
}

}  // namespace

extern "C" {

int quant_linear_simd() {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) · Wᵀ + bias, W as described at the top.
void quant_linear_rows(const float* x, int64_t ldx, int64_t M, const uint8_t* q, int bits, int64_t N, int64_t K,
                       int64_t group, const float* s, const float* m, const float* bias, float* y, int64_t ldy,
                       int threads) {
    const int64_t G = (K + group - 1) / group;
    std::vector<float> xsum;
    if (m) {  // Σ x over each group, for the offsets' share
        xsum.assign(M * G, 0.f);
        for (int64_t r = 0; r < M; ++r)
            for (int64_t g = 0; g < G; ++g) {
                float t = 0.f;
                for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) t += x[r * ldx + k];
                xsum[r * G + g] = t;
            }
    }
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, M - r0);
        const float* xr = x + r0 * ldx;
        const float* xs = m ? xsum.data() + r0 * G : nullptr;
        float* yr = y + r0 * ldy;
        switch (rows) {
            case 1: rows_block<1>(xr, ldx, q, bits, N, K, group, s, m, xs, bias, yr, ldy, threads); break;
            case 2: rows_block<2>(xr, ldx, q, bits, N, K, group, s, m, xs, bias, yr, ldy, threads); break;
            case 3: rows_block<3>(xr, ldx, q, bits, N, K, group, s, m, xs, bias, yr, ldy, threads); break;
            default: rows_block<4>(xr, ldx, q, bits, N, K, group, s, m, xs, bias, yr, ldy, threads); break;
        }
    }
}

// w [N, K] float32 = the dequantized weight.
void quant_dequant(const uint8_t* q, int bits, int64_t N, int64_t K, int64_t group, const float* s, const float* m,
                   float* w, int threads) {
    const int64_t G = (K + group - 1) / group;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* qn = q + n * row_bytes;
        float* wn = w + n * K;
        for (int64_t g = 0; g < G; ++g) {
            const float sc = s[n * G + g], of = m ? m[n * G + g] : 0.f;
            const int64_t k1 = std::min(K, (g + 1) * group);
            if (bits == 4) {
                for (int64_t k = g * group; k < k1; k += 32)
                    for (int j = 0; j < 16; ++j) {
                        const uint8_t b = qn[k / 2 + j];
                        wn[k + j] = (float)(b & 15) * sc + of;
                        wn[k + j + 16] = (float)(b >> 4) * sc + of;
                    }
            } else {
                const int8_t* qs = (const int8_t*)qn;
                for (int64_t k = g * group; k < k1; ++k) wn[k] = (float)qs[k] * sc + of;
            }
        }
    }
}

// y [M, N] = (xq · qᵀ) * xscale[row] * s[n] + bias: q int8 [N, K] with one scale per output row;
// each activation row is quantized to int8 with scale max|x| / 127 (symmetric, dynamic per token).
void w8a8_linear(const float* x, int64_t ldx, int64_t M, const int8_t* q, int64_t N, int64_t K, const float* s,
                 const float* bias, float* y, int64_t ldy, int threads) {
    std::vector<int8_t> xq(M * K);
    std::vector<float> xscale(M);
    for (int64_t r = 0; r < M; ++r) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, fabsf(x[r * ldx + k]));
        const float sc = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / sc;
        xscale[r] = sc;
        for (int64_t k = 0; k < K; ++k) xq[r * K + k] = (int8_t)lrintf(std::min(127.f, std::max(-127.f, x[r * ldx + k] * inv)));
    }
#pragma omp parallel for num_threads(threads) schedule(static, 8)
    for (int64_t n = 0; n < N; ++n) {
        const int8_t* qn = q + n * K;
        for (int64_t r = 0; r < M; ++r) {
            const int8_t* xr = xq.data() + r * K;
            int64_t k = 0;
            int32_t dot = 0;
#ifdef __AVX2__
            __m256i acc = _mm256_setzero_si256();
            for (; k + 16 <= K; k += 16) {  // int8 → int16, pairs multiplied and summed into int32: exact
                __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(qn + k)));
                __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(xr + k)));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
            }
            dot = hsum8i(acc);
#endif
            for (; k < K; ++k) dot += (int32_t)qn[k] * (int32_t)xr[k];
            y[r * ldy + n] = (float)dot * xscale[r] * s[n] + (bias ? bias[n] : 0.f);
        }
    }
}

}  // extern "C"
