// SPDX-License-Identifier: MIT
// The decode driver: calls with few query rows per head (decoding against a KV cache), which are
// bound by reading K and V once, at memory bandwidth, on all cores.
//
// A task is one key/value head's query rows (its GQA group's heads times the query length, at most
// kDecodeMaxRows per task), so each K/V row is read once for the whole group. Few tasks (one new
// token over a few heads) split their key ranges into chunks of at least kDecodeMinChunk keys, one
// work item each, merged afterwards (split_merge.h). K/V heads that interleave in memory (a (batch,
// seq, heads, head_dim) array viewed heads first) have no stream per head; they are read either
// across the heads, every head of a chunk key by key (attend_decode_heads; decode_heads.inc), or in
// short chunks claimed chunk by chunk across the heads, as the plan says. The work split depends on
// the shape only, so the result does not depend on the thread count.

#include "decode_driver.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "parallel.h"
#include "split_merge.h"

namespace pyattn {
namespace {

// Decode over interleaved K/V heads whose rows are whole vectors, each key/value head's tile holding
// all its query rows: work items of every head of a batch entry over a chunk of keys (decode_heads),
// K and V read in address order. Chunks as split_keys gives them for the batch entries as tasks (at
// least kDecodeMinChunk key rows of all heads together), merged as attend_decode merges its chunks.
template <class T>
void attend_decode_heads(const AttnArgs<T>& a, const KernelSet<T>& ks, int num_threads) {
  const int64_t group = a.group, heads = a.num_heads / group, batch = a.batch_heads / a.num_heads;
  const int64_t rows = a.rows_per_kv_head();
  const Split split = split_keys(batch, a.kv_len, ks.decode_heads_block,
                                 std::max(ks.decode_heads_block, ceil_div(kDecodeMinChunk, heads)));
  const int64_t items = batch * split.count;
  const int threads = threads_for(a.fmas(), num_threads, items);

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
    ks.decode_heads(a, b, rows, group, j_begin, j_end, scratch.slice(id), &states[size_t(n * heads)],
                    &local[size_t(id * heads)], &offsets[size_t(id * 2 * heads)]);
  });
  parallel_for(batch * heads, threads, [&](int64_t task) {
    const int64_t b = task / heads, h = task % heads;
    merge_partials<T>(
        split.count, [&](int64_t c) { return carve(partials.data() + sstate * size_t(task * split.count + c)); }, lay,
        rows, a.value_dim,
        [&a, b, h, group](int64_t r) {
          const int64_t bh = b * a.num_heads + h * group + r / a.q_len;
          return a.out_rows(bh) + (r % a.q_len) * a.out_stride_l;
        });
  });
}

// The split of attend_decode's tasks: split_keys, or for interleaved heads chunks of at least
// kInterleavedChunk keys (at most kMaxInterleavedChunks per task), whole decode blocks either way.
template <class T>
Split decode_split(const KernelSet<T>& ks, int64_t tasks, bool interleaved, int64_t keys) {
  if (!interleaved || keys <= kInterleavedChunk) return split_keys(tasks, keys, ks.decode_block, kDecodeMinChunk);
  const int64_t chunk = std::max(kInterleavedChunk, ceil_div(keys, kMaxInterleavedChunks));
  const int64_t rounded = ceil_div(chunk, ks.decode_block) * ks.decode_block;
  return Split{ceil_div(keys, rounded), rounded};
}

// The facts plan_decode goes by.
template <class T>
DecodeFacts decode_facts(const AttnArgs<T>& a, int num_threads) {
  DecodeFacts f;
  f.kv_bytes = a.batch_heads / a.group * a.kv_len * (a.head_dim + a.value_dim) * a.kv_item_bytes();
  f.rows_per_kv_head = a.rows_per_kv_head();
  f.half_kv = a.kv_storage != Storage::same;
  f.int8_kv = a.kv_storage == Storage::i8;
  f.threads = num_threads;
  return f;
}

}  // namespace

template <class T>
void attend_decode(const AttnArgs<T>& a, const KernelSet<T>& ks, const Tuning& tuning, int num_threads) {
  const DecodePlan plan = plan_decode(decode_facts(a, num_threads), tuning);
  const int64_t rows_total = a.rows_per_kv_head(), group = a.group;
  const int64_t kv_heads = a.num_heads / group;  // key/value heads per batch entry
  const int64_t row_chunks = ceil_div(rows_total, kDecodeMaxRows);
  const int64_t chunk_rows = ceil_div(rows_total, row_chunks);
  const int64_t tasks = a.batch_heads / group * row_chunks;
  const bool interleaved = a.kv_heads_interleave();
  const bool whole_vectors = ks.decode_padded(a.head_dim) == a.head_dim && ks.decode_padded(a.value_dim) == a.value_dim;
  // The across-heads kernel knows masks and the causal limit only: calls with variants (window,
  // softcap, ALiBi, sinks) or return_lse take the head-by-head one.
  if (interleaved && row_chunks == 1 && whole_vectors && plan.across_heads && !a.has_variants() && !a.lse &&
      a.kv_storage != Storage::i8)
    return attend_decode_heads(a, ks, num_threads);
  // With a window the keys before every row's window are never read: the split covers the rest only
  // (from a whole block), so that no thread is left with chunks of nothing while another reads the
  // window.
  int64_t keys_from = 0;
  if (a.windowed) {
    keys_from = a.kv_len;
    for (int64_t bh = 0; bh < a.batch_heads; bh += a.num_heads)
      keys_from = std::min(keys_from, std::max<int64_t>(0, a.window_offset_of(bh)));
    keys_from = keys_from / ks.decode_block * ks.decode_block;
  }
  const Split split = decode_split(ks, tasks, interleaved, a.kv_len - keys_from);
  const int64_t items = tasks * split.count;
  const int threads = threads_for(a.fmas(), num_threads, items);

  const int64_t vdim_p = ks.decode_padded(a.value_dim);
  const AccLayout lay{vdim_p, 1};
  const size_t sstate = state_elems<T>(chunk_rows, vdim_p);
  const size_t scratch_elems = padded(size_t(ks.decode_scratch(chunk_rows, a.head_dim, a.value_dim)), sizeof(T));
  // A split item's state goes to `partials`; an unsplit one's stays in the thread's slice.
  ThreadSlices<T> scratch(scratch_elems + (split.count > 1 ? 0 : sstate), threads);
  std::unique_ptr<AlignedBuffer<T>> partials;
  if (split.count > 1) partials.reset(new AlignedBuffer<T>(sstate * size_t(items)));
  auto carve = [&](T* base) { return state_at(base, chunk_rows, vdim_p); };
  auto tile_of = [&](int64_t task) {
    const int64_t kvg = task / row_chunks, r0 = task % row_chunks * chunk_rows;
    return DecodeTile{kvg / kv_heads, kvg % kv_heads, r0, std::min(chunk_rows, rows_total - r0), 0, a.kv_len};
  };
  auto out_row_of = [&](const DecodeTile& t) {
    return [&a, t, group](int64_t r) {
      const int64_t bh = t.batch * a.num_heads + t.kv_head * group + (t.r0 + r) / a.q_len;
      return a.out_rows(bh) + ((t.r0 + r) % a.q_len) * a.out_stride_l;
    };
  };
  auto lse_row_of = [&](const DecodeTile& t) {
    return [&a, t, group](int64_t r) -> T* {
      if (!a.lse) return nullptr;
      const int64_t bh = t.batch * a.num_heads + t.kv_head * group + (t.r0 + r) / a.q_len;
      return a.lse_rows(bh) + (t.r0 + r) % a.q_len;
    };
  };

  parallel_for(items, threads, [&](int64_t claimed) {
    // Item n is chunk n % split.count of task n / split.count; interleaved heads claim them chunk
    // by chunk (all tasks' first chunks, then their second ones, ...).
    const int64_t n = interleaved ? claimed % tasks * split.count + claimed / tasks : claimed;
    T* mine = scratch.slice(thread_id());
    DecodeTile t = tile_of(n / split.count);
    if (split.count > 1) {
      t.j_begin = keys_from + n % split.count * split.chunk;
      t.j_end = std::min(a.kv_len, t.j_begin + split.chunk);
      t.first = n % split.count == 0;
      ks.decode(a, plan, t, group, mine, carve(partials->data() + sstate * size_t(n)));
      return;
    }
    const RowState<T> st = carve(mine + scratch_elems);
    ks.decode(a, plan, t, group, mine, st);
    finalize(st, lay, t.rows, a.value_dim, out_row_of(t));
    if (a.lse)
      for (int64_t r = 0; r < t.rows; ++r) *lse_row_of(t)(r) = row_lse(st.m[r], st.l[r]);
  });
  if (split.count > 1) {
    parallel_for(tasks, threads, [&](int64_t task) {
      const DecodeTile t = tile_of(task);
      merge_partials<T>(
          split.count, [&](int64_t c) { return carve(partials->data() + sstate * size_t(task * split.count + c)); },
          lay, t.rows, a.value_dim, out_row_of(t), lse_row_of(t));
    });
  }
}

template void attend_decode<float>(const AttnArgs<float>&, const KernelSet<float>&, const Tuning&, int);
template void attend_decode<double>(const AttnArgs<double>&, const KernelSet<double>&, const Tuning&, int);

}  // namespace pyattn
