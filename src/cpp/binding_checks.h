// SPDX-License-Identifier: MIT
// The binding's invariant checks, shared by its translation units (bindings.cpp: attention;
// bindings_mha.cpp: the GEMM and the multi-head layer). Every check runs before the GIL is released
// and throws std::invalid_argument (a ValueError in Python) naming the argument: sizes whose byte
// counts overflow, element alignment, output layout, and that every row a kernel will touch lies
// inside the array it belongs to. Also the one allocation both use: arrays that start on a cache
// line (array_on_line).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
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

// A fresh, uninitialised C-contiguous array of `shape` and `dtype` that starts on a cache line: a
// view into a uint8 array one line longer (its base, which owns the memory). NumPy aligns its own
// allocations to 16 bytes only, and the kernels' 64-byte vector stores into rows that straddle two
// lines cost two (0.93-0.98x at L = 128-512, measured for _api._allocate, which calls this). A size
// whose byte count overflows is a ValueError naming `name`; an allocation NumPy refuses, MemoryError.
inline py::array array_on_line(const py::dtype& dtype, const std::vector<py::ssize_t>& shape, const char* name) {
  int64_t bytes = int64_t(dtype.itemsize());
  try {
    for (py::ssize_t n : shape) bytes = checked_mul(bytes, int64_t(n));
    bytes = checked_add(bytes, int64_t(kCacheLine));
  } catch (const std::invalid_argument&) {
    fail(std::string(name) + ": the array's size in bytes overflows int64");
  }
  py::array_t<uint8_t> raw(std::vector<py::ssize_t>{py::ssize_t(bytes)});
  const uintptr_t address = reinterpret_cast<uintptr_t>(raw.data());
  uint8_t* const start = raw.mutable_data() + (kCacheLine - address % kCacheLine) % kCacheLine;
  return py::array(dtype, shape, start, raw);
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
    if (span < 0) lo = checked_add(lo, span);
    else hi = checked_add(hi, span);
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

inline void check_aligned(const char* name, const py::array& arr) {
  if (arr.size() == 0) return;  // nothing is read from an empty array
  const int64_t item = arr.itemsize();
  if (reinterpret_cast<uintptr_t>(arr.data()) % uintptr_t(item) != 0)
    fail(std::string(name) + ": data pointer is not aligned to its element size");
  for (py::ssize_t d = 0; d < arr.ndim(); ++d)
    if (arr.shape(d) > 1 && arr.strides(d) % item != 0) fail(std::string(name) + ": strides must be multiples of the element size");
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
  if (is_bool(mask)) m.kind = MaskKind::boolean;
  else if (same_dtype(mask.dtype(), dt)) m.kind = MaskKind::additive;
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

}  // namespace pyattn
