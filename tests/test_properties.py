# SPDX-License-Identifier: MIT
"""Hypothesis invariants of attention, each also held against the float64 reference where it applies."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyattn

from conftest import DTYPES, assert_close, check_against_reference, make_qkv, tol

sdpa = pyattn.scaled_dot_product_attention

# The `isa` fixture only switches a global; it needs no reset between examples.
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw, max_len=40):
    """(q, k, v, float mask with at least one allowed key per row, dtype) of a random small size."""
    dtype = draw(st.sampled_from(DTYPES))
    q_len = draw(st.integers(1, max_len))
    kv_len = draw(st.integers(1, max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = make_qkv(
        rng,
        dtype,
        batch=(draw(st.integers(1, 2)),),
        q_heads=draw(st.integers(1, 3)),
        q_len=q_len,
        kv_len=kv_len,
        head_dim=draw(st.integers(1, 40)),
        value_dim=draw(st.integers(1, 20)),
    )
    allowed = rng.random((q_len, kv_len)) < draw(st.floats(0.05, 1.0))
    allowed[np.arange(q_len), rng.integers(0, kv_len, q_len)] = True
    mask = np.where(allowed, rng.uniform(-2, 2, allowed.shape), -np.inf).astype(dtype)
    return q, k, v, mask, dtype


@PROPERTY
@given(problem=problems())
def test_weights_rows_sum_to_one(isa, problem):
    q, k, v, mask, dtype = problem
    _, weights = check_against_reference(q, k, v, mask, return_weights=True)
    assert np.all(weights >= 0)
    sums = weights.astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(sums, 1.0, rtol=0, atol=weights.shape[-1] * tol(dtype)[1])


@PROPERTY
@given(problem=problems(), row=st.integers(0, 10**6), shift=st.floats(-30, 30))
def test_constant_added_to_one_row_changes_nothing(isa, problem, row, shift):
    q, k, v, mask, dtype = problem
    shifted = mask.copy()
    shifted[row % mask.shape[0]] += dtype(shift)  # -inf stays -inf
    base = check_against_reference(q, k, v, mask)
    assert_close(sdpa(q, k, v, shifted), base.astype(np.float64), dtype)


@PROPERTY
@given(problem=problems(), perm_seed=st.integers(0, 2**32 - 1))
def test_permuting_keys_with_values_changes_nothing(isa, problem, perm_seed):
    q, k, v, mask, dtype = problem
    perm = np.random.default_rng(perm_seed).permutation(k.shape[-2])
    base = check_against_reference(q, k, v, mask)
    permuted = check_against_reference(q, k[..., perm, :], v[..., perm, :], mask[:, perm])
    assert_close(permuted, base.astype(np.float64), dtype)


@PROPERTY
@given(problem=problems(), key_seed=st.integers(0, 2**32 - 1))
def test_single_allowed_key_returns_its_value_row(isa, problem, key_seed):
    q, k, v, _, dtype = problem
    q_len, kv_len = q.shape[-2], k.shape[-2]
    chosen = np.random.default_rng(key_seed).integers(0, kv_len, q_len)
    allowed = np.zeros((q_len, kv_len), dtype=bool)
    allowed[np.arange(q_len), chosen] = True
    out = check_against_reference(q, k, v, allowed)
    assert_close(out, np.broadcast_to(v[..., chosen, :], out.shape).astype(np.float64), dtype)


@PROPERTY
@given(problem=problems(), magnitude=st.sampled_from([1e2, 1e4]), causal=st.booleans())
def test_large_inputs_stay_finite(isa, problem, magnitude, causal):
    q, k, v, mask, dtype = problem
    # Scores up to ~1e8 * sqrt(E): softmax is nearly one-hot, so float32 and the float64 reference
    # may pick different near-ties; only the convex-combination bound is checked.
    q, k, v = (a * dtype(magnitude) for a in (q, k, v))
    out = sdpa(q, k, v, mask, is_causal=causal)
    assert np.isfinite(out).all()
    bound = np.abs(v).max() * (1 + 10 * tol(dtype)[0])
    assert np.all(np.abs(out) <= bound)
