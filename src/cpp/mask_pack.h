// SPDX-License-Identifier: MIT
// Masks packed to bits once per call for the tile kernels (mask_pack.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel.h"
#include "problem.h"

namespace pyattn {

// A mask's bit copy (MaskSlot::bits, and value_bits for an additive one; lane_words, the bits again
// by 32-key chunk), owned by the driver for the length of one call.
struct PackedMask {
  std::vector<int64_t> offset;       // [batch_heads], in words
  std::vector<int64_t> lane_offset;  // [batch_heads], in lane words
  std::unique_ptr<AlignedBuffer<uint64_t>> bits, value_bits;
  std::unique_ptr<AlignedBuffer<uint32_t>> lane_words;
};

// Packs mask m into p and points m at it, unless the bits would take more than limit_bytes (then m
// stays as it was and the kernels read the mask itself). Heads whose offsets coincide (a mask
// broadcast over batch or heads) share one copy; a mask row shared by every query row is packed once.
// A float mask gets two bits per element (not -inf; a value to add). Lane words are packed too when
// they fit the same budget. Runs on up to `threads` threads, with the kernels of ks.
template <class T>
void pack_mask_bits(MaskSlot& m, const KernelSet<T>& ks, int64_t batch_heads, int64_t q_len, int64_t kv_len,
                    int threads, int64_t limit_bytes, PackedMask& p);

}  // namespace pyattn
