// SPDX-License-Identifier: MIT
// pyattn C++ contract: the plain argument struct the binding fills, the per-ISA kernel table,
// and the driver's entry points. No pybind11 and no STL containers here, so every translation unit
// (including the per-ISA kernel objects, compiled with different flags) can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>  // _mm_prefetch
#endif

namespace pyattn {

// ceil(a / b) for a >= 0, b > 0: items of b needed to cover a.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// How K and V are stored: in the compute type T, or as 16-bit floats (IEEE half or bfloat16) that
// the decode kernel converts to float32 one block at a time.
enum class Storage : int { same = 0, f16 = 1, bf16 = 2 };

// One mask operand, addressed as data + offset[bh] + i * stride_l + j * stride_s (elements; strides
// may be 0 for broadcast axes, or negative). Boolean masks are uint8: nonzero = may attend, or,
// with true_forbids, nonzero = forbidden (torch.nn.MultiheadAttention's convention). Additive masks
// have the input dtype and are added to the scaled scores; -inf forbids.
struct MaskSlot {
  const void* data = nullptr;
  MaskKind kind = MaskKind::none;
  bool true_forbids = false;
  const int64_t* offset = nullptr;  // [batch_heads]
  int64_t stride_l = 0;
  int64_t stride_s = 0;
  // A mask as bits, 1 = may attend (boolean: true_forbids applied), filled by the driver for the
  // tile kernels when the bits fit its budget (else null): key j of row i of head bh is bit j % 64
  // of bits[bits_offset[bh] + i * bits_stride_l + j / 64]; rows are bits_words words long (bits
  // past kv_len are 0) and bits_stride_l is 0 when every query row shares one mask row.
  // An additive mask packed so has bits set where its value is not -inf, and value_bits (same layout)
  // where that value is not 0 either: a key block whose value bits are all 0 never reads the floats.
  const uint64_t* bits = nullptr;
  const uint64_t* value_bits = nullptr;
  const int64_t* bits_offset = nullptr;  // [batch_heads]
  int64_t bits_stride_l = 0;
  int64_t bits_words = 0;
  // The same bits by 32-key chunk, rows side by side, as the score tiles' select reads them (one
  // vector load gives a row vector's words for 32 keys, so a tile needs no words of its own): key j
  // of row i of head bh is bit j % 32 of lane_words[lane_offset[bh] + (j / 32) * lane_rows + i], and
  // with bits_stride_l 0, the shared row is stored kMaxTileRows times (i = 0 .. kMaxTileRows - 1).
  // Packed with bits when both fit the budget (else null).
  const uint32_t* lane_words = nullptr;
  const int64_t* lane_offset = nullptr;  // [batch_heads]
  int64_t lane_rows = 0;
};

// The most query rows one tile of the kernels holds: 4 row vectors of 16 floats (AVX-512).
constexpr int64_t kMaxTileRows = 64;

// One scaled-dot-product-attention call, flattened to (batch*heads) independent heads.
// q, k, v are addressed as base + offset[bh] + row * row_stride + column, in elements; their last
// axis is contiguous. The offsets already encode batch broadcasting and GQA (query head h reads
// key/value head h / group), so kernels never see either. The output of head bh = b * num_heads + h
// starts at out + b * out_stride_b + h * out_stride_h, rows out_stride_l apart (so a multi-head
// layer can write heads side by side, (batch, q_len, heads * value_dim)); weights, when requested,
// are C-contiguous (batch_heads, q_len, kv_len). At most two masks apply (all must allow).
template <class T>
struct AttnArgs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* out = nullptr;
  T* weights = nullptr;
  MaskSlot masks[2];

  const int64_t* q_offset = nullptr;  // [batch_heads]
  const int64_t* k_offset = nullptr;  // [batch_heads]
  const int64_t* v_offset = nullptr;  // [batch_heads]

  int64_t q_stride_l = 0;
  int64_t k_stride_s = 0;
  int64_t v_stride_s = 0;
  int64_t out_stride_b = 0;
  int64_t out_stride_h = 0;
  int64_t out_stride_l = 0;

  int64_t batch_heads = 0;
  int64_t num_heads = 1;  // heads per batch entry (for the output addressing)
  int64_t group = 1;      // consecutive query heads sharing one key/value head (GQA)
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t head_dim = 0;
  int64_t value_dim = 0;

  bool causal = false;
  int64_t causal_offset = 0;  // query i may see keys j <= i + causal_offset

  double scale = 1.0;  // multiplies q.k before the masks are added

  // KV-cache calls: per batch entry b = bh / num_heads, the filled key length and the causal offset
  // (nullptr: kv_len and causal_offset for everyone), and the storage of K and V (k and v then point
  // at uint16 data when it is not `same`).
  const int64_t* kv_lens = nullptr;
  const int64_t* causal_offsets = nullptr;
  Storage kv_storage = Storage::same;
  // Set by the driver when K and V will come from memory rather than from caches (see attention.cpp):
  // the tiles then prefetch the rows they read next, the decode kernel the rows 16 KiB ahead.
  bool prefetch_kv = false;
  // Where the decode kernel prefetches K/V rows to: L1 (prefetch_l1_once, 8 KiB ahead in each
  // stream) or L2 (prefetch_l2, 16 KiB ahead); set by the driver (decode_rules).
  bool prefetch_to_l1 = false;
  // How many parts of a work item's key range the decode kernel reads side by side, row by row in
  // turn: 1, 2 or 4 (decode.inc, decode_blocks); set by the driver (attend_decode).
  int decode_streams = 1;
  // Keys per block of the decode kernel for 16-bit K/V read in place: 32 or 64 (decode.inc,
  // decode_block; set by the driver, attend_decode).
  int decode_block16 = 32;
  // Whether the decode kernel reads a block's K rows and the previous block's V rows together, key
  // by key (decode.inc, scores_and_values), where one query row reads each K/V row stored in the
  // compute type; set by the driver (decode_rules).
  bool decode_fuse = false;

  T* out_rows(int64_t bh) const { return out + (bh / num_heads) * out_stride_b + (bh % num_heads) * out_stride_h; }
  int64_t kv_len_of(int64_t bh) const { return kv_lens ? kv_lens[bh / num_heads] : kv_len; }
  int64_t causal_offset_of(int64_t bh) const { return causal_offsets ? causal_offsets[bh / num_heads] : causal_offset; }
  // Bytes of one stored K/V element.
  int64_t kv_item_bytes() const { return kv_storage == Storage::same ? int64_t(sizeof(T)) : 2; }
  // Query rows that read each key/value head: its group's query heads times the query length.
  int64_t rows_per_kv_head() const { return group * q_len; }
};

// Decode work item: the query rows of one key/value head (all query heads of its group times the
// first `rows` of (head, position) pairs from r0), against keys [j_begin, j_end). Row r is query head
// kv_head * group + (r0 + r) / q_len at position (r0 + r) % q_len.
struct DecodeTile {
  int64_t batch;
  int64_t kv_head;
  int64_t r0;
  int64_t rows;
  int64_t j_begin;
  int64_t j_end;
};

// The running state of the online softmax for one block of query rows, laid out with query rows
// along SIMD lanes: acc is (value_dim x block_rows) i.e. transposed output, m and l are per row,
// in log2 units (scores are pre-multiplied by log2(e) so the kernel can use exp2).
template <class T>
struct RowState {
  T* acc;  // [value_dim * block_rows]
  T* m;    // [block_rows] running max of the scaled scores (log2 units); -inf = nothing seen yet
  T* l;    // [block_rows] running sum of exp2(score - m)
};

// Prefetches the cache line at p into L2. An asm statement on x86 with GCC/Clang: GCC 12 deleted the
// __builtin_prefetch / _mm_prefetch calls from the optimised tile kernels (none left in the object
// code).
inline void prefetch_l2(const void* p) {
#if defined(_MSC_VER) && !defined(__clang__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#elif defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Prefetches the cache line at p close to the core, marked as data read once (prefetchnta: AMD's
// optimisation guides place it in L1 and keep it out of L2 when it came from memory; the AMD64
// manual leaves how it limits cache pollution to each core). For rows the caller reads once, soon
// (the decode kernel's K/V streams; see decode.inc, Ahead).
inline void prefetch_l1_once(const void* p) {
#if defined(_MSC_VER) && !defined(__clang__)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
#elif defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetchnta %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 0);
#endif
}

// The rows a thread's next work item reads and writes (its query rows, key rows, value rows and
// output rows), prefetched into L2 a few lines at a time while the thread's current item runs: the
// score tiles call advance() once per step of keys (see attention.cpp for when the driver asks).
// Each thread's own updates its progress on every step: on cache lines of its own (64 bytes), not
// sharing one with the neighbouring thread's in the driver's per-thread array.
struct alignas(64) ItemPrefetch {
  struct Rows {
    const char* base = nullptr;
    int64_t rows = 0, stride = 0, lines = 0;  // stride in bytes; lines (64 bytes) per row
  };
  static constexpr int kParts = 4;
  Rows part[kParts];
  int64_t lines_per_key = 0;  // lines issued per key of the current item (set by start)
  int at = kParts;            // the part being prefetched (kParts: all issued)
  int64_t row = 0, line = 0;
  void start(int64_t current_keys) {
    int64_t total = 0;
    for (const Rows& r : part) total += r.rows * r.lines;
    // Spread evenly over the current item's keys (B = 64 x 12 heads x 64 x 64, one thread: 66 -> 83
    // GFLOP/s); issued within the first half or quarter of them, 81 and 75; all at the item's start,
    // 68: the core stalls once the misses in flight fill its queues.
    lines_per_key = current_keys > 0 ? (total + current_keys - 1) / current_keys : total;
    if (lines_per_key < 1) lines_per_key = 1;
    at = 0;
    row = line = 0;
  }
  // Issues the lines of `keys` keys' worth.
  void advance(int64_t keys) { issue(keys * lines_per_key); }
  void issue(int64_t n) {
    while (n > 0 && at < kParts) {
      const Rows& r = part[at];
      if (row >= r.rows) {
        ++at;
        row = line = 0;
        continue;
      }
      prefetch_l2(r.base + row * r.stride + line * 64);
      --n;
      if (++line == r.lines) {
        line = 0;
        ++row;
      }
    }
  }
  void finish() { issue(INT64_MAX); }
};

// Per-thread working memory of one kernel invocation; sizes come from KernelSet::scratch_elems.
template <class T>
struct Scratch {
  T* qt;      // [head_dim * block_rows]      query block, transposed and pre-scaled
  T* st;      // [key_block * block_rows]     scores, then probabilities, transposed
  RowState<T> state;
  T* kv = nullptr;  // [key_block * (head_dim + value_dim)] one K and one V block converted from 16 bits
  ItemPrefetch* next_item = nullptr;  // what to prefetch for the thread's next item, or null
};

// Most heads of one GQA group that a group tile (KernelSet::attend_group) takes together.
constexpr int64_t kMaxGroupTileHeads = 8;

// Work item: query rows [i0, i0 + rows) of head bh against keys [j_begin, j_end).
struct Tile {
  int64_t bh;
  int64_t i0;
  int64_t rows;
  int64_t j_begin;
  int64_t j_end;
};

// C[m, n] = bias[n] + sum_k A[m, k] * W[n, k] (a linear layer, W in PyTorch's (out, in) layout),
// with W pre-packed into panels of `panel` output columns: packed[p][k][c] = W[p*panel + c][k]
// (zero beyond n), see pack_weights. A and C rows are strided, so C can be a column slice of a
// wider buffer (e.g. the Q part of a fused QKV projection). Instead of `packed`, W itself may be
// given (`w`, rows w_stride apart): then each task of linear() packs the panels it computes into
// its thread's scratch first (a one-off call: pyattn.mha), with the same results.
template <class T>
struct GemmArgs {
  const T* a = nullptr;
  int64_t a_stride = 0;
  const T* packed = nullptr;  // [panels][k][panel]
  const T* w = nullptr;       // [n][w_stride], when packed is null
  int64_t w_stride = 0;
  const T* bias = nullptr;    // [n] or nullptr
  T* c = nullptr;
  int64_t c_stride = 0;
  int64_t m = 0, n = 0, k = 0;
};

// Kernels of one ISA for one dtype. Single-threaded, allocation-free, no exceptions.
template <class T>
struct KernelSet {
  int lanes;           // SIMD width in elements of T
  int row_vecs;        // most query-row vectors per register tile: block_rows = lanes * (1 .. row_vecs)
  // Keys processed per online-softmax step for a given block_rows.
  int64_t (*key_block)(int64_t block_rows);
  // Online-softmax attention of one tile into `s.state` (which it initialises).
  // block_rows is lanes * rv, rv in 1 .. row_vecs (the caller picks the fewest that hold t.rows).
  void (*attend)(const AttnArgs<T>& a, const Tile& t, int64_t block_rows, Scratch<T>& s);
  // The same for the query rows of t.i0 .. of heads t.bh .. t.bh + heads - 1 (1 .. kMaxGroupTileHeads,
  // sharing K and V: a GQA group), key block by key block, into s[h].state; s[h].st and s[h].kv may
  // be shared (s[0].kv holds the converted 16-bit rows for all heads).
  void (*attend_group)(const AttnArgs<T>& a, const Tile& t, int64_t heads, int64_t block_rows, Scratch<T>* s);
  // Writes normalised softmax weights of the tile's rows for all keys, from the final state.
  void (*write_weights)(const AttnArgs<T>& a, const Tile& t, int64_t block_rows, Scratch<T>& s);
  // Normalised output rows (out + i * out_stride) of a finished tile state: acc / l, zeros if l == 0.
  void (*finalize)(const RowState<T>& s, int64_t block_rows, int64_t rows, int64_t value_dim, T* out, int64_t out_stride);
  // Few-query-row attention (decode): lanes along head_dim, K/V blocks converted to T once. State:
  // acc rows x value_dim_padded (row-major), m and l per row, in `state`; scratch from decode_scratch.
  void (*decode)(const AttnArgs<T>& a, const DecodeTile& t, int64_t group, T* scratch, RowState<T> state);
  // Every key/value head of one batch entry over keys [j_begin, j_end), K and V read in address order
  // (heads that interleave in memory, rows of whole vectors): state h for head h, each of `rows`
  // (its GQA group x q_len) query rows; scratch from decode_heads_scratch; local: heads RowStates and
  // offsets: 2 * heads elements of scratch.
  void (*decode_heads)(const AttnArgs<T>& a, int64_t batch, int64_t rows, int64_t group, int64_t j_begin, int64_t j_end,
                       T* scratch, const RowState<T>* states, RowState<T>* local, int64_t* offsets);
  int64_t (*decode_heads_scratch)(int64_t heads, int64_t rows, int64_t head_dim, int64_t value_dim);
  int64_t decode_heads_block;  // decode_heads' keys per block
  int64_t (*decode_scratch)(int64_t rows, int64_t head_dim, int64_t value_dim);
  int64_t (*decode_padded)(int64_t dim);  // value_dim rounded up to whole vectors (acc row length)
  int64_t decode_block;  // the decode kernel's longest key block (split key chunks are whole blocks)
  int gemm_rows;    // rows of the GEMM register tile
  int gemm_panel;   // output columns per packed weight panel
  // C rows [row_begin, row_end) x columns of panels [p_begin, p_end).
  void (*gemm)(const GemmArgs<T>& g, int64_t row_begin, int64_t row_end, int64_t p_begin, int64_t p_end);
  // Panel p of a (n, k) weight (rows w_stride apart) packed for gemm: packed + p * k * gemm_panel.
  void (*pack_panel)(const T* w, int64_t w_stride, int64_t n, int64_t k, int64_t p, T* packed);
  // Additive mask rows to MaskSlot::bits (not -inf) and MaskSlot::value_bits (a value to add): `rows`
  // rows of kv_len values (element (i, j) at data[i * stride_l + j * stride_s]) into
  // ceil(kv_len / 64) words per row each.
  void (*pack_additive)(const T* data, int64_t stride_l, int64_t stride_s, int64_t rows, int64_t kv_len, uint64_t* bits,
                        uint64_t* value_bits);
};

struct KernelTable {
  const char* name;
  KernelSet<float> f32;
  KernelSet<double> f64;
  // Machine ceilings for the benchmark (machine.cpp): a register-only FMA loop (returns flops done),
  // and the XOR of `bytes` bytes read with this ISA's widest loads.
  double (*fma_loop)(int64_t iterations);
  uint64_t (*xor_bytes)(const unsigned char* p, int64_t bytes);
  // Boolean mask rows to bits for MaskSlot::bits: `rows` rows of kv_len bytes (element (i, j) at
  // data[i * stride_l + j * stride_s]) into words_per_row = ceil(kv_len / 64) words each.
  void (*pack_mask)(const uint8_t* data, int64_t stride_l, int64_t stride_s, bool true_forbids, int64_t rows,
                    int64_t kv_len, uint64_t* out);
  // n float16 bit patterns to float32 and back (round to nearest even), exactly as IEEE 754 says.
  void (*half_to_float)(const uint16_t* src, float* dst, int64_t n);
  void (*float_to_half)(const float* src, uint16_t* dst, int64_t n);
  // n bfloat16 bit patterns to float32 (exact) and back (rounded as ml_dtypes rounds: to nearest
  // even, NaN to the quiet NaN of its sign).
  void (*bf16_to_float)(const uint16_t* src, float* dst, int64_t n);
  void (*float_to_bf16)(const float* src, uint16_t* dst, int64_t n);
};

// Per-ISA tables (defined in kernels_<isa>.cpp).
namespace generic { const KernelTable& kernel_table(); }
#if defined(PYATTN_HAVE_AVX2)
namespace avx2 { const KernelTable& kernel_table(); }
#endif
#if defined(PYATTN_HAVE_AVX512)
namespace avx512 { const KernelTable& kernel_table(); }
#endif

// dispatch.cpp
const KernelTable& active_kernels();

// The active ISA's kernels for dtype T.
template <class T>
const KernelSet<T>& active_set();
template <>
inline const KernelSet<float>& active_set<float>() { return active_kernels().f32; }
template <>
inline const KernelSet<double>& active_set<double>() { return active_kernels().f64; }
const char* active_isa();
// Names compiled into this build and supported by this CPU, best last; returns the count.
int available_isas(const char** names, int capacity);
// Forces an ISA by name; returns false (and leaves the current choice) if unknown or unsupported.
bool set_isa(const char* name);
bool cpu_supports(const char* name);
// Bytes of the level-1, -2 or -3 data cache one core uses (CPUID), 0 where the CPU does not say.
int64_t cache_bytes(int level);
// CPUID's vendor string ("GenuineIntel", "AuthenticAMD", ...), "" off x86.
const char* cpu_vendor();
// CPUID's display family (base + extended: 0x19 for AMD Zen 3/4, 0x1A for Zen 5, 6 for Intel cores), 0 off x86.
int cpu_family();
// An Intel core (CPUID vendor "GenuineIntel"), which has decode rules and a bfloat16 KVCache
// placement of its own (attention.cpp decode_rules, _cache.py).
bool cpu_is_intel();
// An AMD core of family 1Ah or later (Zen 5 on), which has per-core rules of its own (attention.cpp
// decode_rules, the KVCache's bfloat16 placement in _cache.py).
bool cpu_is_amd_zen5_on();
bool isa_compiled(const char* name);

// attention.cpp: the driver (task split, scratch, merges; its parallel loops are parallel.h's).
template <class T>
void scaled_dot_product_attention(const AttnArgs<T>& a, int num_threads);
// Query rows per head at or below which the driver runs the decode kernel (lanes along head_dim, a
// GQA group's rows sharing every K/V load, the key range split across threads) instead of query
// tiles (lanes along query rows). Measured on Zen 4, 2 threads, 32 query heads, head_dim 128,
// lower-right causal: for 5-8 rows the decode kernel is 1.2-2.2x faster than one-vector tiles with
// 8 or 32 key/value heads and 16-4096 keys, on AVX-512 (16-row tiles, mostly padding) and AVX2
// (8-row tiles, no padding at 8) alike; at 12 rows and 4096 keys the two are level, at 16 the
// tiles lead by 5-30%. Python reads it as _core.DECODE_MAX_Q_LEN (which 16-bit K/V it can pass
// without float32 copies).
constexpr int64_t kDecodeMaxLen = 8;
// Registers the handler that makes a child forked after a parallel region run single-threaded
// (ForkGuard, parallel.h); called once, when the module loads.
void install_fork_guard();
int default_num_threads();
void set_default_num_threads(int n);  // 0 = unset (OpenMP default)
// Largest packed copy of a boolean mask the driver makes, in bytes (tests set 0 to force the kernels
// to read mask bytes); returns the previous value. A negative count throws std::invalid_argument
// and leaves the limit as it was.
int64_t set_packed_mask_limit(int64_t bytes);
// The switches from here to set_decode_prefetch_level take only the values each lists (any other
// throws std::invalid_argument, leaving the setting as it was).
// Whether the tiles prefetch: -1 decided per call from the cache sizes (attention.cpp), 0 never,
// 1 always the next key block's K/V rows (AttnArgs::prefetch_kv), 2 always the next work item's
// rows (Scratch::next_item); tests force each. Returns the previous mode.
int set_prefetch(int mode);
// Whether the query tiles take a GQA group's heads together (KernelSet::attend_group; 1, the
// default) or head by head (0, for tests). Returns the previous setting.
int set_group_tiles(int on);
// Whether the query tiles copy the rows of K/V heads that interleave in memory into a per-thread
// buffer, head by head (attention.cpp, pack_heads): -1 decided per call from the sizes (the
// default), 0 never, 1 whenever they interleave (tests). Returns the previous setting.
int set_pack_heads(int mode);
// Whether decode calls over K/V whose heads interleave in memory read every head of a key block in
// turn (attention.cpp, attend_decode_heads): -1 by the driver's rule (the default: wherever they
// interleave, on Zen 5 only for 16-bit K/V with fewer than 4 query rows per K/V row), 0 never (head
// by head, chunk by chunk across the heads), 1 wherever they interleave. Returns the previous setting.
int set_decode_heads(int mode);
// How many parts of a work item's keys the decode kernel reads side by side: -1 decided per call
// (attend_decode, the default), or 1, 2 or 4 always (tests and measurements). Returns the previous
// setting.
int set_decode_streams(int streams);
// Keys per block of the decode kernel for 16-bit K/V: -1 decided per call (attend_decode, the
// default), or 32 or 64 always (tests and measurements). Returns the previous setting.
int set_decode_block16(int keys);
// Whether the decode kernel reads a block's K rows together with the previous block's V rows, key by
// key, where it can (decode.inc, scores_and_values): -1 decided per call (decode_rules, the default),
// 0 never, 1 wherever it can (tests and measurements). Returns the previous setting.
int set_decode_fuse(int mode);
// Where the decode kernel's software prefetches put K/V rows, when it prefetches: -1 decided per call
// (decode_rules, the default), 1 L1 or 2 L2 always (tests and measurements). Returns the previous
// setting.
int set_decode_prefetch_level(int level);
bool openmp_enabled();
const char* openmp_runtime();

// One projection of a multi-head attention layer: its weight packed by pack_weights for the active
// ISA (MultiHeadAttention packs once), or the (out_features, in_features) weight itself, rows
// w_stride apart (pyattn.mha: packed per GEMM task, see GemmArgs); a null bias adds nothing.
template <class T>
struct Projection {
  const T* packed = nullptr;
  const T* w = nullptr;
  int64_t w_stride = 0;
  const T* bias = nullptr;
};

template <class T>
struct LayerWeights {
  Projection<T> q, k, v, o;
};

// One multi-head attention layer (inference), batch-first: three projections, attention, output
// projection, in one call. Inputs are row matrices (batch * len, features) with a row stride; weights
// are packed by pack_weights for the active ISA (W in (out_features, in_features) layout), biases may
// be null. Query head h uses key/value head h / (num_heads / num_kv_heads). Mask offsets are per
// (batch * num_heads + h). `out` is C-contiguous (batch * q_len, embed_dim); `weights`, when not
// null, C-contiguous (batch, num_heads, q_len, kv_len).
template <class T>
struct MhaArgs {
  const T* xq = nullptr;
  const T* xk = nullptr;
  const T* xv = nullptr;
  int64_t xq_stride = 0, xk_stride = 0, xv_stride = 0;
  int64_t batch = 0, q_len = 0, kv_len = 0;
  int64_t embed_dim = 0, kdim = 0, vdim = 0;
  int64_t num_heads = 1, num_kv_heads = 1, head_dim = 0;
  LayerWeights<T> proj;  // the projections' packed weights and biases
  MaskSlot masks[2];
  bool causal = false;
  int64_t causal_offset = 0;
  T* out = nullptr;
  T* weights = nullptr;
};

// One step of a self-attention layer over a KV cache (MultiHeadAttention(..., kv_cache=)): the
// chunk's rows x (batch * chunk, embed_dim) are projected to Q, K and V; row b's real tokens (the
// first or, left_padded, the last lengths_after[b] - lengths_before[b] of its chunk) have their K/V
// written into the cache at positions lengths_before[b].. (converted to 16 bits for such storage);
// the chunk's queries attend to each row's first lengths_after[b] keys with lower-right causal
// alignment (query i sees keys j <= i + lengths_before[b] - first[b], first[b] = the padding tokens
// in front of row b's real ones); the output projection writes `out` (batch * chunk, embed_dim). The
// cache is (batch, num_kv_heads, max_len, head_dim) for K and V alike, element strides cache_stride_*
// (last axis contiguous); k_cache/v_cache hold uint16 bit patterns when storage is not `same`.
template <class T>
struct MhaCacheArgs {
  const T* x = nullptr;
  int64_t x_stride = 0;
  int64_t batch = 0, chunk = 0;
  int64_t embed_dim = 0, num_heads = 1, num_kv_heads = 1, head_dim = 0;
  LayerWeights<T> proj;  // the projections' packed weights and biases
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  Storage storage = Storage::same;
  int64_t cache_stride_b = 0, cache_stride_h = 0, cache_stride_s = 0;
  const int64_t* lengths_before = nullptr;  // [batch]
  const int64_t* lengths_after = nullptr;   // [batch]
  bool left_padded = false;
  T* out = nullptr;
};

// mha.cpp
template <class T>
void multi_head_attention(const MhaArgs<T>& m, int num_threads);
template <class T>
void multi_head_attention_cached(const MhaCacheArgs<T>& m, int num_threads);

// gemm.cpp: packing and the threaded GEMM driver.
template <class T>
void pack_weights(const KernelSet<T>& ks, const T* w, int64_t w_stride, int64_t n, int64_t k, T* packed);
template <class T>
void linear(const GemmArgs<T>& g, int num_threads);

// attention.cpp: float16 <-> float32 conversion of n elements with the active ISA's kernels, split
// across threads (NumPy's astype converts float16 one element at a time: ~2-3 ms per million
// elements here).
// bfloat16: the same with bfloat16 bits instead of float16 ones (ml_dtypes' astype: ~1.3-1.5 ms per
// million elements here).
void convert_half(const uint16_t* src, float* dst, int64_t n, int num_threads, bool bfloat16 = false);
void convert_half(const float* src, uint16_t* dst, int64_t n, int num_threads, bool bfloat16 = false);

// machine.cpp: the ceilings the benchmarks quote. GFLOP/s of the active ISA's FMA loop on
// num_threads threads for `seconds`; GB/s of reading a fresh nbytes buffer (best of 5 passes); GB/s
// of reading every byte of the given buffers once (best of `repeats` passes).
double fma_peak_gflops(int num_threads, double seconds);
double read_bandwidth_gbs(int num_threads, int64_t nbytes);
double read_buffers_gbs(const std::vector<std::pair<const void*, int64_t>>& buffers, int num_threads, int repeats);

}  // namespace pyattn
