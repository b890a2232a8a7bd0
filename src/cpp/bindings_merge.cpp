// SPDX-License-Identifier: MIT
// pyattn.merge_attention_states's contract: P partial results of the same query rows over disjoint
// key sets (a sequence of arrays, or one array stacked along a leading axis of P), each output
// (..., L, Ev) with its log-sum-exp (..., L) as scaled_dot_product_attention(..., return_lse=True)
// returns them, merged into one (out, lse) by the core (merge_states.cpp). Outputs compute in float32
// (float32 and 16-bit outputs) or float64; a part not C-contiguous in the compute dtype is copied
// into one (the only copies). `sinks` (Hq,) are applied once, here, to rows ordered (..., Hq, L).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "attention.h"
#include "binding_checks.h"
#include "binding_variants.h"

namespace pyattn {
namespace {

// The P parts of `obj`: the arrays of a list or tuple, or the sub-arrays of a stacked array along
// its first axis.
std::vector<py::array> parts_of(py::handle obj, const char* name) {
  const std::string n(name);
  std::vector<py::array> parts;
  py::module_ np = py::module_::import("numpy");
  if (is_ndarray(obj)) {
    const py::array stacked = py::reinterpret_borrow<py::array>(obj);
    if (stacked.ndim() < 2)
      fail(n + ": a stacked array needs a leading axis of parts, got shape " + str_of(stacked.attr("shape")));
    for (py::ssize_t p = 0; p < stacked.shape(0); ++p) parts.push_back(stacked[py::int_(p)].cast<py::array>());
  } else if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    for (py::handle x : py::reinterpret_borrow<py::sequence>(obj)) parts.push_back(np.attr("asarray")(x));
  } else {
    type_fail(n + ": expected a sequence of arrays or a stacked array, got " + type_name(obj));
  }
  if (parts.empty()) fail(n + ": expected at least one part");
  return parts;
}

// A part in the compute dtype, C-contiguous (copied only when it is not).
py::array compute_layout(const py::array& x, const py::dtype& compute, const std::string& name) {
  const FloatKind kind = float_kind(x.dtype());
  if (kind == FloatKind::other) type_fail(name + ": dtype must be floating, got " + str_of(x.dtype()));
  py::module_ np = py::module_::import("numpy");
  return np.attr("ascontiguousarray")(x.attr("astype")(compute, py::arg("copy") = false));
}

template <class T>
void launch_merge(const std::vector<py::array>& outs, const std::vector<py::array>& lses, const Variants& v,
                  int64_t heads, int64_t q_len, py::array& out, py::array& lse, int threads) {
  std::vector<const T*> out_ptrs, lse_ptrs;
  for (size_t p = 0; p < outs.size(); ++p) {
    out_ptrs.push_back(static_cast<const T*>(outs[p].data()));
    lse_ptrs.push_back(static_cast<const T*>(lses[p].data()));
  }
  MergeArgs<T> m;
  m.outs = out_ptrs.data();
  m.lses = lse_ptrs.data();
  m.parts = int64_t(outs.size());
  m.rows = int64_t(lse.size());
  m.value_dim = m.rows > 0 ? int64_t(out.size()) / m.rows : 0;
  m.sinks = v.sinks.empty() ? nullptr : v.sinks.data();
  m.heads = heads;
  m.q_len = q_len;
  m.out = static_cast<T*>(out.mutable_data());
  m.lse = static_cast<T*>(lse.mutable_data());
  py::gil_scoped_release release;
  merge_attention_states<T>(m, threads);
}

py::object merge_states_py(py::handle outputs, py::handle lses, py::handle sinks, py::handle out_obj,
                           py::handle num_threads) {
  const int threads = parse_threads(num_threads);
  std::vector<py::array> outs = parts_of(outputs, "outputs"), lse_parts = parts_of(lses, "lses");
  if (outs.size() != lse_parts.size())
    fail("outputs and lses: need one lse per output, got " + std::to_string(outs.size()) + " outputs and " +
         std::to_string(lse_parts.size()) + " lses");
  const FloatKind kind = float_kind(outs[0].dtype());
  if (kind == FloatKind::other) type_fail("outputs: dtype must be floating, got " + str_of(outs[0].dtype()));
  const bool f64 = kind == FloatKind::f64;
  const py::dtype compute = f64 ? py::dtype::of<double>() : py::dtype::of<float>();
  const Dims shape = shape_of(outs[0]);
  if (shape.size() < 2) fail("outputs: each part needs at least 2 dimensions (..., L, Ev), got " + tuple_repr(shape));
  Dims lse_shape = shape;
  lse_shape.n -= 1;
  for (size_t p = 0; p < outs.size(); ++p) {
    const std::string at = "[" + std::to_string(p) + "]";
    if (float_kind(outs[p].dtype()) != kind)
      type_fail("outputs" + at + ": every part must have the first's dtype " + str_of(outs[0].dtype()) + ", got " +
                str_of(outs[p].dtype()));
    if (shape_of(outs[p]) != shape)
      fail("outputs" + at + ": every part must have the first's shape " + tuple_repr(shape) + ", got " +
           tuple_repr(shape_of(outs[p])));
    if (shape_of(lse_parts[p]) != lse_shape)
      fail("lses" + at + ": expected shape " + tuple_repr(lse_shape) + " (the outputs' without Ev), got " +
           tuple_repr(shape_of(lse_parts[p])));
    outs[p] = compute_layout(outs[p], compute, "outputs" + at);
    lse_parts[p] = compute_layout(lse_parts[p], compute, "lses" + at);
  }
  const int64_t heads = lse_shape.size() >= 2 ? lse_shape[lse_shape.size() - 2] : 1;
  const int64_t q_len = lse_shape.size() >= 1 ? lse_shape[lse_shape.size() - 1] : 1;
  Variants v;
  if (!sinks.is_none()) {
    if (lse_shape.size() < 2) fail("sinks: the lses need a head axis, (..., Hq, L), got " + tuple_repr(lse_shape));
    v.sinks = per_head_values(sinks, "sinks", Dims{heads}, true);
  }
  const Dims out_shape = shape;
  py::array out;
  if (!out_obj.is_none()) {
    if (!is_ndarray(out_obj)) type_fail("out: expected a NumPy array, got " + type_name(out_obj));
    out = py::reinterpret_borrow<py::array>(out_obj);
    if (!same_dtype(out.dtype(), compute))
      type_fail("out: dtype must be " + str_of(compute) + ", got " + str_of(out.dtype()));
    if (shape_of(out) != out_shape)
      fail("out: shape must be " + tuple_repr(out_shape) + ", got " + tuple_repr(shape_of(out)));
    if (!(out.flags() & py::array::c_style) || !out.writeable()) fail("out: must be C-contiguous and writeable");
    check_aligned("out", out);
    for (size_t p = 0; p < outs.size(); ++p)
      if (may_share_memory(out, outs[p]) || may_share_memory(out, lse_parts[p]))
        fail("out: must not overlap the outputs or lses");
  } else {
    out = array_on_line(compute, out_shape, "out");
  }
  py::array lse = array_on_line(compute, lse_shape, "lse");
  if (f64)
    launch_merge<double>(outs, lse_parts, v, heads, q_len, out, lse, threads);
  else
    launch_merge<float>(outs, lse_parts, v, heads, q_len, out, lse, threads);
  return py::make_tuple(out, lse);
}

}  // namespace

void bind_merge(py::module_& m) {
  m.def("merge_states", &merge_states_py, py::arg("outputs"), py::arg("lses"), py::arg("sinks"), py::arg("out"),
        py::arg("num_threads"), "pyattn.merge_attention_states on NumPy arrays: the whole contract.");
}

}  // namespace pyattn
