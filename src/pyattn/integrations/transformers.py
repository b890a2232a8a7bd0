# SPDX-License-Identifier: MIT
"""pyattn as a Hugging Face ``transformers`` attention implementation: ``attn_implementation="pyattn"``.

:func:`register` adds two entries under the name ``"pyattn"``, both through ``transformers``' public
interfaces:

- an attention function (``AttentionInterface``) that runs pyattn's kernels on the query/key/value
  tensors the model's attention module passes: grouped-query heads read in place (no ``repeat_kv``),
  ``scaling``, ``softcap`` (Gemma 2), the attention sinks ``s_aux`` (gpt-oss);
- a mask function (``AttentionMaskInterface``) that turns the model's mask request into *structure*
  instead of a dense (batch, 1, q_len, kv_len) tensor: causal or not, the sliding window, where the
  queries sit among the keys (the cache offsets), and the (batch, kv_len) padding of the batch. The
  kernels then skip forbidden key blocks instead of reading a mask. A request it does not recognise
  (packed sequences, image-token overlays, chunked attention, a model's own mask function) is built
  densely by ``transformers``' own boolean mask builder, so the answer is exact either way.

Positions: the mask functions of ``transformers`` see absolute positions ``q_offset + i`` and
``kv_offset + j``; a causal rule ``kv <= q`` is pyattn's diagonal ``d(i) = i + (q_offset - kv_offset)``
and a sliding window of W tokens is ``window=(W - 1, 0)`` around it.

Inference only, like the rest of pyattn: a model in training mode with attention dropout, or tensors
that require grad under grad mode, raise an error that says what to do (``model.eval()``,
``torch.inference_mode()``).
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import AttentionInterface
from transformers import masking_utils as _masking

from ..torch import _op_arguments, _run

__all__ = ["register", "NAME", "MaskStructure"]

NAME = "pyattn"


class MaskStructure:
    """The attention pattern of one mask request, without an L x S tensor.

    Attributes
    ----------
    causal : bool
        Key position kv may be attended by query position q only when kv <= q.
    window : tuple or None
        (left, right) extents around the diagonal, pyattn's ``window=`` (None: unbounded).
    diagonal : int
        q_offset - kv_offset: query row i's diagonal key is i + diagonal.
    padding : torch.Tensor or None
        (batch, kv_len) bool, True at real tokens; None when nothing is padded.
    kv_length : int
        The key length the request was made for.
    batch_size, q_length : int
        The rest of the request's shape.
    shape, ndim
        (batch_size, 1, q_length, kv_length) and 4, the dense mask's: transformers reads them when a
        mask made ahead (``generate`` with a static cache) is passed back to a model, which hands it
        to the mask function again, and that returns it unchanged.
    """

    __slots__ = ("causal", "window", "diagonal", "padding", "kv_length", "batch_size", "q_length")
    ndim = 4

    def __init__(self, causal, window, diagonal, padding, kv_length, batch_size=1, q_length=1):
        self.causal = causal
        self.window = window
        self.diagonal = diagonal
        self.padding = padding
        self.kv_length = kv_length
        self.batch_size = batch_size
        self.q_length = q_length

    @property
    def shape(self):
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def __repr__(self):
        padded = "none" if self.padding is None else tuple(self.padding.shape)
        return (
            f"MaskStructure(causal={self.causal}, window={self.window}, diagonal={self.diagonal}, "
            f"padding={padded}, kv_length={self.kv_length})"
        )


# The code objects of transformers' own mask functions: a closure built by the same factory shares its
# code object, so a request is recognised exactly, whatever window size its closure holds.
_AND_CODE = _masking.and_masks(_masking.causal_mask_function).__code__
_SLIDING_CODE = _masking.sliding_window_overlay(1).__code__
_SLIDING_BIDIRECTIONAL_CODE = (
    _masking.sliding_window_bidirectional_overlay(1).__code__
    if hasattr(_masking, "sliding_window_bidirectional_overlay")
    else None
)


def _closure(fn, name):
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _pattern(mask_function):
    """(causal, window) of a mask function transformers builds, or None when it is anything else."""
    if mask_function is _masking.causal_mask_function:
        return True, None
    if mask_function is _masking.bidirectional_mask_function:
        return False, None
    if getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = list(_closure(mask_function, "mask_functions"))
    if len(parts) != 2:
        return None
    base = parts.pop(1)
    overlay = parts[0]
    code = getattr(overlay, "__code__", None)
    width = _closure(overlay, "sliding_window") if code in (_SLIDING_CODE, _SLIDING_BIDIRECTIONAL_CODE) else None
    if isinstance(width, bool) or not isinstance(width, int):
        return None
    if base is _masking.causal_mask_function and code is _SLIDING_CODE and width >= 1:
        return True, (width - 1, 0)  # kv > q - W
    if base is _masking.bidirectional_mask_function and code is _SLIDING_BIDIRECTIONAL_CODE and width >= 0:
        return False, (width, width)  # |q - kv| <= W
    return None


def mask_function(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=_masking.causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """The ``"pyattn"`` entry of ``AttentionMaskInterface``: a :class:`MaskStructure` when the request
    is causal, bidirectional or a sliding window (with any padding), else transformers' dense boolean
    mask of shape (batch, 1, q_length, kv_length). A MaskStructure passed in as ``attention_mask`` (one
    made ahead by ``generate``) is returned as it is."""
    if isinstance(attention_mask, MaskStructure):
        return attention_mask
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(torch.bool)  # a 2-D padding mask: 1 = token, 0 = padding
    pattern = _pattern(mask_function)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if pattern is None:
        return _masking.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
            use_vmap=kwargs.get("use_vmap", False),
            device=kwargs.get("device", "cpu"),
        )
    padding = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length]
        if bool(padding.all()):
            padding = None
    causal, window = pattern
    return MaskStructure(causal, window, q_offset - kv_offset, padding, int(kv_length), batch_size, q_length)


def _inference_only(module, dropout):
    if dropout:
        raise ValueError(
            f"attn_implementation='pyattn' is inference only, and {type(module).__name__} asked for attention "
            f"dropout {dropout}: put the model in inference mode with model.eval() (or use 'sdpa' for training)"
        )


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    is_causal=None,
    **kwargs,
):
    """The ``"pyattn"`` entry of ``AttentionInterface``.

    query (batch, Hq, L, E), key/value (batch, Hk, S, E/Ev) -> ((batch, L, Hq, Ev), None), the layout
    and return value of transformers' other implementations (no attention weights).
    """
    _inference_only(module, dropout)
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"attn_implementation='pyattn' does not support the position_bias of {type(module).__name__} "
            "(T5-style relative bias); use 'sdpa' or 'eager' for this model"
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask, diagonal, window = None, None, None
    if isinstance(attention_mask, MaskStructure):
        structure = attention_mask
        if structure.kv_length != kv_len:
            raise ValueError(f"attention_mask: built for {structure.kv_length} keys, the layer attends to {kv_len}")
        if structure.padding is not None:
            mask = structure.padding[:, None, None, :]  # (batch, 1, 1, S): broadcast, never expanded
        causal, window, diagonal = structure.causal, structure.window, structure.diagonal
    elif attention_mask is not None:  # a dense 4-D mask: bool (True = attend) or additive float
        mask = attention_mask
        if mask.dtype.is_floating_point and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        elif mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(
                f"attention_mask: a 4-D mask must be bool (True = attend) or floating (added to the scores), "
                f"got {mask.dtype}"
            )
        causal = False
    else:  # no mask request (a model that builds none): the module's own rule, aligned with its cache
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        diagonal = kv_len - q_len
        if causal and sliding_window:
            window = (int(sliding_window) - 1, 0)
    options = {}
    if window is not None:
        options["window"] = window
    if softcap:
        options["softcap"] = float(softcap)
    if s_aux is not None:
        options["sinks"] = s_aux
    gqa = query.shape[1] != key.shape[1]
    args = _op_arguments(query, key, value, mask, 0.0, causal, scaling, gqa, options, diagonal)
    out = _run(args)
    return out.transpose(1, 2).contiguous(), None


def register():
    """Make ``attn_implementation="pyattn"`` available to every transformers model (idempotent).

    Returns
    -------
    str
        The name to pass: ``"pyattn"``.
    """
    if "q_offset" not in inspect.signature(_masking.sdpa_mask).parameters:
        raise ImportError(
            "pyattn.integrations.transformers needs transformers' mask interface with q_offset/kv_offset "
            f"(transformers >= 5); this is transformers {transformers.__version__}"
        )
    if AttentionInterface._global_mapping.get(NAME) is not attention_forward:
        AttentionInterface.register(NAME, attention_forward)
    if _masking.AttentionMaskInterface._global_mapping.get(NAME) is not mask_function:
        _masking.AttentionMaskInterface.register(NAME, mask_function)
    return NAME
