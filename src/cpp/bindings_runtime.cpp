// SPDX-License-Identifier: MIT
// The _core entries of the runtime: the kernel ISA (PYATTN_ISA, isa, available_isas, _set_isa), the
// default thread count, what the build is (OpenMP, compiler, flags), the CPU as the tuning module
// sees it (cpu_info), the KV cache's storage placement (kv_storage_offset), and the one tuning
// override for tests and benchmarks (_set_tuning). bind_runtime runs when the module loads.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "binding_checks.h"
#include "dispatch.h"
#include "runtime.h"
#include "tuning.h"

namespace py = pybind11;

namespace pyattn {
namespace {

std::vector<std::string> isa_list() {
  const char* names[8];
  const int n = available_isas(names, 8);
  return std::vector<std::string>(names, names + n);
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
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

// PYATTN_ISA=name forces a compiled ISA that this CPU supports; anything else fails the import.
void apply_env_isa() {
  const char* env = std::getenv("PYATTN_ISA");
  if (!env || !*env) return;
  if (!isa_compiled(env))
    throw py::import_error("PYATTN_ISA='" + std::string(env) +
                           "' is not an ISA this build of pyattn has; use one of: " + joined(isa_list()));
  if (!set_isa(env))
    throw py::import_error("PYATTN_ISA='" + std::string(env) +
                           "' is not supported by this CPU; available: " + joined(isa_list()));
}

// ---- _set_tuning: the override's fields as Python names and values them ----

// How a field's Python value reads: a name from a list, a bool, one of a few ints, or an int in a range.
enum class Kind { label, flag, choice, count };

struct Field {
  const char* key;
  int64_t TuningOverride::* member;
  Kind kind;
  std::vector<std::pair<std::string, int64_t>> labels;  // Kind::label: (name, value)
  std::vector<int64_t> choices;                         // Kind::choice
  int64_t lo = 0, hi = 0;                               // Kind::count: [lo, hi]
};

const std::vector<Field>& fields() {
  using O = TuningOverride;
  constexpr int64_t kMaxBytes = int64_t(1) << 50;
  static const std::vector<Field> f = {
      {"tile_prefetch", &O::tile_prefetch, Kind::label, {{"off", 0}, {"kv_rows", 1}, {"next_items", 2}}, {}},
      {"group_heads", &O::group_heads, Kind::count, {}, {}, 1, kMaxGroupTileHeads},
      {"pack_heads", &O::pack_heads, Kind::flag, {}, {}},
      {"decode_prefetch", &O::decode_prefetch, Kind::label, {{"off", 0}, {"l1", 1}, {"l2", 2}}, {}},
      {"decode_streams", &O::decode_streams, Kind::choice, {}, {1, 2, 4}},
      {"decode_block16", &O::decode_block16, Kind::choice, {}, {32, 64}},
      {"decode_across_heads", &O::decode_across_heads, Kind::flag, {}, {}},
      {"decode_fuse", &O::decode_fuse, Kind::flag, {}, {}},
      {"packed_mask_limit", &O::packed_mask_limit, Kind::count, {}, {}, 0, kMaxBytes},
      {"cpu_vendor",
       &O::cpu_vendor,
       Kind::label,
       {{"unknown", int64_t(CpuVendor::unknown)},
        {"intel", int64_t(CpuVendor::intel)},
        {"amd", int64_t(CpuVendor::amd)}},
       {}},
      {"cpu_family", &O::cpu_family, Kind::count, {}, {}, 0, 0xfff},
      {"cpu_model", &O::cpu_model, Kind::count, {}, {}, 0, 0xfff},
      {"l2_bytes", &O::l2_bytes, Kind::count, {}, {}, 0, kMaxBytes},
      {"llc_bytes", &O::llc_bytes, Kind::count, {}, {}, 0, kMaxBytes},
  };
  return f;
}

// What a field takes, for the error message.
std::string accepted(const Field& f) {
  std::string s;
  switch (f.kind) {
    case Kind::label:
      for (const auto& l : f.labels) s += (s.empty() ? "" : ", ") + ("'" + l.first + "'");
      return "None or one of " + s;
    case Kind::flag:
      return "None, False or True";
    case Kind::choice:
      for (const int64_t c : f.choices) s += (s.empty() ? "" : ", ") + std::to_string(c);
      return "None or one of " + s;
    case Kind::count:
      return "None or an int in [" + std::to_string(f.lo) + ", " + std::to_string(f.hi) + "]";
  }
  return "";
}

// The override value of Python value v for field f (kByRule for None); ValueError naming the key.
int64_t parse(const Field& f, py::handle v) {
  if (v.is_none()) return kByRule;
  const bool is_bool = py::isinstance<py::bool_>(v), is_int = py::isinstance<py::int_>(v) && !is_bool;
  if (f.kind == Kind::label && py::isinstance<py::str>(v)) {
    const std::string name = py::str(v);
    for (const auto& l : f.labels)
      if (l.first == name) return l.second;
  } else if (f.kind == Kind::flag && is_bool) {
    return v.cast<bool>() ? 1 : 0;
  } else if ((f.kind == Kind::choice || f.kind == Kind::count) && is_int) {
    int64_t x = kByRule;
    bool fits = true;  // an int beyond int64's range is refused like any other outside the field's
    try {
      x = v.cast<int64_t>();
    } catch (const py::cast_error&) {
      fits = false;
    }
    if (fits && f.kind == Kind::count && x >= f.lo && x <= f.hi) return x;
    for (const int64_t c : f.choices)
      if (fits && x == c) return x;
  }
  throw py::value_error("_set_tuning: " + std::string(f.key) + ": expected " + accepted(f) + ", got " +
                        std::string(py::repr(v)));
}

py::object unparse(const Field& f, int64_t x) {
  if (x == kByRule) return py::none();
  if (f.kind == Kind::flag) return py::bool_(x != 0);
  if (f.kind == Kind::label)
    for (const auto& l : f.labels)
      if (l.second == x) return py::str(l.first);
  return py::int_(x);
}

py::dict as_dict(const TuningOverride& o) {
  py::dict d;
  for (const Field& f : fields()) d[f.key] = unparse(f, o.*f.member);
  return d;
}

// Sets the fields named in `settings` (the others stay as they are) and returns every field's previous
// value, so that _set_tuning(previous) restores them all. Nothing changes when any key or value is
// refused.
py::dict set_tuning(const py::dict& settings) {
  TuningOverride o = tuning_override();
  for (const auto& item : settings) {
    const std::string key = py::str(item.first);
    const Field* field = nullptr;
    for (const Field& f : fields())
      if (key == f.key) field = &f;
    if (!field) {
      std::string known;
      for (const Field& f : fields()) known += (known.empty() ? "" : ", ") + std::string(f.key);
      throw py::value_error("_set_tuning: unknown key '" + key + "'; known keys: " + known);
    }
    o.*field->member = parse(*field, item.second);
  }
  return as_dict(set_tuning_override(o));
}

const char* vendor_name(CpuVendor v) {
  return v == CpuVendor::intel ? "intel" : v == CpuVendor::amd ? "amd" : "unknown";
}

py::dict cpu_dict(const CpuInfo& c) {
  py::dict d;
  d["vendor"] = vendor_name(c.vendor);
  d["family"] = c.family;
  d["model"] = c.model;
  d["l1d_bytes"] = c.l1d_bytes;
  d["l2_bytes"] = c.l2_bytes;
  d["llc_bytes"] = c.llc_bytes;
  d["avx2"] = c.avx2;
  d["avx512"] = c.avx512;
  return d;
}

// KVCache.append into int8 storage: src (heads, n, dim) float32, C-contiguous; dst the storage's
// (heads, n, dim) int8 view (rows contiguous within a head); scales its (heads, n) float32 view.
void quantize_into(const py::array& src, const py::array& dst, const py::array& scales) {
  if (!is_float32(src) || src.ndim() != 3 || !(src.flags() & py::array::c_style))
    fail("quantize: src must be C-contiguous float32 (heads, n, dim)");
  if (!same_dtype(dst.dtype(), py::dtype::of<int8_t>()) || dst.ndim() != 3 || !is_float32(scales) || scales.ndim() != 2)
    fail("quantize: dst must be int8 (heads, n, dim) and scales float32 (heads, n)");
  for (int x = 0; x < 2; ++x)
    if (dst.shape(x) != src.shape(x) || scales.shape(x) != src.shape(x)) fail("quantize: shapes differ");
  if (dst.shape(2) != src.shape(2)) fail("quantize: shapes differ");
  const int64_t heads = src.shape(0), n = src.shape(1), dim = src.shape(2);
  if (heads == 0 || n == 0) return;
  if ((dim > 1 && dst.strides(2) != 1) || dst.strides(1) < dim || scales.strides(1) != int64_t(sizeof(float)) ||
      !dst.writeable() || !scales.writeable())
    fail("quantize: dst rows and scales must be contiguous and writeable");
  const float* s = static_cast<const float*>(src.data());
  int8_t* d = static_cast<int8_t*>(const_cast<void*>(dst.data()));
  char* sc = static_cast<char*>(const_cast<void*>(scales.data()));
  for (int64_t h = 0; h < heads; ++h)
    quantize_int8(s + h * n * dim, n, dim, d + h * dst.strides(0), dst.strides(1),
                  reinterpret_cast<float*>(sc + h * scales.strides(0)));
}

}  // namespace

void bind_runtime(py::module_& m) {
  apply_env_isa();
  install_fork_guard();
  m.def("isa", []() { return std::string(active_isa()); }, "Name of the kernel ISA in use.");
  m.def(
      "bf16_dots", [](py::handle precision) { return parse_precision(precision) && active_kernels().bf16_dots; },
      py::arg("precision") = "fast",
      "Whether the ISA in use computes bfloat16 inputs with bfloat16 dot products under `precision` (the "
      "error every entry point gives for a precision other than 'fast' or 'highest').");
  m.def("quantize_int8", &quantize_into, py::arg("src"), py::arg("dst"), py::arg("scales"),
        "Rows of src quantised to int8 into dst with one float32 scale per row (KVCache.append).");
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
  m.def("openmp_runtime", []() { return std::string(openmp_runtime()); });
  m.def("openmp_enabled", &openmp_enabled);
  m.def("compiler", &compiler_string);
  m.def("isa_flags", []() { return std::string(PYATTN_ISA_FLAGS); }, "Compiler flags of each ISA's kernels.");
  m.def(
      "cpu_info", []() { return cpu_dict(current_tuning().cpu); },
      "The CPU as the tuning module plans with it: vendor ('intel', 'amd' or 'unknown'), CPUID family and "
      "model, L1d / L2 / last-level cache bytes per core (0 where CPUID does not say), AVX2 and AVX-512 "
      "with OS support; with _set_tuning's CPU fields in place of the probed ones.");
  m.def(
      "kv_storage_offset",
      [](int64_t itemsize, bool bfloat16) { return kv_storage_offset(current_tuning().cpu, itemsize, bfloat16); },
      py::arg("itemsize"), py::arg("bfloat16"),
      "Bytes past a 64-byte line at which a KVCache's storage of this element size starts (the decode "
      "kernel's fastest placement on this CPU).");
  m.def("_set_tuning", &set_tuning, py::arg("settings"),
        "Forces tuning decisions, or the CPU the planner sees (tests and benchmarks): a dict of the keys "
        "tile_prefetch ('off', 'kv_rows', 'next_items'), group_heads (1-8), pack_heads (bool), "
        "decode_prefetch ('off', 'l1', 'l2'), decode_streams (1, 2, 4), decode_block16 (32, 64), "
        "decode_across_heads (bool), decode_fuse (bool), packed_mask_limit (bytes), cpu_vendor ('intel', "
        "'amd', 'unknown'), cpu_family, cpu_model, l2_bytes, llc_bytes (0: unknown); None leaves a key to "
        "the rules. Keys not given keep their setting. Returns every key's previous value (pass it back to "
        "restore); an unknown key or a value outside a key's range raises ValueError and changes nothing.");
  m.attr("DECODE_MAX_Q_LEN") = kDecodeMaxLen;
}

}  // namespace pyattn
