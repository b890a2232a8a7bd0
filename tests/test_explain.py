# SPDX-License-Identifier: MIT
"""Explain mode: every intermediate against an independent computation, the final output against
pyattn.mha (and torch), text alignment with CJK tokens, the demo CLI and the heatmaps."""

import os
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn._explain import explain, render_text
from pyattn._explain_render import format_table

from conftest import tol

F64 = dict(zip(("rtol", "atol"), tol(np.float64)))  # explain computes in float64

CJK_TOKENS = ["我", "用", "毒", "毒", "毒", "蛇"]


def random_layer(rng, embed_dim=8, num_heads=2, num_kv_heads=None, separate=False, bias=True):
    """A state dict with torch names (plus num_heads); K/V sized for num_kv_heads (grouped-query)."""
    kv_dim = embed_dim // num_heads * (num_kv_heads or num_heads)
    w = {"num_heads": num_heads}
    if separate:
        w["q_proj_weight"] = rng.standard_normal((embed_dim, embed_dim))
        w["k_proj_weight"] = rng.standard_normal((kv_dim, embed_dim))
        w["v_proj_weight"] = rng.standard_normal((kv_dim, embed_dim))
    else:
        w["in_proj_weight"] = rng.standard_normal((embed_dim + 2 * kv_dim, embed_dim))
    w["out_proj.weight"] = rng.standard_normal((embed_dim, embed_dim))
    if bias:
        w["in_proj_bias"] = rng.standard_normal(embed_dim + 2 * kv_dim)
        w["out_proj.bias"] = rng.standard_normal(embed_dim)
    return w


def split_projections(w, embed_dim):
    """(wq, wk, wv, bq, bk, bv) from a state dict, written independently of _explain."""
    if "in_proj_weight" in w:
        wq, wk, wv = np.split(w["in_proj_weight"], [embed_dim, embed_dim + (len(w["in_proj_weight"]) - embed_dim) // 2])
    else:
        wq, wk, wv = w["q_proj_weight"], w["k_proj_weight"], w["v_proj_weight"]
    b = w.get("in_proj_bias", np.zeros(len(wq) + len(wk) + len(wv)))
    bq, bk, bv = np.split(b, [len(wq), len(wq) + len(wk)])
    return wq, wk, wv, bq, bk, bv


def mha_kwargs(w):
    """pyattn.mha keyword arguments for a state dict."""
    names = {"out_proj.weight": "out_proj_weight", "out_proj.bias": "out_proj_bias"}
    return {names.get(k, k): v for k, v in w.items()}


MASK_CASES = ["none", "causal", "bool_attn", "float_attn_per_head", "padding", "float_padding_causal"]


def make_masks(rng, case, seq_len, num_heads):
    """(is_causal, attn_mask, key_padding_mask) in mha's conventions; every row keeps key 0."""
    if case == "none":
        return False, None, None
    if case == "causal":
        return True, None, None
    if case == "bool_attn":
        mask = rng.random((seq_len, seq_len)) < 0.4  # True = not allowed
        mask[:, 0] = False
        return False, mask, None
    if case == "float_attn_per_head":
        mask = rng.standard_normal((num_heads, seq_len, seq_len))
        mask[rng.random(mask.shape) < 0.3] = -np.inf
        mask[..., 0] = 0.0
        return False, mask, None
    if case == "padding":
        return False, None, np.arange(seq_len) >= seq_len - 2  # last two keys are padding
    padding = np.where(np.arange(seq_len) == seq_len - 1, -np.inf, rng.standard_normal(seq_len))
    padding[0] = 0.0
    return True, None, padding


@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("num_kv_heads, separate", [(None, False), (1, False), (2, True)])
def test_intermediates_match_independent_computation(rng, case, num_kv_heads, separate):
    embed_dim, num_heads, seq_len = 8, 4, 7
    head_dim = embed_dim // num_heads
    w = random_layer(rng, embed_dim, num_heads, num_kv_heads, separate)
    x = rng.standard_normal((seq_len, embed_dim))
    is_causal, attn_mask, padding = make_masks(rng, case, seq_len, num_heads)
    ex = explain(x, w, is_causal=is_causal, attn_mask=attn_mask, key_padding_mask=padding)

    wq, wk, wv, bq, bk, bv = split_projections(w, embed_dim)
    q = np.einsum("le,fe->lf", x, wq) + bq
    k = np.einsum("le,fe->lf", x, wk) + bk
    v = np.einsum("le,fe->lf", x, wv) + bv
    np.testing.assert_allclose(ex.q, q, **F64)
    np.testing.assert_allclose(ex.k, k, **F64)
    np.testing.assert_allclose(ex.v, v, **F64)
    assert ex.scale == 1 / np.sqrt(head_dim)

    # The mask in SDPA terms: bool True = may attend, float -inf = forbidden, other floats added.
    additive = np.zeros((num_heads, seq_len, seq_len))
    if is_causal:
        additive += np.triu(np.full((seq_len, seq_len), -np.inf), k=1)
    if attn_mask is not None:
        additive = additive + (np.where(attn_mask, -np.inf, 0.0) if attn_mask.dtype == bool else attn_mask)
    if padding is not None:
        additive = additive + (np.where(padding, -np.inf, 0.0) if padding.dtype == bool else padding)
    np.testing.assert_array_equal(ex.mask, additive)

    group = num_heads // (num_kv_heads or num_heads)
    q_heads = q.reshape(seq_len, num_heads, head_dim).transpose(1, 0, 2)
    k_heads = np.repeat(k.reshape(seq_len, -1, head_dim).transpose(1, 0, 2), group, axis=0)
    v_heads = np.repeat(v.reshape(seq_len, -1, head_dim).transpose(1, 0, 2), group, axis=0)
    ref_out, ref_weights = reference.scaled_dot_product_attention(
        q_heads, k_heads, v_heads, np.where(np.isfinite(additive), additive, -np.inf), return_weights=True
    )
    for h, head in enumerate(ex.heads):
        assert head.kv_head == h // group
        scores = np.einsum("id,jd->ij", q_heads[h], k_heads[h])
        np.testing.assert_allclose(head.scores, scores, **F64)
        np.testing.assert_allclose(head.scaled_scores, scores * ex.scale, **F64)
        expected_masked = np.where(additive[h] == -np.inf, -np.inf, scores * ex.scale + additive[h])
        np.testing.assert_allclose(head.masked_scores, expected_masked, **F64)
        np.testing.assert_allclose(head.weights, ref_weights[h], **F64)
        np.testing.assert_allclose(head.output, ref_out[h], **F64)
    concat = ref_out.transpose(1, 0, 2).reshape(seq_len, embed_dim)
    np.testing.assert_allclose(ex.concat, concat, **F64)
    expected = np.einsum("le,fe->lf", concat, w["out_proj.weight"]) + w["out_proj.bias"]
    np.testing.assert_allclose(ex.output, expected, **F64)


def test_causal_weights_exactly_zero_above_diagonal_rows_sum_to_one(rng):
    w = random_layer(rng)
    ex = explain(rng.standard_normal((9, 8)), w, is_causal=True)
    above = np.triu(np.ones((9, 9), dtype=bool), k=1)
    assert np.all(ex.weights[:, above] == 0.0)
    assert np.all(ex.weights[:, ~above] > 0.0)
    np.testing.assert_allclose(ex.weights.sum(-1), 1.0, rtol=0, atol=F64["atol"])
    assert np.all(ex.heads[0].masked_scores[above] == -np.inf)


def test_fully_masked_row_gives_zero_weights_and_bias_output(rng):
    w = random_layer(rng)
    attn_mask = np.zeros((5, 5), dtype=bool)
    attn_mask[2] = True  # query 2 may attend nothing
    x = rng.standard_normal((5, 8))
    x[4] = np.nan  # a padding key for every query, so its NaN K/V must not leak into rows 0, 1, 3
    padding = np.arange(5) == 4
    ex = explain(x, w, attn_mask=attn_mask, key_padding_mask=padding)
    assert np.all(ex.weights[:, 2] == 0.0)
    assert np.all(ex.concat[2] == 0.0)
    np.testing.assert_array_equal(ex.output[2], w["out_proj.bias"])
    np.testing.assert_allclose(ex.weights[:, [0, 1, 3]].sum(-1), 1.0, rtol=0, atol=F64["atol"])
    assert np.all(np.isfinite(ex.output[[0, 1, 3]]))  # (query 4 itself is NaN and so is its row)


def test_identical_tokens_identical_without_mask_different_with_causal():
    x = np.array([[1.0, 0.0, 0.5], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3]])
    w = {"in_proj_weight": np.vstack([np.eye(3), 2 * np.eye(3), np.eye(3)]), "out_proj.weight": np.eye(3)}
    free = explain(x, w, num_heads=1)
    assert np.array_equal(free.output[1], free.output[2]) and np.array_equal(free.output[2], free.output[3])
    causal = explain(x, w, num_heads=1, is_causal=True)
    assert not np.allclose(causal.output[1], causal.output[2])
    assert "identical outputs" in free.to_text()
    assert "different outputs" in causal.to_text()


def test_layer_forms_agree(rng):
    w = random_layer(rng, bias=False)
    x = rng.standard_normal((4, 8))
    base = explain(x, w)
    renamed = {k.replace("out_proj.", "out_proj_"): v for k, v in w.items() if k != "num_heads"}
    np.testing.assert_array_equal(explain(x, renamed, num_heads=2).output, base.output)
    with pytest.raises(ValueError, match="num_heads"):
        explain(x, renamed)
    with pytest.raises(ValueError, match="num_heads"):
        explain(x, w, num_heads=4)
    with pytest.raises(ValueError, match="unsupported keys"):
        explain(x, {**w, "bias_k": np.zeros(8)})
    with pytest.raises(TypeError, match="layer_or_weights"):
        explain(x, object(), num_heads=2)
    with pytest.raises(TypeError, match="attn_mask"):
        explain(x, w, attn_mask=np.zeros((4, 4), dtype=np.int32))


def test_masked_arrays_are_refused(rng):
    # Their masks would be dropped by np.asarray: a masked padding flag read as "not padding".
    w = random_layer(rng, bias=False)
    x = rng.standard_normal((2, 4, 8))
    some = np.zeros((2, 4), bool)
    some[0, -1] = True
    for name, kwargs in [
        ("x", {"x": np.ma.masked_array(x, mask=np.zeros(x.shape, bool))}),
        ("out_proj.weight", {"layer_or_weights": {**w, "out_proj.weight": np.ma.masked_array(w["out_proj.weight"])}}),
        ("attn_mask", {"attn_mask": np.ma.masked_array(np.zeros((4, 4), bool))}),
        ("key_padding_mask", {"key_padding_mask": np.ma.masked_array(np.zeros((2, 4), bool), mask=some)}),
    ]:
        args = {"x": x, "layer_or_weights": w, **kwargs}
        with pytest.raises(TypeError, match=rf"^{name}: masked arrays"):
            explain(args.pop("x"), args.pop("layer_or_weights"), **args)


def test_batched_input_gives_one_explanation_per_item(rng):
    w = random_layer(rng)
    x = rng.standard_normal((3, 5, 8))
    padding = np.zeros((3, 5), dtype=bool)
    padding[1, 3:] = True
    attn_mask = rng.standard_normal((3 * 2, 5, 5))
    batch = explain(x, w, key_padding_mask=padding, attn_mask=attn_mask, tokens="abcde", is_causal=True)
    assert len(batch) == 3
    for b, ex in enumerate(batch):
        single = explain(x[b], w, key_padding_mask=padding[b], attn_mask=attn_mask[2 * b : 2 * b + 2], is_causal=True)
        np.testing.assert_array_equal(ex.output, single.output)
        assert ex.tokens == list("abcde")


def test_sequence_first_input_with_batch_first_false(rng):
    # A (L, B, E) input, as a layer built with batch_first=False takes it, explains as its (B, L, E)
    # transpose does; batch_first must be a bool, and 2-D input ignores it.
    w = random_layer(rng)
    x = rng.standard_normal((3, 5, 8))
    padding = np.zeros((3, 5), dtype=bool)
    padding[2, 4:] = True
    batch = explain(x, w, key_padding_mask=padding, is_causal=True)
    seq_first = explain(x.swapaxes(0, 1), w, key_padding_mask=padding, is_causal=True, batch_first=False)
    assert len(seq_first) == 3
    for a, b in zip(batch, seq_first):
        np.testing.assert_array_equal(a.output, b.output)
        np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(explain(x[0], w, batch_first=False).output, explain(x[0], w).output)
    with pytest.raises(TypeError, match="batch_first"):
        explain(x, w, batch_first=0)
    with pytest.raises(ValueError, match=r"\(L, B, E\)"):
        explain(x[None], w, batch_first=False)


def _mha_available():
    return hasattr(pyattn, "mha")


@pytest.mark.skipif(not _mha_available(), reason="pyattn.mha is not implemented yet (issue: multi-head attention)")
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("num_kv_heads, separate", [(None, False), (1, False), (2, True)])
def test_output_matches_pyattn_mha(rng, case, num_kv_heads, separate):
    embed_dim, num_heads, seq_len = 8, 4, 7
    w = random_layer(rng, embed_dim, num_heads, num_kv_heads, separate)
    x = rng.standard_normal((seq_len, embed_dim))
    is_causal, attn_mask, padding = make_masks(rng, case, seq_len, num_heads)
    ex = explain(x, w, is_causal=is_causal, attn_mask=attn_mask, key_padding_mask=padding)
    kwargs = mha_kwargs(w)
    kwargs["num_kv_heads"] = num_kv_heads
    out, weights = pyattn.mha(
        x, is_causal=is_causal, attn_mask=attn_mask, key_padding_mask=padding,
        need_weights=True, average_attn_weights=False, **kwargs,
    )  # fmt: skip
    rtol, atol = tol(np.float64)
    np.testing.assert_allclose(out, ex.output, rtol=rtol, atol=atol)
    np.testing.assert_allclose(weights, ex.weights, rtol=rtol, atol=atol)


@pytest.mark.skipif(not _mha_available(), reason="pyattn.mha is not implemented yet (issue: multi-head attention)")
def test_batched_output_matches_pyattn_mha_and_layer_object(rng):
    w = random_layer(rng)
    x = rng.standard_normal((2, 6, 8))
    padding = np.zeros((2, 6), dtype=bool)
    padding[0, 4:] = True
    out = pyattn.mha(x, key_padding_mask=padding, is_causal=True, **mha_kwargs(w))
    batch = explain(x, w, key_padding_mask=padding, is_causal=True)
    rtol, atol = tol(np.float64)
    np.testing.assert_allclose(out, np.stack([ex.output for ex in batch]), rtol=rtol, atol=atol)
    if hasattr(pyattn, "MultiHeadAttention"):
        layer = pyattn.MultiHeadAttention(8, 2, num_kv_heads=1, dtype=np.float64, seed=3)
        np.testing.assert_allclose(
            layer(x[0], is_causal=True), explain(x[0], layer, is_causal=True).output, rtol=rtol, atol=atol
        )


def test_output_matches_torch_multihead_attention(rng):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    x = rng.standard_normal((1, 6, 8))
    padding = np.arange(6)[None] >= 5
    with torch.no_grad():
        out, weights = module(
            *(torch.from_numpy(x),) * 3,
            key_padding_mask=torch.from_numpy(padding),
            attn_mask=torch.triu(torch.ones(6, 6, dtype=torch.bool), 1),
            average_attn_weights=False,
        )
    (ex,) = explain(x, module, key_padding_mask=padding, is_causal=True)
    np.testing.assert_allclose(ex.output, out[0].numpy(), **F64)
    np.testing.assert_allclose(ex.weights, weights[0].numpy(), **F64)


def width(text):
    """Display columns, computed here independently: East Asian Wide/Fullwidth count 2."""
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def cell_right_edges(line, num_cells):
    """Display column where each of the last num_cells space-free cells of a line ends."""
    edges, column, in_cell = [], 0, False
    for c in line:
        column += width(c)
        if c != " ":
            in_cell = True
        elif in_cell:
            edges.append(column - 1)
            in_cell = False
    if in_cell:
        edges.append(column)
    return edges[-num_cells:]


@pytest.mark.parametrize("tokens", [CJK_TOKENS, ["我", "cat", "毒蛇", "ｆｕｌｌ", "é", "x"]], ids=["cjk", "mixed"])
def test_weight_table_columns_align_by_display_width(rng, tokens):
    seq_len = len(tokens)
    ex = explain(rng.standard_normal((seq_len, 8)), random_layer(rng), tokens=tokens, is_causal=True)
    text = render_text(ex, steps=False)
    lines = text.splitlines()
    for h in range(2):
        start = lines.index(f"head {h}: softmax weights (%), row = query, column = key") + 1
        table = lines[start : start + seq_len + 1]
        assert table[0].split()[-seq_len:] == tokens
        edges = [cell_right_edges(line, seq_len) for line in table]
        assert all(e == edges[0] for e in edges), "\n".join(table)
        assert len({width(line) for line in table}) == 1
        # Row labels are left-aligned: the first cell starts at the same column on every data row.
        assert all(line.startswith(f"  {i} {tokens[i]}") for i, line in enumerate(table[1:]))


def test_format_table_pads_wide_characters():
    lines = format_table(["蛇", "snake"], ["毒", "x"], [["1", "22"], ["333", "4"]])
    assert lines == ["        毒   x", "蛇       1  22", "snake  333   4"]
    assert [width(line) for line in lines] == [14, 14, 14]


def test_full_walkthrough_lists_steps_in_order(rng):
    ex = explain(rng.standard_normal((6, 8)), random_layer(rng), tokens=CJK_TOKENS, is_causal=True)
    text = ex.to_text()
    titles = [line.split(". ", 1)[1] for line in text.splitlines() if line.startswith("Step ")]
    per_head = ["raw scores", "scaled scores", "mask,", "masked scores", "softmax weights", "values"]
    expected = ["Embedding", "Keys", "Queries"]
    expected += [f"Head {h}: {step}" for h in range(2) for step in per_head] + ["Concatenation", "Output projection"]
    assert len(titles) == len(expected)
    assert all(title.startswith(start) for title, start in zip(titles, expected)), titles
    assert "-inf" in text


def run_demo(*args, cwd):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "pyattn", "explain", *args],
        check=False, capture_output=True, text=True, encoding="utf-8", cwd=cwd, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("args", [(), ("--causal",), ("--no-causal",)], ids=["both", "causal", "no-causal"])
def test_demo_runs(tmp_path, args):
    result = run_demo(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Step 8. Softmax weights" in result.stdout
    assert "毒" in result.stdout and "1/√3" in result.stdout
    if not args:
        assert "Without a mask their outputs are identical" in result.stdout
        assert "With the causal mask they see 3, 4, 5 tokens" in result.stdout


def test_demo_with_own_tokens_and_weights(tmp_path, rng):
    w = random_layer(rng, embed_dim=6, num_heads=3)
    np.savez(tmp_path / "layer.npz", **w)
    result = run_demo("--tokens", "the cat sat on the mat", "--weights", "layer.npz", "--causal", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "3 heads of d = 2" in result.stdout and "Positions 0 the, 4 the" in result.stdout
    assert run_demo("--bogus", cwd=tmp_path).returncode == 2


def test_plot_heatmaps_writes_png(tmp_path, rng):
    pytest.importorskip("matplotlib")
    ex = explain(rng.standard_normal((6, 8)), random_layer(rng), tokens=CJK_TOKENS, is_causal=True)
    path = ex.plot(tmp_path / "heads.png")  # CJK labels: no warning may escape (filterwarnings=error)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run_demo("--plot", "demo.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path, rng, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    ex = explain(rng.standard_normal((3, 8)), random_layer(rng))
    with pytest.raises(ImportError, match=r"pyattn\[plot\]"):
        ex.plot(tmp_path / "x.png")
