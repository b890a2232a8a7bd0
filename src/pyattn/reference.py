# SPDX-License-Identifier: MIT
"""Naive float64 NumPy reference for :func:`pyattn.scaled_dot_product_attention`.

Obvious code that materialises the full (..., Hq, L, S) score matrix; tests hold the fast path
against it. It shares no code with ``pyattn._api``.

Masked-row policy (the same as the fast path): a key is *forbidden* for a query when the boolean
mask is False, the float mask is -inf, or the causal rule excludes it. Forbidden keys are removed
with ``np.where`` selections, never multiplied by a zero weight, so NaN/Inf in their K or V rows
cannot leak. A query row with no allowed key gets zero output and zero weights. NaN/Inf at allowed
positions propagate as the math says.
"""

import math

import numpy as np

__all__ = ["scaled_dot_product_attention"]


def _allowed_keys(mask, is_causal, q_len, kv_len):
    """Boolean array broadcastable to (..., L, S): True where a query may attend a key."""
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if is_causal is not False:
        if is_causal is True or is_causal == "upper_left":
            offset = 0
        elif is_causal == "lower_right":
            offset = kv_len - q_len
        else:
            raise ValueError(f"is_causal must be False, True, 'upper_left' or 'lower_right', got {is_causal!r}")
        i = np.arange(q_len)[:, None]
        j = np.arange(kv_len)[None, :]
        allowed = j <= i + offset
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        elif mask.dtype.kind == "f":
            allowed = allowed & (mask != -np.inf)
        else:
            raise TypeError(f"attn_mask must be bool or floating, got {mask.dtype}")
    return allowed


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    *,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_weights=False,
):
    """softmax(query @ key^T * scale + mask) @ value, computed in float64.

    Same arguments and shapes as :func:`pyattn.scaled_dot_product_attention` (without ``out`` and
    ``num_threads``). Returns ``out`` or ``(out, weights)``, both float64.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ValueError("query, key and value need at least 2 dimensions (L, E)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head_dim differ: {q.shape[-1]} != {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value kv_len differ: {k.shape[-2]} != {v.shape[-2]}")
    if q.ndim >= 3 and k.ndim >= 3:
        num_q_heads, num_kv_heads = q.shape[-3], k.shape[-3]
        if enable_gqa and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0:
            # Query head h reads kv head h // group.
            k = np.repeat(k, num_q_heads // num_kv_heads, axis=-3)
            v = np.repeat(v, num_q_heads // num_kv_heads, axis=-3)
        elif num_q_heads != num_kv_heads:
            raise ValueError(f"query heads {num_q_heads} and key heads {num_kv_heads} are incompatible")

    q_len, head_dim = q.shape[-2:]
    kv_len = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

    allowed = _allowed_keys(attn_mask, is_causal, q_len, kv_len)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scores = (q @ np.swapaxes(k, -1, -2)) * scale
        if attn_mask is not None and np.asarray(attn_mask).dtype.kind == "f":
            # -inf entries are forbidden (and excluded below); other values are added.
            scores = scores + np.where(allowed, np.asarray(attn_mask, dtype=np.float64), 0.0)
        allowed = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, scores.shape))
        scores = np.where(allowed, scores, -np.inf)

        row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
        any_allowed = allowed.any(axis=-1, keepdims=True)
        row_max = np.where(any_allowed, row_max, 0.0)  # fully masked rows: avoid -inf - -inf
        exps = np.where(allowed, np.exp(scores - row_max), 0.0)
        row_sum = exps.sum(axis=-1, keepdims=True)
        weights = exps / np.where(any_allowed, row_sum, 1.0)

        if np.isfinite(v).all():
            # Forbidden weights are exactly 0 and V is finite, so they contribute exact zeros.
            out = weights @ v
        else:
            # 0 * inf would be NaN: select allowed (query, key) pairs explicitly.
            terms = weights[..., :, :, None] * v[..., None, :, :]
            out = np.where(allowed[..., :, :, None], terms, 0.0).sum(axis=-2)
    if return_weights:
        return out, weights
    return out
