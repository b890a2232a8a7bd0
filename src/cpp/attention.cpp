// SPDX-License-Identifier: MIT
// The driver: splits one attention call into independent tiles, runs them on the threads
// (parallel.h), owns the per-thread scratch, and normalises the kernels' running state into the
// output.
//
// Work split. A task is (batch*head, block of query rows). When there are too few tasks to keep a
// machine busy (short queries, few heads: decode), each task's key range is also split into chunks;
// every chunk produces a partial (m, l, acc) and the chunks are merged in a fixed order with
// log-sum-exp rescaling. The decision depends only on the problem's shape, never on the thread
// count, so the result is bitwise identical for any number of threads. Each thread runs its own
// range of the tasks (ItemRanges, parallel.h), then helps with what is left of the others'; within a
// head, last query blocks first: under a causal mask they are the longest. When the arrays
// come from memory in small pieces (many short heads), each thread claims its next item before
// starting the current one and prefetches the next item's rows while it works (ItemPrefetch).
//
// Memory: per thread one query block, one score block and one accumulator (O(block_rows * (head_dim
// + key_block + value_dim)), plus one K and one V block converted from 16 bits when K/V are stored so);
// split calls add one partial accumulator per work item, whose count is
// bounded by kTaskTarget tasks' worth; a boolean mask may be packed to bits, one bit per element of
// each distinct mask, up to kMaxPackedMaskBytes. Nothing is O(q_len * kv_len) except the caller's
// weights.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "parallel.h"

#if defined(PYATTN_FORK_GUARD)
#include <pthread.h>
#endif

namespace pyattn {
namespace {

// Below this many tasks the key range is split: enough independent items for the threads to
// balance (ItemRanges) on machines with up to a few dozen cores.
constexpr int64_t kTaskTarget = 64;
// A chunk of a split key range is at least this many key blocks (256 keys for float32 tiles), so the
// merge (one pass over the chunk's accumulators) stays under 1% of the chunk's work.
constexpr int64_t kMinChunkBlocks = 1;
// Query rows per decode work item (kDecodeMaxLen, attention.h, picks the decode kernel), and the
// smallest key chunk worth a work item of its own (chunks are whole decode blocks,
// KernelSet::decode_block).
constexpr int64_t kDecodeMaxRows = 16;
constexpr int64_t kDecodeMinChunk = 256;
constexpr size_t kAlign = 64;  // cache line

std::atomic<int> g_default_threads{0};  // set_num_threads(); read by every call, from any thread

// Boolean masks are packed to bits once per call when the bits take at most this many bytes: 8 MiB
// covers a mask broadcast over batch and heads up to L = S = 8192 (a 64 MiB bool array), and keeps
// the working memory bounded whatever L * S is (DESIGN: never O(L * S)). Bigger masks are read as
// bytes by the tiles, which costs ~5% of a masked call at L = S = 4096 (measured: 1x8x4096x64).
constexpr int64_t kMaxPackedMaskBytes = int64_t(8) << 20;
std::atomic<int64_t> g_packed_mask_limit{kMaxPackedMaskBytes};
std::atomic<int> g_prefetch{-1};  // set_prefetch: -1 by cache sizes, 0 never, 1 K/V rows, 2 next items
std::atomic<int> g_decode_streams{-1};  // set_decode_streams: -1 by storage and size, else 1, 2 or 4
std::atomic<int> g_decode_block16{-1};  // set_decode_block16: -1 by rule, else 32 or 64
std::atomic<int> g_decode_fuse{-1};  // set_decode_fuse: -1 by rule, else 0 or 1
std::atomic<int> g_decode_prefetch_level{-1};  // set_decode_prefetch_level: -1 by rule, else 1 or 2
std::atomic<int> g_group_tiles{1};  // set_group_tiles: 1 GQA groups' heads together, 0 head by head
std::atomic<int> g_pack_heads{-1};  // set_pack_heads: -1 by sizes, 0 never, 1 whenever K/V heads interleave
std::atomic<int> g_decode_heads{-1};  // set_decode_heads: -1 by rule where K/V heads interleave, 0 never, 1 always

// The last-level cache in bytes (L3, else L2; 0 when CPUID does not tell): what decides whether a
// call's arrays come from memory (the prefetch conditions below).
int64_t last_level_cache_bytes() { return std::max(cache_bytes(3), cache_bytes(2)); }

// Whether the rows of consecutive key/value heads interleave in memory: a (batch, seq, heads,
// head_dim) array viewed heads first, where each head's row is head_dim elements out of every
// heads * head_dim. Such rows are read in another order (attend_decode, the tile driver).
template <class T>
bool kv_heads_interleave(const AttnArgs<T>& a) {
  return a.num_heads > a.group && std::abs(a.k_offset[a.group] - a.k_offset[0]) < a.k_stride_s &&
         std::abs(a.v_offset[a.group] - a.v_offset[0]) < a.v_stride_s;
}

// The CPU vendor, for the prefetch rules measured per vendor (compared once, not per call).
bool cpu_is_amd() {
  static const bool amd = std::strcmp(cpu_vendor(), "AuthenticAMD") == 0;
  return amd;
}
}  // namespace

bool cpu_is_intel() {
  static const bool intel = std::strcmp(cpu_vendor(), "GenuineIntel") == 0;
  return intel;
}

// AMD's family 1Ah (Zen 5) and later, whose decode rule was measured apart from Zen 3/4's (family 19h).
bool cpu_is_amd_zen5_on() {
  static const bool zen5 = cpu_is_amd() && cpu_family() >= 0x1A;
  return zen5;
}

namespace {

size_t padded(size_t elems, size_t elem_size) {
  const size_t per_line = kAlign / elem_size;
  return (elems + per_line - 1) / per_line * per_line;
}

// Carves one item's running state (acc, m, l) out of `base`.
template <class T>
RowState<T> state_at(T* base, int64_t block_rows, int64_t value_dim) {
  const size_t acc = padded(size_t(block_rows * value_dim), sizeof(T));
  const size_t row = padded(size_t(block_rows), sizeof(T));
  return RowState<T>{base, base + acc, base + acc + row};
}

template <class T>
size_t state_elems(int64_t block_rows, int64_t value_dim) {
  return padded(size_t(block_rows * value_dim), sizeof(T)) + 2 * padded(size_t(block_rows), sizeof(T));
}

// Where a state keeps row i's accumulator for value column e: acc[i * row + e * col].
struct AccLayout {
  int64_t row;
  int64_t col;
};

// out_row(i)[e] = acc[i][e] / l[i]; a row that saw no allowed key (l == 0) becomes zeros.
template <class T, class OutRow>
void finalize(const RowState<T>& s, AccLayout lay, int64_t rows, int64_t value_dim, OutRow out_row) {
  for (int64_t i = 0; i < rows; ++i) {
    const T l = s.l[i];
    const T inv = l == T(0) ? T(0) : T(1) / l;
    T* o = out_row(i);
    for (int64_t e = 0; e < value_dim; ++e) o[e] = s.acc[i * lay.row + e * lay.col] * inv;
  }
}

// Merges the partial states of one task's key chunks (in chunk order, so the result does not depend
// on which thread computed which chunk) into the output rows.
template <class T, class StateAt, class OutRow>
void merge_partials(int64_t nsplit, StateAt state_of, AccLayout lay, int64_t rows, int64_t value_dim,
                    OutRow out_row) {
  for (int64_t i = 0; i < rows; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    bool nan = false;
    for (int64_t c = 0; c < nsplit; ++c) {
      const T mc = state_of(c).m[i];
      nan = nan || std::isnan(mc);
      m = std::max(m, mc);
    }
    if (nan) m = std::numeric_limits<T>::quiet_NaN();
    T l = 0;
    T* o = out_row(i);
    for (int64_t e = 0; e < value_dim; ++e) o[e] = T(0);
    for (int64_t c = 0; c < nsplit; ++c) {
      const RowState<T> s = state_of(c);
      if (s.m[i] == -std::numeric_limits<T>::infinity()) continue;  // chunk saw nothing allowed
      const T w = std::exp2(s.m[i] - m);
      l += w * s.l[i];
      for (int64_t e = 0; e < value_dim; ++e) o[e] += w * s.acc[i * lay.row + e * lay.col];
    }
    const T inv = l == T(0) ? T(0) : T(1) / l;
    for (int64_t e = 0; e < value_dim; ++e) o[e] *= inv;
  }
}

// How many chunks to split each task's key range into: enough work items for kTaskTarget, chunks of
// at least min_chunk keys, rounded to whole key blocks. Depends on the shape only.
struct Split {
  int64_t count;
  int64_t chunk;
};

Split split_keys(int64_t tasks, int64_t kv_len, int64_t block, int64_t min_chunk) {
  if (tasks >= kTaskTarget || kv_len <= 0) return {1, kv_len};
  const int64_t n = std::min(ceil_div(kTaskTarget, tasks), ceil_div(kv_len, min_chunk));
  if (n <= 1) return {1, kv_len};
  const int64_t chunk = ceil_div(ceil_div(kv_len, n), block) * block;
  return {ceil_div(kv_len, chunk), chunk};
}

// A mask packed to bits for the tile kernels (MaskSlot::bits, and value_bits for an additive one;
// lane_words, the bits again by 32-key chunk).
struct PackedMask {
  std::vector<int64_t> offset;       // [batch_heads], in words
  std::vector<int64_t> lane_offset;  // [batch_heads], in lane words
  std::unique_ptr<AlignedBuffer<uint64_t>> bits, value_bits;
  std::unique_ptr<AlignedBuffer<uint32_t>> lane_words;
};

// Rows [r0, r0 + count) of packed bits (rows words apart) as MaskSlot::lane_words: each row's word
// for keys 32c .. 32c + 31 at lanes[c * lane_rows + row]. A shared row (rows 1) is stored
// kMaxTileRows times, so a tile's vector loads find it in every lane.
void pack_lane_words(const uint64_t* bits, int64_t rows, int64_t words, int64_t kv_len, int64_t r0, int64_t count,
                     int64_t lane_rows, uint32_t* lanes) {
  const int64_t chunks = ceil_div(kv_len, 32);
  for (int64_t c = 0; c < chunks; ++c) {
    uint32_t* out = lanes + c * lane_rows;
    if (rows == 1) {
      const uint32_t word = uint32_t(bits[c / 2] >> (32 * (c % 2)));
      for (int64_t i = 0; i < kMaxTileRows; ++i) out[i] = word;
      continue;
    }
    for (int64_t i = r0; i < r0 + count; ++i) out[i] = uint32_t(bits[i * words + c / 2] >> (32 * (c % 2)));
  }
}

// Packs mask m into p and points m at it, unless the bits would take more than the limit. Heads
// whose offsets coincide (a mask broadcast over batch or heads) share one copy; a mask row shared by
// every query row is packed once. A float mask gets two bits per element (not -inf; a value to add).
template <class T>
void pack_mask_bits(MaskSlot& m, int64_t batch_heads, int64_t q_len, int64_t kv_len, int threads,
                    const KernelSet<T>& ks, PackedMask& p) {
  const bool additive = m.kind == MaskKind::additive;
  const int64_t rows = m.stride_l == 0 ? 1 : q_len, words = ceil_div(kv_len, 64);
  std::vector<std::pair<int64_t, int64_t>> by_offset(static_cast<size_t>(batch_heads));  // (offset, bh)
  bool ordered = true;  // offsets of unbroadcast and batch-shared masks never decrease: no sort needed
  for (int64_t bh = 0; bh < batch_heads; ++bh) {
    by_offset[size_t(bh)] = {m.offset[bh], bh};
    ordered = ordered && (bh == 0 || m.offset[bh] >= m.offset[bh - 1]);
  }
  if (!ordered) std::sort(by_offset.begin(), by_offset.end());
  std::vector<int64_t> distinct;
  p.offset.resize(size_t(batch_heads));
  for (const auto& ob : by_offset) {
    if (distinct.empty() || distinct.back() != ob.first) distinct.push_back(ob.first);
    p.offset[size_t(ob.second)] = int64_t(distinct.size() - 1) * rows * words;
  }
  const int64_t elems = int64_t(distinct.size()) * rows * words;
  const int64_t bytes = elems * int64_t(sizeof(uint64_t)) * (additive ? 2 : 1);
  const int64_t limit = g_packed_mask_limit.load(std::memory_order_relaxed);
  if (bytes > limit) return;
  p.bits.reset(new AlignedBuffer<uint64_t>(size_t(elems)));
  if (additive) p.value_bits.reset(new AlignedBuffer<uint64_t>(size_t(elems)));
  // Lane words when they fit the budget too: the tiles then read a partly masked block's verdicts
  // in place instead of gathering them row by row from the bits for every head (~2-4% of a masked
  // call at L = 128 with the mask shared by all heads, measured as the gain of reusing them).
  const int64_t lane_rows = rows == 1 ? kMaxTileRows : rows, lane_elems = lane_rows * ceil_div(kv_len, 32);
  if (bytes + int64_t(distinct.size()) * lane_elems * int64_t(sizeof(uint32_t)) <= limit) {
    p.lane_words.reset(new AlignedBuffer<uint32_t>(size_t(int64_t(distinct.size()) * lane_elems)));
    p.lane_offset.resize(size_t(batch_heads));
    for (int64_t bh = 0; bh < batch_heads; ++bh) p.lane_offset[size_t(bh)] = p.offset[size_t(bh)] / (rows * words) * lane_elems;
  }
  // Items of 64 rows (a tile's worth): a few hundred KiB of mask bytes each at long key lengths. A
  // mask element costs about what a multiply-add does (a vector compare per 32 bytes, a load per
  // vector of floats), so a small mask is packed by the calling thread: a 128 x 128 mask took a
  // two-thread region (1x1x128x64 with a 128 x 128 mask: 20.0 -> 18.0 us a call, Zen 5).
  const int64_t chunk = 64, chunks = ceil_div(rows, chunk), items = int64_t(distinct.size()) * chunks;
  const KernelTable& kt = active_kernels();
  const int pack_threads = threads_for(double(int64_t(distinct.size()) * rows * kv_len), threads, items);
  parallel_for(items, pack_threads, [&](int64_t n) {
    const int64_t d = n / chunks, r0 = n % chunks * chunk, at = distinct[size_t(d)] + r0 * m.stride_l;
    const int64_t out = (d * rows + r0) * words, count = std::min(chunk, rows - r0);
    if (additive)
      ks.pack_additive(static_cast<const T*>(m.data) + at, m.stride_l, m.stride_s, count, kv_len,
                       p.bits->data() + out, p.value_bits->data() + out);
    else
      kt.pack_mask(static_cast<const uint8_t*>(m.data) + at, m.stride_l, m.stride_s, m.true_forbids, count, kv_len,
                   p.bits->data() + out);
    if (p.lane_words)
      pack_lane_words(p.bits->data() + d * rows * words, rows, words, kv_len, r0, count, lane_rows,
                      p.lane_words->data() + d * lane_elems);
  });
  m.bits = p.bits->data();
  m.value_bits = additive ? p.value_bits->data() : nullptr;
  m.bits_offset = p.offset.data();
  m.bits_stride_l = rows == 1 ? 0 : words;
  m.bits_words = words;
  m.lane_words = p.lane_words ? p.lane_words->data() : nullptr;
  m.lane_offset = p.lane_words ? p.lane_offset.data() : nullptr;
  m.lane_rows = lane_rows;
}

}  // namespace

// Decode over K/V whose heads' rows interleave in memory (kv_heads_interleave) and are whole
// vectors, each key/value head's tile holding all its query rows (at most kDecodeMaxRows): work
// items of every head of a batch entry over a chunk of keys (decode.inc, decode_heads), K and V read
// in address order. Chunks as split_keys gives them for the batch entries as tasks (at least
// kDecodeMinChunk key rows of all heads together), merged as attend_decode merges its chunks.
template <class T>
void attend_decode_heads(const AttnArgs<T>& a, const KernelSet<T>& ks, int num_threads) {
  const int64_t group = a.group, heads = a.num_heads / group, batch = a.batch_heads / a.num_heads;
  const int64_t rows = a.rows_per_kv_head();
  const Split split = split_keys(batch, a.kv_len, ks.decode_heads_block,
                                 std::max(ks.decode_heads_block, ceil_div(kDecodeMinChunk, heads)));
  const int64_t items = batch * split.count;
  const double fmas = double(a.batch_heads) * double(a.q_len) * double(a.kv_len) * double(a.head_dim + a.value_dim);
  const int threads = threads_for(fmas, num_threads, items);

  const int64_t vdim_p = ks.decode_padded(a.value_dim);
  const AccLayout lay{vdim_p, 1};
  const size_t sstate = state_elems<T>(rows, vdim_p);
  auto carve = [&](T* base) { return state_at(base, rows, vdim_p); };
  // Head h's state for chunk c of batch entry b: task b * heads + h, chunk c (attend_decode's
  // layout), listed by item (b, c), then head.
  AlignedBuffer<T> partials(sstate * size_t(batch * heads * split.count));
  std::vector<RowState<T>> states(size_t(items * heads));
  for (int64_t n = 0; n < items; ++n)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t task = n / split.count * heads + h, c = n % split.count;
      states[size_t(n * heads + h)] = carve(partials.data() + sstate * size_t(task * split.count + c));
    }
  const size_t scratch_elems = padded(size_t(ks.decode_heads_scratch(heads, rows, a.head_dim, a.value_dim)), sizeof(T));
  ThreadSlices<T> scratch(scratch_elems, threads);
  std::vector<int64_t> offsets(size_t(threads * 2 * heads));  // decode_heads' scratch, per thread
  std::vector<RowState<T>> local(size_t(threads * heads));
  parallel_for(items, threads, [&](int64_t n) {
    const int64_t b = n / split.count, j_begin = n % split.count * split.chunk;
    const int64_t j_end = std::min(a.kv_len, j_begin + split.chunk);
    const int id = thread_id();
    ks.decode_heads(a, b, rows, group, j_begin, j_end, scratch.slice(id),
                    &states[size_t(n * heads)], &local[size_t(id * heads)], &offsets[size_t(id * 2 * heads)]);
  });
  parallel_for(batch * heads, threads, [&](int64_t task) {
    const int64_t b = task / heads, h = task % heads;
    merge_partials<T>(split.count, [&](int64_t c) { return carve(partials.data() + sstate * size_t(task * split.count + c)); },
                      lay, rows, a.value_dim, [&a, b, h, group](int64_t r) {
                        const int64_t bh = b * a.num_heads + h * group + r / a.q_len;
                        return a.out_rows(bh) + (r % a.q_len) * a.out_stride_l;
                      });
  });
}

// How the decode kernel reads K and V on this core, for one call (attend_decode): software
// prefetching and the cache level it fills, the parts of a work item read side by side, the 16-bit
// block length, and whether K/V heads that interleave in memory are read across the heads. Each is a
// rule measured per core, as said at each; the _core._set_* switches (g_prefetch,
// g_decode_prefetch_level, g_decode_streams, g_decode_block16, g_decode_heads) force them for tests.
// One function, so that the cores' rules read side by side.
struct DecodeRules {
  bool prefetch_kv;
  bool prefetch_to_l1;
  int streams;
  int block16;
  bool across_heads;
  bool fuse;
};

template <class T>
DecodeRules decode_rules(const AttnArgs<T>& a, const KernelSet<T>& ks, int num_threads) {
  DecodeRules r{};
  const int64_t rows_total = a.rows_per_kv_head();
  // The two things the rules below go by besides sizes: 16-bit K/V, and 4+ query rows per K/V row.
  const bool half_kv = a.kv_storage != Storage::same, four_rows = rows_total >= 4;
  // Software prefetching of the K and V streams, 16 KiB ahead in each (decode.inc, Ahead), where the
  // hardware prefetchers alone leave the cores waiting. The need differs between the two x86 cores
  // it was measured on (2 threads, KVCache.attend, 32 query heads, head_dim 128, prefetch off / on
  // alternating in one process, medians of 6-12 rounds), so the rule is the vendor's:
  // * AMD (Zen 4, 1 MiB L2, 32 MiB L3): only 16-bit K/V from memory gain, because converting the
  //   rows keeps a core from issuing loads for long enough that, with both cores streaming, memory
  //   time and compute time add up. "From memory": K and V (each row read once per GQA group) take
  //   at least half the last-level cache, what a call on a shared VM can expect to find there.
  //   8 K/V heads (4 query rows per K/V row) float16 4k keys 1.09x faster, 16k 1.45x, B = 8 at 4k
  //   1.30x, bfloat16 64k 1.78x; 32 K/V heads float16 16k 0.94x, 64k 1.08x, B = 8 at 4k 1.11x,
  //   bfloat16 16k 1.60x; 4 new tokens per step float16 16k 1.29x (8 K/V heads), 1.21x (32); at the
  //   threshold (16 MiB) 0.98-1.19x. float32 K/V (a plain stream its prefetchers keep at full
  //   speed) 0.97-0.99x with 8 K/V heads, 0.85-0.99x with 32: left to them.
  //   The same holds for float32 K/V where 256-bit vectors are the widest (Zen 3: AVX2, 512 KiB
  //   L2, 32 MiB L3) and at least 4 query rows share each K/V row: there the arithmetic per row is
  //   long enough too (a float32 row for 4 query rows took ~57 ns of one core with K/V in L2,
  //   tools/decode_harness.cpp, ~39 ns since P.V's V sub-blocks, against ~65-100 ns for the two
  //   cores to read the 1 KiB of two rows). Zen 3, 2 threads, 32 query heads, head_dim 128, float32,
  //   prefetch off / on alternating in one process, medians of 12 rounds: 8 K/V heads 4k keys 1.19x,
  //   16k 1.12x, 64k 1.13x, B = 8 at 4k 1.12x (after the V sub-blocks: 16k 1.05x, 64k 1.06x, B = 8
  //   1.07x); 32 K/V heads with 4 new tokens 1.06x; 2 query rows per K/V row (16 K/V heads, or 32
  //   with 2 new tokens) 0.99-1.03x and one row 1.03x (left off).
  //   All of that was measured with the key range read as one stream; since the four parts (below)
  //   AMD prefetches only where 4+ query rows share each K/V row: for one or two the parts do it.
  // * Intel (a Sapphire Rapids-class Xeon VM: 2 MiB L2, a 480 MiB L3 shared with other tenants):
  //   every K/V that outgrows the threads' L2s gains, from the L3 as from memory, float32 too.
  //   float16 16 MiB 1.03-1.06x, 64 MiB 1.19x, 128 MiB (B = 8 at 4k) 1.99x, bfloat16 64 MiB 1.10x,
  //   256 MiB 1.57x; float32 32 MiB 1.01x, 128 MiB 1.38x, 256 MiB 1.13x, 512 MiB-2 GiB 1.04-1.06x;
  //   4 new tokens float32 128 MiB 1.10x; within L2 (2-8 MiB) 0.99-1.02x. Half of that L3 (240
  //   MiB) would have left most of these unprefetched.
  // * AMD Zen 5 (family 1Ah: an EPYC VM, 2 vCPUs, AVX-512, 1 MiB L2, 32 MiB L3): one stream with
  //   software prefetching wherever K and V outgrow the last-level cache, whatever the rows per K/V
  //   row and the storage; see the parts below for the measurements.
  // Other vendors: as AMD. Prefetch distances of 8 and 32 KiB measured the same as 16 on the Xeon.
  const int64_t llc = last_level_cache_bytes(), l2 = cache_bytes(2);
  const int64_t kv_bytes = a.batch_heads / a.group * a.kv_len * (a.head_dim + a.value_dim) * a.kv_item_bytes();
  // Long arithmetic per K/V row (AMD): 4+ query rows share each row, and it is 16-bit or float32 in
  // 256-bit vectors (8 float32 lanes). Where fewer rows share it, the four parts below replace
  // software prefetching instead of adding to it (measured on Zen 3 since the parts, below).
  const bool busy_rows = four_rows && (half_kv || (sizeof(T) == 4 && ks.lanes <= 8));
  const bool from_memory = llc > 0 && 2 * kv_bytes >= llc;
  bool by_size = busy_rows && from_memory;
  if (cpu_is_intel()) by_size = l2 > 0 && kv_bytes > int64_t(std::max(num_threads, 1)) * l2;
  if (cpu_is_amd_zen5_on()) by_size = llc > 0 && kv_bytes >= llc;
  const int mode = g_prefetch.load(std::memory_order_relaxed);
  r.prefetch_kv = mode < 0 ? by_size : mode == 1;
  // Where the prefetches go (decode.inc, kPrefetchAheadL1Bytes): into L1 on Zen 5, except for 16-bit
  // rows that 4+ query rows share; into L2 elsewhere (the other cores were measured with L2 only).
  // Zen 5 (KVCache.attend, 2 threads, 32 query heads of 128, one new token, L1 / L2 alternating in
  // one process, medians of 7 rounds; L2 time / L1 time): float32 8 K/V heads 4k-64k keys 1.01x,
  // 1.12x, 1.09x, B = 8 at 4k 1.06x, 32 K/V heads 4k-64k 1.24x, 1.15x, 1.03x, B = 8 at 4k 1.03x;
  // 16-bit with 32 K/V heads float16 16k 1.16x, 64k 1.06x, bfloat16 16k 1.08x, B = 8 at 4k 1.09x;
  // but 16-bit with 8 K/V heads float16 16k 0.84x, bfloat16 64k 0.995x: those stay in L2.
  const int level = g_decode_prefetch_level.load(std::memory_order_relaxed);
  r.prefetch_to_l1 = level > 0 ? level == 1 : cpu_is_amd_zen5_on() && !(half_kv && four_rows);
  // How many parts of each work item's key range the kernel reads side by side (decode.inc,
  // decode_blocks): reading one K (or V) stream front to back, a core keeps too few lines in flight
  // to reach the memory's bandwidth. Measured on a Sapphire Rapids-class Xeon VM (2 threads,
  // KVCache.attend, 32 query heads, head_dim 128, one stream / two / four alternating in one
  // process, medians of 9-15 rounds): float32 K/V from memory (128 MiB-2 GiB) 1.11-1.21x /
  // 1.15-1.28x faster, held in the L3 (16-32 MiB) 0.97-1.07x / 0.98-1.07x, cold (the caches evicted
  // before each call, as a model's other layers do) 32 MiB 1.14-1.18x / 1.27-1.31x; 16-bit K/V from
  // memory (64-512 MiB) 1.08-1.21x / 1.15-1.32x, cold 4-64 MiB 1.03-1.26x / 1.03-1.34x, but held in
  // the L3 (4-32 MiB) 0.93-1.00x / 0.90-0.96x, where arithmetic bounds the step (conversions, four
  // query rows per K/V row) and more streams only cost. Hence four parts, for 16-bit K/V from half
  // the last-level cache on (the AMD prefetch rule's "from memory", above).
  // On AMD (a Zen 3 VM, AVX2: 2 threads, the same calls, medians of 31 rounds, two runs) the parts
  // and software prefetching do not add up: with both, a step was slower than with either alone.
  // Where 4 query rows share each K/V row (8 K/V heads; 4k-64k keys and B = 8 at 4k), prefetching
  // with one part was 0.98-1.18x as fast as both together (mostly 1.05-1.16x), and four parts
  // without prefetching about as fast as prefetching with one (0.90-1.15x of it, the geometric
  // mean ~0.98x); with one query row per 16-bit K/V row (32 K/V heads), four parts without
  // prefetching were 1.14-1.38x faster than prefetching with one part (4k-64k keys, B = 8 at 4k)
  // and 1.19-1.30x faster than both (16k). Hence on AMD: software prefetching with one part for
  // busy GQA groups from memory (the rule above), else the parts as on Intel. (Zen 4 unmeasured
  // since the parts.)
  // On Zen 5 (2 threads, KVCache.attend, 32 query heads, head_dim 128, one new token, prefetch x
  // parts alternating in one process, medians of 5-7 rounds, AVX-512 kernels) four parts cost
  // everywhere and one prefetched stream is the fastest or within 3% of it from memory: against the
  // previous rule (four parts; prefetching only for busy 16-bit rows) float32 8 K/V heads 16k-64k
  // keys 1.39-1.43x, B = 8 at 4k 1.17x, 32 K/V heads 4k-64k 1.11-1.65x, B = 8 at 4k 1.57x; float16
  // and bfloat16 with 32 K/V heads 4k-64k 1.44-2.12x, B = 8 at 4k 1.37x (with 8 K/V heads the old
  // rule already chose it). Below the last-level cache (4-16 MiB) prefetching costs (0.72-0.93x
  // the speed of one part without it, which runs at 0.98-1.36x the old rule; two parts alike); at
  // 32 MiB (float32, 8 K/V heads at 4k keys or 32 at 1k) it gains 1.46-1.56x over the old rule,
  // hence "at least the last-level cache". The table is in bench/RESULTS.md (Zen 5).
  // The AVX2 kernels on the same core measured the same way (one prefetched stream 0.99-2.37x the
  // old rule, four parts 0.53-1.00x of it), so the rule goes by the core, not the ISA.
  const int streams = g_decode_streams.load(std::memory_order_relaxed);
  const bool one_part = cpu_is_amd_zen5_on() || (!cpu_is_intel() && r.prefetch_kv);
  const int by_rule = one_part ? 1 : !half_kv || from_memory ? 4 : 1;
  r.streams = streams > 0 ? streams : by_rule;
  // 16-bit K/V read in blocks of 64 keys instead of 32 (decode.inc, decode_block) on Zen 5 where
  // 4+ query rows share each K/V row: the per-block work (q rows reloaded into registers, the
  // softmax's reductions) spreads over twice the keys. Zen 5 (2 threads, 32 query heads of 128,
  // 32 and 64 alternating in one process, medians of 7-9 rounds, float16 and bfloat16): 8 K/V heads
  // 1k-4k keys 1.10-1.16x, 16k-64k 1.46-1.57x, B = 8 at 4k 1.44-1.45x, 4 K/V heads 16k 1.30x, 4
  // new tokens per step over 8 and 32 K/V heads 1.23x and 1.10x; with fewer rows per K/V row it
  // loses from memory (2 rows 0.88-0.96x, one row 0.92-0.98x; 1.06-1.11x from the L3). On Intel
  // too where the K/V rows stay in the last-level cache (from_memory above: the step is then bound by
  // its arithmetic): a Sapphire Rapids-class Xeon VM (480 MiB L3), 8 K/V heads, same method, 11
  // rounds, 32 / 64: float16 1k 1.054x, 4k 1.020x, 16k 1.018x, B = 8 at 4k 1.030x, bfloat16 1.050x,
  // 1.017x, 1.021x, 1.028x; from memory (64k, 256 MiB) 0.970x and 0.981x, which keeps 32. Other cores
  // keep 32, measured on Zen 4 before software prefetching (64 and 128 were 35-50% slower there).
  const int block16 = g_decode_block16.load(std::memory_order_relaxed);
  const bool long_blocks = four_rows && (cpu_is_amd_zen5_on() || (cpu_is_intel() && !from_memory));
  r.block16 = block16 > 0 ? block16 : long_blocks ? 64 : 32;
  // Interleaved K/V heads (attend_decode): read across the heads everywhere but on Zen 5, where the
  // chunks, with its decode rule above (one software-prefetched stream), are the faster reading
  // except for 16-bit K/V with fewer than 4 query rows per K/V row (2 threads, 32 query heads of
  // 128, one new token, alternating in one process, medians of 7 rounds; across heads / chunks):
  // float32 0.62-0.92x (8 and 32 K/V heads, 1k-16k keys), 16-bit with 8 K/V heads 0.61-0.80x, but
  // with 16 or 32 K/V heads 1.26-1.46x from 4k keys on (0.98x at 1k).
  const int heads_mode = g_decode_heads.load(std::memory_order_relaxed);
  const bool heads_by_rule = !cpu_is_amd_zen5_on() || (half_kv && !four_rows);
  r.across_heads = heads_mode > 0 || (heads_mode < 0 && heads_by_rule);
  // One query row per K/V row (rows of 4 or 8 vectors in the compute type, read in place): a
  // block's K rows and the previous block's V rows read together, key by key (decode.inc,
  // scores_and_values), so that both streams are in flight at once. Zen 5: a plain read of two 128
  // MiB arrays, two processes side by side, took 29.6-30.7 ns per 1 KiB row of K and V in 128-row
  // blocks of each in turn (24.1-25.1 with the kernel's prefetching), 22.6-23.4 a row of each in
  // turn; the kernel's step 27.7-28.4 (unfused, prefetching into L1) against 26.2-26.9 fused. In the
  // driver (2 threads, 32 query heads over 32 K/V heads of 128, one new token, fused and not
  // alternating in one process, medians of 7 rounds): 256-1k keys 1.05-1.16x, 4k-64k 1.08-1.13x,
  // B = 8 at 4k 1.08x, with the same bits. Other cores: unmeasured, left apart (on the Xeon, four
  // parts of each stream side by side: eight streams, which measured slower than four there).
  const int fuse_mode = g_decode_fuse.load(std::memory_order_relaxed);
  r.fuse = fuse_mode < 0 ? cpu_is_amd_zen5_on() : fuse_mode == 1;
  return r;
}

// Few query rows per head (decode): lanes along head_dim, all query heads of a GQA group together.
template <class T>
void attend_decode(const AttnArgs<T>& in, const KernelSet<T>& ks, int num_threads) {
  AttnArgs<T> a = in;
  const int64_t rows_total = a.rows_per_kv_head();
  const DecodeRules rules = decode_rules(a, ks, num_threads);
  a.prefetch_kv = rules.prefetch_kv;
  a.prefetch_to_l1 = rules.prefetch_to_l1;
  a.decode_streams = rules.streams;
  a.decode_block16 = rules.block16;
  a.decode_fuse = rules.fuse;
  const int64_t group = a.group;
  const int64_t kv_heads = a.num_heads / group;  // key/value heads per batch entry
  const int64_t kv_groups = a.batch_heads / group;
  const int64_t row_chunks = ceil_div(rows_total, kDecodeMaxRows);
  const int64_t chunk_rows = ceil_div(rows_total, row_chunks);
  const int64_t tasks = kv_groups * row_chunks;
  // Key/value heads whose rows interleave in memory (a (batch, seq, heads, head_dim) array viewed
  // heads first: each head's row is head_dim elements out of every heads * head_dim) are read key by
  // key across all heads (attend_decode_heads) when every head's query rows fit one tile and the
  // rows are whole vectors: Zen 3 (AVX2, 2 threads, 32 query heads, head_dim 128, one new token,
  // alternating in one process, medians of 7 rounds) 1.34-2.76x faster than the chunks below, 0.68-
  // 0.86x the speed of the same values stored heads first (4k-16k keys, 8 and 32 K/V heads, float32
  // and float16, B = 4 at 4k). Otherwise they are read in short chunks of keys, chunk by chunk across
  // the heads (items claimed chunk-major below), instead of each head's whole key range in turn:
  // then the memory around each head's rows, which the hardware prefetchers fetch along with them,
  // belongs to the rows the next items read (Zen 3, float32: 4096 keys 0.48-0.52 -> 0.68x the speed
  // of heads stored first, 16384 keys 0.45-0.47 -> 0.69-0.72x, B = 4 at 4096 0.43-0.56 ->
  // 0.58-0.72x, 8 K/V heads at 4096 0.49-0.64 -> 0.63-0.66x; chunks of 32, 64 and 256 keys measured
  // 0.58-0.72x). At most kMaxInterleavedChunks chunks per head, so the partial states stay small.
  // Which of the two a core reads by is decode_rules' across_heads (on Zen 5 mostly the chunks).
  constexpr int64_t kInterleavedChunk = 128, kMaxInterleavedChunks = 256;
  const bool interleaved = kv_heads_interleave(a);
  const bool whole_vectors = ks.decode_padded(a.head_dim) == a.head_dim && ks.decode_padded(a.value_dim) == a.value_dim;
  if (interleaved && row_chunks == 1 && whole_vectors && rules.across_heads) return attend_decode_heads(a, ks, num_threads);
  Split split = split_keys(tasks, a.kv_len, ks.decode_block, kDecodeMinChunk);
  if (interleaved && a.kv_len > kInterleavedChunk) {
    const int64_t chunk = std::max(kInterleavedChunk, ceil_div(a.kv_len, kMaxInterleavedChunks));
    const int64_t rounded = ceil_div(chunk, ks.decode_block) * ks.decode_block;
    split = Split{ceil_div(a.kv_len, rounded), rounded};
  }
  const int64_t items = tasks * split.count;
  // The split above depends on the shape only, so the thread count never changes the result.
  const double fmas = double(a.batch_heads) * double(a.q_len) * double(a.kv_len) * double(a.head_dim + a.value_dim);
  const int threads = threads_for(fmas, num_threads, items);

  const int64_t vdim_p = ks.decode_padded(a.value_dim);
  const AccLayout lay{vdim_p, 1};
  const size_t sstate = state_elems<T>(chunk_rows, vdim_p);
  const size_t scratch_elems = padded(size_t(ks.decode_scratch(chunk_rows, a.head_dim, a.value_dim)), sizeof(T));
  const size_t per_thread = scratch_elems + (split.count > 1 ? 0 : sstate);
  ThreadSlices<T> scratch(per_thread, threads);
  std::unique_ptr<AlignedBuffer<T>> partials;
  if (split.count > 1) partials.reset(new AlignedBuffer<T>(sstate * size_t(items)));
  auto carve = [&](T* base) { return state_at(base, chunk_rows, vdim_p); };
  auto tile_of = [&](int64_t task) {
    const int64_t kvg = task / row_chunks, rc = task % row_chunks;
    const int64_t r0 = rc * chunk_rows;
    return DecodeTile{kvg / kv_heads, kvg % kv_heads, r0, std::min(chunk_rows, rows_total - r0), 0, a.kv_len};
  };
  auto out_row_of = [&](const DecodeTile& t) {
    return [&a, t, group](int64_t r) {
      const int64_t bh = t.batch * a.num_heads + t.kv_head * group + (t.r0 + r) / a.q_len;
      return a.out_rows(bh) + ((t.r0 + r) % a.q_len) * a.out_stride_l;
    };
  };

  parallel_for(items, threads, [&](int64_t claimed) {
    // Item n is chunk n % split.count of task n / split.count; interleaved heads claim them chunk
    // by chunk (all tasks' first chunks, then their second ones, ...).
    const int64_t n = interleaved ? claimed % tasks * split.count + claimed / tasks : claimed;
    T* mine = scratch.slice(thread_id());
    DecodeTile t = tile_of(n / split.count);
    if (split.count > 1) {
      const int64_t c = n % split.count;
      t.j_begin = c * split.chunk;
      t.j_end = std::min(a.kv_len, t.j_begin + split.chunk);
      ks.decode(a, t, group, mine, carve(partials->data() + sstate * size_t(n)));
      return;
    }
    const RowState<T> st = carve(mine + scratch_elems);
    ks.decode(a, t, group, mine, st);
    finalize(st, lay, t.rows, a.value_dim, out_row_of(t));
  });
  if (split.count > 1) {
    parallel_for(tasks, threads, [&](int64_t task) {
      const DecodeTile t = tile_of(task);
      merge_partials<T>(split.count, [&](int64_t c) { return carve(partials->data() + sstate * size_t(task * split.count + c)); },
                        lay, t.rows, a.value_dim, out_row_of(t));
    });
  }
}

template <class T>
void scaled_dot_product_attention(const AttnArgs<T>& in, int num_threads) {
  if (in.batch_heads == 0 || in.q_len == 0) return;
  const KernelSet<T>& ks = active_set<T>();
  const int threads_wanted = num_threads > 0 ? num_threads : default_num_threads();
  if (!in.weights && in.q_len <= kDecodeMaxLen) return attend_decode(in, ks, threads_wanted);

  // Masks reach the tile kernels as bits: one pass over each distinct mask here instead of every
  // tile converting its bytes or floats (a 4096 x 4096 boolean mask broadcast over 8 heads: 16 MiB of
  // bytes read by every head's tiles from L3 or memory, ~8% of a masked tile's time; 2 MiB of bits
  // once packed). A float mask of 0 and -inf (a causal or padding pattern) then costs what a boolean
  // one does: 1x16x2048x64 with a float causal mask 56.9 -> 47.0 ms (boolean 46.3, is_causal 45.4).
  AttnArgs<T> a = in;
  PackedMask packed[2];
  for (int x = 0; x < 2; ++x)
    if (a.masks[x].kind != MaskKind::none && a.kv_len > 0)
      pack_mask_bits(a.masks[x], a.batch_heads, a.q_len, a.kv_len, threads_wanted, ks, packed[x]);

  // K and V that outgrow the last-level cache, with each head's outgrowing L2, come from memory in
  // an order the hardware prefetchers follow badly (the score tiles read several keys' rows
  // interleaved, P.V reads V by columns); the tiles then prefetch into L2 the next key block's K rows
  // and the current block's V rows as they go. Measured on Zen 4 (one thread, C++ harness, head_dim
  // 128, 4096 keys, 32 heads, K/V from DRAM): 16-row tiles 598 -> 418 us per head, 64-row tiles
  // 1540 -> 1310; with K/V held in L3 the prefetches cost 16-row tiles ~9%, and with a head's K/V
  // in L2 5%, hence both conditions (sizes from CPUID; unknown sizes: no prefetching). Many small
  // heads that together outgrow the last-level cache are prefetched a work item ahead instead (below).
  const int64_t l2 = cache_bytes(2), llc = last_level_cache_bytes();
  const int prefetch_mode = g_prefetch.load(std::memory_order_relaxed);
  const int64_t kv_heads = std::max<int64_t>(1, a.batch_heads / a.group);
  const int64_t kv_row_bytes = (a.head_dim + a.value_dim) * a.kv_item_bytes();
  {
    const int64_t head_kv = a.kv_len * kv_row_bytes;
    a.prefetch_kv = prefetch_mode < 0 ? l2 > 0 && head_kv > l2 && head_kv >= llc / kv_heads : prefetch_mode == 1;
  }

  // Query rows are split into blocks of lanes * row_vecs (the widest register tile; one vector of
  // rows when q_len fits it). Each tile then runs with as few row vectors as hold its rows
  // (tile_rows), so a short query or a block's remainder does not compute up to three vectors of
  // padding rows: q_len = 32 on AVX-512 in 64-row tiles was 1.7x slower than in two 16-row tiles.
  const int64_t block_rows = a.q_len <= ks.lanes ? ks.lanes : int64_t(ks.lanes) * ks.row_vecs;
  auto tile_rows = [&](const Tile& t) { return std::min(block_rows, ceil_div(t.rows, int64_t(ks.lanes)) * ks.lanes); };
  const int64_t q_blocks = ceil_div(a.q_len, block_rows);
  // The query's row vectors are shared out evenly over those blocks (the first ones take one more
  // when they do not divide): q_len = 128 on AVX2 in blocks of 3, 3, 3, 3, 2, 2 vectors of 8 rows
  // rather than five of 3 and one of 1, whose lone vector of rows costs ~1.7x per row what a tile of
  // 3 does (profile, 8x12x128x64: 9% of the time for 6% of the rows). Measured (Zen 3, 2 threads,
  // both splits alternating in one process, medians of 15 rounds): L = 128 1.02-1.03x without a
  // mask and causal (1x, 8x and 32x12 heads), 1.00-1.02x with a mask; L = 200 and 512 1.01-1.02x.
  // Each row's arithmetic does not depend on its tile, so neither do the results.
  const int64_t q_vecs = ceil_div(a.q_len, int64_t(ks.lanes));
  const int64_t vecs_per_block = q_vecs / q_blocks, blocks_with_one_more = q_vecs % q_blocks;
  const size_t qt_elems = padded(size_t(a.head_dim * block_rows), sizeof(T));
  const size_t sstate = state_elems<T>(block_rows, a.value_dim);

  // GQA group tiles (KernelSet::attend_group): the heads of a group, which share K and V, go through
  // the key blocks together. Each K/V block then comes from L3 or memory once per group and the
  // other heads find it in L1/L2, where head-by-head tiles streamed the whole key range once per head;
  // 16-bit rows are also converted once per group instead of once per head. Measured (Zen 4, 2
  // threads, 32 query heads over 8 K/V heads, head_dim 128, lower-right causal, group tiles against
  // head by head): 12-16 new tokens over 4096-16384 keys float32 1.13-1.14x (AVX2 1.16-1.20x),
  // float16/bfloat16 1.19-1.24x (16-bit was 0.8x float32 there, now 1.0x); prefill 1024-2048 tokens
  // 1.02-1.05x (AVX2 1.04-1.25x). Up to kMaxGroupTileHeads heads, and no more than put their query
  // blocks and states in half of L2 next to the key blocks.
  //
  // Neighbouring heads whose K/V rows interleave in memory (a (batch, seq, heads, head_dim) array
  // viewed heads first, as Hugging Face models pass them: each head's rows are head_dim elements
  // out of every heads * head_dim) go through the key blocks in pairs the same way, each reading its
  // own rows: a block's rows of both heads then share their pages and cache-line neighbourhoods.
  // Head by head, such rows ran 1.13-1.29x slower than the same values stored heads first. Measured
  // on Zen 3 (AVX2, 2 threads, float32, pairs against head by head alternating in one process,
  // medians of 7-11 rounds, three runs): 1x16x1024x64 1.03-1.07x, causal 1.08-1.11x; 1x8x4096x64
  // 1.02-1.15x; 1x32x1024x128 causal 1.03-1.13x; 4x12x512x64 1.04-1.05x; 1x32 heads x 16 queries x 2048
  // keys x 128 1.08-1.17x; 8x12x128x64 causal 1.04-1.18x; 1x12x128x64 0.98-1.00x. Four heads
  // together measured 0.97-1.21x and eight 0.92-1.14x against head by head in the same runs.
  // Results are bit for bit the same: each head's arithmetic is unchanged, only the order of tiles.
  //
  // Where many query blocks read each head's K/V, a thread instead copies the head's interleaved
  // rows back to back into its own buffer once (pack_heads) and its tiles of that head read the copy
  // (the hardware prefetchers then follow each head's rows, as for heads stored first): Zen 3, same
  // method, against pairs, two runs, as a fraction of the speed of heads stored first: 1x16x1024x64
  // 0.79-0.88 -> 0.96-1.03x, 1x8x4096x64 0.89-0.92 -> 0.97-1.04x, 1x16x1024x128 causal 0.84-0.92 ->
  // 0.93-0.94x, 4x12x512x64 0.92-0.97 -> 0.96-0.99x; GQA, 32 query heads over 8 (group tiles against
  // group tiles reading the copy): 1024 x 128 causal 0.94 -> 1.01x, 2048 x 64 0.86 -> 0.98x. Copying costs a
  // pass over the head's rows per thread, which few query blocks do not repay (L = 128, 6 blocks
  // of 24 rows: 0.84-0.91x; 16 queries over 2048 keys, one block: 0.66x; 4x12x512x64's 22 blocks
  // gained, above): hence at least kPackMinQueryBlocks blocks, and copies that together take at
  // most half of the last-level cache (they are meant to stay there; a quarter each on 2 threads).
  constexpr int64_t kNeighbourHeads = 2, kPackMinQueryBlocks = 16;
  const bool interleaved = kv_heads_interleave(a);
  const int64_t head_pack_bytes = a.kv_len * kv_row_bytes;
  const int pack_mode = g_pack_heads.load(std::memory_order_relaxed);
  const bool pack_heads = interleaved && !a.weights &&
                          (pack_mode < 0 ? q_blocks >= kPackMinQueryBlocks && llc > 0 &&
                                               head_pack_bytes * threads_wanted <= llc / 2
                                         : pack_mode == 1);
  const bool pairs = interleaved && a.group == 1 && !pack_heads;
  const int64_t tile_group = pairs ? a.num_heads : a.group;  // heads that may share a tile
  int64_t group_heads = 1;
  if (!a.weights && tile_group > 1 && g_group_tiles.load(std::memory_order_relaxed)) {
    const int64_t per_head = int64_t((qt_elems + sstate) * sizeof(T));
    const int64_t fit = l2 > 0 ? std::max<int64_t>(1, l2 / 2 / per_head) : kMaxGroupTileHeads;
    const int64_t most = std::min<int64_t>({tile_group, pairs ? kNeighbourHeads : kMaxGroupTileHeads, fit});
    group_heads = ceil_div(tile_group, ceil_div(tile_group, most));  // sub-groups of even size
    // A group tile converts a 16-bit key block before its heads' steps: the first head's steps then
    // prefetch the next block's K and V rows whenever a head's rows outgrow L2 (from L3 too: they
    // are read once per group, not once per head).
    if (!pairs && a.kv_storage != Storage::same && prefetch_mode < 0) a.prefetch_kv = l2 > 0 && a.kv_len * kv_row_bytes > l2;
  }
  const int64_t sub_groups = ceil_div(tile_group, group_heads);  // tiles per group (or heads) and query block
  const int64_t tasks = a.batch_heads / tile_group * sub_groups * q_blocks;
  const int64_t key_block = ks.key_block(block_rows);
  // A group tile does the work of its heads' tiles: the key range is split as for one tile per
  // head and query block, however the heads are grouped (tasks * group_heads overcounts a last
  // sub-group with fewer heads, e.g. the lone head of an odd count in pairs, and changed the bits).
  const Split split = a.weights ? Split{1, a.kv_len}
                                : split_keys(a.batch_heads * q_blocks, a.kv_len, key_block, kMinChunkBlocks * key_block);
  const int64_t items = tasks * split.count;
  // The work (every key for every query row; a causal call does about half) decides how many
  // threads are worth starting; the split above depends on the shape only.
  const double fmas = double(a.batch_heads) * double(a.q_len) * double(a.kv_len) * double(a.head_dim + a.value_dim);
  const int threads = threads_for(fmas, threads_wanted, items);

  const size_t st_elems = padded(size_t(key_block * block_rows), sizeof(T));
  // 16-bit K/V: one converted K block and one V block per thread (key_block of the narrowest tile,
  // the longest).
  const size_t kv_elems =
      a.kv_storage == Storage::same ? 0 : padded(size_t(ks.key_block(ks.lanes) * (a.head_dim + a.value_dim)), sizeof(T));
  // Per thread: scores, converted K/V, then query block and state of each head of a tile.
  // A split item's states are copied out to `partials` at its end (ThreadSlices, parallel.h).
  const size_t per_thread = st_elems + kv_elems + size_t(group_heads) * (qt_elems + sstate);
  ThreadSlices<T> scratch(per_thread, threads);
  std::unique_ptr<AlignedBuffer<T>> partials;  // state of item n's head h at (n * group_heads + h) * sstate
  if (split.count > 1) partials.reset(new AlignedBuffer<T>(sstate * size_t(items * group_heads)));

  // Many small heads whose arrays together outgrow the last-level cache (a large batch of short
  // sequences) come from memory too, but each tile's rows are too few for the prefetchers to get
  // going: every item then prefetches the rows of its thread's next item (Q, K, V and output rows)
  // into L2, spread over its own score steps. Measured (B x 12 heads x L x 64, float32, Zen 4):
  // B = 64, L = 64 one thread 66 -> 82 GFLOP/s, two 115 -> 138-155; B = 32, L = 128 82 -> 91 and
  // 138 -> 158-175. Not where the arrays stay cached between calls (B = 8, L = 64: 6% slower), nor
  // where an item's rows would take more than half of L2 (they would evict the current item's).
  // "Cached" is half of the last-level cache on AMD (an eighth on Intel, below): the L3 is shared
  // with other cores (on a cloud VM with other tenants), and a call's arrays must survive there next
  // to the caller's data. Measured on a
  // 2-vCPU Zen 4 VM with a 32 MiB L3 (q, k, v and out together, B x 12 x L x 64; one / two
  // threads): at 4.5-9 MiB the arrays stayed cached (prefetching 3-17% slower); at 18 MiB (B = 48,
  // L = 32) prefetching was 1.52x / 1.56x faster, at 24 MiB (B = 64, L = 32) 1.3-1.9x over three
  // alternating runs; these went without it when the threshold was the whole L3. At 12 MiB it
  // depends on the neighbours' use of the L3 at the time (0.8x-1.36x across runs), so it stays off.
  // (A streaming read of one buffer here drops from L3 to memory speed between 16 and 24 MiB.)
  // On AMD the threshold is also at most 16 L2s: a Zen 3 VM (512 KiB L2, the same 32 MiB L3, whose
  // streaming read drops to memory speed between 12 and 16 MiB already) gains from 6 MiB on (B x 12
  // x 128 x 64, two threads, off / on alternating in one process, medians of 15 rounds: 1.6 MiB
  // 0.93x, 3.1 MiB 0.97x, 6.3 MiB 1.03x, 9.4 MiB 1.15x, 12.6 MiB 1.13x (one thread 1.21x), 15.7
  // MiB 1.15x; 12 x 12 x 64 x 64, 9.4 MiB, 1.14x). 16 L2s leave Zen 4's threshold where it was.
  // On Intel the threshold is an eighth of the LLC, from two Sapphire Rapids-class Xeon VMs with
  // 2 MiB L2s (same B x 12 x 128 x 64 calls and method, 11-21 rounds): with a 480 MiB L3, 0.94x at
  // 48 MiB and 1.12x at 96 MiB; with a 105 MiB L3 (whose streaming read falls from 37 to 20 GB/s
  // between 24 and 48 MiB: the guest's share of the L3 is far below what CPUID reports), 0.94-0.96x
  // at 1.5-6 MiB, 1.04x at 9 MiB, 1.00-1.08x at 12 MiB, 1.09x at 18, 1.13x at 24, 1.12x at 48. Half
  // the LLC, the rule before 2026-12-03, left the 48 MiB call of the second host without; an eighth
  // (60 and 13 MiB) sorts every clear case of both hosts, and gives up the second's 9-12 MiB.
  // But what a guest keeps of a 480 MiB L3 changes with its neighbours: the 48-50 MiB call measured
  // 0.94x, 1.04x, 1.20x and 1.27x in four sessions, and on 2026-12-06 (the same host, a streaming
  // read at L3 speed up to 96 MiB; -1 / 2 alternating in one process, medians of 11 rounds) 25 MiB
  // 1.01x, 32 MiB (8 x 16 x 256 x 64) 1.15x, 33 MiB 1.27x, 37.5 MiB 1.15x (B x 12 x 64 x 64: 1.15x),
  // 50 MiB 1.27x, against a cost of at most 6% where the arrays did stay. So Intel too stops at 16
  // L2s (32 MiB there), as AMD does; the 105 MiB host keeps its eighth (13 MiB). (An unknown L2
  // gives 0 here, but prefetch_items below requires a known one.)
  const int64_t cached_bytes = std::min(cpu_is_amd() ? llc / 2 : llc / 8, 16 * l2);
  const int64_t item_bytes = block_rows * (a.head_dim + a.value_dim) * int64_t(sizeof(T)) +
                             std::min(a.kv_len, split.chunk) * kv_row_bytes;
  const int64_t call_bytes = a.batch_heads * a.q_len * (a.head_dim + a.value_dim) * int64_t(sizeof(T)) +
                             kv_heads * a.kv_len * kv_row_bytes;
  const bool prefetch_items = prefetch_mode < 0 ? !a.prefetch_kv && l2 > 0 && call_bytes >= cached_bytes && item_bytes <= l2 / 2
                                                : prefetch_mode == 2;
  std::vector<ItemPrefetch> next_items(prefetch_items ? size_t(threads) : 0);

  // A task's first head (its tile's bh) and how many heads from there it takes.
  auto first_head = [&](int64_t task) {
    const int64_t unit = task / q_blocks;  // (GQA group, sub-group)
    return unit / sub_groups * tile_group + unit % sub_groups * group_heads;
  };
  auto heads_of = [&](int64_t task) {
    return std::min(group_heads, tile_group - task / q_blocks % sub_groups * group_heads);
  };
  auto tile_of = [&](int64_t task) {
    // Head (or group tile) by head, so a core's consecutive tiles reuse the head's K and V from its
    // L2; within a head, last query blocks first: under a causal mask they have the most keys.
    const int64_t bh = first_head(task);
    const int64_t qb = q_blocks - 1 - task % q_blocks;
    const int64_t i0 = ks.lanes * (qb * vecs_per_block + std::min(qb, blocks_with_one_more));
    const int64_t rows = ks.lanes * (vecs_per_block + (qb < blocks_with_one_more ? 1 : 0));
    return Tile{bh, i0, std::min(rows, a.q_len - i0), 0, a.kv_len_of(bh)};
  };
  auto out_row_of = [&](const Tile& t) {
    T* base = a.out_rows(t.bh) + t.i0 * a.out_stride_l;
    const int64_t stride = a.out_stride_l;
    return [base, stride](int64_t i) { return base + i * stride; };
  };

  auto item_tile = [&](int64_t n) {
    Tile t = tile_of(n / split.count);
    if (split.count > 1) {
      const int64_t c = n % split.count;
      t.j_begin = std::min(t.j_end, c * split.chunk);
      t.j_end = std::min(t.j_end, t.j_begin + split.chunk);
    }
    return t;
  };
  // The rows item n reads and writes (a split item writes a partial state, not output rows), but not
  // the K and V rows of `current` (the item running now) if n reads the same ones: another query
  // block of the same head, or a head of the same GQA group, finds them in L2 (prefetching them
  // again cost 4x16x512x64 9%, causal 17%).
  auto plan_prefetch = [&](ItemPrefetch& p, int64_t n, const Tile& current) {
    const Tile t = item_tile(n);
    const bool same_kv = a.k_offset[t.bh] == a.k_offset[current.bh] && a.v_offset[t.bh] == a.v_offset[current.bh] &&
                         t.j_begin == current.j_begin && t.j_end <= current.j_end;
    const int64_t item = a.kv_item_bytes(), keys = same_kv ? 0 : t.j_end - t.j_begin;
    auto lines = [](int64_t bytes) { return ceil_div(bytes, int64_t(kAlign)); };  // cache lines per row
    p.part[0] = {reinterpret_cast<const char*>(a.q + a.q_offset[t.bh] + t.i0 * a.q_stride_l), t.rows,
                 a.q_stride_l * int64_t(sizeof(T)), lines(a.head_dim * int64_t(sizeof(T)))};
    p.part[1] = {reinterpret_cast<const char*>(a.k) + (a.k_offset[t.bh] + t.j_begin * a.k_stride_s) * item, keys,
                 a.k_stride_s * item, lines(a.head_dim * item)};
    p.part[2] = {reinterpret_cast<const char*>(a.v) + (a.v_offset[t.bh] + t.j_begin * a.v_stride_s) * item, keys,
                 a.v_stride_s * item, lines(a.value_dim * item)};
    p.part[3] = {reinterpret_cast<const char*>(a.out_rows(t.bh) + t.i0 * a.out_stride_l), split.count > 1 ? 0 : t.rows,
                 a.out_stride_l * int64_t(sizeof(T)), lines(a.value_dim * int64_t(sizeof(T)))};
  };

  // pack_heads: per thread, one head's (or GQA group's) K rows then V rows, back to back and at
  // their key index, as stored (16-bit rows stay 16-bit); packed_keys says whose rows it holds (K
  // and V offsets, key range: a K shared by all heads may come with V rows of each head's own).
  const int64_t item_bytes_kv = a.kv_item_bytes();
  const size_t pack_bytes = pack_heads ? padded(size_t(head_pack_bytes), 1) : 0;
  ThreadSlices<char> packs(pack_bytes, threads);
  // Each thread's four keys (32 bytes) 128 bytes from the next thread's: never on a common cache
  // line, wherever the vector starts.
  constexpr size_t kKeyStride = 2 * kCacheLine / sizeof(int64_t);
  std::vector<int64_t> packed_keys(pack_heads ? size_t(threads) * kKeyStride : 0, -1);
  const std::vector<int64_t> zero_offsets(pack_heads ? size_t(a.batch_heads) : 0, 0);
  // The arguments a tile of t reads: a's, or with pack_heads the thread's copy of t's K/V rows.
  auto packed_args = [&](const Tile& t, AttnArgs<T>& copy) {
    char* kp = packs.slice(thread_id());
    char* vp = kp + a.kv_len * a.head_dim * item_bytes_kv;
    int64_t* key = &packed_keys[size_t(thread_id()) * kKeyStride];
    if (key[0] != a.k_offset[t.bh] || key[1] != a.v_offset[t.bh] || key[2] != t.j_begin || key[3] != t.j_end) {
      const char* k = reinterpret_cast<const char*>(a.k);
      const char* v = reinterpret_cast<const char*>(a.v);
      const size_t k_row = size_t(a.head_dim * item_bytes_kv), v_row = size_t(a.value_dim * item_bytes_kv);
      for (int64_t j = t.j_begin; j < t.j_end; ++j) {
        std::memcpy(kp + size_t(j) * k_row, k + (a.k_offset[t.bh] + j * a.k_stride_s) * item_bytes_kv, k_row);
        std::memcpy(vp + size_t(j) * v_row, v + (a.v_offset[t.bh] + j * a.v_stride_s) * item_bytes_kv, v_row);
      }
      key[0] = a.k_offset[t.bh];
      key[1] = a.v_offset[t.bh];
      key[2] = t.j_begin;
      key[3] = t.j_end;
    }
    copy = a;
    copy.k = reinterpret_cast<const T*>(kp);
    copy.v = reinterpret_cast<const T*>(vp);
    copy.k_offset = copy.v_offset = zero_offsets.data();
    copy.k_stride_s = a.head_dim;
    copy.v_stride_s = a.value_dim;
  };
  auto run_item = [&](int64_t n, int64_t next) {
    T* mine = scratch.slice(thread_id());
    const Tile t = item_tile(n);
    AttnArgs<T> with_copy;
    if (pack_heads) packed_args(t, with_copy);
    const AttnArgs<T>& args = pack_heads ? with_copy : a;
    const int64_t heads = heads_of(n / split.count);
    Scratch<T> s[kMaxGroupTileHeads];
    for (int64_t h = 0; h < heads; ++h) {
      T* head = mine + st_elems + kv_elems + size_t(h) * (qt_elems + sstate);
      s[h] = Scratch<T>{head, mine, state_at(head + qt_elems, block_rows, a.value_dim), kv_elems ? mine + st_elems : nullptr};
    }
    if (prefetch_items && next >= 0) {
      s[0].next_item = &next_items[size_t(thread_id())];
      plan_prefetch(*s[0].next_item, next, t);
      s[0].next_item->start(t.j_end - t.j_begin);
    }
    const int64_t bm = tile_rows(t);
    if (heads > 1) ks.attend_group(args, t, heads, bm, s);
    else ks.attend(args, t, bm, s[0]);
    if (s[0].next_item) s[0].next_item->finish();  // what the score steps left (a causal tile skips keys)
    if (split.count > 1) {
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(partials->data() + sstate * size_t(n * group_heads + h), s[h].state.acc, sstate * sizeof(T));
      return;
    }
    for (int64_t h = 0; h < heads; ++h)
      ks.finalize(s[h].state, bm, t.rows, a.value_dim, a.out_rows(t.bh + h) + t.i0 * a.out_stride_l, a.out_stride_l);
    if (a.weights) ks.write_weights(a, t, bm, s[0]);
  };
  // Claiming ahead only where it is used: elsewhere each item is claimed when its thread is free.
  if (prefetch_items) parallel_for_ahead(items, threads, run_item);
  else parallel_for(items, threads, [&](int64_t n) { run_item(n, -1); });

  if (split.count > 1) {
    parallel_for(tasks, threads, [&](int64_t task) {
      const Tile t = tile_of(task);
      for (int64_t h = 0; h < heads_of(task); ++h) {
        const Tile th{t.bh + h, t.i0, t.rows, t.j_begin, t.j_end};
        auto state_of = [&](int64_t c) {
          return state_at(partials->data() + sstate * size_t((task * split.count + c) * group_heads + h), block_rows,
                          a.value_dim);
        };
        merge_partials<T>(split.count, state_of, AccLayout{1, tile_rows(th)}, th.rows, a.value_dim, out_row_of(th));
      }
    });
  }
}

template void scaled_dot_product_attention<float>(const AttnArgs<float>&, int);
template void scaled_dot_product_attention<double>(const AttnArgs<double>&, int);

void install_fork_guard() {
#if defined(PYATTN_FORK_GUARD)
  static const int installed = pthread_atfork(nullptr, nullptr, &ForkGuard::on_fork_child);
  (void)installed;  // 0, or ENOMEM: then a forked child is as unguarded as without pyattn's help
#endif
}

int default_num_threads() {
  if (!ForkGuard::teams_allowed()) return 1;  // a child forked after a team ran: see parallel.h
  const int n = g_default_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
#if defined(PYATTN_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_default_num_threads(int n) { g_default_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

int64_t set_packed_mask_limit(int64_t bytes) {
  if (bytes < 0)
    throw std::invalid_argument("_set_packed_mask_limit: expected a byte count >= 0, got " + std::to_string(bytes));
  return g_packed_mask_limit.exchange(bytes);
}
namespace {

// The test switches below take only the values they document: a value outside them is refused
// (ValueError in Python), not read as a neighbouring one, and the setting stays as it was.
int switch_value(const char* name, int value, std::initializer_list<int> allowed) {
  std::string list;
  for (const int x : allowed) {
    if (x == value) return value;
    list += (list.empty() ? "" : ", ") + std::to_string(x);
  }
  throw std::invalid_argument(std::string(name) + ": expected one of " + list + ", got " + std::to_string(value));
}

}  // namespace

int set_prefetch(int mode) { return g_prefetch.exchange(switch_value("_set_prefetch", mode, {-1, 0, 1, 2})); }
int set_group_tiles(int on) { return g_group_tiles.exchange(switch_value("_set_group_tiles", on, {0, 1})); }
int set_pack_heads(int mode) { return g_pack_heads.exchange(switch_value("_set_pack_heads", mode, {-1, 0, 1})); }
int set_decode_heads(int mode) { return g_decode_heads.exchange(switch_value("_set_decode_heads", mode, {-1, 0, 1})); }
int set_decode_block16(int keys) {
  return g_decode_block16.exchange(switch_value("_set_decode_block16", keys, {-1, 32, 64}));
}
int set_decode_fuse(int mode) { return g_decode_fuse.exchange(switch_value("_set_decode_fuse", mode, {-1, 0, 1})); }
int set_decode_prefetch_level(int level) {
  return g_decode_prefetch_level.exchange(switch_value("_set_decode_prefetch_level", level, {-1, 1, 2}));
}
int set_decode_streams(int streams) {
  return g_decode_streams.exchange(switch_value("_set_decode_streams", streams, {-1, 1, 2, 4}));
}

bool openmp_enabled() {
#if defined(PYATTN_OPENMP)
  return true;
#else
  return false;
#endif
}

const char* openmp_runtime() {
  if (!ForkGuard::teams_allowed()) return "libgomp (GNU); single-threaded: this process was forked after a parallel region";
#if !defined(PYATTN_OPENMP)
  return "none (built without OpenMP: single-threaded)";
#elif defined(__clang__)
  return "libomp (LLVM)";
#elif defined(__GNUC__)
  return "libgomp (GNU)";
#elif defined(_MSC_VER)
  return "vcomp (MSVC)";
#else
  return "unknown";
#endif
}

namespace {
// Runs convert(from, to, count) over [0, n) in chunks of at least kConvertChunk elements (below that,
// starting a thread costs more than it saves), one chunk per thread.
constexpr int64_t kConvertChunk = 1 << 16;
template <class From, class To, class F>
void convert_parallel(const From* src, To* dst, int64_t n, int num_threads, F convert) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(std::max(1, num_threads), n / kConvertChunk));
  parallel_for(parts, int(parts), [&](int64_t c) {
    const int64_t begin = n * c / parts, end = n * (c + 1) / parts;
    convert(src + begin, dst + begin, end - begin);
  });
}
}  // namespace

void convert_half(const uint16_t* src, float* dst, int64_t n, int num_threads, bool bfloat16) {
  const KernelTable& kt = active_kernels();
  convert_parallel(src, dst, n, num_threads > 0 ? num_threads : default_num_threads(),
                   bfloat16 ? kt.bf16_to_float : kt.half_to_float);
}

void convert_half(const float* src, uint16_t* dst, int64_t n, int num_threads, bool bfloat16) {
  const KernelTable& kt = active_kernels();
  convert_parallel(src, dst, n, num_threads > 0 ? num_threads : default_num_threads(),
                   bfloat16 ? kt.float_to_bf16 : kt.float_to_half);
}

}  // namespace pyattn
