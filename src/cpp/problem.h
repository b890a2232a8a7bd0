// SPDX-License-Identifier: MIT
// The shared types of the C++ core: the problem description the binding fills (AttnArgs, MaskSlot,
// GemmArgs, the multi-head layer's arguments), the plans the tuning module makes for it (TilePlan,
// DecodePlan), the work items and running state the driver hands the kernels (Tile, DecodeTile,
// RowState, Scratch), and the per-ISA kernel table (KernelSet, KernelTable). Types only: no .cpp of
// its own, no pybind11 and no STL containers, so every translation unit (the per-ISA kernel objects
// too, compiled with different flags) can include it, and every other header depends on it, never
// the other way round.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyattn {

// ceil(a / b) for a >= 0, b > 0: items of b needed to cover a.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// How K and V are stored: in the compute type T, as 16-bit floats (IEEE half or bfloat16), or as
// int8 with one float32 scale per row (a token of one head: x = scale * q); the kernels convert the
// last three to float32 a block at a time.
enum class Storage : int { same = 0, f16 = 1, bf16 = 2, i8 = 3 };

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
  // The mask as bits, 1 = may attend (boolean: true_forbids applied), filled by the driver
  // (mask_pack.cpp) when they fit its budget, else null: key j of row i of head bh is bit j % 64 of
  // bits[bits_offset[bh] + i * bits_stride_l + j / 64]; rows are bits_words words long (bits past
  // kv_len are 0) and bits_stride_l is 0 when every query row shares one mask row. An additive mask
  // has bits set where its value is not -inf, and value_bits (same layout) where that value is not
  // 0 either: a key block whose value bits are all 0 never reads the floats.
  const uint64_t* bits = nullptr;
  const uint64_t* value_bits = nullptr;
  const int64_t* bits_offset = nullptr;  // [batch_heads]
  int64_t bits_stride_l = 0;
  int64_t bits_words = 0;
  // The same bits by 32-key chunk, rows side by side, as the score tiles' select reads them (one
  // vector load gives a row vector's words for 32 keys): key j of row i of head bh is bit j % 32 of
  // lane_words[lane_offset[bh] + (j / 32) * lane_rows + i]; with bits_stride_l 0 the shared row is
  // stored kMaxTileRows times. Packed with bits when both fit the budget, else null.
  const uint32_t* lane_words = nullptr;
  const int64_t* lane_offset = nullptr;  // [batch_heads]
  int64_t lane_rows = 0;
};

// The most query rows one tile of the kernels holds: 4 row vectors of 16 floats (AVX-512).
constexpr int64_t kMaxTileRows = 64;

// One scaled-dot-product-attention call, flattened to (batch*heads) independent heads: the problem
// only, never how it is run (the plans below carry that).
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

  // The band of keys each query row may see. Row i's diagonal is key i + diagonal_of(bh) (the causal
  // alignment: S - L for lower_right and the KV cache, 0 otherwise). With `causal`, keys past
  // i + causal_offset_of(bh) = the diagonal + upper_shift are forbidden (a causal call: upper_shift
  // 0; a window's right side without causal: its width); with `windowed`, keys before
  // i + window_offset_of(bh) = the diagonal - window_left are.
  bool causal = false;
  int64_t causal_offset = 0;  // the diagonal of every batch entry when causal_offsets is null
  int64_t upper_shift = 0;
  bool windowed = false;
  int64_t window_left = 0;

  double scale = 1.0;  // multiplies q.k before the masks are added

  // The score transforms and the sink of today's models (score_mods.inc), in natural units; each
  // scaled score s becomes softcap * tanh(s / softcap) (softcap > 0), then
  // s - alibi_slopes[bh] * |i + diagonal_of(bh) - j|, before the masks are added; sinks[bh] is one
  // more logit in every softmax denominator of head bh, with no value row. Null: not used.
  double softcap = 0.0;
  const double* alibi_slopes = nullptr;  // [batch_heads]
  const double* sinks = nullptr;         // [batch_heads]

  // return_lse: row i of head bh gets the natural log of its softmax denominator (the sink's term
  // included), lse[bh * lse_stride_bh + i]; -inf for a row without an allowed key. Null: not asked.
  T* lse = nullptr;
  int64_t lse_stride_bh = 0;

  // KV-cache calls: per batch entry b = bh / num_heads, the filled key length and the causal offset
  // (nullptr: kv_len and causal_offset for everyone), and the storage of K and V (k and v then point
  // at uint16 data when it is not `same`).
  const int64_t* kv_lens = nullptr;
  const int64_t* causal_offsets = nullptr;
  Storage kv_storage = Storage::same;
  // Precision "fast": 16-bit K/V may go through bfloat16 dot products (float32 accumulation, the
  // softmax weights rounded to bfloat16 for P.V) where the kernels have them (tile_pairs.inc);
  // false: float32 products throughout.
  bool bf16_dots = false;
  // int8 storage: the scale of the K row at element offset o (a row's start) is k_scales[o /
  // k_stride_s], and likewise for V; a cache's (batch, heads, max_len) scales for its rows.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;

  T* out_rows(int64_t bh) const { return out + (bh / num_heads) * out_stride_b + (bh % num_heads) * out_stride_h; }
  int64_t kv_len_of(int64_t bh) const { return kv_lens ? kv_lens[bh / num_heads] : kv_len; }
  int64_t diagonal_of(int64_t bh) const { return causal_offsets ? causal_offsets[bh / num_heads] : causal_offset; }
  int64_t causal_offset_of(int64_t bh) const { return diagonal_of(bh) + upper_shift; }
  int64_t window_offset_of(int64_t bh) const { return diagonal_of(bh) - window_left; }
  // Whether scores are transformed (softcap, ALiBi) or rows carry a sink.
  bool mods_scores() const { return softcap > 0 || alibi_slopes != nullptr; }
  bool has_variants() const { return mods_scores() || sinks != nullptr || windowed || upper_shift != 0; }
  T* lse_rows(int64_t bh) const { return lse + bh * lse_stride_bh; }
  // Bytes of one stored K/V element.
  int64_t kv_item_bytes() const {
    return kv_storage == Storage::same ? int64_t(sizeof(T)) : kv_storage == Storage::i8 ? 1 : 2;
  }
  // The scales of head bh's K (V) rows from key 0 on, or null when the storage has none.
  const float* k_scales_of(int64_t bh) const { return k_scales ? k_scales + k_offset[bh] / k_stride_s : nullptr; }
  const float* v_scales_of(int64_t bh) const { return v_scales ? v_scales + v_offset[bh] / v_stride_s : nullptr; }
  // Query rows that read each key/value head: its group's query heads times the query length.
  int64_t rows_per_kv_head() const { return group * q_len; }
  // Whether the rows of consecutive key/value heads interleave in memory: a (batch, seq, heads,
  // head_dim) array viewed heads first, each head's row head_dim elements out of every heads * head_dim.
  bool kv_heads_interleave() const {
    if (num_heads <= group) return false;  // one key/value head per batch entry
    const int64_t dk = k_offset[group] - k_offset[0], dv = v_offset[group] - v_offset[0];
    return (dk < 0 ? -dk : dk) < k_stride_s && (dv < 0 ? -dv : dv) < v_stride_s;
  }
  // Multiply-adds of the whole call (a causal call does about half), for the thread count.
  double fmas() const { return double(batch_heads) * double(q_len) * double(kv_len) * double(head_dim + value_dim); }
};

// The variant options of a call (window, softcap, sinks, ALiBi) as the layer entries carry them to
// their attention stage; the arrays (per batch * num_heads) belong to the caller.
struct VariantOptions {
  bool has_left = false, has_right = false;  // window sides; absent: unbounded
  int64_t left = 0, right = 0;
  double softcap = 0.0;
  const double* sinks = nullptr;
  const double* slopes = nullptr;

  // Into a, for a call whose diagonal is d(i) = i + diagonal (with `causal`: its upper limit).
  template <class T>
  void apply(AttnArgs<T>& a, bool causal, int64_t diagonal) const {
    a.causal = causal || has_right;
    a.causal_offset = diagonal;
    a.upper_shift = causal || !has_right ? 0 : right;
    a.windowed = has_left;
    a.window_left = has_left ? left : 0;
    a.softcap = softcap;
    a.sinks = sinks;
    a.alibi_slopes = slopes;
  }
};

// How the query tiles run one call, beside its AttnArgs (tuning.cpp, plan_tiles).
struct TilePlan {
  bool prefetch_kv = false;     // the score tiles prefetch the next key block's K/V rows into L2
  bool prefetch_items = false;  // each work item prefetches its thread's next item's rows into L2
  bool pack_heads = false;      // K/V heads that interleave in memory are copied head by head first
  bool pairs = false;           // neighbouring heads with interleaved K/V of their own share tiles
  int64_t group_heads = 1;      // heads per tile (a GQA group's, or pairs'); 1: head by head
};

// How the decode kernel reads K and V for one call, beside its AttnArgs (tuning.cpp, plan_decode).
struct DecodePlan {
  bool prefetch_kv = false;     // software prefetch of the K and V streams ahead of the reads
  bool prefetch_to_l1 = false;  // ... into L1 (a shorter distance) instead of L2
  int streams = 1;              // parts of a work item's key range read side by side: 1, 2 or 4
  int block16 = 32;             // keys per block for 16-bit K/V read in place: 32 or 64
  bool across_heads = true;     // K/V heads that interleave in memory are read across the heads
  bool fuse = false;            // one query row per K/V row: a block's K rows read with the last one's V
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
  bool first = true;  // the first of its rows' key chunks: the rows start from their sinks here
};

// The running state of the online softmax for one block of query rows, in log2 units (scores are
// pre-multiplied by log2(e) so the kernels can use exp2). The tile kernels keep query rows along SIMD
// lanes (acc is value_dim x block_rows, the output transposed); the decode kernel keeps them in rows
// (acc is rows x value_dim rounded up to whole vectors).
template <class T>
struct RowState {
  T* acc;
  T* m;  // [rows] running max of the scaled scores (log2 units); -inf = nothing seen yet
  T* l;  // [rows] running sum of exp2(score - m)
};

struct ItemPrefetch;  // prefetch.h

// Per-thread working memory of one tile; sizes come from KernelSet::key_block and the driver.
template <class T>
struct Scratch {
  T* qt;  // [head_dim * block_rows]      query block, transposed and pre-scaled
  T* st;  // [key_block * block_rows]     scores, then probabilities, transposed
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
// bfloat16 layers (float32 C and bias; only where KernelTable::bf16_dots): A as bfloat16 rows (a16,
// a_stride apart) and W packed in pairs of k (packed16[p][k2][c] = W[p*panel + c][2 k2] | W[..][2 k2 +
// 1] << 16, ceil(k / 2) pairs, an odd k's last pair with 0, see pack_weights16) instead of a and packed.
template <class T>
struct GemmArgs {
  const T* a = nullptr;
  int64_t a_stride = 0;
  const T* packed = nullptr;  // [panels][k][panel]
  const T* w = nullptr;       // [n][w_stride], when packed is null
  int64_t w_stride = 0;
  const T* bias = nullptr;  // [n] or nullptr
  T* c = nullptr;
  int64_t c_stride = 0;
  int64_t m = 0, n = 0, k = 0;
  const uint16_t* a16 = nullptr;
  const uint32_t* packed16 = nullptr;  // [panels][ceil(k / 2)][panel]
};

// pyattn.merge_attention_states: P partial results of the same rows over disjoint key sets, each
// with its rows' log-sum-exp, merged exactly: out_i = sum_p w_p out_p,i / W with w_p = e^(lse_p,i - M),
// W = sum_p w_p (+ e^(sink - M)), lse_i = M + ln W, M the largest of the lse_p,i (and the sink). Rows
// are value_dim apart in every output; part p's rows start at outs[p], its lses at lses[p]. Row i's
// sink, when sinks is not null, is sinks[(i / q_len) % heads] (rows ordered (..., head, query)).
template <class T>
struct MergeArgs {
  const T* const* outs = nullptr;  // [parts]
  const T* const* lses = nullptr;  // [parts]
  int64_t parts = 0, rows = 0, value_dim = 0;
  const double* sinks = nullptr;
  int64_t heads = 1, q_len = 1;
  T* out = nullptr;
  T* lse = nullptr;
};

// Kernels of one ISA for one dtype. Single-threaded, allocation-free, no exceptions.
template <class T>
struct KernelSet {
  int lanes;     // SIMD width in elements of T
  int row_vecs;  // most query-row vectors per register tile: block_rows = lanes * (1 .. row_vecs)
  // Keys processed per online-softmax step for a given block_rows.
  int64_t (*key_block)(int64_t block_rows);
  // Online-softmax attention of one tile into `s.state` (which it initialises).
  // block_rows is lanes * rv, rv in 1 .. row_vecs (the caller picks the fewest that hold t.rows).
  void (*attend)(const AttnArgs<T>& a, const TilePlan& p, const Tile& t, int64_t block_rows, Scratch<T>& s);
  // The same for the query rows of t.i0 .. of heads t.bh .. t.bh + heads - 1 (1 .. kMaxGroupTileHeads,
  // sharing K and V: a GQA group, or neighbours), key block by key block, into s[h].state; s[h].st
  // and s[h].kv may be shared (s[0].kv holds the converted 16-bit rows for all heads).
  void (*attend_group)(const AttnArgs<T>& a, const TilePlan& p, const Tile& t, int64_t heads, int64_t block_rows,
                       Scratch<T>* s);
  // Writes normalised softmax weights of the tile's rows for all keys, from the final state.
  void (*write_weights)(const AttnArgs<T>& a, const Tile& t, int64_t block_rows, Scratch<T>& s);
  // Normalised output rows (out + i * out_stride) of a finished tile state: acc / l, zeros if l == 0.
  void (*finalize)(const RowState<T>& s, int64_t block_rows, int64_t rows, int64_t value_dim, T* out,
                   int64_t out_stride);
  // Few-query-row attention (decode): lanes along head_dim, K/V blocks converted to T once. State:
  // acc rows x value_dim_padded (row-major), m and l per row, in `state`; scratch from decode_scratch.
  void (*decode)(const AttnArgs<T>& a, const DecodePlan& p, const DecodeTile& t, int64_t group, T* scratch,
                 RowState<T> state);
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
  int64_t decode_block;                   // the decode kernel's longest key block (split key chunks are whole blocks)
  int gemm_rows;                          // rows of the GEMM register tile
  int gemm_panel;                         // output columns per packed weight panel
  // C rows [row_begin, row_end) x columns of panels [p_begin, p_end).
  void (*gemm)(const GemmArgs<T>& g, int64_t row_begin, int64_t row_end, int64_t p_begin, int64_t p_end);
  // Panel p of a (n, k) weight (rows w_stride apart) packed for gemm: packed + p * k * gemm_panel.
  void (*pack_panel)(const T* w, int64_t w_stride, int64_t n, int64_t k, int64_t p, T* packed);
  // Additive mask rows to MaskSlot::bits (not -inf) and MaskSlot::value_bits (a value to add): `rows`
  // rows of kv_len values (element (i, j) at data[i * stride_l + j * stride_s]) into
  // ceil(kv_len / 64) words per row each.
  void (*pack_additive)(const T* data, int64_t stride_l, int64_t stride_s, int64_t rows, int64_t kv_len, uint64_t* bits,
                        uint64_t* value_bits);
  // Rows [row_begin, row_end) of a merge of partial results (MergeArgs).
  void (*merge_states)(const MergeArgs<T>& m, int64_t row_begin, int64_t row_end);
};

struct KernelTable {
  const char* name;
  KernelSet<float> f32;
  KernelSet<double> f64;
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
  // Whether f32.attend takes AttnArgs::bf16_dots (16-bit K/V in bfloat16 dot products).
  bool bf16_dots;
};

// One projection of a multi-head attention layer: its weight packed by pack_weights for the active
// ISA (MultiHeadAttention packs once), or the (out_features, in_features) weight itself, rows
// w_stride apart (pyattn.mha: packed per GEMM task, see GemmArgs); a null bias adds nothing.
template <class T>
struct Projection {
  const T* packed = nullptr;
  const T* w = nullptr;
  int64_t w_stride = 0;
  const T* bias = nullptr;
  const uint32_t* packed16 = nullptr;  // a bfloat16 layer's weight in pairs (GemmArgs::packed16)
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
// null, C-contiguous (batch, num_heads, q_len, kv_len). A bfloat16 layer (bf16, T = float): xq, xk and
// xv point at bfloat16 rows (strides in their elements), the projections are packed16, and the
// attention's output is rounded to bfloat16 for the output projection; Q/K/V, the attention, out and
// weights stay float32.
template <class T>
struct MhaArgs {
  bool bf16 = false;
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
  VariantOptions variants;
  // A packed batch (batch 1, q_len = kv_len = all tokens): sequence s is rows [cu_seqlens[s],
  // cu_seqlens[s + 1]) of queries and keys alike, attending within itself only; null: not packed.
  const int64_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0;
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
// (last axis contiguous); k_cache/v_cache hold uint16 bit patterns for 16-bit storage, int8 values
// for int8 storage, with the row at element offset o scaled by k_scales[o / cache_stride_s] (V alike).
// A bfloat16 layer (bf16, T = float) as in MhaArgs: x holds bfloat16 rows, the projections are
// packed16, the attention's output is rounded to bfloat16 for the output projection.
template <class T>
struct MhaCacheArgs {
  bool bf16 = false;
  const T* x = nullptr;
  int64_t x_stride = 0;
  int64_t batch = 0, chunk = 0;
  int64_t embed_dim = 0, num_heads = 1, num_kv_heads = 1, head_dim = 0;
  LayerWeights<T> proj;  // the projections' packed weights and biases
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  Storage storage = Storage::same;
  float* k_scales = nullptr;
  float* v_scales = nullptr;
  int64_t cache_stride_b = 0, cache_stride_h = 0, cache_stride_s = 0;
  const int64_t* lengths_before = nullptr;  // [batch]
  const int64_t* lengths_after = nullptr;   // [batch]
  bool left_padded = false;
  VariantOptions variants;
  T* out = nullptr;
};

}  // namespace pyattn
