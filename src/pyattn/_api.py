# SPDX-License-Identifier: MIT
"""pyattn.scaled_dot_product_attention: the public function.

The contract (which arrays are accepted, how batch dimensions, grouped-query heads and masks
broadcast, defaults, `out=`, `return_weights`, the error messages) is decided in one place, the
compiled core (src/cpp/bindings_sdpa.cpp). This module only turns inputs that are not NumPy arrays
(torch tensors, lists) into arrays and passes everything on.
"""

from __future__ import annotations

from . import _core
from ._arrays import as_array, ndarray, refuse_masked


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
    out=None,
    num_threads=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    return_lse=False,
    precision="fast",
):
    """Scaled dot-product attention, softmax(Q Kᵀ · scale + mask) V, computed by a fused kernel.

    Parameters
    ----------
    query : ndarray, shape (..., Hq, L, E)
    key : ndarray, shape (..., Hk, S, E)
    value : ndarray, shape (..., Hk, S, Ev)
        float32, float64, float16 or bfloat16 (ml_dtypes), all the same dtype; 16-bit inputs are
        computed as `precision` says and the result returned in their dtype. Leading batch dimensions
        broadcast against each other. 2-D inputs (L, E) are one head; 3-D inputs are (heads, L, E). Any strides are read
        in place; an input whose last axis is not contiguous is copied first. PyTorch CPU tensors and any
        array with ``__dlpack__`` on the CPU (JAX, CuPy host arrays) are read without a copy; arrays on
        other devices are a TypeError.
    attn_mask : ndarray, optional
        Broadcastable to (..., Hq, L, S). Boolean: True means the query may attend to the key
        (PyTorch's convention). Floating (same dtype as query): added to the scaled scores; -inf
        forbids. Broadcasting never materialises the mask.
    is_causal : {False, True, "upper_left", "lower_right"}
        True / "upper_left": query i sees keys j <= i. "lower_right": query i sees keys
        j <= i + S - L (the alignment of a KV cache). Combines with attn_mask (both apply).
    scale : float, optional
        Multiplies Q Kᵀ; default 1/sqrt(E) (1.0 when E == 0). Any finite value.
    enable_gqa : bool
        Grouped-query attention: Hq must be a multiple of Hk and query head h reads key/value head
        h // (Hq // Hk), without copying. Without it Hq must equal Hk.
    return_weights : bool
        Also return the softmax weights (..., Hq, L, S); the only mode that allocates O(L·S).
    out : ndarray, optional
        C-contiguous output of the right shape and dtype, not overlapping any input; returned.
    num_threads : int, optional
        Threads for this call; default pyattn.get_num_threads().
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: query i sees key j only when d(i) - left <= j <= d(i) + right,
        with d(i) = i + S - L for ``is_causal="lower_right"`` and d(i) = i otherwise; None on a side is
        unbounded. Hugging Face's ``sliding_window=W`` on a causal model is ``window=(W - 1, 0)``.
        Combines with is_causal and attn_mask (all apply). Key blocks outside every row's window are
        skipped: the cost grows with L · (left + right + 1), not L · S.
    softcap : float, optional
        Logit softcap c > 0 (Gemma 2): each scaled score s becomes c · tanh(s / c) before the ALiBi
        term and attn_mask are added.
    sinks : array_like, shape (Hq,), optional
        One extra logit per query head that joins every softmax denominator and has no value row
        (gpt-oss): out_i = Σ_j e^{s_ij} v_j / (e^{sink_h} + Σ_j e^{s_ij}); finite or -inf (no sink).
        Returned weights then sum to less than 1; a row with no allowed key still returns zeros.
    alibi_slopes : array_like, shape (Hq,) or (..., Hq), optional
        ALiBi: adds ``-slope_h · |d(i) - j|`` to the scaled scores (after softcap), d(i) as for window;
        leading axes broadcast against the output's batch dimensions (never adding any). Finite, any sign.
    return_lse : bool
        Also return each row's log-sum-exp: the natural log of its full softmax denominator, in the
        scaled-score domain after softcap, ALiBi and masks (a sink's term included), -inf for a row
        without an allowed key. Partial results over disjoint key sets merge exactly with
        :func:`merge_attention_states`.
    precision : {"fast", "highest"}
        How 16-bit inputs are computed (float32 and float64 always compute in their own precision).
        "fast": bfloat16 inputs on CPUs with AVX512-BF16 (``pyattn.runtime_info()["precision_fast"]``)
        take bfloat16 dot products with float32 sums for Q·Kᵀ and P·V, the softmax in float32 and
        its weights rounded to bfloat16 for P·V; float16 inputs, other CPUs, return_weights and
        few query rows compute as "highest". "highest": float32 products throughout.
        Error bounds per dtype and precision: docs/design.md.

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
    weights : ndarray, shape (..., Hq, L, S), only with return_weights=True
    lse : ndarray, shape (..., Hq, L), only with return_lse=True
        float32 for float32 and 16-bit inputs, float64 for float64. With both, the result is
        ``(out, weights, lse)``.

    Notes
    -----
    A query row with no allowed key returns zeros (and zero weights), never NaN. The K and V
    values of forbidden keys never influence the result, even when they are NaN or Inf. Results
    are bitwise identical for any num_threads.
    """
    # None stays None: the core names the missing argument.
    if type(query) is not ndarray and query is not None:
        query = as_array(query, "query")
    if type(key) is not ndarray and key is not None:
        key = as_array(key, "key")
    if type(value) is not ndarray and value is not None:
        value = as_array(value, "value")
    if attn_mask is not None and type(attn_mask) is not ndarray:
        attn_mask = as_array(attn_mask, "attn_mask")
    if out is not None and type(out) is not ndarray:
        refuse_masked(out, "out")
    if (
        window is None
        and softcap is None
        and sinks is None
        and alibi_slopes is None
        and not return_lse
        and precision == "fast"
    ):
        return _core.sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, return_weights, out, num_threads)
    return _core.sdpa(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        enable_gqa,
        return_weights,
        out,
        num_threads,
        window,
        softcap,
        sinks,
        alibi_slopes,
        return_lse,
        precision=precision,
    )


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
    out=None,
    num_threads=None,
    return_lse=False,
    precision="fast",
):
    """Attention over a packed batch of variable-length sequences (FlashAttention's varlen layout).

    Sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` against key/value rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; sequences never attend across their boundaries, and no work
    or memory is spent on pairs across them (no padding).

    Parameters
    ----------
    query : ndarray, shape (total_q, Hq, E)
    key : ndarray, shape (total_k, Hk, E)
    value : ndarray, shape (total_k, Hk, Ev)
        Same dtypes as :func:`scaled_dot_product_attention`; any strides with a contiguous last axis
        are read in place.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (batch + 1,)
        Prefix sums of the sequence lengths: start at 0, non-decreasing, end at total_q / total_k.
    is_causal, window, softcap, sinks, scale, enable_gqa, num_threads, precision
        As in :func:`scaled_dot_product_attention`, applied to each sequence on its own (the causal
        alignment and d(i) use that sequence's L and S).
    alibi_slopes : array_like, shape (Hq,), optional
        As in :func:`scaled_dot_product_attention`.
    out : ndarray, optional
        C-contiguous (total_q, Hq, Ev) output of the inputs' dtype, not overlapping any input.
    return_lse : bool
        Also return the rows' log-sum-exp, shape (Hq, total_q) (FlashAttention's varlen layout), as
        in :func:`scaled_dot_product_attention`.

    Returns
    -------
    out : ndarray, shape (total_q, Hq, Ev)
        Rows of a sequence without keys are zeros (and their lse -inf).
    lse : ndarray, shape (Hq, total_q), only with return_lse=True
    """
    if type(query) is not ndarray and query is not None:
        query = as_array(query, "query")
    if type(key) is not ndarray and key is not None:
        key = as_array(key, "key")
    if type(value) is not ndarray and value is not None:
        value = as_array(value, "value")
    if out is not None and type(out) is not ndarray:
        refuse_masked(out, "out")
    return _core.varlen(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        is_causal,
        scale,
        enable_gqa,
        out,
        num_threads,
        window,
        softcap,
        sinks,
        alibi_slopes,
        return_lse,
        precision,
    )


def merge_attention_states(outputs, lses, *, sinks=None, out=None, num_threads=None):
    """Merge partial attention results over disjoint key sets into the result over all of them.

    Each part p is the output of the same query rows over its own keys (``out_p``) and the rows'
    log-sum-exp (``lse_p``), as :func:`scaled_dot_product_attention`, :func:`varlen_attention` and
    :meth:`KVCache.attend` return them with ``return_lse=True``. With ``M = max_p lse_p``::

        w_p = exp(lse_p - M)
        out = Σ_p w_p · out_p / Σ_p w_p
        lse = M + log Σ_p w_p

    which equals the attention over the union of the keys exactly (up to rounding), whatever the
    split: shards of a long context, cache segments, key blocks on other workers.

    Parameters
    ----------
    outputs : sequence of ndarray, or ndarray stacked as (P, ..., L, Ev)
        The parts' outputs, all of one shape (..., L, Ev) and dtype; float32 and 16-bit outputs merge
        in float32, float64 ones in float64.
    lses : sequence of ndarray, or ndarray stacked as (P, ..., L)
        Their log-sum-exps, shape (..., L); a -inf row (no allowed key in that part) contributes
        nothing, whatever its output holds.
    sinks : array_like, shape (Hq,), optional
        Attention sinks applied once, here (the parts computed without them): one more term
        ``exp(sink_h)`` in each denominator of head h, the rows ordered (..., Hq, L).
    out : ndarray, optional
        C-contiguous (..., L, Ev) array of the compute dtype for the merged output.
    num_threads : int, optional
        Threads for this call; default pyattn.get_num_threads().

    Returns
    -------
    out : ndarray, shape (..., L, Ev)
        Rows without an allowed key in any part are zeros, never NaN.
    lse : ndarray, shape (..., L)
        The merged log-sum-exp (-inf for those rows; with sinks, the sink's term included).
    """
    return _core.merge_states(outputs, lses, sinks, out, num_threads)
