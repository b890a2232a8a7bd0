# SPDX-License-Identifier: MIT
"""Benchmark the pyattn multi-head attention layer and the GEMM behind its projections.

Run (from the repository root, with pyattn installed in the interpreter's environment; torch is
optional: without it its columns show "-")::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_mha.py            # full suite
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_mha.py --quick    # smoke, < 30 s
    python bench/bench_mha.py --threads 1 --markdown --json out.json
    python bench/bench_mha.py --quick --dtype bfloat16                                # bfloat16 layers

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set, slow NumPy's BLAS (the numpy peers); the script
never changes them, it prints a warning, hence the ``env -u`` above.

Everything is float32 (``--dtype bfloat16``: bfloat16 layers, see the end) with the same thread count
for every library (``--threads``, default os.cpu_count(); ``torch.set_num_threads``; NumPy's BLAS
through threadpoolctl when installed). Each library is timed in its own blocks (warm-up, then its
repetitions, then the next library), never two at once: two OpenMP runtimes spin-waiting side by side
interfere on a small machine. The blocks alternate (``--rounds`` per row, samples pooled), so a slow
spell of the shared machine hits every library alike.

Table 1, the layer: self-attention ``out = layer(x)`` with x (B, L, E), no mask, for BERT-base-sized
(E=768, 12 heads; B in 1, 8; L in 128, 512) and MiniLM-sized (E=384, 12 heads, B=8, L=128) layers:

* pyattn: ``pyattn.MultiHeadAttention.from_torch(module)`` with torch, else
  ``MultiHeadAttention(E, H)`` then ``load_state_dict(weights)`` (torch's state_dict keys): the same
  random weights and biases either way, N(0, 1/E) drawn with NumPy from ``--seed`` (packed once),
  ``num_threads``;
* mha: ``pyattn.mha(x, **weights)``, the functional form with the same weights as arrays on every
  call (its GEMM packs them as it goes; the output must equal the layer's bit for bit), "mha/layer"
  its time over the layer's;
* numpy: the same layer in float32 NumPy: the fused Q/K/V projection as one ``np.matmul`` over the
  B*L rows (+ bias), attention by ``_common.numpy_attention`` (batched matmuls over all (batch, head)
  pairs, in chunks of at most 4M scores, max-subtracted exp; no per-head loops), the output
  projection by ``np.matmul``; its BLAS threads limited like the GEMM peer's;
* torch (when installed): the same ``torch.nn.MultiheadAttention`` (batch_first=True, eval,
  ``torch.inference_mode()``, ``need_weights=False``), i.e. what a PyTorch user runs for inference;
* ref: ``pyattn.reference.mha``, the float64 NumPy reference (only on the L=128 shapes; it is a
  correctness yardstick, not a tuned peer);
* max err: max |pyattn - reference| on the shapes where the reference runs, else max |pyattn - torch|
  (torch float32), or max |pyattn - numpy| (float32) without torch, column "vs"; the JSON rows also
  hold each peer's own error against the reference (torch_max_abs_err, numpy_max_abs_err).

Table 2, the GEMM alone on the projection shapes (M = B*L, N = 3E for the fused Q/K/V projection or E
for the output projection, K = E): ``pyattn._core.linear`` with pre-packed weights against NumPy's
``np.matmul(x, w.T, out=...)`` and ``torch.mm(x, w.T, out=...)`` (when installed); no bias; max err
against a float64 matmul.

Columns: ms = median over runs after warm-up (runs repeat until both --min-time s and --min-runs runs);
GFLOP/s from the formula below; %peak = of the FMA peak measured in this run
(``pyattn._machine.fma_peak_gflops(threads, 0.5)``, float32, best ISA; the best of 3 readings before the
rows and 1 after them); ``<peer> x`` = peer ms / pyattn ms (> 1: pyattn is faster); bg = CPUs other
processes kept busy during the row (with --wait-idle, disturbed rows are redone up to twice).

FLOP count: projections 2*M*N*K each (layer: Q, K, V and out, 8*B*L*E^2 in total) + attention
4*B*H*L*S*Dh (= 4*B*L*S*E; q.k and p.v, 2*Dh each per (query, key) pair, S = L here).

Table 3, a decode step: one new token through a self-attention layer over a KV cache of S tokens
(batch 1; E, query heads / key-value heads, cache storage dtype), the way a generating model calls it:

* pyattn: ``layer(token, kv_cache=cache)`` (projections, the token's K/V into the cache, attention
  over the cache, output projection, in one call); each timed call generates DECODE_STEPS tokens
  from position S (``cache.truncate(S)`` first, which is timed too);
* mha: the same steps through ``pyattn.mha(token, kv_cache=cache2, **weights)`` over a second cache
  (the weights as arrays on every call; the output must equal the layer's bit for bit);
* torch (when installed; without it pyattn and mha are still timed and checked): the same weights
  as ``torch.nn.functional.linear`` projections, a preallocated float32
  K/V cache tensor (1, Hkv, S + DECODE_STEPS, Dh) written in place, and
  ``F.scaled_dot_product_attention(enable_gqa=...)`` over its filled part: what a PyTorch user
  writes for a KV cache (nn.MultiheadAttention has none); float32 for every row, also where pyattn's
  cache is 16-bit;
* ms = per token; GB/s = the bytes a step must read (the four weight matrices in float32 and the
  cache's K/V in its dtype) / time; max err = the last token's output against a float64 computation
  from the K/V values the cache stores (Q and output projections in float64 too).

``--dtype bfloat16``: Table 1 only (the GEMM and decode tables are the float32 run's), on
ml_dtypes.bfloat16 weights and x (the same draws as the float32 rows, rounded to bfloat16). Per layer:

* pyattn (the pyattn columns): ``MultiHeadAttention.from_torch(module)`` of the bfloat16 torch module
  below (without torch ``MultiHeadAttention(E, H, dtype=bfloat16)`` + ``load_state_dict``): bfloat16
  weights, inputs and output; with AVX512-BF16 (ISA avx512bf16, runtime_info()["precision_fast"] ==
  "bfloat16 dot products") its projections are bfloat16 dot products with float32 sums, elsewhere it
  computes as the float32 layer over the same values and rounds the output to bfloat16;
  ``pyattn.mha`` with the same bfloat16 weights must equal it bit for bit (checked once, not timed);
* f32: pyattn's float32 layer with the same (bfloat16-valued) weights and x, in the same alternating
  blocks: ``f32 ms``, ``f32/bf16`` = f32 ms / pyattn ms (> 1: the bfloat16 layer is faster), ``f32 err``;
* torch (when installed): the float32 module ``.to(torch.bfloat16)`` (exact: the values are
  bfloat16's), batch_first, eval, ``torch.inference_mode()``, ``need_weights=False``, on
  ``torch.from_numpy(x's float32 values).to(torch.bfloat16)`` (not timed); ``torch x`` as above;
* no numpy peer (NumPy has no bfloat16 matmul) and no timed reference;
* errors against ``pyattn.reference.mha`` in float64 on the bfloat16 values, on every row (untimed):
  ``max err`` (pyattn's bfloat16 output), ``torch err`` (torch's bfloat16 output), ``err/torch`` = max
  err / torch err (the accuracy target: <= 1.5), ``f32 err``. A bfloat16 result is wrong (exit status
  1) above BF16_ERR_ATOL + BF16_ERR_RTOL * max|reference| (bench_sdpa.py's bounds: the output alone
  is rounded to bfloat16), the float32 layer's above WRONG_ANSWER_ERR;
* %peak = of the bfloat16 dot-product peak (``pyattn._machine.dot16_peak_gflops``, vdpbf16ps) when
  pyattn's ISA has one, else of the float32 FMA peak; the header says which. The attention
  (4*B*L*S*E of the FLOPs) computes in float32 either way.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass

import numpy as np

from _common import (
    BUSY_WARN_CPUS,
    ENVIRONMENT_HELP,
    WRONG_ANSWER_ERR,
    BackgroundLoad,
    Column,
    Table,
    TimingDefaults,
    add_common_arguments,
    as_float64,
    bfloat16_dtype,
    blas_thread_limiter,
    cpu_model,
    finish_run,
    fmt,
    fmt_ms,
    import_pyattn,
    limit_peer_isa,
    machine,
    now_iso,
    numpy_attention,
    numpy_blas_name,
    openblas_env_warnings,
    peer_timing,
    print_peer_isa,
    pyattn_timing,
    resolve_common_arguments,
    settle,
    time_call,
    time_interleaved,
    wait_for_idle,
)

DTYPE = np.float32
DTYPES = ("float32", "bfloat16")  # --dtype (bfloat16: the layer table only)
# A bfloat16 row's result is wrong above BF16_ERR_ATOL + BF16_ERR_RTOL * max|reference|: bench_sdpa.py's
# bounds (twice the test suite's for precision="fast" bfloat16). Correct rows measure about 2**-8 *
# max|reference| (the output's own rounding to bfloat16); a wrong head or lost weights are far above.
BF16_ERR_ATOL = 1.2e-2
BF16_ERR_RTOL = 3.2e-2
BF16_DOTS = "bfloat16 dot products"  # runtime_info()["precision_fast"] on ISAs with them (avx512bf16)
REFERENCE_MAX_LEN = 128  # the float64 reference runs (and is the error yardstick) only up to this L
WARMUP = 2  # untimed calls per library and row (torch's first calls allocate and pick kernels)
ROW_RETRIES = 2  # with --wait-idle: redo a row disturbed by other processes at most this often
TIMING = TimingDefaults(min_time=0.5, min_runs=10, quick_min_runs=3)  # --min-time / --min-runs


@dataclass(frozen=True)
class LayerCase:
    """A self-attention layer: x (batch, seq_len, embed_dim), num_heads heads."""

    embed_dim: int
    num_heads: int
    batch: int
    seq_len: int

    @property
    def name(self) -> str:
        return f"E{self.embed_dim} H{self.num_heads} B{self.batch} L{self.seq_len}"

    @property
    def flops(self) -> int:
        """8*M*E^2 (Q, K, V, out projections, 2*M*N*K each) + 4*B*L*S*E (attention, S = L)."""
        m, e = self.batch * self.seq_len, self.embed_dim
        return 8 * m * e * e + 4 * self.batch * self.seq_len * self.seq_len * e

    @property
    def small(self) -> bool:
        return self.seq_len <= REFERENCE_MAX_LEN


@dataclass(frozen=True)
class GemmCase:
    """out (m, n) = x (m, k) @ w.T, w (n, k)."""

    m: int
    n: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class DecodeCase:
    """One new token through a self-attention layer (E, H query heads, Hkv key/value heads) over a
    KV cache of `cached` tokens stored as `dtype`."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    cached: int
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"E{self.embed_dim} H{self.num_heads}/{self.num_kv_heads} S{self.cached} {self.dtype}"

    def step_bytes(self, length: int) -> int:
        """Bytes a step reads: the q/k/v/out weights (float32) and K/V of `length` cached tokens."""
        e, kv = self.embed_dim, self.num_kv_heads * (self.embed_dim // self.num_heads)
        item = 2 if self.dtype in ("float16", "bfloat16") else 4
        return 4 * (2 * e * e + 2 * e * kv) + 2 * length * kv * item


DECODE_STEPS = 8  # tokens generated per timed call (from position `cached`)
DECODE_SUITE = (
    DecodeCase(256, 4, 4, 256),
    DecodeCase(768, 12, 12, 1024),
    DecodeCase(768, 12, 4, 1024),
    DecodeCase(768, 12, 4, 1024, "bfloat16"),
    DecodeCase(2048, 16, 4, 4096),
    DecodeCase(2048, 16, 4, 4096, "bfloat16"),
)
QUICK_DECODE = ("E256 H4/4 S256 float32", "E768 H12/4 S1024 bfloat16")

LAYER_SUITE = (
    LayerCase(768, 12, 1, 128),
    LayerCase(768, 12, 1, 512),
    LayerCase(768, 12, 8, 128),
    LayerCase(768, 12, 8, 512),
    LayerCase(384, 12, 8, 128),
)
QUICK_LAYERS = ("E768 H12 B1 L128", "E384 H12 B8 L128")


def gemm_suite(layers) -> list[GemmCase]:
    """The projection GEMMs of `layers`: (B*L, 3E, E) and (B*L, E, E), without duplicates."""
    cases = []
    for layer in layers:
        m, e = layer.batch * layer.seq_len, layer.embed_dim
        for case in (GemmCase(m, 3 * e, e), GemmCase(m, e, e)):
            if case not in cases:
                cases.append(case)
    return cases


# ----------------------------------------------------------------------------------------------
# Inputs


def layer_weights(case: LayerCase, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights and biases, N(0, 1/E), under torch.nn.MultiheadAttention's state_dict keys (in
    the order of its parameters)."""
    e = case.embed_dim
    shapes = {"in_proj_weight": (3 * e, e), "in_proj_bias": (3 * e,), "out_proj.weight": (e, e), "out_proj.bias": (e,)}
    return {name: (rng.standard_normal(shape) / np.sqrt(e)).astype(DTYPE) for name, shape in shapes.items()}


def torch_layer(case: LayerCase, state: dict[str, np.ndarray]):
    """An eval-mode batch_first torch.nn.MultiheadAttention holding `state`."""
    import torch

    module = torch.nn.MultiheadAttention(case.embed_dim, case.num_heads, batch_first=True).eval()
    module.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    return module


def numpy_layer(x: np.ndarray, state: dict[str, np.ndarray], num_heads: int) -> np.ndarray:
    """Self-attention through the layer in float32 NumPy: Q/K/V projection, attention, output projection."""
    batch, seq_len, e = x.shape
    dh = e // num_heads
    qkv = np.matmul(x.reshape(batch * seq_len, e), state["in_proj_weight"].T)  # one GEMM for all B*L rows
    qkv += state["in_proj_bias"]
    q, k, v = qkv.reshape(batch, seq_len, 3, num_heads, dh).transpose(2, 0, 3, 1, 4)  # each (B, H, L, Dh)
    context = numpy_attention(q, k, v, None, 1.0 / np.sqrt(dh)).transpose(0, 2, 1, 3).reshape(batch * seq_len, e)
    out = np.matmul(context, state["out_proj.weight"].T)
    out += state["out_proj.bias"]
    return out.reshape(batch, seq_len, e)


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# ----------------------------------------------------------------------------------------------
# Rows


def layer_row(pyattn, case: LayerCase, args, peak) -> dict:
    """Time pyattn, numpy, torch (when installed) and (small shapes) the reference on one layer; all
    blocks separate."""
    rng = np.random.default_rng(args.seed)
    state = layer_weights(case, rng)
    x = rng.standard_normal((case.batch, case.seq_len, case.embed_dim), dtype=DTYPE)
    timing = dict(min_time=args.min_time, min_runs=args.min_runs, warmup=WARMUP)
    module = torch_layer(case, state) if args.torch else None
    if module is not None:
        layer = pyattn.MultiHeadAttention.from_torch(module)
    else:
        layer = pyattn.MultiHeadAttention(case.embed_dim, case.num_heads)
        layer.load_state_dict(state)

    weights = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    fns = {
        "pyattn": lambda: layer(x, num_threads=args.threads),
        "pyattn.mha": lambda: pyattn.mha(x, num_heads=case.num_heads, num_threads=args.threads, **weights),
        "numpy": lambda: numpy_layer(x, state, case.num_heads),
    }
    if module is not None:
        import torch

        torch.set_num_threads(args.threads)
        tx = torch.from_numpy(x)

        def run_torch():
            with torch.inference_mode():
                return module(tx, tx, tx, need_weights=False)[0]

        fns["torch"] = run_torch
    timed = interleaved(fns, args, contexts={"numpy": args.blas_limit})
    t_pyattn, out = timed["pyattn"]
    t_function, function_out = timed["pyattn.mha"]
    t_numpy, numpy_out = timed["numpy"]
    t_torch, torch_out = timed.get("torch", (None, None))
    if not np.array_equal(function_out, out):
        raise AssertionError(f"{case.name}: pyattn.mha differs from the layer with the same weights")
    torch_out = None if torch_out is None else torch_out.numpy()

    row = {
        "case": case.name,
        "embed_dim": case.embed_dim,
        "num_heads": case.num_heads,
        "batch": case.batch,
        "seq_len": case.seq_len,
        "flops": case.flops,
        **pyattn_timing(t_pyattn),
        "function_ms": t_function.median * 1e3,
        "function_vs_pyattn": t_function.median / t_pyattn.median,
        **peer_timing("torch", t_torch, t_pyattn),
        **peer_timing("numpy", t_numpy, t_pyattn),
        "reference_ms": None,
        "reference_vs_pyattn": None,
    }
    row["gflops"] = case.flops / t_pyattn.median / 1e9
    row["pct_fma_peak"] = 100 * row["gflops"] / peak if peak else None
    if case.small:
        ref_timing = dict(timing, min_runs=min(args.min_runs, 3), warmup=1)
        with args.blas_limit():
            t_ref, ref = time_call(lambda: pyattn.reference.mha(x, num_heads=case.num_heads, **weights), **ref_timing)
        row["reference_ms"] = t_ref.median * 1e3
        row["reference_vs_pyattn"] = t_ref.median / t_pyattn.median
        row["max_abs_err"], row["err_vs"] = max_abs_diff(out, ref), "ref"
        row["torch_max_abs_err"] = None if torch_out is None else max_abs_diff(torch_out, ref)
        row["numpy_max_abs_err"] = max_abs_diff(numpy_out, ref)
    else:  # no float64 reference at this size: agreement with a float32 peer (torch, else numpy)
        peer_name, peer_out = ("torch", torch_out) if torch_out is not None else ("numpy", numpy_out)
        row["max_abs_err"], row["err_vs"] = max_abs_diff(out, peer_out), peer_name
        row["torch_max_abs_err"] = row["numpy_max_abs_err"] = None
    return row


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two bfloat16 arrays hold the same bits (NaN included)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def layer_bf16_row(pyattn, case: LayerCase, args, peak) -> dict:
    """--dtype bfloat16: time pyattn's bfloat16 layer, pyattn's float32 layer on the same values and
    torch's bfloat16 nn.MultiheadAttention (when installed) in alternating blocks; the errors of all
    three against the float64 reference on the bfloat16 values (untimed)."""
    bf16 = args.bf16
    rng = np.random.default_rng(args.seed)  # the float32 rows' draws, rounded to bfloat16
    state = {name: value.astype(bf16) for name, value in layer_weights(case, rng).items()}
    x = rng.standard_normal((case.batch, case.seq_len, case.embed_dim), dtype=DTYPE).astype(bf16)
    state32 = {name: value.astype(DTYPE) for name, value in state.items()}  # the same values
    x32 = x.astype(DTYPE)
    module = None
    if args.torch:
        import torch

        module = torch_layer(case, state32).to(torch.bfloat16)  # exact: the values are bfloat16's
        layer = pyattn.MultiHeadAttention.from_torch(module)
    else:
        layer = pyattn.MultiHeadAttention(case.embed_dim, case.num_heads, dtype=bf16)
        layer.load_state_dict(state)
    layer32 = pyattn.MultiHeadAttention(case.embed_dim, case.num_heads)
    layer32.load_state_dict(state32)
    fns = {
        "pyattn": lambda: layer(x, num_threads=args.threads),
        "f32": lambda: layer32(x32, num_threads=args.threads),
    }
    if module is not None:
        torch.set_num_threads(args.threads)
        tx = torch.from_numpy(x32).to(torch.bfloat16)

        def run_torch():
            with torch.inference_mode():
                return module(tx, tx, tx, need_weights=False)[0]

        fns["torch"] = run_torch
    timed = interleaved(fns, args)
    t_pyattn, out = timed["pyattn"]
    t_f32, out32 = timed["f32"]
    t_torch, torch_out = timed.get("torch", (None, None))
    if out.dtype != bf16:
        raise AssertionError(f"{case.name}: the bfloat16 layer returned {out.dtype}")
    weights = {k.replace(".", "_"): v for k, v in layer.state_dict().items()}
    function_out = pyattn.mha(x, num_heads=case.num_heads, num_threads=args.threads, **weights)
    if not same_bits(function_out, out):
        raise AssertionError(f"{case.name}: pyattn.mha differs from the layer with the same bfloat16 weights")

    with args.blas_limit():
        ref = pyattn.reference.mha(
            x.astype(np.float64),
            num_heads=case.num_heads,
            **{k: v.astype(np.float64) for k, v in weights.items()},
        )
    ref_max = float(np.max(np.abs(ref)))
    err = max_abs_diff(out, ref)
    torch_err = None if torch_out is None else max_abs_diff(as_float64(torch_out), ref)
    gflops = case.flops / t_pyattn.median / 1e9
    return {
        "case": case.name,
        "dtype": "bfloat16",
        "embed_dim": case.embed_dim,
        "num_heads": case.num_heads,
        "batch": case.batch,
        "seq_len": case.seq_len,
        "flops": case.flops,
        "bf16_projections": args.bf16_dots,
        **pyattn_timing(t_pyattn),
        "gflops": gflops,
        "peak_ceiling": args.ceiling,
        "pct_peak": 100 * gflops / peak if peak else None,
        "max_abs_err": err,
        "err_vs": "ref",
        "ref_max_abs": ref_max,
        "err_tol": BF16_ERR_ATOL + BF16_ERR_RTOL * ref_max,
        "f32_ms": t_f32.median * 1e3,
        "f32_min_ms": t_f32.min * 1e3,
        "f32_runs": t_f32.runs,
        "f32_vs_bf16": t_f32.median / t_pyattn.median,
        "f32_max_abs_err": max_abs_diff(out32, ref),
        # Without bfloat16 dot products the bfloat16 layer is the float32 layer's output rounded once.
        "bf16_is_rounded_f32": None if args.bf16_dots else same_bits(out32.astype(bf16), out),
        **peer_timing("torch", t_torch, t_pyattn),
        "torch_max_abs_err": torch_err,
        "err_vs_torch": err / torch_err if torch_err else None,
    }


def wrong_f32(rows: list[dict]) -> list[str]:
    """bfloat16 rows whose float32 layer (same values) is above WRONG_ANSWER_ERR (or NaN); the bfloat16
    result (max_abs_err) is checked by finish_run against the row's err_tol."""
    return [
        f"{r['case']} float32 layer: max err {r['f32_max_abs_err']:.3g}"
        for r in rows
        if "f32_max_abs_err" in r and not r["f32_max_abs_err"] <= WRONG_ANSWER_ERR
    ]


def decode_row(pyattn, case: DecodeCase, args, peak) -> dict:
    """Time DECODE_STEPS one-token steps of pyattn's layer over its KVCache and, when torch is
    installed, of the same step in PyTorch (torch_decode); blocks separate."""
    rng = np.random.default_rng(args.seed)
    e, h, hkv, s = case.embed_dim, case.num_heads, case.num_kv_heads, case.cached
    dh = e // h
    layer = pyattn.MultiHeadAttention(e, h, num_kv_heads=hkv, seed=args.seed)
    state = layer.state_dict()
    state["in_proj_bias"] = (0.1 * rng.standard_normal(state["in_proj_bias"].shape)).astype(DTYPE)
    state["out_proj.bias"] = (0.1 * rng.standard_normal(state["out_proj.bias"].shape)).astype(DTYPE)
    layer.load_state_dict(state)
    cache = pyattn.KVCache(1, hkv, dh, s + DECODE_STEPS, dtype=case.dtype)
    function_cache = pyattn.KVCache(1, hkv, dh, s + DECODE_STEPS, dtype=case.dtype)
    prompt = rng.standard_normal((1, s, e), dtype=DTYPE)
    layer(prompt, kv_cache=cache, num_threads=args.threads)
    layer(prompt, kv_cache=function_cache, num_threads=args.threads)
    tokens = rng.standard_normal((DECODE_STEPS, 1, 1, e), dtype=DTYPE)
    weights = {k.replace(".", "_"): v for k, v in state.items()}

    def run_pyattn():
        cache.truncate(s)
        for token in tokens:
            out = layer(token, kv_cache=cache, num_threads=args.threads)
        return out

    def run_function():  # pyattn.mha: the weights as arrays on every call
        function_cache.truncate(s)
        for token in tokens:
            out = pyattn.mha(
                token, num_heads=h, num_kv_heads=hkv, kv_cache=function_cache, num_threads=args.threads, **weights
            )
        return out

    fns = {"pyattn": run_pyattn, "pyattn.mha": run_function}
    if args.torch:
        fns["torch"] = torch_decode(case, state, cache, tokens, args.threads)
    timed = interleaved(fns, args)
    t_pyattn, out = timed["pyattn"]
    t_function, function_out = timed["pyattn.mha"]
    t_torch = timed["torch"][0] if args.torch else None
    if not np.array_equal(function_out, out):
        raise AssertionError(f"{case.name}: pyattn.mha differs from the layer with the same weights")

    # The last token (it sees every cached key) in float64 from the K/V the cache stores.
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    q = (f64(tokens[-1, 0, 0]) @ f64(state["in_proj_weight"][:e]).T + f64(state["in_proj_bias"][:e])).reshape(h, dh)
    keys = np.repeat(f64(cache.keys(0)), h // hkv, axis=0)  # (h, length, dh)
    values = np.repeat(f64(cache.values(0)), h // hkv, axis=0)
    scores = np.einsum("hd,hjd->hj", q, keys) / np.sqrt(dh)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    context = np.einsum("hj,hjd->hd", p / p.sum(axis=1, keepdims=True), values).reshape(e)
    expected = context @ f64(state["out_proj.weight"]).T + f64(state["out_proj.bias"])

    step = t_pyattn.median / DECODE_STEPS
    return {
        "case": case.name,
        "embed_dim": e,
        "num_heads": h,
        "num_kv_heads": hkv,
        "cached": s,
        "cache_dtype": case.dtype,
        "steps_per_call": DECODE_STEPS,
        **pyattn_timing(t_pyattn, per_call=DECODE_STEPS),
        "step_bytes": case.step_bytes(s + DECODE_STEPS // 2),
        "gbs": case.step_bytes(s + DECODE_STEPS // 2) / step / 1e9,
        "max_abs_err": max_abs_diff(out.reshape(e), expected),
        "function_ms": t_function.median / DECODE_STEPS * 1e3,
        "function_vs_pyattn": t_function.median / t_pyattn.median,
        **peer_timing("torch", t_torch, t_pyattn, per_call=DECODE_STEPS),
    }


def torch_decode(case: DecodeCase, state, cache, tokens, threads):
    """DECODE_STEPS one-token steps written in PyTorch, as a callable: F.linear projections with the
    layer's weights, a preallocated float32 K/V cache tensor (1, Hkv, S + DECODE_STEPS, Dh) holding
    `cache`'s first S tokens and written in place, F.scaled_dot_product_attention over its filled part."""
    import torch
    import torch.nn.functional as F

    e, h, hkv, s = case.embed_dim, case.num_heads, case.num_kv_heads, case.cached
    dh = e // h
    torch.set_num_threads(threads)
    w_in, b_in = torch.from_numpy(state["in_proj_weight"]), torch.from_numpy(state["in_proj_bias"])
    sizes = [e, hkv * dh, hkv * dh]
    wq, wk, wv = torch.split(w_in, sizes)
    bq, bk, bv = torch.split(b_in, sizes)
    wo, bo = torch.from_numpy(state["out_proj.weight"]), torch.from_numpy(state["out_proj.bias"])
    k_cache = torch.zeros((1, hkv, s + DECODE_STEPS, dh))
    v_cache = torch.zeros((1, hkv, s + DECODE_STEPS, dh))
    k_cache[:, :, :s] = torch.from_numpy(cache.keys(0)[None, :, :s].astype(DTYPE))
    v_cache[:, :, :s] = torch.from_numpy(cache.values(0)[None, :, :s].astype(DTYPE))
    ttokens = torch.from_numpy(tokens)

    def run_torch():
        with torch.inference_mode():
            for i in range(DECODE_STEPS):
                x, pos = ttokens[i], s + i
                q = F.linear(x, wq, bq).view(1, 1, h, dh).transpose(1, 2)
                k_cache[:, :, pos : pos + 1] = F.linear(x, wk, bk).view(1, 1, hkv, dh).transpose(1, 2)
                v_cache[:, :, pos : pos + 1] = F.linear(x, wv, bv).view(1, 1, hkv, dh).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1], enable_gqa=hkv != h
                )
                out = F.linear(o.transpose(1, 2).reshape(1, 1, e), wo, bo)
        return out

    return run_torch


def interleaved(fns, args, contexts=None) -> dict:
    """name -> (timing, result) of each callable, timed in args.rounds alternating blocks
    (time_interleaved); a failure is raised."""
    return time_interleaved(
        fns,
        rounds=args.rounds,
        min_time=args.min_time,
        min_runs=args.min_runs,
        warmup=WARMUP,
        contexts=contexts,
        raise_errors=True,
    )


def gemm_row(pyattn, case: GemmCase, args, peak) -> dict:
    """Time pyattn._core.linear (pre-packed), np.matmul and torch.mm (when installed) on one GEMM shape."""
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((case.m, case.k), dtype=DTYPE)
    w = (rng.standard_normal((case.n, case.k)) / np.sqrt(case.k)).astype(DTYPE)
    packed, panel = pyattn._core.pack_weights(w)
    # pyattn's output on a cache line, as the layer's own intermediates are (its C stores are whole
    # lines then); NumPy's as NumPy allocates it, torch's as torch.empty does (64-byte aligned).
    out = pyattn._arrays.allocate((case.m, case.n), DTYPE, "out")
    out_np = np.empty((case.m, case.n), dtype=DTYPE)
    w_t = w.T
    fns = {
        "pyattn": lambda: pyattn._core.linear(x, packed, panel, case.n, None, out, args.threads),
        "numpy": lambda: np.matmul(x, w_t, out=out_np),
    }
    if args.torch:
        import torch

        torch.set_num_threads(args.threads)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        out_torch = torch.empty((case.m, case.n), dtype=torch.float32)
        fns["torch"] = lambda: torch.mm(tx, tw.t(), out=out_torch)
    timed = interleaved(fns, args, contexts={"numpy": args.blas_limit})
    t_pyattn, t_numpy = timed["pyattn"][0], timed["numpy"][0]
    t_torch = timed["torch"][0] if args.torch else None

    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    gflops = case.flops / t_pyattn.median / 1e9
    return {
        "case": case.name,
        "m": case.m,
        "n": case.n,
        "k": case.k,
        "flops": case.flops,
        **pyattn_timing(t_pyattn),
        "gflops": gflops,
        "pct_fma_peak": 100 * gflops / peak if peak else None,
        "max_abs_err": max_abs_diff(out, exact),
        "numpy_ms": t_numpy.median * 1e3,
        "numpy_gflops": case.flops / t_numpy.median / 1e9,
        "numpy_vs_pyattn": t_numpy.median / t_pyattn.median,
        "numpy_max_abs_err": max_abs_diff(out_np, exact),
        "torch_ms": None if t_torch is None else t_torch.median * 1e3,
        "torch_gflops": None if t_torch is None else case.flops / t_torch.median / 1e9,
        "torch_vs_pyattn": None if t_torch is None else t_torch.median / t_pyattn.median,
        "torch_max_abs_err": None if t_torch is None else max_abs_diff(out_torch.numpy(), exact),
    }


def measure_peak(pyattn, args, readings: int = 3) -> tuple[float, float | None]:
    """The rows' ceiling (args.ceiling: the FMA peak, float32, or with --dtype bfloat16 on an ISA that
    has one the bfloat16 dot-product peak; GFLOP/s, pyattn's ISA): the best of `readings` readings, and
    the background load during that reading. Any reading can come out low (other processes, or the
    hypervisor taking the CPU, which /proc/stat does not show as busy), and a ceiling is what the best
    reading says."""
    measure = getattr(machine(pyattn), args.ceiling)
    best, busy = 0.0, None
    for _ in range(readings):
        settle()
        with BackgroundLoad() as load:
            peak = float(measure(args.threads, 0.1 if args.quick else 0.5))
        if peak > best:
            best, busy = peak, load.cpus
    return best, busy


def rescale_peak(results: dict[str, list[dict]], old_peak: float, new_peak: float) -> None:
    """Recompute every row's %peak against `new_peak` (rows were printed with `old_peak`)."""
    for rows in results.values():
        for row in rows:
            for key in ("pct_fma_peak", "pct_peak"):
                if row.get(key) is not None:
                    row[key] *= old_peak / new_peak


def guarded(run, pyattn, case, args, peak) -> dict:
    """run(...) under a BackgroundLoad monitor; the row gets "background_cpus" and "attempts". With
    --wait-idle, wait for idle CPUs first and redo a disturbed row (at most ROW_RETRIES times)."""
    for attempt in range(1 + (ROW_RETRIES if args.wait_idle > 0 else 0)):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            row = run(pyattn, case, args, peak)
        row["background_cpus"], row["attempts"] = load.cpus, attempt + 1
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
        print(f"  note: {row['case']}: other processes used {load.cpus:.1f} CPUs", file=sys.stderr)
    return row


# ----------------------------------------------------------------------------------------------
# Tables


LAYER_TABLE = Table(
    [
        Column("layer", 17, right=False),
        Column("pyattn ms", 9),
        Column("min ms", 7),
        Column("GFLOP/s", 7),
        Column("%peak", 5),
        Column("max err", 7),
        Column("vs", 5, right=False),
        Column("mha ms", 7),
        Column("mha/layer", 9),
        Column("numpy ms", 8),
        Column("numpy x", 7),
        Column("torch ms", 8),
        Column("torch x", 7),
        Column("ref ms", 7),
        Column("ref x", 5),
        Column("bg", 3),
    ]
)
LAYER_BF16_TABLE = Table(
    [
        Column("layer", 17, right=False),
        Column("pyattn ms", 9),
        Column("min ms", 7),
        Column("GFLOP/s", 7),
        Column("%peak", 5),
        Column("max err", 7),
        Column("torch err", 7),
        Column("err/torch", 5),
        Column("f32 ms", 7),
        Column("f32/bf16", 5),
        Column("f32 err", 7),
        Column("torch ms", 8),
        Column("torch x", 7),
        Column("bg", 3),
    ]
)
GEMM_TABLE = Table(
    [
        Column("M x N x K", 15, right=False),
        Column("pyattn ms", 9),
        Column("GFLOP/s", 7),
        Column("%peak", 5),
        Column("max err", 7),
        Column("numpy ms", 8),
        Column("numpy GF/s", 10),
        Column("numpy x", 7),
        Column("torch ms", 8),
        Column("torch GF/s", 10),
        Column("torch x", 7),
        Column("bg", 3),
    ]
)


DECODE_TABLE = Table(
    [
        Column("decode step", 27, right=False),
        Column("pyattn ms", 9),
        Column("min ms", 7),
        Column("GB/s", 5),
        Column("max err", 7),
        Column("mha ms", 7),
        Column("mha/layer", 9),
        Column("torch ms", 8),
        Column("torch x", 7),
        Column("bg", 3),
    ]
)


def decode_cells(row: dict) -> list[str]:
    return [
        row["case"],
        fmt_ms(row["pyattn_ms"]),
        fmt_ms(row["pyattn_min_ms"]),
        fmt(row["gbs"], ".1f"),
        fmt(row["max_abs_err"], ".1e"),
        fmt_ms(row["function_ms"]),
        fmt(row["function_vs_pyattn"], ".2f"),
        fmt_ms(row["torch_ms"]),
        fmt(row["torch_vs_pyattn"], ".2f"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


def layer_cells(row: dict) -> list[str]:
    return [
        row["case"],
        fmt_ms(row["pyattn_ms"]),
        fmt_ms(row["pyattn_min_ms"]),
        fmt(row["gflops"], ".1f"),
        fmt(row["pct_fma_peak"], ".0f"),
        fmt(row["max_abs_err"], ".1e"),
        row["err_vs"],
        fmt_ms(row["function_ms"]),
        fmt(row["function_vs_pyattn"], ".2f"),
        fmt_ms(row["numpy_ms"]),
        fmt(row["numpy_vs_pyattn"], ".2f"),
        fmt_ms(row["torch_ms"]),
        fmt(row["torch_vs_pyattn"], ".2f"),
        fmt_ms(row["reference_ms"]),
        fmt(row["reference_vs_pyattn"], ".1f"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


def layer_bf16_cells(row: dict) -> list[str]:
    return [
        row["case"],
        fmt_ms(row["pyattn_ms"]),
        fmt_ms(row["pyattn_min_ms"]),
        fmt(row["gflops"], ".1f"),
        fmt(row["pct_peak"], ".0f"),
        fmt(row["max_abs_err"], ".1e"),
        fmt(row["torch_max_abs_err"], ".1e"),
        fmt(row["err_vs_torch"], ".2f"),
        fmt_ms(row["f32_ms"]),
        fmt(row["f32_vs_bf16"], ".2f"),
        fmt(row["f32_max_abs_err"], ".1e"),
        fmt_ms(row["torch_ms"]),
        fmt(row["torch_vs_pyattn"], ".2f"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


def gemm_cells(row: dict) -> list[str]:
    return [
        row["case"],
        fmt_ms(row["pyattn_ms"]),
        fmt(row["gflops"], ".1f"),
        fmt(row["pct_fma_peak"], ".0f"),
        fmt(row["max_abs_err"], ".1e"),
        fmt_ms(row["numpy_ms"]),
        fmt(row["numpy_gflops"], ".1f"),
        fmt(row["numpy_vs_pyattn"], ".2f"),
        fmt_ms(row["torch_ms"]),
        fmt(row["torch_gflops"], ".1f"),
        fmt(row["torch_vs_pyattn"], ".2f"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the pyattn multi-head attention layer and its projection GEMM against PyTorch "
        "and NumPy (float32, same thread count).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ENVIRONMENT_HELP.format(script="bench/bench_mha.py"),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: layers {', '.join(QUICK_LAYERS)}, decode steps {', '.join(QUICK_DECODE)}, few runs (< 40 s)",
    )
    parser.add_argument(
        "--layers",
        default=None,
        help="comma-separated filters; a layer (and its GEMM shapes) or decode step runs if a filter is a "
        f"substring of its name (names: {', '.join(c.name for c in LAYER_SUITE + DECODE_SUITE)}; "
        "e.g. --layers 'B1 L128,E384,bfloat16')",
    )
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM table")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode-step table")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer table")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="layer dtype (default %(default)s). bfloat16 (ml_dtypes): the layer table only, pyattn's bfloat16 "
        "layer against its float32 layer on the same values and torch's bfloat16 nn.MultiheadAttention",
    )
    add_common_arguments(
        parser,
        TIMING,
        seed_of="weights and inputs",
        wait_idle_help="shared machines: before each row wait up to SECONDS for other processes to go idle",
        tables="tables",
    )
    args = parser.parse_args(argv)
    resolve_common_arguments(args, parser, TIMING)
    return args


def print_header(info: dict) -> None:
    rt = info["pyattn"]
    half = info["dtype"] == "bfloat16"
    peak = info[info["peak_ceiling"]]
    print(f"pyattn bench_mha   {info['date']}")
    print(f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs); threads, every library: {info['threads']}")
    print(
        f"pyattn {rt.get('version')}: isa={rt.get('isa')} available={rt.get('available_isas')} "
        f"openmp={rt.get('openmp')} compiler={rt.get('compiler')}"
    )
    print(
        f"numpy {np.__version__} ({info['numpy_blas']}); "
        f"torch {info['torch'] or 'not installed (peer skipped: its columns show -)'}"
    )
    print_peer_isa(info["peer_isa_env"])
    if info["peak_ceiling"] == "dot16_peak_gflops":
        ceiling = "bfloat16 dot-product peak"
        print(f"{ceiling} (measured now, vdpbf16ps, pyattn's ISA): {peak:.1f} GFLOP/s; %peak is of it")
    else:
        ceiling = "FMA peak"
        print(f"FMA peak (measured now, float32, pyattn's ISA): {peak:.1f} GFLOP/s", end="")
        print(f"; %peak is of it: {info['dot16_peak_note']}" if half else "")
    peak_busy = info[info["peak_ceiling"].replace("_gflops", "_background_cpus")]
    if peak_busy is not None and peak_busy > BUSY_WARN_CPUS:
        print(f"WARNING: {peak_busy:.1f} CPUs were busy while measuring the {ceiling}; %peak is overstated")
    for line in openblas_env_warnings():
        print(line)
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
    if half:
        print_bf16_definitions(info, ceiling)
        print()
        return
    print(
        "float32; ms = median over runs after warm-up (min ms = fastest); each library timed in its own blocks, "
        "--rounds alternating blocks per row"
    )
    print("layer GFLOP/s = (8*B*L*E^2 [Q,K,V,out projections, 2*M*N*K each] + 4*B*H*L*S*Dh [attention]) / time")
    print("GEMM GFLOP/s = 2*M*N*K / time; %peak = of the FMA peak above")
    print(
        "'<peer> x' = peer ms / pyattn ms (> 1: pyattn faster); numpy = the layer in float32 NumPy (np.matmul "
        "projections, batched-matmul attention); torch = nn.MultiheadAttention (eval, inference_mode, "
        "need_weights=False); ref = pyattn.reference.mha (float64 NumPy)"
    )
    print(
        f"layer max err vs 'ref' (float64 reference, L <= {REFERENCE_MAX_LEN}) or 'torch' (float32; 'numpy' "
        "without torch); GEMM max err vs a float64 matmul; decode max err vs a float64 step"
    )
    print()


def print_bf16_definitions(info: dict, ceiling: str) -> None:
    """The --dtype bfloat16 header's definitions (the layer table only)."""
    dots = info["bf16_projections"]
    print(
        "dtype bfloat16 (ml_dtypes): weights and x drawn in float32 and rounded to bfloat16; pyattn = "
        "MultiHeadAttention(dtype=bfloat16), whose projections on this ISA compute with: "
        + (
            "bfloat16 dot products (float32 sums)"
            if dots
            else "float32 (the float32 layer over the bfloat16 values, output rounded to bfloat16)"
        )
    )
    print(
        "ms = median over runs after warm-up (min ms = fastest); each library timed in its own blocks, "
        "--rounds alternating blocks per row"
    )
    print(
        "layer GFLOP/s = (8*B*L*E^2 [Q,K,V,out projections, 2*M*N*K each] + 4*B*H*L*S*Dh [attention]) / time; "
        f"%peak = of the {ceiling} above (the attention computes in float32 either way)"
    )
    print(
        "f32 ms = pyattn's float32 layer on the same (bfloat16-valued) weights and x, timed in the same "
        "alternating blocks; f32/bf16 = f32 ms / pyattn ms (> 1: the bfloat16 layer is faster)"
    )
    print(
        "'torch x' = torch ms / pyattn ms (> 1: pyattn faster); torch = nn.MultiheadAttention .to(torch.bfloat16) "
        "(eval, inference_mode, need_weights=False) on torch.from_numpy(x's float32 values).to(torch.bfloat16) "
        "(not timed)"
    )
    print(
        "max err = max|pyattn bfloat16 - pyattn.reference.mha (float64, on the bfloat16 values)| over the whole "
        "output; torch err = the same for torch's bfloat16 output; err/torch = max err / torch err (the accuracy "
        "target: <= 1.5); f32 err = the same for the float32 layer"
    )
    print(
        f"wrong result (exit status 1): max err > {BF16_ERR_ATOL:g} + {BF16_ERR_RTOL:g} * max|reference|, or "
        f"f32 err > {WRONG_ANSWER_ERR:g}"
    )
    print(
        "not run on bfloat16: numpy (NumPy has no bfloat16 matmul), the timed reference, the GEMM and decode "
        "tables (theirs: --dtype float32)"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    pyattn = import_pyattn(args.isa, "bench_mha")
    peer_env = limit_peer_isa(args.isa, args.peers_isa)  # before torch is imported
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # an optional peer (not a bench dependency): its columns show "-"
        torch_version = None
    args.torch = torch_version is not None
    if not hasattr(pyattn, "MultiHeadAttention"):
        sys.exit("bench_mha: this pyattn has no MultiHeadAttention")
    half = args.dtype == "bfloat16"
    args.bf16 = bfloat16_dtype("bench_mha") if half else None
    args.bf16_dots = pyattn.runtime_info().get("precision_fast") == BF16_DOTS
    layers = [c for c in LAYER_SUITE if c.name in QUICK_LAYERS] if args.quick else list(LAYER_SUITE)
    decodes = [c for c in DECODE_SUITE if c.name in QUICK_DECODE] if args.quick else list(DECODE_SUITE)
    if args.layers:
        filters = [f.strip() for f in args.layers.split(",") if f.strip()]
        layers = [c for c in layers if any(f in c.name for f in filters)]
        decodes = [c for c in decodes if any(f in c.name for f in filters)]
        if not layers and not decodes:
            sys.exit("bench_mha: no layer or decode step matches --layers")
    if half:  # the layer table only
        if args.no_layer or not layers:
            sys.exit("bench_mha: --dtype bfloat16 runs layer rows only, and none is selected")
        decodes = []
        args.no_gemm = args.no_decode = True
    gemms = gemm_suite(layers)
    args.blas_limit, blas_threads = blas_thread_limiter(args.threads)

    busy = wait_for_idle(args.wait_idle)
    args.ceiling, dot16_note = "fma_peak_gflops", None
    if half:  # %peak of the bfloat16 dot product where pyattn's ISA has one, else of the FMA
        dot16_note = f"ISA {pyattn.get_isa()} has no bfloat16 dot product"
        if hasattr(machine(pyattn), "dot16_peak_gflops"):
            args.ceiling = "dot16_peak_gflops"
        else:
            dot16_note = "pyattn._machine.dot16_peak_gflops missing"
    try:
        peak, peak_busy = measure_peak(pyattn, args)
    except ValueError:  # dot16_peak_gflops on an ISA without the instruction
        args.ceiling = "fma_peak_gflops"
        peak, peak_busy = measure_peak(pyattn, args)
    info = {
        "date": now_iso(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": args.threads,
        "pyattn": dict(pyattn.runtime_info()),
        "numpy_blas": f"{numpy_blas_name()}; BLAS threads: {blas_threads}",
        "torch": torch_version,
        "dtype": args.dtype,
        "peak_ceiling": args.ceiling,
        args.ceiling: peak,
        args.ceiling.replace("_gflops", "_background_cpus"): peak_busy,
        "busy_cpus_before": busy,
        "peer_isa_env": peer_env,
        "env": {
            k: os.environ[k]
            for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "PYATTN_ISA")
            if k in os.environ
        },
        "quick": args.quick,
        "min_time_s": args.min_time,
        "min_runs": args.min_runs,
        "rounds": args.rounds,
        "seed": args.seed,
    }
    if half:
        info["bf16_projections"] = args.bf16_dots
        if args.ceiling != "dot16_peak_gflops":
            info["dot16_peak_note"] = dot16_note
    print_header(info)

    results: dict[str, list[dict]] = {"layer": [], "gemm": [], "decode": []}
    layer_table, cells_of, run_layer = (
        (LAYER_BF16_TABLE, layer_bf16_cells, layer_bf16_row) if half else (LAYER_TABLE, layer_cells, layer_row)
    )
    if not args.no_layer:
        print("Layer: self-attention, x (B, L, E), no mask" + (", bfloat16" if half else ""))
        print(layer_table.header(), flush=True)
        for case in layers:
            row = guarded(run_layer, pyattn, case, args, peak)
            results["layer"].append(row)
            print(layer_table.add(cells_of(row)), flush=True)
        print()
    if not args.no_gemm:
        print("GEMM: out (M, N) = x (M, K) @ w.T, pyattn weights pre-packed, no bias")
        print(GEMM_TABLE.header(), flush=True)
        for case in gemms:
            row = guarded(gemm_row, pyattn, case, args, peak)
            results["gemm"].append(row)
            print(GEMM_TABLE.add(gemm_cells(row)), flush=True)
    if not args.no_decode and decodes:
        print(
            f"\nDecode step: one token through the layer over a KV cache (batch 1), ms per token, "
            f"{DECODE_STEPS} tokens per timed call"
        )
        print(DECODE_TABLE.header(), flush=True)
        for case in decodes:
            row = guarded(decode_row, pyattn, case, args, peak)
            results["decode"].append(row)
            print(DECODE_TABLE.add(decode_cells(row)), flush=True)

    # The peak again, after the rows: if this reading is higher, the first one was disturbed.
    end_peak, _ = measure_peak(pyattn, args, readings=1)
    info[f"{args.ceiling}_end"] = end_peak
    if end_peak > peak:
        name = "bfloat16 dot-product peak" if args.ceiling == "dot16_peak_gflops" else "FMA peak"
        print(f"\n{name} re-measured after the rows: {end_peak:.1f} GFLOP/s (was {peak:.1f});", end=" ")
        print("%peak in the Markdown and JSON output uses the higher value")
        rescale_peak(results, peak, end_peak)
        info[args.ceiling] = end_peak
    if args.markdown:
        for title, table, cells, rows in (
            ("Layer", layer_table, cells_of, results["layer"]),
            ("GEMM", GEMM_TABLE, gemm_cells, results["gemm"]),
            ("Decode step", DECODE_TABLE, decode_cells, results["decode"]),
        ):
            if rows:
                fresh = Table(table.columns)
                for row in rows:
                    fresh.add(cells(row))
                print(f"\n{title}\n")
                print(fresh.markdown())
    status = finish_run(
        info,
        args.json,
        results,
        f"{len(results['layer'])} layer, {len(results['gemm'])} GEMM and {len(results['decode'])} decode rows",
    )
    bad = wrong_f32(results["layer"])
    for line in bad:
        print(f"ERROR: wrong result (max abs error above {WRONG_ANSWER_ERR:g}): {line}", file=sys.stderr)
    notes = [r["case"] for r in results["layer"] if r.get("bf16_is_rounded_f32") is False]
    if notes:
        print(
            "note: without bfloat16 dot products the bfloat16 layer's output is not the float32 layer's rounded "
            f"to bfloat16 on {', '.join(notes)}",
            file=sys.stderr,
        )
    return 1 if bad or status else 0


if __name__ == "__main__":
    sys.exit(main())
