# SPDX-License-Identifier: MIT
"""pyattn.torch: pyattn's attention on torch tensors, as a torch operator.

Imported only when asked for (``import pyattn.torch``); ``import pyattn`` never imports torch.

- :func:`scaled_dot_product_attention` takes and returns CPU tensors with the arguments and semantics
  of ``torch.nn.functional.scaled_dot_product_attention``, plus pyattn's options (``window``,
  ``softcap``, ``sinks``, ``alibi_slopes``, ``is_causal="lower_right"``, ``num_threads``,
  ``precision``). Inputs are read in place through their strides (NumPy views of the tensors' memory,
  the same conversion as pyattn's NumPy API); the output is a fresh tensor that the core writes
  directly.
- The computation is the operator ``torch.ops.pyattn.sdpa`` (``torch.library.custom_op``) with a
  fake implementation, so ``torch.compile(fullgraph=True)`` traces calls to it without a graph
  break. Outside compilation the wrapper calls the implementation directly: the operator dispatch
  would only add overhead to every decode step.
- Inference only: pyattn has no backward and no dropout. ``dropout_p > 0``, or a tensor that requires
  grad while grad mode is on, is an error naming the way out; :func:`sdpa_override` sends such calls
  to PyTorch's own function instead.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from typing import Optional

import torch

from . import _core
from ._arrays import as_array

try:  # bfloat16 tensors are read through ml_dtypes: imported here, not inside a model's first forward
    import ml_dtypes  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    pass

__all__ = ["scaled_dot_product_attention", "sdpa_override"]

_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_CAUSAL = {False: "none", True: "upper_left", "upper_left": "upper_left", "lower_right": "lower_right"}
_OPTIONS = ("window", "softcap", "sinks", "alibi_slopes", "num_threads", "precision")


def _output_shape(query, key, value):
    """The result's shape under pyattn's rules: (L, Ev) for 2-D operands, else the broadcast batch
    axes + (Hq, L, Ev) (a 2-D operand among 3-D ones is one head). What does not fit is a ValueError
    naming the arguments, as the core would raise."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dimensions (..., L, E), got shape {tuple(t.shape)}")
    if max(query.dim(), key.dim(), value.dim()) == 2:
        return (query.shape[-2], value.shape[-1])
    lead = query.shape[:-3]
    try:  # the common case, equal batch axes, without torch.broadcast_shapes' cost
        if not (lead == key.shape[:-3] == value.shape[:-3]):
            lead = torch.broadcast_shapes(lead, key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        raise ValueError(
            "query, key and value: leading batch dimensions do not broadcast: "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        ) from None
    heads = query.shape[-3] if query.dim() >= 3 else 1
    return (*lead, heads, query.shape[-2], value.shape[-1])


def _per_head(t):
    """sinks / alibi_slopes (a few values per head, often a bf16 nn.Parameter) as float64 values."""
    return None if t is None else t.detach().to(torch.float64).numpy()


def _sdpa_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    causal: str,
    scale: Optional[float],
    enable_gqa: bool,
    windowed: bool,
    window_left: Optional[int],
    window_right: Optional[int],
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    diagonal: Optional[int],
    num_threads: Optional[int],
    precision: str,
) -> torch.Tensor:
    """pyattn.scaled_dot_product_attention on CPU tensors, into a fresh output tensor."""
    out = torch.empty(_output_shape(query, key, value), dtype=query.dtype)
    mask = None if attn_mask is None else as_array(attn_mask, "attn_mask")
    _core.sdpa(
        as_array(query, "query"),
        as_array(key, "key"),
        as_array(value, "value"),
        mask,
        False if causal == "none" else causal,
        scale,
        enable_gqa,
        False,
        as_array(out, "out"),  # the new tensor's memory: the core writes the result there
        num_threads,
        (window_left, window_right) if windowed else None,
        softcap,
        _per_head(sinks),
        _per_head(alibi_slopes),
        False,
        diagonal,
        precision,
    )
    return out


# The operator torch.compile sees; outside compilation _run calls _sdpa_impl itself.
_sdpa_op = torch.library.custom_op("pyattn::sdpa", _sdpa_impl, mutates_args=(), device_types="cpu")


def _run(args):
    """The operator on its flat arguments (_op_arguments): through torch.ops under torch.compile, else
    the implementation directly (the dispatch would only add overhead to every decode step)."""
    return _sdpa_op(*args) if torch.compiler.is_compiling() else _sdpa_impl(*args)


@_sdpa_op.register_fake
def _(query, key, value, attn_mask, causal, scale, enable_gqa, windowed, window_left, window_right, *rest):
    return query.new_empty(_output_shape(query, key, value))


def _check_inputs(tensors):
    """CPU, a dtype pyattn computes, and no autograd: each failure names the argument."""
    grad = torch.is_grad_enabled()
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise TypeError(
                f"{name}: the tensor is on {t.device}; pyattn computes on the CPU (move it with .cpu(), or "
                "use torch.nn.functional.scaled_dot_product_attention on that device)"
            )
        if grad and t.requires_grad:
            raise RuntimeError(
                f"{name}: requires grad while grad mode is on, and pyattn has no backward (inference only): "
                "call it under torch.inference_mode() or torch.no_grad(), or use "
                "torch.nn.functional.scaled_dot_product_attention for training"
            )
    for name in ("query", "key", "value"):
        if tensors[name].dtype not in _DTYPES:
            raise TypeError(f"{name}: expected float32, float64, float16 or bfloat16, got {tensors[name].dtype}")


def _op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, options, diagonal=None):
    """The operator's flat arguments from the public signature, or a clear error. `diagonal` (private,
    for the transformers integration) places the queries among the keys: row i's diagonal key is
    i + diagonal, for the causal rule and the window alike."""
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; pyattn options are {list(_OPTIONS)}")
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p: pyattn is inference only and has no dropout, got {dropout_p!r}; pass 0.0 (a model in "
            ".eval() mode does), or use torch.nn.functional.scaled_dot_product_attention for training"
        )
    causal = _CAUSAL.get(is_causal) if isinstance(is_causal, (bool, str)) else None
    if causal is None:
        raise ValueError(f"is_causal: expected False, True, 'upper_left' or 'lower_right', got {is_causal!r}") from None
    sinks, slopes = options.get("sinks"), options.get("alibi_slopes")
    _check_inputs(
        {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "sinks": sinks, "alibi_slopes": slopes}
    )
    window = options.get("window")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window: expected a (left, right) pair of ints or None, got {window!r}")
        try:  # NumPy and torch integers too; the core checks the values
            window = tuple(None if side is None else operator.index(side) for side in window)
        except TypeError:
            raise TypeError(f"window: expected a (left, right) pair of ints or None, got {window!r}") from None
        if any(type(side) is bool for side in options["window"]):
            raise TypeError(f"window: expected a (left, right) pair of ints or None, got {window!r}")
    if scale is not None:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be finite, got {scale}")
    softcap = options.get("softcap")
    precision = options.get("precision", "fast")
    if not isinstance(precision, str):  # the value is the core's to check
        raise TypeError(f"precision: expected 'fast' or 'highest', got {type(precision).__name__}")
    return (
        query,
        key,
        value,
        attn_mask,
        causal,
        scale,
        bool(enable_gqa),
        window is not None,
        None if window is None else window[0],
        None if window is None else window[1],
        None if softcap is None else float(softcap),
        sinks,
        slopes,
        None if diagonal is None else int(diagonal),
        options.get("num_threads"),
        precision,
    )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    **pyattn_options,
):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by pyattn, on CPU tensors.

    Parameters
    ----------
    query, key, value : torch.Tensor
        (..., Hq, L, E), (..., Hk, S, E), (..., Hk, S, Ev) on the CPU; float32, float64, float16 or
        bfloat16, all the same dtype. Any strides are read in place (a tensor whose last axis is not
        contiguous is copied first).
    attn_mask : torch.Tensor, optional
        Boolean (True = may attend) or of the query's dtype (added to the scaled scores),
        broadcastable to (..., Hq, L, S); broadcast axes are read with stride 0, never expanded.
    dropout_p : float
        Must be 0.0: pyattn is inference only.
    is_causal : bool or str
        As in torch (True: query i sees keys j <= i), plus ``"lower_right"``: j <= i + S - L, the
        alignment of a KV cache. May be combined with ``attn_mask`` (both apply).
    scale : float, optional
        Default 1/sqrt(E).
    enable_gqa : bool
        Hq a multiple of Hk; key/value heads are shared without copies.
    **pyattn_options
        ``window=(left, right)``, ``softcap=``, ``sinks=`` (tensor (Hq,)), ``alibi_slopes=``
        (tensor (Hq,) or (..., Hq)), ``num_threads=``, ``precision=`` ("fast", the default, or
        "highest": how bfloat16 tensors are computed): see :func:`pyattn.scaled_dot_product_attention`.

    Returns
    -------
    torch.Tensor
        (..., Hq, L, Ev), the query's dtype, a new CPU tensor. A query row with no allowed key is
        zeros (as in torch).

    Raises
    ------
    TypeError, ValueError
        A non-CPU tensor, an unsupported dtype or option, shapes that do not fit; the message names
        the argument.
    RuntimeError
        A tensor requires grad while grad mode is on (use ``torch.inference_mode()`` or
        ``torch.no_grad()``).
    """
    args = _op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pyattn_options)
    return _run(args)


# -- sdpa_override ---------------------------------------------------------------------------------


def _servable(query, key, value, attn_mask, dropout_p, scale, enable_gqa, extra):
    """Whether pyattn computes this torch call exactly: CPU float tensors of one dtype, no dropout, no
    autograd, no argument pyattn does not know."""
    if extra or dropout_p != 0.0:
        return False
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if any(t.device.type != "cpu" or t.is_nested or t.layout != torch.strided for t in tensors):
        return False
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _same_shape_rules(query, key, value, enable_gqa) and (scale is None or math.isfinite(scale))


def _same_shape_rules(query, key, value, enable_gqa):
    """Whether torch and pyattn read these shapes alike: the same rank, the same last dimensions,
    batch axes that broadcast, and head counts equal or grouped (torch also broadcasts a single
    head, and a lower-rank query over the heads, where pyattn raises or reads one head)."""
    if not (query.dim() == key.dim() == value.dim() >= 2):
        return False
    if key.shape[-1] != query.shape[-1] or value.shape[-2] != key.shape[-2]:
        return False
    if query.dim() == 2:
        return True
    q_heads, kv_heads = query.shape[-3], key.shape[-3]
    if value.shape[-3] != kv_heads or kv_heads == 0:
        return False
    if q_heads != kv_heads and not (enable_gqa and q_heads % kv_heads == 0):
        return False
    try:
        torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError:
        return False
    return True


def _routed_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **extra
):
    """torch.nn.functional.scaled_dot_product_attention while sdpa_override is active."""
    if not _servable(query, key, value, attn_mask, dropout_p, scale, enable_gqa, extra):
        return _TORCH_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            **extra,
        )
    return scaled_dot_product_attention(
        query, key, value, attn_mask, is_causal=bool(is_causal), scale=scale, enable_gqa=enable_gqa
    )


class sdpa_override(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with sdpa_override():`)
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to pyattn inside a ``with`` block
    (or a decorated function).

    Calls that pyattn computes exactly (CPU tensors of float32/float64/float16/bfloat16, dropout 0,
    no tensor requiring grad under grad mode) go to pyattn; every other call (GPU tensors, training
    with dropout, nested tensors) goes to PyTorch's own function, unchanged. On exit, normal or by an
    exception, the previous function is restored; blocks nest.

    The switch replaces the attribute of ``torch.nn.functional``, so it reaches code that looks the
    function up when calling it (``F.scaled_dot_product_attention(...)``, Hugging Face's ``"sdpa"``
    attention, ``torch.nn.MultiheadAttention``'s slow path); a name imported before the block
    (``from torch.nn.functional import scaled_dot_product_attention``) keeps PyTorch's function. The
    attribute is process-wide: other threads see the switch while the block runs.
    """

    def __init__(self):
        self._saved = []

    def __enter__(self):
        self._saved.append(torch.nn.functional.scaled_dot_product_attention)
        torch.nn.functional.scaled_dot_product_attention = _routed_sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._saved.pop()
        return False


functools.update_wrapper(_routed_sdpa, _TORCH_SDPA, assigned=("__doc__",), updated=())
