# SPDX-License-Identifier: MIT
"""API fuzzing for pyattn.scaled_dot_product_attention: the strategy, the oracle, and a long-run CLI.

Each example is one call with random shapes, strides, broadcasting, dtypes (valid and invalid),
masks, causal options, grouped-query ratios, scales, thread counts and `out=` arguments, plus at most
one deliberate mistake. The oracle: a call built without a mistake must succeed, leave its inputs
untouched, return `out` when one was given, and agree with pyattn.reference within tests/conftest.py's
TOL; a call with a mistake must raise the ValueError/TypeError the error policy names (DESIGN §2),
with a message naming the argument. Anything else (another exception, a wrong result, a crash of the
process) is a failure.

tests/test_fuzz.py runs a bounded number of examples inside pytest. For release checks run it longer:

    python tests/fuzz_api.py --minutes 10        # from the repository root, package installed

It prints how many examples ran, what they covered, and on failure the reproducing example
(hypothesis prints it; the failure is also stored in .hypothesis/ for the next run).
"""

from __future__ import annotations

import argparse
import collections
import math
import pickle
import sys
import time

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import reference

try:  # the one tolerance table of the suite
    from conftest import np_dtype, tol
except ImportError:  # pragma: no cover - run from elsewhere
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from conftest import np_dtype, tol

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - optional
    ml_dtypes = None


# Tags counted over a run (a crude coverage report; hypothesis `event`s show the same in
# `pytest --hypothesis-show-statistics`).
COVERAGE: collections.Counter = collections.Counter()


class Case:
    """One call: its arguments, the expected outcome, and tags describing what it exercises.

    error is None for a valid call, else the exception class the error policy prescribes; names are
    the arguments of which the message must mention at least one.
    """

    def __init__(self, query, key, value, attn_mask, kwargs, isa, error=None, names=(), tags=()):
        self.query, self.key, self.value, self.attn_mask = query, key, value, attn_mask
        self.kwargs, self.isa = kwargs, isa
        self.error: type | None = error
        self.names = tuple(names)
        self.tags = list(tags)

    def __repr__(self):  # shown by hypothesis on failure: shapes/strides, not megabytes of values
        def describe(x):
            if isinstance(x, np.ndarray):
                return f"ndarray(shape={x.shape}, dtype={x.dtype}, strides={x.strides}, aligned={x.flags.aligned})"
            if isinstance(x, list):
                return f"list(len={len(x)})"
            return repr(x)

        kw = {k: describe(v) for k, v in self.kwargs.items()}
        return (
            f"Case(isa={self.isa!r}, query={describe(self.query)}, key={describe(self.key)}, "
            f"value={describe(self.value)}, attn_mask={describe(self.attn_mask)}, kwargs={kw}, "
            f"error={self.error.__name__ if self.error else None}, names={self.names}, tags={self.tags})"
        )


# --- building blocks ------------------------------------------------------------------------------

_FLOATS = ("float32", "float64")
# Big-endian floats too: a ">f2" array also calls itself "float16" (it was once read as native bits).
_BAD_DTYPES = ("int32", "int64", "complex64", "complex128", "object", "bool", "uint8", ">f2", ">f4", ">f8")
_HALF = ("float16",) + (("bfloat16",) if ml_dtypes is not None else ())
_LAYOUTS = (
    "c",
    "c",
    "c",
    "guarded",
    "transposed",
    "reversed",
    "last_strided",
    "fortran",
    "misaligned",
    "stride0",
    "unpickled",
)


def _values(rng, shape, dtype):
    """Standard-normal values of dtype (or the closest thing for non-float dtypes)."""
    x = rng.standard_normal(shape)
    dt = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if dt.kind in "iu":
        return (x * 3).astype(dt)
    if dt.kind == "b":
        return x > 0
    if dt.kind == "c":
        return (x + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "O":
        out = np.empty(shape, dtype=object)
        out[...] = x
        return out
    return x.astype(dt)


def _layout(x, layout, rng):
    """An array holding x's values in the given memory layout (a view of a fresh parent)."""
    if x.ndim == 0 or layout == "c":
        return np.ascontiguousarray(x)
    if layout == "unpickled":  # an equal dtype that is another object (pickle rebuilds the descriptor)
        back = pickle.loads(pickle.dumps(np.ascontiguousarray(x)))
        return back if back.dtype.str == x.dtype.str else np.ascontiguousarray(x)  # NumPy unpickles >f4 as <f4
    if layout == "guarded":  # offset view of a NaN-filled parent, rows not adjacent
        pad = 2
        parent = np.zeros(tuple(n + 2 * pad for n in x.shape), dtype=x.dtype)
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            parent[...] = np.nan
        view = parent[tuple(slice(pad, pad + n) for n in x.shape)]
        view[...] = x
        return view
    if layout == "transposed" and x.ndim >= 3:  # BSHD memory seen as BHSD
        parent = np.ascontiguousarray(np.swapaxes(x, -2, -3))
        return np.swapaxes(parent, -2, -3)
    if layout == "reversed" and x.ndim >= 2:  # negative stride on the row axis
        parent = np.ascontiguousarray(x[..., ::-1, :])
        return parent[..., ::-1, :]
    if layout == "last_strided":  # the last axis not contiguous: documented copy
        parent = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
        view = parent[..., ::2]
        view[...] = x
        return view
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "misaligned" and x.dtype.itemsize > 1 and x.dtype.kind != "O":
        buf = np.zeros(x.nbytes + x.dtype.itemsize, dtype=np.uint8)
        view = np.ndarray(x.shape, dtype=x.dtype, buffer=buf, offset=1)
        view[...] = x
        return view
    if layout == "stride0" and x.ndim >= 2 and x.shape[-2] > 1:  # every row the same: stride 0
        axis = int(rng.integers(0, x.ndim - 1))
        if x.shape[axis] > 1:
            return np.broadcast_to(np.take(x, [0], axis=axis), x.shape)
    return np.ascontiguousarray(x)


def _reduce_batch(batch, rng, drop_ok=True):
    """A batch shape that broadcasts to `batch`: leading dims dropped, others set to 1."""
    batch = list(batch)
    if drop_ok and batch and rng.random() < 0.3:
        batch = batch[int(rng.integers(1, len(batch) + 1)) :]
    return tuple(1 if rng.random() < 0.3 else n for n in batch)


# --- the strategy ---------------------------------------------------------------------------------

MISTAKES = (
    "bad_dtype",
    "mixed_dtype",
    "ndim1",
    "key_dim",
    "value_len",
    "value_heads",
    "heads_no_gqa",
    "gqa_ratio",
    "batch_mismatch",
    "mask_dtype",
    "mask_shape",
    "mask_extra_batch",
    "scale_nonfinite",
    "scale_type",
    "threads_value",
    "threads_type",
    "causal_value",
    "out_shape",
    "out_dtype",
    "out_layout",
    "out_readonly",
    "out_type",
    "out_overlap",
    "masked",
    "window_value",
    "softcap_value",
    "sinks_shape",
    "alibi_value",
)


@st.composite
def cases(draw):
    """A random call of pyattn.scaled_dot_product_attention and its expected outcome."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tags = []
    mistake = draw(st.one_of(st.none(), st.none(), st.sampled_from(MISTAKES)))
    if mistake:
        tags.append(f"mistake:{mistake}")
    error, names = None, ()

    def fail(exc, *arg_names):
        nonlocal error, names
        error, names = exc, arg_names

    # dtype: a third of the calls (a fifth without ml_dtypes) in a 16-bit float
    dtype = draw(st.sampled_from(_FLOATS + _FLOATS + _HALF))
    q_dtype = k_dtype = v_dtype = dtype
    if mistake == "bad_dtype":
        q_dtype = k_dtype = v_dtype = draw(st.sampled_from(_BAD_DTYPES))
        fail(TypeError, "query")
    elif mistake == "mixed_dtype":
        other = "float64" if dtype == "float32" else "float32"
        which = draw(st.sampled_from(["key", "value"]))
        k_dtype, v_dtype = (other, dtype) if which == "key" else (dtype, other)
        fail(TypeError, "query", "key", "value")
    tags.append(f"dtype:{q_dtype}")

    # shapes
    rank = draw(st.sampled_from([2, 3, 3, 4, 4, 5]))
    nb = max(rank - 3, 0)
    batch = [draw(st.sampled_from([1, 2, 3, 2])) for _ in range(nb)]
    kv_heads = draw(st.integers(1, 3)) if rank >= 3 else 1
    ratio = draw(st.sampled_from([1, 1, 2, 3])) if rank >= 3 else 1
    enable_gqa = ratio > 1 or draw(st.booleans())
    q_heads = kv_heads * ratio
    sizes = {
        "q_len": draw(st.sampled_from([1, 2, 5, 7, 16, 17, 33])),
        "kv_len": draw(st.sampled_from([1, 3, 8, 13, 31, 65])),
        "head_dim": draw(st.sampled_from([1, 2, 3, 8, 16, 17, 33, 64])),
    }
    sizes["value_dim"] = draw(st.sampled_from([sizes["head_dim"], 1, 5, 16]))
    # About one case in eight has a zero-size dimension (defined results, no crash).
    zero = draw(st.sampled_from(["none"] * 14 + ["batch", "q_len", "kv_len", "head_dim", "value_dim"]))
    if zero == "batch" and batch:
        batch[int(rng.integers(0, len(batch)))] = 0
    elif zero in sizes:
        sizes[zero] = 0
    batch = tuple(batch)
    q_len, kv_len, head_dim, value_dim = sizes["q_len"], sizes["kv_len"], sizes["head_dim"], sizes["value_dim"]
    tags += [f"rank:{rank}", f"gqa:{ratio}"]
    if 0 in batch or 0 in sizes.values():
        tags.append(f"zero_size:{zero}")

    def heads_shape(b, h, length, dim):
        return (length, dim) if rank == 2 else b + (h, length, dim)

    q_shape = heads_shape(_reduce_batch(batch, rng), q_heads, q_len, head_dim)
    k_batch = _reduce_batch(batch, rng)
    k_shape = heads_shape(k_batch, kv_heads, kv_len, head_dim)
    v_shape = heads_shape(_reduce_batch(batch, rng) if draw(st.booleans()) else k_batch, kv_heads, kv_len, value_dim)
    if rank >= 3 and ratio == 1 and kv_heads == 1 and draw(st.integers(0, 4)) == 0:
        q_shape = q_shape[-2:] if len(q_shape) == 3 else q_shape  # a 2-D query against 3-D keys
        tags.append("mixed_rank")

    if mistake == "ndim1":
        q_shape = (head_dim,)
        fail(ValueError, "query")
    elif mistake == "key_dim":
        k_shape = k_shape[:-1] + (head_dim + 1,)
        fail(ValueError, "key")
    elif mistake == "value_len":
        v_shape = v_shape[:-2] + (kv_len + 1, value_dim)
        fail(ValueError, "value")
    elif mistake == "value_heads" and rank >= 3:
        v_shape = v_shape[:-3] + (kv_heads + 1,) + v_shape[-2:]
        fail(ValueError, "value")
    elif mistake == "heads_no_gqa" and rank >= 3:
        q_heads = 2 * kv_heads
        q_shape = q_shape[:-3] + (q_heads,) + q_shape[-2:]
        enable_gqa = False
        fail(ValueError, "key", "enable_gqa")
    elif mistake == "gqa_ratio" and rank >= 3:
        kv_heads = 2
        q_heads = 3
        q_shape, k_shape = q_shape[:-3] + (3,) + q_shape[-2:], k_shape[:-3] + (2,) + k_shape[-2:]
        v_shape = v_shape[:-3] + (2,) + v_shape[-2:]
        enable_gqa = True
        fail(ValueError, "enable_gqa")
    elif mistake == "batch_mismatch" and len(q_shape) == len(k_shape):
        tail = 3 if rank >= 3 else 2  # batch dims 2 and 3 at the same (aligned) position
        q_shape, k_shape, v_shape = (2,) + q_shape[-tail:], (3,) + k_shape[-tail:], (3,) + v_shape[-tail:]
        fail(ValueError, "query", "key", "value", "enable_gqa")
    if mistake and error is None:
        mistake = None  # the mistake did not apply to this rank: a valid call after all

    query = _values(rng, q_shape, q_dtype)
    key = _values(rng, k_shape, k_dtype)
    value = _values(rng, v_shape, v_dtype)

    # attention mask
    mask = None
    full_shape = (
        np.broadcast_shapes(q_shape[:-3], k_shape[:-3], v_shape[:-3]) + (q_heads, q_len, kv_len)
        if error is None and rank >= 3
        else (q_len, kv_len)
    )
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "bool", "float"]))
    if mistake in ("mask_dtype", "mask_shape", "mask_extra_batch") and mask_kind == "none":
        mask_kind = "bool"
    if mask_kind != "none":
        shape = list(full_shape)
        drop = int(rng.integers(0, len(shape) + 1)) if draw(st.booleans()) else 0
        shape = [1 if (rng.random() < 0.4 and i < len(shape) - 1) else n for i, n in enumerate(shape)][drop:]
        if draw(st.integers(0, 5)) == 0 and shape:
            shape[-1] = 1  # one value for every key
        p_allowed = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
        allowed = rng.random(shape) < p_allowed
        mask_dtype = dtype
        if mistake == "mask_dtype":
            wrong = ["int8", "int64", "float16", "complex64", "object", "float64" if dtype == "float32" else "float32"]
            mask_dtype = draw(st.sampled_from([w for w in wrong if w != dtype]))
            fail(TypeError, "attn_mask")
        elif mistake == "mask_shape":
            shape = shape[:-1] + [kv_len + 2] if shape else [kv_len + 2]
            allowed = rng.random(shape) < p_allowed
            fail(ValueError, "attn_mask")
        elif mistake == "mask_extra_batch":
            shape = [2] + [2 if n == 1 else n for n in full_shape]
            allowed = rng.random(shape) < p_allowed
            fail(ValueError, "attn_mask")
        mdt = np_dtype(mask_dtype)
        if mask_kind == "bool" and mistake != "mask_dtype":
            mask = allowed
        elif mdt.kind == "f" or mdt.name == "bfloat16":
            mask = np.where(allowed, _values(rng, shape, "float64"), -np.inf).astype(mdt)
        else:  # a wrong kind of mask: integers, complex, objects
            mask = _values(rng, shape, mdt)
        tags.append(f"mask:{mask_kind}:p{p_allowed}")

    # special values: NaN behind forbidden keys must not leak; NaN in a query row propagates
    special = draw(st.sampled_from(["none", "none", "none", "forbidden_nan", "query_nan"]))
    if (
        error is None
        and kv_len > 1
        and special == "forbidden_nan"
        and mask is not None
        and mask.ndim
        and mask.shape[-1] == kv_len
    ):
        j = int(rng.integers(0, kv_len))
        mask[..., j] = False if mask.dtype == np.bool_ else -np.inf
        key[..., j, :] = np.nan
        value[..., j, :] = np.nan
        tags.append("special:forbidden_nan")
    elif error is None and query.size > 0 and special == "query_nan":
        query[(0,) * (query.ndim - 2) + (int(rng.integers(0, q_len)), int(rng.integers(0, head_dim)))] = np.nan
        tags.append("special:query_nan")

    # memory layouts (applied after the values are final)
    layouts = [draw(st.sampled_from(_LAYOUTS)) for _ in range(4)]
    query, key, value = (_layout(x, lay, rng) for x, lay in zip((query, key, value), layouts))
    if mask is not None:
        mask = _layout(mask, layouts[3], rng)
    tags += [f"layout:{lay}" for lay in set(layouts)]
    if mistake == "masked" and error is None:  # a numpy.ma array: its mask would be dropped, so refused
        arrays = {"query": query, "key": key, "value": value, "attn_mask": mask}
        which = draw(st.sampled_from([n for n, x in arrays.items() if isinstance(x, np.ndarray) and x.ndim]))
        x = arrays[which]
        masked = np.ma.masked_array(x, mask=rng.random(x.shape) < 0.3)
        query, key, value, mask = (masked if n == which else a for n, a in arrays.items())
        fail(TypeError, which)
    if error is None and dtype == "float64" and query.size > 0 and draw(st.integers(0, 9)) == 0:
        query = query.tolist()  # any array-like is accepted
        tags.append("layout:list")

    kwargs = {}
    causal = draw(st.sampled_from([False, False, True, "upper_left", "lower_right", np.bool_(True)]))
    if mistake == "causal_value":
        causal = draw(st.sampled_from(["diagonal", 1, None, "", "LOWER_RIGHT"]))
        fail(ValueError, "is_causal")
    if causal is not False or draw(st.booleans()):
        kwargs["is_causal"] = causal
    tags.append(f"causal:{causal}")

    # The variants (window, softcap, sinks, ALiBi): valid values unless the mistake is theirs.
    hq = q_shape[-3] if len(q_shape) >= 3 else 1
    variant = draw(st.sampled_from(["none", "none", "none", "window", "softcap", "sinks", "alibi", "all"]))
    if mistake in ("window_value", "softcap_value", "sinks_shape", "alibi_value"):
        variant = mistake
    side = st.sampled_from([None, 0, 1, 3, 40, 2**50])
    if variant in ("window", "all"):
        kwargs["window"] = (draw(side), draw(side))
    if variant in ("softcap", "all"):
        kwargs["softcap"] = draw(st.sampled_from([0.3, 5.0, 50.0, 1e6]))
    if variant in ("sinks", "all"):
        kwargs["sinks"] = rng.standard_normal(hq) * draw(st.sampled_from([1.0, 10.0]))
        if draw(st.integers(0, 3)) == 0:
            kwargs["sinks"][0] = -np.inf
    if variant in ("alibi", "all"):
        kwargs["alibi_slopes"] = rng.uniform(-0.3, 0.6, hq).astype(draw(st.sampled_from([np.float32, np.float64])))
    if variant == "window_value":
        kwargs["window"], exc = draw(
            st.sampled_from(
                [((-1, 0), ValueError), ((0, -3), ValueError), ((1.5, 0), TypeError), ((1, 2, 3), TypeError)]
                + [("3", TypeError), ((True, 0), TypeError)]
            )
        )
        fail(exc, "window")
    elif variant == "softcap_value":
        kwargs["softcap"], exc = draw(
            st.sampled_from([(0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError)])
            | st.sampled_from([("5", TypeError), (True, TypeError)])
        )
        fail(exc, "softcap")
    elif variant == "sinks_shape":
        kwargs["sinks"] = draw(st.sampled_from([np.zeros(hq + 1), np.zeros((1, hq)), np.full(hq, np.nan), 0.5]))
        fail(ValueError, "sinks")
    elif variant == "alibi_value":
        kwargs["alibi_slopes"] = draw(st.sampled_from([np.zeros(hq + 1), np.full(hq, np.inf), np.zeros(0)]))
        fail(ValueError, "alibi_slopes")
    tags.append(f"variant:{variant}")

    scale = draw(st.one_of(st.none(), st.floats(-3, 3, allow_nan=False), st.sampled_from([0.0, -0.0, np.float32(0.5)])))
    if mistake == "scale_nonfinite":
        scale = draw(st.sampled_from([math.nan, math.inf, -math.inf, np.float64("nan")]))
        fail(ValueError, "scale")
    elif mistake == "scale_type":
        scale = draw(st.sampled_from(["0.5", True, 1j, [1.0]]))
        fail(TypeError, "scale")
    if scale is not None:
        kwargs["scale"] = scale

    threads = draw(st.sampled_from([None, None, 1, 2, 3, 5, np.int64(2)]))
    if mistake == "threads_value":
        threads = draw(st.sampled_from([0, -1, -(2**40)]))
        fail(ValueError, "num_threads")
    elif mistake == "threads_type":
        threads = draw(st.sampled_from([2.0, "2", True]))
        fail(TypeError, "num_threads")
    if threads is not None:
        kwargs["num_threads"] = threads

    if enable_gqa:
        kwargs["enable_gqa"] = True
    if draw(st.integers(0, 3)) == 0:
        kwargs["return_weights"] = True
        tags.append("return_weights")
    if draw(st.integers(0, 3)) == 0:
        kwargs["return_lse"] = True
        tags.append("return_lse")

    # out=
    out_kind = draw(st.sampled_from(["none", "none", "none", "good"]))
    if mistake and mistake.startswith("out_"):
        out_kind = mistake
    if out_kind != "none" and (error is None or out_kind == mistake):
        out_shape = (
            (q_len, value_dim)
            if max(len(q_shape), len(k_shape), len(v_shape)) == 2
            else np.broadcast_shapes(q_shape[:-3], k_shape[:-3], v_shape[:-3]) + (q_heads, q_len, value_dim)
        )
        out_dtype = np_dtype(dtype)
        if out_kind == "out_shape":
            out_shape = out_shape[:-1] + (value_dim + 1,)
            fail(ValueError, "out")
        elif out_kind == "out_dtype":
            wrong = ["float64" if dtype == "float32" else "float32", "int32", "float16"]
            out_dtype = np.dtype(draw(st.sampled_from([w for w in wrong if w != dtype])))
            fail(TypeError, "out")
        out = np.full(out_shape, np.nan, dtype=out_dtype)
        if out_kind == "out_layout":
            parent = np.full(out_shape[:-1] + (2 * out_shape[-1] + 1,), np.nan, dtype=out_dtype)
            out = parent[..., : 2 * out_shape[-1] : 2] if draw(st.booleans()) else np.asfortranarray(out)
            if not out.flags.c_contiguous:
                fail(ValueError, "out")
        elif out_kind == "out_readonly":
            out.flags.writeable = False
            fail(ValueError, "out")
        elif out_kind == "out_type":
            out = out.tolist()
            fail(TypeError, "out")
        elif out_kind == "out_overlap":
            src = value if isinstance(value, np.ndarray) else None
            if src is not None and src.size and src.dtype == out_dtype:
                # out aliases value's memory (the first out.size elements of value's buffer)
                base = src
                while isinstance(base.base, np.ndarray):
                    base = base.base
                flat = base.reshape(-1) if base.flags.c_contiguous and base.dtype == out_dtype else None
                if flat is not None and flat.size >= math.prod(out_shape) > 0:
                    out = flat[: math.prod(out_shape)].reshape(out_shape)
                    fail(ValueError, "out")
        kwargs["out"] = out
        tags.append(f"out:{out_kind}")
    if mistake and error is None:
        mistake = None

    isa = draw(st.sampled_from(pyattn.available_isas()))
    tags.append(f"isa:{isa}")
    tags.append("valid" if error is None else f"error:{error.__name__}")
    return Case(query, key, value, mask, kwargs, isa, error, names, tags)


# --- the oracle -----------------------------------------------------------------------------------


def _snapshot(x):
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else None


def _same(a, b):
    if a.dtype.name == "bfloat16":  # ml_dtypes: NumPy sees kind 'V'; compare the values, NaN included
        a, b = a.astype(np.float64), b.astype(np.float64)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and (np.array_equal(a, b, equal_nan=True) if a.dtype.kind in "fc" else np.array_equal(a, b))
    )


def _score_factor(query, key, scale):
    """How much larger than usual the scores can be: the error of attention in a given precision
    grows with |score| = |scale * q.k| (softmax turns an absolute error of a score into a relative
    error of its weight), and TOL is set for the default scale on unit-variance data (|score| below
    ~16). Bound by Cauchy-Schwarz from the largest finite query and key rows: a row holding NaN or
    Inf gives NaN/Inf results, whose positions are compared exactly, but must not take the other rows'
    factor with it (a NaN query row once made it 1 for a call with scale 2.2)."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    if q.size == 0 or k.size == 0:
        return 1.0
    head_dim = q.shape[-1]
    s = float(scale) if scale is not None else (1.0 / math.sqrt(head_dim) if head_dim else 1.0)
    bound = abs(s) * largest_finite_norm(q) * largest_finite_norm(k)
    return max(1.0, bound / 16.0) if np.isfinite(bound) else 1.0


def largest_finite_norm(x) -> float:
    """The largest Euclidean norm among the rows (last axis) of x that hold only finite values; 0 if
    none does."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        norms = np.sqrt((x * x).sum(-1))
    return float(norms[np.isfinite(norms)].max(initial=0.0))


def _compare(got, want, dtype, factor=1.0):
    """pyattn's result vs the float64 reference with conftest's tolerance for its dtype, widened by
    `factor` (_score_factor) for calls whose scores are larger than the table assumes."""
    assert isinstance(got, np.ndarray), type(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == dtype, (got.dtype, dtype)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol * factor, atol=atol * factor)


# Discrepancies found by this fuzzer and reported, each with the condition that recognises it. A
# case matching one is counted (event "known:...") instead of failing, so the test guards everything
# else meanwhile. Delete an entry once it is fixed.
def _known_issue(case, exc=None, got_shape=None, want_shape=None):
    """None: the three discrepancies this fuzzer found (empty misaligned inputs refused, empty GQA
    batches refused, reference weights missing batch dimensions) are fixed; add new ones here."""
    return None


def _result_dtype(case):
    """Results have the inputs' dtype (float16/bfloat16 compute in float32 and return their own)."""
    return np.dtype(case.query.dtype if isinstance(case.query, np.ndarray) else np.float64)


def check(case: Case):
    """Runs the case and asserts the oracle (see the module docstring)."""
    for tag in case.tags:
        event(tag)
        COVERAGE[tag] += 1
    previous = pyattn.get_isa()
    pyattn._core._set_isa(case.isa)
    try:
        inputs = (case.query, case.key, case.value, case.attn_mask)
        before = [_snapshot(x) for x in inputs]
        try:
            result = pyattn.scaled_dot_product_attention(*inputs, **case.kwargs)
        except (ValueError, TypeError) as exc:
            if case.error is None:
                known = _known_issue(case, exc=exc)
                if known:
                    event(f"known:{known}")
                    COVERAGE[f"known:{known}"] += 1
                    return
                raise AssertionError(f"valid call raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(exc, case.error):
                raise AssertionError(f"expected {case.error.__name__}, got {type(exc).__name__}: {exc}") from exc
            if not any(name in str(exc) for name in case.names):
                raise AssertionError(f"error message names none of {case.names}: {exc}") from exc
            COVERAGE["outcome:" + type(exc).__name__] += 1
            return
        if case.error is not None:
            raise AssertionError(f"expected {case.error.__name__}, the call succeeded")
        for x, snap in zip(inputs, before):
            if snap is not None:
                assert _same(x, snap), "an input was modified"
        kwargs = {k: v for k, v in case.kwargs.items() if k not in ("out", "num_threads")}
        if isinstance(kwargs.get("is_causal"), np.bool_):  # the reference wants a Python bool
            kwargs["is_causal"] = bool(kwargs["is_causal"])
        want = reference.scaled_dot_product_attention(*inputs, **kwargs)
        factor = _score_factor(case.query, case.key, kwargs.get("scale"))
        got = result
        if case.kwargs.get("return_lse"):
            assert isinstance(result, tuple) and isinstance(want, tuple)
            *result, lse = result
            *want, want_lse = want
            result = result[0] if len(result) == 1 else tuple(result)
            want = want[0] if len(want) == 1 else tuple(want)
            got = result
            assert lse.shape == want_lse.shape, (lse.shape, want_lse.shape)
            compute = np.float64 if _result_dtype(case) == np.float64 else np.float32
            assert lse.dtype == compute
            finite = np.isfinite(want_lse)
            assert (np.isneginf(lse) == np.isneginf(want_lse)).all()
            # lse sits at the scores' scale: its error is the scores' (factor), in the compute dtype
            _compare(lse[finite], want_lse[finite], compute, factor)
        if case.kwargs.get("return_weights"):
            assert isinstance(result, tuple) and len(result) == 2
            got, weights = result
            want, want_weights = want
            if _known_issue(case, got_shape=weights.shape, want_shape=want_weights.shape):
                event("known:reference_weights_batch")
                COVERAGE["known:reference_weights_batch"] += 1
                assert weights.shape == want.shape[:-1] + want_weights.shape[-1:]
                want_weights = np.broadcast_to(want_weights, weights.shape)
            _compare(weights, want_weights, _result_dtype(case), factor)
        _compare(got, want, _result_dtype(case), factor)
        if "out" in case.kwargs:
            assert got is case.kwargs["out"], "out= was not returned"
        COVERAGE["outcome:ok"] += 1
    finally:
        pyattn._core._set_isa(previous)


def coverage_report(counter=None):
    counter = COVERAGE if counter is None else counter
    groups = collections.defaultdict(list)
    for tag, n in counter.items():
        groups[tag.split(":", 1)[0]].append((tag.split(":", 1)[-1], n))
    lines = []
    for group in sorted(groups):
        items = ", ".join(f"{name}={n}" for name, n in sorted(groups[group], key=lambda t: -t[1]))
        lines.append(f"  {group}: {items}")
    return "\n".join(lines)


# --- long runs ------------------------------------------------------------------------------------


def long_run(doc, batch, strategy, check, argv=None, what="fuzzing"):
    """The long-run CLI of both fuzzers (this one and tests/fuzz_cache.py): parses --minutes and
    --batch (default `batch`) from argv, then runs check on examples of strategy, --batch per
    hypothesis run, until the minutes are up. Returns (runs, seconds); raises, with the reproducing
    example, on the first failure."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    parser.add_argument("--batch", type=int, default=batch, help="examples per hypothesis run")
    args = parser.parse_args(argv)

    start = time.monotonic()
    deadline = start + 60 * args.minutes
    runs = 0
    print(f"pyattn {pyattn.__version__}, ISAs {pyattn.available_isas()}, {what} for {args.minutes} min")
    # check itself is the test: hypothesis keys its example database by the test's source, so each
    # fuzzer replays its own saved failures.
    fuzz = settings(
        max_examples=args.batch,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(strategy)(check))
    while time.monotonic() < deadline:
        fuzz()
        runs += 1
    return runs, time.monotonic() - start


def main(argv=None):
    runs, _ = long_run(__doc__, 500, cases(), check, argv)
    total = sum(n for tag, n in COVERAGE.items() if tag.startswith("outcome:"))
    print(f"{total} calls in {runs} runs, no failure. Coverage:")
    print(coverage_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
