# SPDX-License-Identifier: MIT
"""Cross-check against torch.nn.functional.scaled_dot_product_attention (skipped without torch).

Every row keeps at least one allowed key: older torch releases return NaN for a fully masked row,
pyattn zeros (tests/test_torch_op.py checks that torch 2.5 and later agree).
"""

import numpy as np
import pytest

import pyattn

from conftest import assert_close, make_qkv, random_mask, tol

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


def test_tensors_are_read_like_arrays(rng):
    """Tensors go wherever arrays go, as their values: detached (pyattn is inference only; numpy()
    refuses a tensor that requires grad, which reached the user as an unnamed RuntimeError),
    bfloat16 through ml_dtypes (numpy() has none), and a dtype NumPy lacks is a TypeError naming the
    argument."""
    q, k, v = make_qkv(rng, np.float32, batch=(2,), q_heads=4, q_len=5, kv_len=7, head_dim=8)
    expected = pyattn.scaled_dot_product_attention(q, k, v)
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))
    got = pyattn.scaled_dot_product_attention(
        tq.requires_grad_(), tk, torch.nn.Parameter(tv), attn_mask=torch.ones(5, 7, dtype=torch.bool)
    )
    np.testing.assert_array_equal(got, expected)
    assert isinstance(got, np.ndarray) and not tq.grad_fn and tq.grad is None

    ml_dtypes = pytest.importorskip("ml_dtypes")
    half = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    got = pyattn.scaled_dot_product_attention(*(torch.from_numpy(x.astype(np.float32)).bfloat16() for x in half))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), pyattn.scaled_dot_product_attention(*half).view(np.uint16))

    cache = pyattn.KVCache(2, 4, 8, 16, dtype=ml_dtypes.bfloat16)
    cache.append(
        torch.from_numpy(k).bfloat16().requires_grad_(), torch.from_numpy(v).bfloat16(), num_new=torch.tensor([7, 6])
    )
    assert cache.lengths.tolist() == [7, 6]
    np.testing.assert_array_equal(cache.keys(0).view(np.uint16), k[0].astype(ml_dtypes.bfloat16).view(np.uint16))
    query = k * 0.5  # a chunk as long as the last append (7 tokens)
    np.testing.assert_array_equal(cache.attend(torch.from_numpy(query).requires_grad_()), cache.attend(query))

    with pytest.raises(TypeError, match="^key: a torch tensor of dtype torch.float8_e4m3fn has no NumPy"):
        pyattn.scaled_dot_product_attention(tq, tk.to(torch.float8_e4m3fn), tv)
    with pytest.raises(TypeError, match="^value: a torch tensor of dtype torch.float8_e5m2 has no NumPy"):
        cache.append(torch.from_numpy(k[:, :, :1]), torch.from_numpy(v[:, :, :1]).to(torch.float8_e5m2))
    assert cache.lengths.tolist() == [7, 6]


def test_mha_and_explain_take_tensors_that_require_grad(rng):
    layer = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    ours = pyattn.MultiHeadAttention.from_torch(layer)
    expected = ours(x.detach().numpy())
    weights = {name: p for name, p in layer.named_parameters()}  # these require grad
    np.testing.assert_array_equal(
        pyattn.mha(
            x,
            num_heads=4,
            in_proj_weight=weights["in_proj_weight"],
            in_proj_bias=weights["in_proj_bias"],
            out_proj_weight=weights["out_proj.weight"],
            out_proj_bias=weights["out_proj.bias"],
        ),
        expected,
    )
    explained = pyattn.explain(x[0], {**weights, "num_heads": 4})
    rtol, atol = tol(np.float32)
    np.testing.assert_allclose(explained.output, expected[0], rtol=rtol, atol=atol)
    # a bfloat16 input with float32 weights: one dtype for the layer, never a silent promotion
    with pytest.raises(TypeError, match="^in_proj_weight: dtype must be bfloat16 .*got float32"):
        pyattn.mha(
            x.bfloat16(),
            num_heads=4,
            in_proj_weight=weights["in_proj_weight"],
            out_proj_weight=weights["out_proj.weight"],
        )


def test_from_torch_keeps_the_modules_layout(rng):
    """torch.nn.MultiheadAttention is (len, batch, E) unless batch_first=True; a converted layer
    takes the module's layout (it used to be batch-first always: a default module's (len, batch, E)
    inputs then mixed the batch rows instead of the tokens, without an error)."""
    torch.manual_seed(0)
    for batch_first in (False, True):
        module = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
        layer = pyattn.MultiHeadAttention.from_torch(module)
        assert layer.batch_first is batch_first
        x = torch.randn((2, 5, 16) if batch_first else (5, 2, 16))
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[1, 3:] = True
        with torch.no_grad():
            expected, expected_weights = module(x, x, x, key_padding_mask=padding)
        out, weights = layer(x.numpy(), key_padding_mask=padding.numpy(), need_weights=True)
        assert_close(out, expected.numpy().astype(np.float64), np.float32)
        assert_close(weights, expected_weights.numpy().astype(np.float64), np.float32)
