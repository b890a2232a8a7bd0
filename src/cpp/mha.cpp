// SPDX-License-Identifier: MIT
// Multi-head attention layer: projections -> attention -> output projection, in one call.
//
// The projections write Q, K and V as plain row matrices (batch * len, heads * head_dim), i.e.
// already "head-split": head h of batch b is the column slice [h * head_dim, (h + 1) * head_dim) of
// rows [b * len, (b + 1) * len), which the attention kernel addresses with an offset and a row stride.
// The attention writes each head's output into the same kind of slice of one (batch * q_len,
// embed_dim) context matrix, which is exactly the input of the output projection. So no stage
// reshapes, transposes or copies what the previous one produced.

#include <cmath>
#include <vector>

#include "attention.h"

namespace pyattn {

template <class T>
void multi_head_attention(const MhaArgs<T>& m, int num_threads) {
  const int64_t q_rows = m.batch * m.q_len, kv_rows = m.batch * m.kv_len;
  const int64_t q_width = m.num_heads * m.head_dim, kv_width = m.num_kv_heads * m.head_dim;
  // Intermediate matrices, written in full by their producer. They live in a per-calling-thread
  // workspace that only grows, so a layer called again and again does not pay page faults for fresh
  // megabytes on every call (and concurrent callers never share one).
  thread_local std::vector<T> workspace;
  const size_t q_size = size_t(q_rows * q_width), kv_size = size_t(kv_rows * kv_width);
  if (workspace.size() < 2 * q_size + 2 * kv_size) workspace.resize(2 * q_size + 2 * kv_size);
  T* const q = workspace.data();
  T* const k = q + q_size;
  T* const v = k + kv_size;
  T* const context = v + kv_size;

  auto project = [&](const T* x, int64_t x_stride, int64_t rows, int64_t in, const T* packed, const T* bias,
                     T* dst, int64_t width) {
    GemmArgs<T> g;
    g.a = x;
    g.a_stride = x_stride;
    g.packed = packed;
    g.bias = bias;
    g.c = dst;
    g.c_stride = width;
    g.m = rows;
    g.n = width;
    g.k = in;
    linear<T>(g, num_threads);
  };
  project(m.xq, m.xq_stride, q_rows, m.embed_dim, m.packed_q, m.bias_q, q, q_width);
  project(m.xk, m.xk_stride, kv_rows, m.kdim, m.packed_k, m.bias_k, k, kv_width);
  project(m.xv, m.xv_stride, kv_rows, m.vdim, m.packed_v, m.bias_v, v, kv_width);

  const int64_t batch_heads = m.batch * m.num_heads;
  const int64_t group = m.num_heads / m.num_kv_heads;
  std::vector<int64_t> q_off(static_cast<size_t>(batch_heads)), k_off(static_cast<size_t>(batch_heads));
  for (int64_t b = 0; b < m.batch; ++b)
    for (int64_t h = 0; h < m.num_heads; ++h) {
      q_off[size_t(b * m.num_heads + h)] = b * m.q_len * q_width + h * m.head_dim;
      k_off[size_t(b * m.num_heads + h)] = b * m.kv_len * kv_width + (h / group) * m.head_dim;
    }
  AttnArgs<T> a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_offset = q_off.data();
  a.k_offset = k_off.data();
  a.v_offset = k_off.data();  // K and V share their layout
  a.q_stride_l = q_width;
  a.k_stride_s = kv_width;
  a.v_stride_s = kv_width;
  a.out = context;
  a.num_heads = m.num_heads;
  a.group = group;
  a.out_stride_b = m.q_len * q_width;
  a.out_stride_h = m.head_dim;
  a.out_stride_l = q_width;
  a.weights = m.weights;
  a.masks[0] = m.masks[0];
  a.masks[1] = m.masks[1];
  a.batch_heads = batch_heads;
  a.q_len = m.q_len;
  a.kv_len = m.kv_len;
  a.head_dim = m.head_dim;
  a.value_dim = m.head_dim;
  a.causal = m.causal;
  a.causal_offset = m.causal_offset;
  a.scale = m.head_dim > 0 ? 1.0 / std::sqrt(double(m.head_dim)) : 1.0;
  scaled_dot_product_attention<T>(a, num_threads);

  project(context, q_width, q_rows, q_width, m.packed_o, m.bias_o, m.out, m.embed_dim);
}

template void multi_head_attention<float>(const MhaArgs<float>&, int);
template void multi_head_attention<double>(const MhaArgs<double>&, int);

}  // namespace pyattn
