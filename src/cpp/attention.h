// SPDX-License-Identifier: MIT
// The C++ core's entry points, as the binding calls them: one attention call (the tile and decode
// drivers, attention.cpp), one multi-head layer (mha.cpp), the projections' GEMM (gemm.cpp). It also
// brings in what a binding file uses around them: the shared types (problem.h), the kernel dispatch
// (dispatch.h), the runtime (threads, conversions: runtime.h) and the tuning constants (tuning.h).
#pragma once

#include <cstdint>

#include "dispatch.h"
#include "problem.h"
#include "runtime.h"
#include "tuning.h"

namespace pyattn {

// One attention call (AttnArgs, problem.h) on up to num_threads threads (0: the default).
template <class T>
void scaled_dot_product_attention(const AttnArgs<T>& a, int num_threads);

// One multi-head attention layer, and one step of a self-attention layer over a KV cache.
template <class T>
void multi_head_attention(const MhaArgs<T>& m, int num_threads);
template <class T>
void multi_head_attention_cached(const MhaCacheArgs<T>& m, int num_threads);

// Partial attention results merged by their log-sum-exp (MergeArgs, problem.h; merge_states.cpp).
template <class T>
void merge_attention_states(const MergeArgs<T>& m, int num_threads);

// W (n, k) packed into the panels of ks's GEMM (GemmArgs::packed), and C = A.W^T + bias.
template <class T>
void pack_weights(const KernelSet<T>& ks, const T* w, int64_t w_stride, int64_t n, int64_t k, T* packed);
template <class T>
void linear(const GemmArgs<T>& g, int num_threads);
// A bfloat16 (n, k) weight (uint16 bits, rows w_stride apart) packed in pairs of k into panels of
// `panel` columns (GemmArgs::packed16).
void pack_weights16(const uint16_t* w, int64_t w_stride, int64_t n, int64_t k, int64_t panel, uint32_t* packed);

}  // namespace pyattn
