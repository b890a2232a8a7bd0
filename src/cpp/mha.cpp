// SPDX-License-Identifier: MIT
// Multi-head attention layer: projections -> attention -> output projection, in one call.
//
// The projections write Q, K and V as plain row matrices (batch * len, heads * head_dim), i.e.
// already "head-split": head h of batch b is the column slice [h * head_dim, (h + 1) * head_dim) of
// rows [b * len, (b + 1) * len), which the attention kernel addresses with an offset and a row stride.
// The attention writes each head's output into the same kind of slice of one (batch * q_len,
// embed_dim) context matrix, which is exactly the input of the output projection. So no stage
// reshapes, transposes or copies what the previous one produced.
//
// A bfloat16 layer (MhaArgs::bf16) is the same chain with its projections in bfloat16 pairs
// (GemmArgs::packed16) from bfloat16 inputs: Q, K, V and the attention stay float32, and the
// attention's output is rounded to bfloat16 once, as the output projection's input.
//
// A step over a KV cache (multi_head_attention_cached, a bfloat16 layer's too) is the same chain with
// the cache in the middle: the new K/V rows go from the projection's matrix into the cache
// (converted to its storage there), and the attention reads the cache in place. Doing the whole step
// in one call matters for decoding: as a dozen NumPy operations and several calls into the core, the
// step's fixed cost per layer would be as much as the arithmetic of a small layer.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "parallel.h"
#include "runtime.h"

namespace pyattn {
namespace {

// Tag of the calling thread's workspace for the layer's intermediate matrices (each written in full
// by its producer; parallel.h, grow_only_scratch).
struct LayerWorkspace;
// ... and for a bfloat16 layer's attention output rounded to bfloat16 (MhaArgs::bf16).
struct ContextBf16;

// The layer's intermediates, carved from the workspace: Q and the attention's output `context`
// (q_rows, q_width), K and V (kv_rows, kv_width).
template <class T>
struct LayerBuffers {
  T *q, *k, *v, *context;
};

// Each starts on a cache line, like the workspace itself (the kernels' vector loads of K/V rows).
template <class T>
LayerBuffers<T> layer_buffers(int64_t q_rows, int64_t q_width, int64_t kv_rows, int64_t kv_width) {
  constexpr int64_t kLine = int64_t(kCacheLine / sizeof(T));
  const size_t q_size = size_t(ceil_div(q_rows * q_width, kLine) * kLine);
  const size_t kv_size = size_t(ceil_div(kv_rows * kv_width, kLine) * kLine);
  T* const q = grow_only_scratch<LayerWorkspace, T>(2 * q_size + 2 * kv_size);
  return {q, q + q_size, q + q_size + kv_size, q + q_size + 2 * kv_size};
}

// dst (rows, width) = x (rows, in) @ W.T + bias; with a weight packed in pairs (a bfloat16 layer), x
// holds bfloat16 rows.
template <class T>
void project(const T* x, int64_t x_stride, int64_t rows, int64_t in, const Projection<T>& p, T* dst, int64_t width,
             int num_threads) {
  GemmArgs<T> g;
  if (p.packed16) {
    g.a16 = reinterpret_cast<const uint16_t*>(x);
    g.packed16 = p.packed16;
  }
  g.a = x;
  g.a_stride = x_stride;
  g.packed = p.packed;
  g.w = p.w;
  g.w_stride = p.w_stride;
  g.bias = p.bias;
  g.c = dst;
  g.c_stride = width;
  g.m = rows;
  g.n = width;
  g.k = in;
  linear<T>(g, num_threads);
}

// The attention stage of the layer. Q is head-split in rows of num_heads * head_dim (batch b's
// queries are rows [b * q_len, (b + 1) * q_len)); K/V head g of batch b starts at element
// b * kv_stride_b + g * kv_stride_h of k and v, its rows kv_stride_s apart; each head's output goes
// to its slice of `context` (batch * q_len, num_heads * head_dim). The caller adds masks, causal
// alignment and per-row lengths; q_off/kv_off hold the offsets the returned arguments point to.
template <class T>
AttnArgs<T> head_split_attention(const T* q, const T* k, const T* v, int64_t batch, int64_t q_len, int64_t kv_len,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t kv_stride_b,
                                 int64_t kv_stride_h, int64_t kv_stride_s, T* context, std::vector<int64_t>& q_off,
                                 std::vector<int64_t>& kv_off) {
  const int64_t q_width = num_heads * head_dim, group = num_heads / num_kv_heads;
  q_off.resize(size_t(batch * num_heads));
  kv_off.resize(size_t(batch * num_heads));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_heads; ++h) {
      q_off[size_t(b * num_heads + h)] = b * q_len * q_width + h * head_dim;
      kv_off[size_t(b * num_heads + h)] = b * kv_stride_b + (h / group) * kv_stride_h;
    }
  AttnArgs<T> a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_offset = q_off.data();
  a.k_offset = kv_off.data();
  a.v_offset = kv_off.data();  // K and V share their layout
  a.q_stride_l = q_width;
  a.k_stride_s = kv_stride_s;
  a.v_stride_s = kv_stride_s;
  a.out = context;
  a.num_heads = num_heads;
  a.group = group;
  a.out_stride_b = q_len * q_width;
  a.out_stride_h = head_dim;
  a.out_stride_l = q_width;
  a.batch_heads = batch * num_heads;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.head_dim = head_dim;
  a.value_dim = head_dim;
  a.scale = head_dim > 0 ? 1.0 / std::sqrt(double(head_dim)) : 1.0;
  return a;
}

// The output projection's input: the attention's output `context` (rows, width) itself, or for a
// bfloat16 layer (bf16) its values rounded to bfloat16 (as ml_dtypes rounds) in per-thread scratch.
template <class T>
const T* output_projection_input(const T* context, int64_t rows, int64_t width, bool bf16, int num_threads) {
  if constexpr (std::is_same<T, float>::value) {
    if (bf16) {
      uint16_t* rounded = grow_only_scratch<ContextBf16, uint16_t>(size_t(std::max<int64_t>(1, rows * width)));
      convert_half(context, rounded, rows * width, num_threads, true);
      return reinterpret_cast<const T*>(rounded);
    }
  }
  return context;
}

}  // namespace

template <class T>
void multi_head_attention(const MhaArgs<T>& m, int num_threads) {
  const int64_t q_rows = m.batch * m.q_len, kv_rows = m.batch * m.kv_len;
  const int64_t q_width = m.num_heads * m.head_dim, kv_width = m.num_kv_heads * m.head_dim;
  const LayerBuffers<T> buf = layer_buffers<T>(q_rows, q_width, kv_rows, kv_width);
  T *const q = buf.q, *const k = buf.k, *const v = buf.v, *const context = buf.context;
  project<T>(m.xq, m.xq_stride, q_rows, m.embed_dim, m.proj.q, q, q_width, num_threads);
  project<T>(m.xk, m.xk_stride, kv_rows, m.kdim, m.proj.k, k, kv_width, num_threads);
  project<T>(m.xv, m.xv_stride, kv_rows, m.vdim, m.proj.v, v, kv_width, num_threads);

  std::vector<int64_t> q_off, kv_off;
  if (m.cu_seqlens) {  // a packed batch: one call per sequence on its rows, nothing across them
    for (int64_t s = 0; s < m.num_seqs; ++s) {
      const int64_t first = m.cu_seqlens[s], len = m.cu_seqlens[s + 1] - first;
      if (len == 0) continue;
      AttnArgs<T> a = head_split_attention<T>(q + first * q_width, k + first * kv_width, v + first * kv_width, 1, len,
                                              len, m.num_heads, m.num_kv_heads, m.head_dim, len * kv_width, m.head_dim,
                                              kv_width, context + first * q_width, q_off, kv_off);
      m.variants.apply(a, m.causal, 0);
      scaled_dot_product_attention<T>(a, num_threads);
    }
  } else {
    AttnArgs<T> a =
        head_split_attention<T>(q, k, v, m.batch, m.q_len, m.kv_len, m.num_heads, m.num_kv_heads, m.head_dim,
                                m.kv_len * kv_width, m.head_dim, kv_width, context, q_off, kv_off);
    a.weights = m.weights;
    a.masks[0] = m.masks[0];
    a.masks[1] = m.masks[1];
    m.variants.apply(a, m.causal, m.causal_offset);
    scaled_dot_product_attention<T>(a, num_threads);
  }

  const T* out_in = output_projection_input<T>(context, q_rows, q_width, m.bf16, num_threads);
  project<T>(out_in, q_width, q_rows, q_width, m.proj.o, m.out, m.embed_dim, num_threads);
}

template void multi_head_attention<float>(const MhaArgs<float>&, int);
template void multi_head_attention<double>(const MhaArgs<double>&, int);

namespace {

// Copies n elements of a projected K or V row into the cache, converted to its storage (float16 and
// bfloat16 rounded to nearest even, as NumPy's and ml_dtypes' astype do: KVCache.append).
template <class T>
void store_row(const T* src, void* dst, int64_t n, Storage storage) {
  if constexpr (std::is_same<T, float>::value) {
    if (storage == Storage::f16) return active_kernels().float_to_half(src, static_cast<uint16_t*>(dst), n);
    if (storage == Storage::bf16) return active_kernels().float_to_bf16(src, static_cast<uint16_t*>(dst), n);
  }
  std::memcpy(dst, src, size_t(n) * sizeof(T));
}

// Below this many K/V elements to store, one thread does it (starting the others costs more).
constexpr int64_t kStoreParallelElems = int64_t(1) << 16;

}  // namespace

template <class T>
void multi_head_attention_cached(const MhaCacheArgs<T>& m, int num_threads) {
  const int64_t rows = m.batch * m.chunk, dim = m.head_dim;
  const int64_t q_width = m.num_heads * dim, kv_width = m.num_kv_heads * dim;
  const LayerBuffers<T> buf = layer_buffers<T>(rows, q_width, rows, kv_width);
  T *const q = buf.q, *const k = buf.k, *const v = buf.v, *const context = buf.context;
  project<T>(m.x, m.x_stride, rows, m.embed_dim, m.proj.q, q, q_width, num_threads);
  project<T>(m.x, m.x_stride, rows, m.embed_dim, m.proj.k, k, kv_width, num_threads);
  project<T>(m.x, m.x_stride, rows, m.embed_dim, m.proj.v, v, kv_width, num_threads);

  // Row b's real tokens: chunk rows [first[b], first[b] + count) go to cache positions
  // [lengths_before[b], lengths_after[b]).
  std::vector<int64_t> first(static_cast<size_t>(m.batch)), causal_offsets(static_cast<size_t>(m.batch));
  int64_t kv_len = 0, stored = 0;
  for (int64_t b = 0; b < m.batch; ++b) {
    const int64_t count = m.lengths_after[b] - m.lengths_before[b];
    first[size_t(b)] = m.left_padded ? m.chunk - count : 0;
    causal_offsets[size_t(b)] = m.lengths_before[b] - first[size_t(b)];
    kv_len = std::max(kv_len, m.lengths_after[b]);
    stored += count;
  }
  const int64_t item = m.storage == Storage::same ? int64_t(sizeof(T)) : m.storage == Storage::i8 ? 1 : 2;
  auto store_token = [&](int64_t r) {  // chunk row r = b * chunk + t, all its heads, K and V
    const int64_t b = r / m.chunk, t = r % m.chunk - first[size_t(b)];
    if (t < 0 || t >= m.lengths_after[b] - m.lengths_before[b]) return;  // padding of row b
    for (int64_t h = 0; h < m.num_kv_heads; ++h) {
      const int64_t elem = b * m.cache_stride_b + h * m.cache_stride_h + (m.lengths_before[b] + t) * m.cache_stride_s;
      if constexpr (std::is_same<T, float>::value) {
        if (m.storage == Storage::i8) {  // as KVCache.append quantises (runtime.cpp)
          const int64_t row = elem / m.cache_stride_s;
          quantize_int8(k + r * kv_width + h * dim, 1, dim, static_cast<int8_t*>(m.k_cache) + elem, dim,
                        m.k_scales + row);
          quantize_int8(v + r * kv_width + h * dim, 1, dim, static_cast<int8_t*>(m.v_cache) + elem, dim,
                        m.v_scales + row);
          continue;
        }
      }
      store_row<T>(k + r * kv_width + h * dim, static_cast<char*>(m.k_cache) + elem * item, dim, m.storage);
      store_row<T>(v + r * kv_width + h * dim, static_cast<char*>(m.v_cache) + elem * item, dim, m.storage);
    }
  };
  const int threads = num_threads > 0 ? num_threads : default_num_threads();
  parallel_for(rows, stored * 2 * kv_width >= kStoreParallelElems ? threads : 1, store_token);

  // The chunk's queries over the cache, read in place (uint16 data when storage != same, read as such
  // by the kernel): the same arguments as KVCache.attend.
  std::vector<int64_t> q_off, kv_off;
  AttnArgs<T> a = head_split_attention<T>(q, static_cast<const T*>(m.k_cache), static_cast<const T*>(m.v_cache),
                                          m.batch, m.chunk, kv_len, m.num_heads, m.num_kv_heads, dim, m.cache_stride_b,
                                          m.cache_stride_h, m.cache_stride_s, context, q_off, kv_off);
  a.kv_storage = m.storage;
  a.k_scales = m.k_scales;
  a.v_scales = m.v_scales;
  m.variants.apply(a, true, 0);  // each row's diagonal: causal_offsets
  a.kv_lens = m.lengths_after;
  a.causal_offsets = causal_offsets.data();
  scaled_dot_product_attention<T>(a, num_threads);

  const T* out_in = output_projection_input<T>(context, rows, q_width, m.bf16, num_threads);
  project<T>(out_in, q_width, rows, q_width, m.proj.o, m.out, m.embed_dim, num_threads);
}

template void multi_head_attention_cached<float>(const MhaCacheArgs<float>&, int);
template void multi_head_attention_cached<double>(const MhaCacheArgs<double>&, int);

}  // namespace pyattn
