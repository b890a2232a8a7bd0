// SPDX-License-Identifier: MIT
// Mask packing: each distinct mask of a call to bits once, so that the tile kernels classify a key
// block (skipped, fully allowed, per element) from a few words instead of every tile converting the
// mask's bytes or floats again for every head. A float mask of 0 and -inf (a causal or padding
// pattern) then costs what a boolean one does. The bits are bounded by the tuning module's budget
// (packed_mask_limit): never O(L * S) working memory.

#include "mask_pack.h"

#include <algorithm>
#include <utility>

#include "dispatch.h"

namespace pyattn {
namespace {

// Mask rows per packing item: a tile's worth. A mask element costs about what a multiply-add does,
// so threads_for (parallel.h) leaves a small mask to the calling thread.
constexpr int64_t kPackRows = 64;

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

// The distinct offsets of m over the heads (sorted), and each head's word offset into the copy.
std::vector<int64_t> distinct_offsets(const MaskSlot& m, int64_t batch_heads, int64_t row_words, PackedMask& p) {
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
    p.offset[size_t(ob.second)] = int64_t(distinct.size() - 1) * row_words;
  }
  return distinct;
}

}  // namespace

template <class T>
void pack_mask_bits(MaskSlot& m, const KernelSet<T>& ks, int64_t batch_heads, int64_t q_len, int64_t kv_len,
                    int threads, int64_t limit_bytes, PackedMask& p) {
  const bool additive = m.kind == MaskKind::additive;
  const int64_t rows = m.stride_l == 0 ? 1 : q_len, words = ceil_div(kv_len, 64);
  const std::vector<int64_t> distinct = distinct_offsets(m, batch_heads, rows * words, p);
  const int64_t copies = int64_t(distinct.size());
  const int64_t elems = copies * rows * words;
  const int64_t bytes = elems * int64_t(sizeof(uint64_t)) * (additive ? 2 : 1);
  if (bytes > limit_bytes) return;
  p.bits.reset(new AlignedBuffer<uint64_t>(size_t(elems)));
  if (additive) p.value_bits.reset(new AlignedBuffer<uint64_t>(size_t(elems)));
  // Lane words when they fit the budget too: the tiles then read a partly masked block's verdicts
  // in place instead of gathering them from the bits for every head.
  const int64_t lane_rows = rows == 1 ? kMaxTileRows : rows, lane_elems = lane_rows * ceil_div(kv_len, 32);
  if (bytes + copies * lane_elems * int64_t(sizeof(uint32_t)) <= limit_bytes) {
    p.lane_words.reset(new AlignedBuffer<uint32_t>(size_t(copies * lane_elems)));
    p.lane_offset.resize(size_t(batch_heads));
    for (int64_t bh = 0; bh < batch_heads; ++bh)
      p.lane_offset[size_t(bh)] = p.offset[size_t(bh)] / (rows * words) * lane_elems;
  }
  const int64_t chunks = ceil_div(rows, kPackRows), items = copies * chunks;
  const KernelTable& kt = active_kernels();
  const int pack_threads = threads_for(double(copies * rows * kv_len), threads, items);
  parallel_for(items, pack_threads, [&](int64_t n) {
    const int64_t d = n / chunks, r0 = n % chunks * kPackRows, at = distinct[size_t(d)] + r0 * m.stride_l;
    const int64_t out = (d * rows + r0) * words, count = std::min(kPackRows, rows - r0);
    if (additive)
      ks.pack_additive(static_cast<const T*>(m.data) + at, m.stride_l, m.stride_s, count, kv_len, p.bits->data() + out,
                       p.value_bits->data() + out);
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

template void pack_mask_bits<float>(MaskSlot&, const KernelSet<float>&, int64_t, int64_t, int64_t, int, int64_t,
                                    PackedMask&);
template void pack_mask_bits<double>(MaskSlot&, const KernelSet<double>&, int64_t, int64_t, int64_t, int, int64_t,
                                     PackedMask&);

}  // namespace pyattn
