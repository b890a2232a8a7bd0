# SPDX-License-Identifier: MIT
"""User-facing contract of pyattn: validation, broadcasting and layout, then one call into the core.

Every decision about shapes, dtypes and broadcasting is made here, before the compiled core runs.
Broadcasting never copies: leading batch dimensions, grouped-query heads and mask dimensions become
per-(batch, head) element offsets plus row strides, which the kernels read directly (stride 0 for a
broadcast axis). The only copies are documented ones: an input whose last axis is not contiguous
(or whose memory is misaligned) is copied before the call, because the kernels vectorise along it.
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np

from . import _core

_SUPPORTED = (np.dtype(np.float32), np.dtype(np.float64))
# 16-bit inputs compute in float32 and return their own dtype; bfloat16 is ml_dtypes' dtype.
_HALF_STORAGE = {"float16": 1, "bfloat16": 2}


def _is_half(dtype):
    # Native byte order only: the kernels read the 16-bit patterns as the CPU's own (a big-endian
    # float16 also calls itself "float16"; float32/float64 ones already fail the _SUPPORTED test).
    return dtype.itemsize == 2 and dtype.name in _HALF_STORAGE and dtype.isnative


_CAUSAL = {False: None, True: "upper_left", "upper_left": "upper_left", "lower_right": "lower_right"}
# The same choices as _core.sdpa_simple's codes (0 none, 1 upper-left, 2 lower-right).
_SIMPLE_CAUSAL = {k: {None: 0, "upper_left": 1, "lower_right": 2}[v] for k, v in _CAUSAL.items()}
_MAX_THREADS = 2**31 - 1  # the core takes a C int; larger requests are capped (threads <= work items anyway)


def _refuse_masked(x, name):
    """TypeError for a numpy.ma masked array: np.asarray keeps its data and drops its mask, so the
    masked entries would take part as if unmasked (a masked key attended to, a masked padding flag
    ignored, a masked out= entry overwritten but still hidden) and the result would differ from what
    the array says, silently. Cheap for plain arrays (no numpy.ma import: a masked array's module is
    loaded already)."""
    if type(x) is not np.ndarray:
        ma = sys.modules.get("numpy.ma")
        if ma is not None and isinstance(x, ma.MaskedArray):
            raise TypeError(
                f"{name}: masked arrays (numpy.ma) are not supported: their masked entries would be read as "
                f"if unmasked; pass a plain array (e.g. {name}.filled(...))"
            )


def _tensor_values(x, name):
    """A torch tensor's values as a NumPy array (no copy for a CPU tensor): detached, since pyattn
    is inference only (numpy() refuses a tensor that requires grad), bfloat16 as ml_dtypes.bfloat16
    (numpy() has no bfloat16), and a dtype NumPy lacks a TypeError naming the argument instead of
    torch's unnamed one."""
    t = x.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":  # named as from_torch names dtypes (torch is loaded: x is its tensor)
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}: a bfloat16 tensor needs the ml_dtypes package (pip install ml_dtypes)") from None
        return t.view(sys.modules["torch"].int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{name}: a torch tensor of dtype {t.dtype} has no NumPy equivalent ({exc})") from None


def _as_numpy(x, name):
    """x as a NumPy array: an ndarray itself (a masked one refused), a torch tensor's values
    (_tensor_values), anything else through np.asarray."""
    if isinstance(x, np.ndarray):
        _refuse_masked(x, name)
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):  # a torch tensor
        return _tensor_values(x, name)
    return np.asarray(x)


def _as_float_array(x, name):
    if x is None:
        raise TypeError(f"{name}: expected a NumPy array, got None")
    x = _as_numpy(x, name)
    if x.dtype not in _SUPPORTED and not _is_half(x.dtype):
        raise TypeError(f"{name}: dtype must be float32, float64, float16 or bfloat16 (native byte order), got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions (..., seq_len, dim), got shape {x.shape}")
    return x


def _kernel_layout(x, contiguous_last=True, name="input"):
    """x itself when the kernels can read it through strides, else a C-contiguous copy."""
    flags = x.flags
    if flags.c_contiguous and flags.aligned:  # the common case, decided in ~0.2 us instead of ~2
        return x
    item = x.itemsize
    last_ok = not contiguous_last or x.shape[-1] <= 1 or x.strides[-1] == item
    strides_ok = all(n <= 1 or s % item == 0 for n, s in zip(x.shape, x.strides))
    if last_ok and strides_ok and x.flags.aligned:
        return x
    copy = _allocate(x.shape, x.dtype, name)  # fresh allocations are aligned, unlike ascontiguousarray(x)
    copy[...] = x
    return copy


def _as_heads(x):
    """View of x with at least 3 dimensions (..., heads, seq_len, dim)."""
    return x[np.newaxis] if x.ndim == 2 else x


def _lead_strides(x, lead_shape):
    """Element strides of x's leading axes (all but its last two), aligned from the right with
    lead_shape; 0 for axes x lacks or has with size 1 (broadcast: read again, never copied)."""
    nd = max(x.ndim - 2, 0)
    strides = [0] * len(lead_shape)
    for i in range(1, nd + 1):
        if x.shape[nd - i] != 1:
            strides[-i] = x.strides[nd - i] // x.itemsize
    return strides


# Up to this many (batch, head) slices, offsets are built in plain Python (cheaper than NumPy calls).
_SMALL_COUNT = 256


def _offsets(lead_shape, strides, repeat=1):
    """Element offset of every index of lead_shape (C order), given per-axis element strides, each
    repeated `repeat` times (consecutive query heads sharing one key/value head)."""
    if math.prod(lead_shape) * repeat <= _SMALL_COUNT:
        offsets = [0]
        for n, stride in zip(lead_shape, strides):
            offsets = [o + i * stride for o in offsets for i in range(n)]
        return [o for o in offsets for _ in range(repeat)]
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(lead_shape, strides):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    return np.repeat(offsets, repeat)


def _row_stride(x, axis):
    return 0 if x.shape[axis] <= 1 else x.strides[axis] // x.itemsize


def _check_out(out, shape, dtype, inputs):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a NumPy array, got {type(out).__name__}")
    _refuse_masked(out, "out")
    if out.dtype != dtype:
        raise TypeError(f"out: dtype must be {dtype}, got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"out: shape must be {shape}, got {out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out: must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError("out: must be writeable")
    for name, x in inputs:
        if x is not None and np.may_share_memory(out, x):
            raise ValueError(f"out: must not overlap {name}")


def _scale_value(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale: must be finite, got {value}")
    return value


def _threads_value(num_threads):
    if num_threads is None:
        return 0
    if type(num_threads) is int and num_threads >= 1:  # the common case without the ABC check (~1 us)
        return min(num_threads, _MAX_THREADS)
    if isinstance(num_threads, (bool, np.bool_)) or not isinstance(num_threads, numbers.Integral):
        raise TypeError(f"num_threads: expected an int or None, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"num_threads: must be >= 1, got {num_threads}")
    return min(int(num_threads), _MAX_THREADS)  # more than a C int can hold means "as many as useful"


def _to_float32(x, threads, name):
    """A float16/bfloat16 array as float32; C-contiguous arrays through the core's vector conversion
    (NumPy converts float16 element by element, ~2 ms per million elements here, ml_dtypes' bfloat16
    astype ~1.5 ms). The core takes aligned arrays only (a 16-bit view at an odd address goes through
    NumPy)."""
    if x.dtype.name in _HALF_STORAGE and x.flags.c_contiguous and x.flags.aligned:
        wide = _allocate(x.shape, np.float32, name)
        _core._convert_half(x.view(np.uint16), wide, threads, bfloat16=x.dtype.name == "bfloat16")
        return wide
    return x.astype(np.float32)


def _from_float32(x, dtype, name, dst=None, threads=0):
    """float32 array x rounded to dtype (float16, bfloat16: the core's conversion), into dst if given."""
    dtype = np.dtype(dtype)
    if (dtype.name in _HALF_STORAGE and x.flags.c_contiguous
            and (dst is None or (dst.flags.c_contiguous and dst.flags.aligned))):
        narrow = _allocate(x.shape, dtype, name) if dst is None else dst
        _core._convert_half(x, narrow.view(np.uint16), threads, bfloat16=dtype.name == "bfloat16")
        return narrow
    if dst is None:
        return x.astype(dtype)
    dst[...] = x
    return dst


def _causal_value(is_causal):
    key = is_causal
    if isinstance(is_causal, (bool, np.bool_)):
        key = bool(is_causal)
    elif not isinstance(is_causal, str):
        raise ValueError(f"is_causal: expected False, True, 'upper_left' or 'lower_right', got {is_causal!r}")
    if key not in _CAUSAL:
        raise ValueError(f"is_causal: expected False, True, 'upper_left' or 'lower_right', got {is_causal!r}")
    return _CAUSAL[key]


_LINE = 64  # bytes in a cache line (KVCache storage starts relative to one; outputs start on one)


def _allocate(shape, dtype, name):
    """An uninitialised C-contiguous array that starts on a cache line (a view into a slightly larger
    buffer): NumPy aligns to 16 bytes, and the kernels' 64-byte vector stores into a row that
    straddles two lines cost two (unaligned outputs 0.93-0.98x at L = 128-512, Sapphire Rapids-class
    Xeon, 2026-12-03, output offsets alternating in one process). Made by the core (its plain-call
    path allocates the same way): 1.8 us a call, where finding the address from Python
    (ndarray.ctypes) took 2 of the 3.6 us this cost (np.empty: 0.5)."""
    try:
        return _core.empty_on_line(np.dtype(dtype), shape, name)
    except MemoryError as exc:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        raise ValueError(f"{name}: cannot allocate an array of shape {tuple(shape)} ({nbytes} bytes): {exc}") from None


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
):
    """Scaled dot-product attention, softmax(Q Kᵀ · scale + mask) V, computed by a fused kernel.

    Parameters
    ----------
    query : ndarray, shape (..., Hq, L, E)
    key : ndarray, shape (..., Hk, S, E)
    value : ndarray, shape (..., Hk, S, Ev)
        float32, float64, float16 or bfloat16 (ml_dtypes), all the same dtype; 16-bit inputs are
        computed in float32 and the result returned in their dtype. Leading batch dimensions
        broadcast against each other. 2-D inputs (L, E) are one head; 3-D inputs are (heads, L, E). Any strides are read
        in place; an input whose last axis is not contiguous is copied first.
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

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
    weights : ndarray, shape (..., Hq, L, S), only with return_weights=True

    Notes
    -----
    A query row with no allowed key returns zeros (and zero weights), never NaN. The K and V
    values of forbidden keys never influence the result, even when they are NaN or Inf. Results
    are bitwise identical for any num_threads.
    """
    if not return_weights:
        # Plain q/k/v: checked and launched in C++ in one step; None sends anything else (and every
        # error) through the general path below, which builds the same kernel arguments.
        causal = _SIMPLE_CAUSAL.get(is_causal) if type(is_causal) in (bool, str) else None
        plain_int = type(num_threads) is int and 0 < num_threads <= _MAX_THREADS
        threads = 0 if num_threads is None else num_threads if plain_int else -1
        if causal is not None and threads >= 0 and (scale is None or type(scale) is float):
            result = _core.sdpa_simple(query, key, value, causal, bool(enable_gqa), scale, threads, attn_mask, out)
            if result is not None:
                return result
    q = _as_float_array(query, "query")
    k = _as_float_array(key, "key")
    v = _as_float_array(value, "value")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    dtype = q.dtype
    out_ndim = max(q.ndim, k.ndim, v.ndim)
    kv_storage = 0
    threads = _threads_value(num_threads)
    if _is_half(dtype):
        # Computed in float32. The kernels read 16-bit K/V directly, converting one key block at a
        # time; only return_weights (a rare, O(L*S) mode) works on float32 copies of K and V.
        q = _to_float32(q, threads, "query")
        if not return_weights:
            kv_storage = _HALF_STORAGE[dtype.name]
            k, v = _kernel_layout(k).view(np.uint16), _kernel_layout(v).view(np.uint16)
        else:
            k, v = _to_float32(k, threads, "key"), _to_float32(v, threads, "value")
    q, k, v = (_as_heads(_kernel_layout(x, name=n)) for x, n in ((q, "query"), (k, "key"), (v, "value")))

    num_q_heads, q_len, head_dim = q.shape[-3:]
    num_kv_heads, kv_len, key_dim = k.shape[-3:]
    num_v_heads, v_len, value_dim = v.shape[-3:]
    if key_dim != head_dim:
        raise ValueError(f"key: last dimension must equal query's ({head_dim}), got key shape {k.shape}")
    if v_len != kv_len:
        raise ValueError(f"value: sequence length must equal key's ({kv_len}), got value shape {v.shape}")
    if num_v_heads != num_kv_heads:
        raise ValueError(f"value: number of heads must equal key's ({num_kv_heads}), got value shape {v.shape}")
    if enable_gqa:
        if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
            raise ValueError(
                f"enable_gqa: query heads ({num_q_heads}) must be a multiple of key/value heads ({num_kv_heads})"
            )
    elif num_q_heads != num_kv_heads:
        raise ValueError(
            f"key: number of heads ({num_kv_heads}) must equal query's ({num_q_heads}); "
            "pass enable_gqa=True for grouped-query attention"
        )
    try:
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise ValueError(
            f"query, key and value: leading batch dimensions do not broadcast: "
            f"{q.shape[:-3]}, {k.shape[:-3]}, {v.shape[:-3]}"
        ) from None

    causal = _causal_value(is_causal)
    scale_value = _scale_value(scale, head_dim)

    mask = None
    if attn_mask is not None:
        mask = _as_numpy(attn_mask, "attn_mask")
        if mask.dtype != np.bool_ and mask.dtype != dtype:
            raise TypeError(f"attn_mask: dtype must be bool or the query's dtype ({dtype}), got {mask.dtype}")
        if mask.dtype != np.bool_ and mask.dtype != q.dtype:
            mask = _to_float32(mask, threads, "attn_mask")  # a 16-bit float mask, widened like the inputs
        # The kernels read the mask through arbitrary strides, the last axis included.
        mask = _kernel_layout(mask, contiguous_last=False, name="attn_mask")
        full = batch + (num_q_heads, q_len, kv_len)
        try:
            broadcastable = np.broadcast_shapes(mask.shape, full) == full
        except ValueError:
            broadcastable = False
        if not broadcastable:
            raise ValueError(f"attn_mask: shape {mask.shape} is not broadcastable to {full}")

    out_shape = (q_len, value_dim) if out_ndim == 2 else batch + (num_q_heads, q_len, value_dim)
    user_out = out
    if out is not None:
        _check_out(out, out_shape, dtype, [("query", q), ("key", k), ("value", v), ("attn_mask", mask)])
    if out is None or out.dtype != q.dtype:  # 16-bit results are computed into a float32 buffer
        out = _allocate(out_shape, q.dtype, "out")
    weights = None
    if return_weights:
        w_shape = (q_len, kv_len) if out_ndim == 2 else batch + (num_q_heads, q_len, kv_len)
        weights = _allocate(w_shape, q.dtype, "return_weights")

    group = num_q_heads // num_kv_heads if num_kv_heads else 1
    heads_shape = batch + (num_q_heads,)
    kv_heads_shape = batch + (num_kv_heads,)
    q_off = _offsets(heads_shape, _lead_strides(q, heads_shape))
    # Query head h reads key/value head h // group: repeat each key/value head's offset group times.
    k_off = _offsets(kv_heads_shape, _lead_strides(k, kv_heads_shape), group)
    v_off = _offsets(kv_heads_shape, _lead_strides(v, kv_heads_shape), group)
    mask_strides = [0, 0]
    if mask is None:
        m_off = [0] * len(q_off)
    else:
        m_off = _offsets(heads_shape, _lead_strides(mask, heads_shape))
        for axis in (-2, -1):
            if mask.ndim >= -axis and mask.shape[axis] != 1:
                mask_strides[axis] = mask.strides[axis] // mask.itemsize
    offsets = np.array([q_off, k_off, v_off, m_off], dtype=np.int64).reshape(4, len(q_off))

    _core.sdpa(
        q, k, v, mask, out, weights, offsets,
        [_row_stride(q, -2), _row_stride(k, -2), _row_stride(v, -2), mask_strides[-2], mask_strides[-1]],
        [len(q_off), q_len, kv_len, head_dim, value_dim, group],
        causal is not None, (kv_len - q_len) if causal == "lower_right" else 0,
        scale_value, threads, kv_storage=kv_storage,
    )
    if out.dtype != dtype:
        out = _from_float32(out, dtype, "out", user_out, threads)
        weights = None if weights is None else _from_float32(weights, dtype, "return_weights", threads=threads)
    return (out, weights) if return_weights else out
