// SPDX-License-Identifier: MIT
// The entry point of one attention call and the tile driver: splits the call into independent
// tiles, runs them on the threads (parallel.h), owns the per-thread scratch, and normalises the
// kernels' running state into the output. Calls of at most kDecodeMaxLen query rows per head go to
// the decode driver instead (decode_driver.cpp).
//
// Work split. A task is (batch*head, block of query rows): a tile, or a group tile of several heads
// that share K and V (a GQA group, or neighbouring heads whose K/V rows interleave in memory), as the
// plan says (tuning.cpp, plan_tiles). When there are too few tasks to keep a machine busy, each
// task's key range is also split into chunks; every chunk produces a partial (m, l, acc) and the
// chunks are merged in a fixed order (split_merge.h). The split depends only on the problem's shape,
// never on the thread count or the plan, so the result is bitwise identical for any number of
// threads and any plan. Each thread runs its own range of the tasks (ItemRanges, parallel.h), then
// helps with what is left of the others'; within a head, last query blocks first: under a causal
// mask they are the longest.
//
// Memory: per thread one query block, one score block and one accumulator per head of a tile
// (O(block_rows * (head_dim + key_block + value_dim))), plus one K and one V block converted from
// 16 bits when K/V are stored so, plus a copy of one head's K/V rows when the plan packs heads; split
// calls add one partial state per work item, whose count is bounded by kTaskTarget tasks' worth; a
// mask may be packed to bits (mask_pack.cpp), up to the tuning module's budget. Nothing is
// O(q_len * kv_len) except the caller's weights.

#include "attention.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "decode_driver.h"
#include "mask_pack.h"
#include "parallel.h"
#include "prefetch.h"
#include "split_merge.h"

namespace pyattn {
namespace {

// How the tile driver lays out one call's query rows, keys and scratch.
struct TileLayout {
  int64_t block_rows;            // rows of the widest tile (lanes * row_vecs, or one vector)
  int64_t q_blocks;              // tiles per head
  int64_t vecs_per_block;        // the query's row vectors shared out evenly over the blocks,
  int64_t blocks_with_one_more;  // the first ones taking one more when they do not divide
  int64_t key_block;             // keys per online-softmax step of the widest tile
  Split split;                   // each task's key range in chunks
  size_t qt_elems, sstate;       // per head of a tile: query block, running state
  size_t st_elems, kv_elems;     // per thread: scores, 16-bit K/V converted
};

// Query rows are split into blocks of lanes * row_vecs (the widest register tile; one vector of rows
// when q_len fits it); the query's row vectors are shared out evenly over those blocks, so that no
// block is left with a lone vector of rows, which costs far more per row than a full tile. Each row's
// arithmetic does not depend on its tile, so neither do the results.
template <class T>
TileLayout tile_layout(const AttnArgs<T>& a, const KernelSet<T>& ks) {
  TileLayout l;
  l.block_rows = a.q_len <= ks.lanes ? ks.lanes : int64_t(ks.lanes) * ks.row_vecs;
  l.q_blocks = ceil_div(a.q_len, l.block_rows);
  const int64_t q_vecs = ceil_div(a.q_len, int64_t(ks.lanes));
  l.vecs_per_block = q_vecs / l.q_blocks;
  l.blocks_with_one_more = q_vecs % l.q_blocks;
  l.key_block = ks.key_block(l.block_rows);
  // A group tile does the work of its heads' tiles: the key range is split as for one tile per head
  // and query block, however the heads are grouped, so that the plan never changes the bits.
  l.split = a.weights ? Split{1, a.kv_len}
                      : split_keys(a.batch_heads * l.q_blocks, a.kv_len, l.key_block, kMinChunkBlocks * l.key_block);
  l.qt_elems = padded(size_t(a.head_dim * l.block_rows), sizeof(T));
  l.sstate = state_elems<T>(l.block_rows, a.value_dim);
  l.st_elems = padded(size_t(l.key_block * l.block_rows), sizeof(T));
  // 16-bit K/V: one converted K block and one V block (key_block of the narrowest tile, the longest).
  l.kv_elems = a.kv_storage == Storage::same
                   ? 0
                   : padded(size_t(ks.key_block(ks.lanes) * (a.head_dim + a.value_dim)), sizeof(T));
  return l;
}

template <class T>
TileFacts tile_facts(const AttnArgs<T>& a, const TileLayout& l, int threads_wanted) {
  TileFacts f;
  f.q_rows = a.batch_heads * a.q_len;
  f.q_row_bytes = (a.head_dim + a.value_dim) * int64_t(sizeof(T));
  f.kv_len = a.kv_len;
  f.kv_heads = std::max<int64_t>(1, a.batch_heads / a.group);
  f.kv_row_bytes = (a.head_dim + a.value_dim) * a.kv_item_bytes();
  f.block_rows = l.block_rows;
  f.q_blocks = l.q_blocks;
  f.chunk_keys = l.split.chunk;
  f.group = a.group;
  f.num_heads = a.num_heads;
  f.head_state_bytes = int64_t((l.qt_elems + l.sstate) * sizeof(T));
  f.interleaved = a.kv_heads_interleave();
  f.weights = a.weights != nullptr;
  f.half_kv = a.kv_storage != Storage::same;
  f.threads = threads_wanted;
  return f;
}

// One call of the tile driver: its layout, plan, tasks and buffers, and the work items.
template <class T>
class TileRun {
 public:
  TileRun(const AttnArgs<T>& a, const KernelSet<T>& ks, const Tuning& tuning, int threads_wanted);
  void run();

 private:
  Tile tile_of(int64_t task) const;
  Tile item_tile(int64_t n) const;
  int64_t heads_of(int64_t task) const;
  void plan_prefetch(ItemPrefetch& p, int64_t n, const Tile& current) const;
  const AttnArgs<T>& packed_args(const Tile& t, AttnArgs<T>& copy);
  void run_item(int64_t n, int64_t next);
  void merge(int64_t task);

  const AttnArgs<T>& a_;
  const KernelSet<T>& ks_;
  TileLayout l_;
  TilePlan plan_;
  int64_t tile_group_;  // heads that may share a tile: a GQA group, or all heads of a batch entry (pairs)
  int64_t sub_groups_;  // tiles per tile_group_ heads and query block
  int64_t tasks_, items_;
  int threads_;
  ThreadSlices<T> scratch_;                     // per thread: scores, converted K/V, each head's block and state
  std::unique_ptr<AlignedBuffer<T>> partials_;  // state of item n's head h at (n * group_heads + h) * sstate
  std::vector<ItemPrefetch> next_items_;        // per thread, with plan_.prefetch_items
  // pack_heads: per thread, one head's (or GQA group's) K rows then V rows, back to back at their key
  // index, as stored; packed_keys_ says whose rows each holds (K and V offsets, key range).
  ThreadSlices<char> packs_;
  std::vector<int64_t> packed_keys_;
  std::vector<int64_t> zero_offsets_;
};

// Each thread's four keys (32 bytes) 128 bytes from the next thread's: never on a common cache line.
constexpr size_t kKeyStride = 2 * kCacheLine / sizeof(int64_t);

template <class T>
TileRun<T>::TileRun(const AttnArgs<T>& a, const KernelSet<T>& ks, const Tuning& tuning, int threads_wanted)
    : a_(a),
      ks_(ks),
      l_(tile_layout(a, ks)),
      plan_(plan_tiles(tile_facts(a, l_, threads_wanted), tuning)),
      tile_group_(plan_.pairs ? a.num_heads : a.group),
      sub_groups_(ceil_div(tile_group_, plan_.group_heads)),
      tasks_(a.batch_heads / tile_group_ * sub_groups_ * l_.q_blocks),
      items_(tasks_ * l_.split.count),
      threads_(threads_for(a.fmas(), threads_wanted, items_)),
      scratch_(l_.st_elems + l_.kv_elems + size_t(plan_.group_heads) * (l_.qt_elems + l_.sstate), threads_),
      next_items_(plan_.prefetch_items ? size_t(threads_) : 0),
      packs_(plan_.pack_heads ? padded(size_t(a.kv_len * (a.head_dim + a.value_dim) * a.kv_item_bytes()), 1) : 0,
             threads_),
      packed_keys_(plan_.pack_heads ? size_t(threads_) * kKeyStride : 0, -1),
      zero_offsets_(plan_.pack_heads ? size_t(a.batch_heads) : 0, 0) {
  if (l_.split.count > 1) partials_.reset(new AlignedBuffer<T>(l_.sstate * size_t(items_ * plan_.group_heads)));
}

// A task's tile: head (or group tile) by head, so a core's consecutive tiles reuse the head's K and V
// from its L2; within a head, last query blocks first (under a causal mask they have the most keys).
template <class T>
Tile TileRun<T>::tile_of(int64_t task) const {
  const int64_t unit = task / l_.q_blocks;  // (GQA group, sub-group)
  const int64_t bh = unit / sub_groups_ * tile_group_ + unit % sub_groups_ * plan_.group_heads;
  const int64_t qb = l_.q_blocks - 1 - task % l_.q_blocks;
  const int64_t i0 = ks_.lanes * (qb * l_.vecs_per_block + std::min(qb, l_.blocks_with_one_more));
  const int64_t rows = ks_.lanes * (l_.vecs_per_block + (qb < l_.blocks_with_one_more ? 1 : 0));
  return Tile{bh, i0, std::min(rows, a_.q_len - i0), 0, a_.kv_len_of(bh)};
}

// Item n: chunk n % split.count of task n / split.count.
template <class T>
Tile TileRun<T>::item_tile(int64_t n) const {
  Tile t = tile_of(n / l_.split.count);
  if (l_.split.count > 1) {
    const int64_t c = n % l_.split.count;
    t.j_begin = std::min(t.j_end, c * l_.split.chunk);
    t.j_end = std::min(t.j_end, t.j_begin + l_.split.chunk);
  }
  return t;
}

// How many heads from tile_of(task).bh the task takes (a last sub-group may have fewer).
template <class T>
int64_t TileRun<T>::heads_of(int64_t task) const {
  return std::min(plan_.group_heads, tile_group_ - task / l_.q_blocks % sub_groups_ * plan_.group_heads);
}

// The rows item n reads and writes (a split item writes a partial state, not output rows), but not
// the K and V rows of `current` (the item running now) if n reads the same ones: another query block
// of the same head, or a head of the same GQA group, finds them in L2.
template <class T>
void TileRun<T>::plan_prefetch(ItemPrefetch& p, int64_t n, const Tile& current) const {
  const AttnArgs<T>& a = a_;
  Tile t = item_tile(n);
  if (a.windowed)  // the keys before the window of the item's first row are never read
    t.j_begin = std::max(t.j_begin, std::min(t.j_end, t.i0 + a.window_offset_of(t.bh)));
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
  p.part[3] = {reinterpret_cast<const char*>(a.out_rows(t.bh) + t.i0 * a.out_stride_l), l_.split.count > 1 ? 0 : t.rows,
               a.out_stride_l * int64_t(sizeof(T)), lines(a.value_dim * int64_t(sizeof(T)))};
}

// The arguments a tile of t reads with pack_heads: the thread's copy of t's K/V rows (made unless the
// copy holds them already), read at stride head_dim / value_dim.
template <class T>
const AttnArgs<T>& TileRun<T>::packed_args(const Tile& t, AttnArgs<T>& copy) {
  const AttnArgs<T>& a = a_;
  const int64_t item = a.kv_item_bytes();
  char* kp = packs_.slice(thread_id());
  char* vp = kp + a.kv_len * a.head_dim * item;
  int64_t* key = &packed_keys_[size_t(thread_id()) * kKeyStride];
  if (key[0] != a.k_offset[t.bh] || key[1] != a.v_offset[t.bh] || key[2] != t.j_begin || key[3] != t.j_end) {
    const char* k = reinterpret_cast<const char*>(a.k);
    const char* v = reinterpret_cast<const char*>(a.v);
    const size_t k_row = size_t(a.head_dim * item), v_row = size_t(a.value_dim * item);
    for (int64_t j = t.j_begin; j < t.j_end; ++j) {
      std::memcpy(kp + size_t(j) * k_row, k + (a.k_offset[t.bh] + j * a.k_stride_s) * item, k_row);
      std::memcpy(vp + size_t(j) * v_row, v + (a.v_offset[t.bh] + j * a.v_stride_s) * item, v_row);
    }
    key[0] = a.k_offset[t.bh];
    key[1] = a.v_offset[t.bh];
    key[2] = t.j_begin;
    key[3] = t.j_end;
  }
  copy = a;
  copy.k = reinterpret_cast<const T*>(kp);
  copy.v = reinterpret_cast<const T*>(vp);
  copy.k_offset = copy.v_offset = zero_offsets_.data();
  copy.k_stride_s = a.head_dim;
  copy.v_stride_s = a.value_dim;
  return copy;
}

// Runs item n (next: the item the thread runs after it, -1 unknown), into the output rows or, for a
// split item, into its partial states.
template <class T>
void TileRun<T>::run_item(int64_t n, int64_t next) {
  T* mine = scratch_.slice(thread_id());
  const Tile t = item_tile(n);
  AttnArgs<T> with_copy;
  const AttnArgs<T>& args = plan_.pack_heads ? packed_args(t, with_copy) : a_;
  const int64_t heads = heads_of(n / l_.split.count);
  Scratch<T> s[kMaxGroupTileHeads];
  for (int64_t h = 0; h < heads; ++h) {
    T* head = mine + l_.st_elems + l_.kv_elems + size_t(h) * (l_.qt_elems + l_.sstate);
    s[h] = Scratch<T>{head, mine, state_at(head + l_.qt_elems, l_.block_rows, a_.value_dim),
                      l_.kv_elems ? mine + l_.st_elems : nullptr};
  }
  if (plan_.prefetch_items && next >= 0) {
    s[0].next_item = &next_items_[size_t(thread_id())];
    plan_prefetch(*s[0].next_item, next, t);
    s[0].next_item->start(t.j_end - t.j_begin);
  }
  // As few row vectors as hold the tile's rows: a short block computes no padding vectors.
  const int64_t bm = std::min(l_.block_rows, ceil_div(t.rows, int64_t(ks_.lanes)) * ks_.lanes);
  if (heads > 1)
    ks_.attend_group(args, plan_, t, heads, bm, s);
  else
    ks_.attend(args, plan_, t, bm, s[0]);
  if (s[0].next_item) s[0].next_item->finish();  // what the score steps left (a causal tile skips keys)
  if (l_.split.count > 1) {
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(partials_->data() + l_.sstate * size_t(n * plan_.group_heads + h), s[h].state.acc,
                  l_.sstate * sizeof(T));
    return;
  }
  for (int64_t h = 0; h < heads; ++h)
    ks_.finalize(s[h].state, bm, t.rows, a_.value_dim, a_.out_rows(t.bh + h) + t.i0 * a_.out_stride_l, a_.out_stride_l);
  if (a_.lse)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < t.rows; ++i) a_.lse_rows(t.bh + h)[t.i0 + i] = row_lse(s[h].state.m[i], s[h].state.l[i]);
  if (a_.weights) ks_.write_weights(a_, t, bm, s[0]);
}

// Merges the chunks of a split task into its heads' output rows.
template <class T>
void TileRun<T>::merge(int64_t task) {
  const Tile t = tile_of(task);
  const int64_t bm = std::min(l_.block_rows, ceil_div(t.rows, int64_t(ks_.lanes)) * ks_.lanes);
  for (int64_t h = 0; h < heads_of(task); ++h) {
    auto state_of = [&](int64_t c) {
      const size_t at = l_.sstate * size_t((task * l_.split.count + c) * plan_.group_heads + h);
      return state_at(partials_->data() + at, l_.block_rows, a_.value_dim);
    };
    T* out = a_.out_rows(t.bh + h) + t.i0 * a_.out_stride_l;
    const int64_t stride = a_.out_stride_l;
    T* lse = a_.lse ? a_.lse_rows(t.bh + h) + t.i0 : nullptr;
    merge_partials<T>(
        l_.split.count, state_of, AccLayout{1, bm}, t.rows, a_.value_dim,
        [out, stride](int64_t i) { return out + i * stride; }, [lse](int64_t i) { return lse ? lse + i : nullptr; });
  }
}

template <class T>
void TileRun<T>::run() {
  // Claiming ahead only where it is used: elsewhere each item is claimed when its thread is free.
  if (plan_.prefetch_items)
    parallel_for_ahead(items_, threads_, [this](int64_t n, int64_t next) { run_item(n, next); });
  else
    parallel_for(items_, threads_, [this](int64_t n) { run_item(n, -1); });
  if (l_.split.count > 1) parallel_for(tasks_, threads_, [this](int64_t task) { merge(task); });
}

}  // namespace

template <class T>
void scaled_dot_product_attention(const AttnArgs<T>& in, int num_threads) {
  if (in.batch_heads == 0 || in.q_len == 0) return;
  const KernelSet<T>& ks = active_set<T>();
  const int threads_wanted = num_threads > 0 ? num_threads : default_num_threads();
  const Tuning tuning = current_tuning();
  if (!in.weights && in.q_len <= kDecodeMaxLen) return attend_decode(in, ks, tuning, threads_wanted);
  // Masks reach the tile kernels as bits, packed once per call (mask_pack.cpp).
  AttnArgs<T> a = in;
  PackedMask packed[2];
  for (int x = 0; x < 2; ++x)
    if (a.masks[x].kind != MaskKind::none && a.kv_len > 0)
      pack_mask_bits(a.masks[x], ks, a.batch_heads, a.q_len, a.kv_len, threads_wanted, packed_mask_limit(tuning),
                     packed[x]);
  TileRun<T>(a, ks, tuning, threads_wanted).run();
}

template void scaled_dot_product_attention<float>(const AttnArgs<float>&, int);
template void scaled_dot_product_attention<double>(const AttnArgs<double>&, int);

}  // namespace pyattn
