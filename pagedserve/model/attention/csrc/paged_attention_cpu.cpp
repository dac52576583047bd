// Paged decode attention for the CPU: one query token per sequence attends to its whole
// context, reading K/V rows in place from the block pool (no gather copy). GQA-aware: the
// query heads that share a kv head are processed together, so each K/V row is read once.
// Accumulation is in float32 whatever the storage type. Plain C ABI (called through ctypes),
// so it builds in about a second without torch's headers.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

static inline float load(const float* p, int64_t i) { return p[i]; }
static inline float load(const uint16_t* p, int64_t i) {  // bfloat16 -> float32
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline void store(float* p, int64_t i, float v) { p[i] = v; }
static inline void store(uint16_t* p, int64_t i, float v) {  // float32 -> bfloat16, round to nearest even
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

template <typename T>
static void decode(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, T* out,
                   int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MAXB, float scale,
                   int nthreads) {
  const int64_t G = H / KVH;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qf(G * D), acc(G * D), scores, krow(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * KVH; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = lens[b];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q, (b * H + kh * G + g) * D + d) * scale;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t base = ((bt[b * MAXB + t / BS] * BS + t % BS) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) krow[d] = load(kc, base + d);
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qr[d] * krow[d];
          scores[g * L + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        float m = sc[0];
        for (int64_t t = 1; t < L; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t base = ((bt[b * MAXB + t / BS] * BS + t % BS) * KVH + kh) * D;
        for (int64_t d = 0; d < D; ++d) krow[d] = load(vc, base + d);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * krow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) store(out, (b * H + kh * G + g) * D + d, acc[g * D + d]);
    }
  }
}

extern "C" {
void paged_decode_f32(const float* q, const float* kc, const float* vc, const int64_t* bt, const int64_t* lens,
                      float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t MAXB,
                      float scale, int nthreads) {
  decode<float>(q, kc, vc, bt, lens, out, B, H, KVH, D, BS, MAXB, scale, nthreads);
}
void paged_decode_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                       const int64_t* lens, uint16_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                       int64_t BS, int64_t MAXB, float scale, int nthreads) {
  decode<uint16_t>(q, kc, vc, bt, lens, out, B, H, KVH, D, BS, MAXB, scale, nthreads);
}
}
