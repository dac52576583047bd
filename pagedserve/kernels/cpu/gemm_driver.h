// The GEMM driver: x packing, k blocking, the tile shapes each ISA runs, and gemm_tiles / gemm,
// which walk the packed panels over the threads and hand each finished tile to an epilogue.
//
// Part of gemm_cpu.cpp: included there, inside its anonymous namespace, after the constants and
// the headers it relies on; not a standalone header.
#pragma once

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
