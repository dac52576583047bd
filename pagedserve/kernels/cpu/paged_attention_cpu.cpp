// Paged attention for the CPU, reading K/V in place from the block pool (no gather copy).
//
// One kernel serves decodes and prefill chunks alike: sequence b has qn = q_starts[b+1] -
// q_starts[b] query tokens, the last qn positions of its context of seq_lens[b] tokens, and each
// attends causally to its context. (A decode is qn = 1; a prompt chunk after a prefix-cache hit
// or an earlier chunk is qn > 1 with earlier context.) The new tokens' K/V are already in the pool.
//
// Work item = (sequence, kv heads, up to kQueryChunk queries). Within an item the context is
// walked block by block (on the tiled path a span of blocks at a time) with an online softmax, so
// each K/V block is read from memory once for all the queries and the query heads that share the
// kv head (GQA), and the scores never need a buffer the size of the context. Accumulation is
// float32 whatever the storage type.
//
// Two paths (AVX2+FMA, float32 and bfloat16 storage, head size a multiple of 8):
//   paged_attention_rows.h   decodes and short chunks: each (query, head) row on its own
//   paged_attention_tiled.h  prompt chunks: the rows of a kv head as small register-tiled products
//                            over spans of blocks (paged_attention_span.h; 16-wide with AVX-512)
// and, with AVX-512, bfloat16 decodes of head size 64 or 128 on paged_attention_decode.h (the G
// heads of a kv head through each K/V row together); with AMX-BF16, bfloat16 prompt chunks of
// head sizes a multiple of 32 on paged_attention_amx.h (the products as tile products); with
// AVX512-BF16 where vdpbf16ps issues as often as an FMA (Zen 4), the tiled path's bfloat16 walk
// on paged_attention_dot.h (products of bfloat16 pairs).
// Built for the CPU it runs on: with AVX-512, the rows' dot products and P·V sums and the tiles'
// 16-key / 16-dim cases use 16-wide vectors (~1.1x on the workloads' shapes, cpu_attention_ab.py).
// Other head sizes and CPUs take a scalar path with the rows structure. Plain C ABI, called
// through ctypes, so it builds in a couple of seconds without torch's headers. The headers are
// part of the build's cache key (build.py).
#include <type_traits>

#include "paged_attention_amx.h"
#include "paged_attention_common.h"
#include "paged_attention_decode.h"
#include "paged_attention_rows.h"
#include "paged_attention_tiled.h"

namespace {

constexpr int64_t kQueryChunk = 32;
// Prompt chunks on the AMX path take longer query chunks: an item packs every K/V span it walks
// (keys copied as tile rows, values transposed), and 128 queries share that packing four times as
// widely as 32 (1.2-1.3x on 512- and 1056-token prompts, cpu_attention_ab.py; a row's arithmetic
// does not depend on the chunk, so the bits do not change).
constexpr int64_t kAmxQueryChunk = 128;
// prompt chunks with at least this many query rows per kv head take the tiled path
constexpr int64_t kTiledMinRows = 8;
// Shared-prefix decode: at least this many decodes starting with at least this many common full
// blocks read those blocks together, up to kShareChunk sequences per work item.
constexpr int64_t kShareMinSeqs = 4;
constexpr int64_t kShareMinBlocks = 4;
constexpr int64_t kShareChunk = 32;
static_assert(kShareChunk <= kQueryChunk, "a shared-prefix item's rows must fit an item's work buffer");

struct SharedPrefix {
  std::vector<int64_t> members;  // sequences (decodes) that start with the same blocks
  int64_t blocks;                // how many full blocks they share
};

// Decodes grouped by their first block (prefix caching hands equal prefixes the same physical
// blocks), each group cut to the blocks all its members share and fully see.
std::vector<SharedPrefix> find_shared_prefixes(const int64_t* bt, const int64_t* seq_lens, const int64_t* q_starts,
                                               int64_t B, int64_t BS, int64_t MAXB) {
  std::vector<std::pair<int64_t, int64_t>> by_first;  // (first block, sequence)
  for (int64_t b = 0; b < B; ++b)
    if (q_starts[b + 1] - q_starts[b] == 1 && seq_lens[b] >= kShareMinBlocks * BS) by_first.push_back({bt[b * MAXB], b});
  std::sort(by_first.begin(), by_first.end());
  std::vector<SharedPrefix> groups;
  for (size_t i = 0; i < by_first.size();) {
    size_t j = i;
    while (j < by_first.size() && by_first[j].first == by_first[i].first) ++j;
    if (static_cast<int64_t>(j - i) >= kShareMinSeqs) {
      SharedPrefix g{{}, MAXB};
      for (size_t k = i; k < j; ++k) {
        const int64_t b = by_first[k].second;
        g.members.push_back(b);
        g.blocks = std::min(g.blocks, seq_lens[b] / BS);  // a decode sees all of its full blocks
      }
      const int64_t* t0 = bt + g.members[0] * MAXB;
      for (int64_t b : g.members) {
        int64_t n = 0;
        while (n < g.blocks && bt[b * MAXB + n] == t0[n]) ++n;
        g.blocks = n;
      }
      if (g.blocks >= kShareMinBlocks) groups.push_back(std::move(g));
    }
    i = j;
  }
  return groups;
}

// Whether decodes take the AVX-512 decode kernel where it takes the dtype and shape
// (paged_attention_decode.h);
// paged_attention_set_decode_kernel(0) sends them down the row path, for A/B runs and tests.
bool use_decode_kernel = true;
// Whether bfloat16 prompt chunks take the AMX tiles where this build and CPU have them
// (paged_attention_amx.h); paged_attention_set_amx(0) sends them down the tiled path.
bool use_amx = true;

template <typename T>
void attention(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* seq_lens,
               const int64_t* q_starts, T* out, int64_t B, const Shape& s, int nthreads) {
  // An item covers every kv head of a query chunk, so it walks each K/V block as one contiguous
  // piece of memory. Only when there are too few items to keep the threads busy (one long
  // sequence decoding) are the kv heads split across items.
#ifdef PS_HAVE_AMX
  const bool amx = std::is_same_v<T, uint16_t> && use_amx && amx_path(s) && amx_permitted();
#else
  const bool amx = false;
#endif
  auto chunk_for = [amx](int64_t qn) { return amx && qn > 1 ? kAmxQueryChunk : kQueryChunk; };
  int64_t n_chunks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qn = q_starts[b + 1] - q_starts[b], chunk = chunk_for(qn);
    n_chunks += (qn + chunk - 1) / chunk;
  }
  const int64_t want = 4 * static_cast<int64_t>(nthreads);
  const int64_t kv_split = n_chunks >= want ? 1 : std::min(s.KVH, (want + n_chunks - 1) / std::max<int64_t>(n_chunks, 1));
  const int64_t kv_per_item = (s.KVH + kv_split - 1) / kv_split;
  const int64_t G = s.H / s.KVH;
  struct Item {
    int64_t b, i0, i1, kh0, kh1;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qn = q_starts[b + 1] - q_starts[b], chunk = chunk_for(qn);
    // a sequence's later chunks first: they see the most keys, and the dynamic schedule then
    // ends on the short ones
    for (int64_t i0 = (qn - 1) / chunk * chunk; i0 >= 0; i0 -= chunk)
      for (int64_t kh0 = 0; kh0 < s.KVH; kh0 += kv_per_item)
        items.push_back({b, i0, std::min(qn, i0 + chunk), kh0, std::min(s.KVH, kh0 + kv_per_item)});
  }
#ifdef PS_HAVE_AVX2
  const int64_t W = tile_width(s);  // at least a block rounded up to 8 keys, what the row path takes
#else
  const int64_t W = (s.BS + 7) / 8 * 8;
#endif
  size_t work_floats = static_cast<size_t>(kQueryChunk * kv_per_item * G * (2 * s.D + W + 8) + s.D * W + W + 16);
#ifdef PS_HAVE_AMX
  if (amx) work_floats = std::max(work_floats, amx_work_floats(kAmxQueryChunk * G, s));
#endif
#ifdef PS_HAVE_AVX2
  const bool vec = s.D % 8 == 0;
  // shared-prefix pass: (group, kv head, up to kShareChunk members) items, their rows' states
  // saved for the per-sequence items to continue from
  struct ShareItem {
    const SharedPrefix* group;
    int64_t j0, j1, kh;
  };
  std::vector<SharedPrefix> groups;
  if (vec) groups = find_shared_prefixes(bt, seq_lens, q_starts, B, s.BS, s.MAXB);
  std::vector<ShareItem> share_items;
  std::vector<int64_t> shared_blocks(groups.empty() ? 0 : B, 0);
  const int64_t share_chunk = amx ? kAmxQueryChunk : kShareChunk;  // (members: one row per query head)
  for (const SharedPrefix& g : groups) {
    const int64_t n = static_cast<int64_t>(g.members.size());
    for (int64_t j0 = 0; j0 < n; j0 += share_chunk)
      for (int64_t kh = 0; kh < s.KVH; ++kh) share_items.push_back({&g, j0, std::min(n, j0 + share_chunk), kh});
    for (int64_t b : g.members) shared_blocks[b] = g.blocks;
  }
  std::vector<float> state(groups.empty() ? 0 : static_cast<size_t>(B * s.H * (s.D + 2)));
  const int64_t n_share = static_cast<int64_t>(share_items.size());
#endif
#ifdef PS_HAVE_AVX512
  const DecodeFn<T> decode = use_decode_kernel ? decode_kernel<T>(s) : nullptr;
#endif
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> work(work_floats);
    bool tiles_configured = false;  // this thread's AMX tiles, set up on its first AMX item
#ifdef PS_HAVE_AVX2
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < n_share; ++k) {  // (the implicit barrier: every state is written before use)
      const ShareItem& it = share_items[k];
      const SharedPrefix& g = *it.group;
#ifdef PS_HAVE_AMX
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (amx) {
          if (!tiles_configured) amx_configure(), tiles_configured = true;
          shared_prefix_amx(q, kc, vc, bt + g.members[0] * s.MAXB, q_starts, g.members.data() + it.j0, it.j1 - it.j0,
                            g.blocks, it.kh, s, state.data(), work.data());
          continue;
        }
      }
#endif
      shared_prefix_tiled(q, kc, vc, bt + g.members[0] * s.MAXB, q_starts, g.members.data() + it.j0, it.j1 - it.j0,
                          g.blocks, it.kh, s, state.data(), work.data());
    }
#endif
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
      // a decode of a shared-prefix group continues from the state of its rows (decode or row path)
      const int64_t blk0 = shared_blocks.empty() ? 0 : shared_blocks[it.b];
#ifdef PS_HAVE_AVX512
      if (decode != nullptr && qn == 1) {
        decode(qp, kc, vc, bt + it.b * s.MAXB, seq_lens[it.b], it.kh0, it.kh1, s, op, work.data(), blk0,
               blk0 > 0 ? state.data() + it.b * s.H * (s.D + 2) : nullptr);
        continue;
      }
#endif
      if (vec && rs.qn * G >= kTiledMinRows && blk0 == 0) {
#ifdef PS_HAVE_AMX
        if constexpr (std::is_same_v<T, uint16_t>) {
          if (amx && qn > 1) {  // (a decode keeps float32 probabilities past a shared prefix, as on its other paths)
            if (!tiles_configured) amx_configure(), tiles_configured = true;
            item_amx(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
            continue;
          }
        }
#endif
        item_tiled(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
        continue;
      }
      if (vec) {
        item_avx2(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data(), blk0,
                  blk0 > 0 ? state.data() + it.b * s.H * (s.D + 2) : nullptr);
        continue;
      }
#endif
      item_scalar(qp, kc, vc, bt + it.b * s.MAXB, first_pos, rs, s, op, work.data());
    }
#ifdef PS_HAVE_AMX
    // back to the initial state, so that no other user of the tiles on this thread (oneDNN,
    // torch) runs on this configuration; they configure their own before use
    if (tiles_configured) _tile_release();
#else
    (void)tiles_configured;
#endif
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
// 1 = decodes take the AVX-512 decode kernel where this build has it and the dtype and shape fit
// (the default), 0 = the row path. Returns 1 when the decode kernel is built in.
int paged_attention_set_decode_kernel(int on) {
  use_decode_kernel = on != 0;
#ifdef PS_HAVE_AVX512
  return 1;
#else
  return 0;
#endif
}
// 1 = bfloat16 prompt chunks take the AMX tiles where this build and CPU have them (the default),
// 0 = the tiled path. Returns 1 when the AMX path is built in and the OS grants the tiles.
int paged_attention_set_amx(int on) {
  use_amx = on != 0;
#ifdef PS_HAVE_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}
// 1 = bfloat16 prompt chunks and shared-prefix passes on the tiled path take the vdpbf16ps walk
// (paged_attention_dot.h) and the decode kernel's scores run on vdpbf16ps, 0 = float32 FMAs for
// both (the default: cpu_kernels.py turns it on
// where the GEMM library's probe finds vdpbf16ps faster than FMAs). Returns 1 when the walk is
// built in (AVX512-BF16).
int paged_attention_set_bf16_dot(int on) {
#ifdef PS_HAVE_BF16_DOT
  use_bf16_dot = on != 0;
  return 1;
#else
  (void)on;
  return 0;
#endif
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
