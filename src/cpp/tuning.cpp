// SPDX-License-Identifier: MIT
// The rules of tuning.h: each plan field decided in one short block, its threshold a named constant
// with the reason for it, the vendor- and model-specific exceptions side by side with the generic
// rule they replace.

#include "tuning.h"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace pyattn {
namespace {

// ---- Query tiles ----

// A thread copies a head's interleaved K/V rows only for this many query blocks or more: the copy
// costs a pass over the rows, which fewer blocks reading them do not repay.
constexpr int64_t kPackMinQueryBlocks = 16;
// Heads whose K/V rows interleave in memory share a tile two at a time: their rows then share pages
// and cache-line neighbourhoods; more at once gained nothing more.
constexpr int64_t kNeighbourHeads = 2;
// The next-item prefetch pays only when a call's arrays outgrow what a core can keep cached between
// calls; that is at most this many L2s, since a guest's share of a large shared L3 changes with its
// neighbours' use of it.
constexpr int64_t kCachedL2s = 16;
// ... and a share of the last-level cache: AMD's L3 keeps half of it for one core complex's calls,
// while a large Intel L3 shared by many cores keeps far less for one guest.
constexpr int64_t kCachedLlcShareAmd = 2;    // 1/2
constexpr int64_t kCachedLlcShareOther = 8;  // 1/8

// ---- Decode ----

// Rows per K/V row from which the decode kernel's arithmetic per row is long enough to stop a core
// issuing loads (GQA groups of four query heads and more).
constexpr int64_t kBusyRows = 4;
// 16-bit blocks of the decode kernel: 32 keys, or 64 where the per-block work (q rows reloaded,
// the softmax's reductions) is worth spreading over twice the keys.
constexpr int kBlock16Short = 32, kBlock16Long = 64;
// Parts of a work item's key range the decode kernel reads side by side to keep more lines in flight.
constexpr int kManyStreams = 4;

// ---- Masks, GEMM, KV cache ----

// Masks are packed to bits once per call when the bits take at most this many bytes: enough for a
// mask broadcast over batch and heads up to L = S = 8192, and a bound on the working memory whatever
// L * S is (never O(L * S)); bigger masks are read as they are.
constexpr int64_t kMaxPackedMaskBytes = int64_t(8) << 20;
// Rows per GEMM task: at least this many register tiles amortise the panel's trip through L2.
constexpr int64_t kTilesPerTask = 16;
// 16-bit KVCache storage starts this many bytes past a line: the decode kernel's 16-bit steps are
// compute-bound and read a split row no slower from L3 and memory, as NumPy would place it.
constexpr int64_t kHalfStorageOffset = 16;

std::mutex g_override_mutex;
TuningOverride g_override;              // guarded by g_override_mutex
std::atomic<bool> g_overridden{false};  // any field not kByRule: calls then read g_override

bool forced(int64_t field) { return field != kByRule; }

bool any_forced(const TuningOverride& o) {
  for (const int64_t f : {o.tile_prefetch, o.group_heads, o.pack_heads, o.decode_prefetch, o.decode_streams,
                          o.decode_block16, o.decode_across_heads, o.decode_fuse, o.packed_mask_limit, o.cpu_vendor,
                          o.cpu_family, o.cpu_model, o.l2_bytes, o.llc_bytes})
    if (forced(f)) return true;
  return false;
}

}  // namespace

TuningOverride set_tuning_override(const TuningOverride& o) {
  std::lock_guard<std::mutex> lock(g_override_mutex);
  const TuningOverride previous = g_override;
  g_override = o;
  g_overridden.store(any_forced(o), std::memory_order_release);
  return previous;
}

TuningOverride tuning_override() {
  std::lock_guard<std::mutex> lock(g_override_mutex);
  return g_override;
}

Tuning current_tuning() {
  Tuning t{probed_cpu(), TuningOverride{}};
  if (!g_overridden.load(std::memory_order_acquire)) return t;
  t.force = tuning_override();
  const TuningOverride& o = t.force;
  if (forced(o.cpu_vendor)) t.cpu.vendor = CpuVendor(o.cpu_vendor);
  if (forced(o.cpu_family)) t.cpu.family = int(o.cpu_family);
  if (forced(o.cpu_model)) t.cpu.model = int(o.cpu_model);
  if (forced(o.l2_bytes)) t.cpu.l2_bytes = o.l2_bytes;
  if (forced(o.llc_bytes)) t.cpu.llc_bytes = o.llc_bytes;
  return t;
}

TilePlan plan_tiles(const TileFacts& f, const Tuning& t) {
  const TuningOverride& o = t.force;
  const int64_t l2 = t.cpu.l2_bytes, llc = t.cpu.llc_bytes;
  const int64_t head_kv = f.kv_len * f.kv_row_bytes;
  TilePlan p;
  // K/V rows prefetched a key block ahead where a head's K and V come from memory: they outgrow L2,
  // and all heads' outgrow the last-level cache (unknown sizes: never). The score tiles read several
  // keys' rows interleaved, an order the hardware prefetchers follow badly.
  p.prefetch_kv = forced(o.tile_prefetch) ? o.tile_prefetch == 1
                                          : l2 > 0 && head_kv > l2 && head_kv >= llc / std::max<int64_t>(1, f.kv_heads);
  // Interleaved K/V heads read by many query blocks are copied head by head into a per-thread buffer
  // (which the hardware prefetchers then follow), when the copies fit half the last-level cache.
  p.pack_heads =
      f.interleaved && !f.weights &&
      (forced(o.pack_heads) ? o.pack_heads == 1
                            : f.q_blocks >= kPackMinQueryBlocks && llc > 0 && head_kv * f.threads <= llc / 2);
  p.pairs = f.interleaved && f.group == 1 && !p.pack_heads;
  // Heads that share K and V (a GQA group) go through the key blocks together, each block then read
  // from memory (and converted from 16 bits) once per group: as many as put their query blocks and
  // states in half of L2 next to the key blocks; neighbouring interleaved heads in pairs.
  const int64_t tile_group = p.pairs ? f.num_heads : f.group;
  if (!f.weights && tile_group > 1 && o.group_heads != 1) {
    int64_t most = std::min(tile_group, o.group_heads);
    if (!forced(o.group_heads)) {
      const int64_t fit = l2 > 0 ? std::max<int64_t>(1, l2 / 2 / f.head_state_bytes) : kMaxGroupTileHeads;
      most = std::min({tile_group, p.pairs ? kNeighbourHeads : kMaxGroupTileHeads, fit});
    }
    p.group_heads = ceil_div(tile_group, ceil_div(tile_group, most));  // sub-groups of even size
    // A group tile converts a 16-bit block once for its heads, which then read it from L1: its rows
    // come from beyond L2 whenever a head's rows outgrow L2, from the L3 too.
    if (!p.pairs && f.half_kv && !forced(o.tile_prefetch)) p.prefetch_kv = l2 > 0 && head_kv > l2;
  }
  // Many small heads that together outgrow what stays cached (a large batch of short sequences) come
  // from memory in pieces too short for the prefetchers: each item then prefetches its thread's next
  // item, unless K/V rows are prefetched already or an item's rows would take more than half of L2.
  const int64_t llc_share = t.cpu.vendor == CpuVendor::amd ? kCachedLlcShareAmd : kCachedLlcShareOther;
  const int64_t cached_bytes = std::min(llc / llc_share, kCachedL2s * l2);
  const int64_t item_bytes = f.block_rows * f.q_row_bytes + std::min(f.kv_len, f.chunk_keys) * f.kv_row_bytes;
  const int64_t call_bytes = f.q_rows * f.q_row_bytes + f.kv_heads * f.kv_len * f.kv_row_bytes;
  p.prefetch_items = forced(o.tile_prefetch)
                         ? o.tile_prefetch == 2
                         : !p.prefetch_kv && l2 > 0 && call_bytes >= cached_bytes && item_bytes <= l2 / 2;
  return p;
}

DecodePlan plan_decode(const DecodeFacts& f, const Tuning& t) {
  const TuningOverride& o = t.force;
  const CpuInfo& cpu = t.cpu;
  const bool intel = cpu.vendor == CpuVendor::intel, zen5 = cpu.amd_zen5_on();
  const int64_t l2 = cpu.l2_bytes, llc = cpu.llc_bytes;
  const bool busy = f.rows_per_kv_head >= kBusyRows;
  // "From memory": K and V take at least half the last-level cache, what a call on a shared machine
  // can expect to find there.
  const bool from_memory = llc > 0 && 2 * f.kv_bytes >= llc;
  DecodePlan p;
  // Software prefetch of the K and V streams, where the hardware prefetchers alone leave the cores
  // waiting: generically where long arithmetic per K/V row (16-bit rows converted for 4+ query rows)
  // stops a core issuing loads while K/V come from memory. Intel: every K/V that outgrows the
  // threads' L2s, float32 too. Zen 5: every K/V that outgrows the last-level cache (with one stream,
  // below). int8 K/V from memory elsewhere (rows of half a 16-bit row's lines, which the hardware
  // prefetchers alone leave waiting even for one query row): into L1, one stream.
  const bool int8_rows = !intel && !zen5 && f.int8_kv && from_memory;
  bool prefetch = (busy && f.half_kv && from_memory) || int8_rows;
  if (intel) prefetch = l2 > 0 && f.kv_bytes > int64_t(std::max(f.threads, 1)) * l2;
  if (zen5) prefetch = llc > 0 && f.kv_bytes >= llc;
  p.prefetch_kv = forced(o.decode_prefetch) ? o.decode_prefetch != 0 : prefetch;
  // Into L1 (a shorter distance) on Zen 5, except for 16-bit rows that 4+ query rows share, and for
  // int8_rows; into L2 elsewhere.
  p.prefetch_to_l1 = forced(o.decode_prefetch) ? o.decode_prefetch == 1 : (zen5 && !(f.half_kv && busy)) || int8_rows;
  // Four parts of each item's keys side by side keep more lines in flight than one stream; where the
  // kernel prefetches in software the parts add nothing but cost (except on Intel), and 16-bit K/V
  // held in the caches are bound by their arithmetic, where more streams only cost. Zen 5: one stream.
  const bool one_part = zen5 || (!intel && p.prefetch_kv);
  p.streams = forced(o.decode_streams)    ? int(o.decode_streams)
              : one_part                  ? 1
              : !f.half_kv || from_memory ? kManyStreams
                                          : 1;
  // 16-bit blocks of 64 keys where 4+ query rows share each K/V row, on Zen 5.
  p.block16 = forced(o.decode_block16) ? int(o.decode_block16) : busy && zen5 ? kBlock16Long : kBlock16Short;
  // Interleaved K/V heads are read across the heads (each key's rows of all heads in turn, in address
  // order), except on Zen 5, where chunk by chunk with one prefetched stream is faster but for 16-bit
  // K/V with fewer than 4 query rows per K/V row.
  p.across_heads = forced(o.decode_across_heads) ? o.decode_across_heads == 1 : !zen5 || (f.half_kv && !busy);
  // One query row per K/V row: a block's K rows read together with the previous block's V rows, so
  // that both streams are in flight at once, on Zen 5.
  p.fuse = forced(o.decode_fuse) ? o.decode_fuse == 1 : zen5;
  return p;
}

int64_t packed_mask_limit(const Tuning& t) {
  return forced(t.force.packed_mask_limit) ? t.force.packed_mask_limit : kMaxPackedMaskBytes;
}

int64_t gemm_task_tiles(const CpuInfo& cpu, int64_t packed_bytes, int64_t tile_bytes) {
  // A weight too large to stay in L2 between tasks comes from L3 into every task's first tile: its
  // tasks then take as many rows as half of L2 holds, so that the trip is paid by more tiles.
  const int64_t l2 = cpu.l2_bytes;
  if (l2 > 0 && packed_bytes > 2 * l2) return std::max(kTilesPerTask, l2 / 2 / tile_bytes);
  return kTilesPerTask;
}

int64_t kv_storage_offset(const CpuInfo& cpu, int64_t itemsize, bool bfloat16) {
  // float32/float64 rows start on a line: a 64-byte vector load across two lines costs two. bfloat16
  // rows are read two vectors per load, which the offset splits: on a line on Zen 5.
  if (bfloat16 && cpu.amd_zen5_on()) return 0;
  return itemsize == 2 ? kHalfStorageOffset : 0;
}

}  // namespace pyattn
