# SPDX-License-Identifier: MIT
"""Rendering of an :class:`pyattn._explain.Explanation`: aligned text tables and matplotlib heatmaps.

Text tables are aligned by terminal display width, not by ``len``: East Asian wide and fullwidth
characters (CJK) take two columns, combining marks none (``unicodedata.east_asian_width``), so a
table of Chinese tokens lines up as well as one of English words. matplotlib is optional and
imported only inside :func:`plot_heatmaps`.
"""

from __future__ import annotations

import logging
import subprocess
import textwrap
import unicodedata
import warnings

import numpy as np

__all__ = ["display_width", "format_table", "plot_heatmaps", "render_text"]


def display_width(text):
    """Terminal columns taken by `text`: wide/fullwidth characters count 2, combining marks 0."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _pad(text, width, left=False):
    gap = " " * max(width - display_width(text), 0)
    return text + gap if left else gap + text


def format_table(row_labels, col_labels, cells, corner=""):
    """Table lines: row labels left-aligned, each cell right-aligned under its column label."""
    columns = [[corner, *row_labels]]
    columns += [[col_labels[j], *(row[j] for row in cells)] for j in range(len(col_labels))]
    widths = [max(display_width(text) for text in column) for column in columns]
    lines = []
    for r in range(len(row_labels) + 1):
        parts = [_pad(columns[0][r], widths[0], left=True)]
        parts += [_pad(columns[c][r], widths[c]) for c in range(1, len(columns))]
        lines.append("  ".join(parts).rstrip())
    return lines


def _number(value, digits):
    if np.isnan(value):
        return "nan"
    if np.isinf(value):
        return "-inf" if value < 0 else "inf"
    text = f"{value:.{digits}f}"
    return f"{0.0:.{digits}f}" if float(text) == 0 else text  # no "-0.000"


def _matrix(values, row_labels, col_labels, digits, corner=""):
    cells = [[_number(value, digits) for value in row] for row in values]
    return format_table(row_labels, col_labels, cells, corner)


def _mask_table(mask, row_labels, col_labels, digits):
    """The additive mask: 0 (allowed as is), -inf (forbidden) or the float added."""
    cells = [["0" if value == 0 else _number(value, digits) for value in row] for row in mask]
    return format_table(row_labels, col_labels, cells)


def _percentages(weights, allowed, row_labels, col_labels):
    """Weights as percentages with one decimal; forbidden entries shown as '-'."""
    cells = [[f"{100 * w:.1f}" if ok else "-" for w, ok in zip(row, ok_row)] for row, ok_row in zip(weights, allowed)]
    return format_table(row_labels, col_labels, cells, corner="query \\ key")


def _mask_name(ex):
    parts = []
    if ex.is_causal is not False:
        parts.append("causal (query i sees keys 0..i)")
    custom = ex.mask.copy()
    if ex.is_causal is not False:
        i, j = np.indices(custom.shape[1:])
        custom[:, j > i] = 0.0
    if np.any(custom != 0):
        parts.append("attn_mask/key_padding_mask")
    return " + ".join(parts) if parts else "none (every query sees every key)"


def _dim_labels(num_heads, head_dim):
    if num_heads == 1:
        return [f"d{d}" for d in range(head_dim)]
    return [f"h{h}.{d}" for h in range(num_heads) for d in range(head_dim)]


def identical_token_notes(ex):
    """Sentences about positions whose embeddings are identical: do their outputs differ, and why."""
    groups = {}
    for i, row in enumerate(ex.x):
        groups.setdefault(row.tobytes(), []).append(i)
    notes = []
    for positions in (p for p in groups.values() if len(p) > 1):
        names = ", ".join(f"{i} {ex.tokens[i]}" for i in positions)
        spread = float(np.max(np.abs(ex.output[positions] - ex.output[positions[0]])))
        seen = [int(ex.allowed[0, i].sum()) for i in positions]
        same_mask = all(np.array_equal(ex.mask[:, i], ex.mask[:, positions[0]]) for i in positions)
        if spread == 0:
            why = "they see the same keys with the same mask, so every step computes the same numbers"
            if not same_mask:
                why = "their masks differ, but not in a way that changes their weighted mixes"
            notes.append(f"Positions {names} have identical embeddings and identical outputs: {why}.")
        elif not same_mask:
            notes.append(
                f"Positions {names} have identical embeddings but different outputs (they differ by up to "
                f"{spread:.3f}): the mask gives them different keys to look at ({', '.join(map(str, seen))} "
                "allowed keys respectively), so each mixes a different set of values."
            )
        else:
            notes.append(
                f"Positions {names} have identical embeddings and masks; outputs differ by {spread:.1e} (rounding)."
            )
    return notes


def render_text(ex, *, steps=True, digits=3, feature_names=None):
    """The explanation as text: every step in order (steps=True) or only the weight tables.

    Parameters
    ----------
    ex : Explanation
    steps : bool
        True: embedding, keys, queries, then per head raw/scaled scores, mask, masked scores, softmax
        weights and value mix, then concatenation and output projection. False: per head the
        softmax weights as percentages.
    digits : int
        Decimals of the numbers (weights are always percentages with one decimal).
    feature_names : sequence of str, optional
        Column labels of the embedding (default e0, e1, ...).
    """
    seq_len, embed_dim = ex.x.shape
    rows = [f"{i} {token}" for i, token in enumerate(ex.tokens)]
    cols = list(ex.tokens)
    heads = f"{ex.num_heads} head{'s' if ex.num_heads > 1 else ''}"
    if ex.num_kv_heads != ex.num_heads:
        heads += f" sharing {ex.num_kv_heads} key/value head{'s' if ex.num_kv_heads > 1 else ''}"
    out = [
        f"Self-attention over {seq_len} tokens: {' '.join(ex.tokens)}",
        f"E = {embed_dim} features, {heads} of d = {ex.head_dim} (scale 1/√{ex.head_dim} = {ex.scale:.{digits}f}), "
        + f"mask: {_mask_name(ex)}",
    ]
    step = 0

    def section(title, lines):
        nonlocal step
        step += 1
        out.extend(["", f"Step {step}. {title[0].upper()}{title[1:]}", *("  " + line for line in lines)])

    def head_title(h, text):
        return f"head {h}: {text}" if ex.num_heads > 1 else text

    if not steps:
        for h, head in enumerate(ex.heads):
            out.extend(["", head_title(h, "softmax weights (%), row = query, column = key")])
            out.extend("  " + line for line in _percentages(head.weights, ex.allowed[h], rows, cols))
        return "\n".join(out)

    features = list(feature_names) if feature_names is not None else [f"e{e}" for e in range(embed_dim)]
    section("Embedding x: one row per token", _matrix(ex.x, rows, features, digits))
    kv_labels = _dim_labels(ex.num_kv_heads, ex.head_dim)
    section("Keys K = x·Wkᵀ + bk: what each token offers to be found by", _matrix(ex.k, rows, kv_labels, digits))
    q_labels = _dim_labels(ex.num_heads, ex.head_dim)
    section("Queries Q = x·Wqᵀ + bq: what each token looks for", _matrix(ex.q, rows, q_labels, digits))
    for h, head in enumerate(ex.heads):
        kv = f" (reads key/value head {head.kv_head})" if ex.num_kv_heads != ex.num_heads else ""
        section(
            head_title(h, f"raw scores Q·Kᵀ{kv}, row = query, column = key"), _matrix(head.scores, rows, cols, digits)
        )
        section(
            head_title(h, f"scaled scores: raw × 1/√{ex.head_dim} = × {ex.scale:.{digits}f}"),
            _matrix(head.scaled_scores, rows, cols, digits),
        )
        section(
            head_title(h, "mask, added to the scaled scores (-inf = forbidden)"),
            _mask_table(ex.mask[h], rows, cols, digits),
        )
        section(head_title(h, "masked scores"), _matrix(head.masked_scores, rows, cols, digits))
        section(
            head_title(h, "softmax weights (%): exp(score - row max), normalised; each row sums to 100"),
            _percentages(head.weights, ex.allowed[h], rows, cols),
        )
        value_labels = [f"d{d}" for d in range(ex.head_dim)]
        section(
            head_title(h, "values V = x·Wvᵀ + bv, mixed by the weights: head output = weights·V"),
            [
                "V:",
                *_matrix(head.v, rows, value_labels, digits),
                "weights·V:",
                *_matrix(head.output, rows, value_labels, digits),
            ],
        )
    concat_title = "concatenation of the head outputs, side by side"
    if ex.num_heads == 1:
        concat_title = "concatenation of the head outputs (one head: its output as it is)"
    section(concat_title, _matrix(ex.concat, rows, q_labels, digits))
    section(
        "output projection: output = concat·Woᵀ + bo",
        _matrix(ex.output, rows, [f"o{e}" for e in range(embed_dim)], digits),
    )
    notes = identical_token_notes(ex)
    if notes:
        out.extend(["", "Identical tokens:"])
        out.extend(textwrap.fill(note, width=100, initial_indent="  ", subsequent_indent="    ") for note in notes)
    return "\n".join(out)


def _cjk_font_family():
    """Family name of an installed font with Chinese glyphs (asked to fontconfig), or None."""
    try:
        command = ["fc-list", ":lang=zh", "file"]
        listing = subprocess.run(command, check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    from matplotlib import font_manager

    for line in sorted(listing.splitlines()):
        path = line.split(":")[0].strip()
        try:
            font_manager.fontManager.addfont(path)
            return font_manager.FontProperties(fname=path).get_name()
        except (OSError, RuntimeError, ValueError):  # a font matplotlib cannot read: try the next one
            pass
    return None


def plot_heatmaps(explanations, path, *, titles=None, dpi=150):
    """Save heatmaps of the softmax weights: one subplot per head, one row per explanation.

    Parameters
    ----------
    explanations : Explanation or sequence of Explanation
    path : str or path-like
        Output file; the format follows the suffix (.png, .svg, .pdf).
    titles : sequence of str, optional
        One title per explanation (default: its mask).
    dpi : int
        Resolution of raster output (matplotlib's savefig dpi).

    Token labels use an installed CJK font when fontconfig finds one (e.g. Debian's fonts-noto-cjk or
    fonts-wqy-zenhei); without one, CJK labels draw as boxes and matplotlib's missing-glyph warnings
    are silenced. Needs matplotlib (``pip install "pyattn[plot]"``).
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'plot_heatmaps needs matplotlib: install the "plot" extra (pip install "pyattn[plot]") or matplotlib itself'
        ) from error
    if hasattr(explanations, "heads"):
        explanations = [explanations]
    explanations = list(explanations)
    if titles is None:
        titles = [_mask_name(ex).split(" (")[0] for ex in explanations]
    num_rows = max(ex.num_heads for ex in explanations)
    seq_len = max(len(ex.tokens) for ex in explanations)
    side = 1.5 + 0.45 * seq_len
    families = ["DejaVu Sans"]  # ships with matplotlib; CJK glyphs fall back to the next family
    font_log = logging.getLogger("matplotlib.font_manager")
    log_level = font_log.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing glyphs: never fail (or spam) the caller
        font_log.setLevel(logging.ERROR)  # "findfont: ..." notes go to logging, not warnings
        try:
            cjk = _cjk_font_family()
            if cjk:
                families.append(cjk)
            with matplotlib.rc_context({"font.family": families}):
                figure = Figure(figsize=(len(explanations) * side + 1.0, num_rows * side), layout="constrained")
                axes = figure.subplots(num_rows, len(explanations), squeeze=False)
                for c, ex in enumerate(explanations):  # one column per explanation, one row per head
                    for h in range(num_rows):
                        if h < ex.num_heads:
                            image = _draw_head(axes[h][c], ex, h, titles[c])
                        else:
                            axes[h][c].axis("off")
                figure.colorbar(image, ax=axes, label="attention weight (%)", shrink=0.8)
                figure.savefig(path, dpi=dpi)
        finally:
            font_log.setLevel(log_level)
    return path


def _draw_head(ax, ex, h, title):
    import matplotlib

    weights = 100 * ex.heads[h].weights
    forbidden = ~ex.allowed[h]
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")  # forbidden cells: grey
    image = ax.imshow(np.ma.masked_array(weights, forbidden), vmin=0, vmax=100, cmap=cmap)
    positions = range(len(ex.tokens))
    ax.set_xticks(positions, labels=ex.tokens)
    ax.set_yticks(positions, labels=[f"{i} {t}" for i, t in enumerate(ex.tokens)])
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"{title}, head {h}" if ex.num_heads > 1 else title)
    if len(ex.tokens) <= 12:  # numbers stay readable only on small maps
        for i in positions:
            for j in positions:
                if not forbidden[i, j]:
                    color = "white" if weights[i, j] < 60 else "black"
                    ax.text(j, i, f"{weights[i, j]:.0f}", ha="center", va="center", fontsize=8, color=color)
    return image
