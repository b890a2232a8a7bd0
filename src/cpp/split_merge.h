// SPDX-License-Identifier: MIT
// Key splits and the merge of partial softmax states (split_merge.cpp), for both drivers.
//
// When a call has too few tasks to keep the threads busy (short queries, few heads), each task's key
// range is split into chunks, one work item each. Every chunk leaves a partial running state (m, l,
// acc) over its keys, in log2 units, and merge_partials combines them exactly:
//   m = max_c m_c,   l = sum_c 2^(m_c - m) l_c,   out = sum_c 2^(m_c - m) acc_c / l,
// in chunk order, so the result does not depend on which thread computed which chunk. A chunk that
// saw no allowed key (m_c = -inf) contributes nothing; a row with l = 0 becomes zeros. The same merge
// combines partial attention outputs over disjoint key sets (out_c with its log-sum-exp lse_c is the
// state m_c = lse_c * log2(e), l_c = 1, acc_c = out_c). The split depends on the shape only, never on
// the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "problem.h"

namespace pyattn {

constexpr size_t kAlign = 64;  // cache line: every state and scratch block starts on one

// elems rounded up to whole cache lines of elem_size-byte elements.
inline size_t padded(size_t elems, size_t elem_size) {
  const size_t per_line = kAlign / elem_size;
  return (elems + per_line - 1) / per_line * per_line;
}

// Elements of one work item's running state (acc, m, l) for block_rows rows of value_dim columns.
template <class T>
size_t state_elems(int64_t block_rows, int64_t value_dim) {
  return padded(size_t(block_rows * value_dim), sizeof(T)) + 2 * padded(size_t(block_rows), sizeof(T));
}

// Carves one item's running state (acc, m, l) out of `base`.
template <class T>
RowState<T> state_at(T* base, int64_t block_rows, int64_t value_dim) {
  const size_t acc = padded(size_t(block_rows * value_dim), sizeof(T));
  const size_t row = padded(size_t(block_rows), sizeof(T));
  return RowState<T>{base, base + acc, base + acc + row};
}

// Where a state keeps row i's accumulator for value column e: acc[i * row + e * col].
struct AccLayout {
  int64_t row;
  int64_t col;
};

// How many chunks to split each task's key range into, and how long they are.
struct Split {
  int64_t count;
  int64_t chunk;
};

// Enough work items for kTaskTarget (tuning.h) from `tasks` tasks, chunks of at least min_chunk keys
// rounded to whole blocks of `block` keys; one chunk when the tasks are enough already.
Split split_keys(int64_t tasks, int64_t kv_len, int64_t block, int64_t min_chunk);

// The natural log of a row's softmax denominator from its final state (m in log2 units, l the sum
// scaled by 2^-m): -inf when the row saw no allowed key, NaN when m is NaN.
template <class T>
T row_lse(T m, T l) {
  if (l == T(0)) return -std::numeric_limits<T>::infinity();
  return (m + std::log2(l)) * T(0.693147180559945309417232121458176568);
}

// A merge that writes no log-sum-exp.
template <class T>
struct NoLse {
  T* operator()(int64_t) const { return nullptr; }
};

// out_row(i)[e] = acc[i][e] / l[i]; a row that saw no allowed key (l == 0) becomes zeros.
template <class T, class OutRow>
void finalize(const RowState<T>& s, AccLayout lay, int64_t rows, int64_t value_dim, OutRow out_row) {
  for (int64_t i = 0; i < rows; ++i) {
    const T l = s.l[i];
    const T inv = l == T(0) ? T(0) : T(1) / l;
    T* o = out_row(i);
    for (int64_t e = 0; e < value_dim; ++e) o[e] = s.acc[i * lay.row + e * lay.col] * inv;
  }
}

// Merges the partial states state_of(0 .. nsplit - 1) of one task's rows into the output rows
// out_row(i), in chunk order (see the top of this file), and the rows' log-sum-exp into *lse_row(i)
// where that is not null. A NaN maximum in any chunk makes the row NaN.
template <class T, class StateAt, class OutRow, class LseRow = NoLse<T>>
void merge_partials(int64_t nsplit, StateAt state_of, AccLayout lay, int64_t rows, int64_t value_dim, OutRow out_row,
                    LseRow lse_row = LseRow{}) {
  for (int64_t i = 0; i < rows; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    bool nan = false;
    for (int64_t c = 0; c < nsplit; ++c) {
      const T mc = state_of(c).m[i];
      nan = nan || std::isnan(mc);
      m = std::max(m, mc);
    }
    if (nan) m = std::numeric_limits<T>::quiet_NaN();
    T l = 0;
    T* o = out_row(i);
    for (int64_t e = 0; e < value_dim; ++e) o[e] = T(0);
    for (int64_t c = 0; c < nsplit; ++c) {
      const RowState<T> s = state_of(c);
      if (s.m[i] == -std::numeric_limits<T>::infinity()) continue;  // chunk saw nothing allowed
      const T w = std::exp2(s.m[i] - m);
      l += w * s.l[i];
      for (int64_t e = 0; e < value_dim; ++e) o[e] += w * s.acc[i * lay.row + e * lay.col];
    }
    const T inv = l == T(0) ? T(0) : T(1) / l;
    for (int64_t e = 0; e < value_dim; ++e) o[e] *= inv;
    if (T* at = lse_row(i)) *at = row_lse(m, l);
  }
}

}  // namespace pyattn
