// SPDX-License-Identifier: MIT
// Tuning in one place: what the core knows about the CPU (CpuInfo), the plans it makes for a call
// from that and the call's sizes (plan_tiles, plan_decode, and the GEMM's, the mask packer's and the
// KV cache's size rules), every threshold those rules use, and the one override that tests and
// benchmarks use to force a plan or to make the planner see another CPU.
//
// A plan never changes what is computed, only how: which rows are prefetched, how many heads go
// through the key blocks together, the order in which a decode work item reads its keys. Rules that
// change the order of a sum (decode streams, 16-bit decode blocks, reading interleaved heads across
// the heads) change the rounding of the result, never its value beyond that; everything else gives
// the same bits. The work split (key chunks, decode row groups) depends on the call's shape only,
// never on the CPU or the thread count, so that results do not either.
//
// Each vendor- or model-specific rule below was measured on that core (the evidence is in
// docs/design.md and bench/RESULTS.md) and is kept only where it is worth at least 10% on a
// benchmark row there; every other CPU takes the generic rule.
#pragma once

#include <cstdint>

#include "problem.h"

namespace pyattn {

// ---- Work split (shape only) ----------------------------------------------------------------------

// Query rows per head at or below which the driver runs the decode kernel (lanes along head_dim, a
// GQA group's rows sharing every K/V load, the key range split across threads) instead of query
// tiles, which would be mostly padding rows. Python reads it as _core.DECODE_MAX_Q_LEN.
constexpr int64_t kDecodeMaxLen = 8;
// Below this many tasks the key range is split: enough independent items for the threads to
// balance on machines with up to a few dozen cores.
constexpr int64_t kTaskTarget = 64;
// A chunk of a split key range is at least this many key blocks, so that the merge (one pass over
// the chunk's accumulators) stays small against the chunk's work.
constexpr int64_t kMinChunkBlocks = 1;
// Query rows per decode work item: a GQA group's rows share each K/V load up to this many.
constexpr int64_t kDecodeMaxRows = 16;
// The smallest key chunk worth a decode work item of its own.
constexpr int64_t kDecodeMinChunk = 256;
// Decode over K/V heads that interleave in memory, read chunk by chunk across the heads: chunks of
// this many keys, so that the memory the prefetchers fetch around a head's rows belongs to the rows
// the next items read; at most kMaxInterleavedChunks per head, so that the partial states stay small.
constexpr int64_t kInterleavedChunk = 128;
constexpr int64_t kMaxInterleavedChunks = 256;

// ---- The CPU ----------------------------------------------------------------------------------------

enum class CpuVendor : int { unknown = 0, intel = 1, amd = 2 };

// What the planner knows about the CPU: probed once from CPUID (dispatch.cpp), replaceable field by
// field through the override.
struct CpuInfo {
  CpuVendor vendor = CpuVendor::unknown;
  int family = 0;         // CPUID display family: 0x19 AMD Zen 3/4, 0x1A Zen 5, 6 Intel cores; 0 off x86
  int model = 0;          // CPUID display model
  int64_t l1d_bytes = 0;  // one core's level-1 data cache; 0 where CPUID does not say
  int64_t l2_bytes = 0;   // one core's L2; 0 unknown
  int64_t llc_bytes = 0;  // the last-level cache one core can use (L3, else L2); 0 unknown
  bool avx2 = false;      // AVX2 + FMA + F16C, with the OS saving YMM state
  bool avx512 = false;    // AVX-512F, with the OS saving ZMM state
  bool amd_zen5_on() const { return vendor == CpuVendor::amd && family >= 0x1A; }
};

// CPUID's answers, read once (dispatch.cpp).
const CpuInfo& probed_cpu();

// ---- The override -----------------------------------------------------------------------------------

// A field at kByRule leaves the decision to the rules; any other value forces it. The binding
// (_core._set_tuning) checks each value against the range written beside it.
constexpr int64_t kByRule = -1;
struct TuningOverride {
  int64_t tile_prefetch = kByRule;        // 0 none, 1 the next key block's K/V rows, 2 the next item's rows
  int64_t group_heads = kByRule;          // heads per tile at most, 1 .. kMaxGroupTileHeads (1: head by head)
  int64_t pack_heads = kByRule;           // 0 never, 1 whenever K/V heads interleave in memory
  int64_t decode_prefetch = kByRule;      // 0 none, 1 into L1, 2 into L2
  int64_t decode_streams = kByRule;       // 1, 2 or 4
  int64_t decode_block16 = kByRule;       // 32 or 64
  int64_t decode_across_heads = kByRule;  // 0 chunk by chunk, 1 across the heads (where they interleave)
  int64_t decode_fuse = kByRule;          // 0 never, 1 wherever the kernel can
  int64_t packed_mask_limit = kByRule;    // bytes >= 0 (0: masks are read as they are)
  // The CPU the planner sees instead of the probed one, field by field.
  int64_t cpu_vendor = kByRule;  // a CpuVendor
  int64_t cpu_family = kByRule;  // >= 0
  int64_t cpu_model = kByRule;   // >= 0
  int64_t l2_bytes = kByRule;    // >= 0 (0: unknown)
  int64_t llc_bytes = kByRule;   // >= 0 (0: unknown)
};

// Replaces the override (thread-safe; calls already planned keep their plans); returns the previous one.
TuningOverride set_tuning_override(const TuningOverride& o);
TuningOverride tuning_override();

// What one call plans with: the CPU as the planner sees it (probed, then overridden) and the override.
struct Tuning {
  CpuInfo cpu;
  TuningOverride force;
};
// Read once per call, when its plan is made.
Tuning current_tuning();

// ---- Plans ------------------------------------------------------------------------------------------

// What plan_tiles goes by: the call's sizes as the tile driver has laid them out.
struct TileFacts {
  int64_t q_rows;       // batch_heads * q_len
  int64_t q_row_bytes;  // one query row and its output row
  int64_t kv_len;
  int64_t kv_heads;          // distinct key/value heads of the call
  int64_t kv_row_bytes;      // one key's K and V rows as stored
  int64_t block_rows;        // query rows per tile
  int64_t q_blocks;          // tiles per head
  int64_t chunk_keys;        // keys per work item (a split key range's chunk)
  int64_t group;             // query heads per key/value head
  int64_t num_heads;         // query heads per batch entry
  int64_t head_state_bytes;  // one head's query block and running state in a tile
  bool interleaved;          // the rows of consecutive K/V heads interleave in memory
  bool weights;              // the caller asked for the softmax weights (one head per tile)
  bool half_kv;              // K/V stored as 16-bit floats
  int threads;               // threads the caller asked for
};
TilePlan plan_tiles(const TileFacts& f, const Tuning& t);

// What plan_decode goes by.
struct DecodeFacts {
  int64_t kv_bytes;          // every K and V row of the call as stored
  int64_t rows_per_kv_head;  // query rows that read each K/V row (GQA group x q_len)
  bool half_kv;              // K/V stored as 16-bit floats or int8 (converted in registers)
  bool int8_kv;              // K/V stored as int8
  int threads;
};
DecodePlan plan_decode(const DecodeFacts& f, const Tuning& t);

// The largest bit copy of a call's masks the driver makes (mask_pack.cpp), in bytes.
int64_t packed_mask_limit(const Tuning& t);

// Register tiles of rows per GEMM task for a packed weight of `packed_bytes` whose tiles take
// `tile_bytes` of A rows each (gemm.cpp).
int64_t gemm_task_tiles(const CpuInfo& cpu, int64_t packed_bytes, int64_t tile_bytes);

// Bytes past a 64-byte line at which a KVCache's storage of `itemsize`-byte elements starts
// (_cache.py), bfloat16 or not: where the decode kernel reads it fastest.
int64_t kv_storage_offset(const CpuInfo& cpu, int64_t itemsize, bool bfloat16);

}  // namespace pyattn
