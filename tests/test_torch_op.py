# SPDX-License-Identifier: MIT
"""pyattn.torch: the torch-tensor API, the torch.ops.pyattn.sdpa operator and sdpa_override (skipped
without torch).

- parity with torch.nn.functional.scaled_dot_product_attention (computed in float64 on the same
  values) for every dtype and on every ISA, and of pyattn's own options with pyattn.reference;
- zero copy: strided, sliced and stride-0 tensors reach the core as views of their own memory, the
  result is a fresh tensor the core writes into, the inputs are left alone;
- torch.compile(fullgraph=True) (aot_eager, and inductor once), torch.library.opcheck;
- errors naming the argument; sdpa_override's routing, fallbacks and restoring;
- fully masked rows are zeros, as in torch.

"""

import contextlib
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyattn import reference

from conftest import tol

torch = pytest.importorskip("torch")

import pyattn.torch as pt  # noqa: E402  (imports torch: only after the skip)

F = torch.nn.functional
TORCH_SDPA = F.scaled_dot_product_attention  # torch's own function, whatever a test switches later
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = list(DTYPES)
B, HQ, L, S, E = 2, 4, 5, 9, 16


def randn(rng, shape, dtype):
    """A contiguous tensor of standard-normal values rounded to `dtype` (a name)."""
    return torch.from_numpy(rng.standard_normal(shape)).to(DTYPES[dtype])


def make_qkv(rng, dtype, batch=(B,), q_heads=HQ, kv_heads=None, q_len=L, kv_len=S, head_dim=E, value_dim=None):
    """query (*batch, Hq, L, E), key (*batch, Hk, S, E), value (*batch, Hk, S, Ev); q_heads=None
    leaves out the head axis (2-D inputs when batch is () too)."""
    kv_heads = q_heads if kv_heads is None else kv_heads
    value_dim = head_dim if value_dim is None else value_dim
    batch = tuple(batch)
    q_head, kv_head = ((), ()) if q_heads is None else ((q_heads,), (kv_heads,))
    return (
        randn(rng, batch + q_head + (q_len, head_dim), dtype),
        randn(rng, batch + kv_head + (kv_len, head_dim), dtype),
        randn(rng, batch + kv_head + (kv_len, value_dim), dtype),
    )


def make_mask(rng, shape, kind, dtype, p_allowed=0.6):
    """A bool mask (True = attend) or a float mask of `dtype` (offsets, -inf where forbidden); key 0
    is allowed in every row unless the caller overrides it."""
    allowed = rng.random(shape) < p_allowed
    allowed[..., 0] = True
    if kind == "bool":
        return torch.from_numpy(allowed)
    return torch.from_numpy(np.where(allowed, rng.standard_normal(shape), -np.inf)).to(DTYPES[dtype])


def values64(t):
    """A tensor's values as a float64 NumPy array (bool stays bool); None stays None."""
    if t is None:
        return None
    t = t.detach()
    return t.numpy().copy() if t.dtype == torch.bool else t.to(torch.float64).numpy()


def torch_reference(q, k, v, attn_mask=None, **kwargs):
    """torch's own function on the same values in float64 (its semantics, no rounding error to speak of)."""
    as64 = [None if t is None else torch.from_numpy(values64(t)) for t in (q, k, v, attn_mask)]
    if attn_mask is not None and kwargs.get("is_causal"):
        # torch refuses a mask with is_causal=True (for most shapes); pyattn applies both, as torch
        # would with the causal rule folded into the mask
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = as64[3]
        as64[3] = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, -math.inf)
        kwargs = {**kwargs, "is_causal": False}
    with torch.no_grad():
        return TORCH_SDPA(*as64, **kwargs).numpy()


def pyattn_reference(q, k, v, attn_mask=None, **kwargs):
    """pyattn.reference (float64) on the values; tensor options (sinks, alibi_slopes) as values too."""
    kwargs = {name: values64(x) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
    kwargs.pop("num_threads", None)
    return reference.scaled_dot_product_attention(values64(q), values64(k), values64(v), values64(attn_mask), **kwargs)


def assert_matches(got, expected, dtype):
    """A pyattn.torch result: a CPU tensor of `dtype` (a name) within the table's tolerance of `expected`."""
    assert isinstance(got, torch.Tensor)
    assert got.dtype == DTYPES[dtype] and got.device.type == "cpu"
    assert tuple(got.shape) == expected.shape
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(values64(got), expected, rtol=rtol, atol=atol)


# -- parity with torch -----------------------------------------------------------------------------

# Mask shapes by name, for a query of length q_len (B, HQ, S fixed).
MASK_SHAPES = {
    "LS": lambda q_len: (q_len, S),
    "11LS": lambda q_len: (1, 1, q_len, S),
    "B11S": lambda q_len: (B, 1, 1, S),
    "BHLS": lambda q_len: (B, HQ, q_len, S),
}

PARITY = {
    "plain": dict(),
    "causal_short_query": dict(is_causal=True),  # L < S: torch's upper-left alignment
    "causal_long_query": dict(is_causal=True, q_len=13),
    **{f"{kind}_mask_{shape}": dict(mask=(kind, shape)) for kind in ("bool", "float") for shape in MASK_SHAPES},
    "gqa": dict(enable_gqa=True, kv_heads=2),
    "gqa_causal_float_mask": dict(enable_gqa=True, kv_heads=2, is_causal=True, q_len=S, mask=("float", "B11S")),
    "scale": dict(scale=0.3),
    "negative_scale": dict(scale=-0.7, mask=("bool", "LS")),
    "value_dim": dict(value_dim=12),
    "3d": dict(batch=()),
    "3d_gqa_causal": dict(batch=(), enable_gqa=True, kv_heads=1, is_causal=True),
    "2d": dict(batch=(), q_heads=None, value_dim=7),
    "2d_causal_mask": dict(batch=(), q_heads=None, is_causal=True, mask=("bool", "LS")),
    "5d": dict(batch=(2, 1)),
}


@pytest.mark.parametrize("case", list(PARITY))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_matches_torch(isa, rng, dtype, case):
    spec = dict(PARITY[case])
    shapes = {name: spec.pop(name) for name in ("batch", "q_heads", "kv_heads", "q_len", "value_dim") if name in spec}
    q, k, v = make_qkv(rng, dtype, **shapes)
    mask = None
    if "mask" in spec:
        kind, shape = spec.pop("mask")
        mask = make_mask(rng, MASK_SHAPES[shape](q.shape[-2]), kind, dtype)
    got = pt.scaled_dot_product_attention(q, k, v, mask, **spec)
    assert_matches(got, torch_reference(q, k, v, mask, **spec), dtype)


# pyattn's options, against pyattn.reference. Tensor options are built by name in the test.
OPTIONS = {
    "window": dict(window=(2, 1)),
    "window_left_only": dict(window=(3, None), is_causal=True),
    "window_right_only": dict(window=(None, 0)),
    "softcap": dict(softcap=1.5, scale=1.0),  # scale 1: scores around +-4, so the cap bites
    "sinks": dict(sinks=True),
    "alibi": dict(alibi_slopes=(HQ,)),
    "alibi_per_batch": dict(alibi_slopes=(B, HQ)),
    "lower_right": dict(is_causal="lower_right"),
    "lower_right_long_query": dict(is_causal="lower_right", q_len=12),  # the first 3 rows see no key
    "upper_left_string": dict(is_causal="upper_left", window=(1, None)),
    "lower_right_window_gqa": dict(is_causal="lower_right", window=(4, 0), enable_gqa=True, kv_heads=2),
    "everything": dict(
        is_causal="lower_right",
        window=(6, 0),
        softcap=3.0,
        sinks=True,
        alibi_slopes=(HQ,),
        enable_gqa=True,
        kv_heads=1,
        mask=("float", "B11S"),
        scale=0.5,
        value_dim=10,
    ),
    "everything_3d": dict(batch=(), window=(2, 2), softcap=2.0, sinks=True, alibi_slopes=(HQ,), mask=("bool", "LS")),
    "num_threads": dict(num_threads=1, mask=("bool", "BHLS")),
}


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_options_match_reference(isa, rng, dtype, case):
    spec = dict(OPTIONS[case])
    shapes = {name: spec.pop(name) for name in ("batch", "kv_heads", "q_len", "value_dim") if name in spec}
    q, k, v = make_qkv(rng, dtype, **shapes)
    mask = None
    if "mask" in spec:
        kind, shape = spec.pop("mask")
        mask = make_mask(rng, MASK_SHAPES[shape](q.shape[-2]), kind, dtype)
    if spec.get("sinks"):
        spec["sinks"] = randn(rng, (HQ,), dtype)  # the query's dtype, as a model's parameter would be
    if "alibi_slopes" in spec:
        spec["alibi_slopes"] = torch.from_numpy(rng.uniform(0.05, 0.5, spec["alibi_slopes"])).float()
    got = pt.scaled_dot_product_attention(q, k, v, mask, **spec)
    assert_matches(got, pyattn_reference(q, k, v, mask, **spec), dtype)


def test_negative_infinite_sink_is_no_sink(rng):
    q, k, v = make_qkv(rng, "float32")
    no_sink = pt.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = pt.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=torch.full((HQ,), -math.inf))
    torch.testing.assert_close(got, no_sink, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_fully_masked_rows_are_zeros(rng, dtype):
    """A query row with no allowed key is zeros, as torch returns since 2.5 (NaN before)."""
    q, k, v = make_qkv(rng, dtype, q_len=6)
    bool_mask = make_mask(rng, (B, 1, 6, S), "bool", dtype)
    bool_mask[:, :, 2] = False
    float_mask = make_mask(rng, (6, S), "float", dtype)
    float_mask[4] = -math.inf
    for mask in (bool_mask, float_mask):
        got = pt.scaled_dot_product_attention(q, k, v, mask)
        rows = (2,) if mask is bool_mask else (4,)
        assert torch.count_nonzero(got[:, :, rows]) == 0
        assert_matches(got, torch_reference(q, k, v, mask), dtype)
        if torch.__version__ >= "2.5":
            torch.testing.assert_close(TORCH_SDPA(q, k, v, mask)[:, :, rows], torch.zeros_like(got[:, :, rows]))
    # lower-right with L > S: rows 0..L-S-1 see no key; a window can empty a row as well
    q_long = randn(rng, (B, HQ, S + 3, E), dtype)
    got = pt.scaled_dot_product_attention(q_long, k, v, is_causal="lower_right")
    assert torch.count_nonzero(got[:, :, :3]) == 0 and torch.all(got[:, :, 3:].abs().sum(-1) > 0)
    assert_matches(got, pyattn_reference(q_long, k, v, is_causal="lower_right"), dtype)
    got = pt.scaled_dot_product_attention(q_long, k, v, is_causal="lower_right", window=(0, 0))  # key d(i) only
    assert torch.count_nonzero(got[:, :, :3]) == 0
    assert_matches(got, pyattn_reference(q_long, k, v, is_causal="lower_right", window=(0, 0)), dtype)
    torch.testing.assert_close(got[:, :, 3:], v, rtol=0, atol=0)


# -- zero copy -------------------------------------------------------------------------------------

COPYING_METHODS = ("contiguous", "clone", "copy_", "to", "cpu", "float", "double", "half", "bfloat16")


@contextlib.contextmanager
def no_tensor_copies():
    """Makes every torch.Tensor method that copies (or may copy) raise while the block runs."""
    with contextlib.ExitStack() as stack:
        for name in COPYING_METHODS:
            if hasattr(torch.Tensor, name):
                error = AssertionError(f"pyattn.torch called Tensor.{name}() on an input")
                stack.enter_context(mock.patch.object(torch.Tensor, name, side_effect=error))
        yield


def storage(t):
    return t.untyped_storage().data_ptr()


def assert_view_of(array, tensor):
    """The NumPy array the core received is the tensor's own memory, with the tensor's strides."""
    assert array.__array_interface__["data"][0] == tensor.data_ptr()
    assert array.shape == tuple(tensor.shape)
    assert array.strides == tuple(s * tensor.element_size() for s in tensor.stride())


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_strided_inputs_are_read_in_place(rng, dtype):
    q = randn(rng, (B, L, HQ, E), dtype).transpose(1, 2)  # a (B, L, H, E) projection viewed as (B, H, L, E)
    k = randn(rng, (B + 1, 2, S + 3, E + 4), dtype)[1:, :, 2 : 2 + S, 3 : 3 + E]  # a slice of a bigger tensor
    v = randn(rng, (1, 2, S, 12), dtype).expand(B, -1, -1, -1)  # shared across the batch: stride 0
    mask = make_mask(rng, (1, 1, 1, S), "float", dtype).expand(B, 1, L, S)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(0) == 0 and k.storage_offset() > 0
    before = [t.clone() for t in (q, k, v, mask)]
    expected = torch_reference(q, k, v, mask, is_causal=True, enable_gqa=True)

    with mock.patch.object(pt._core, "sdpa", wraps=pt._core.sdpa) as core, no_tensor_copies():
        got = pt.scaled_dot_product_attention(q, k, v, mask, is_causal=True, enable_gqa=True)

    assert core.call_count == 1
    args = core.call_args.args
    for array, tensor in zip(args[:4], (q, k, v, mask)):
        assert_view_of(array, tensor)
    assert_view_of(args[8], got)  # the core wrote the result in place
    assert_matches(got, expected, dtype)
    assert got.is_contiguous() and not got.requires_grad
    assert storage(got) not in {storage(t) for t in (q, k, v, mask)}
    for t, old in zip((q, k, v, mask), before):
        assert torch.equal(t, old)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inputs_with_a_strided_last_axis(rng, dtype):
    """A last axis that is not contiguous is copied by the core (never by pyattn.torch) and the
    result is still right; nothing the caller holds changes."""
    q = randn(rng, (B, HQ, E, L), dtype).transpose(-1, -2)
    k = randn(rng, (B, HQ, S, 2 * E), dtype)[..., ::2]
    v = randn(rng, (B, HQ, 8, S), dtype).transpose(-1, -2)
    mask = make_mask(rng, (B, 1, S, L), "bool", dtype).transpose(-1, -2)
    mask[..., 0] = True
    assert all(t.stride(-1) != 1 for t in (q, k, v, mask))
    before = [t.clone() for t in (q, k, v, mask)]
    with no_tensor_copies():
        got = pt.scaled_dot_product_attention(q, k, v, mask, scale=0.2)
    assert_matches(got, torch_reference(q, k, v, mask, scale=0.2), dtype)
    for t, old in zip((q, k, v, mask), before):
        assert torch.equal(t, old)


def strided_copy(values, order, pad, fill):
    """A view holding `values`, laid out in memory with axis order `order` (outermost first) and `pad`
    elements of `fill` before and after each axis: any strides, an offset, gaps in between."""
    parent_shape = [values.shape[axis] + 2 * pad for axis in order]
    parent = torch.full(parent_shape, fill, dtype=values.dtype)
    view = parent[tuple(slice(pad, pad + values.shape[axis]) for axis in order)]
    view = view.permute(*np.argsort(order).tolist())
    view.copy_(values)
    return view


@st.composite
def strided_cases(draw):
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    batch = draw(st.sampled_from([(), (1,), (2,)]))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    q_len, kv_len = draw(st.integers(1, 7)), draw(st.integers(1, 9))
    head_dim, value_dim = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    shapes = {
        "q": batch + (kv_heads * group, q_len, head_dim),
        "k": batch + (kv_heads, kv_len, head_dim),
        "v": batch + (kv_heads, kv_len, value_dim),
    }
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind is not None:
        shapes["mask"] = draw(
            st.sampled_from([(q_len, kv_len), (kv_heads * group, 1, kv_len), batch + (1, q_len, kv_len)])
        )
    layouts = {
        name: (draw(st.permutations(range(len(shape)))), draw(st.integers(0, 2))) for name, shape in shapes.items()
    }
    options = dict(
        is_causal=draw(st.sampled_from([False, True, "lower_right"])),
        enable_gqa=group > 1,
        scale=draw(st.sampled_from([None, 0.5])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    return dtype, shapes, mask_kind, layouts, options


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strided_cases())
def test_any_strides_match_reference(case):
    """Random shapes, axis orders and offsets (NaN around every view: a read outside it, or a
    stride ignored, shows) against the float64 reference."""
    dtype, shapes, mask_kind, layouts, options = case
    rng = np.random.default_rng(options.pop("seed"))
    tensors = {}
    for name, shape in shapes.items():
        if name == "mask":
            values, fill = make_mask(rng, shape, mask_kind, dtype, p_allowed=0.7), mask_kind == "bool" or math.nan
        else:
            values, fill = randn(rng, shape, dtype), math.nan
        tensors[name] = strided_copy(values, *layouts[name], fill)
    q, k, v, mask = tensors["q"], tensors["k"], tensors["v"], tensors.get("mask")
    got = pt.scaled_dot_product_attention(q, k, v, mask, **options)
    assert_matches(got, pyattn_reference(q, k, v, mask, **options), dtype)


# -- torch.compile and the operator ----------------------------------------------------------------


class Block(torch.nn.Module):
    """A projection, pyattn's attention (mask, GQA, window, softcap, sinks), an activation, a residual."""

    def __init__(self, heads=4, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = torch.nn.Linear(heads * head_dim, heads * head_dim)
        self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 1.0, heads))  # requires grad: fine under no_grad

    def forward(self, x, k, v, mask):
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        out = pt.scaled_dot_product_attention(
            q, k, v, mask, is_causal="lower_right", enable_gqa=True, window=(5, 0), softcap=4.0, sinks=self.sinks
        )
        return F.gelu(out.transpose(1, 2).reshape(batch, length, -1)) + x


def block_inputs(rng):
    torch.manual_seed(0)
    block = Block().eval()
    x = randn(rng, (2, 5, 32), "float32")
    k, v = randn(rng, (2, 2, 9, 8), "float32"), randn(rng, (2, 2, 9, 8), "float32")
    mask = make_mask(rng, (2, 1, 1, 9), "bool", "float32")  # key padding
    return block, (x, k, v, mask)


def test_compile_fullgraph_aot_eager(rng):
    from torch._dynamo.testing import CompileCounterWithBackend

    block, inputs = block_inputs(rng)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    with torch.no_grad():
        expected = block(*inputs)
        with mock.patch.object(pt._core, "sdpa", wraps=pt._core.sdpa) as core:
            got = compiled(*inputs)
            again = compiled(*inputs)
    assert counter.frame_count == 1 and core.call_count == 2
    targets = [node.target for node in counter.graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.pyattn.sdpa.default in targets
    rtol, atol = tol("float32")
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(again, got, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's
def test_compile_fullgraph_inductor(rng):
    """The one inductor compile of the file (its slowest test: 7-15 s with a cold cache)."""
    block, inputs = block_inputs(rng)
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        expected = block(*inputs)
        with mock.patch.object(pt._core, "sdpa", wraps=pt._core.sdpa) as core:
            got = compiled(*inputs)
    assert core.call_count == 1
    rtol, atol = tol("float32")
    torch.testing.assert_close(got, expected, rtol=4 * rtol, atol=4 * atol)  # inductor's own GEMM/GELU


@pytest.mark.parametrize("problem", ["dropout_p", "requires_grad"])
def test_compile_keeps_the_error_message(rng, problem):
    """Under fullgraph=True dynamo re-raises our error as its own (torch._dynamo.exc.Unsupported, a
    RuntimeError), but the message still names the argument."""
    q, k, v = make_qkv(rng, "float32")
    if problem == "requires_grad":
        q.requires_grad_()
    dropout = 0.1 if problem == "dropout_p" else 0.0
    compiled = torch.compile(
        lambda q, k, v: pt.scaled_dot_product_attention(q, k, v, dropout_p=dropout), backend="aot_eager", fullgraph=True
    )
    with pytest.raises((ValueError, RuntimeError), match="dropout_p" if problem == "dropout_p" else "inference_mode"):
        compiled(q, k, v)


def opcheck_arguments(rng):
    q, k, v = make_qkv(rng, "float32", value_dim=12)
    qb, kb, vb = make_qkv(rng, "bfloat16", kv_heads=2)
    q2, k2, v2 = make_qkv(rng, "float64", batch=(), q_heads=None, value_dim=3)
    return {
        "causal": pt._op_arguments(q, k, v, None, 0.0, True, None, False, {}),
        "everything_bf16": pt._op_arguments(
            qb,
            kb,
            vb,
            make_mask(rng, (B, 1, L, S), "bool", "bfloat16"),
            0.0,
            "lower_right",
            0.3,
            True,
            dict(window=(4, 1), softcap=5.0, sinks=randn(rng, (HQ,), "bfloat16"), alibi_slopes=torch.rand(B, HQ)),
        ),
        "2d_float_mask": pt._op_arguments(
            q2, k2, v2, make_mask(rng, (L, S), "float", "float64"), 0.0, False, None, False, dict(num_threads=1)
        ),
    }


@pytest.mark.parametrize("name", ["causal", "everything_bf16", "2d_float_mask"])
def test_opcheck(rng, name):
    args = opcheck_arguments(rng)[name]
    assert len(args) == len(torch.ops.pyattn.sdpa.default._schema.arguments)
    result = torch.library.opcheck(torch.ops.pyattn.sdpa.default, args)
    assert set(result.values()) == {"SUCCESS"}, result
    # the operator computes what the wrapper does
    torch.testing.assert_close(torch.ops.pyattn.sdpa(*args), pt._sdpa_impl(*args), rtol=0, atol=0)


# -- errors ----------------------------------------------------------------------------------------


def meta(t):
    return t.to("meta")


ERRORS = {
    "dropout": (dict(dropout_p=0.1), ValueError, "^dropout_p: pyattn is inference only"),
    "meta_query": (dict(query=meta), TypeError, "^query: the tensor is on meta"),
    "meta_key": (dict(key=meta), TypeError, "^key: the tensor is on meta"),
    "meta_value": (dict(value=meta), TypeError, "^value: the tensor is on meta"),
    "meta_mask": (dict(attn_mask=lambda m: meta(m)), TypeError, "^attn_mask: the tensor is on meta"),
    "meta_sinks": (dict(sinks=torch.zeros(HQ, device="meta")), TypeError, "^sinks: the tensor is on meta"),
    "meta_alibi": (dict(alibi_slopes=torch.ones(HQ, device="meta")), TypeError, "^alibi_slopes: the tensor is on"),
    "int_query": (dict(query=lambda t: t.int()), TypeError, "^query: expected float32, float64, float16 or bfloat16"),
    "int_key": (dict(key=lambda t: t.long()), TypeError, "^key: expected float32, float64, float16 or bfloat16"),
    "complex_value": (dict(value=lambda t: t.to(torch.complex64)), TypeError, "^value: expected float32"),
    "mixed_key": (dict(key=lambda t: t.double()), TypeError, "same dtype.*float32, float64 and float32"),
    "mixed_value": (dict(value=lambda t: t.half()), TypeError, "same dtype.*float32, float32 and float16"),
    "int_mask": (dict(attn_mask=lambda m: m.int()), TypeError, "^attn_mask: dtype must be bool or the query's"),
    "float64_mask": (dict(attn_mask=lambda m: m.double()), TypeError, "^attn_mask: dtype must be bool or the query's"),
    "numpy_query": (dict(query=lambda t: t.numpy()), TypeError, "^query: expected a torch.Tensor, got ndarray"),
    "list_sinks": (dict(sinks=[0.0] * HQ), TypeError, "^sinks: expected a torch.Tensor"),
    "unknown_option": (dict(windows=(1, 1)), TypeError, r"unexpected keyword argument\(s\) \['windows'\]"),
    "bad_is_causal": (dict(is_causal="upper_right"), ValueError, "^is_causal: expected False, True"),
    "tensor_is_causal": (dict(is_causal=torch.tensor(True)), ValueError, "^is_causal"),
    "nan_scale": (dict(scale=math.nan), ValueError, "^scale: must be finite"),
    "inf_scale": (dict(scale=-math.inf), ValueError, "^scale: must be finite"),
    "window_not_a_pair": (dict(window=3), TypeError, "^window: expected a .left, right. pair"),
    "window_float": (dict(window=(2.0, 0)), TypeError, "^window: expected a .left, right. pair"),
    "window_bool": (dict(window=(True, 0)), TypeError, "^window"),
    "softcap": (dict(softcap=0.0), ValueError, "^softcap"),
    "sinks_shape": (dict(sinks=torch.zeros(HQ - 1)), ValueError, "^sinks"),
    "mask_shape": (dict(attn_mask=lambda m: m[:, :3]), ValueError, "^attn_mask: shape"),
    "head_dim": (dict(key=lambda t: t[..., :8]), ValueError, "^key: last dimension"),
    "gqa_heads": (
        dict(key=lambda t: t[:, :3], value=lambda t: t[:, :3], enable_gqa=True),
        ValueError,
        "^enable_gqa: query heads",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_name_the_argument(rng, case):
    changes, error, message = ERRORS[case]
    q, k, v = make_qkv(rng, "float32")
    arguments = dict(query=q, key=k, value=v, attn_mask=make_mask(rng, (L, S), "float", "float32"))
    for name, change in changes.items():
        arguments[name] = change(arguments[name]) if callable(change) else change
    with pytest.raises(error, match=message):
        pt.scaled_dot_product_attention(**arguments)


@pytest.mark.parametrize("name", ["query", "key", "value", "attn_mask", "sinks", "alibi_slopes"])
def test_requires_grad_only_under_grad_mode(rng, name):
    q, k, v = make_qkv(rng, "float32")
    arguments = dict(
        query=q,
        key=k,
        value=v,
        attn_mask=make_mask(rng, (L, S), "float", "float32"),
        sinks=torch.zeros(HQ),
        alibi_slopes=torch.full((HQ,), 0.25),
    )
    expected = pt.scaled_dot_product_attention(**arguments)
    arguments[name] = torch.nn.Parameter(arguments[name])
    with pytest.raises(RuntimeError, match=f"^{name}: requires grad.*inference_mode.*no_grad"):
        pt.scaled_dot_product_attention(**arguments)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = pt.scaled_dot_product_attention(**arguments)
        assert got.grad_fn is None and not got.requires_grad
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert arguments[name].grad is None
    with torch.inference_mode():  # inference tensors are fine outside inference mode too
        inference_query = q.clone()
    torch.testing.assert_close(
        pt.scaled_dot_product_attention(inference_query, k, v, arguments["attn_mask"].detach()),
        pt.scaled_dot_product_attention(q, k, v, arguments["attn_mask"].detach()),
        rtol=0,
        atol=0,
    )


# -- sdpa_override ---------------------------------------------------------------------------------


@contextlib.contextmanager
def spies():
    """Counts the calls that reach pyattn's implementation and torch's own function through the override."""
    with mock.patch.object(pt, "_sdpa_impl", wraps=pt._sdpa_impl) as ours:
        with mock.patch.object(pt, "_TORCH_SDPA", wraps=TORCH_SDPA) as theirs:
            yield ours, theirs


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_override_routes_to_pyattn(rng, dtype):
    q, k, v = make_qkv(rng, dtype, kv_heads=2)
    mask = make_mask(rng, (B, 1, L, S), "float", dtype)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with spies() as (ours, theirs), pt.sdpa_override() as switch:
        assert isinstance(switch, pt.sdpa_override)
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        got = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
        got_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.25)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert ours.call_count == 2 and theirs.call_count == 0
    assert_matches(got, torch_reference(q, k, v, mask, enable_gqa=True), dtype)
    assert_matches(got_causal, torch_reference(q, k, v, is_causal=True, enable_gqa=True, scale=0.25), dtype)


def test_override_restores_after_an_exception():
    with pytest.raises(KeyError, match="inside"):
        with pt.sdpa_override():
            assert F.scaled_dot_product_attention is not TORCH_SDPA
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_override_nests_and_restores_the_previous_function():
    outer, inner = pt.sdpa_override(), pt.sdpa_override()
    with outer:
        routed = F.scaled_dot_product_attention
        with inner:
            assert F.scaled_dot_product_attention is routed
            with outer:  # the same object re-entered
                assert F.scaled_dot_product_attention is routed
            assert F.scaled_dot_product_attention is routed
        assert F.scaled_dot_product_attention is routed
    assert F.scaled_dot_product_attention is TORCH_SDPA

    def someone_elses(*args, **kwargs):
        raise AssertionError("not called")

    with mock.patch.object(F, "scaled_dot_product_attention", someone_elses):
        with pt.sdpa_override():
            assert F.scaled_dot_product_attention is not someone_elses
        assert F.scaled_dot_product_attention is someone_elses
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_override_as_a_decorator(rng):
    q, k, v = make_qkv(rng, "float32")

    @pt.sdpa_override()
    def attend(depth=0):
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        if depth:
            return attend(depth - 1)  # the decorator's one object, entered recursively
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with spies() as (ours, _):
        first, second = attend(), attend(depth=2)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert ours.call_count == 2
    assert_matches(first, torch_reference(q, k, v, is_causal=True), "float32")
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_override_leaves_dropout_to_torch(rng):
    q, k, v = make_qkv(rng, "float32")
    with spies() as (ours, theirs), pt.sdpa_override():
        torch.manual_seed(7)
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    expected = TORCH_SDPA(q, k, v, dropout_p=0.3)
    assert ours.call_count == 0 and theirs.call_count == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_override_leaves_training_to_torch(rng):
    q, k, v = make_qkv(rng, "float32")
    q_ref, k_ref = q.clone().requires_grad_(), k.clone().requires_grad_()
    q.requires_grad_(), k.requires_grad_()
    mask = make_mask(rng, (L, S), "bool", "float32")
    with spies() as (ours, theirs), pt.sdpa_override():
        got = F.scaled_dot_product_attention(q, k, v, mask)
        assert got.grad_fn is not None
        got.square().sum().backward()
    assert ours.call_count == 0 and theirs.call_count == 1
    expected = TORCH_SDPA(q_ref, k_ref, v, mask)
    expected.square().sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(k.grad, k_ref.grad, rtol=0, atol=0)
    # the same call under no_grad is pyattn's
    with spies() as (ours, theirs), pt.sdpa_override(), torch.no_grad():
        inference = F.scaled_dot_product_attention(q, k, v, mask)
    assert ours.call_count == 1 and theirs.call_count == 0 and inference.grad_fn is None
    rtol, atol = tol("float32")
    torch.testing.assert_close(inference, expected.detach(), rtol=2 * rtol, atol=2 * atol)  # both float32


def test_override_leaves_other_devices_and_dtypes_to_torch(rng):
    q, k, v = make_qkv(rng, "float32")
    with spies() as (ours, theirs), pt.sdpa_override():
        on_meta = F.scaled_dot_product_attention(meta(q), meta(k), meta(v), is_causal=True)
        with pytest.raises(RuntimeError, match="attn_mask dtype"):  # torch's own error, not pyattn's TypeError
            F.scaled_dot_product_attention(q, k, v, torch.zeros(L, S, dtype=torch.float64))
        with pytest.raises(RuntimeError):  # integer inputs: torch's error
            F.scaled_dot_product_attention(q.int(), k.int(), v.int())
    assert on_meta.device.type == "meta" and on_meta.shape == (B, HQ, L, E)
    assert ours.call_count == 0 and theirs.call_count == 3


def test_override_reaches_multihead_attention(rng):
    """nn.MultiheadAttention's slow path (batch_first=False, a key_padding_mask) calls
    F.scaled_dot_product_attention with a float mask: the same output inside the block, computed by pyattn."""
    torch.manual_seed(1)
    layer = torch.nn.MultiheadAttention(32, 4).eval()
    x = randn(rng, (6, 2, 32), "float32")  # (L, B, E)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with torch.no_grad():
        expected, _ = layer(x, x, x, key_padding_mask=padding, need_weights=False)
        with spies() as (ours, theirs), pt.sdpa_override():
            got, _ = layer(x, x, x, key_padding_mask=padding, need_weights=False)
    assert ours.call_count == 1 and theirs.call_count == 0
    rtol, atol = tol("float32")
    torch.testing.assert_close(got, expected, rtol=2 * rtol, atol=2 * atol)  # pyattn vs torch, both float32


def test_override_under_compile_guards_the_switch(rng):
    """A function compiled inside the block traces pyattn's operator; after the block dynamo's guard
    on torch.nn.functional.scaled_dot_product_attention recompiles it with torch's function."""
    q, k, v = make_qkv(rng, "float32")

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    expected = 2 * torch_reference(q, k, v, is_causal=True)
    with torch.no_grad(), mock.patch.object(pt._core, "sdpa", wraps=pt._core.sdpa) as core:
        with pt.sdpa_override():
            inside = compiled(q, k, v)
        assert core.call_count == 1
        outside = compiled(q, k, v)
        assert core.call_count == 1
    assert_matches(inside, expected, "float32")
    rtol, atol = tol("float32")
    np.testing.assert_allclose(values64(outside), expected, rtol=2 * rtol, atol=2 * atol)


# -- shapes torch and pyattn read differently ------------------------------------------------------


def test_2d_query_with_3d_key_names_the_argument(rng):
    """As in the NumPy API: `key: number of heads (4) must equal query's (1)`; a 1-D query is a
    ValueError naming it."""
    q, k, v = make_qkv(rng, "float32", batch=())
    with pytest.raises(ValueError, match="^key"):
        pt.scaled_dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="^query: expected at least 2 dimensions"):
        pt.scaled_dot_product_attention(q[0, 0], k, v)


def test_batch_mismatch_names_the_arguments(rng):
    """As in the NumPy API: `ValueError: query, key and value: leading batch dimensions do not
    broadcast`."""
    q, _, _ = make_qkv(rng, "float32")
    _, k, v = make_qkv(rng, "float32", batch=(3,))
    with pytest.raises(ValueError, match="query, key and value"):
        pt.scaled_dot_product_attention(q, k, v)


def test_override_leaves_a_2d_query_over_3d_heads_to_torch(rng):
    q, k, v = make_qkv(rng, "float32", batch=())
    expected = TORCH_SDPA(q[0], k, v)  # torch broadcasts the (L, E) query over the heads: (H, L, Ev)
    with pt.sdpa_override():
        got = F.scaled_dot_product_attention(q[0], k, v)
    torch.testing.assert_close(got, expected)


def test_override_leaves_head_broadcasting_to_torch(rng):
    """torch broadcasts a single key/value head (or a single query head) without enable_gqa; pyattn
    would refuse it, so the override hands the call to torch."""
    q, k, v = make_qkv(rng, "float32", kv_heads=1)
    expected = TORCH_SDPA(q, k, v)
    with pt.sdpa_override():
        got = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("precision", ["fast", "highest"])
def test_precision_passes_through(rng, isa, precision):
    """precision= reaches the core: the tensors' result is the NumPy API's, bit for bit, for bfloat16
    tensors large enough for the query tiles (where "fast" may take bfloat16 dot products)."""
    import ml_dtypes

    import pyattn

    q, k, v = make_qkv(rng, "bfloat16", q_len=70, kv_len=90)
    got = pt.scaled_dot_product_attention(q, k, v, is_causal=True, precision=precision)
    as_np = [x.float().numpy().astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    want = pyattn.scaled_dot_product_attention(*as_np, is_causal=True, precision=precision)
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want.view(np.int16))


def test_precision_errors(rng):
    q, k, v = make_qkv(rng, "bfloat16")
    with pytest.raises(TypeError, match="precision"):
        pt.scaled_dot_product_attention(q, k, v, precision=1)
    with pytest.raises(ValueError, match="precision: expected 'fast' or 'highest'"):
        pt.scaled_dot_product_attention(q, k, v, precision="low")
