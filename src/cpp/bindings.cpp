// SPDX-License-Identifier: MIT
// pybind11 module pyattn._core: a translator between NumPy arrays and the driver.
//
// src/pyattn/_api.py owns the user-facing contract (shapes, broadcasting, dtype policy, messages).
// This file re-checks every invariant the C++ side relies on, cheaply and before the GIL is
// released: dtypes, output layout, and that every row the kernels will touch lies inside the array it
// belongs to (so no combination of arguments can make the core read or write out of bounds). Then it
// fills AttnArgs, releases the GIL and calls the driver. No dtype conversion happens here: a silent
// copy would hide layout bugs.

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

namespace py = pybind11;

namespace pyattn {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t checked_mul(int64_t a, int64_t b) {
#if defined(_MSC_VER) && !defined(__clang__)
  if (a != 0 && b != 0) {
    const bool neg = (a < 0) != (b < 0);
    const uint64_t ua = a < 0 ? 0 - uint64_t(a) : uint64_t(a), ub = b < 0 ? 0 - uint64_t(b) : uint64_t(b);
    if (ua > (neg ? uint64_t(INT64_MAX) + 1 : uint64_t(INT64_MAX)) / ub) fail("size computation overflows int64");
  }
  return a * b;
#else
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail("size computation overflows int64");
  return r;
#endif
}

int64_t checked_add(int64_t a, int64_t b) {
#if defined(_MSC_VER) && !defined(__clang__)
  if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) fail("size computation overflows int64");
  return a + b;
#else
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail("size computation overflows int64");
  return r;
#endif
}

// Byte range [lo, hi) that an array's elements occupy, relative to its data pointer.
struct Extent {
  int64_t lo = 0, hi = 0;
  bool empty = false;
};

Extent extent_of(const py::array& arr) {
  Extent e;
  int64_t lo = 0, hi = 0;
  for (py::ssize_t d = 0; d < arr.ndim(); ++d) {
    const int64_t n = arr.shape(d), st = arr.strides(d);
    if (n == 0) e.empty = true;
    const int64_t span = checked_mul(n > 0 ? n - 1 : 0, st);
    if (span < 0) lo = checked_add(lo, span);
    else hi = checked_add(hi, span);
  }
  e.lo = lo;
  e.hi = checked_add(hi, arr.itemsize());
  return e;
}

// Checks that for every bh, the 2-D block base + off[bh] + r*stride_r + c*stride_c (r < rows,
// c < cols, elements of `itemsize` bytes) lies inside `arr`.
void check_block(const char* name, const py::array& arr, const int64_t* off, int64_t count, int64_t rows,
                 int64_t stride_r, int64_t cols, int64_t stride_c) {
  if (rows == 0 || cols == 0 || count == 0) return;
  const Extent e = extent_of(arr);
  if (e.empty) fail(std::string(name) + ": empty array cannot supply the requested rows");
  const int64_t item = arr.itemsize();
  const int64_t span_r = checked_mul(rows - 1, stride_r), span_c = checked_mul(cols - 1, stride_c);
  const int64_t min_rel = (span_r < 0 ? span_r : 0) + (span_c < 0 ? span_c : 0);
  const int64_t max_rel = (span_r > 0 ? span_r : 0) + (span_c > 0 ? span_c : 0);
  for (int64_t n = 0; n < count; ++n) {
    const int64_t lo = checked_mul(checked_add(off[n], min_rel), item);
    const int64_t hi = checked_add(checked_mul(checked_add(off[n], max_rel), item), item);
    if (lo < e.lo || hi > e.hi) fail(std::string(name) + ": offsets/strides reach outside the array");
  }
}

bool is_float32(const py::array& a) { return a.dtype().is(py::dtype::of<float>()); }
bool is_float64(const py::array& a) { return a.dtype().is(py::dtype::of<double>()); }
bool is_bool(const py::array& a) { return a.dtype().kind() == 'b' && a.itemsize() == 1; }
bool is_int64(const py::array& a) { return a.dtype().is(py::dtype::of<int64_t>()); }

void check_aligned(const char* name, const py::array& arr) {
  if (arr.size() == 0) return;  // nothing is read from an empty array
  const int64_t item = arr.itemsize();
  if (reinterpret_cast<uintptr_t>(arr.data()) % uintptr_t(item) != 0)
    fail(std::string(name) + ": data pointer is not aligned to its element size");
  for (py::ssize_t d = 0; d < arr.ndim(); ++d)
    if (arr.shape(d) > 1 && arr.strides(d) % item != 0) fail(std::string(name) + ": strides must be multiples of the element size");
}

void check_output(const char* name, const py::array& arr, const py::dtype& dt, int64_t expected_size) {
  if (!arr.dtype().is(dt)) fail(std::string(name) + ": dtype must match the inputs");
  if (!(arr.flags() & py::array::c_style)) fail(std::string(name) + ": must be C-contiguous");
  if (!arr.writeable()) fail(std::string(name) + ": must be writeable");
  if (arr.size() != expected_size) fail(std::string(name) + ": wrong number of elements");
}

// A mask operand after its checks: bool (uint8) or the inputs' float dtype, every (bh, i, j) the kernel
// will read inside the array.
template <class T>
MaskSlot mask_slot(const char* name, const py::object& obj, const py::dtype& dt, const int64_t* offset,
                   int64_t stride_l, int64_t stride_s, bool true_forbids, int64_t batch_heads, int64_t q_len,
                   int64_t kv_len) {
  MaskSlot m;
  if (obj.is_none()) return m;
  const py::array mask = py::reinterpret_borrow<py::array>(obj);
  if (is_bool(mask)) m.kind = MaskKind::boolean;
  else if (mask.dtype().is(dt)) m.kind = MaskKind::additive;
  else fail(std::string(name) + ": dtype must be bool or the inputs' dtype");
  check_aligned(name, mask);
  check_block(name, mask, offset, batch_heads, q_len, stride_l, kv_len, stride_s);
  m.data = mask.data();
  m.true_forbids = true_forbids;
  m.offset = offset;
  m.stride_l = stride_l;
  m.stride_s = stride_s;
  return m;
}

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
    if (!q.dtype().is(k.dtype()) || !q.dtype().is(v.dtype())) fail("query, key and value must share one dtype");
  } else {
    // 16-bit K/V are passed as uint16 views; the kernels convert them a block at a time.
    if (!is_float32(q)) fail("query: must be float32 with float16/bfloat16 keys and values");
    if (!k.dtype().is(py::dtype::of<uint16_t>()) || !v.dtype().is(py::dtype::of<uint16_t>()))
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

// The common call, q/k/v of one float dtype with equal leading shapes, at most a broadcast mask and
// an out= array (no weights, 16-bit or copied inputs): checked and launched here without the Python layer's
// general machinery (~15 us of interpreter time per call). Returns None for anything outside that
// case, including every error, so the Python layer takes the general path and raises its usual
// message; for calls inside it, the arguments the kernels see are exactly the general path's.
template <class T>
py::object sdpa_simple_t(const py::array& q, const py::array& k, const py::array& v, const py::object& mask_obj,
                         const py::object& out_obj, int causal, bool gqa, double scale, bool default_scale,
                         int num_threads) {
  const py::ssize_t nd = q.ndim();
  if ((nd != 3 && nd != 4) || k.ndim() != nd || v.ndim() != nd) return py::none();
  for (const py::array* x : {&q, &k, &v}) {
    const py::ssize_t item = x->itemsize();
    if (reinterpret_cast<uintptr_t>(x->data()) % uintptr_t(item) != 0) return py::none();
    for (py::ssize_t d = 0; d < nd; ++d) {
      if (x->shape(d) == 0) return py::none();  // empty inputs: the general path
      if (x->strides(d) < 0 || x->strides(d) % item != 0) return py::none();
    }
    if (x->shape(nd - 1) > 1 && x->strides(nd - 1) != item) return py::none();
  }
  const py::ssize_t h = nd - 3;  // the heads axis
  if (nd == 4 && (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0))) return py::none();
  const int64_t batch = nd == 4 ? q.shape(0) : 1, num_heads = q.shape(h), kv_heads = k.shape(h);
  const int64_t q_len = q.shape(h + 1), kv_len = k.shape(h + 1), head_dim = q.shape(h + 2);
  const int64_t value_dim = v.shape(h + 2);
  if (k.shape(h + 2) != head_dim || v.shape(h + 1) != kv_len || v.shape(h) != kv_heads) return py::none();
  if (gqa ? num_heads % kv_heads != 0 : num_heads != kv_heads) return py::none();
  if (!default_scale && !std::isfinite(scale)) return py::none();
  if (num_threads < 0) return py::none();
  // A mask: bool or q's dtype, at least (L, S), every axis 1 or the full size (broadcast through
  // zero strides), non-negative strides, aligned.
  const int64_t full[4] = {batch, num_heads, q_len, kv_len};
  const int64_t* full_tail = nd == 4 ? full : full + 1;
  py::array mask;
  const bool has_mask = !mask_obj.is_none();
  bool mask_bool = false;
  int64_t m_lead[2] = {0, 0}, m_stride_l = 0, m_stride_s = 0;
  if (has_mask) {
    if (!exact_ndarray(mask_obj)) return py::none();
    mask = py::reinterpret_borrow<py::array>(mask_obj);
    mask_bool = is_bool(mask);
    if (!mask_bool && !mask.dtype().is(q.dtype())) return py::none();
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
  std::vector<py::ssize_t> shape(q.shape(), q.shape() + nd);
  shape[size_t(nd - 1)] = value_dim;
  py::array out;
  if (!out_obj.is_none()) {
    if (!exact_ndarray(out_obj)) return py::none();
    out = py::reinterpret_borrow<py::array>(out_obj);
    if (!out.dtype().is(q.dtype()) || out.ndim() != nd || !std::equal(shape.begin(), shape.end(), out.shape()))
      return py::none();
    if (!(out.flags() & py::array::c_style) || !out.writeable()) return py::none();
    auto bounds = [](const py::array& x) {
      const Extent e = extent_of(x);
      const char* base = static_cast<const char*>(x.data());
      return std::make_pair(base + e.lo, base + e.hi);
    };
    const auto ob = bounds(out);
    const py::array* mask_ptr = has_mask ? &mask : nullptr;
    for (const py::array* x : {&q, &k, &v, mask_ptr}) {
      if (x == nullptr) continue;
      const auto xb = bounds(*x);
      if (xb.first < ob.second && ob.first < xb.second) return py::none();
    }
  } else {
    try {
      out = py::array_t<T>(shape);
    } catch (const py::error_already_set&) {
      return py::none();
    } catch (const std::bad_alloc&) {
      return py::none();
    }
  }

  auto elems = [](const py::array& x, py::ssize_t d) { return int64_t(x.strides(d) / x.itemsize()); };
  AttnArgs<T> a;
  a.batch_heads = checked_mul(batch, num_heads);
  a.num_heads = num_heads;
  a.group = num_heads / kv_heads;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.head_dim = head_dim;
  a.value_dim = value_dim;
  a.q_stride_l = q_len > 1 ? elems(q, h + 1) : 0;  // as _api._row_stride
  a.k_stride_s = kv_len > 1 ? elems(k, h + 1) : 0;
  a.v_stride_s = kv_len > 1 ? elems(v, h + 1) : 0;
  a.causal = causal != 0;
  a.causal_offset = causal == 2 ? kv_len - q_len : 0;
  a.scale = default_scale ? 1.0 / std::sqrt(double(head_dim)) : scale;
  std::vector<int64_t> offsets(size_t(4 * a.batch_heads));
  // Element strides of the batch and head axes (0 where the axis has size 1, as _api._lead_strides).
  auto lead = [&](const py::array& x, py::ssize_t d) { return x.shape(d) > 1 ? elems(x, d) : int64_t(0); };
  const int64_t qs[2] = {nd == 4 ? lead(q, 0) : 0, lead(q, h)}, ks[2] = {nd == 4 ? lead(k, 0) : 0, lead(k, h)},
                vs[2] = {nd == 4 ? lead(v, 0) : 0, lead(v, h)};
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
  a.k = static_cast<const T*>(k.data());
  a.v = static_cast<const T*>(v.data());
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

py::object sdpa_simple(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj, int causal,
                       bool gqa, const py::object& scale, int num_threads, const py::object& mask,
                       const py::object& out) {
  for (const py::object* o : {&q_obj, &k_obj, &v_obj})
    if (!exact_ndarray(*o)) return py::none();
  const py::array q = py::reinterpret_borrow<py::array>(q_obj);
  const py::array k = py::reinterpret_borrow<py::array>(k_obj);
  const py::array v = py::reinterpret_borrow<py::array>(v_obj);
  if (!q.dtype().is(k.dtype()) || !q.dtype().is(v.dtype())) return py::none();
  const bool default_scale = scale.is_none();
  if (!default_scale && !PyFloat_CheckExact(scale.ptr())) return py::none();
  const double s = default_scale ? 1.0 : scale.cast<double>();
  if (is_float32(q)) return sdpa_simple_t<float>(q, k, v, mask, out, causal, gqa, s, default_scale, num_threads);
  if (is_float64(q)) return sdpa_simple_t<double>(q, k, v, mask, out, causal, gqa, s, default_scale, num_threads);
  return py::none();
}

template <class T>
py::array_t<T> pack_weights_t(const py::array& w) {
  const KernelSet<T>& ks = active_set<T>();
  const int64_t n = w.shape(0), k = w.shape(1), panel = ks.gemm_panel;
  const int64_t panels = (n + panel - 1) / panel;
  py::array_t<T> packed(std::vector<py::ssize_t>{py::ssize_t(checked_mul(checked_mul(panels, k), panel))});
  check_aligned("weight", w);
  if (w.size() > 0 && k > 1 && w.strides(1) != py::ssize_t(sizeof(T))) fail("weight: last axis must be contiguous");
  const T* src = static_cast<const T*>(w.data());
  T* dst = packed.mutable_data();
  const int64_t w_stride = n > 1 ? w.strides(0) / int64_t(sizeof(T)) : 0;
  py::gil_scoped_release release;
  pack_weights<T>(src, w_stride, n, k, panel, dst);
  return packed;
}

// Packs a (n, k) weight for the active ISA's GEMM; returns (packed, panel).
py::tuple pack_weights_py(const py::array& w) {
  if (w.ndim() != 2) fail("weight: expected a 2-D array (out_features, in_features)");
  if (is_float32(w)) return py::make_tuple(pack_weights_t<float>(w), active_set<float>().gemm_panel);
  if (is_float64(w)) return py::make_tuple(pack_weights_t<double>(w), active_set<double>().gemm_panel);
  fail("weight: dtype must be float32 or float64");
}

template <class T>
void linear_t(const py::array& x, const py::array& packed, int64_t panel, int64_t n, const py::object& bias_obj,
              py::array& out, int num_threads) {
  const KernelSet<T>& ks = active_set<T>();
  if (panel != ks.gemm_panel) fail("packed weight was packed for another ISA; pack it again");
  if (x.ndim() != 2 || out.ndim() != 2) fail("x and out must be 2-D");
  const int64_t m = x.shape(0), k = x.shape(1);
  if (out.shape(0) != m || out.shape(1) != n) fail("out: shape must be (m, n)");
  if (!packed.dtype().is(x.dtype()) || !out.dtype().is(x.dtype())) fail("packed and out must share x's dtype");
  if (packed.ndim() != 1 || packed.size() != checked_mul(checked_mul((n + panel - 1) / panel, k), panel) ||
      !(packed.flags() & py::array::c_style))
    fail("packed: size does not match (n, k)");
  check_aligned("x", x);
  if (x.size() > 0 && k > 1 && x.strides(1) != py::ssize_t(sizeof(T))) fail("x: last axis must be contiguous");
  if (!(out.flags() & py::array::c_style) || !out.writeable()) fail("out: must be C-contiguous and writeable");
  GemmArgs<T> g;
  g.a = static_cast<const T*>(x.data());
  g.a_stride = m > 1 ? x.strides(0) / int64_t(sizeof(T)) : 0;
  g.packed = static_cast<const T*>(packed.data());
  if (!bias_obj.is_none()) {
    const py::array bias = py::reinterpret_borrow<py::array>(bias_obj);
    if (!bias.dtype().is(x.dtype()) || bias.ndim() != 1 || bias.shape(0) != n || !(bias.flags() & py::array::c_style))
      fail("bias: expected a contiguous 1-D array of n elements and x's dtype");
    g.bias = static_cast<const T*>(bias.data());
  }
  g.c = static_cast<T*>(out.mutable_data());
  g.c_stride = n;
  g.m = m;
  g.n = n;
  g.k = k;
  py::gil_scoped_release release;
  linear<T>(g, num_threads);
}

void linear_py(const py::array& x, const py::array& packed, int64_t panel, int64_t n, const py::object& bias,
               py::array out, int num_threads) {
  if (is_float32(x)) return linear_t<float>(x, packed, panel, n, bias, out, num_threads);
  if (is_float64(x)) return linear_t<double>(x, packed, panel, n, bias, out, num_threads);
  fail("x: dtype must be float32 or float64");
}

// A row matrix input (rows, cols) of the MHA: 2-D, dtype T, last axis contiguous; returns its row stride.
template <class T>
int64_t row_matrix(const char* name, const py::array& x, int64_t rows, int64_t cols) {
  if (x.ndim() != 2 || x.shape(0) != rows || x.shape(1) != cols) fail(std::string(name) + ": wrong shape");
  if (!x.dtype().is(py::dtype::of<T>())) fail(std::string(name) + ": wrong dtype");
  check_aligned(name, x);
  if (cols > 1 && x.strides(1) != py::ssize_t(sizeof(T))) fail(std::string(name) + ": last axis must be contiguous");
  return rows > 1 ? x.strides(0) / int64_t(sizeof(T)) : 0;
}

template <class T>
const T* packed_weight(const char* name, const py::array& p, int64_t n, int64_t k) {
  const int64_t panel = active_set<T>().gemm_panel;
  if (!p.dtype().is(py::dtype::of<T>()) || p.ndim() != 1 || !(p.flags() & py::array::c_style) ||
      p.size() != checked_mul(checked_mul((n + panel - 1) / panel, k), panel))
    fail(std::string(name) + ": packed weight does not match its shape or the active ISA; pack it again");
  return static_cast<const T*>(p.data());
}

template <class T>
const T* optional_bias(const char* name, const py::object& obj, int64_t n) {
  if (obj.is_none()) return nullptr;
  const py::array b = py::reinterpret_borrow<py::array>(obj);
  if (!b.dtype().is(py::dtype::of<T>()) || b.ndim() != 1 || b.shape(0) != n || !(b.flags() & py::array::c_style))
    fail(std::string(name) + ": expected a contiguous 1-D array of " + std::to_string(n) + " elements");
  return static_cast<const T*>(b.data());
}

template <class T>
void run_mha(const py::array& xq, const py::array& xk, const py::array& xv, const py::tuple& w,
             const std::vector<int64_t>& dims, const py::list& masks, int64_t causal, int64_t causal_offset,
             py::array& out, const py::object& weights_obj, int num_threads) {
  MhaArgs<T> m;
  m.batch = dims[0];
  m.q_len = dims[1];
  m.kv_len = dims[2];
  m.embed_dim = dims[3];
  m.kdim = dims[4];
  m.vdim = dims[5];
  m.num_heads = dims[6];
  m.num_kv_heads = dims[7];
  m.head_dim = dims[8];
  for (int64_t d : dims)
    if (d < 0) fail("dims must be non-negative");
  if (m.num_heads < 1 || m.num_kv_heads < 1 || m.num_heads % m.num_kv_heads != 0)
    fail("num_heads must be a positive multiple of num_kv_heads");
  if (m.num_heads * m.head_dim != m.embed_dim) fail("num_heads * head_dim must equal embed_dim");
  const int64_t q_rows = checked_mul(m.batch, m.q_len), kv_rows = checked_mul(m.batch, m.kv_len);
  m.xq_stride = row_matrix<T>("query", xq, q_rows, m.embed_dim);
  m.xk_stride = row_matrix<T>("key", xk, kv_rows, m.kdim);
  m.xv_stride = row_matrix<T>("value", xv, kv_rows, m.vdim);
  m.xq = static_cast<const T*>(xq.data());
  m.xk = static_cast<const T*>(xk.data());
  m.xv = static_cast<const T*>(xv.data());
  if (w.size() != 8) fail("weights must be a tuple of 8 entries");
  const int64_t kv_width = checked_mul(m.num_kv_heads, m.head_dim);
  m.packed_q = packed_weight<T>("q_proj_weight", w[0].cast<py::array>(), m.embed_dim, m.embed_dim);
  m.packed_k = packed_weight<T>("k_proj_weight", w[1].cast<py::array>(), kv_width, m.kdim);
  m.packed_v = packed_weight<T>("v_proj_weight", w[2].cast<py::array>(), kv_width, m.vdim);
  m.packed_o = packed_weight<T>("out_proj_weight", w[3].cast<py::array>(), m.embed_dim, m.embed_dim);
  m.bias_q = optional_bias<T>("q_proj_bias", w[4], m.embed_dim);
  m.bias_k = optional_bias<T>("k_proj_bias", w[5], kv_width);
  m.bias_v = optional_bias<T>("v_proj_bias", w[6], kv_width);
  m.bias_o = optional_bias<T>("out_proj_bias", w[7], m.embed_dim);

  const int64_t batch_heads = checked_mul(m.batch, m.num_heads);
  if (masks.size() > 2) fail("at most two masks");
  std::vector<py::array_t<int64_t>> keep;  // offsets arrays stay referenced by `masks`
  for (size_t x = 0; x < masks.size(); ++x) {
    const py::tuple t = masks[x].cast<py::tuple>();
    if (t.size() != 6) fail("mask entries are (name, array, offsets, stride_l, stride_s, true_forbids)");
    const std::string name = t[0].cast<std::string>();
    const py::array_t<int64_t> offsets = t[2].cast<py::array_t<int64_t>>();
    if (offsets.ndim() != 1 || offsets.shape(0) != batch_heads || !(offsets.flags() & py::array::c_style))
      fail(name + ": offsets must be a contiguous int64 array of batch * num_heads entries");
    keep.push_back(offsets);
    m.masks[x] = mask_slot<T>(name.c_str(), t[1], py::dtype::of<T>(), keep.back().data(), t[3].cast<int64_t>(),
                              t[4].cast<int64_t>(), t[5].cast<bool>(), batch_heads, m.q_len, m.kv_len);
  }
  m.causal = causal != 0;
  m.causal_offset = causal_offset;
  check_output("out", out, py::dtype::of<T>(), checked_mul(q_rows, m.embed_dim));
  m.out = static_cast<T*>(out.mutable_data());
  if (!weights_obj.is_none()) {
    py::array weights = py::reinterpret_borrow<py::array>(weights_obj);
    check_output("weights", weights, py::dtype::of<T>(), checked_mul(checked_mul(batch_heads, m.q_len), m.kv_len));
    m.weights = static_cast<T*>(weights.mutable_data());
  }
  if (num_threads < 0) fail("num_threads must be >= 1 (or 0 for the default)");
  py::gil_scoped_release release;
  multi_head_attention<T>(m, num_threads);
}

void mha_py(const py::array& xq, const py::array& xk, const py::array& xv, const py::tuple& w,
            const std::vector<int64_t>& dims, const py::list& masks, int64_t causal, int64_t causal_offset,
            py::array out, const py::object& weights, int num_threads) {
  if (dims.size() != 9) fail("dims must have 9 entries");
  if (is_float32(xq)) return run_mha<float>(xq, xk, xv, w, dims, masks, causal, causal_offset, out, weights, num_threads);
  if (is_float64(xq)) return run_mha<double>(xq, xk, xv, w, dims, masks, causal, causal_offset, out, weights, num_threads);
  fail("query: dtype must be float32 or float64");
}

std::vector<std::string> isa_list() {
  const char* names[8];
  const int n = available_isas(names, 8);
  return std::vector<std::string>(names, names + n);
}

std::string compiler_string() {
#if defined(__clang__)
  std::string v = __clang_version__;
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return "clang " + v;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
  return "msvc " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

void apply_env_isa() {
  const char* env = std::getenv("PYATTN_ISA");
  if (!env || !*env) return;
  if (!isa_compiled(env)) {
    std::string built;
    for (const auto& n : isa_list()) built += (built.empty() ? "" : ", ") + n;
    throw py::import_error("PYATTN_ISA='" + std::string(env) + "' is not an ISA this build of pyattn has; use one of: " + built);
  }
  if (!set_isa(env)) {
    std::string avail;
    for (const auto& n : isa_list()) avail += (avail.empty() ? "" : ", ") + n;
    throw py::import_error("PYATTN_ISA='" + std::string(env) + "' is not supported by this CPU; available: " + avail);
  }
}

}  // namespace
}  // namespace pyattn

PYBIND11_MODULE(_core, m) {
  using namespace pyattn;
  m.doc() = "pyattn compiled core (private: use the functions of the pyattn package)";
  apply_env_isa();

  m.def("sdpa", &sdpa, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"), py::arg("out"),
        py::arg("weights"), py::arg("offsets"), py::arg("strides"), py::arg("dims"), py::arg("causal"),
        py::arg("causal_offset"), py::arg("scale"), py::arg("num_threads"), py::arg("kv_storage") = 0,
        py::arg("kv_lens") = py::none(), py::arg("causal_offsets") = py::none(), py::arg("num_heads") = 0,
        "Low-level attention entry; arguments prepared by pyattn._api.");
  m.def("sdpa_simple", &sdpa_simple, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("causal"),
        py::arg("enable_gqa"), py::arg("scale"), py::arg("num_threads"), py::arg("attn_mask") = py::none(), py::arg("out") = py::none(),
        "scaled_dot_product_attention for plain q/k/v only (0/1/2 = no/upper-left/lower-right causal); "
        "None when the call needs the general path.");
  m.def("pack_weights", &pack_weights_py, py::arg("weight"),
        "Pack a (out_features, in_features) weight for the active ISA's GEMM; returns (packed, panel).");
  m.def("linear", &linear_py, py::arg("x"), py::arg("packed"), py::arg("panel"), py::arg("n"), py::arg("bias"),
        py::arg("out"), py::arg("num_threads"), "out = x @ W.T + bias with W packed by pack_weights.");
  m.def("mha", &mha_py, py::arg("xq"), py::arg("xk"), py::arg("xv"), py::arg("weights"), py::arg("dims"),
        py::arg("masks"), py::arg("causal"), py::arg("causal_offset"), py::arg("out"), py::arg("attn_weights"),
        py::arg("num_threads"), "Low-level multi-head attention entry; arguments prepared by pyattn._mha.");
  m.def("isa", []() { return std::string(active_isa()); }, "Name of the kernel ISA in use.");
  m.def("available_isas", &isa_list, "ISAs compiled into this build and supported by this CPU, worst to best.");
  m.def(
      "_set_isa",
      [](const std::string& name) {
        if (!isa_compiled(name.c_str())) throw py::value_error("isa: unknown ISA '" + name + "'");
        if (!set_isa(name.c_str())) throw py::value_error("isa: this CPU does not support '" + name + "'");
      },
      py::arg("name"), "Force a kernel ISA (for tests and benchmarks).");
  m.def("set_num_threads", [](int n) {
    if (n < 0) throw py::value_error("num_threads must be >= 1, or 0 to restore the default");
    set_default_num_threads(n);
  });
  m.def("get_num_threads", &default_num_threads);
  m.def("_set_prefetch", &set_prefetch, py::arg("mode"),
        "What the query tiles prefetch: -1 decided per call from the cache sizes (default), 0 nothing, "
        "1 always the next key block's K/V rows, 2 always the next work item's rows (for tests). "
        "Returns the previous mode.");
  m.def("_set_group_tiles", &set_group_tiles, py::arg("on"),
        "Whether the query tiles take the heads of a GQA group together (1, the default) or head by "
        "head (0, for tests). Returns the previous setting.");
  m.def("_set_packed_mask_limit", &set_packed_mask_limit, py::arg("nbytes"),
        "Largest packed (bit) copy of a boolean mask a call makes; 0 makes the kernels read mask bytes "
        "(for tests). Returns the previous limit.");
  m.def(
      "_convert_half",
      [](const py::array& src, const py::array& dst, int threads) {
        const bool widen = src.dtype().is(py::dtype::of<uint16_t>()) && dst.dtype().is(py::dtype::of<float>());
        const bool narrow = src.dtype().is(py::dtype::of<float>()) && dst.dtype().is(py::dtype::of<uint16_t>());
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
          convert_half(s, d, n, threads);
        } else {
          const float* s = static_cast<const float*>(src.data());
          uint16_t* d = static_cast<uint16_t*>(const_cast<void*>(dst.data()));
          py::gil_scoped_release release;
          convert_half(s, d, n, threads);
        }
      },
      py::arg("src"), py::arg("dst"), py::arg("num_threads") = 0,
      "float16 bits (uint16) <-> float32, element by element as IEEE 754 rounds (to nearest even).");
  m.def("cache_bytes", &cache_bytes, py::arg("level"),
        "Bytes of this CPU's level 1-3 data cache per core, from CPUID (0 where it does not say).");
  m.def("openmp_runtime", []() { return std::string(openmp_runtime()); });
  m.def("openmp_enabled", &openmp_enabled);
  m.def("compiler", &compiler_string);
  m.def("isa_flags", []() { return std::string(PYATTN_ISA_FLAGS); }, "Compiler flags of each ISA's kernels.");
  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds) {
        py::gil_scoped_release release;
        return fma_peak_gflops(threads, seconds);
      },
      py::arg("num_threads"), py::arg("seconds") = 0.5, "float32 FMA throughput of the active ISA, GFLOP/s.");
  m.def(
      "read_bandwidth_gbs",
      [](int threads, int64_t nbytes) {
        if (nbytes <= 0) throw py::value_error("nbytes must be positive");
        py::gil_scoped_release release;
        return read_bandwidth_gbs(threads, nbytes);
      },
      py::arg("num_threads"), py::arg("nbytes") = int64_t(1) << 30, "Streaming read bandwidth, GB/s (best of 5).");
  m.def(
      "read_buffers_gbs",
      [](const py::list& arrays, int threads) {
        std::vector<py::buffer_info> infos;
        std::vector<std::pair<const void*, int64_t>> spans;
        for (const auto& item : arrays) {
          infos.push_back(py::reinterpret_borrow<py::buffer>(item).request());
          const py::buffer_info& b = infos.back();
          int64_t expected = b.itemsize;
          for (int64_t d = b.ndim - 1; d >= 0; --d) {
            if (b.shape[size_t(d)] > 1 && b.strides[size_t(d)] != expected)
              throw py::value_error("arrays: every array must be C-contiguous");
            expected *= b.shape[size_t(d)];
          }
          spans.emplace_back(b.ptr, int64_t(b.size) * b.itemsize);
        }
        py::gil_scoped_release release;
        return read_buffers_gbs(spans, threads);
      },
      py::arg("arrays"), py::arg("num_threads"),
      "GB/s of reading these C-contiguous arrays once, each split across num_threads threads (best of 5).");
  m.attr("DECODE_MAX_Q_LEN") = pyattn::kDecodeMaxLen;
#if defined(PYATTN_VERSION)
  m.attr("__version__") = PYATTN_VERSION;
#endif
}
