# SPDX-License-Identifier: MIT
"""Multi-head attention layer: pyattn.mha and pyattn.MultiHeadAttention.

Weights use torch.nn.MultiheadAttention's layouts and names (checked and packed in
_layer_weights.py). Everything numeric happens in one call into the core (projections as packed
GEMMs, attention, output projection; see src/cpp/mha.cpp); this module checks the call's inputs and
turns masks into (offset, stride) descriptions without copying them.
"""

from __future__ import annotations

import math

import numpy as np

from . import _core
from ._arrays import COMPUTE_DTYPES, allocate, as_array, check_batch_first, kernel_layout
from ._cache import KVCache, compute_dtype, layer_step
from ._layer_weights import float_array, is_bf16, resolve_weights


def _mask_entry(m, name, dtype, batch, num_heads, q_len, kv_len, key_padding):
    """(name, array, offsets per (b, h), stride_l, stride_s, true_forbids) for the core, or None;
    m is a NumPy array (_forward converts both masks) or None."""
    if m is None:
        return None
    if m.dtype != np.bool_ and m.dtype != dtype:
        raise TypeError(f"{name}: dtype must be bool or the inputs' dtype ({dtype}), got {m.dtype}")
    if m.dtype != np.bool_ and is_bf16(dtype):  # a bfloat16 layer computes in float32: its values, exactly
        m = m.astype(np.float32)
    m = kernel_layout(m, name, contiguous_last=False) if m.ndim else m
    item = m.itemsize
    bh = np.arange(batch * num_heads, dtype=np.int64)
    if key_padding:
        if m.shape != (batch, kv_len):
            raise ValueError(f"{name}: expected shape {(batch, kv_len)}, got {m.shape}")
        offsets = (bh // num_heads) * (m.strides[0] // item)
        stride_l, stride_s = 0, m.strides[1] // item
    else:
        if m.shape == (q_len, kv_len):
            offsets = np.zeros_like(bh)
            stride_l, stride_s = m.strides[0] // item, m.strides[1] // item
        elif m.shape == (batch * num_heads, q_len, kv_len):
            offsets = bh * (m.strides[0] // item)
            stride_l, stride_s = m.strides[1] // item, m.strides[2] // item
        else:
            raise ValueError(
                f"{name}: expected shape {(q_len, kv_len)} or {(batch * num_heads, q_len, kv_len)}, got {m.shape}"
            )
    return (name, m, np.ascontiguousarray(offsets, dtype=np.int64), int(stride_l), int(stride_s), m.dtype == np.bool_)


def _rows(x, batched, name):
    """(batch * len, features) view of a (batch, len, features) input, copied only if it must be."""
    x3 = kernel_layout(x, name) if batched else kernel_layout(x, name)[np.newaxis]
    return x3.reshape(x3.shape[0] * x3.shape[1], x3.shape[2])  # a view when the rows are evenly strided


def _key_value(q, key, value):
    """key and value arrays: both default to query (self-attention); value is required with key."""
    if key is None and value is None:
        return q, q
    if key is None or value is None:
        raise ValueError("key, value: pass both (cross-attention) or neither (self-attention)")
    return float_array(key, "key", q.dtype), float_array(value, "value", q.dtype)


def _forward_cached(w, q, kv_cache, num_new, left_padded, need_weights, num_threads, variants, pairs):
    """Self-attention of new tokens q (batch, chunk, E) over kv_cache, after appending their K/V."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache: expected a pyattn.KVCache, got {type(kv_cache).__name__}")
    if need_weights:
        raise ValueError("need_weights: not supported with kv_cache")
    if (w.kdim, w.vdim) != (w.embed_dim, w.embed_dim):
        raise ValueError(
            f"kv_cache: self-attention needs kdim = vdim = embed_dim ({w.embed_dim}), "
            f"the layer has kdim={w.kdim}, vdim={w.vdim}"
        )
    if (kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.value_dim) != (w.num_kv_heads, w.head_dim, w.head_dim):
        raise ValueError(
            f"kv_cache: expected num_kv_heads={w.num_kv_heads}, head_dim=value_dim={w.head_dim}, got {kv_cache!r}"
        )
    compute = compute_dtype(kv_cache)
    if compute != w.compute:
        raise TypeError(
            f"kv_cache: storage {kv_cache.dtype} computes in {compute}, "
            f"but the layer ({w.dtype}) computes in {w.compute}"
        )
    batched = q.ndim == 3
    x = q if batched else q[np.newaxis]
    if x.shape[0] != kv_cache.batch:
        raise ValueError(f"query: batch size must equal kv_cache.batch ({kv_cache.batch}), got {x.shape[0]}")
    batch, chunk = x.shape[0], x.shape[1]
    out = allocate((batch, chunk, w.embed_dim), w.compute, "out")
    dims = [batch, chunk, w.embed_dim, w.num_heads, w.num_kv_heads, w.head_dim]
    layer_step(
        kv_cache,
        w.core_rows(_rows(x, True, "query"), pairs, num_threads),
        w.core_weights(pairs),
        dims,
        num_new,
        left_padded,
        out,
        num_threads,
        _core_variants(w, variants),
        pairs,
    )
    out = _in_layer_dtype(w, out, num_threads)
    return out if batched else out[0]


def _core_variants(w, variants):
    """(window, softcap, sinks, alibi_slopes) for the core: a bfloat16 layer's per-head values as
    float32 (the same values)."""
    if not w.bf16:
        return variants
    return tuple(v.astype(np.float32) if isinstance(v, np.ndarray) and is_bf16(v.dtype) else v for v in variants)


def _in_layer_dtype(w, x, num_threads):
    """A result computed in w.compute, in the layer's dtype: a bfloat16 layer's rounded once (to
    nearest even, as ml_dtypes rounds; by the core's threads), into an array on a cache line like
    every result."""
    if x is None or not w.bf16:
        return x
    y = allocate(x.shape, w.dtype, "out")
    _core._convert_half(np.ascontiguousarray(x), y.view(np.uint16), num_threads, bfloat16=True)
    return y


def _core_inputs(w, arrays, batched, pairs, num_threads):
    """(query, key, value) as the core's row matrices (_rows, LayerWeights.core_rows): an array passed
    as more than one of them (self-attention) is converted once."""
    rows = {}
    for x, name in zip(arrays, ("query", "key", "value")):
        if id(x) not in rows:
            rows[id(x)] = w.core_rows(_rows(x, batched, name), pairs, num_threads)
    return [rows[id(x)] for x in arrays]


def _sequence_first(x, batch_first):
    """A (len, batch, features) input (batch_first=False) as its (batch, len, features) view; other
    inputs as they are (unbatched 2-D inputs have no batch axis to move, as in torch)."""
    return x if batch_first or x.ndim != 3 else x.swapaxes(0, 1)


def _forward_packed(
    w, query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, num_threads, variants, cu_seqlens, pairs
):
    """Self-attention over a packed batch: query (total, E) holds the sequences' tokens back to back,
    sequence s being rows cu_seqlens[s]:cu_seqlens[s + 1]; each attends within itself only."""
    if attn_mask is not None or key_padding_mask is not None:
        raise ValueError("cu_seqlens: a packed batch takes no attn_mask or key_padding_mask (it needs no padding)")
    if need_weights:
        raise ValueError("need_weights: not supported with cu_seqlens")
    q = float_array(query, "query")
    if q.dtype != w.dtype:
        raise TypeError(f"query: dtype must be {w.dtype} (the weights' dtype), got {q.dtype}")
    if q.ndim != 2 or q.shape[1] != w.embed_dim:
        raise ValueError(f"query: with cu_seqlens expected packed tokens (total, {w.embed_dim}), got shape {q.shape}")
    k, v = _key_value(q, key, value)
    total = q.shape[0]
    for name, x, dim in (("key", k, w.kdim), ("value", v, w.vdim)):
        if x.shape != (total, dim):
            raise ValueError(
                f"{name}: with cu_seqlens expected shape {(total, dim)} like query's tokens, got {x.shape}"
            )
    out = allocate((total, w.embed_dim), w.compute, "out")
    _core.mha(
        *_core_inputs(w, (q, k, v), False, pairs, num_threads),
        w.core_weights(pairs),
        [1, total, total, w.embed_dim, w.kdim, w.vdim, w.num_heads, w.num_kv_heads, w.head_dim],
        [],
        is_causal,
        out,
        None,
        num_threads,
        *_core_variants(w, variants),
        cu_seqlens,
        bf16=pairs,
    )
    return _in_layer_dtype(w, out, num_threads)


def _forward(
    w,
    query,
    key,
    value,
    attn_mask,
    key_padding_mask,
    is_causal,
    need_weights,
    average_attn_weights,
    num_threads,
    kv_cache=None,
    num_new=None,
    left_padded=False,
    batch_first=True,
    variants=(None, None, None, None),
    cu_seqlens=None,
    precision="fast",
):
    check_batch_first(batch_first)
    pairs = w.pairs(precision)
    if cu_seqlens is not None:
        if kv_cache is not None:
            raise ValueError("cu_seqlens: a packed batch cannot be combined with kv_cache")
        return _forward_packed(
            w,
            query,
            key,
            value,
            attn_mask,
            key_padding_mask,
            is_causal,
            need_weights,
            num_threads,
            variants,
            cu_seqlens,
            pairs,
        )
    if kv_cache is not None:
        if key is not None or value is not None or attn_mask is not None or key_padding_mask is not None:
            raise ValueError("kv_cache: self-attention only; per-row lengths (num_new) replace masks")
        q = float_array(query, "query", w.dtype)
        if q.ndim not in (2, 3) or q.shape[-1] != w.embed_dim:
            layout = "(batch, chunk" if batch_first else "(chunk, batch"
            raise ValueError(f"query: expected {layout}, {w.embed_dim}) or (chunk, {w.embed_dim}), got {q.shape}")
        q = _sequence_first(q, batch_first)
        out = _forward_cached(w, q, kv_cache, num_new, left_padded, need_weights, num_threads, variants, pairs)
        return _sequence_first(out, batch_first)
    q = float_array(query, "query")
    if q.dtype != w.dtype:
        raise TypeError(f"query: dtype must be {w.dtype} (the weights' dtype), got {q.dtype}")
    k, v = _key_value(q, key, value)
    if not batch_first:  # the checks below then speak of (batch, len, features) shapes
        q, k, v = (_sequence_first(x, False) for x in (q, k, v))
    if q.ndim not in (2, 3):
        raise ValueError(f"query: expected (batch, q_len, embed_dim) or (q_len, embed_dim), got shape {q.shape}")
    batched = q.ndim == 3
    for name, x in (("key", k), ("value", v)):
        if x.ndim != q.ndim:
            raise ValueError(f"{name}: expected {q.ndim} dimensions like query, got shape {x.shape}")
    batch = q.shape[0] if batched else 1
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if q.shape[-1] != w.embed_dim:
        raise ValueError(f"query: last dimension must be embed_dim ({w.embed_dim}), got shape {q.shape}")
    if k.shape[-1] != w.kdim:
        raise ValueError(f"key: last dimension must be kdim ({w.kdim}), got shape {k.shape}")
    if v.shape[-1] != w.vdim:
        raise ValueError(f"value: last dimension must be vdim ({w.vdim}), got shape {v.shape}")
    if v.shape[-2] != kv_len:
        raise ValueError(f"value: length must equal key's ({kv_len}), got shape {v.shape}")
    if batched and (k.shape[0] != batch or v.shape[0] != batch):
        raise ValueError(f"key/value: batch size must equal query's ({batch}), got {k.shape[0]} and {v.shape[0]}")

    masks = []
    if attn_mask is not None:
        am = as_array(attn_mask, "attn_mask")
        masks.append(_mask_entry(am, "attn_mask", w.dtype, batch, w.num_heads, q_len, kv_len, False))
    if key_padding_mask is not None:
        kp = as_array(key_padding_mask, "key_padding_mask")
        if not batched:
            if kp.shape != (kv_len,):
                raise ValueError(f"key_padding_mask: expected shape {(kv_len,)} for unbatched input, got {kp.shape}")
            kp = kp[np.newaxis]
        masks.append(_mask_entry(kp, "key_padding_mask", w.dtype, batch, w.num_heads, q_len, kv_len, True))

    out = allocate((batch, q_len, w.embed_dim) if batched else (q_len, w.embed_dim), w.compute, "out")
    weights = allocate((batch, w.num_heads, q_len, kv_len), w.compute, "need_weights") if need_weights else None
    _core.mha(
        *_core_inputs(w, (q, k, v), batched, pairs, num_threads),
        w.core_weights(pairs),
        [batch, q_len, kv_len, w.embed_dim, w.kdim, w.vdim, w.num_heads, w.num_kv_heads, w.head_dim],
        masks,
        is_causal,
        out,
        weights,
        num_threads,
        *_core_variants(w, variants),
        bf16=pairs,
    )
    out = _sequence_first(_in_layer_dtype(w, out, num_threads), batch_first)
    if not need_weights:
        return out
    if average_attn_weights:
        weights = weights.mean(axis=1)
    weights = _in_layer_dtype(w, weights, num_threads)
    if not batched:
        weights = weights[0]
    return out, weights


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
    kv_cache=None,
    num_new=None,
    left_padded=False,
    batch_first=True,
    num_threads=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    cu_seqlens=None,
    precision="fast",
):
    """Multi-head attention (inference) with torch.nn.MultiheadAttention's weights and conventions.

    Parameters
    ----------
    query : ndarray, (batch, q_len, embed_dim) or unbatched (q_len, embed_dim)
    key, value : ndarray, optional
        (batch, kv_len, kdim) and (batch, kv_len, vdim); default to query (self-attention).
    num_heads : int
        Must divide embed_dim; head_dim = embed_dim // num_heads, scale 1/sqrt(head_dim).
    in_proj_weight, in_proj_bias : ndarray, optional
        Stacked q/k/v projection (embed_dim + 2 * num_kv_heads * head_dim, embed_dim) and its bias,
        when kdim == vdim == embed_dim. Otherwise pass q_proj_weight (embed_dim, embed_dim),
        k_proj_weight (num_kv_heads * head_dim, kdim), v_proj_weight (num_kv_heads * head_dim, vdim)
        and optionally q_proj_bias, k_proj_bias, v_proj_bias (or one in_proj_bias).
    out_proj_weight, out_proj_bias : ndarray
        (embed_dim, embed_dim) and (embed_dim,); the bias is optional.
    attn_mask : ndarray, optional
        (q_len, kv_len) or (batch * num_heads, q_len, kv_len). Bool: True = NOT allowed (PyTorch's
        nn.MultiheadAttention convention, the opposite of scaled_dot_product_attention). Float: added.
    key_padding_mask : ndarray, optional
        (batch, kv_len) (unbatched: (kv_len,)). Bool: True = padding, ignored. Float: added.
    is_causal : {False, True, "upper_left", "lower_right"}
        As in scaled_dot_product_attention; combines with the masks.
    need_weights, average_attn_weights : bool
        Also return the attention weights (see Returns), averaged over the heads or per head.
    num_kv_heads : int, optional
        Key/value heads for grouped-query (1 = multi-query) attention; must divide num_heads.
    kv_cache : pyattn.KVCache, optional
        Incremental decoding (self-attention only, no masks): the new tokens' K/V are appended to
        the cache and their queries attend to every cached key (lower-right causal alignment). The
        cache computes in the layer's compute dtype (float32 for bfloat16 weights).
    num_new : int or ndarray of int, optional
        With kv_cache: the real tokens of each row of a padded chunk, (batch,) ints in [0, chunk].
    left_padded : bool
        With num_new: the real tokens are the last num_new[b] of row b's chunk, not the first.
    batch_first : bool
        True (default): batched inputs and output are (batch, len, features); False: (len, batch,
        features), torch's default, read as views (the output is a view too). Masks and weights
        keep their shapes, as in torch.
    num_threads : int, optional
        Threads for this call; default pyattn.get_num_threads().
    window, softcap : optional
        As in :func:`scaled_dot_product_attention` (with kv_cache: as in :meth:`KVCache.attend`).
    sinks, alibi_slopes : ndarray, shape (num_heads,), optional
        As in :func:`scaled_dot_product_attention`, one per query head.
    cu_seqlens : array_like of int, shape (num_seqs + 1,), optional
        A packed batch without padding: query (and key/value, if given) are (total, features), the
        sequences' tokens back to back, sequence s being rows cu_seqlens[s]:cu_seqlens[s+1] (prefix
        sums starting at 0 and ending at total); each attends within itself only (is_causal, window
        and ALiBi per sequence), and no work is spent across sequences. No masks, no need_weights,
        no kv_cache; the output is (total, embed_dim).
    precision : {"fast", "highest"}
        How a bfloat16 layer (bfloat16 weights and inputs) computes; float32 and float64 layers
        compute in their own precision. "fast" (the default): on CPUs with AVX512-BF16
        (``pyattn.runtime_info()["precision_fast"]``) the projections are bfloat16 dot products
        with float32 sums, the attention's output rounded to bfloat16 for the output projection;
        elsewhere as "highest". "highest": the float32 layer over the same values, its results
        rounded to bfloat16 once. Error bounds: docs/guide_dtypes.rst.

    Returns
    -------
    out : ndarray
        (batch, q_len, embed_dim), or (q_len, embed_dim) for unbatched inputs.
    weights : ndarray
        Only with need_weights: (batch, q_len, kv_len) averaged over heads, or (batch, num_heads,
        q_len, kv_len) with average_attn_weights=False.

    Notes
    -----
    The weights are packed on every call: MultiHeadAttention packs them once (same results).
    """
    q = float_array(query, "query")
    k, v = _key_value(q, key, value)
    if q.ndim < 1:
        raise ValueError(f"query: expected (batch, q_len, embed_dim) or (q_len, embed_dim), got shape {q.shape}")
    w = resolve_weights(
        q.shape[-1],
        k.shape[-1],
        v.shape[-1],
        num_heads,
        num_kv_heads,
        q.dtype,
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
    return _forward(
        w,
        q,
        None if key is None else k,
        None if value is None else v,
        attn_mask,
        key_padding_mask,
        is_causal,
        need_weights,
        average_attn_weights,
        num_threads,
        kv_cache,
        num_new,
        left_padded,
        batch_first,
        (window, softcap, sinks, alibi_slopes),
        cu_seqlens,
        precision,
    )


def _head_values(values, name, num_heads, dtype):
    """A layer's sinks or ALiBi slopes: None, or a fresh (num_heads,) array of the layer's dtype."""
    if values is None:
        return None
    arr = np.array(as_array(values, name), dtype=dtype)
    if arr.shape != (num_heads,):
        raise ValueError(f"{name}: expected shape ({num_heads},), got {arr.shape}")
    return arr


class MultiHeadAttention:
    """A multi-head attention layer holding its weights, packed for the GEMM once.

    Weight attributes use torch.nn.MultiheadAttention's names: ``in_proj_weight``/``in_proj_bias``
    (when kdim == vdim == embed_dim) or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
    (+ ``in_proj_bias``), ``out_proj_weight``, ``out_proj_bias``. Change weights through
    ``load_state_dict`` (which repacks them), not by writing into the arrays. Calling the layer is
    ``pyattn.mha`` with these weights.

    Parameters
    ----------
    embed_dim : int
        Model width E: query features and output features.
    num_heads : int
        Query heads; must divide embed_dim (head_dim = embed_dim // num_heads).
    kdim, vdim : int, optional
        Key and value input features; default embed_dim. Other sizes store separate
        q/k/v_proj_weight instead of one in_proj_weight.
    bias : bool
        Whether the projections have biases (initialised to zero, as in torch).
    num_kv_heads : int, optional
        Key/value heads for grouped-query (1 = multi-query) attention; must divide num_heads;
        default num_heads.
    dtype : float32, float64 or bfloat16 (``ml_dtypes.bfloat16``)
        The weights' dtype, and the inputs' and outputs' dtype of the layer. A bfloat16 layer
        computes in float32 from its bfloat16 values: on CPUs with AVX512-BF16 its projections are
        bfloat16 dot products (float32 sums; the attention's output rounded to bfloat16 for the output
        projection) unless a call asks for ``precision="highest"``, elsewhere float32 products; the
        attention is float32; results are rounded to bfloat16 once. Its ``kv_cache`` is any cache
        that computes in float32 (storage float32, float16, bfloat16 or int8).
    seed : int, optional
        Seed of the random initial weights (torch's ``xavier_uniform_`` for the input projections,
        its Linear default for the output projection), for reproducible layers.
    batch_first : bool
        True (default): inputs and outputs are (batch, len, features); False: (len, batch,
        features), torch.nn.MultiheadAttention's default.
    window, softcap : optional
        The layer's sliding window and logit softcap (Mistral, Gemma 2), applied on every call, as in
        :func:`scaled_dot_product_attention`.
    sinks : bool or array_like, shape (num_heads,), optional
        Attention sinks (gpt-oss), a parameter of the layer (``state_dict()["sinks"]``); True: zeros.
    alibi_slopes : array_like, shape (num_heads,), optional
        ALiBi slopes (BLOOM, MPT), held as ``state_dict()["alibi_slopes"]``.
    """

    # Variant options of layers made by from_torch / from_linear_weights unless set.
    window = None
    softcap = None
    sinks = None
    alibi_slopes = None

    def __init__(
        self,
        embed_dim,
        num_heads,
        *,
        kdim=None,
        vdim=None,
        bias=True,
        num_kv_heads=None,
        dtype=np.float32,
        seed=None,
        batch_first=True,
        window=None,
        softcap=None,
        sinks=None,
        alibi_slopes=None,
    ):
        self.batch_first = check_batch_first(batch_first)
        dtype = np.dtype(dtype)
        if dtype not in COMPUTE_DTYPES and not is_bf16(dtype):
            raise TypeError(f"dtype: must be float32, float64 or bfloat16 (ml_dtypes.bfloat16), got {dtype}")
        if isinstance(embed_dim, bool) or not isinstance(embed_dim, (int, np.integer)) or embed_dim < 1:
            raise ValueError(f"embed_dim: expected a positive int, got {embed_dim!r}")
        self.embed_dim = int(embed_dim)
        self.kdim = int(kdim) if kdim is not None else self.embed_dim
        self.vdim = int(vdim) if vdim is not None else self.embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if not isinstance(num_heads, (int, np.integer)) or num_heads < 1 or self.embed_dim % num_heads:
            raise ValueError(
                f"num_heads: must be a positive divisor of embed_dim ({self.embed_dim}), got {num_heads!r}"
            )
        head_dim = self.embed_dim // num_heads
        kv_width = self.num_kv_heads * head_dim
        rng = np.random.default_rng(seed)

        def xavier(rows, cols):  # torch's xavier_uniform_ for the input projections
            bound = math.sqrt(6.0 / (rows + cols))
            return rng.uniform(-bound, bound, (rows, cols)).astype(dtype)

        state = {}
        if self.kdim == self.embed_dim and self.vdim == self.embed_dim:
            state["in_proj_weight"] = xavier(self.embed_dim + 2 * kv_width, self.embed_dim)
        else:
            state["q_proj_weight"] = xavier(self.embed_dim, self.embed_dim)
            state["k_proj_weight"] = xavier(kv_width, self.kdim)
            state["v_proj_weight"] = xavier(kv_width, self.vdim)
        bound = 1.0 / math.sqrt(self.embed_dim)  # torch's default Linear init for out_proj
        state["out_proj.weight"] = rng.uniform(-bound, bound, (self.embed_dim, self.embed_dim)).astype(dtype)
        if bias:
            state["in_proj_bias"] = np.zeros(self.embed_dim + 2 * kv_width, dtype)
            state["out_proj.bias"] = np.zeros(self.embed_dim, dtype)
        self.dtype = dtype
        self.window, self.softcap = window, softcap
        if sinks is True:
            state["sinks"] = np.zeros(num_heads, dtype)
        elif sinks is not None and sinks is not False:
            state["sinks"] = sinks
        if alibi_slopes is not None:
            state["alibi_slopes"] = alibi_slopes
        self.load_state_dict(state)

    # -- weights ------------------------------------------------------------------------------
    def load_state_dict(self, state_dict):
        """Load weights given with torch.nn.MultiheadAttention's state_dict keys and repack them.

        Parameters
        ----------
        state_dict : dict
            ``in_proj_weight`` (or ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``),
            ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``; NumPy arrays or torch
            tensors of the layer's dtype; optionally ``sinks`` and ``alibi_slopes`` (num_heads,).
            Unknown keys (``bias_k``, ``bias_v``) raise ValueError.
        """
        known = {
            "in_proj_weight",
            "in_proj_bias",
            "q_proj_weight",
            "k_proj_weight",
            "v_proj_weight",
            "out_proj.weight",
            "out_proj.bias",
            "sinks",
            "alibi_slopes",
        }
        unknown = set(state_dict) - known
        if unknown:
            raise ValueError(
                f"state_dict: unsupported keys {sorted(unknown)} (bias_k/bias_v/add_zero_attn are not supported)"
            )
        get = state_dict.get
        w = resolve_weights(
            self.embed_dim,
            self.kdim,
            self.vdim,
            self.num_heads,
            self.num_kv_heads,
            self.dtype,
            get("in_proj_weight"),
            get("in_proj_bias"),
            get("q_proj_weight"),
            get("k_proj_weight"),
            get("v_proj_weight"),
            None,
            None,
            None,
            get("out_proj.weight"),
            get("out_proj.bias"),
        )
        sinks = _head_values(get("sinks"), "sinks", self.num_heads, self.dtype)
        slopes = _head_values(get("alibi_slopes"), "alibi_slopes", self.num_heads, self.dtype)
        self._weights = w
        if sinks is not None:
            self.sinks = sinks
        if slopes is not None:
            self.alibi_slopes = slopes
        self._has_in_proj = get("in_proj_weight") is not None
        self._has_bias = get("in_proj_bias") is not None or get("out_proj.bias") is not None
        w.packed()  # pre-pack for the active ISA now, not on the first call

    def state_dict(self):
        """Weights as a dict with torch.nn.MultiheadAttention's keys.

        Returns
        -------
        dict
            Copies of the weights, keyed as ``torch.nn.MultiheadAttention.state_dict()`` keys them.
        """
        w = self._weights
        d = {}
        if self._has_in_proj:
            d["in_proj_weight"] = np.concatenate([w.q, w.k, w.v])
        else:
            d["q_proj_weight"], d["k_proj_weight"], d["v_proj_weight"] = w.q.copy(), w.k.copy(), w.v.copy()
        if w.bq is not None or w.bk is not None or w.bv is not None:
            parts = [
                b if b is not None else np.zeros(n, self.dtype)
                for b, n in ((w.bq, w.q.shape[0]), (w.bk, w.k.shape[0]), (w.bv, w.v.shape[0]))
            ]
            d["in_proj_bias"] = np.concatenate(parts)
        d["out_proj.weight"] = w.o.copy()
        if w.bo is not None:
            d["out_proj.bias"] = w.bo.copy()
        if self.sinks is not None:
            d["sinks"] = self.sinks.copy()
        if self.alibi_slopes is not None:
            d["alibi_slopes"] = self.alibi_slopes.copy()
        return d

    # Read-only views with torch's attribute names (None where torch has None).
    in_proj_weight = property(lambda self: self.state_dict().get("in_proj_weight"))
    in_proj_bias = property(lambda self: self.state_dict().get("in_proj_bias"))
    q_proj_weight = property(lambda self: None if self._has_in_proj else self._weights.q)
    k_proj_weight = property(lambda self: None if self._has_in_proj else self._weights.k)
    v_proj_weight = property(lambda self: None if self._has_in_proj else self._weights.v)
    out_proj_weight = property(lambda self: self._weights.o)
    out_proj_bias = property(lambda self: self._weights.bo)

    @classmethod
    def from_torch(cls, module):
        """A layer with the weights, dtype and batch_first of a torch.nn.MultiheadAttention.

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
            float32, float64 or bfloat16 parameters; ``bias_k``/``bias_v`` and ``add_zero_attn`` are not
            supported (ValueError).
        """
        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise ValueError("module: bias_k/bias_v and add_zero_attn are not supported")
        dtype = module.out_proj.weight.dtype
        np_dtype = {"torch.float32": np.float32, "torch.float64": np.float64}.get(str(dtype))
        if str(dtype) == "torch.bfloat16":
            import ml_dtypes  # a bfloat16 tensor's values come as ml_dtypes.bfloat16 (as_array)

            np_dtype = ml_dtypes.bfloat16
        if np_dtype is None:
            raise TypeError(f"module: parameters must be float32, float64 or bfloat16, got {dtype}")
        layer = cls.__new__(cls)
        layer.batch_first = bool(getattr(module, "batch_first", False))  # torch's default is (len, batch, E)
        layer.embed_dim, layer.kdim, layer.vdim = module.embed_dim, module.kdim, module.vdim
        layer.num_heads = layer.num_kv_heads = module.num_heads
        layer.dtype = np.dtype(np_dtype)
        layer.load_state_dict({k: v for k, v in module.state_dict().items()})
        return layer

    @classmethod
    def from_linear_weights(
        cls,
        q_weight,
        k_weight,
        v_weight,
        o_weight,
        q_bias=None,
        k_bias=None,
        v_bias=None,
        o_bias=None,
        *,
        num_heads,
        num_kv_heads=None,
        batch_first=True,
    ):
        """A layer from separate q/k/v/o linear layers (BERT/GPT style).

        Parameters
        ----------
        q_weight, k_weight, v_weight, o_weight : ndarray
            Weights in (out_features, in_features) layout: q (E, E), k (num_kv_heads * head_dim,
            kdim), v (num_kv_heads * head_dim, vdim), o (E, E).
        q_bias, k_bias, v_bias, o_bias : ndarray, optional
            Their biases.
        num_heads : int
            Query heads; must divide E.
        num_kv_heads : int, optional
            Key/value heads (grouped-query attention); default num_heads.
        batch_first : bool
            As in the constructor.
        """
        q_weight = float_array(q_weight, "q_weight")
        layer = cls.__new__(cls)
        layer.batch_first = check_batch_first(batch_first)
        layer.embed_dim = q_weight.shape[0]
        layer.kdim, layer.vdim = np.shape(k_weight)[-1], np.shape(v_weight)[-1]
        layer.num_heads = num_heads
        layer.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        layer.dtype = q_weight.dtype
        w = resolve_weights(
            layer.embed_dim,
            layer.kdim,
            layer.vdim,
            num_heads,
            layer.num_kv_heads,
            layer.dtype,
            None,
            None,
            q_weight,
            k_weight,
            v_weight,
            q_bias,
            k_bias,
            v_bias,
            o_weight,
            o_bias,
        )
        layer._weights = w
        layer._has_in_proj = layer.kdim == layer.embed_dim and layer.vdim == layer.embed_dim
        layer._has_bias = any(b is not None for b in (q_bias, k_bias, v_bias, o_bias))
        w.packed()
        return layer

    # -- forward --------------------------------------------------------------------------------
    def __call__(
        self,
        query,
        key=None,
        value=None,
        *,
        attn_mask=None,
        key_padding_mask=None,
        is_causal=False,
        need_weights=False,
        average_attn_weights=True,
        kv_cache=None,
        num_new=None,
        left_padded=False,
        num_threads=None,
        cu_seqlens=None,
        precision="fast",
    ):
        """The layer's forward pass: ``pyattn.mha`` with this layer's weights, batch_first and variant
        options (window, softcap, sinks, alibi_slopes).

        Parameters
        ----------
        query, key, value, attn_mask, key_padding_mask, is_causal, need_weights, \
average_attn_weights, kv_cache, num_new, left_padded, num_threads, cu_seqlens, precision
            As in :func:`pyattn.mha`.

        Returns
        -------
        out : ndarray
            Or ``(out, weights)`` with need_weights, as in :func:`pyattn.mha`.
        """
        return _forward(
            self._weights,
            query,
            key,
            value,
            attn_mask,
            key_padding_mask,
            is_causal,
            need_weights,
            average_attn_weights,
            num_threads,
            kv_cache,
            num_new,
            left_padded,
            self.batch_first,
            (self.window, self.softcap, self.sinks, self.alibi_slopes),
            cu_seqlens,
            precision,
        )

    def __repr__(self):
        options = [f"window={self.window}"] if self.window is not None else []
        options += [f"softcap={self.softcap}"] if self.softcap is not None else []
        options += [f"{name}=..." for name in ("sinks", "alibi_slopes") if getattr(self, name) is not None]
        return (
            f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, dtype={self.dtype}"
            + ("" if self.batch_first else ", batch_first=False")
            + "".join(", " + o for o in options)
            + ")"
        )
