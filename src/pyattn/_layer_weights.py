# SPDX-License-Identifier: MIT
"""A multi-head layer's weights: checked against the layer's sizes (torch.nn.MultiheadAttention's
layouts and names) and packed for the active ISA's GEMM. Used by pyattn.mha and
pyattn.MultiHeadAttention (_mha.py)."""

from __future__ import annotations

import numpy as np

from . import _core
from ._arrays import COMPUTE_DTYPES, allocate, as_array, kernel_layout


def is_bf16(dtype):
    """A bfloat16 layer's dtype (ml_dtypes.bfloat16, native byte order)."""
    return dtype.name == "bfloat16" and dtype.itemsize == 2 and dtype.isnative


def float_array(x, name, dtype=None):
    """x as a float32/float64/bfloat16 NumPy array (None stays None), of `dtype` when given; TypeError
    naming `name`."""
    if x is None:
        return None
    x = as_array(x, name)
    if x.dtype not in COMPUTE_DTYPES and not is_bf16(x.dtype):
        raise TypeError(f"{name}: dtype must be float32, float64 or bfloat16, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: dtype must be {dtype} (the other inputs' dtype), got {x.dtype}")
    return x


def _expect_shape(x, shape, name):
    if x is not None and x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")


class LayerWeights:
    """Validated layer weights: q/k/v/out projections (out_features, in_features) and biases.

    A bfloat16 layer (dtype bfloat16) computes in float32 (``compute``): under precision "fast" on an
    ISA with bfloat16 dot products its projections are pair GEMMs over the bfloat16 weights and inputs
    (``pairs``, the core's ``bf16=True``: weights from pack_weights16, float32 biases), otherwise the
    float32 layer over the same values (bfloat16 widens to float32 exactly); the results are rounded
    to bfloat16 once."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, kdim, vdim, q, k, v, o, bq, bk, bv, bo):
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.kdim, self.vdim = kdim, vdim
        self.head_dim = embed_dim // num_heads
        self.q, self.k, self.v, self.o = q, k, v, o
        self.bq, self.bk, self.bv, self.bo = bq, bk, bv, bo
        self.dtype = q.dtype
        self.bf16 = is_bf16(self.dtype)
        self.compute = np.dtype(np.float32) if self.bf16 else self.dtype
        self._packed = {}

    def __getstate__(self):
        """Pickling (and copy.deepcopy): the weights without their packed copies, which are a cache
        for one ISA on cache lines (a pickled copy comes back off its line, refused by the core, and
        the loading CPU may run another ISA); a layer's weights (packed at construction) are packed
        again when loaded."""
        return {**self.__dict__, "_packed": {}, "_was_packed": bool(self._packed)}

    def __setstate__(self, state):
        was_packed = state.pop("_was_packed", False)
        # Unpickled arrays may sit anywhere in the loader's buffer (pickle protocol 5, Dask's frames):
        # the core reads weights only element-aligned, so misaligned ones are copied.
        state = {
            key: np.require(value, requirements="A") if isinstance(value, np.ndarray) else value
            for key, value in state.items()
        }
        self.__dict__.update(state)
        if was_packed:
            self.packed()

    def pairs(self, precision="fast"):
        """Whether the core computes this bfloat16 layer's projections in bfloat16 pairs under
        `precision` on the ISA in use (checked for every layer: an error names a bad precision)."""
        return _core.bf16_dots(precision) and self.bf16

    def packed(self, pairs=None):
        """(q, k, v, o) weights packed for the active ISA's GEMM (cached per ISA and form), and the
        panel width: in bfloat16 pairs (pack_weights16) with `pairs` (default: pairs()), else the
        float32 (or float64) values."""
        pairs = self.pairs() if pairs is None else pairs
        key = (_core.isa(), pairs)
        if key not in self._packed:
            weights = (self.q, self.k, self.v, self.o)
            if pairs:
                packs = [_core.pack_weights16(np.ascontiguousarray(w).view(np.uint16)) for w in weights]
            else:
                packs = [_core.pack_weights(np.ascontiguousarray(w, dtype=self.compute)) for w in weights]
            self._packed[key] = (tuple(p for p, _ in packs), packs[0][1])
        return self._packed[key]

    def biases(self):
        """(q, k, v, o) biases as the core takes them: in the compute dtype (None stays None)."""
        if not self.bf16:
            return (self.bq, self.bk, self.bv, self.bo)
        return tuple(None if b is None else b.astype(np.float32) for b in (self.bq, self.bk, self.bv, self.bo))

    def core_rows(self, x, pairs, num_threads=None):
        """An input's (rows, features) matrix as the core reads it: a bfloat16 layer's as the uint16
        view of its bfloat16 rows (pairs) or their float32 values (widened by the core's threads)."""
        if not self.bf16:
            return x
        if pairs:
            return x.view(np.uint16)
        if not x.flags.c_contiguous:
            return x.astype(np.float32)
        wide = allocate(x.shape, np.float32, "query")
        _core._convert_half(x.view(np.uint16), wide, num_threads, bfloat16=True)
        return wide

    def core_weights(self, pairs):
        """The core layer call's weights tuple: (q, k, v, o) weights (for_core) and their biases."""
        return (*self.for_core(pairs), *self.biases())

    def for_core(self, pairs):
        """(q, k, v, o) weights as the core's layer calls take them: packed for the active ISA once
        this object has packed (MultiHeadAttention packs at construction), else the weight arrays
        themselves (pyattn.mha: one call, whose GEMM tasks pack the panels they compute into
        per-thread scratch, or for one or two rows read them in place: no four fresh packed copies
        per call, same results). A bfloat16 layer's are always packed (packed())."""
        if self._packed or self.bf16:
            return self.packed(pairs)[0]
        return tuple(
            kernel_layout(x, n)
            for x, n in zip(
                (self.q, self.k, self.v, self.o), ("q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj_weight")
            )
        )

    def linear(self, x, which, threads):
        """x (rows, in) @ W.T + b for which in "qkvo", through the core's GEMM."""
        packed, panel = self.packed()
        index = "qkvo".index(which)
        w, b = (self.q, self.k, self.v, self.o)[index], (self.bq, self.bk, self.bv, self.bo)[index]
        out = allocate((x.shape[0], w.shape[0]), self.dtype, "out")
        _core.linear(x, packed[index], panel, w.shape[0], b, out, threads)
        return out


def resolve_weights(
    embed_dim,
    kdim,
    vdim,
    num_heads,
    num_kv_heads,
    dtype,
    in_proj_weight,
    in_proj_bias,
    q_proj_weight,
    k_proj_weight,
    v_proj_weight,
    q_proj_bias,
    k_proj_bias,
    v_proj_bias,
    out_proj_weight,
    out_proj_bias,
):
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    if embed_dim % num_heads != 0:
        raise ValueError(f"num_heads: must divide embed_dim ({embed_dim}), got {num_heads}")
    if num_kv_heads is None:
        num_kv_heads = num_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, (int, np.integer)) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: expected a positive int, got {num_kv_heads!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads: must divide num_heads ({num_heads}), got {num_kv_heads}")
    head_dim = embed_dim // num_heads
    kv_width = num_kv_heads * head_dim

    names = (
        "in_proj_weight",
        "in_proj_bias",
        "q_proj_weight",
        "k_proj_weight",
        "v_proj_weight",
        "q_proj_bias",
        "k_proj_bias",
        "v_proj_bias",
        "out_proj_weight",
        "out_proj_bias",
    )
    values = (
        in_proj_weight,
        in_proj_bias,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
        q_proj_bias,
        k_proj_bias,
        v_proj_bias,
        out_proj_weight,
        out_proj_bias,
    )
    arrays = {n: float_array(x, n, dtype) for n, x in zip(names, values)}
    if arrays["out_proj_weight"] is None:
        raise ValueError("out_proj_weight: required")
    if arrays["in_proj_weight"] is not None:
        if any(arrays[n] is not None for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
            raise ValueError("in_proj_weight: pass either in_proj_weight or q/k/v_proj_weight, not both")
        if kdim != embed_dim or vdim != embed_dim:
            raise ValueError(
                f"in_proj_weight: needs key and value feature sizes equal to embed_dim ({embed_dim}); "
                f"got kdim={kdim}, vdim={vdim}: pass q/k/v_proj_weight instead"
            )
        w = arrays["in_proj_weight"]
        _expect_shape(w, (embed_dim + 2 * kv_width, embed_dim), "in_proj_weight")
        q, k, v = w[:embed_dim], w[embed_dim : embed_dim + kv_width], w[embed_dim + kv_width :]
    else:
        q, k, v = arrays["q_proj_weight"], arrays["k_proj_weight"], arrays["v_proj_weight"]
        for n, x in (("q_proj_weight", q), ("k_proj_weight", k), ("v_proj_weight", v)):
            if x is None:
                raise ValueError(f"{n}: required (or pass in_proj_weight)")
        _expect_shape(q, (embed_dim, embed_dim), "q_proj_weight")
        _expect_shape(k, (kv_width, kdim), "k_proj_weight")
        _expect_shape(v, (kv_width, vdim), "v_proj_weight")
    bq, bk, bv = arrays["q_proj_bias"], arrays["k_proj_bias"], arrays["v_proj_bias"]
    if arrays["in_proj_bias"] is not None:
        if any(b is not None for b in (bq, bk, bv)):
            raise ValueError("in_proj_bias: pass either in_proj_bias or q/k/v_proj_bias, not both")
        b = arrays["in_proj_bias"]
        _expect_shape(b, (embed_dim + 2 * kv_width,), "in_proj_bias")
        bq, bk, bv = b[:embed_dim], b[embed_dim : embed_dim + kv_width], b[embed_dim + kv_width :]
    _expect_shape(bq, (embed_dim,), "q_proj_bias")
    _expect_shape(bk, (kv_width,), "k_proj_bias")
    _expect_shape(bv, (kv_width,), "v_proj_bias")
    o = arrays["out_proj_weight"]
    _expect_shape(o, (embed_dim, embed_dim), "out_proj_weight")
    _expect_shape(arrays["out_proj_bias"], (embed_dim,), "out_proj_bias")

    def contiguous(x):
        return None if x is None else np.ascontiguousarray(x)

    return LayerWeights(
        embed_dim,
        num_heads,
        num_kv_heads,
        kdim,
        vdim,
        q,
        k,
        v,
        o,
        contiguous(bq),
        contiguous(bk),
        contiguous(bv),
        contiguous(arrays["out_proj_bias"]),
    )
