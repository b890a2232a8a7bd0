// SPDX-License-Identifier: MIT
// The attention variants' options, checked once for every entry point (sdpa, sdpa_cache, the layer):
// window=(left, right), softcap=c, sinks (one logit per query head) and alibi_slopes (per query head,
// optionally per batch entry). Each parser names its argument in its error; the result is what
// AttnArgs carries (problem.h): a band of keys around each row's diagonal, the softcap, and per
// (batch, head) arrays of sinks and slopes owned here.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <string>
#include <vector>

#include "binding_checks.h"
#include "problem.h"

namespace pyattn {

// A window side this far or farther is unbounded: no sequence reaches it, and the band's arithmetic
// (positions plus sides) cannot overflow.
constexpr int64_t kUnboundedSide = int64_t(1) << 40;

struct Variants {
  bool has_left = false, has_right = false;
  int64_t left = 0, right = 0;
  double softcap = 0.0;
  std::vector<double> sinks;   // [batch_heads], empty: none
  std::vector<double> slopes;  // [batch_heads], empty: none

  // What the kernels' arguments take (VariantOptions::apply), pointing into this object's arrays.
  VariantOptions options() const {
    VariantOptions o;
    o.has_left = has_left;
    o.has_right = has_right;
    o.left = left;
    o.right = right;
    o.softcap = softcap;
    o.sinks = sinks.empty() ? nullptr : sinks.data();
    o.slopes = slopes.empty() ? nullptr : slopes.data();
    return o;
  }
};

// One side of window: None (unbounded) or an integer >= 0.
inline bool parse_window_side(py::handle side, const char* which, int64_t& value) {
  if (side.is_none()) return false;
  if (PyBool_Check(side.ptr()) || is_numpy_bool(side) || !PyIndex_Check(side.ptr()))
    type_fail(std::string("window: the ") + which + " side must be an int >= 0 or None, got " + type_name(side));
  int overflow = 0;
  const long long n =
      PyLong_AsLongLongAndOverflow(py::reinterpret_steal<py::object>(PyNumber_Index(side.ptr())).ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && n < 0))
    fail(std::string("window: the ") + which + " side must be >= 0, got " + repr_of(side));
  if (overflow > 0 || n >= kUnboundedSide) return false;
  value = int64_t(n);
  return true;
}

inline void parse_window(py::handle obj, Variants& v) {
  if (obj.is_none()) return;
  if (!PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr()) || py::len(obj) != 2)
    type_fail("window: expected None or a pair (left, right) of ints >= 0 or None, got " + repr_of(obj));
  const py::sequence pair = py::reinterpret_borrow<py::sequence>(obj);
  v.has_left = parse_window_side(pair[0], "left", v.left);
  v.has_right = parse_window_side(pair[1], "right", v.right);
}

// softcap: None (off) or a finite real number > 0.
inline double parse_softcap(py::handle obj) {
  if (obj.is_none()) return 0.0;
  if (PyBool_Check(obj.ptr()) || is_numpy_bool(obj) || !is_instance_of(obj, Abc::real))
    type_fail("softcap: expected a real number > 0 or None, got " + type_name(obj));
  const double c = PyFloat_AsDouble(obj.ptr());
  if (c == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  if (!std::isfinite(c) || c <= 0) fail("softcap: must be finite and > 0, got " + repr_of(obj));
  return c;
}

// obj (any array-like of real numbers broadcasting to `shape`) as float64 values of that shape.
inline std::vector<double> broadcast_values(py::handle obj, const std::string& n, const Dims& shape) {
  py::module_ np = py::module_::import("numpy");
  py::array arr = is_ndarray(obj) ? py::reinterpret_borrow<py::array>(obj) : py::array(np.attr("asarray")(obj));
  const char kind = arr.dtype().kind();
  if (!(kind == 'f' || kind == 'i' || kind == 'u' || float_kind(arr.dtype()) == FloatKind::bf16))
    type_fail(n + ": expected real numbers (a float or int array), got dtype " + str_of(arr.dtype()));
  // One value per head, always: the last axis is the heads' (a scalar or one value for all is refused,
  // as a likely mistake); leading axes broadcast, and only sinks have none.
  const bool heads_last = arr.ndim() >= 1 && arr.shape(arr.ndim() - 1) == shape[shape.size() - 1];
  if (!heads_last || (shape.size() == 1 && arr.ndim() != 1) || !broadcasts_to(shape_of(arr), shape))
    fail(n + ": expected shape " +
         (shape.size() == 1
              ? tuple_repr(shape)
              : "(..., " + std::to_string(shape[shape.size() - 1]) + ") broadcasting to " + tuple_repr(shape)) +
         ", got " + str_of(arr.attr("shape")));
  py::tuple target(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) target[i] = shape[i];
  py::array full = np.attr("ascontiguousarray")(np.attr("broadcast_to")(arr.attr("astype")("float64"), target));
  const double* p = static_cast<const double*>(full.data());
  return std::vector<double>(p, p + full.size());
}

// sinks / alibi_slopes as float64 values of shape `shape` (broadcast from the argument's, which must
// broadcast to it), C order; `allow_neg_inf`: -inf is accepted (a sink that is never there).
inline std::vector<double> per_head_values(py::handle obj, const char* name, const Dims& shape, bool allow_neg_inf) {
  const std::string n(name);
  std::vector<double> values;
  // The common case without NumPy calls (a layer's own parameters, on every call): a contiguous
  // float32/float64 array of exactly that shape.
  if (is_ndarray(obj)) {
    const py::array arr = py::reinterpret_borrow<py::array>(obj);
    if ((is_float32(arr) || is_float64(arr)) && shape_of(arr) == shape && (arr.flags() & py::array::c_style)) {
      values.resize(size_t(arr.size()));
      for (size_t i = 0; i < values.size(); ++i)
        values[i] = is_float32(arr) ? double(static_cast<const float*>(arr.data())[i])
                                    : static_cast<const double*>(arr.data())[i];
    }
  }
  if (values.empty()) values = broadcast_values(obj, n, shape);
  for (double x : values)
    if (std::isnan(x) || (std::isinf(x) && !(allow_neg_inf && x < 0)))
      fail(n + (allow_neg_inf ? ": entries must be finite or -inf, got " : ": entries must be finite, got ") +
           repr_of(obj));
  return values;
}

// Every option of a call with `batch` batch axes (the output's) and num_heads query heads.
inline Variants parse_variants(py::handle window, py::handle softcap, py::handle sinks, py::handle alibi_slopes,
                               const Dims& batch, int64_t num_heads) {
  Variants v;
  parse_window(window, v);
  v.softcap = parse_softcap(softcap);
  int64_t batch_count = 1;
  for (size_t i = 0; i < batch.size(); ++i) batch_count = checked_mul(batch_count, batch[i]);
  if (!sinks.is_none()) {
    const std::vector<double> per_head = per_head_values(sinks, "sinks", Dims{num_heads}, true);
    for (int64_t b = 0; b < batch_count; ++b) v.sinks.insert(v.sinks.end(), per_head.begin(), per_head.end());
  }
  if (!alibi_slopes.is_none()) {
    Dims full = batch;
    full.push_back(num_heads);
    v.slopes = per_head_values(alibi_slopes, "alibi_slopes", full, false);
  }
  return v;
}

// A cu_seqlens argument as int64 values: 1-D integers starting at 0, non-decreasing, ending at total.
inline std::vector<int64_t> parse_cu_seqlens(py::handle obj, const char* name, int64_t total) {
  const std::string n(name);
  py::array arr = is_ndarray(obj) ? py::reinterpret_borrow<py::array>(obj)
                                  : py::array(py::module_::import("numpy").attr("asarray")(obj));
  const char kind = arr.dtype().kind();
  if ((kind != 'i' && kind != 'u') || arr.ndim() != 1)
    type_fail(n + ": expected a 1-D int32 or int64 array of batch + 1 prefix sums, got " + str_of(arr.dtype()) +
              " array of shape " + str_of(arr.attr("shape")));
  const py::array wide = py::module_::import("numpy").attr("ascontiguousarray")(arr, "int64");
  const int64_t* p = static_cast<const int64_t*>(wide.data());
  std::vector<int64_t> cu(p, p + wide.size());
  if (cu.empty() || cu[0] != 0) fail(n + ": must start at 0");
  for (size_t b = 1; b < cu.size(); ++b)
    if (cu[b] < cu[b - 1]) fail(n + ": must be non-decreasing, got " + repr_of(obj));
  if (cu.back() != total)
    fail(n + ": must end at the total length " + std::to_string(total) + ", got " + std::to_string(cu.back()));
  return cu;
}

}  // namespace pyattn
