# SPDX-License-Identifier: MIT
"""Explain mode: every step of multi-head self-attention, named and inspectable.

``explain(x, layer)`` recomputes what :func:`pyattn.mha` computes for self-attention, one named step
at a time: projections, raw scores, scaling, masking, softmax, value mix, head concatenation and
output projection. Everything is float64 NumPy written as plainly as possible (Python loops over heads
and rows, every L x L matrix materialised): clarity over speed, so use it on a sentence, not on a
book. It shares no code with the fast path, so it doubles as a readable specification.

Masks follow :func:`pyattn.mha` (PyTorch's ``nn.MultiheadAttention`` conventions): a bool
``attn_mask`` is True where attention is NOT allowed, a bool ``key_padding_mask`` is True at padding
keys, float masks are added to the scaled scores (-inf forbids), and ``is_causal`` forbids later keys.
A row whose keys are all forbidden gets all-zero weights and a zero head output.

Rendering lives in ``_explain_render`` (:func:`render_text`, :func:`plot_heatmaps`, re-exported
here) and the ``python -m pyattn explain`` demo in ``_explain_demo`` (reached through :func:`main`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ._arrays import as_array, check_batch_first
from ._explain_render import plot_heatmaps, render_text

__all__ = ["Explanation", "HeadSteps", "explain", "main", "plot_heatmaps", "render_text"]

_WEIGHT_NAMES = (
    "in_proj_weight", "in_proj_bias",
    "q_proj_weight", "k_proj_weight", "v_proj_weight",
    "q_proj_bias", "k_proj_bias", "v_proj_bias",
    "out_proj_weight", "out_proj_bias",
)  # fmt: skip


@dataclass
class HeadSteps:
    """One attention head, step by step (float64; L queries, S = L keys, d = head_dim).

    Attributes
    ----------
    head : int
        Query head index.
    kv_head : int
        The key/value head it reads (differs from `head` only with grouped-query attention).
    q : ndarray, (L, d)
        This head's columns of the query projection.
    k, v : ndarray, (S, d)
        Its key/value head's columns of the key and value projections.
    scores : ndarray, (L, S)
        Raw scores ``q @ k.T``.
    scaled_scores : ndarray, (L, S)
        ``scores * scale``.
    masked_scores : ndarray, (L, S)
        Scaled scores plus float masks; -inf where forbidden.
    weights : ndarray, (L, S)
        Softmax over the allowed keys of each row; forbidden entries exactly 0.
    output : ndarray, (L, d)
        ``weights @ v``.
    """

    head: int
    kv_head: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scores: np.ndarray
    scaled_scores: np.ndarray
    masked_scores: np.ndarray
    weights: np.ndarray
    output: np.ndarray


@dataclass
class Explanation:
    """Every intermediate of one self-attention call (float64), in the order they are computed.

    Attributes
    ----------
    tokens : list
        L labels.
    x : ndarray, (L, E)
        Input embeddings.
    num_heads, num_kv_heads, head_dim : int
        The layer's sizes.
    scale : float
        1/sqrt(head_dim).
    is_causal : bool or str
        As passed: False, True, "upper_left" or "lower_right".
    mask : ndarray, (num_heads, L, S)
        The additive mask used: 0 allowed, -inf forbidden, else added.
    q : ndarray, (L, E)
        ``x @ Wq.T + bq``, all heads side by side.
    k, v : ndarray, (S, num_kv_heads * head_dim)
        The key and value projections.
    heads : list of HeadSteps
        One per query head.
    concat : ndarray, (L, E)
        Head outputs side by side.
    output : ndarray, (L, E)
        ``concat @ Wo.T + bo``.
    params : dict
        The float64 q/k/v/out weights and biases used.
    """

    tokens: list
    x: np.ndarray
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    is_causal: object
    mask: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    heads: list
    concat: np.ndarray
    output: np.ndarray
    params: dict = field(repr=False, default_factory=dict)

    @property
    def allowed(self):
        """(num_heads, L, S) bool: True where a query may attend a key."""
        return self.mask != -np.inf

    @property
    def weights(self):
        """(num_heads, L, S) softmax weights of every head."""
        return np.stack([head.weights for head in self.heads])

    def to_text(self, **kwargs):
        """Same as ``render_text(self, **kwargs)``."""
        return render_text(self, **kwargs)

    def plot(self, path, **kwargs):
        """Same as ``plot_heatmaps(self, path, **kwargs)``."""
        return plot_heatmaps(self, path, **kwargs)

    def __str__(self):
        return render_text(self)


def _as_float64(value, name):
    array = np.asarray(as_array(value, name), dtype=np.float64)
    if array.dtype == object:  # pragma: no cover - np.asarray(..., float64) already refuses these
        raise TypeError(f"{name}: expected a numeric array")
    return array


def _read_layer(layer):
    """(dict of the torch-named weights as float64 arrays or None, num_heads or None) of a layer."""
    if isinstance(layer, Mapping):  # a state dict, e.g. MultiHeadAttention.state_dict() or np.load(.npz)
        source = {str(key).replace("out_proj.", "out_proj_"): value for key, value in layer.items()}
        unknown = sorted(set(source) - set(_WEIGHT_NAMES) - {"num_heads", "num_kv_heads"})
        if unknown:
            raise ValueError(f"layer_or_weights: unsupported keys {unknown}")
        heads = source.get("num_heads")
    elif hasattr(layer, "out_proj_weight"):  # pyattn.MultiHeadAttention
        source = {name: getattr(layer, name, None) for name in _WEIGHT_NAMES}
        heads = getattr(layer, "num_heads", None)
    elif hasattr(layer, "state_dict"):  # torch.nn.MultiheadAttention (state_dict detaches the tensors)
        return _read_layer({**layer.state_dict(), "num_heads": layer.num_heads})
    else:
        raise TypeError(
            "layer_or_weights: expected a pyattn.MultiHeadAttention or a dict of weights with torch "
            f"state_dict keys, got {type(layer).__name__}"
        )
    weights = {n: None if source.get(n) is None else _as_float64(source[n], n) for n in _WEIGHT_NAMES}
    return weights, None if heads is None else int(np.asarray(heads))


def _projections(weights, embed_dim, num_heads):
    """Per-projection float64 (weight, bias) in torch layout, plus num_kv_heads, checked against E."""
    if num_heads < 1 or embed_dim % num_heads:
        raise ValueError(f"num_heads: must be >= 1 and divide embed_dim {embed_dim}, got {num_heads}")
    head_dim = embed_dim // num_heads
    if weights["in_proj_weight"] is not None:
        packed = weights["in_proj_weight"]
        kv_dim = (packed.shape[0] - embed_dim) // 2
        if packed.ndim != 2 or packed.shape != (embed_dim + 2 * kv_dim, embed_dim):
            raise ValueError(f"in_proj_weight: expected shape (E + 2*kv_dim, E={embed_dim}), got {packed.shape}")
        wq, wk, wv = packed[:embed_dim], packed[embed_dim : embed_dim + kv_dim], packed[embed_dim + kv_dim :]
    else:
        wq, wk, wv = (weights[f"{p}_proj_weight"] for p in "qkv")
        if wq is None or wk is None or wv is None:
            raise ValueError("layer_or_weights: needs in_proj_weight or all of q/k/v_proj_weight")
        kv_dim = wk.shape[0]
    for name, w, rows in (
        ("q_proj_weight", wq, embed_dim),
        ("k_proj_weight", wk, kv_dim),
        ("v_proj_weight", wv, kv_dim),
    ):
        if w.shape != (rows, embed_dim):
            raise ValueError(f"{name}: expected shape ({rows}, {embed_dim}) for self-attention, got {w.shape}")
    if kv_dim < 1 or kv_dim % head_dim or num_heads % (kv_dim // head_dim):
        raise ValueError(f"k_proj_weight: {kv_dim} outputs is not a number of kv heads dividing {num_heads} heads")

    biases = [weights[f"{p}_proj_bias"] for p in "qkv"]
    if weights["in_proj_bias"] is not None:  # split in three like torch
        packed = weights["in_proj_bias"]
        if packed.shape != (embed_dim + 2 * kv_dim,):
            raise ValueError(f"in_proj_bias: expected shape ({embed_dim + 2 * kv_dim},), got {packed.shape}")
        biases = [packed[:embed_dim], packed[embed_dim : embed_dim + kv_dim], packed[embed_dim + kv_dim :]]
    bq, bk, bv = (np.zeros(n) if b is None else b for b, n in zip(biases, (embed_dim, kv_dim, kv_dim)))

    wo, bo = weights["out_proj_weight"], weights["out_proj_bias"]
    if wo is None or wo.shape != (embed_dim, embed_dim):
        got = None if wo is None else wo.shape
        raise ValueError(f"out_proj_weight: expected shape ({embed_dim}, {embed_dim}), got {got}")
    bo = np.zeros(embed_dim) if bo is None else bo
    for name, b, n in (
        ("q bias", bq, embed_dim),
        ("k bias", bk, kv_dim),
        ("v bias", bv, kv_dim),
        ("out_proj_bias", bo, embed_dim),
    ):
        if b.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {b.shape}")
    params = {"q_weight": wq, "k_weight": wk, "v_weight": wv, "out_weight": wo}
    params.update(q_bias=bq, k_bias=bk, v_bias=bv, out_bias=bo)
    return params, kv_dim // head_dim


def _additive(mask, name):
    """A user mask as float64 values to add: bool True (= not allowed) becomes -inf, False 0."""
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, -np.inf, 0.0)
    if mask.dtype.kind != "f":
        raise TypeError(f"{name}: dtype must be bool or floating, got {mask.dtype}")
    return mask.astype(np.float64)


def _mask(num_heads, seq_len, is_causal, attn_mask, key_padding_mask):
    """(num_heads, L, S) additive mask combining the causal rule, attn_mask and key_padding_mask."""
    mask = np.zeros((num_heads, seq_len, seq_len))
    valid = is_causal is False or is_causal is True or is_causal in ("upper_left", "lower_right")
    if not valid:
        raise ValueError(f"is_causal: must be False, True, 'upper_left' or 'lower_right', got {is_causal!r}")
    if is_causal is not False:  # for self-attention (L == S) both alignments are the same
        i, j = np.indices((seq_len, seq_len))
        mask[:, j > i] = -np.inf
    if attn_mask is not None:
        added = _additive(attn_mask, "attn_mask")
        if added.shape not in ((seq_len, seq_len), (num_heads, seq_len, seq_len)):
            expected = f"({seq_len}, {seq_len}) or ({num_heads}, {seq_len}, {seq_len})"
            raise ValueError(f"attn_mask: expected shape {expected}, got {added.shape}")
        mask = mask + added
    if key_padding_mask is not None:
        added = _additive(key_padding_mask, "key_padding_mask")
        if added.shape != (seq_len,):
            raise ValueError(f"key_padding_mask: expected shape ({seq_len},), got {added.shape}")
        mask = mask + added[None, None, :]
    return mask


def _softmax_allowed(masked_scores, allowed):
    """Row softmax over the allowed entries only; forbidden entries and fully masked rows are 0."""
    weights = np.zeros_like(masked_scores)
    for i in range(masked_scores.shape[0]):
        keys = allowed[i]
        if keys.any():
            row = masked_scores[i, keys]
            exps = np.exp(row - row.max())  # subtracting the max changes nothing but avoids overflow
            weights[i, keys] = exps / exps.sum()
    return weights


def _mix_values(weights, allowed, v):
    """output[i] = sum over allowed keys j of weights[i, j] * v[j] (forbidden V rows never read)."""
    output = np.zeros((weights.shape[0], v.shape[1]))
    for i in range(weights.shape[0]):
        keys = allowed[i]
        output[i] = weights[i, keys] @ v[keys]
    return output


def _explain_one(x, weights, num_heads, tokens, is_causal, attn_mask, key_padding_mask):
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs propagate as the math says, quietly
        return _steps(x, weights, num_heads, tokens, is_causal, attn_mask, key_padding_mask)


def _steps(x, weights, num_heads, tokens, is_causal, attn_mask, key_padding_mask):
    seq_len, embed_dim = x.shape
    params, num_kv_heads = _projections(weights, embed_dim, num_heads)
    head_dim = embed_dim // num_heads
    scale = 1.0 / math.sqrt(head_dim)
    if tokens is None:
        tokens = [f"t{i}" for i in range(seq_len)]
    tokens = [str(t) for t in tokens]  # a str is one token per character (handy for CJK)
    if len(tokens) != seq_len:
        raise ValueError(f"tokens: expected {seq_len} tokens, got {len(tokens)}")

    q = x @ params["q_weight"].T + params["q_bias"]
    k = x @ params["k_weight"].T + params["k_bias"]
    v = x @ params["v_weight"].T + params["v_bias"]
    mask = _mask(num_heads, seq_len, is_causal, attn_mask, key_padding_mask)
    allowed = mask != -np.inf

    heads = []
    group = num_heads // num_kv_heads
    for h in range(num_heads):
        g = h // group  # query head h reads kv head h // group
        q_h = q[:, h * head_dim : (h + 1) * head_dim]
        k_h = k[:, g * head_dim : (g + 1) * head_dim]
        v_h = v[:, g * head_dim : (g + 1) * head_dim]
        scores = q_h @ k_h.T
        scaled = scores * scale
        # Forbidden entries are set to -inf, not computed as score + (-inf): a score of +inf would give NaN.
        masked = np.where(allowed[h], scaled + np.where(allowed[h], mask[h], 0.0), -np.inf)
        weights_h = _softmax_allowed(masked, allowed[h])
        output_h = _mix_values(weights_h, allowed[h], v_h)
        heads.append(HeadSteps(h, g, q_h, k_h, v_h, scores, scaled, masked, weights_h, output_h))

    concat = np.concatenate([head.output for head in heads], axis=1)
    output = concat @ params["out_weight"].T + params["out_bias"]
    return Explanation(
        tokens, x, num_heads, num_kv_heads, head_dim, scale, is_causal, mask, q, k, v, heads, concat, output, params
    )


def explain(
    x,
    layer_or_weights,
    *,
    num_heads=None,
    tokens=None,
    is_causal=False,
    attn_mask=None,
    key_padding_mask=None,
    batch_first=True,
):
    """Self-attention of ``x`` through a multi-head attention layer, every intermediate kept.

    Parameters
    ----------
    x : array_like, shape (L, E) or (B, L, E) [batch_first=False: (L, B, E)]
        Token embeddings (any float dtype; computed in float64).
    layer_or_weights : pyattn.MultiHeadAttention, torch.nn.MultiheadAttention or dict
        The layer, or its weights under torch ``state_dict`` names (``in_proj_weight``,
        ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``, or ``q_proj_weight``, ...) and
        optionally ``num_heads``. Fewer K/V outputs than E means grouped-query attention.
    num_heads : int, optional
        Defaults to the layer's; required for a dict without a ``num_heads`` entry.
    tokens : sequence of str or str, optional
        Labels for the L positions (a str counts one token per character); default ``t0, t1, ...``.
        For batched ``x``, one list shared by all, or a list of lists.
    is_causal, attn_mask, key_padding_mask
        As in :func:`pyattn.mha`: ``attn_mask`` (L, S) or (num_heads, L, S) [batched: (B*num_heads,
        L, S)], bool True = not allowed, float added; ``key_padding_mask`` (S,) [batched: (B, S)],
        bool True = padding, float added.
    batch_first : bool
        How a 3-D ``x`` is laid out: (B, L, E) (True, the default) or (L, B, E) (False, as a layer
        built with ``batch_first=False`` takes it; the layer's own setting is not consulted, since
        torch's default differs from pyattn's). The masks keep their shapes either way.

    Returns
    -------
    Explanation
        For (B, L, E) input, a list of B explanations.
    """
    weights, layer_heads = _read_layer(layer_or_weights)
    if num_heads is None:
        num_heads = layer_heads
    if num_heads is None:
        raise ValueError("num_heads: required for a dict of weights without a 'num_heads' entry")
    if layer_heads is not None and layer_heads != num_heads:
        raise ValueError(f"num_heads: {num_heads} differs from the layer's {layer_heads}")
    check_batch_first(batch_first)
    x = _as_float64(x, "x")
    if x.ndim == 3 and not batch_first:
        x = x.swapaxes(0, 1)
    # NumPy arrays (a masked one refused) before the batched path below slices them.
    attn_mask = None if attn_mask is None else as_array(attn_mask, "attn_mask")
    key_padding_mask = None if key_padding_mask is None else as_array(key_padding_mask, "key_padding_mask")
    if x.ndim == 2:
        return _explain_one(x, weights, num_heads, tokens, is_causal, attn_mask, key_padding_mask)
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (L, E) or {'(B, L, E)' if batch_first else '(L, B, E)'}, got {x.shape}")
    batch = x.shape[0]
    per_batch_tokens = tokens is not None and len(tokens) == batch and all(isinstance(t, (list, tuple)) for t in tokens)
    results = []
    for b in range(batch):
        mask_b = attn_mask
        if attn_mask is not None and np.ndim(attn_mask) == 3:
            if np.shape(attn_mask)[0] != batch * num_heads:
                rows = batch * num_heads
                raise ValueError(f"attn_mask: a 3-D mask needs B*num_heads = {rows} rows, got {np.shape(attn_mask)}")
            mask_b = np.asarray(attn_mask)[b * num_heads : (b + 1) * num_heads]
        padding_b = None if key_padding_mask is None else np.asarray(key_padding_mask)[b]
        tokens_b = tokens[b] if per_batch_tokens else tokens
        results.append(_explain_one(x[b], weights, num_heads, tokens_b, is_causal, mask_b, padding_b))
    return results


def main(argv=None):
    """``python -m pyattn explain [options]``: the step-by-step demo (see ``_explain_demo``)."""
    from ._explain_demo import main as demo_main  # imported late: the demo itself imports explain

    return demo_main(argv)
