# SPDX-License-Identifier: MIT
"""Cross-check against torch.nn.functional.scaled_dot_product_attention (skipped without torch).

Every row keeps at least one allowed key: torch returns NaN for fully masked rows, pyattn zeros.
"""

import numpy as np
import pytest
from conftest import assert_close, make_qkv, random_mask

import pyattn

torch = pytest.importorskip("torch")


def torch_sdpa(q, k, v, attn_mask=None, **kwargs):
    def to_torch(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a))

    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            to_torch(q), to_torch(k), to_torch(v), attn_mask=to_torch(attn_mask), **kwargs
        )
    return out.numpy().astype(np.float64)


def mask_with_a_key_per_row(rng, shape, kind, dtype):
    mask = random_mask(rng, shape, kind, dtype, p_allowed=0.6)
    mask[..., 0] = True if kind == "bool" else 0.0
    return mask


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "gqa": dict(enable_gqa=True),
    "gqa_causal": dict(enable_gqa=True, is_causal=True),
    "scale": dict(scale=0.3),
    "negative_scale_mask": dict(scale=-0.7, mask="float"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("q_len, kv_len", [(17, 17), (5, 75), (75, 19)])
def test_matches_torch(isa, dtype, rng, case, q_len, kv_len):
    options = dict(CASES[case])
    mask_kind = options.pop("mask", None)
    kv_heads = 2 if options.get("enable_gqa") else 4
    q, k, v = make_qkv(
        rng, dtype, batch=(2,), q_heads=4, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=32, value_dim=24
    )
    mask = None if mask_kind is None else mask_with_a_key_per_row(rng, (2, 1, q_len, kv_len), mask_kind, dtype)
    got = pyattn.scaled_dot_product_attention(q, k, v, mask, **options)
    assert_close(got, torch_sdpa(q, k, v, mask, **options), dtype)


def test_matches_torch_broadcast_mask_and_batch(dtype, rng):
    q, k, v = make_qkv(rng, dtype, batch=(3, 2), q_heads=2, q_len=9, kv_len=13, head_dim=16)
    mask = mask_with_a_key_per_row(rng, (13,), "bool", dtype)
    got = pyattn.scaled_dot_product_attention(q, k, v, mask)
    assert_close(got, torch_sdpa(q, k, v, mask), dtype)
