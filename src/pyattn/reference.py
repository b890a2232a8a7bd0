# SPDX-License-Identifier: MIT
"""Naive float64 NumPy references for :func:`pyattn.scaled_dot_product_attention` and :func:`pyattn.mha`.

Obvious code that materialises the full (..., Hq, L, S) score matrix; tests hold the fast path
against it. It shares no code with ``pyattn._api`` or ``pyattn._mha`` and imports no compiled
module; :func:`mha` is projections, head split and merge around this module's own
:func:`scaled_dot_product_attention`. The attention variants (sliding ``window``, ``softcap``,
per-head ``sinks``, ``alibi_slopes``) and FlashAttention's packed layout (:func:`varlen_attention`)
are spelled out here as the contract the fast path is held to.

Masked-row policy (the same as the fast path): a key is *forbidden* for a query when the boolean
mask is False, the float mask is -inf, or the causal rule or the window excludes it. Forbidden keys
are removed with ``np.where`` selections, never multiplied by a zero weight, so NaN/Inf in their K
or V rows cannot leak. A query row with no allowed key gets zero output and zero weights (also with
sinks). NaN/Inf at allowed positions propagate as the math says.
"""

import math

import numpy as np

__all__ = ["merge_attention_states", "mha", "scaled_dot_product_attention", "varlen_attention"]


def _is_float_mask(mask):
    """A floating mask: NumPy's float kinds, or ml_dtypes' bfloat16 (whose kind NumPy reports as 'V')."""
    dtype = np.asarray(mask).dtype
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _diagonal(is_causal, q_len, kv_len):
    """(causal, offset): whether the causal rule applies, and query i's diagonal key d(i) = i + offset
    that the causal rule, the window and ALiBi all measure from (S - L for "lower_right", else 0)."""
    if isinstance(is_causal, np.bool_):
        is_causal = bool(is_causal)
    if is_causal is False or is_causal is True or is_causal == "upper_left":
        return is_causal is not False, 0
    if is_causal == "lower_right":
        return True, kv_len - q_len
    raise ValueError(f"is_causal must be False, True, 'upper_left' or 'lower_right', got {is_causal!r}")


def _check_window(window):
    """`window` as a (left, right) tuple of non-negative ints or None (None: unbounded on that side)."""
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window: expected a (left, right) pair, got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer))):
            raise TypeError(f"window: each side must be an int or None, got {window!r}")
        if side is not None and side < 0:
            raise ValueError(f"window: each side must be >= 0, got {window!r}")
    return tuple(None if side is None else int(side) for side in window)


def _check_softcap(softcap):
    """`softcap` as a finite float > 0."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap: expected a positive number, got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap: must be finite and > 0, got {softcap!r}")
    return float(softcap)


def _per_head(values, name, num_heads, head_axis, batched, finite):
    """`values` of shape (num_heads,), or (..., num_heads) when `batched`, in float64 and shaped to
    broadcast against the (..., Hq, L, S) scores; without `head_axis` (a 2-D query, one head and no
    head axis) the scores are (..., L, S) and num_heads is 1. NaN is refused, and so is +/-inf
    when `finite`."""
    a = np.asarray(values, dtype=np.float64)
    if a.ndim < 1 or a.shape[-1] != num_heads or (a.ndim > 1 and not batched):
        expected = f"(..., {num_heads})" if batched else f"({num_heads},)"
        raise ValueError(f"{name}: expected shape {expected}, got {a.shape}")
    if np.isnan(a).any() or (finite and not np.isfinite(a).all()):
        raise ValueError(f"{name}: must not contain NaN{' or inf' if finite else ''}")
    if not head_axis:
        a = a[..., 0]
    return a[..., None, None]


def _allowed_keys(mask, is_causal, window, q_len, kv_len):
    """Boolean array broadcastable to (..., L, S): True where a query may attend a key."""
    causal, offset = _diagonal(is_causal, q_len, kv_len)
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if causal:
        allowed = j <= i + offset
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= i + offset - left)
        if right is not None:
            allowed = allowed & (j <= i + offset + right)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = allowed & mask
        elif _is_float_mask(mask):
            allowed = allowed & (mask.astype(np.float64) != -np.inf)
        else:
            raise TypeError(f"attn_mask must be bool or floating, got {mask.dtype}")
    return allowed


def _sink_term(sink, row_max):
    """e^(sink - row_max), the sink's share of a softmax denominator whose max is already `row_max`
    (>= sink). A -inf sink adds exactly 0, as no sink would; sink == row_max gives 1 without
    forming inf - inf for an infinite sink."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(sink == -np.inf, 0.0, np.where(sink == row_max, 1.0, np.exp(sink - row_max)))


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
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    return_lse=False,
):
    """softmax(query @ key^T * scale + mask) @ value, computed in float64.

    Same arguments and shapes as :func:`pyattn.scaled_dot_product_attention` (without ``out`` and
    ``num_threads``). Returns ``out`` or ``(out, weights)``, both float64.

    The variants, each off when None. Query i's diagonal key is d(i) = i + (S - L) when
    ``is_causal == "lower_right"``, else d(i) = i.

    - ``window=(left, right)``: query i may attend key j only when d(i) - left <= j <= d(i) + right
      (a None side is unbounded); it forbids keys like a mask, together with ``is_causal`` and
      ``attn_mask``.
    - ``softcap=c`` (> 0): each scaled score s becomes c * tanh(s / c).
    - ``alibi_slopes`` (Hq,) or (..., Hq): ``-slope_h * |d(i) - j|`` is added to the scores; leading
      dimensions broadcast against the output's batch dimensions.
    - ``sinks`` (Hq,): one extra logit per query head in every softmax denominator, with no value
      row: out_i = sum_j e^(s_ij) v_j / (e^sink_h + sum_j e^(s_ij)), so the weights sum to less than
      1. A -inf sink is no sink.

    Order: scores = q @ k^T * scale, softcap, + ALiBi bias, + float mask, softmax (with sinks). A
    2-D query is one head: sinks and alibi_slopes then have Hq = 1. Fully masked rows stay zero.
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
    head_axis = q.ndim >= 3
    num_heads = q.shape[-3] if head_axis else 1
    window = None if window is None else _check_window(window)
    softcap = None if softcap is None else _check_softcap(softcap)
    if sinks is not None:
        # A -inf sink is no sink and a +inf sink takes the whole softmax: both are meaningful.
        sinks = _per_head(sinks, "sinks", num_heads, head_axis, batched=False, finite=False)
    if alibi_slopes is not None:
        # An infinite slope would make the diagonal's bias inf * 0.
        alibi_slopes = _per_head(alibi_slopes, "alibi_slopes", num_heads, head_axis, batched=True, finite=True)

    allowed = _allowed_keys(attn_mask, is_causal, window, q_len, kv_len)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scores = (q @ np.swapaxes(k, -1, -2)) * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        if alibi_slopes is not None:
            _, offset = _diagonal(is_causal, q_len, kv_len)
            distance = np.abs(np.arange(q_len)[:, None] + offset - np.arange(kv_len)[None, :])
            scores = scores + (-alibi_slopes * distance)
        if attn_mask is not None and _is_float_mask(attn_mask):
            # -inf entries are forbidden (and excluded below); other values are added.
            scores = scores + np.where(allowed, np.asarray(attn_mask, dtype=np.float64), 0.0)
        allowed = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, scores.shape))
        scores = np.where(allowed, scores, -np.inf)

        row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
        any_allowed = allowed.any(axis=-1, keepdims=True)
        row_max = np.where(any_allowed, row_max, 0.0)  # fully masked rows: avoid -inf - -inf
        if sinks is not None:
            # The sink joins the max, so neither it nor a score can overflow exp.
            row_max = np.maximum(row_max, sinks)
        exps = np.where(allowed, np.exp(scores - row_max), 0.0)
        row_sum = exps.sum(axis=-1, keepdims=True)
        if sinks is not None:
            row_sum = row_sum + _sink_term(sinks, row_max)
        weights = exps / np.where(any_allowed, row_sum, 1.0)

        if np.isfinite(v).all():
            # Forbidden weights are exactly 0 and V is finite, so they contribute exact zeros.
            out = weights @ v
        else:
            # 0 * inf would be NaN: select allowed (query, key) pairs explicitly.
            terms = weights[..., :, :, None] * v[..., None, :, :]
            out = np.where(allowed[..., :, :, None], terms, 0.0).sum(axis=-2)
    results = (out,)
    if return_weights:
        # Weights take the output's batch shape (value or the mask may add batch dimensions).
        results += (np.broadcast_to(weights, out.shape[:-2] + weights.shape[-2:]).copy(),)
    if return_lse:
        # ln(row_sum) + row_max: the log of the whole denominator (the sink's term included); -inf
        # for a row with neither an allowed key nor a finite sink.
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = np.log(row_sum[..., 0]) + row_max[..., 0]
        lse = np.where(row_sum[..., 0] == 0, -np.inf, lse)
        results += (np.broadcast_to(lse, out.shape[:-1]).copy(),)
    return results[0] if len(results) == 1 else results


def _check_cu_seqlens(cu_seqlens, name, total):
    """`cu_seqlens` as an int64 array: 1-D integers starting at 0, non-decreasing, ending at `total`."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size == 0 or cu.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a non-empty 1-D integer array, got {cu.dtype} shape {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
        raise ValueError(f"{name}: must start at 0, not decrease and end at the total length {total}, got {cu}")
    return cu


def varlen_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal=False,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
):
    """Attention over sequences packed along the token axis (FlashAttention's varlen layout), in float64.

    ``query`` (total_q, Hq, E), ``key`` (total_k, Hk, E) and ``value`` (total_k, Hk, Ev) hold the
    tokens of all sequences back to back; ``cu_seqlens_q`` and ``cu_seqlens_k`` (batch + 1,) are the
    integer prefix sums of their lengths. Sequence b is query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    against keys cu_seqlens_k[b]:cu_seqlens_k[b+1], computed by :func:`scaled_dot_product_attention`
    on its (H, len, E) transposes with the other arguments unchanged (``alibi_slopes`` (Hq,) only).
    A sequence without keys gives zeros. Returns (total_q, Hq, Ev) float64, and with return_lse the
    rows' log-sum-exp (Hq, total_q) (-inf for a sequence without keys).
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 3:
            raise ValueError(f"{name}: expected (total, heads, head_dim), got shape {x.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"key and value: total and heads must agree, got {k.shape} and {v.shape}")
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k: lengths differ, {cu_q.size} != {cu_k.size}")
    if alibi_slopes is not None and np.ndim(alibi_slopes) != 1:
        raise ValueError(f"alibi_slopes: expected shape ({q.shape[1]},), got {np.shape(alibi_slopes)}")

    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full(q.shape[1::-1], -np.inf)
    for b in range(cu_q.size - 1):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys = slice(cu_k[b], cu_k[b + 1])
        seq_out, seq_lse = scaled_dot_product_attention(
            q[rows].transpose(1, 0, 2),
            k[keys].transpose(1, 0, 2),
            v[keys].transpose(1, 0, 2),
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            window=window,
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            return_lse=True,
        )
        out[rows] = seq_out.transpose(1, 0, 2)
        lse[:, rows] = seq_lse
    return (out, lse) if return_lse else out


def merge_attention_states(outputs, lses, *, sinks=None):
    """The exact merge of partial results over disjoint key sets (see
    :func:`pyattn.merge_attention_states`), in float64: weights e^(lse_p - M) over the parts (and the
    sink), parts with a -inf lse left out. Returns (out, lse)."""
    outs = [np.asarray(o, dtype=np.float64) for o in outputs]
    ls = [np.asarray(x, dtype=np.float64) for x in lses]
    top = np.max(np.stack(ls), axis=0)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)[:, None]  # (Hq, 1) against (..., Hq, L)
        top = np.maximum(top, sink)
    safe = np.where(np.isfinite(top), top, 0.0)
    total = np.zeros_like(top)
    out = np.zeros_like(outs[0])
    with np.errstate(invalid="ignore", over="ignore"):
        for o, x in zip(outs, ls):
            w = np.where(x == -np.inf, 0.0, np.exp(x - safe))
            total = total + w
            out = out + np.where((x == -np.inf)[..., None], 0.0, w[..., None] * o)
        if sinks is not None:
            total = total + np.where(sink == -np.inf, 0.0, np.exp(sink - safe))
        out = out / np.where(total == 0, 1.0, total)[..., None]
        lse = np.where(total == 0, -np.inf, np.log(np.where(total == 0, 1.0, total)) + safe)
    nan = np.isnan(np.stack(ls)).any(axis=0)
    return np.where(nan[..., None], np.nan, out), np.where(nan, np.nan, lse)


# ----------------------------------------------------------------------------------------------
# Multi-head attention


def _as_float64(array, name, shape=None):
    """`array` as float64, checking its shape when `shape` is given (None entries match anything)."""
    a = np.asarray(array, dtype=np.float64)
    if shape is not None and (a.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, a.shape))):
        expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name}: expected shape {expected}, got {a.shape}")
    return a


def _project(x, weight, bias):
    """x @ weight.T + bias (bias may be None); NaN/Inf inputs propagate without warnings."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = x @ weight.T
        return y if bias is None else y + bias


def _additive_mask(mask, name, bool_value):
    """A float64 array to add to the scores: bool masks give `bool_value` where True and 0 elsewhere."""
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, bool_value, 0.0)
    if mask.dtype.kind == "f":
        return mask.astype(np.float64)
    raise TypeError(f"{name}: must be bool or floating, got {mask.dtype}")


def _layer_weights(
    embed_dim, kv_dim, kdim, vdim, in_proj_weight, in_proj_bias, qkv_weights, qkv_biases, out_proj_weight, out_proj_bias
):
    """((wq, bq), (wk, bk), (wv, bv), (wo, bo)) in float64, checked against the layer's sizes: the
    stacked in_proj_weight [Wq; Wk; Wv] or the three separate weights; in_proj_bias [bq; bk; bv] or
    the separate biases (None where absent)."""
    if in_proj_weight is not None:
        if kdim != embed_dim or vdim != embed_dim:
            raise ValueError("in_proj_weight: only valid when key and value have embed_dim features")
        w = _as_float64(in_proj_weight, "in_proj_weight", (embed_dim + 2 * kv_dim, embed_dim))
        wq, wk, wv = w[:embed_dim], w[embed_dim : embed_dim + kv_dim], w[embed_dim + kv_dim :]
    else:
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        for name, w in zip(names, qkv_weights):
            if w is None:
                raise ValueError(f"{name}: required when in_proj_weight is not given")
        shapes = ((embed_dim, embed_dim), (kv_dim, kdim), (kv_dim, vdim))
        wq, wk, wv = (_as_float64(w, n, shape) for w, n, shape in zip(qkv_weights, names, shapes))
    bq, bk, bv = qkv_biases
    if in_proj_bias is not None:
        b = _as_float64(in_proj_bias, "in_proj_bias", (embed_dim + 2 * kv_dim,))
        bq, bk, bv = b[:embed_dim], b[embed_dim : embed_dim + kv_dim], b[embed_dim + kv_dim :]
    bq = None if bq is None else _as_float64(bq, "q_proj_bias", (embed_dim,))
    bk = None if bk is None else _as_float64(bk, "k_proj_bias", (kv_dim,))
    bv = None if bv is None else _as_float64(bv, "v_proj_bias", (kv_dim,))
    wo = _as_float64(out_proj_weight, "out_proj_weight", (embed_dim, embed_dim))
    bo = None if out_proj_bias is None else _as_float64(out_proj_bias, "out_proj_bias", (embed_dim,))
    return (wq, bq), (wk, bk), (wv, bv), (wo, bo)


def _layer_mask(attn_mask, key_padding_mask, unbatched, batch, num_heads, q_len, kv_len):
    """One additive (B, num_heads, L, S) float64 mask from torch.nn.MultiheadAttention's two masks
    (bool True = not allowed / padding; floats added), or None when neither is given."""
    mask = None
    if attn_mask is not None:
        if unbatched:
            shapes = [(q_len, kv_len), (num_heads, q_len, kv_len)]
        else:
            shapes = [(q_len, kv_len), (batch * num_heads, q_len, kv_len)]
        if np.shape(attn_mask) not in shapes:
            raise ValueError(f"attn_mask: expected shape {' or '.join(map(str, shapes))}, got {np.shape(attn_mask)}")
        mask = _additive_mask(attn_mask, "attn_mask", -np.inf)
        if mask.ndim == 3:
            mask = mask.reshape(batch, num_heads, q_len, kv_len)
    if key_padding_mask is not None:
        expected = (kv_len,) if unbatched else (batch, kv_len)
        if np.shape(key_padding_mask) != expected:
            raise ValueError(f"key_padding_mask: expected shape {expected}, got {np.shape(key_padding_mask)}")
        padding = _additive_mask(key_padding_mask, "key_padding_mask", -np.inf).reshape(batch, 1, 1, kv_len)
        mask = padding if mask is None else mask + padding
    return mask


def _check_packed(query, attn_mask, key_padding_mask, need_weights):
    """mha's inputs with cu_seqlens: packed (total, E) query, neither mask, no weights."""
    if query.ndim != 2:
        raise ValueError(f"query: expected packed (total, E) with cu_seqlens, got shape {query.shape}")
    for name, x in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if x is not None:
            raise ValueError(f"{name}: not supported with cu_seqlens")
    if need_weights:
        raise ValueError("need_weights: not supported with cu_seqlens")


def _packed_attention(q, k, v, cu_seqlens, is_causal, variants):
    """mha's attention step on packed tokens: q, k, v are (1, heads, total, head_dim), the one batch
    of an unbatched call, and so is the result."""
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"key: with cu_seqlens, needs as many tokens as query ({q.shape[2]}), got {k.shape[2]}")
    packed = (x[0].transpose(1, 0, 2) for x in (q, k, v))
    context = varlen_attention(*packed, cu_seqlens, cu_seqlens, is_causal=is_causal, enable_gqa=True, **variants)
    return context.transpose(1, 0, 2)[None]


def mha(
    query,
    key=None,
    value=None,
    *,
    num_heads,
    in_proj_weight=None,
    in_proj_bias=None,
    q_proj_weight=None,
    k_proj_weight=None,
    v_proj_weight=None,
    q_proj_bias=None,
    k_proj_bias=None,
    v_proj_bias=None,
    out_proj_weight,
    out_proj_bias=None,
    attn_mask=None,
    key_padding_mask=None,
    is_causal=False,
    need_weights=False,
    average_attn_weights=True,
    num_kv_heads=None,
    num_threads=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    cu_seqlens=None,
):
    """Multi-head attention layer (torch.nn.MultiheadAttention, batch_first=True, eval), in float64.

    Same arguments as :func:`pyattn.mha`; ``num_threads`` is accepted and ignored. The steps are
    the textbook ones:

    1. project: q = query @ Wq.T + bq (E outputs), k = key @ Wk.T + bk, v = value @ Wv.T + bv
       (num_kv_heads * head_dim outputs each). ``in_proj_weight`` holds [Wq; Wk; Wv] stacked by
       rows; ``in_proj_bias`` [bq; bk; bv], also when the weights are given separately.
    2. split heads: (B, L, E) -> (B, num_heads, L, head_dim), K/V into num_kv_heads heads.
    3. attention per head with scale 1/sqrt(head_dim), query head h reading kv head
       h // (num_heads // num_kv_heads), via :func:`scaled_dot_product_attention` above. Masks
       follow PyTorch's MultiheadAttention: a bool ``attn_mask`` (L, S) or (B*num_heads, L, S) is
       True where attending is NOT allowed; a bool ``key_padding_mask`` (B, S) is True at padding
       keys; float masks are added to the scaled scores (-inf forbids). ``is_causal`` applies on
       top (False, True/"upper_left", "lower_right"). A query row with no allowed key gets a zero
       context vector (and zero weights), so its output is ``out_proj_bias`` (or 0).
       ``window``, ``softcap``, ``sinks`` and ``alibi_slopes`` (num_heads,) go to it unchanged.
    4. merge heads: (B, num_heads, L, head_dim) -> (B, L, E); out = context @ Wo.T + bo.

    Unbatched inputs (L, E) with masks (L, S) / (num_heads, L, S) and (S,) are run as batch 1.
    Returns ``out`` (B, L, E), or ``(out, weights)`` when ``need_weights``: weights (B, L, S)
    averaged over heads when ``average_attn_weights``, else (B, num_heads, L, S). All float64.

    With ``cu_seqlens`` (batch + 1,), query (total, E) and key/value (total, kdim/vdim) are packed
    sequences, step 3 is :func:`varlen_attention` with ``cu_seqlens`` for queries and keys alike,
    and the result is ``out`` (total, E); masks and ``need_weights`` are refused (ValueError).
    """
    del num_threads  # the reference is single-threaded NumPy
    query = np.asarray(query)
    if query.ndim not in (2, 3):
        raise ValueError(f"query: expected (B, L, E) or unbatched (L, E), got shape {query.shape}")
    unbatched = query.ndim == 2
    if cu_seqlens is not None:
        # Packed tokens (total, E) are run like one unbatched sequence up to the attention step.
        _check_packed(query, attn_mask, key_padding_mask, need_weights)
    key = query if key is None else np.asarray(key)
    value = key if value is None else np.asarray(value)
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name}: expected {query.ndim} dimensions like query, got shape {x.shape}")
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    q_in = _as_float64(query, "query")
    k_in = _as_float64(key, "key")
    v_in = _as_float64(value, "value")
    batch, q_len, embed_dim = q_in.shape
    kv_len, kdim, vdim = k_in.shape[1], k_in.shape[2], v_in.shape[2]
    if k_in.shape[:2] != (batch, kv_len) or v_in.shape[:2] != (batch, kv_len):
        raise ValueError(f"key and value: batch and length must agree with query, got {key.shape} and {value.shape}")

    if num_heads < 1 or embed_dim % num_heads != 0:
        raise ValueError(f"num_heads: must divide embed_dim {embed_dim}, got {num_heads}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads: must divide num_heads {num_heads}, got {num_kv_heads}")
    head_dim = embed_dim // num_heads
    kv_dim = num_kv_heads * head_dim

    # 1. Projections.
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = _layer_weights(
        embed_dim,
        kv_dim,
        kdim,
        vdim,
        in_proj_weight,
        in_proj_bias,
        (q_proj_weight, k_proj_weight, v_proj_weight),
        (q_proj_bias, k_proj_bias, v_proj_bias),
        out_proj_weight,
        out_proj_bias,
    )
    q = _project(q_in, wq, bq)
    k = _project(k_in, wk, bk)
    v = _project(v_in, wv, bv)

    # 2. Split heads: (B, len, heads * head_dim) -> (B, heads, len, head_dim).
    q = q.reshape(batch, q_len, num_heads, head_dim).transpose(0, 2, 1, 3)
    k = k.reshape(batch, kv_len, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = v.reshape(batch, kv_len, num_kv_heads, head_dim).transpose(0, 2, 1, 3)

    # 3. Attention: one additive (B, num_heads, L, S) mask from both PyTorch-convention masks, or
    # the packed sequences.
    variants = dict(window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    if cu_seqlens is None:
        mask = _layer_mask(attn_mask, key_padding_mask, unbatched, batch, num_heads, q_len, kv_len)
        attn = scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, enable_gqa=True, return_weights=need_weights, **variants
        )
        context, weights = attn if need_weights else (attn, None)
    else:
        context, weights = _packed_attention(q, k, v, cu_seqlens, is_causal, variants), None

    # 4. Merge heads and project out.
    context = context.transpose(0, 2, 1, 3).reshape(batch, q_len, embed_dim)
    out = _project(context, wo, bo)

    if need_weights and average_attn_weights:
        weights = weights.mean(axis=1)
    if unbatched:
        out = out[0]
        weights = None if weights is None else weights[0]
    return (out, weights) if need_weights else out
