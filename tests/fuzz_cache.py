# SPDX-License-Identifier: MIT
"""Stateful fuzzing of incremental decoding: pyattn.KVCache, pyattn.mha(kv_cache=) and
MultiHeadAttention(kv_cache=), held against a plain NumPy model of what the cache must hold.

Each example builds a KVCache (random batch, KV heads, head_dim / value_dim, max_len, storage dtype,
ISA) and runs a random sequence of operations on it: `append` (chunks of any length, 0 included;
`num_new` per row as an array or a list; right or left padding with NaN in the padding tokens; key
and value of any float dtype and memory layout), `attend` (GQA/MQA head counts, query dtypes and
layouts, scales, thread counts, NaN in padding query rows, repeated with another thread count),
`truncate`, `trim`, `reset`, `keys()`/`values()` views, `lengths` edited in place, and decode steps
through `MultiHeadAttention.__call__` or `pyattn.mha` (batched or unbatched, in_proj or separate q/k/v
weights, with or without biases, ragged chunks). At most one operation per example is a deliberate
mistake (overflow past max_len, wrong shapes and dtypes, bad num_new, negative trim, out-of-range
lengths, a layer that does not fit the cache, ...).

The model keeps every row's length, the whole K/V storage in the storage dtype (so data past a row's
length, left by truncate or never written, is known too) and what the last append added. After every
operation: `lengths` and every stored bit equal the model's; views equal the model; attention outputs
(the real query rows of the last chunk: lower-right causal over each row's own keys) agree with
pyattn.reference in float64 on the stored, already rounded, K/V within tests/conftest.py's TOL of the
compute dtype; K/V written by a layer step agree with a float64 projection up to the storage's
rounding (the model then takes the stored bits); inputs are never modified; results are bitwise
identical for any thread count. A mistake must raise the ValueError/TypeError the error policy
prescribes (DESIGN §2), with a message naming the argument, and leave the cache exactly as it was
(lengths, every stored bit, and what the last append added, which attend() reads). A mistake whose
outcome is a reported, not yet fixed, discrepancy (KNOWN_ISSUES) is counted as known:<label> and
ends its example.

This file holds the strategy (programs()), the runner of the valid operations, check() and the
long-run CLI; tests/fuzz_cache_model.py the NumPy model and oracle; tests/fuzz_cache_mistakes.py the
mistake catalogue and KNOWN_ISSUES.

tests/test_fuzz.py runs a bounded number of examples inside pytest. For release checks run it longer:

    python tests/fuzz_cache.py --minutes 10      # from the repository root, package installed

It prints how many examples and operations ran, what they covered, and on failure the reproducing
example (hypothesis prints the program and, as notes, every operation as it was resolved; the
failure is also stored in .hypothesis/ for the next run).
"""

from __future__ import annotations

import collections
import math
import sys

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st

import pyattn

try:  # the one tolerance table of the suite, and what the two fuzzers share
    import fuzz_api
except ImportError:  # pragma: no cover - run from elsewhere
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import fuzz_api
from fuzz_api import _layout as fuzz_api_layout
from fuzz_api import ml_dtypes, np_dtype, tol
from fuzz_cache_mistakes import MISTAKES, KnownIssue, Mistakes
from fuzz_cache_model import MAX_ELEMENTS, MAX_EMBED, Model, Snapshot, _bits, _compare, _f64, _score_factor

# Tags counted over a run (a crude coverage report; hypothesis `event`s show the same in
# `pytest --hypothesis-show-statistics`).
COVERAGE: collections.Counter = collections.Counter()

STORAGE = ("float32", "float64", "float16") + (("bfloat16",) if ml_dtypes is not None else ())
# head_dim / value_dim: 1, odd sizes, and both sides of 8/16/32 lanes (AVX2, AVX-512, bfloat16 pairs).
DIMS = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 48, 64, 65, 100, 128)
# Chunk lengths: 0, decode steps, both sides of the decode kernel's limit, longer prefills; "fill"
# takes what is left of the shortest row (reaching long rows and key-range splits quickly).
DECODE_MAX = pyattn._core.DECODE_MAX_Q_LEN
CHUNKS = (0, 1, 1, 1, 2, 3, 5, DECODE_MAX, DECODE_MAX + 1, 12, 17, 33, "fill")
LAYOUTS = ("c", "c", "c", "guarded", "guarded", "transposed", "last_strided", "fortran", "list")
THREADS = (None, None, 1, 2, 3, np.int64(2))
RAGGED = ("no", "no", "array", "list")  # num_new: none, an int64 array, a list


def _layout(x, layout):
    """An array holding x's values in the given memory layout (fuzz_api's: a view of a fresh parent),
    or for "list" nested Python lists (float64 only; an empty list loses the shape)."""
    if layout == "list" and x.ndim and x.dtype == np.float64 and x.size:
        return x.tolist()
    return fuzz_api_layout(x, layout, None)  # LAYOUTS has no "stride0", the one that draws from rng


# --- programs (the strategy) ------------------------------------------------------------------------


class Op:
    """One operation: its kind and the random choices it was drawn with. Shapes that depend on the
    cache's state (chunk lengths that fit, the last chunk, lengths near the current ones) are resolved
    when the operation runs; the resolved call is recorded with hypothesis.note."""

    def __init__(self, kind, **args):
        self.kind, self.args = kind, args

    def __repr__(self):
        return f"{self.kind}({', '.join(f'{k}={v!r}' for k, v in self.args.items())})"


class Program:
    def __init__(self, config, ops, isa, seed):
        self.config, self.ops, self.isa, self.seed = config, ops, isa, seed

    def __repr__(self):
        ops = ",\n  ".join(repr(op) for op in self.ops)
        return f"Program(isa={self.isa!r}, seed={self.seed}, config={self.config},\n ops=[\n  {ops}])"


# "decode" is an append followed by an attend over it (what a decoding loop does).
_KINDS = (
    ("append",) * 4
    + ("attend",) * 3
    + ("decode",) * 4
    + ("mha",) * 5
    + ("truncate", "trim", "trim", "reset", "views", "views", "set_lengths")
)


@st.composite
def _ops(draw, kind=None):
    kind = kind or draw(st.sampled_from(_KINDS))
    seed = draw(st.integers(0, 2**32 - 1))
    if kind == "decode":
        return Op(kind, append=draw(_ops("append")).args, attend=draw(_ops("attend")).args)
    if kind == "append":
        return Op(
            kind,
            chunk=draw(st.sampled_from(CHUNKS)),
            ragged=draw(st.sampled_from(RAGGED)),
            left=draw(st.booleans()),
            dtype=draw(st.sampled_from(("same", "same", "float32", "float64") + STORAGE[2:])),
            layouts=(draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))),
            pad_nan=draw(st.booleans()),
            magnitude=draw(st.sampled_from([1.0, 1.0, 1.0, 3.0, 1e-3])),
            seed=seed,
        )
    if kind == "attend":
        return Op(
            kind,
            group=draw(st.sampled_from([1, 1, 2, 3, 4, 6])),
            dtype=draw(st.sampled_from(("same", "same", "same", "float32", "float64") + STORAGE[2:])),
            layout=draw(st.sampled_from(LAYOUTS)),
            scale=draw(st.one_of(st.none(), st.floats(-2, 2, allow_nan=False), st.sampled_from([0.0, 1.5]))),
            threads=draw(st.sampled_from(THREADS)),
            pad_nan=draw(st.booleans()),
            repeat=draw(st.sampled_from([False, False, False, True])),
            seed=seed,
        )
    if kind == "mha":
        return Op(
            kind,
            form=draw(st.sampled_from(["layer", "layer", "function"])),
            group=draw(st.sampled_from([1, 1, 2, 3, 4])),
            chunk=draw(st.sampled_from(CHUNKS)),
            ragged=draw(st.sampled_from(RAGGED)),
            left=draw(st.booleans()),
            unbatched=draw(st.booleans()),
            weights=draw(st.sampled_from(["in_proj", "separate", "separate_no_bias", "in_proj_no_bias"])),
            layout=draw(st.sampled_from(["c", "c", "guarded", "last_strided"])),
            threads=draw(st.sampled_from(THREADS)),
            pad_nan=draw(st.booleans()),
            seed=seed,
        )
    if kind in ("truncate", "trim"):
        return Op(kind, per_row=draw(st.booleans()), seed=seed)
    if kind == "set_lengths":
        return Op(kind, seed=seed)
    return Op(kind)


@st.composite
def programs(draw):
    """A random cache and a random sequence of operations on it, with at most one mistake."""
    batch = draw(st.integers(1, 3))
    num_kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from(DIMS))
    value_dim = draw(st.one_of(st.just(head_dim), st.just(head_dim), st.sampled_from(DIMS)))
    max_len = draw(st.one_of(st.integers(1, 40), st.integers(1, 40), st.integers(41, 300), st.integers(301, 2500)))
    # Cap the storage (a bitwise comparison runs after every operation): long caches get small rows.
    max_len = max(1, min(max_len, MAX_ELEMENTS // (batch * num_kv_heads * (head_dim + value_dim))))
    config = dict(
        batch=batch,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        max_len=max_len,
        dtype=draw(st.sampled_from(STORAGE)),
    )
    ops = draw(st.lists(_ops(), min_size=1, max_size=12))
    mistake = draw(st.one_of(st.none(), st.sampled_from(MISTAKES)))  # half the programs
    if mistake:
        ops.insert(draw(st.integers(0, len(ops))), Op("mistake", what=mistake, seed=draw(st.integers(0, 2**32 - 1))))
    isa = draw(st.sampled_from(pyattn.available_isas()))
    return Program(config, ops, isa, draw(st.integers(0, 2**32 - 1)))


# --- the runner -----------------------------------------------------------------------------------------


class Runner(Mistakes):
    """Runs a program's operations on a KVCache and on its Model, checking the cache after each one
    (the mistake operations come from fuzz_cache_mistakes.Mistakes)."""

    def __init__(self, program):
        self.program = program
        c = program.config
        self.rng = np.random.default_rng(program.seed)
        self.storage = np_dtype(c["dtype"])
        self.compute = np.dtype(np.float32) if self.storage.itemsize == 2 else self.storage
        # value_dim left out (its default) or given; bfloat16 by name or as the ml_dtypes type.
        value_dim = None if c["value_dim"] == c["head_dim"] and self.rng.random() < 0.5 else c["value_dim"]
        dtype = "bfloat16" if c["dtype"] == "bfloat16" and self.rng.random() < 0.5 else self.storage
        self.cache = pyattn.KVCache(
            c["batch"], c["num_kv_heads"], c["head_dim"], c["max_len"], value_dim=value_dim, dtype=dtype
        )
        self.model = Model(c["batch"], c["num_kv_heads"], c["head_dim"], c["value_dim"], c["max_len"], self.storage)
        self.batch, self.hk, self.d, self.dv, self.max_len = (
            c["batch"],
            c["num_kv_heads"],
            c["head_dim"],
            c["value_dim"],
            c["max_len"],
        )
        self.layers = {}
        self.tags = []
        self.check_state()

    def tag(self, t):
        self.tags.append(t)

    def trace(self, text):
        note(text)

    # -- invariants --------------------------------------------------------------------------------------
    def check_state(self):
        cache, model = self.cache, self.model
        assert isinstance(cache.lengths, np.ndarray) and cache.lengths.dtype == np.int64, cache.lengths
        assert cache.lengths.tolist() == model.lengths.tolist(), (cache.lengths, model.lengths)
        assert cache.dtype == self.storage
        for name, got, want in (("keys", cache._k, model.k), ("values", cache._v, model.v)):
            if _bits(got) != _bits(want):
                diff = np.argwhere(
                    (
                        got.view(np.uint8).reshape(got.shape + (-1,)) != want.view(np.uint8).reshape(want.shape + (-1,))
                    ).any(-1)
                )
                raise AssertionError(f"stored {name} differ from the model (first positions {diff[:4].tolist()})")

    # -- helpers ----------------------------------------------------------------------------------------
    def _values(self, shape, dtype, magnitude=1.0):
        return (magnitude * self.rng.standard_normal(shape)).astype(dtype)

    def _chunk(self, spec, ragged, limit=None):
        """A chunk length for spec (a CHUNKS entry) that fits: every row when not ragged, else at
        least one row (counts are drawn per row to fit)."""
        rooms = self.model.rooms()
        room = int(rooms.min()) if not ragged else int(rooms.max())
        chunk = room if spec == "fill" else min(spec, room)
        return chunk if limit is None else min(chunk, limit)

    def _counts(self, chunk):
        """num_new per row: random in [0, min(chunk, room)], some rows full, some empty."""
        rooms = self.model.rooms()
        counts = np.array([self.rng.integers(0, min(chunk, int(r)) + 1) for r in rooms], np.int64)
        for b in range(self.batch):
            pick = self.rng.random()
            if pick < 0.3:
                counts[b] = min(chunk, int(rooms[b]))
            elif pick < 0.4:
                counts[b] = 0
        return counts

    def _padded(self, shape, counts, chunk, left, pad_nan, dtype, magnitude=1.0, axis=2, firsts=None):
        """Random values; padding tokens (outside each row's counts: the last ones when left, else the
        first ones, or from firsts[b] on when given) NaN when pad_nan."""
        x = self._values(shape, dtype, magnitude)
        if pad_nan and counts is not None:
            for b, n in enumerate(counts):
                real = np.zeros(chunk, bool)
                start = int(firsts[b]) if firsts is not None else (chunk - n if left else 0)
                real[start : start + n] = True
                index = [b] + [slice(None)] * (x.ndim - 1)
                index[axis] = ~real
                x[tuple(index)] = np.nan
        return x

    def _commit(self, counts, chunk, left):
        m = self.model
        m.lengths = m.lengths + counts
        m.last_new, m.last_chunk, m.last_left = counts.copy(), chunk, bool(left)
        m.last_first = chunk - counts if left else np.zeros(self.batch, np.int64)

    # -- valid operations -----------------------------------------------------------------------------------
    def op_append(self, chunk, ragged, left, dtype, layouts, pad_nan, magnitude, seed):
        self.rng = np.random.default_rng(seed)
        is_ragged = ragged != "no"
        chunk = self._chunk(chunk, is_ragged)
        counts = self._counts(chunk) if is_ragged else np.full(self.batch, chunk, np.int64)
        in_dtype = self.storage if dtype == "same" else np_dtype(dtype)
        shape_k = (self.batch, self.hk, chunk, self.d)
        shape_v = (self.batch, self.hk, chunk, self.dv)
        k = self._padded(shape_k, counts if is_ragged else None, chunk, left, pad_nan, in_dtype, magnitude)
        v = self._padded(shape_v, counts if is_ragged else None, chunk, left, pad_nan, in_dtype, magnitude)
        key, value = _layout(k, layouts[0]), _layout(v, layouts[1])
        kwargs = {}
        if is_ragged:
            kwargs["num_new"] = counts.copy() if ragged == "array" else counts.tolist()
        if left or self.rng.random() < 0.2:
            kwargs["left_padded"] = left
        self.trace(f"append(key {shape_k} {in_dtype} {layouts[0]}, value {shape_v} {layouts[1]}, {kwargs})")
        snap = Snapshot(key, value, kwargs.get("num_new"))
        self.cache.append(key, value, **kwargs)
        snap.assert_unchanged()
        # The model: row b stores the chunk's first counts[b] tokens (last ones when left_padded),
        # converted to the storage dtype, at positions lengths[b]...
        m = self.model
        for b in range(self.batch):
            n, pos = int(counts[b]), int(m.lengths[b])
            start = chunk - n if kwargs.get("left_padded") else 0
            m.k[b, :, pos : pos + n] = k[b, :, start : start + n].astype(self.storage)
            m.v[b, :, pos : pos + n] = v[b, :, start : start + n].astype(self.storage)
        self._commit(counts, chunk, kwargs.get("left_padded", False))
        self.tag("append:ragged" if is_ragged else "append:full")
        self.tag(f"chunk:{'0' if chunk == 0 else '1' if chunk == 1 else '<=8' if chunk <= DECODE_MAX else '>8'}")
        if kwargs.get("left_padded"):
            self.tag("append:left_padded")

    def op_attend(self, group, dtype, layout, scale, threads, pad_nan, repeat, seed):
        self.rng = np.random.default_rng(seed)
        m = self.model
        heads = self.hk * group
        q_dtype = self.compute if dtype == "same" else np_dtype(dtype)
        shape = (self.batch, heads, m.last_chunk, self.d)
        real = np.array([m.real_rows(b).stop - m.real_rows(b).start for b in range(self.batch)])
        nan_pad = pad_nan and (real < m.last_chunk).any()
        q = self._padded(
            shape, real if nan_pad else None, m.last_chunk, m.last_left, nan_pad, q_dtype, firsts=m.last_first
        )
        query = _layout(q, layout)
        kwargs = {}
        if scale is not None:
            kwargs["scale"] = scale
        if threads is not None:
            kwargs["num_threads"] = threads
        self.trace(
            f"attend(query {shape} {q_dtype} {layout}, {kwargs}) lengths={m.lengths.tolist()} "
            f"last_new={m.last_new.tolist()} left={m.last_left}"
        )
        snap = Snapshot(query)
        out = self.cache.attend(query, **kwargs)
        snap.assert_unchanged()
        assert isinstance(out, np.ndarray) and out.dtype == self.compute, (type(out), getattr(out, "dtype", None))
        assert out.shape == (self.batch, heads, m.last_chunk, self.dv), out.shape
        q64 = _f64(q.astype(self.compute))  # what the cache computes with (the query converted)
        s = 1.0 / math.sqrt(self.d) if scale is None else float(scale)
        expected, q_rows, k_rows = self.model.expected_attention(q64, s)
        factor = _score_factor(q_rows, k_rows, s)
        for b, (rows, want) in expected.items():
            _compare(out[b, :, rows], want, self.compute, factor, f"attend row {b} rows {rows}")
        if not nan_pad:
            assert np.isfinite(_f64(out)).all(), "attend: non-finite output from finite inputs"
        if repeat:  # bitwise identical for any thread count (README: Determinism)
            other = 1 if threads != 1 else 3
            again = self.cache.attend(query, **dict(kwargs, num_threads=other))
            assert _bits(again) == _bits(out), f"attend with num_threads={other} differs from {threads}"
            self.tag("attend:repeat")
        self.tag(f"attend:group{group}")
        self.tag("attend:checked_rows" if expected else "attend:no_real_rows")
        if nan_pad:
            self.tag("attend:nan_padding")

    def _layer(self, group, dtype, hk=None, head_dim=None):
        """A MultiHeadAttention with the cache's (or the given) KV heads and head_dim, random non-zero
        biases; built once per shape and dtype."""
        hk = self.hk if hk is None else hk
        head_dim = self.d if head_dim is None else head_dim
        key = (group, np.dtype(dtype).name, hk, head_dim)
        if key not in self.layers:
            heads = hk * group
            layer = pyattn.MultiHeadAttention(
                heads * head_dim, heads, num_kv_heads=hk, dtype=dtype, seed=int(self.rng.integers(1 << 30))
            )
            state = layer.state_dict()
            for name in ("in_proj_bias", "out_proj.bias"):
                state[name] = (0.5 * self.rng.standard_normal(state[name].shape)).astype(dtype)
            layer.load_state_dict(state)
            self.layers[key] = (layer, Snapshot(state))
        return self.layers[key][0]

    def _group_for_layer(self, group):
        """A GQA group that keeps embed_dim <= MAX_EMBED, or None when no layer fits this cache
        (value_dim != head_dim, or one group already too wide)."""
        if self.dv != self.d or self.hk * self.d > MAX_EMBED:
            return None
        return max(1, min(group, MAX_EMBED // (self.hk * self.d)))

    def _weights_args(self, layer, form):
        """pyattn.mha keyword arguments holding the layer's weights in the given form, and the float64
        weights the reference uses (absent biases: zeros)."""
        state = layer.state_dict()
        e = layer.embed_dim
        kvw = layer.num_kv_heads * (e // layer.num_heads)
        w, b = state["in_proj_weight"], state["in_proj_bias"]
        args = dict(
            num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, out_proj_weight=state["out_proj.weight"]
        )
        if form.startswith("in_proj"):
            args["in_proj_weight"] = w
        else:  # row blocks of one array (views)
            args.update(q_proj_weight=w[:e], k_proj_weight=w[e : e + kvw], v_proj_weight=w[e + kvw :])
        if not form.endswith("no_bias"):
            if form.startswith("in_proj") or self.rng.random() < 0.5:
                args["in_proj_bias"] = b
            else:
                args.update(q_proj_bias=b[:e], k_proj_bias=b[e : e + kvw], v_proj_bias=b[e + kvw :])
            args["out_proj_bias"] = state["out_proj.bias"]
        bias = b if not form.endswith("no_bias") else np.zeros_like(b)
        out_bias = state["out_proj.bias"] if not form.endswith("no_bias") else np.zeros(e)
        w64 = dict(
            q=_f64(w[:e]),
            k=_f64(w[e : e + kvw]),
            v=_f64(w[e + kvw :]),
            o=_f64(state["out_proj.weight"]),
            bq=_f64(bias[:e]),
            bk=_f64(bias[e : e + kvw]),
            bv=_f64(bias[e + kvw :]),
            bo=_f64(out_bias),
        )
        return args, w64

    def op_mha(self, form, group, chunk, ragged, left, unbatched, weights, layout, threads, pad_nan, seed):
        self.rng = np.random.default_rng(seed)
        group = self._group_for_layer(group)
        if group is None:
            self.tag("mha:skipped_incompatible_cache")
            return
        layer = self._layer(group, self.compute)
        e, heads = layer.embed_dim, layer.num_heads
        is_ragged = ragged != "no"
        chunk = self._chunk(chunk, is_ragged, limit=64)
        counts = self._counts(chunk) if is_ragged else np.full(self.batch, chunk, np.int64)
        x = self._padded(
            (self.batch, chunk, e), counts if is_ragged else None, chunk, left, pad_nan, self.compute, axis=1
        )
        unbatched = unbatched and self.batch == 1
        query = _layout(x[0] if unbatched else x, layout)
        kwargs = {}
        if is_ragged:
            kwargs["num_new"] = counts.copy() if ragged == "array" else counts.tolist()
        if left or self.rng.random() < 0.2:
            kwargs["left_padded"] = left
        if threads is not None:
            kwargs["num_threads"] = threads
        if form == "layer":
            weights = "own"  # the layer's weights and biases
        args, w64 = self._weights_args(layer, "in_proj" if form == "layer" else weights)
        self.trace(
            f"mha[{form}, {weights}](x {query.shape} {layout}, heads={heads}, kv_heads={self.hk}, {kwargs}) "
            f"lengths={self.model.lengths.tolist()}"
        )
        snap = Snapshot(query, kwargs.get("num_new"), args)
        if form == "layer":
            out = layer(query, kv_cache=self.cache, **kwargs)
        else:
            out = pyattn.mha(query, kv_cache=self.cache, **args, **kwargs)
        snap.assert_unchanged()
        assert isinstance(out, np.ndarray) and out.dtype == self.compute
        assert out.shape == ((chunk, e) if unbatched else (self.batch, chunk, e)), out.shape
        out = out[None] if unbatched else out
        m = self.model
        before = m.lengths.copy()
        self._commit(counts, chunk, kwargs.get("left_padded", False))
        # The new K/V: the float64 projections of the real tokens, rounded to the storage; the model
        # takes the stored bits (the core's GEMM rounds differently from a float64 projection).
        x64 = _f64(x)
        hd = self.d
        kp = (x64 @ w64["k"].T + w64["bk"]).reshape(self.batch, chunk, self.hk, hd).transpose(0, 2, 1, 3)
        vp = (x64 @ w64["v"].T + w64["bv"]).reshape(self.batch, chunk, self.hk, hd).transpose(0, 2, 1, 3)
        name = self.storage.name
        rtol, atol = tol(f"stored {name}" if name in ("float16", "bfloat16") else self.storage)
        for b in range(self.batch):
            rows, pos, n = m.real_rows(b), int(before[b]), int(counts[b])
            for name, stored, model, proj in (("key", self.cache._k, m.k, kp), ("value", self.cache._v, m.v, vp)):
                new = stored[b, :, pos : pos + n]
                np.testing.assert_allclose(
                    _f64(new), proj[b, :, rows], rtol=rtol, atol=atol, err_msg=f"stored {name}s of row {b}"
                )
                model[b, :, pos : pos + n] = new
        q64 = (x64 @ w64["q"].T + w64["bq"]).reshape(self.batch, chunk, heads, hd).transpose(0, 2, 1, 3)
        expected, q_rows, k_rows = self.model.expected_attention(q64, 1.0 / math.sqrt(hd))
        factor = _score_factor(q_rows, k_rows, 1.0 / math.sqrt(hd))
        for b, (rows, context) in expected.items():
            context = context.transpose(1, 0, 2).reshape(-1, e)
            want = context @ w64["o"].T + w64["bo"]
            _compare(out[b, rows], want, self.compute, factor, f"mha row {b} rows {rows}")
        if not (pad_nan and is_ragged):
            assert np.isfinite(_f64(out)).all(), "mha: non-finite output from finite inputs"
        self.tag(f"mha:{form}:{weights}")
        self.tag(f"mha:group{group}")
        if unbatched:
            self.tag("mha:unbatched")
        if is_ragged:
            self.tag("mha:ragged_left" if kwargs.get("left_padded") else "mha:ragged")

    def op_decode(self, append, attend):
        self.op_append(**append)
        self.check_state()
        self.op_attend(**attend)

    def op_truncate(self, per_row, seed):
        self.rng = np.random.default_rng(seed)
        top = int(self.model.lengths.max()) + 2
        length = self.rng.integers(0, top + 1, self.batch) if per_row else int(self.rng.integers(0, top + 1))
        if per_row and self.rng.random() < 0.3:
            length = length.tolist()
        self.trace(f"truncate({length!r})")
        snap = Snapshot(length)
        self.cache.truncate(length)
        snap.assert_unchanged()
        m = self.model
        m.cut(np.minimum(m.lengths, np.asarray(length, np.int64)))
        self.tag("truncate")

    def op_trim(self, per_row, seed):
        self.rng = np.random.default_rng(seed)
        top = int(self.model.lengths.max()) + 2
        count = self.rng.integers(0, top + 1, self.batch) if per_row else int(self.rng.integers(0, min(top, 4) + 1))
        if per_row and self.rng.random() < 0.3:
            count = count.astype(np.int32)
        self.trace(f"trim({count!r})")
        snap = Snapshot(count)
        self.cache.trim(count)
        snap.assert_unchanged()
        m = self.model
        m.cut(np.maximum(m.lengths - np.asarray(count, np.int64), 0))
        self.tag("trim")

    def op_reset(self):
        self.trace("reset()")
        self.cache.reset()
        m = self.model
        m.lengths = np.zeros(self.batch, np.int64)
        m.last_new = np.zeros(self.batch, np.int64)
        m.last_first = np.zeros(self.batch, np.int64)
        m.last_chunk = 0
        # Like a fresh cache: the next attend takes an empty chunk (no append since).
        out = self.cache.attend(self._values((self.batch, self.hk, 0, self.d), self.compute))
        assert out.shape == (self.batch, self.hk, 0, self.dv) and out.dtype == self.compute, (out.shape, out.dtype)
        self.tag("reset")

    def op_set_lengths(self, seed):
        """The public lengths array edited in place (attend and append must follow it)."""
        self.rng = np.random.default_rng(seed)
        b = int(self.rng.integers(0, self.batch))
        n = int(self.rng.integers(0, self.max_len + 1))
        self.trace(f"lengths[{b}] = {n}")
        self.cache.lengths[b] = n
        self.model.lengths[b] = n
        self.tag("set_lengths")

    def op_views(self):
        self.trace("keys()/values() views")
        m = self.model
        for b in range(self.batch):
            for name, view, storage in (("keys", self.cache.keys(b), m.k), ("values", self.cache.values(b), m.v)):
                assert isinstance(view, np.ndarray) and view.dtype == self.storage, (name, view.dtype)
                assert not view.flags.owndata, f"{name}({b}) is a copy, not a view"
                assert _bits(view) == _bits(storage[b, :, : int(m.lengths[b])]), f"{name}({b}) differs from the model"
        if (m.lengths == m.lengths[0]).all():
            n = int(m.lengths[0])
            assert _bits(self.cache.keys()) == _bits(m.k[:, :, :n])
            assert _bits(self.cache.values()) == _bits(m.v[:, :, :n])
            self.tag("views:all_rows")
        else:  # rows of different lengths: keys() needs a row
            for method in (self.cache.keys, self.cache.values):
                try:
                    method()
                except ValueError as exc:
                    assert "row" in str(exc), exc
                else:
                    raise AssertionError("keys()/values() without a row succeeded for rows of different lengths")
            self.tag("views:ragged_refused")

    # -- running ---------------------------------------------------------------------------------------------
    def run(self):
        for op in self.program.ops:
            getattr(self, "op_" + op.kind)(**op.args)
            self.check_state()
        if self.program.ops and self.rng.random() < 0.5:
            self.op_views()
        for _, state in self.layers.values():
            state.assert_unchanged()  # the layers' own weights (state_dict copies) were never written


def check(program: Program):
    """Runs the program against pyattn and its model; asserts the oracle (see the module docstring)."""
    c = program.config
    tags = [
        f"dtype:{c['dtype']}",
        f"isa:{program.isa}",
        f"batch:{c['batch']}",
        f"kv_heads:{c['num_kv_heads']}",
        f"max_len:{'<=40' if c['max_len'] <= 40 else '<=300' if c['max_len'] <= 300 else '>300'}",
        "dims:" + ("equal" if c["head_dim"] == c["value_dim"] else "differ"),
    ]
    previous = pyattn.get_isa()
    pyattn._core._set_isa(program.isa)
    runner = None
    try:
        runner = Runner(program)
        runner.run()
        tags.append("outcome:program_ok")
    except KnownIssue as known:
        tags.append(f"known:{known}")
    finally:
        pyattn._core._set_isa(previous)
        for tag in tags + (runner.tags if runner else []):
            event(tag)
            COVERAGE[tag] += 1
        COVERAGE["programs:run"] += 1
        COVERAGE["programs:ops"] += len(program.ops)


def coverage_report(counter=None):
    return fuzz_api.coverage_report(COVERAGE if counter is None else counter)


# --- long runs --------------------------------------------------------------------------------------------


def main(argv=None):
    runs, elapsed = fuzz_api.long_run(
        __doc__, 300, programs(), check, argv, what=f"storage {STORAGE}, fuzzing the KV cache"
    )
    total, ops = COVERAGE["programs:run"], COVERAGE["programs:ops"]
    print(
        f"{total} programs ({ops} operations) in {runs} runs, {elapsed:.0f} s "
        f"({total / elapsed:.1f} programs/s), no failure. Coverage:"
    )
    print(coverage_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
