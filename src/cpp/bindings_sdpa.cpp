// SPDX-License-Identifier: MIT
// pyattn.scaled_dot_product_attention's contract, decided here and nowhere else: which arrays are
// accepted (dtypes, dimensions, shapes), how batch dimensions, grouped-query heads and masks
// broadcast, the defaults (scale 1/sqrt(E)), the causal alignments, `out=` and `return_weights`.
// src/pyattn/_api.py only turns non-NumPy inputs (torch tensors, lists) into arrays first.
//
// The path of a call: classify and check every argument (messages name the argument, as the error
// policy asks), then describe each operand to the kernels without copying it: batch broadcasting,
// GQA and mask broadcasting become per-(batch, head) element offsets plus row strides (stride 0 for a
// broadcast axis). The only copies are documented ones: an input whose last axis is not contiguous
// (or whose memory is misaligned) is copied; 16-bit queries are widened to float32 (the kernels read
// 16-bit keys and values in place, converting one key block at a time). Then the GIL is released and
// the driver runs; 16-bit results are rounded back into their dtype.
//
// KVCache.attend enters through sdpa_cache, which describes the cache's storage with the same helpers.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "binding_checks.h"
#include "binding_variants.h"

namespace pyattn {
namespace {

// One of query, key and value after its first checks: a floating ndarray with at least 2 axes.
py::array float_input(py::handle obj, const char* name) {
  const std::string n(name);
  if (obj.is_none()) type_fail(n + ": expected a NumPy array, got None");
  if (!is_ndarray(obj)) type_fail(n + ": expected a NumPy array, got " + type_name(obj));
  py::array x = py::reinterpret_borrow<py::array>(obj);
  if (float_kind(x.dtype()) == FloatKind::other)
    type_fail(n + ": dtype must be float32, float64, float16 or bfloat16 (native byte order), got " +
              str_of(x.dtype()));
  if (x.ndim() < 2)
    fail(n + ": expected at least 2 dimensions (..., seq_len, dim), got shape " + str_of(x.attr("shape")));
  return x;
}

// The dtype class that query, key and value share (a TypeError naming all three otherwise).
FloatKind same_float_kind(const py::array& q, const py::array& k, const py::array& v) {
  const FloatKind kind = float_kind(q.dtype());
  if (float_kind(k.dtype()) != kind || float_kind(v.dtype()) != kind)
    type_fail("query, key and value must have the same dtype, got " + str_of(q.dtype()) + ", " + str_of(k.dtype()) +
              " and " + str_of(v.dtype()));
  return kind;
}

// Query heads against key/value heads: equal, or with enable_gqa a multiple.
void check_heads(int64_t num_heads, int64_t num_kv_heads, py::handle enable_gqa) {
  if (truthy(enable_gqa)) {
    if (num_kv_heads == 0 || num_heads % num_kv_heads != 0)
      fail("enable_gqa: query heads (" + std::to_string(num_heads) + ") must be a multiple of key/value heads (" +
           std::to_string(num_kv_heads) + ")");
  } else if (num_heads != num_kv_heads) {
    fail("key: number of heads (" + std::to_string(num_kv_heads) + ") must equal query's (" +
         std::to_string(num_heads) + "); pass enable_gqa=True for grouped-query attention");
  }
}

// x's shape read as (..., heads, len, dim): 2-D inputs are one head.
Dims heads_shape(const py::array& x) {
  Dims s = shape_of(x);
  if (s.size() == 2) s.push_front(1);
  return s;
}

// An operand as the kernels address it: its shape and element strides (0 along axes of size <= 1),
// (..., heads, len, dim) for query, key and value; any rank for a mask.
struct Layout {
  Dims shape, strides;
};

Layout layout_of(const py::array& x, bool as_heads) {
  Layout l;
  const int64_t item = x.itemsize();
  for (py::ssize_t d = 0; d < x.ndim(); ++d) {
    l.shape.push_back(x.shape(d));
    l.strides.push_back(x.shape(d) > 1 ? int64_t(x.strides(d)) / item : 0);
  }
  if (as_heads && l.shape.size() == 2) {
    l.shape.push_front(1);
    l.strides.push_front(0);
  }
  return l;
}

// Element stride between rows (axis -2), 0 for a single row.
int64_t row_stride(const Layout& l) { return l.shape.size() >= 2 ? l.strides[l.strides.size() - 2] : 0; }

// The offset of every index of lead_shape (C order) into x, x's axes but its last two aligned from
// the right with lead_shape (axes x lacks or has of size 1 broadcast: stride 0), each written
// `repeat` times (consecutive query heads sharing one key/value head) to out[0 ..).
void lead_offsets(const Layout& x, const Dims& lead_shape, int64_t repeat, int64_t* out) {
  const size_t nd = lead_shape.size(), x_lead = x.shape.size() >= 2 ? x.shape.size() - 2 : 0;
  int64_t strides[kMaxDims], index[kMaxDims];
  for (size_t d = 0; d < nd; ++d) strides[d] = index[d] = 0;
  for (size_t i = 1; i <= std::min(nd, x_lead); ++i) strides[nd - i] = x.strides[x_lead - i];
  const int64_t count = lead_shape.product();
  int64_t offset = 0;
  for (int64_t c = 0; c < count; ++c) {
    for (int64_t r = 0; r < repeat; ++r) *out++ = offset;
    for (size_t d = nd; d-- > 0;) {  // next index, last axis fastest
      offset += strides[d];
      if (++index[d] < lead_shape[d]) break;
      offset -= strides[d] * index[d];
      index[d] = 0;
    }
  }
}

// np.broadcast_shapes of the batch axes (all but the last three) of query, key and value.
Dims broadcast_batch(const Dims* shapes[3]) {
  size_t nd = 0;
  for (int i = 0; i < 3; ++i) nd = std::max(nd, shapes[i]->size() - 3);
  Dims batch;
  for (size_t i = 0; i < nd; ++i) batch.push_back(1);
  bool ok = true;
  for (int i = 0; i < 3; ++i) {
    const Dims& s = *shapes[i];
    const size_t lead = s.size() - 3;
    for (size_t j = 0; j < lead; ++j) {
      int64_t& b = batch[nd - lead + j];
      const int64_t n = s[j];
      if (n == 1) continue;
      if (b == 1)
        b = n;
      else if (b != n)
        ok = false;
    }
  }
  if (!ok) {
    std::string msg = "query, key and value: leading batch dimensions do not broadcast: ";
    for (int i = 0; i < 3; ++i) msg += (i ? ", " : "") + tuple_repr(shapes[i]->data(), shapes[i]->size() - 3);
    fail(msg);
  }
  return batch;
}

py::array view_as(const py::array& x, const py::dtype& dtype) {
  std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim()), strides(x.strides(), x.strides() + x.ndim());
  return py::array(dtype, shape, strides, x.data(), x);
}

// A float16/bfloat16 array as a fresh float32 one (on a cache line), converted by the core's vector
// kernels wherever rows are contiguous and aligned, else by NumPy.
py::array widen(const py::array& x, FloatKind kind, int threads, const char* name) {
  py::array wide = array_on_line(py::dtype::of<float>(), shape_of(x), name);
  const int64_t n = int64_t(x.size());
  if (n == 0) return wide;
  const bool bf16 = kind == FloatKind::bf16;
  if (!readable_in_place(x, true)) {
    wide.attr("__setitem__")(py::ellipsis(), x);
    return wide;
  }
  const uint16_t* src = static_cast<const uint16_t*>(x.data());
  float* dst = static_cast<float*>(wide.mutable_data());
  if (x.flags() & py::array::c_style) {
    py::gil_scoped_release release;
    convert_half(src, dst, n, threads, bf16);
    return wide;
  }
  // Row by row: every row's offset from the index over the leading axes (a trailing pair of size-1
  // axes lets lead_offsets walk all axes but the last).
  Layout rows = layout_of(x, false);
  const int64_t row = rows.shape.back(), count = n / row;
  Dims lead = rows.shape;
  lead.n -= 1;
  rows.shape.back() = 1;
  rows.strides.back() = 0;
  rows.shape.push_back(1);
  rows.strides.push_back(0);
  std::vector<int64_t> at(static_cast<size_t>(count));
  lead_offsets(rows, lead, 1, at.data());
  py::gil_scoped_release release;
  for (int64_t r = 0; r < count; ++r) convert_half(src + at[size_t(r)], dst + r * row, row, 1, bf16);
  return wide;
}

// float32 `wide` rounded into the 16-bit array `narrow` (same shape, C-contiguous), by the core's
// vector kernels when narrow is element-aligned, else by NumPy.
void narrow_into(const py::array& wide, py::array& narrow, FloatKind kind, int threads) {
  if (narrow.size() == 0) return;
  if (reinterpret_cast<uintptr_t>(narrow.data()) % 2 != 0) {
    narrow.attr("__setitem__")(py::ellipsis(), wide);
    return;
  }
  const float* src = static_cast<const float*>(wide.data());
  uint16_t* dst = static_cast<uint16_t*>(narrow.mutable_data());
  const int64_t n = int64_t(wide.size());
  py::gil_scoped_release release;
  convert_half(src, dst, n, threads, kind == FloatKind::bf16);
}

// A py::array holding nothing yet (py::array's default constructor makes an empty NumPy array).
py::array no_array() { return py::reinterpret_borrow<py::array>(py::handle()); }

// Everything the driver needs for one call, with the arrays that keep its memory alive.
struct Call {
  // As the kernels read them (16-bit keys/values as uint16 views).
  py::array q = no_array(), k = no_array(), v = no_array();
  Storage kv_storage = Storage::same;
  bool bf16_dots = false;        // precision "fast" (AttnArgs::bf16_dots)
  py::object mask = py::none();  // the mask the kernels read, or None
  int64_t mask_stride_l = 0, mask_stride_s = 0;
  py::array out = no_array();  // compute dtype, C-contiguous, element-aligned
  py::object weights = py::none();
  py::object lse = py::none();   // return_lse: (batch_heads, q_len) in the compute dtype
  std::vector<int64_t> offsets;  // q, k, v, mask offsets per (batch, head): 4 * batch_heads
  int64_t batch_heads = 0, num_heads = 0, group = 1, q_len = 0, kv_len = 0, head_dim = 0, value_dim = 0;
  int64_t q_stride_l = 0, k_stride_s = 0, v_stride_s = 0;
  bool causal = false;
  int64_t causal_offset = 0;  // the diagonal: d(i) = i + causal_offset
  Variants variants;
  double scale = 1.0;
  const int64_t* kv_lens = nullptr;
  const int64_t* causal_offsets = nullptr;
  py::array k_scales = no_array(), v_scales = no_array();  // int8 storage: float32 per row
  int threads = 0;
};

// Fills c.offsets and the row strides for query/key/value layouts broadcast over `batch`.
void describe_operands(Call& c, const Layout& q, const Layout& k, const Layout& v, const Dims& batch,
                       int64_t num_kv_heads) {
  Dims heads = batch, kv_heads = batch;
  heads.push_back(c.num_heads);
  kv_heads.push_back(num_kv_heads);
  const size_t bh = size_t(c.batch_heads);
  c.offsets.assign(4 * bh, 0);
  lead_offsets(q, heads, 1, c.offsets.data());
  lead_offsets(k, kv_heads, c.group, c.offsets.data() + bh);
  lead_offsets(v, kv_heads, c.group, c.offsets.data() + 2 * bh);
  c.q_stride_l = row_stride(q);
  c.k_stride_s = row_stride(k);
  c.v_stride_s = row_stride(v);
}

template <class T>
void launch(const Call& c) {
  AttnArgs<T> a;
  const int64_t bh = c.batch_heads;
  a.batch_heads = bh;
  a.num_heads = c.num_heads > 0 ? c.num_heads : 1;
  a.group = c.group;
  a.q_len = c.q_len;
  a.kv_len = c.kv_len;
  a.head_dim = c.head_dim;
  a.value_dim = c.value_dim;
  a.q = static_cast<const T*>(c.q.data());
  a.k = static_cast<const T*>(c.k.data());  // uint16 data when kv_storage != same (the kernels know)
  a.v = static_cast<const T*>(c.v.data());
  a.kv_storage = c.kv_storage;
  a.bf16_dots = c.bf16_dots;
  a.q_offset = c.offsets.data();
  a.k_offset = c.offsets.data() + bh;
  a.v_offset = c.offsets.data() + 2 * bh;
  a.q_stride_l = c.q_stride_l;
  a.k_stride_s = c.k_stride_s;
  a.v_stride_s = c.v_stride_s;
  c.variants.options().apply(a, c.causal, c.causal_offset);
  a.scale = c.scale;
  a.kv_lens = c.kv_lens;
  a.causal_offsets = c.causal_offsets;
  if (c.kv_storage == Storage::i8) {
    a.k_scales = static_cast<const float*>(c.k_scales.data());
    a.v_scales = static_cast<const float*>(c.v_scales.data());
  }
  if (!c.mask.is_none()) {
    const py::array m = py::reinterpret_borrow<py::array>(c.mask);
    MaskSlot& s = a.masks[0];
    s.data = m.data();
    s.kind = m.dtype().kind() == 'b' ? MaskKind::boolean : MaskKind::additive;
    s.offset = c.offsets.data() + 3 * bh;
    s.stride_l = c.mask_stride_l;
    s.stride_s = c.mask_stride_s;
  }
  a.out = static_cast<T*>(const_cast<void*>(c.out.data()));
  a.out_stride_l = c.value_dim;
  a.out_stride_h = checked_mul(c.q_len, c.value_dim);
  a.out_stride_b = checked_mul(a.num_heads, a.out_stride_h);
  if (!c.weights.is_none()) a.weights = static_cast<T*>(py::reinterpret_borrow<py::array>(c.weights).mutable_data());
  if (!c.lse.is_none()) {
    a.lse = static_cast<T*>(py::reinterpret_borrow<py::array>(c.lse).mutable_data());
    a.lse_stride_bh = c.q_len;
  }
  if (bh == 0) return;
  py::gil_scoped_release release;
  scaled_dot_product_attention<T>(a, c.threads);
}

void launch(const Call& c, bool float64) {
  if (float64)
    launch<double>(c);
  else
    launch<float>(c);
}

// out=: exactly the result's dtype and shape, C-contiguous, writeable, sharing no memory with an input.
void check_out(const py::handle& out_obj, const py::dtype& dtype, const Dims& shape,
               std::initializer_list<std::pair<const char*, py::handle>> inputs) {
  if (!is_ndarray(out_obj)) type_fail("out: expected a NumPy array, got " + type_name(out_obj));
  const py::array out = py::reinterpret_borrow<py::array>(out_obj);
  if (!out.dtype().is(dtype) && !out.dtype().equal(dtype))
    type_fail("out: dtype must be " + str_of(dtype) + ", got " + str_of(out.dtype()));
  if (shape_of(out) != shape) fail("out: shape must be " + tuple_repr(shape) + ", got " + str_of(out.attr("shape")));
  if (!(out.flags() & py::array::c_style)) fail("out: must be C-contiguous");
  if (!out.writeable()) fail("out: must be writeable");
  for (const auto& in : inputs)
    if (!in.second.is_none() && may_share_memory(out, py::reinterpret_borrow<py::array>(in.second)))
      fail(std::string("out: must not overlap ") + in.first);
}

// The attention mask after its checks: bool (True = attend) or the inputs' float dtype (added to the
// scaled scores), broadcastable to batch + (Hq, L, S) without materialising it.
py::array check_mask(py::handle mask_obj, const py::dtype& dtype, const Dims& batch, const Call& c) {
  if (!is_ndarray(mask_obj)) type_fail("attn_mask: expected a NumPy array, got " + type_name(mask_obj));
  py::array mask = py::reinterpret_borrow<py::array>(mask_obj);
  const bool boolean = mask.dtype().kind() == 'b' && mask.itemsize() == 1;
  if (!boolean && !mask.dtype().is(dtype) && !mask.dtype().equal(dtype))
    type_fail("attn_mask: dtype must be bool or the query's dtype (" + str_of(dtype) + "), got " +
              str_of(mask.dtype()));
  Dims full = batch;
  for (int64_t n : {c.num_heads, c.q_len, c.kv_len}) full.push_back(n);
  if (!broadcasts_to(shape_of(mask), full))
    fail("attn_mask: shape " + str_of(mask.attr("shape")) + " is not broadcastable to " + tuple_repr(full));
  return mask;
}

// The checked mask described into c (read in place, stride 0 along broadcast axes); a 16-bit float
// mask is widened like the inputs.
void describe_mask(Call& c, py::array mask, FloatKind kind, const Dims& batch) {
  if (mask.dtype().kind() != 'b' && is_half(kind)) mask = widen(mask, kind, c.threads, "attn_mask");
  mask = kernel_layout(mask, false, "attn_mask");  // read through any strides, the last axis's too
  const Layout l = layout_of(mask, false);
  const size_t nd = l.shape.size();
  c.mask_stride_l = nd >= 2 ? l.strides[nd - 2] : 0;
  c.mask_stride_s = nd >= 1 ? l.strides[nd - 1] : 0;
  Dims heads = batch;
  heads.push_back(c.num_heads);
  lead_offsets(l, heads, 1, c.offsets.data() + 3 * size_t(c.batch_heads));
  c.mask = mask;
}

py::object sdpa(py::handle query, py::handle key, py::handle value, py::handle attn_mask, py::handle is_causal,
                py::handle scale, py::handle enable_gqa, py::handle return_weights, py::handle out_obj,
                py::handle num_threads, py::handle window, py::handle softcap, py::handle sinks,
                py::handle alibi_slopes, py::handle return_lse, py::handle diagonal, py::handle precision) {
  const py::array q_in = float_input(query, "query"), k_in = float_input(key, "key"),
                  v_in = float_input(value, "value");
  const py::dtype dtype = q_in.dtype();
  const FloatKind kind = same_float_kind(q_in, k_in, v_in);
  Call c;
  c.bf16_dots = parse_precision(precision);
  const bool want_lse = truthy(return_lse);
  c.threads = parse_threads(num_threads);
  const bool want_weights = truthy(return_weights);

  // Shapes: (..., Hq, L, E), (..., Hk, S, E), (..., Hk, S, Ev).
  const Dims qs = heads_shape(q_in), ks = heads_shape(k_in), vs = heads_shape(v_in);
  auto tail = [](const Dims& s, size_t i) { return s[s.size() - 3 + i]; };
  c.num_heads = tail(qs, 0);
  c.q_len = tail(qs, 1);
  c.head_dim = tail(qs, 2);
  const int64_t num_kv_heads = tail(ks, 0);
  c.kv_len = tail(ks, 1);
  c.value_dim = tail(vs, 2);
  if (tail(ks, 2) != c.head_dim)
    fail("key: last dimension must equal query's (" + std::to_string(c.head_dim) + "), got key shape " +
         tuple_repr(ks));
  if (tail(vs, 1) != c.kv_len)
    fail("value: sequence length must equal key's (" + std::to_string(c.kv_len) + "), got value shape " +
         tuple_repr(vs));
  if (tail(vs, 0) != num_kv_heads)
    fail("value: number of heads must equal key's (" + std::to_string(num_kv_heads) + "), got value shape " +
         tuple_repr(vs));
  check_heads(c.num_heads, num_kv_heads, enable_gqa);
  const Dims* all[3] = {&qs, &ks, &vs};
  const Dims batch = broadcast_batch(all);
  c.group = num_kv_heads > 0 ? c.num_heads / num_kv_heads : 1;
  int64_t batch_count = 1;
  for (size_t i = 0; i < batch.size(); ++i) batch_count = checked_mul(batch_count, batch[i]);
  c.batch_heads = checked_mul(batch_count, c.num_heads);

  const Causal causal = parse_causal(is_causal);
  c.causal = causal != Causal::none;
  c.causal_offset = causal_offset(causal, c.q_len, c.kv_len);
  // Private (pyattn.distributed): the diagonal of a block of a larger problem, d(i) = i + diagonal,
  // for the causal rule, the window and ALiBi alike, instead of the alignment's.
  if (!diagonal.is_none()) c.causal_offset = diagonal.cast<int64_t>();
  c.scale = parse_scale(scale, c.head_dim);
  c.variants = parse_variants(window, softcap, sinks, alibi_slopes, batch, c.num_heads);
  const py::array mask = attn_mask.is_none() ? no_array() : check_mask(attn_mask, dtype, batch, c);

  // The output's shape: 2-D inputs give (L, Ev), else batch + (Hq, L, Ev).
  const bool two_d = std::max({q_in.ndim(), k_in.ndim(), v_in.ndim()}) == 2;
  Dims out_shape = two_d ? Dims{} : batch, w_shape;
  if (!two_d) out_shape.push_back(c.num_heads);
  w_shape = out_shape;
  for (int64_t n : {c.q_len, c.value_dim}) out_shape.push_back(n);
  for (int64_t n : {c.q_len, c.kv_len}) w_shape.push_back(n);
  if (!out_obj.is_none())
    check_out(out_obj, dtype, out_shape, {{"query", q_in}, {"key", k_in}, {"value", v_in}, {"attn_mask", attn_mask}});

  // The outputs first: an impossible size is refused before any copy is made.
  const bool half = is_half(kind);
  const py::dtype compute = half ? py::dtype::of<float>() : dtype;
  const bool in_place =
      !out_obj.is_none() && !half &&
      reinterpret_cast<uintptr_t>(py::reinterpret_borrow<py::array>(out_obj).data()) % dtype.itemsize() == 0;
  c.out = in_place ? py::reinterpret_borrow<py::array>(out_obj) : array_on_line(compute, out_shape, "out");
  if (want_weights) c.weights = array_on_line(compute, w_shape, "return_weights");
  if (want_lse) {
    Dims lse_shape = out_shape;
    lse_shape.n -= 1;
    c.lse = array_on_line(compute, lse_shape, "return_lse");
  }
  auto empty = [](const py::object& x) { return x.is_none() || py::reinterpret_borrow<py::array>(x).size() == 0; };
  const bool nothing_to_do = c.out.size() == 0 && empty(c.weights) && empty(c.lse);  // value_dim 0 still has lse

  // The operands as the kernels read them.
  if (!nothing_to_do) {
    c.q = half ? widen(q_in, kind, c.threads, "query") : kernel_layout(q_in, true, "query");
    if (half && !want_weights) {  // read in place by the kernels as 16-bit storage
      c.k = view_as(kernel_layout(k_in, true, "key"), py::dtype::of<uint16_t>());
      c.v = view_as(kernel_layout(v_in, true, "value"), py::dtype::of<uint16_t>());
      c.kv_storage = storage_of(kind);
    } else if (half) {  // return_weights: the rare O(L*S) mode works on float32 copies
      c.k = widen(k_in, kind, c.threads, "key");
      c.v = widen(v_in, kind, c.threads, "value");
    } else {
      c.k = kernel_layout(k_in, true, "key");
      c.v = kernel_layout(v_in, true, "value");
    }
    describe_operands(c, layout_of(c.q, true), layout_of(c.k, true), layout_of(c.v, true), batch, num_kv_heads);
    if (!attn_mask.is_none()) describe_mask(c, mask, kind, batch);
    launch(c, kind == FloatKind::f64);
  }

  py::object result = c.out, weights = c.weights;
  if (half) {
    py::array narrow =
        out_obj.is_none() ? array_on_line(dtype, out_shape, "out") : py::reinterpret_borrow<py::array>(out_obj);
    narrow_into(c.out, narrow, kind, c.threads);
    result = narrow;
    if (want_weights) {
      py::array w = array_on_line(dtype, w_shape, "return_weights");
      narrow_into(py::reinterpret_borrow<py::array>(c.weights), w, kind, c.threads);
      weights = w;
    }
  } else if (!out_obj.is_none() && !in_place) {  // an element-misaligned out=: copied into
    out_obj.attr("__setitem__")(py::ellipsis(), c.out);
    result = py::reinterpret_borrow<py::object>(out_obj);
  }
  if (want_weights && want_lse) return py::make_tuple(result, weights, c.lse);
  if (want_weights) return py::make_tuple(result, weights);
  if (want_lse) return py::make_tuple(result, c.lse);
  return result;
}

// KVCache.attend: the queries (batch, num_heads, chunk, head_dim) of the chunk appended last, in the
// cache's compute dtype, over its storage (batch, num_kv_heads, max_len, dim) (16-bit storage as
// uint16 views, storage 1 = float16, 2 = bfloat16; storage 3 = int8 with (batch, num_kv_heads,
// max_len) float32 row scales), kv_len keys long (the longest row), each batch row b seeing its
// first lengths[b] keys with query i at position causal_offsets[b] + i.
py::object sdpa_cache(py::handle query, const py::array& k_store, const py::array& v_store, int storage, int64_t kv_len,
                      const py::array& lengths, const py::array& causal_offsets, py::handle scale,
                      py::handle num_threads, py::handle window, py::handle softcap, py::handle sinks,
                      py::handle alibi_slopes, py::handle return_lse, py::handle k_scales, py::handle v_scales) {
  if (storage < 0 || storage > 3) fail("storage must be 0 (same), 1 (float16), 2 (bfloat16) or 3 (int8)");
  const py::array q_in = float_input(query, "query");
  const FloatKind kind = float_kind(q_in.dtype());
  const py::dtype stored = storage == 0   ? q_in.dtype()
                           : storage == 3 ? py::dtype::of<int8_t>()
                                          : py::dtype::of<uint16_t>();
  if (storage != 0 && kind != FloatKind::f32) type_fail("query: must be float32 with a 16-bit or int8 cache");
  if (kind != FloatKind::f32 && kind != FloatKind::f64) type_fail("query: dtype must be float32 or float64");
  if (q_in.ndim() != 4) fail("query: expected (batch, num_heads, chunk, head_dim)");
  const int64_t batch = q_in.shape(0);
  for (const py::array* s : {&k_store, &v_store}) {
    if (s->ndim() != 4 || s->shape(0) != batch || s->shape(2) != k_store.shape(2) || s->shape(1) != k_store.shape(1))
      fail("k/v storage: expected (batch, num_kv_heads, max_len, dim) arrays of the query's batch");
    if (!s->dtype().is(stored) && !s->dtype().equal(stored)) type_fail("k/v storage: dtype does not match the query's");
    if (!readable_in_place(*s, true)) fail("k/v storage: must be element-aligned with a contiguous last axis");
  }
  if (k_store.shape(3) != q_in.shape(3)) fail("query: head_dim must equal the cache's");
  for (const py::array* a : {&lengths, &causal_offsets})
    if (!is_int64(*a) || a->ndim() != 1 || a->shape(0) != batch || !(a->flags() & py::array::c_style))
      fail("lengths/causal_offsets: expected contiguous int64 arrays of one entry per batch row");
  const int64_t* len = static_cast<const int64_t*>(lengths.data());
  if (kv_len < 0 || kv_len > k_store.shape(2)) fail("kv_len: must lie in [0, max_len]");
  for (int64_t b = 0; b < batch; ++b)
    if (len[b] < 0 || len[b] > kv_len) fail("lengths: entries must lie in [0, kv_len]");
  const int64_t num_kv_heads = k_store.shape(1);
  Call c;
  c.threads = parse_threads(num_threads);
  c.num_heads = q_in.shape(1);
  if (num_kv_heads == 0 || c.num_heads % num_kv_heads != 0)
    fail("query: num_heads must be a multiple of the cache's num_kv_heads");
  c.group = c.num_heads / num_kv_heads;
  c.q_len = q_in.shape(2);
  c.kv_len = kv_len;
  c.head_dim = q_in.shape(3);
  c.value_dim = v_store.shape(3);
  c.batch_heads = checked_mul(batch, c.num_heads);
  c.scale = parse_scale(scale, c.head_dim);
  c.causal = true;
  c.variants = parse_variants(window, softcap, sinks, alibi_slopes, Dims{batch}, c.num_heads);
  c.kv_lens = len;
  c.causal_offsets = static_cast<const int64_t*>(causal_offsets.data());
  c.kv_storage = Storage(storage);
  if (c.kv_storage == Storage::i8) {  // one float32 scale per stored row, in the storage's row order
    const py::handle given[2] = {k_scales, v_scales};
    py::array* dst[2] = {&c.k_scales, &c.v_scales};
    const py::array* store[2] = {&k_store, &v_store};
    for (int x = 0; x < 2; ++x) {
      if (given[x].is_none()) fail("k/v scales: an int8 cache needs its row scales");
      const py::array sc = py::reinterpret_borrow<py::array>(given[x]);
      const py::array& st = *store[x];
      if (!is_float32(sc) || sc.ndim() != 3 || sc.shape(0) != batch || sc.shape(1) != num_kv_heads ||
          sc.shape(2) != st.shape(2) || !(sc.flags() & py::array::c_style) || !(st.flags() & py::array::c_style))
        fail("k/v scales: expected C-contiguous float32 (batch, num_kv_heads, max_len) beside C-contiguous storage");
      *dst[x] = sc;
    }
  }
  c.q = kernel_layout(q_in, true, "query");
  c.k = k_store;
  c.v = v_store;
  describe_operands(c, layout_of(c.q, true), layout_of(c.k, true), layout_of(c.v, true), Dims{batch}, num_kv_heads);
  c.out = array_on_line(q_in.dtype(), Dims{batch, c.num_heads, c.q_len, c.value_dim}, "out");
  const bool want_lse = truthy(return_lse);
  if (want_lse) c.lse = array_on_line(q_in.dtype(), Dims{batch, c.num_heads, c.q_len}, "return_lse");
  launch(c, kind == FloatKind::f64);
  if (want_lse) return py::make_tuple(c.out, c.lse);
  return c.out;
}

// pyattn.varlen_attention: FlashAttention's packed layout, query (total_q, Hq, E), key (total_k, Hk,
// E), value (total_k, Hk, Ev), sequence b being rows cu_q[b]:cu_q[b + 1] against rows cu_k[b]:cu_k[b + 1].
// Each sequence is one call of the driver on views of the packed arrays (no copy, no padding, no
// work across sequences), writing its rows of the packed output in place.
struct Packed {
  py::array q = no_array(), k = no_array(), v = no_array(), out = no_array();
  py::object lse = py::none();  // return_lse: (Hq, total_q) in the compute dtype
  Storage kv_storage = Storage::same;
  bool bf16_dots = false;  // precision "fast" (AttnArgs::bf16_dots)
  std::vector<int64_t> cu_q, cu_k;
  int64_t num_heads = 0, group = 1, head_dim = 0, value_dim = 0;
  bool causal = false, lower_right = false;
  Variants variants;
  double scale = 1.0;
  int threads = 0;
};

template <class T>
void launch_varlen(const Packed& c) {
  const int64_t hq = c.num_heads, batch = int64_t(c.cu_q.size()) - 1;
  const Layout q = layout_of(c.q, false), k = layout_of(c.k, false), v = layout_of(c.v, false);
  std::vector<int64_t> offsets(size_t(3 * hq));
  AttnArgs<T> a;
  a.batch_heads = hq;
  a.num_heads = hq;
  a.group = c.group;
  a.head_dim = c.head_dim;
  a.value_dim = c.value_dim;
  a.q = static_cast<const T*>(c.q.data());
  a.k = static_cast<const T*>(c.k.data());
  a.v = static_cast<const T*>(c.v.data());
  a.kv_storage = c.kv_storage;
  a.bf16_dots = c.bf16_dots;
  a.q_offset = offsets.data();
  a.k_offset = offsets.data() + hq;
  a.v_offset = offsets.data() + 2 * hq;
  a.q_stride_l = q.strides[0];
  a.k_stride_s = k.strides[0];
  a.v_stride_s = v.strides[0];
  a.out_stride_h = c.value_dim;
  a.out_stride_l = hq * c.value_dim;
  a.scale = c.scale;
  T* out = static_cast<T*>(const_cast<void*>(c.out.data()));
  T* lse = c.lse.is_none() ? nullptr : static_cast<T*>(py::reinterpret_borrow<py::array>(c.lse).mutable_data());
  a.lse_stride_bh = c.cu_q.back();  // (Hq, total_q): FlashAttention's varlen layout
  const VariantOptions variants = c.variants.options();
  py::gil_scoped_release release;
  for (int64_t b = 0; b < batch; ++b) {
    a.q_len = c.cu_q[size_t(b) + 1] - c.cu_q[size_t(b)];
    a.kv_len = c.cu_k[size_t(b) + 1] - c.cu_k[size_t(b)];
    if (a.q_len == 0) continue;
    for (int64_t h = 0; h < hq; ++h) {
      offsets[size_t(h)] = c.cu_q[size_t(b)] * q.strides[0] + h * q.strides[1];
      offsets[size_t(hq + h)] = c.cu_k[size_t(b)] * k.strides[0] + h / c.group * k.strides[1];
      offsets[size_t(2 * hq + h)] = c.cu_k[size_t(b)] * v.strides[0] + h / c.group * v.strides[1];
    }
    a.out = out + c.cu_q[size_t(b)] * a.out_stride_l;
    a.lse = lse ? lse + c.cu_q[size_t(b)] : nullptr;
    variants.apply(a, c.causal, c.lower_right ? a.kv_len - a.q_len : 0);
    scaled_dot_product_attention<T>(a, c.threads);
  }
}

py::object varlen(py::handle query, py::handle key, py::handle value, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                  py::handle is_causal, py::handle scale, py::handle enable_gqa, py::handle out_obj,
                  py::handle num_threads, py::handle window, py::handle softcap, py::handle sinks,
                  py::handle alibi_slopes, py::handle return_lse, py::handle precision) {
  const py::array q_in = float_input(query, "query"), k_in = float_input(key, "key"),
                  v_in = float_input(value, "value");
  const py::dtype dtype = q_in.dtype();
  const FloatKind kind = same_float_kind(q_in, k_in, v_in);
  if (q_in.ndim() != 3 || k_in.ndim() != 3 || v_in.ndim() != 3)
    fail("query, key and value: expected packed (total_len, heads, dim) arrays, got shapes " +
         str_of(q_in.attr("shape")) + ", " + str_of(k_in.attr("shape")) + " and " + str_of(v_in.attr("shape")));
  Packed c;
  c.bf16_dots = parse_precision(precision);
  c.threads = parse_threads(num_threads);
  c.num_heads = q_in.shape(1);
  c.head_dim = q_in.shape(2);
  c.value_dim = v_in.shape(2);
  const int64_t num_kv_heads = k_in.shape(1);
  if (k_in.shape(2) != c.head_dim)
    fail("key: last dimension must equal query's (" + std::to_string(c.head_dim) + "), got key shape " +
         str_of(k_in.attr("shape")));
  if (v_in.shape(0) != k_in.shape(0) || v_in.shape(1) != num_kv_heads)
    fail("value: (total_k, heads) must equal key's, got value shape " + str_of(v_in.attr("shape")));
  check_heads(c.num_heads, num_kv_heads, enable_gqa);
  c.group = num_kv_heads > 0 ? c.num_heads / num_kv_heads : 1;
  c.cu_q = parse_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q_in.shape(0));
  c.cu_k = parse_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k_in.shape(0));
  if (c.cu_q.size() != c.cu_k.size())
    fail("cu_seqlens_q and cu_seqlens_k: must have the same length (batch + 1), got " + std::to_string(c.cu_q.size()) +
         " and " + std::to_string(c.cu_k.size()));
  const Causal causal = parse_causal(is_causal);
  c.causal = causal != Causal::none;
  c.lower_right = causal == Causal::lower_right;
  c.scale = parse_scale(scale, c.head_dim);
  c.variants = parse_variants(window, softcap, sinks, alibi_slopes, Dims{}, c.num_heads);
  const Dims out_shape{q_in.shape(0), c.num_heads, c.value_dim};
  if (!out_obj.is_none()) check_out(out_obj, dtype, out_shape, {{"query", q_in}, {"key", k_in}, {"value", v_in}});
  const bool half = is_half(kind);
  const py::dtype compute = half ? py::dtype::of<float>() : dtype;
  const bool in_place =
      !out_obj.is_none() && !half &&
      reinterpret_cast<uintptr_t>(py::reinterpret_borrow<py::array>(out_obj).data()) % dtype.itemsize() == 0;
  // Zeros: rows of a sequence without keys are never written by the driver's loop.
  c.out = in_place ? py::reinterpret_borrow<py::array>(out_obj) : array_on_line(compute, out_shape, "out", 0, true);
  if (in_place) c.out.attr("fill")(0);
  const bool want_lse = truthy(return_lse);
  if (want_lse) {  // -inf: the rows of a sequence without keys, which the driver's loop never writes
    c.lse = array_on_line(compute, Dims{c.num_heads, q_in.shape(0)}, "return_lse");
    c.lse.attr("fill")(-std::numeric_limits<double>::infinity());
  }
  if (c.out.size() > 0 || (want_lse && py::reinterpret_borrow<py::array>(c.lse).size() > 0)) {
    c.q = half ? widen(q_in, kind, c.threads, "query") : kernel_layout(q_in, true, "query");
    if (half) {
      c.k = view_as(kernel_layout(k_in, true, "key"), py::dtype::of<uint16_t>());
      c.v = view_as(kernel_layout(v_in, true, "value"), py::dtype::of<uint16_t>());
      c.kv_storage = storage_of(kind);
    } else {
      c.k = kernel_layout(k_in, true, "key");
      c.v = kernel_layout(v_in, true, "value");
    }
    if (kind == FloatKind::f64)
      launch_varlen<double>(c);
    else
      launch_varlen<float>(c);
  }
  if (half) {
    py::array narrow =
        out_obj.is_none() ? array_on_line(dtype, out_shape, "out") : py::reinterpret_borrow<py::array>(out_obj);
    narrow_into(c.out, narrow, kind, c.threads);
    return want_lse ? py::object(py::make_tuple(narrow, c.lse)) : py::object(narrow);
  }
  py::object result = c.out;
  if (!out_obj.is_none() && !in_place) {
    out_obj.attr("__setitem__")(py::ellipsis(), c.out);
    result = py::reinterpret_borrow<py::object>(out_obj);
  }
  return want_lse ? py::object(py::make_tuple(result, c.lse)) : result;
}

}  // namespace

void bind_sdpa(py::module_& m) {
  m.def("sdpa", &sdpa, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask"), py::arg("is_causal"),
        py::arg("scale"), py::arg("enable_gqa"), py::arg("return_weights"), py::arg("out"), py::arg("num_threads"),
        py::arg("window") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("return_lse") = false, py::arg("diagonal") = py::none(),
        py::arg("precision") = "fast",
        "pyattn.scaled_dot_product_attention on NumPy arrays: the whole contract (see its docstring).");
  m.def("sdpa_cache", &sdpa_cache, py::arg("query"), py::arg("k_storage"), py::arg("v_storage"), py::arg("storage"),
        py::arg("kv_len"), py::arg("lengths"), py::arg("causal_offsets"), py::arg("scale"), py::arg("num_threads"),
        py::arg("window") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("return_lse") = false, py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(),
        "KVCache.attend's attention over the cache's storage (arguments prepared by pyattn.KVCache).");
  m.def("varlen", &varlen, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("is_causal"), py::arg("scale"), py::arg("enable_gqa"), py::arg("out"),
        py::arg("num_threads"), py::arg("window"), py::arg("softcap"), py::arg("sinks"), py::arg("alibi_slopes"),
        py::arg("return_lse") = false, py::arg("precision") = "fast",
        "pyattn.varlen_attention on NumPy arrays: the whole contract (see its docstring).");
}

}  // namespace pyattn
