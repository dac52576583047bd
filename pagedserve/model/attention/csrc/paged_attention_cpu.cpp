// Paged attention for the CPU, reading K/V in place from the block pool (no gather copy).
//
// One kernel serves decodes and prefill chunks alike: sequence b has qn = q_starts[b+1] -
// q_starts[b] query tokens, the last qn positions of its context of seq_lens[b] tokens, and each
// attends causally to its context. (A decode is qn = 1; a prompt chunk after a prefix-cache hit
// or an earlier chunk is qn > 1 with earlier context.) The new tokens' K/V are already in the pool.
//
// Work item = (sequence, kv heads, up to kQueryChunk queries). Within an item the context is
// walked block by block with an online softmax, so each K/V block is read from memory once for
// all the queries and the query heads that share the kv head (GQA), and the scores never need a
// buffer the size of the context. Accumulation is float32 whatever the storage type.
//
// Two paths (AVX2+FMA, float32 and bfloat16 storage, head size a multiple of 8):
//   paged_attention_rows.h   decodes and short chunks: each (query, head) row on its own
//   paged_attention_tiled.h  prompt chunks: the rows of a kv head as small register-tiled products
// Other head sizes and CPUs take a scalar path with the rows structure. Plain C ABI, called
// through ctypes, so it builds in a couple of seconds without torch's headers. The headers are
// part of the build's cache key (model/native_build.py).
#include "paged_attention_common.h"
#include "paged_attention_rows.h"
#include "paged_attention_tiled.h"

namespace {

constexpr int64_t kQueryChunk = 32;
// prompt chunks with at least this many query rows per kv head take the tiled path
constexpr int64_t kTiledMinRows = 8;

template <typename T>
void attention(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* seq_lens,
               const int64_t* q_starts, T* out, int64_t B, const Shape& s, int nthreads) {
  // An item covers every kv head of a query chunk, so it walks each K/V block as one contiguous
  // piece of memory. Only when there are too few items to keep the threads busy (one long
  // sequence decoding) are the kv heads split across items.
  int64_t n_chunks = 0;
  for (int64_t b = 0; b < B; ++b) n_chunks += (q_starts[b + 1] - q_starts[b] + kQueryChunk - 1) / kQueryChunk;
  const int64_t want = 4 * static_cast<int64_t>(nthreads);
  const int64_t kv_split = n_chunks >= want ? 1 : std::min(s.KVH, (want + n_chunks - 1) / std::max<int64_t>(n_chunks, 1));
  const int64_t kv_per_item = (s.KVH + kv_split - 1) / kv_split;
  const int64_t G = s.H / s.KVH;
  struct Item {
    int64_t b, i0, i1, kh0, kh1;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qn = q_starts[b + 1] - q_starts[b];
    for (int64_t i0 = 0; i0 < qn; i0 += kQueryChunk)
      for (int64_t kh0 = 0; kh0 < s.KVH; kh0 += kv_per_item)
        items.push_back({b, i0, std::min(qn, i0 + kQueryChunk), kh0, std::min(s.KVH, kh0 + kv_per_item)});
  }
  const int64_t W = (s.BS + 7) / 8 * 8;
  const size_t work_floats =
      static_cast<size_t>(kQueryChunk * kv_per_item * G * (2 * s.D + W + 8) + s.D * W + W + 16);
#ifdef PS_HAVE_AVX2
  const bool vec = s.D % 8 == 0;
#endif
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> work(work_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < n_items; ++k) {
      const Item& it = items[k];
      const int64_t qn = q_starts[it.b + 1] - q_starts[it.b];
      const int64_t row0 = q_starts[it.b] + it.i0;
      const T* qp = q + row0 * s.H * s.D;
      T* op = out + row0 * s.H * s.D;
      const int64_t first_pos = seq_lens[it.b] - qn + it.i0;
      const Rows rs{it.i1 - it.i0, it.kh0 * G, (it.kh1 - it.kh0) * G, G};
#ifdef PS_HAVE_AVX2
      if (vec && rs.qn * G >= kTiledMinRows) {
        item_tiled(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
        continue;
      }
      if (vec) {
        item_avx2(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
        continue;
      }
#endif
      item_scalar(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
    }
  }
}

}  // namespace

extern "C" {
void paged_attention_f32(const float* q, const float* kc, const float* vc, const int64_t* bt,
                         const int64_t* seq_lens, const int64_t* q_starts, float* out, int64_t B, int64_t H,
                         int64_t KVH, int64_t D, int64_t BS, int64_t MAXB, float scale, int nthreads) {
  attention<float>(q, kc, vc, bt, seq_lens, q_starts, out, B, Shape{H, KVH, D, BS, MAXB, scale}, nthreads);
}
void paged_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                          const int64_t* seq_lens, const int64_t* q_starts, uint16_t* out, int64_t B, int64_t H,
                          int64_t KVH, int64_t D, int64_t BS, int64_t MAXB, float scale, int nthreads) {
  attention<uint16_t>(q, kc, vc, bt, seq_lens, q_starts, out, B, Shape{H, KVH, D, BS, MAXB, scale}, nthreads);
}
// 1 when this build has the vectorised path (for logs and tests)
int paged_attention_vectorized() {
#ifdef PS_HAVE_AVX2
  return 1;
#else
  return 0;
#endif
}
}
