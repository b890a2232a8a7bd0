# SPDX-License-Identifier: MIT
"""Shared fixtures and helpers: seeded rng, per-ISA fixture, the one tolerance table, input builders."""

import contextlib
import os

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn._tuning import PROFILES, override

# (rtol, atol) of pyattn's results against the float64 reference, by result dtype: the only
# tolerance table of the suite (tests and fuzzers alike; helpers widen it only by a computed factor
# for scores larger than unit-variance inputs give, see fuzz_api._score_factor). float32/float64:
# measured on all three ISAs, the worst |got - ref| / (atol + rtol*|ref|) in the suite is ~0.07 for
# float32 (~0.14 against torch's own float32) and ~0.007 for float64. 16-bit results are computed in
# float32 and rounded once to their dtype: rtol about twice the rounding (2^-11 float16, 2^-8
# bfloat16), atol float32's (near zero the float32 error of the computation dominates). "stored *":
# K/V rounded to 16-bit storage after a float32 projection (the GEMM's error near zero). "fast *":
# bfloat16 under precision="fast" on the avx512bf16 kernels: P rounded to bfloat16 (2^-9 relative per
# weight); the worst ratio measured over 150 random shapes through the emulation was ~0.45. "fast
# bfloat16 layer": a bfloat16 layer whose projections are bfloat16 dot products (exact products,
# float32 sums) and whose attention output is rounded to bfloat16 before the output projection:
# that rounding's error is summed over embed_dim, not relative to the output (worst ratio ~0.63 over
# 180 random layer shapes).
TOL = {
    np.float32: (2e-5, 2e-5),
    np.float64: (1e-12, 1e-12),
    "float16": (1e-3, 2e-5),
    "bfloat16": (8e-3, 2e-5),
    "stored float16": (1e-3, 1e-4),
    "stored bfloat16": (8e-3, 1e-4),
    "fast bfloat16": (1.6e-2, 6e-3),
    "fast bfloat16 layer": (2e-2, 1.5e-2),
}


def tol(dtype, precision="fast"):
    """(rtol, atol) for results of `dtype` (a NumPy dtype, scalar type or name) from TOL.

    bfloat16 results under precision="fast" (the default) on an ISA that computes them with bfloat16
    dot products (pyattn.runtime_info()["precision_fast"]) get the "fast" bounds; elsewhere "fast"
    computes as "highest" and keeps the tight ones. "bfloat16 layer": a bfloat16 MultiHeadAttention
    or mha's results (the "fast bfloat16 layer" bounds on such an ISA, else bfloat16's).
    """
    if isinstance(dtype, str) and dtype == "bfloat16 layer":
        return TOL["fast bfloat16 layer" if pyattn._core.bf16_dots() else "bfloat16"]
    if isinstance(dtype, str) and dtype in TOL:
        name = dtype
    else:
        dtype = np.dtype(dtype)
        if dtype.type in TOL:
            return TOL[dtype.type]
        name = dtype.name
    if name == "bfloat16" and precision == "fast" and pyattn._core.bf16_dots():
        return TOL[f"fast {name}"]
    return TOL[name]


def np_dtype(name):
    """The NumPy dtype for a dtype name ("bfloat16": ml_dtypes'); the test skips without ml_dtypes."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the environment
            pytest.skip("bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def f64(x):
    """x's values in float64 (from any float dtype, bfloat16 included)."""
    return np.asarray(x).astype(np.float64)


DTYPES = [np.float32, np.float64]


@pytest.fixture(params=sorted(PROFILES))
def cpu_profile(request):
    """Makes the core's planner see each CPU it has rules for (Intel, AMD Zen 3, Zen 4, Zen 5), an
    unknown vendor and unknown cache sizes in turn, whatever CPU runs the tests
    (pyattn._tuning.PROFILES), and restores the probed CPU afterwards."""
    with override(**PROFILES[request.param]):
        yield request.param


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


def _fixture_isas():
    # `PYATTN_ISA=name pytest` runs the ISA-parametrised tests on that ISA's kernels only (the import
    # chose it already; tools/build_wheels.sh runs the suite once per ISA this way instead of three
    # times over every ISA); without it, every compiled ISA the CPU supports.
    forced = os.environ.get("PYATTN_ISA")
    return [forced] if forced in pyattn.available_isas() else pyattn.available_isas()


@contextlib.contextmanager
def forced_isa(name):
    """Runs the body on ISA `name`'s kernels, restoring the previous choice afterwards."""
    previous = pyattn.get_isa()
    pyattn._core._set_isa(name)
    try:
        yield name
    finally:
        pyattn._core._set_isa(previous)


@pytest.fixture(params=_fixture_isas())
def isa(request):
    """Forces each compiled and supported ISA in turn (or only PYATTN_ISA's, when it is set),
    restoring the previous choice afterwards."""
    with forced_isa(request.param):
        yield request.param


@pytest.fixture(params=DTYPES, ids=lambda d: np.dtype(d).name)
def dtype(request):
    return request.param


def nan_guarded(array, pad=2):
    """A view holding `array`'s values, cut from a NaN-filled parent.

    Every axis gets `pad` NaN elements on both sides, so the view starts at an offset, its rows are
    not adjacent, and reading outside it (or ignoring a stride) shows up as NaN. The last axis stays
    contiguous. Bool parents are filled with True ("attend"), the closest thing to NaN.
    """
    array = np.asarray(array)
    parent_shape = tuple(n + 2 * pad for n in array.shape)
    parent = np.full(parent_shape, True if array.dtype == np.bool_ else np.nan, dtype=array.dtype)
    view = parent[tuple(slice(pad, pad + n) for n in array.shape)]
    view[...] = array
    return view


def random_array(rng, shape, dtype, guard=True):
    """Standard-normal values of `dtype`; a NaN-guarded view unless guard=False."""
    dtype = np.dtype(dtype)
    # float32 drawn as float32 (Generator.standard_normal's dtype=): drawing float64 and rounding took
    # ~4x as long, 0.42 s for a 10 x 8 x 1031 x 128 cache, most of the suite's 16-bit decode tests.
    if dtype == np.float32:
        values = rng.standard_normal(shape, dtype=np.float32)
    else:
        values = rng.standard_normal(shape).astype(dtype)
    return nan_guarded(values) if guard else values


def make_qkv(
    rng,
    dtype,
    batch=(),
    q_heads=None,
    kv_heads=None,
    q_len=5,
    kv_len=7,
    head_dim=8,
    value_dim=None,
    layout="bhsd",
    guard=True,
):
    """Random query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev).

    q_heads=None leaves out the head axis (inputs are batch + (L, E)). layout="bshd" builds
    (..., L, H, E) arrays and returns them transposed to (..., H, L, E) views.
    """
    value_dim = head_dim if value_dim is None else value_dim
    kv_heads = q_heads if kv_heads is None else kv_heads

    def build(heads, length, dim):
        batch_shape = tuple(batch)
        if heads is None:
            return random_array(rng, batch_shape + (length, dim), dtype, guard)
        if layout == "bshd":
            return np.swapaxes(random_array(rng, batch_shape + (length, heads, dim), dtype, guard), -2, -3)
        return random_array(rng, batch_shape + (heads, length, dim), dtype, guard)

    return build(q_heads, q_len, head_dim), build(kv_heads, kv_len, head_dim), build(kv_heads, kv_len, value_dim)


def random_mask(rng, shape, kind, dtype, p_allowed=0.7):
    """A bool mask (True = attend) or a float mask of `dtype` (random offsets, -inf where forbidden)."""
    allowed = rng.random(shape) < p_allowed
    if kind == "bool":
        return allowed
    return np.where(allowed, rng.standard_normal(shape), -np.inf).astype(dtype)


def assert_close(actual, expected, dtype):
    """pyattn output vs float64 reference, with the table's tolerance; NaN must match NaN."""
    assert actual.dtype == np.dtype(dtype)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def check_against_reference(q, k, v, attn_mask=None, **kwargs):
    """Runs pyattn and the reference with the same arguments, compares, returns pyattn's result."""
    got = pyattn.scaled_dot_product_attention(q, k, v, attn_mask, **kwargs)
    kwargs.pop("num_threads", None)
    expected = reference.scaled_dot_product_attention(q, k, v, attn_mask, **kwargs)
    if kwargs.get("return_weights"):
        assert_close(got[0], expected[0], q.dtype.type)
        assert_close(got[1], expected[1], q.dtype.type)
    else:
        assert_close(got, expected, q.dtype.type)
    return got
