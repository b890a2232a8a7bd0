// SPDX-License-Identifier: MIT
// pybind11 module pyattn._core: a translator between NumPy arrays and the driver.
//
// src/pyattn/_api.py owns the user-facing contract (shapes, broadcasting, dtype policy, messages).
// This file re-checks every invariant the C++ side relies on, cheaply and before the GIL is
// released (binding_checks.h): dtypes, output layout, and that every row the kernels will touch lies
// inside the array it belongs to (so no combination of arguments can make the core read or write out
// of bounds). Then it fills AttnArgs, releases the GIL and calls the driver. No dtype conversion
// happens here: a silent copy would hide layout bugs. The GEMM and multi-head entries are in
// bindings_mha.cpp.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "binding_checks.h"

namespace pyattn {
namespace {

template <class T>
void run_sdpa(const py::array& q, const py::array& k, const py::array& v, const py::object& mask_obj,
              py::array& out, const py::object& weights_obj, const py::array& offsets,
              const std::vector<int64_t>& strides, const std::vector<int64_t>& dims, int64_t causal,
              int64_t causal_offset, double scale, int num_threads, Storage storage, const py::object& kv_lens,
              const py::object& causal_offsets, int64_t num_heads) {
  AttnArgs<T> a;
  a.batch_heads = dims[0];
  a.q_len = dims[1];
  a.kv_len = dims[2];
  a.head_dim = dims[3];
  a.value_dim = dims[4];
  a.group = dims[5];
  for (int64_t d : dims)
    if (d < 0) fail("dims must be non-negative");
  if (a.group < 1 || a.batch_heads % a.group != 0) fail("group must divide batch_heads");
  a.q_stride_l = strides[0];
  a.k_stride_s = strides[1];
  a.v_stride_s = strides[2];
  a.causal = causal != 0;
  a.causal_offset = causal_offset;
  a.scale = scale;

  if (!is_int64(offsets) || offsets.ndim() != 2 || offsets.shape(0) != 4 || offsets.shape(1) != a.batch_heads ||
      !(offsets.flags() & py::array::c_style))
    fail("offsets must be a C-contiguous int64 array of shape (4, batch_heads)");
  const int64_t* off = static_cast<const int64_t*>(offsets.data());
  a.q_offset = off;
  a.k_offset = off + a.batch_heads;
  a.v_offset = off + 2 * a.batch_heads;

  check_aligned("query", q);
  check_aligned("key", k);
  check_aligned("value", v);
  check_block("query", q, a.q_offset, a.batch_heads, a.q_len, a.q_stride_l, a.head_dim, 1);
  check_block("key", k, a.k_offset, a.batch_heads, a.kv_len, a.k_stride_s, a.head_dim, 1);
  check_block("value", v, a.v_offset, a.batch_heads, a.kv_len, a.v_stride_s, a.value_dim, 1);
  a.q = static_cast<const T*>(q.data());
  a.k = static_cast<const T*>(k.data());  // uint16 data when storage != same (read as such by the kernel)
  a.v = static_cast<const T*>(v.data());
  a.kv_storage = storage;

  if (a.batch_heads == 0) return;  // empty result, nothing to compute
  // Output addressing and per-batch-entry cache lengths: num_heads query heads per batch entry.
  a.num_heads = num_heads > 0 ? num_heads : a.batch_heads;
  if (a.batch_heads % a.num_heads != 0 || a.num_heads % a.group != 0)
    fail("num_heads must divide batch_heads and be a multiple of group");
  const int64_t batch = a.batch_heads / a.num_heads;
  // Taken as they are (no conversion: an array_t cast cost ~1 us per argument on every decode step);
  // the Python layer owns them and keeps them alive through the call.
  for (const py::object* obj : {&kv_lens, &causal_offsets}) {
    if (obj->is_none()) continue;
    if (!py::isinstance<py::array>(*obj)) fail("kv_lens/causal_offsets must be int64 arrays");
    const py::array arr = py::reinterpret_borrow<py::array>(*obj);
    if (!is_int64(arr) || arr.ndim() != 1 || arr.shape(0) != batch || !(arr.flags() & py::array::c_style))
      fail("kv_lens/causal_offsets must be contiguous int64 arrays with one entry per batch row");
    const int64_t* data = static_cast<const int64_t*>(arr.data());
    if (obj == &kv_lens) {
      for (int64_t b = 0; b < batch; ++b)
        if (data[b] < 0 || data[b] > a.kv_len) fail("kv_lens entries must lie in [0, kv_len]");
      a.kv_lens = data;
    } else {
      a.causal_offsets = data;
    }
  }
  if (a.kv_lens && weights_obj.is_none() == false) fail("return_weights is not supported with per-row kv lengths");

  a.masks[0] = mask_slot<T>("attn_mask", mask_obj, q.dtype(), off + 3 * a.batch_heads, strides[3], strides[4],
                            false, a.batch_heads, a.q_len, a.kv_len);

  const int64_t out_size = checked_mul(checked_mul(a.batch_heads, a.q_len), a.value_dim);
  check_output("out", out, q.dtype(), out_size);
  a.out = static_cast<T*>(out.mutable_data());
  a.out_stride_b = checked_mul(a.num_heads, checked_mul(a.q_len, a.value_dim));
  a.out_stride_h = a.q_len * a.value_dim;
  a.out_stride_l = a.value_dim;
  py::array weights;
  if (!weights_obj.is_none()) {
    weights = py::reinterpret_borrow<py::array>(weights_obj);
    check_output("weights", weights, q.dtype(), checked_mul(checked_mul(a.batch_heads, a.q_len), a.kv_len));
    a.weights = static_cast<T*>(weights.mutable_data());
  }
  if (num_threads < 0) fail("num_threads must be >= 1 (or 0 for the default)");

  py::gil_scoped_release release;
  scaled_dot_product_attention<T>(a, num_threads);
}

void sdpa(const py::array& q, const py::array& k, const py::array& v, const py::object& mask,
          py::array out, const py::object& weights, const py::array& offsets,
          const std::vector<int64_t>& strides, const std::vector<int64_t>& dims, int64_t causal,
          int64_t causal_offset, double scale, int num_threads, int kv_storage, const py::object& kv_lens,
          const py::object& causal_offsets, int64_t num_heads) {
  if (strides.size() != 5) fail("strides must have 5 entries");
  if (dims.size() != 6) fail("dims must have 6 entries");
  if (kv_storage < 0 || kv_storage > 2) fail("kv_storage must be 0 (same), 1 (float16) or 2 (bfloat16)");
  const Storage storage = Storage(kv_storage);
  if (storage == Storage::same) {
    if (!same_dtype(q.dtype(), k.dtype()) || !same_dtype(q.dtype(), v.dtype())) fail("query, key and value must share one dtype");
  } else {
    // 16-bit K/V are passed as uint16 views; the kernels convert them a block at a time.
    if (!is_float32(q)) fail("query: must be float32 with float16/bfloat16 keys and values");
    if (!same_dtype(k.dtype(), py::dtype::of<uint16_t>()) || !same_dtype(v.dtype(), py::dtype::of<uint16_t>()))
      fail("key/value: 16-bit storage must be passed as uint16 views");
    if (!weights.is_none()) fail("return_weights needs float32 keys and values");
  }
  if (is_float32(q))
    run_sdpa<float>(q, k, v, mask, out, weights, offsets, strides, dims, causal, causal_offset, scale, num_threads,
                    storage, kv_lens, causal_offsets, num_heads);
  else if (is_float64(q))
    run_sdpa<double>(q, k, v, mask, out, weights, offsets, strides, dims, causal, causal_offset, scale, num_threads,
                     storage, kv_lens, causal_offsets, num_heads);
  else
    fail("query: dtype must be float32 or float64");
}

// Exactly numpy.ndarray: subclasses (np.matrix, masked arrays) take the general path.
bool exact_ndarray(const py::object& obj) {
  static PyTypeObject* const nd_type =
      reinterpret_cast<PyTypeObject*>(py::module_::import("numpy").attr("ndarray").ptr());  // lives forever
  return Py_TYPE(obj.ptr()) == nd_type;
}

// A fresh array_on_line, or None where that would raise: the general path then raises the clear error.
py::object on_line_or_none(const py::dtype& dtype, const std::vector<py::ssize_t>& shape, const char* name) {
  try {
    return array_on_line(dtype, shape, name);
  } catch (const py::error_already_set&) {
    return py::none();
  } catch (const std::bad_alloc&) {
    return py::none();
  } catch (const std::invalid_argument&) {
    return py::none();
  }
}

// A caller's out= as the general path accepts it: exactly an ndarray of `dtype` and `shape`,
// C-contiguous, writeable, and no memory bounds shared with any of the `inputs` arrays
// (np.may_share_memory's test; None entries are absent inputs); else None.
py::object accepted_out(const py::object& out_obj, const py::dtype& dtype, const std::vector<py::ssize_t>& shape,
                        std::initializer_list<py::handle> inputs) {
  if (!exact_ndarray(out_obj)) return py::none();
  const py::array out = py::reinterpret_borrow<py::array>(out_obj);
  if (!same_dtype(out.dtype(), dtype) || out.ndim() != py::ssize_t(shape.size()) ||
      !std::equal(shape.begin(), shape.end(), out.shape()))
    return py::none();
  if (!(out.flags() & py::array::c_style) || !out.writeable()) return py::none();
  auto bounds = [](const py::array& x) {
    const Extent e = extent_of(x);
    const char* base = static_cast<const char*>(x.data());
    return std::make_pair(base + e.lo, base + e.hi);
  };
  const auto ob = bounds(out);
  for (const py::handle x : inputs) {
    if (x.is_none()) continue;
    const auto xb = bounds(py::reinterpret_borrow<py::array>(x));
    if (xb.first < ob.second && ob.first < xb.second) return py::none();
  }
  return std::move(out);
}

// The output shape of a call the one-step path can take: q's shape with value_dim last and, for 4-D
// inputs, the batch their batch axes broadcast to (each 1 or one common size, as the general path's
// np.broadcast_shapes); empty when q, k and v are not all of one rank 2..4 (2-D: one head, (L, E);
// 3-D: (heads, L, E)) or their batch axes do not broadcast that way.
std::vector<py::ssize_t> simple_out_shape(const py::array& q, const py::array& k, const py::array& v) {
  const py::ssize_t nd = q.ndim();
  if (nd < 2 || nd > 4 || k.ndim() != nd || v.ndim() != nd) return {};
  std::vector<py::ssize_t> shape(q.shape(), q.shape() + nd);
  shape.back() = v.shape(nd - 1);
  if (nd == 4) {
    const py::ssize_t batch = std::max({q.shape(0), k.shape(0), v.shape(0)});
    for (const py::array* x : {&q, &k, &v})
      if (x->shape(0) != 1 && x->shape(0) != batch) return {};
    shape[0] = batch;
  }
  return shape;
}

// The common call, q/k/v of one float dtype and rank 2..4 (simple_out_shape), at most a broadcast mask
// and an out= array (no weights or copied inputs; 16-bit q/k/v arrive through sdpa_simple_half, with q
// already widened and K/V as `storage`): checked and launched here without the Python layer's
// general machinery (~15 us of interpreter time per call). Returns None for anything outside that
// case, including every error, so the Python layer takes the general path and raises its usual
// message; for calls inside it, the arguments the kernels see are exactly the general path's.
template <class T>
py::object sdpa_simple_t(const py::array& q, const py::array& k, const py::array& v, const py::object& mask_obj,
                         const py::object& out_obj, int causal, bool gqa, double scale, bool default_scale,
                         int num_threads, Storage storage = Storage::same) {
  std::vector<py::ssize_t> shape = simple_out_shape(q, k, v);
  if (shape.empty()) return py::none();
  const py::ssize_t nd = q.ndim();
  for (const py::array* x : {&q, &k, &v}) {
    const py::ssize_t item = x->itemsize();
    if (reinterpret_cast<uintptr_t>(x->data()) % uintptr_t(item) != 0) return py::none();
    for (py::ssize_t d = 0; d < nd; ++d) {
      if (x->shape(d) == 0) return py::none();  // empty inputs: the general path
      if (x->strides(d) < 0 || x->strides(d) % item != 0) return py::none();
    }
    if (x->shape(nd - 1) > 1 && x->strides(nd - 1) != item) return py::none();
  }
  const py::ssize_t l = nd - 2, e = nd - 1;  // the sequence and feature axes; heads nd - 3 (2-D: one head)
  auto heads = [&](const py::array& x) { return nd >= 3 ? int64_t(x.shape(nd - 3)) : int64_t(1); };
  const int64_t batch = nd == 4 ? shape[0] : 1, num_heads = heads(q), kv_heads = heads(k);
  const int64_t q_len = q.shape(l), kv_len = k.shape(l), head_dim = q.shape(e), value_dim = v.shape(e);
  if (k.shape(e) != head_dim || v.shape(l) != kv_len || heads(v) != kv_heads) return py::none();
  if (gqa ? num_heads % kv_heads != 0 : num_heads != kv_heads) return py::none();
  if (!default_scale && !std::isfinite(scale)) return py::none();
  if (num_threads < 0) return py::none();
  // A mask: bool or q's dtype, at least (L, S), every axis 1 or the full size (broadcast through
  // zero strides), non-negative strides, aligned.
  const int64_t full[4] = {batch, num_heads, q_len, kv_len};
  const int64_t* full_tail = full + (4 - nd);
  py::array mask;
  const bool has_mask = !mask_obj.is_none();
  bool mask_bool = false;
  int64_t m_lead[2] = {0, 0}, m_stride_l = 0, m_stride_s = 0;
  if (has_mask) {
    if (!exact_ndarray(mask_obj)) return py::none();
    mask = py::reinterpret_borrow<py::array>(mask_obj);
    mask_bool = is_bool(mask);
    if (!mask_bool && !same_dtype(mask.dtype(), q.dtype())) return py::none();
    const py::ssize_t md = mask.ndim(), item = mask.itemsize();
    if (md < 2 || md > nd) return py::none();
    if (reinterpret_cast<uintptr_t>(mask.data()) % uintptr_t(item) != 0) return py::none();
    for (py::ssize_t d = 0; d < md; ++d) {
      const int64_t want = full_tail[nd - md + d], n = mask.shape(d);
      if ((n != 1 && n != want) || mask.strides(d) < 0 || mask.strides(d) % item != 0) return py::none();
    }
    auto stride = [&](py::ssize_t d) { return mask.shape(d) == 1 ? int64_t(0) : int64_t(mask.strides(d) / item); };
    m_stride_l = stride(md - 2);
    m_stride_s = stride(md - 1);
    // Leading mask axes, right-aligned with (batch, heads); absent ones broadcast.
    for (py::ssize_t d = 0; d < md - 2; ++d) m_lead[2 - (md - 2) + d] = stride(d);
  }

  // The output first (before the offsets, as in the general path): an impossible size is the
  // general path's ValueError, not a MemoryError from here. A caller's out= must be exactly what the
  // general path accepts: q's dtype and the output shape, C-contiguous, writeable, and no memory
  // bounds shared with an input (np.may_share_memory's test).
  const py::object out_or_none = out_obj.is_none() ? on_line_or_none(py::dtype::of<T>(), shape, "out")
                                                   : accepted_out(out_obj, q.dtype(), shape, {q, k, v, mask_obj});
  if (out_or_none.is_none()) return py::none();
  py::array out = py::reinterpret_borrow<py::array>(out_or_none);

  auto elems = [](const py::array& x, py::ssize_t d) { return int64_t(x.strides(d) / x.itemsize()); };
  AttnArgs<T> a;
  a.batch_heads = checked_mul(batch, num_heads);
  a.num_heads = num_heads;
  a.group = num_heads / kv_heads;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.head_dim = head_dim;
  a.value_dim = value_dim;
  a.q_stride_l = q_len > 1 ? elems(q, l) : 0;  // as _api._row_stride
  a.k_stride_s = kv_len > 1 ? elems(k, l) : 0;
  a.v_stride_s = kv_len > 1 ? elems(v, l) : 0;
  a.causal = causal != 0;
  a.causal_offset = causal == 2 ? kv_len - q_len : 0;
  a.scale = default_scale ? 1.0 / std::sqrt(double(head_dim)) : scale;
  std::vector<int64_t> offsets(size_t(4 * a.batch_heads));
  // Element strides of the batch and head axes (0 where the axis has size 1 or is absent, as
  // _api._lead_strides: a batch axis of size 1 broadcasts).
  auto lead = [&](const py::array& x, py::ssize_t d) {
    return d >= 0 && x.shape(d) > 1 ? elems(x, d) : int64_t(0);
  };
  const py::ssize_t b_ax = nd - 4, h_ax = nd - 3;
  const int64_t qs[2] = {lead(q, b_ax), lead(q, h_ax)}, ks[2] = {lead(k, b_ax), lead(k, h_ax)},
                vs[2] = {lead(v, b_ax), lead(v, h_ax)};
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      const int64_t bh = b * num_heads + hq, hk = hq / a.group;
      offsets[size_t(bh)] = b * qs[0] + hq * qs[1];
      offsets[size_t(a.batch_heads + bh)] = b * ks[0] + hk * ks[1];
      offsets[size_t(2 * a.batch_heads + bh)] = b * vs[0] + hk * vs[1];
      offsets[size_t(3 * a.batch_heads + bh)] = b * m_lead[0] + hq * m_lead[1];
    }
  if (has_mask) {
    a.masks[0].data = mask.data();
    a.masks[0].kind = mask_bool ? MaskKind::boolean : MaskKind::additive;
    a.masks[0].offset = offsets.data() + 3 * a.batch_heads;
    a.masks[0].stride_l = m_stride_l;
    a.masks[0].stride_s = m_stride_s;
  }
  a.q_offset = offsets.data();
  a.k_offset = offsets.data() + a.batch_heads;
  a.v_offset = offsets.data() + 2 * a.batch_heads;
  a.q = static_cast<const T*>(q.data());
  a.k = static_cast<const T*>(k.data());  // uint16 data when storage != same (read as such by the kernel)
  a.v = static_cast<const T*>(v.data());
  a.kv_storage = storage;
  a.out = static_cast<T*>(out.mutable_data());
  a.out_stride_l = value_dim;
  a.out_stride_h = checked_mul(q_len, value_dim);
  a.out_stride_b = checked_mul(num_heads, a.out_stride_h);
  {
    py::gil_scoped_release release;
    scaled_dot_product_attention<T>(a, num_threads);
  }
  return std::move(out);
}

// 1 for float16, 2 for bfloat16 (ml_dtypes), in native byte order, else 0: _api._is_half.
int half_storage_of(const py::dtype& dt) {
  if (dt.itemsize() != 2) return 0;
  static PyObject* const f16 = py::dtype("float16").release().ptr();  // NumPy's own, lives forever
  if (dt.ptr() == f16) return 1;
  // bfloat16 is not NumPy's: recognised by name the first time, then by identity.
  static PyObject* bf16 = nullptr;
  if (dt.ptr() == bf16) return 2;
  if (bf16 != nullptr || dt.kind() != 'V') return 0;
  if (py::str(dt.attr("name")).cast<std::string>() != "bfloat16" || !dt.attr("isnative").cast<bool>()) return 0;
  bf16 = py::object(dt).release().ptr();  // kept alive, like f16
  return 2;
}

// sdpa_simple for float16 / bfloat16 q, k, v: what the general path does with them, without its
// ~100 us of interpreter time (a decode step over a 1k-token cache takes ~200 us): q widened to a
// float32 copy, K and V read in place as 16-bit storage (converted a key block at a time by the
// kernels), the float32 result rounded into the input dtype (into out= when given). Bool masks only
// (a 16-bit float mask is widened by the general path); anything else returns None like
// sdpa_simple_t.
py::object sdpa_simple_half(const py::array& q, const py::array& k, const py::array& v, const py::object& mask_obj,
                            const py::object& out_obj, int causal, bool gqa, double scale, bool default_scale,
                            int num_threads, int storage) {
  std::vector<py::ssize_t> out_shape = simple_out_shape(q, k, v);
  if (num_threads < 0 || out_shape.empty()) return py::none();
  const py::ssize_t nd = q.ndim();
  // q any view whose rows (last axis) are contiguous, as a (batch, seq, heads, head_dim) array
  // viewed heads first; widened row by row below.
  if (reinterpret_cast<uintptr_t>(q.data()) % 2 != 0) return py::none();
  for (py::ssize_t d = 0; d < nd; ++d)
    if (q.strides(d) < 0 || q.strides(d) % 2 != 0) return py::none();
  if (q.shape(nd - 1) > 1 && q.strides(nd - 1) != 2) return py::none();
  if (!mask_obj.is_none() && !(exact_ndarray(mask_obj) && is_bool(py::reinterpret_borrow<py::array>(mask_obj))))
    return py::none();
  const std::vector<py::ssize_t> shape(q.shape(), q.shape() + nd);
  py::object out_or_none = py::none();
  if (!out_obj.is_none()) {  // the general path's conditions for converting straight into out=
    out_or_none = accepted_out(out_obj, q.dtype(), out_shape, {q, k, v, mask_obj});
    if (out_or_none.is_none()) return py::none();
    // The conversion's scalar tail writes whole elements: a misaligned out= goes the general way.
    if (reinterpret_cast<uintptr_t>(py::reinterpret_borrow<py::array>(out_or_none).data()) % 2 != 0)
      return py::none();
  }
  const bool bfloat16 = storage == 2;
  const py::object q_or_none = on_line_or_none(py::dtype::of<float>(), shape, "query");
  if (q_or_none.is_none()) return py::none();
  py::array wide_q = py::reinterpret_borrow<py::array>(q_or_none);
  {
    const uint16_t* src = static_cast<const uint16_t*>(q.data());
    float* dst = static_cast<float*>(wide_q.mutable_data());
    const bool contiguous = (q.flags() & py::array::c_style) != 0;
    const int64_t row = q.shape(nd - 1), rows = row > 0 ? int64_t(q.size()) / row : 0;
    int64_t q_shape[4], q_strides[4];  // elements
    for (py::ssize_t d = 0; d < nd; ++d) {
      q_shape[d] = q.shape(d);
      q_strides[d] = q.strides(d) / 2;
    }
    py::gil_scoped_release release;
    if (contiguous) {
      convert_half(src, dst, int64_t(q.size()), num_threads, bfloat16);
    } else {
      for (int64_t r = 0; r < rows; ++r) {  // row r's element offset from its index over the leading axes
        int64_t at = 0;
        for (int64_t d = nd - 2, i = r; d >= 0; --d) {
          at += i % q_shape[d] * q_strides[d];
          i /= q_shape[d];
        }
        convert_half(src + at, dst + r * row, row, 1, bfloat16);
      }
    }
  }
  py::object result = sdpa_simple_t<float>(wide_q, k, v, mask_obj, py::none(), causal, gqa, scale, default_scale,
                                           num_threads, Storage(storage));
  if (result.is_none()) return result;
  const py::array wide_out = py::reinterpret_borrow<py::array>(result);
  if (out_or_none.is_none()) out_or_none = on_line_or_none(q.dtype(), out_shape, "out");
  if (out_or_none.is_none()) return py::none();
  py::array out = py::reinterpret_borrow<py::array>(out_or_none);
  {
    py::gil_scoped_release release;
    convert_half(static_cast<const float*>(wide_out.data()), static_cast<uint16_t*>(out.mutable_data()),
                 int64_t(wide_out.size()), num_threads, bfloat16);
  }
  return std::move(out);
}

py::object sdpa_simple(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj, int causal,
                       bool gqa, const py::object& scale, int num_threads, const py::object& mask,
                       const py::object& out) {
  for (const py::object* o : {&q_obj, &k_obj, &v_obj})
    if (!exact_ndarray(*o)) return py::none();
  const py::array q = py::reinterpret_borrow<py::array>(q_obj);
  const py::array k = py::reinterpret_borrow<py::array>(k_obj);
  const py::array v = py::reinterpret_borrow<py::array>(v_obj);
  if (!same_dtype(q.dtype(), k.dtype()) || !same_dtype(q.dtype(), v.dtype())) return py::none();
  const bool default_scale = scale.is_none();
  if (!default_scale && !PyFloat_CheckExact(scale.ptr())) return py::none();
  const double s = default_scale ? 1.0 : scale.cast<double>();
  if (is_float32(q)) return sdpa_simple_t<float>(q, k, v, mask, out, causal, gqa, s, default_scale, num_threads);
  if (is_float64(q)) return sdpa_simple_t<double>(q, k, v, mask, out, causal, gqa, s, default_scale, num_threads);
  if (const int half = half_storage_of(q.dtype()))
    return sdpa_simple_half(q, k, v, mask, out, causal, gqa, s, default_scale, num_threads, half);
  return py::none();
}

}  // namespace

void bind_mha(py::module_& m);  // bindings_mha.cpp
void bind_runtime(py::module_& m);  // bindings_runtime.cpp

}  // namespace pyattn

PYBIND11_MODULE(_core, m) {
  using namespace pyattn;
  m.doc() = "pyattn compiled core (private: use the functions of the pyattn package)";
  bind_runtime(m);

  m.def("sdpa", &sdpa, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("out"),
        py::arg("weights"), py::arg("offsets"), py::arg("strides"), py::arg("dims"), py::arg("causal"),
        py::arg("causal_offset"), py::arg("scale"), py::arg("num_threads"), py::arg("kv_storage") = 0,
        py::arg("kv_lens") = py::none(), py::arg("causal_offsets") = py::none(), py::arg("num_heads") = 0,
        "Low-level attention entry; arguments prepared by pyattn._api.");
  m.def("sdpa_simple", &sdpa_simple, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("causal"),
        py::arg("enable_gqa"), py::arg("scale"), py::arg("num_threads"), py::arg("attn_mask") = py::none(), py::arg("out") = py::none(),
        "scaled_dot_product_attention for plain q/k/v only (0/1/2 = no/upper-left/lower-right causal); "
        "None when the call needs the general path.");
  bind_mha(m);
  m.def("empty_on_line", &array_on_line, py::arg("dtype"), py::arg("shape"), py::arg("name"),
        "A fresh uninitialised C-contiguous array that starts on a 64-byte cache line (a view into a "
        "slightly larger uint8 array); `name` is the argument an error names.");
  m.def(
      "_convert_half",
      [](const py::array& src, const py::array& dst, int threads, bool bfloat16) {
        const bool widen = same_dtype(src.dtype(), py::dtype::of<uint16_t>()) && same_dtype(dst.dtype(), py::dtype::of<float>());
        const bool narrow = same_dtype(src.dtype(), py::dtype::of<float>()) && same_dtype(dst.dtype(), py::dtype::of<uint16_t>());
        if (!widen && !narrow) throw py::type_error("_convert_half: expected uint16 -> float32 or float32 -> uint16 arrays");
        if (!(src.flags() & py::array::c_style) || !(dst.flags() & py::array::c_style) || !dst.writeable())
          throw py::value_error("_convert_half: src and dst must be C-contiguous, dst writeable");
        if (src.size() != dst.size()) throw py::value_error("_convert_half: src and dst must have the same size");
        // The scalar tails read and write whole elements: a float16 view at an odd address would be a
        // misaligned access (undefined behaviour; UBSan stops there).
        auto aligned = [](const py::array& x) { return reinterpret_cast<uintptr_t>(x.data()) % size_t(x.itemsize()) == 0; };
        const int64_t n = int64_t(src.size());
        if (n > 0 && (!aligned(src) || !aligned(dst)))  // NumPy calls an empty array aligned wherever it points
          throw py::value_error("_convert_half: src and dst must be aligned to their element size");
        if (widen) {
          const uint16_t* s = static_cast<const uint16_t*>(src.data());
          float* d = static_cast<float*>(const_cast<void*>(dst.data()));
          py::gil_scoped_release release;
          convert_half(s, d, n, threads, bfloat16);
        } else {
          const float* s = static_cast<const float*>(src.data());
          uint16_t* d = static_cast<uint16_t*>(const_cast<void*>(dst.data()));
          py::gil_scoped_release release;
          convert_half(s, d, n, threads, bfloat16);
        }
      },
      py::arg("src"), py::arg("dst"), py::arg("num_threads") = 0, py::arg("bfloat16") = false,
      "float16 bits (uint16) <-> float32, element by element as IEEE 754 rounds (to nearest even); with "
      "bfloat16=True bfloat16 bits, rounded as ml_dtypes rounds (to nearest even, NaN to the quiet NaN).");
#if defined(PYATTN_VERSION)
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
