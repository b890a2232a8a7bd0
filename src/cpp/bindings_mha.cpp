// SPDX-License-Identifier: MIT
// The _core entries of the projections' GEMM and of the multi-head layer (pack_weights, linear, mha,
// mha_cached): translators like bindings.cpp's, from arrays prepared by pyattn._mha to GemmArgs,
// MhaArgs and MhaCacheArgs, with the same invariant checks (binding_checks.h) before the GIL is
// released.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "binding_checks.h"
#include "binding_variants.h"
#include "parallel.h"

namespace pyattn {
namespace {

// Elements of a (n, k) weight packed in panels of `panel` columns (pack_weights), checked for overflow.
int64_t packed_elems(int64_t n, int64_t k, int64_t panel) {
  return checked_mul(checked_mul(ceil_div(n, panel), k), panel);
}

// The packed weight starts on a cache line (array_on_line, binding_checks.h): the GEMM
// micro-kernel loads whole 64-byte vectors of it, and NumPy's allocations are only 16-byte aligned,
// so most packings would have every such load straddle two lines.
template <class T>
py::array_t<T> pack_weights_t(const py::array& w) {
  const KernelSet<T>& ks = active_set<T>();
  const int64_t n = w.shape(0), k = w.shape(1), panel = ks.gemm_panel;
  py::array_t<T> packed = array_on_line(py::dtype::of<T>(), Dims{packed_elems(n, k, panel)}, "packed weight");
  check_aligned("weight", w);
  if (w.size() > 0 && k > 1 && w.strides(1) != py::ssize_t(sizeof(T))) fail("weight: last axis must be contiguous");
  const T* src = static_cast<const T*>(w.data());
  T* dst = packed.mutable_data();
  const int64_t w_stride = n > 1 ? w.strides(0) / int64_t(sizeof(T)) : 0;
  py::gil_scoped_release release;
  pack_weights<T>(ks, src, w_stride, n, k, dst);  // ks: the set whose panel sized `packed`
  return packed;
}

// Packs a (n, k) weight for the active ISA's GEMM; returns (packed, panel).
py::tuple pack_weights_py(const py::array& w) {
  if (w.ndim() != 2) fail("weight: expected a 2-D array (out_features, in_features)");
  if (is_float32(w)) return py::make_tuple(pack_weights_t<float>(w), active_set<float>().gemm_panel);
  if (is_float64(w)) return py::make_tuple(pack_weights_t<double>(w), active_set<double>().gemm_panel);
  fail("weight: dtype must be float32 or float64");
}

// A bfloat16 (n, k) weight (its uint16 view) packed in pairs of k for the avx512bf16 GEMM
// (GemmArgs::packed16); returns (packed, panel). Refused where the ISA in use has no bfloat16 dot
// products: the packing is for that GEMM only.
py::tuple pack_weights16_py(const py::array& w) {
  if (!active_kernels().bf16_dots) fail("pack_weights16: the ISA in use has no bfloat16 dot products");
  if (w.ndim() != 2 || !same_dtype(w.dtype(), py::dtype::of<uint16_t>()))
    fail("weight: expected a 2-D uint16 view of a bfloat16 (out_features, in_features) weight");
  const int64_t n = w.shape(0), k = w.shape(1), panel = active_set<float>().gemm_panel;
  check_aligned("weight", w);
  if (w.size() > 0 && k > 1 && w.strides(1) != 2) fail("weight: last axis must be contiguous");
  py::array_t<uint32_t> packed =
      array_on_line(py::dtype::of<uint32_t>(), Dims{packed_elems(n, (k + 1) / 2, panel)}, "packed weight");
  const uint16_t* src = static_cast<const uint16_t*>(w.data());
  uint32_t* dst = packed.mutable_data();
  const int64_t w_stride = n > 1 ? w.strides(0) / 2 : 0;
  {
    py::gil_scoped_release release;
    pack_weights16(src, w_stride, n, k, panel, dst);
  }
  return py::make_tuple(packed, panel);
}

// A row matrix input (rows, cols) of the MHA: 2-D, dtype T, last axis contiguous; returns its row stride.
template <class T>
int64_t row_matrix(const char* name, const py::array& x, int64_t rows, int64_t cols) {
  if (x.ndim() != 2 || x.shape(0) != rows || x.shape(1) != cols) fail(std::string(name) + ": wrong shape");
  if (!same_dtype(x.dtype(), py::dtype::of<T>())) fail(std::string(name) + ": wrong dtype");
  check_aligned(name, x);
  if (cols > 1 && x.strides(1) != py::ssize_t(sizeof(T))) fail(std::string(name) + ": last axis must be contiguous");
  return rows > 1 ? x.strides(0) / int64_t(sizeof(T)) : 0;
}

template <class T>
const T* packed_weight(const char* name, const py::array& p, int64_t n, int64_t k) {
  const int64_t panel = active_set<T>().gemm_panel;
  if (!same_dtype(p.dtype(), py::dtype::of<T>()) || p.ndim() != 1 || !(p.flags() & py::array::c_style) ||
      p.size() != packed_elems(n, k, panel))
    fail(std::string(name) + ": packed weight does not match its shape or the active ISA; pack it again");
  return static_cast<const T*>(p.data());
}

template <class T>
const T* optional_bias(const char* name, const py::object& obj, int64_t n) {
  if (obj.is_none()) return nullptr;
  const py::array b = py::reinterpret_borrow<py::array>(obj);
  if (!same_dtype(b.dtype(), py::dtype::of<T>()) || b.ndim() != 1 || b.shape(0) != n ||
      !(b.flags() & py::array::c_style))
    fail(std::string(name) + ": expected a contiguous 1-D array of " + std::to_string(n) + " elements");
  return static_cast<const T*>(b.data());
}

// One projection's weight for the layer: packed for the active ISA (1-D, from pack_weights), or the
// (n, k) weight itself (2-D, last axis contiguous), which the GEMM's tasks pack as they go.
template <class T>
Projection<T> projection(const char* name, const py::object& weight, const char* bias_name, const py::object& bias,
                         int64_t n, int64_t k) {
  Projection<T> p;
  const py::array w = weight.cast<py::array>();
  if (w.ndim() == 2) {
    p.w = static_cast<const T*>(w.data());
    p.w_stride = row_matrix<T>(name, w, n, k);
  } else {
    p.packed = packed_weight<T>(name, w, n, k);
  }
  p.bias = optional_bias<T>(bias_name, bias, n);
  return p;
}

template <class T>
void linear_t(const py::array& x, const py::array& packed, int64_t panel, int64_t n, const py::object& bias_obj,
              py::array& out, int num_threads) {
  const KernelSet<T>& ks = active_set<T>();
  if (x.ndim() != 2 || out.ndim() != 2) fail("x and out must be 2-D");
  const int64_t m = x.shape(0), k = x.shape(1);
  if (out.shape(0) != m || out.shape(1) != n) fail("out: shape must be (m, n)");
  if (!same_dtype(packed.dtype(), x.dtype()) || !same_dtype(out.dtype(), x.dtype()))
    fail("packed and out must share x's dtype");
  if (packed.ndim() != 2 && panel != ks.gemm_panel) fail("packed weight was packed for another ISA; pack it again");
  const Projection<T> p = projection<T>("packed", packed, "bias", bias_obj, n, k);  // packed, or W itself
  GemmArgs<T> g;
  g.packed = p.packed;
  g.w = p.w;
  g.w_stride = p.w_stride;
  g.bias = p.bias;
  check_aligned("x", x);
  if (x.size() > 0 && k > 1 && x.strides(1) != py::ssize_t(sizeof(T))) fail("x: last axis must be contiguous");
  if (!(out.flags() & py::array::c_style) || !out.writeable()) fail("out: must be C-contiguous and writeable");
  g.a = static_cast<const T*>(x.data());
  g.a_stride = m > 1 ? x.strides(0) / int64_t(sizeof(T)) : 0;
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

// The sizes a layer call passes (dims, from pyattn._mha), checked again here: the Python layer
// checks them first, but this entry is reachable from Python on its own.
void check_layer_dims(const std::vector<int64_t>& dims, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t embed_dim) {
  for (int64_t d : dims)
    if (d < 0) fail("dims must be non-negative");
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
    fail("num_heads must be a positive multiple of num_kv_heads");
  // num_heads >= 1 and head_dim >= 0 here; a product past int64 never equals embed_dim.
  if (head_dim > INT64_MAX / num_heads || num_heads * head_dim != embed_dim)
    fail("num_heads * head_dim must equal embed_dim");
}

// A bfloat16 layer's projection: its weight from pack_weights16 (n, k), a float32 bias.
Projection<float> projection16(const char* name, const py::object& weight, const char* bias_name,
                               const py::object& bias, int64_t n, int64_t k) {
  Projection<float> p;
  const py::array w = weight.cast<py::array>();
  if (!same_dtype(w.dtype(), py::dtype::of<uint32_t>()) || w.ndim() != 1 || !(w.flags() & py::array::c_style) ||
      w.size() != packed_elems(n, (k + 1) / 2, active_set<float>().gemm_panel))
    fail(std::string(name) + ": packed bfloat16 weight does not match its shape or the active ISA; pack it again");
  p.packed16 = static_cast<const uint32_t*>(w.data());
  p.bias = optional_bias<float>(bias_name, bias, n);
  return p;
}

// The layer's weights tuple (q, k, v, out projections, each packed or not, then their optional
// biases), checked against the shapes; a bfloat16 layer's (bf16) packed in pairs.
template <class T>
void layer_weights(const py::tuple& w, int64_t embed_dim, int64_t kv_width, int64_t kdim, int64_t vdim,
                   LayerWeights<T>& m, bool bf16 = false) {
  if (w.size() != 8) fail("weights must be a tuple of 8 entries");
  if constexpr (std::is_same<T, float>::value) {
    if (bf16) {
      m.q = projection16("q_proj_weight", w[0], "q_proj_bias", w[4], embed_dim, embed_dim);
      m.k = projection16("k_proj_weight", w[1], "k_proj_bias", w[5], kv_width, kdim);
      m.v = projection16("v_proj_weight", w[2], "v_proj_bias", w[6], kv_width, vdim);
      m.o = projection16("out_proj_weight", w[3], "out_proj_bias", w[7], embed_dim, embed_dim);
      return;
    }
  }
  m.q = projection<T>("q_proj_weight", w[0], "q_proj_bias", w[4], embed_dim, embed_dim);
  m.k = projection<T>("k_proj_weight", w[1], "k_proj_bias", w[5], kv_width, kdim);
  m.v = projection<T>("v_proj_weight", w[2], "v_proj_bias", w[6], kv_width, vdim);
  m.o = projection<T>("out_proj_weight", w[3], "out_proj_bias", w[7], embed_dim, embed_dim);
}

template <class T>
void run_mha(const py::array& xq, const py::array& xk, const py::array& xv, const py::tuple& w,
             const std::vector<int64_t>& dims, const py::list& masks, Causal causal, py::array& out,
             const py::object& weights_obj, int num_threads, const Variants& variants,
             const std::vector<int64_t>& cu_seqlens, bool bf16 = false) {
  MhaArgs<T> m;
  m.bf16 = bf16;
  m.batch = dims[0];
  m.q_len = dims[1];
  m.kv_len = dims[2];
  m.embed_dim = dims[3];
  m.kdim = dims[4];
  m.vdim = dims[5];
  m.num_heads = dims[6];
  m.num_kv_heads = dims[7];
  m.head_dim = dims[8];
  check_layer_dims(dims, m.num_heads, m.num_kv_heads, m.head_dim, m.embed_dim);
  const int64_t q_rows = checked_mul(m.batch, m.q_len), kv_rows = checked_mul(m.batch, m.kv_len);
  // A bfloat16 layer's inputs: uint16 views of its bfloat16 rows (read as such by the pair GEMM).
  m.xq_stride =
      bf16 ? row_matrix<uint16_t>("query", xq, q_rows, m.embed_dim) : row_matrix<T>("query", xq, q_rows, m.embed_dim);
  m.xk_stride = bf16 ? row_matrix<uint16_t>("key", xk, kv_rows, m.kdim) : row_matrix<T>("key", xk, kv_rows, m.kdim);
  m.xv_stride = bf16 ? row_matrix<uint16_t>("value", xv, kv_rows, m.vdim) : row_matrix<T>("value", xv, kv_rows, m.vdim);
  m.xq = static_cast<const T*>(xq.data());
  m.xk = static_cast<const T*>(xk.data());
  m.xv = static_cast<const T*>(xv.data());
  const int64_t kv_width = checked_mul(m.num_kv_heads, m.head_dim);
  layer_weights<T>(w, m.embed_dim, kv_width, m.kdim, m.vdim, m.proj, bf16);

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
  m.causal = causal != Causal::none;
  m.causal_offset = causal_offset(causal, m.q_len, m.kv_len);
  m.variants = variants.options();
  if (!cu_seqlens.empty()) {
    if (m.batch != 1 || m.q_len != m.kv_len || !masks.empty() || !weights_obj.is_none())
      fail("cu_seqlens: a packed batch is one (total, embed_dim) self-attention input without masks or weights");
    m.cu_seqlens = cu_seqlens.data();
    m.num_seqs = int64_t(cu_seqlens.size()) - 1;
  }
  check_output("out", out, py::dtype::of<T>(), checked_mul(q_rows, m.embed_dim));
  m.out = static_cast<T*>(out.mutable_data());
  if (!weights_obj.is_none()) {
    py::array weights = py::reinterpret_borrow<py::array>(weights_obj);
    check_output("weights", weights, py::dtype::of<T>(), checked_mul(checked_mul(batch_heads, m.q_len), m.kv_len));
    m.weights = static_cast<T*>(weights.mutable_data());
  }
  py::gil_scoped_release release;
  multi_head_attention<T>(m, num_threads);
}

void mha_py(const py::array& xq, const py::array& xk, const py::array& xv, const py::tuple& w,
            const std::vector<int64_t>& dims, const py::list& masks, py::handle is_causal, py::array out,
            const py::object& weights, py::handle num_threads, py::handle window, py::handle softcap, py::handle sinks,
            py::handle alibi_slopes, py::handle cu_seqlens, bool bf16) {
  if (dims.size() != 9) fail("dims must have 9 entries");
  const Causal causal = parse_causal(is_causal);
  const int threads = parse_threads(num_threads);
  const Variants variants = parse_variants(window, softcap, sinks, alibi_slopes, Dims{dims[0]}, dims[6]);
  const std::vector<int64_t> cu =
      cu_seqlens.is_none() ? std::vector<int64_t>{} : parse_cu_seqlens(cu_seqlens, "cu_seqlens", dims[1]);
  if (bf16) {  // uint16 views of bfloat16 inputs, weights from pack_weights16, float32 out and weights
    if (!active_kernels().bf16_dots) fail("bf16: the ISA in use has no bfloat16 dot products");
    return run_mha<float>(xq, xk, xv, w, dims, masks, causal, out, weights, threads, variants, cu, true);
  }
  if (is_float32(xq)) return run_mha<float>(xq, xk, xv, w, dims, masks, causal, out, weights, threads, variants, cu);
  if (is_float64(xq)) return run_mha<double>(xq, xk, xv, w, dims, masks, causal, out, weights, threads, variants, cu);
  fail("query: dtype must be float32 or float64");
}

// One of KVCache's storage arrays: (batch, num_kv_heads, max_len, head_dim) of `dtype`, writeable,
// non-negative strides with a contiguous last axis (so every element the step writes or reads lies
// inside it); returns its element strides (b, h, s).
std::vector<int64_t> cache_array(const char* name, const py::array& c, const py::dtype& dtype, int64_t batch,
                                 int64_t kv_heads, int64_t head_dim) {
  const std::string n(name);
  if (c.ndim() != 4 || c.shape(0) != batch || c.shape(1) != kv_heads || c.shape(3) != head_dim)
    fail(n + ": expected shape (batch, num_kv_heads, max_len, head_dim)");
  if (!same_dtype(c.dtype(), dtype)) fail(n + ": dtype does not match the storage");
  if (!c.writeable()) fail(n + ": must be writeable");
  check_aligned(name, c);
  const int64_t item = c.itemsize();
  if (head_dim > 1 && c.strides(3) != item) fail(n + ": last axis must be contiguous");
  std::vector<int64_t> strides;
  for (int d = 0; d < 3; ++d) {
    if (c.strides(d) < 0) fail(n + ": strides must be non-negative");
    strides.push_back(c.strides(d) / item);
  }
  return strides;
}

// A (batch,) contiguous int64 array of cache lengths.
const int64_t* lengths_array(const char* name, const py::array& a, int64_t batch) {
  if (!is_int64(a) || a.ndim() != 1 || a.shape(0) != batch || !(a.flags() & py::array::c_style))
    fail(std::string(name) + ": expected a contiguous int64 array of batch entries");
  return static_cast<const int64_t*>(a.data());
}

template <class T>
void run_mha_cached(const py::array& x, const py::tuple& w, const std::vector<int64_t>& dims, py::array& k_cache,
                    py::array& v_cache, Storage storage, const py::array& before, const py::array& after,
                    bool left_padded, py::array& out, int num_threads, const Variants& variants, py::handle k_scales,
                    py::handle v_scales, bool bf16 = false) {
  MhaCacheArgs<T> m;
  m.bf16 = bf16;
  m.batch = dims[0];
  m.chunk = dims[1];
  m.embed_dim = dims[2];
  m.num_heads = dims[3];
  m.num_kv_heads = dims[4];
  m.head_dim = dims[5];
  check_layer_dims(dims, m.num_heads, m.num_kv_heads, m.head_dim, m.embed_dim);
  const int64_t rows = checked_mul(m.batch, m.chunk), kv_width = checked_mul(m.num_kv_heads, m.head_dim);
  m.x_stride =
      bf16 ? row_matrix<uint16_t>("query", x, rows, m.embed_dim) : row_matrix<T>("query", x, rows, m.embed_dim);
  m.x = static_cast<const T*>(x.data());
  layer_weights<T>(w, m.embed_dim, kv_width, m.embed_dim, m.embed_dim, m.proj, bf16);

  const py::dtype stored = storage == Storage::same ? py::dtype::of<T>()
                           : storage == Storage::i8 ? py::dtype::of<int8_t>()
                                                    : py::dtype::of<uint16_t>();
  const std::vector<int64_t> ks = cache_array("k_cache", k_cache, stored, m.batch, m.num_kv_heads, m.head_dim);
  const std::vector<int64_t> vs = cache_array("v_cache", v_cache, stored, m.batch, m.num_kv_heads, m.head_dim);
  if (ks != vs || k_cache.shape(2) != v_cache.shape(2))
    fail("k_cache and v_cache must have the same shape and strides");
  const int64_t max_len = k_cache.shape(2);
  m.k_cache = k_cache.mutable_data();
  m.v_cache = v_cache.mutable_data();
  m.storage = storage;
  m.cache_stride_b = ks[0];
  m.cache_stride_h = ks[1];
  m.cache_stride_s = ks[2];
  if (storage == Storage::i8) {  // (batch, num_kv_heads, max_len) float32 beside contiguous storage
    const py::handle given[2] = {k_scales, v_scales};
    float** dst[2] = {&m.k_scales, &m.v_scales};
    for (int which = 0; which < 2; ++which) {
      if (given[which].is_none()) fail("k/v scales: an int8 cache needs its row scales");
      py::array sc = py::reinterpret_borrow<py::array>(given[which]);
      if (!is_float32(sc) || sc.ndim() != 3 || sc.shape(0) != m.batch || sc.shape(1) != m.num_kv_heads ||
          sc.shape(2) != max_len || !(sc.flags() & py::array::c_style) || !sc.writeable() || ks[2] != m.head_dim ||
          ks[1] != max_len * m.head_dim || ks[0] != m.num_kv_heads * ks[1])
        fail(
            "k/v scales: expected writeable C-contiguous float32 (batch, num_kv_heads, max_len) scales beside "
            "C-contiguous storage");
      *dst[which] = static_cast<float*>(sc.mutable_data());
    }
  }
  m.lengths_before = lengths_array("lengths_before", before, m.batch);
  m.lengths_after = lengths_array("lengths_after", after, m.batch);
  for (int64_t b = 0; b < m.batch; ++b) {
    const int64_t lo = m.lengths_before[b], hi = m.lengths_after[b];
    if (lo < 0 || hi < lo || hi > max_len || hi - lo > m.chunk)
      fail("lengths: need 0 <= before <= after <= max_len and after - before <= chunk in every batch row");
  }
  m.left_padded = left_padded;
  m.variants = variants.options();
  check_output("out", out, py::dtype::of<T>(), checked_mul(rows, m.embed_dim));
  m.out = static_cast<T*>(out.mutable_data());
  py::gil_scoped_release release;
  multi_head_attention_cached<T>(m, num_threads);
}

void mha_cached_py(const py::array& x, const py::tuple& w, const std::vector<int64_t>& dims, py::array k_cache,
                   py::array v_cache, int storage, const py::array& before, const py::array& after, bool left_padded,
                   py::array out, py::handle num_threads, py::handle window, py::handle softcap, py::handle sinks,
                   py::handle alibi_slopes, py::handle k_scales, py::handle v_scales, bool bf16) {
  if (dims.size() != 6) fail("dims must have 6 entries");
  if (storage < 0 || storage > 3) fail("storage must be 0 (same), 1 (float16), 2 (bfloat16) or 3 (int8)");
  const int threads = parse_threads(num_threads);
  const Variants variants = parse_variants(window, softcap, sinks, alibi_slopes, Dims{dims[0]}, dims[3]);
  if (bf16) {  // as mha's bf16: uint16 rows, pack_weights16 weights, float32 out; any float32 cache
    if (!active_kernels().bf16_dots) fail("bf16: the ISA in use has no bfloat16 dot products");
    return run_mha_cached<float>(x, w, dims, k_cache, v_cache, Storage(storage), before, after, left_padded, out,
                                 threads, variants, k_scales, v_scales, true);
  }
  if (is_float32(x))
    return run_mha_cached<float>(x, w, dims, k_cache, v_cache, Storage(storage), before, after, left_padded, out,
                                 threads, variants, k_scales, v_scales);
  if (storage != 0) fail("query: must be float32 with a 16-bit or int8 cache");
  if (is_float64(x))
    return run_mha_cached<double>(x, w, dims, k_cache, v_cache, Storage(storage), before, after, left_padded, out,
                                  threads, variants, k_scales, v_scales);
  fail("query: dtype must be float32 or float64");
}

}  // namespace

// The GEMM and multi-head layer entries of the _core module.
void bind_mha(py::module_& m) {
  m.def("pack_weights", &pack_weights_py, py::arg("weight"),
        "Pack a (out_features, in_features) weight for the active ISA's GEMM; returns (packed, panel).");
  m.def("linear", &linear_py, py::arg("x"), py::arg("packed"), py::arg("panel"), py::arg("n"), py::arg("bias"),
        py::arg("out"), py::arg("num_threads"), "out = x @ W.T + bias with W packed by pack_weights.");
  m.def("mha", &mha_py, py::arg("xq"), py::arg("xk"), py::arg("xv"), py::arg("weights"), py::arg("dims"),
        py::arg("masks"), py::arg("is_causal"), py::arg("out"), py::arg("attn_weights"), py::arg("num_threads"),
        py::arg("window") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens") = py::none(), py::arg("bf16") = false,
        "Low-level multi-head attention entry; arguments prepared by pyattn._mha (bf16: a bfloat16 layer's\n"
        "uint16 inputs and pack_weights16 weights, float32 out).");
  m.def("pack_weights16", &pack_weights16_py, py::arg("weight"),
        "Pack a bfloat16 weight's uint16 view in pairs for the avx512bf16 GEMM; returns (packed, panel).");
  m.def("mha_cached", &mha_cached_py, py::arg("x"), py::arg("weights"), py::arg("dims"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("storage"), py::arg("lengths_before"), py::arg("lengths_after"),
        py::arg("left_padded"), py::arg("out"), py::arg("num_threads"), py::arg("window") = py::none(),
        py::arg("softcap") = py::none(), py::arg("sinks") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(), py::arg("bf16") = false,
        "Low-level layer step over a KV cache (project, append, attend, project); arguments prepared by "
        "pyattn._mha and pyattn.KVCache (bf16: as mha's).");
}

}  // namespace pyattn
