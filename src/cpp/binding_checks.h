// SPDX-License-Identifier: MIT
// What the binding's translation units share (bindings_sdpa.cpp: attention; bindings_mha.cpp: the
// GEMM and the multi-head layer): how Python values become C++ ones. The options every entry takes
// (is_causal, scale, num_threads) are parsed here, once, with the messages the user sees; arrays are
// classified by dtype, checked (sizes whose byte counts overflow, element alignment, output layout,
// rows inside their array) and allocated on cache lines (array_on_line, the one aligned allocator).
// Every check runs before the GIL is released and throws std::invalid_argument (ValueError) or
// py::type_error (TypeError) naming the argument.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <climits>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention.h"
#include "parallel.h"

namespace py = pybind11;

namespace pyattn {

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

inline int64_t checked_mul(int64_t a, int64_t b) {
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

inline int64_t checked_add(int64_t a, int64_t b) {
#if defined(_MSC_VER) && !defined(__clang__)
  if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) fail("size computation overflows int64");
  return a + b;
#else
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail("size computation overflows int64");
  return r;
#endif
}

// Python's repr/str of an object, and the name of its type, for messages.
inline std::string repr_of(py::handle obj) { return py::repr(obj).cast<std::string>(); }
inline std::string str_of(py::handle obj) { return py::str(obj).cast<std::string>(); }
inline std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>();
}
inline std::string tuple_repr(const int64_t* dims, size_t n) {
  py::list items;
  for (size_t i = 0; i < n; ++i) items.append(dims[i]);
  return repr_of(py::tuple(items));
}
inline std::string tuple_repr(const std::vector<int64_t>& dims) { return tuple_repr(dims.data(), dims.size()); }

// A shape or a list of strides: at most kMaxDims entries (NumPy's limit), kept inline, so that
// describing a call allocates nothing.
constexpr size_t kMaxDims = 64;
struct Dims {
  int64_t v[kMaxDims];
  size_t n = 0;
  Dims() = default;
  Dims(std::initializer_list<int64_t> values) {
    for (int64_t x : values) push_back(x);
  }
  template <class I>
  Dims(const I* first, size_t count) {
    if (count > kMaxDims) throw std::invalid_argument("more than 64 dimensions");
    for (size_t i = 0; i < count; ++i) v[i] = int64_t(first[i]);
    n = count;
  }
  void push_back(int64_t x) {
    if (n == kMaxDims) throw std::invalid_argument("more than 64 dimensions");
    v[n++] = x;
  }
  void push_front(int64_t x) {
    push_back(0);
    for (size_t i = n - 1; i > 0; --i) v[i] = v[i - 1];
    v[0] = x;
  }
  size_t size() const { return n; }
  const int64_t* data() const { return v; }
  int64_t& operator[](size_t i) { return v[i]; }
  int64_t operator[](size_t i) const { return v[i]; }
  int64_t back() const { return v[n - 1]; }
  int64_t& back() { return v[n - 1]; }
  int64_t product() const {
    int64_t p = 1;
    for (size_t i = 0; i < n; ++i) p *= v[i];
    return p;
  }
  bool operator==(const Dims& o) const {
    if (n != o.n) return false;
    for (size_t i = 0; i < n; ++i)
      if (v[i] != o.v[i]) return false;
    return true;
  }
  bool operator!=(const Dims& o) const { return !(*this == o); }
};

inline Dims shape_of(const py::array& x) { return Dims(x.shape(), size_t(x.ndim())); }
// Whether a mask of shape m broadcasts to `full` without growing it (np.broadcast_shapes(m, full) == full).
inline bool broadcasts_to(const Dims& m, const Dims& full) {
  if (m.size() > full.size()) return false;
  for (size_t i = 0; i < m.size(); ++i) {
    const int64_t n = m[m.size() - 1 - i];
    if (n != 1 && n != full[full.size() - 1 - i]) return false;
  }
  return true;
}

inline std::string tuple_repr(const Dims& d) { return tuple_repr(d.data(), d.size()); }

// A fresh C-contiguous array of `shape` and `dtype` whose data starts `start` bytes past a cache
// line (0: on one), uninitialised unless `zero`: a view into a uint8 array (its base, which owns the
// memory). NumPy aligns its own allocations to 16 bytes only, and the kernels' 64-byte vector loads
// and stores of rows that straddle two lines cost two. A size whose byte count overflows, or that
// NumPy cannot allocate, is a ValueError naming `name`.
inline py::array array_on_line(const py::dtype& dtype, const Dims& shape, const char* name, int64_t start = 0,
                               bool zero = false) {
  int64_t bytes = int64_t(dtype.itemsize());
  try {
    for (size_t i = 0; i < shape.size(); ++i) bytes = checked_mul(bytes, shape[i]);
    bytes = checked_add(checked_add(bytes, start), int64_t(kCacheLine));
  } catch (const std::invalid_argument&) {
    fail(std::string(name) + ": the array's size in bytes overflows int64");
  }
  const auto& api = py::detail::npy_api::get();
  // Zero-filled memory through np.zeros (calloc: pages stay untouched until written, which matters
  // for a KV cache sized for its longest sequence), else uninitialised.
  py::ssize_t nbytes = py::ssize_t(bytes);
  PyObject* r =
      zero ? PyObject_CallFunction(py::module_::import("numpy").attr("zeros").ptr(), "ns", nbytes, "uint8")
           : api.PyArray_NewFromDescr_(api.PyArray_Type_, api.PyArray_DescrFromType_(py::detail::npy_api::NPY_UBYTE_),
                                       1, &nbytes, nullptr, nullptr, 0, nullptr);
  if (r == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_MemoryError)) throw py::error_already_set();
    PyErr_Clear();
    fail(std::string(name) + ": cannot allocate an array of shape " + tuple_repr(shape.data(), shape.size()) + " (" +
         std::to_string(bytes) + " bytes)");
  }
  py::array raw = py::reinterpret_steal<py::array>(r);
  const uintptr_t address = reinterpret_cast<uintptr_t>(raw.data());
  uint8_t* const first =
      static_cast<uint8_t*>(raw.mutable_data()) + (kCacheLine - address % kCacheLine) % kCacheLine + start;
  py::ssize_t dims[kMaxDims];
  for (size_t i = 0; i < shape.size(); ++i) dims[i] = py::ssize_t(shape[i]);
  // The view: NumPy's descriptor reference is stolen by PyArray_NewFromDescr; the base is stolen by
  // PyArray_SetBaseObject.
  py::object view = py::reinterpret_steal<py::object>(
      api.PyArray_NewFromDescr_(api.PyArray_Type_, dtype.inc_ref().ptr(), int(shape.size()), dims, nullptr, first,
                                py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_ |
                                    py::detail::npy_api::NPY_ARRAY_WRITEABLE_,
                                nullptr));
  if (!view) throw py::error_already_set();
  if (api.PyArray_SetBaseObject_(view.ptr(), raw.release().ptr()) != 0) throw py::error_already_set();
  return py::reinterpret_steal<py::array>(view.release());
}

inline py::array array_on_line(const py::dtype& dtype, const std::vector<py::ssize_t>& shape, const char* name,
                               int64_t start = 0, bool zero = false) {
  return array_on_line(dtype, Dims(shape.data(), shape.size()), name, start, zero);
}

// Byte range [lo, hi) that an array's elements occupy, relative to its data pointer.
struct Extent {
  int64_t lo = 0, hi = 0;
  bool empty = false;
};

inline Extent extent_of(const py::array& arr) {
  Extent e;
  int64_t lo = 0, hi = 0;
  for (py::ssize_t d = 0; d < arr.ndim(); ++d) {
    const int64_t n = arr.shape(d), st = arr.strides(d);
    if (n == 0) e.empty = true;
    const int64_t span = checked_mul(n > 0 ? n - 1 : 0, st);
    if (span < 0)
      lo = checked_add(lo, span);
    else
      hi = checked_add(hi, span);
  }
  e.lo = lo;
  e.hi = checked_add(hi, arr.itemsize());
  return e;
}

// Checks that for every bh, the 2-D block base + off[bh] + r*stride_r + c*stride_c (r < rows,
// c < cols, elements of `itemsize` bytes) lies inside `arr`.
inline void check_block(const char* name, const py::array& arr, const int64_t* off, int64_t count, int64_t rows,
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

// Whether two dtypes are the same type. Almost always they are the same object (NumPy's built-in
// descriptors are singletons), but an equal descriptor may be another object: an unpickled array's
// (pickle rebuilds the descriptor), or one that carries metadata. Identity alone refused such arrays
// ("query, key and value must share one dtype" for an unpickled float32 query), so after the cheap
// identity test the descriptors are compared by value, as Python's == does (byte order included).
inline bool same_dtype(const py::dtype& a, const py::dtype& b) { return a.is(b) || a.equal(b); }

inline bool is_float32(const py::array& a) { return same_dtype(a.dtype(), py::dtype::of<float>()); }
inline bool is_float64(const py::array& a) { return same_dtype(a.dtype(), py::dtype::of<double>()); }
inline bool is_bool(const py::array& a) { return a.dtype().kind() == 'b' && a.itemsize() == 1; }
inline bool is_int64(const py::array& a) { return same_dtype(a.dtype(), py::dtype::of<int64_t>()); }

[[noreturn]] inline void type_fail(const std::string& msg) { throw py::type_error(msg); }

// The floating dtypes pyattn computes with: float32 and float64 natively; float16 and bfloat16
// (ml_dtypes), in native byte order only, in float32. Anything else is `other`.
enum class FloatKind { other, f32, f64, f16, bf16 };

inline FloatKind float_kind(const py::dtype& dt) {
  static PyObject* const f32 = py::dtype::of<float>().release().ptr();  // NumPy's singletons, alive forever
  static PyObject* const f64 = py::dtype::of<double>().release().ptr();
  static PyObject* const f16 = py::dtype("float16").release().ptr();
  static PyObject* bf16 = nullptr;  // ml_dtypes' descriptor, recognised by name the first time
  PyObject* const p = dt.ptr();
  if (p == f32) return FloatKind::f32;
  if (p == f64) return FloatKind::f64;
  if (p == f16) return FloatKind::f16;
  if (p == bf16) return FloatKind::bf16;
  // An equal descriptor that is another object (an unpickled array's, one with metadata): compared
  // by value, byte order included, as Python's == does.
  if (dt.equal(py::reinterpret_borrow<py::dtype>(f32))) return FloatKind::f32;
  if (dt.equal(py::reinterpret_borrow<py::dtype>(f64))) return FloatKind::f64;
  if (dt.equal(py::reinterpret_borrow<py::dtype>(f16))) return FloatKind::f16;
  if (dt.itemsize() == 2 && dt.kind() == 'V' && str_of(dt.attr("name")) == "bfloat16" &&
      dt.attr("isnative").cast<bool>()) {
    if (bf16 == nullptr) bf16 = py::object(dt).release().ptr();
    return FloatKind::bf16;
  }
  return FloatKind::other;
}

inline bool is_half(FloatKind k) { return k == FloatKind::f16 || k == FloatKind::bf16; }
inline Storage storage_of(FloatKind k) {
  return k == FloatKind::f16 ? Storage::f16 : k == FloatKind::bf16 ? Storage::bf16 : Storage::same;
}

// np.bool_ and the numbers ABCs, looked up once (kept alive for the process).
inline bool is_numpy_bool(py::handle obj) {
  static PyObject* const type = py::object(py::module_::import("numpy").attr("bool_")).release().ptr();
  return PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(type));
}
enum class Abc { real, integral };
inline bool is_instance_of(py::handle obj, Abc abc) {
  static PyObject* const real = py::object(py::module_::import("numbers").attr("Real")).release().ptr();
  static PyObject* const integral = py::object(py::module_::import("numbers").attr("Integral")).release().ptr();
  const int r = PyObject_IsInstance(obj.ptr(), abc == Abc::real ? real : integral);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// num_threads: None -> 0 (the default), an int >= 1 (NumPy integers too; beyond a C int capped: the
// driver never starts more threads than it has work items).
inline int parse_threads(py::handle obj) {
  if (obj.is_none()) return 0;
  const bool exact_int = PyLong_CheckExact(obj.ptr());
  if (!exact_int && (PyBool_Check(obj.ptr()) || is_numpy_bool(obj) || !is_instance_of(obj, Abc::integral)))
    type_fail("num_threads: expected an int or None, got " + type_name(obj));
  const py::int_ value = exact_int ? py::reinterpret_borrow<py::int_>(obj)
                                   : py::int_(py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr())));
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow > 0 || n > INT_MAX) return INT_MAX;
  if (overflow < 0 || n < 1) fail("num_threads: must be >= 1, got " + str_of(value));
  return int(n);
}

// precision: "fast" (16-bit inputs may take bfloat16 dot products, AttnArgs::bf16_dots) or
// "highest" (float32 products throughout); true for "fast".
inline bool parse_precision(py::handle obj) {
  if (!py::isinstance<py::str>(obj)) type_fail("precision: expected 'fast' or 'highest', got " + type_name(obj));
  const std::string p = obj.cast<std::string>();
  if (p != "fast" && p != "highest") fail("precision: expected 'fast' or 'highest', got '" + p + "'");
  return p == "fast";
}

// is_causal: False, True / "upper_left" (query i sees keys j <= i), "lower_right" (j <= i + S - L).
enum class Causal { none, upper_left, lower_right };

inline Causal parse_causal(py::handle obj) {
  if (obj.ptr() == Py_False) return Causal::none;
  if (obj.ptr() == Py_True) return Causal::upper_left;
  if (is_numpy_bool(obj)) return obj.cast<bool>() ? Causal::upper_left : Causal::none;
  if (PyUnicode_Check(obj.ptr())) {
    const std::string s = obj.cast<std::string>();
    if (s == "upper_left") return Causal::upper_left;
    if (s == "lower_right") return Causal::lower_right;
  }
  fail("is_causal: expected False, True, 'upper_left' or 'lower_right', got " + repr_of(obj));
}

// The causal offset of an alignment: query i sees keys j <= i + offset.
inline int64_t causal_offset(Causal c, int64_t q_len, int64_t kv_len) {
  return c == Causal::lower_right ? kv_len - q_len : 0;
}

// scale: None -> 1/sqrt(head_dim) (1 for head_dim 0), else any finite real number.
inline double parse_scale(py::handle obj, int64_t head_dim) {
  if (obj.is_none()) return head_dim > 0 ? 1.0 / std::sqrt(double(head_dim)) : 1.0;
  double value;
  if (PyFloat_CheckExact(obj.ptr())) {
    value = PyFloat_AS_DOUBLE(obj.ptr());
  } else {
    if (PyBool_Check(obj.ptr()) || is_numpy_bool(obj) || !is_instance_of(obj, Abc::real))
      type_fail("scale: expected a real number or None, got " + type_name(obj));
    value = PyFloat_AsDouble(obj.ptr());
    if (value == -1.0 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
      PyErr_Clear();  // an int beyond a double: as infinite
      value = std::numeric_limits<double>::infinity();
    }
  }
  if (!std::isfinite(value)) fail("scale: must be finite, got " + str_of(py::float_(value)));
  return value;
}

// An argument's truth value (enable_gqa, return_weights, ...), as Python's `if x:`.
inline bool truthy(py::handle obj) {
  const int r = PyObject_IsTrue(obj.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// Exactly numpy.ndarray or a subclass of it.
inline bool is_ndarray(py::handle obj) { return py::isinstance<py::array>(obj); }

// Whether the kernels can read x through its strides: element-aligned data and strides, and (with
// contiguous_last) a contiguous last axis, along which they vectorise.
inline bool readable_in_place(const py::array& x, bool contiguous_last) {
  const py::ssize_t item = x.itemsize(), nd = x.ndim();
  if (x.size() == 0) return true;
  if (reinterpret_cast<uintptr_t>(x.data()) % uintptr_t(item) != 0) return false;
  for (py::ssize_t d = 0; d < nd; ++d)
    if (x.shape(d) > 1 && x.strides(d) % item != 0) return false;
  return !contiguous_last || nd == 0 || x.shape(nd - 1) <= 1 || x.strides(nd - 1) == item;
}

// x itself when readable_in_place, else a C-contiguous copy on a cache line (the one documented copy).
inline py::array kernel_layout(const py::array& x, bool contiguous_last, const char* name) {
  if (readable_in_place(x, contiguous_last)) return x;
  std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
  py::array copy = array_on_line(x.dtype(), shape, name);
  copy.attr("__setitem__")(py::ellipsis(), x);
  return copy;
}

// Whether the memory bounds of a and b intersect (np.may_share_memory's test).
inline bool may_share_memory(const py::array& a, const py::array& b) {
  if (a.size() == 0 || b.size() == 0) return false;
  const Extent ea = extent_of(a), eb = extent_of(b);
  const char* pa = static_cast<const char*>(a.data());
  const char* pb = static_cast<const char*>(b.data());
  return pb + eb.lo < pa + ea.hi && pa + ea.lo < pb + eb.hi;
}

inline void check_aligned(const char* name, const py::array& arr) {
  if (arr.size() == 0) return;  // nothing is read from an empty array
  const int64_t item = arr.itemsize();
  if (reinterpret_cast<uintptr_t>(arr.data()) % uintptr_t(item) != 0)
    fail(std::string(name) + ": data pointer is not aligned to its element size");
  for (py::ssize_t d = 0; d < arr.ndim(); ++d)
    if (arr.shape(d) > 1 && arr.strides(d) % item != 0)
      fail(std::string(name) + ": strides must be multiples of the element size");
}

inline void check_output(const char* name, const py::array& arr, const py::dtype& dt, int64_t expected_size) {
  if (!same_dtype(arr.dtype(), dt)) fail(std::string(name) + ": dtype must match the inputs");
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
  if (is_bool(mask))
    m.kind = MaskKind::boolean;
  else if (same_dtype(mask.dtype(), dt))
    m.kind = MaskKind::additive;
  else
    fail(std::string(name) + ": dtype must be bool or the inputs' dtype");
  check_aligned(name, mask);
  check_block(name, mask, offset, batch_heads, q_len, stride_l, kv_len, stride_s);
  m.data = mask.data();
  m.true_forbids = true_forbids;
  m.offset = offset;
  m.stride_l = stride_l;
  m.stride_s = stride_s;
  return m;
}

}  // namespace pyattn
