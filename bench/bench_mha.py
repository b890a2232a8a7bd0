# SPDX-License-Identifier: MIT
"""Benchmark the pyattn multi-head attention layer and the GEMM behind its projections.

Run (from the repository root, with pyattn installed in the interpreter's environment; torch is
optional: without it its columns show "-")::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_mha.py            # full suite
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_mha.py --quick    # smoke, < 30 s
    python bench/bench_mha.py --threads 1 --markdown --json out.json

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set, slow NumPy's BLAS (the numpy peers); the script
never changes them, it prints a warning, hence the ``env -u`` above.

Everything is float32 with the same thread count for every library (``--threads``, default
os.cpu_count(); ``torch.set_num_threads``; NumPy's BLAS through threadpoolctl when installed). Each
library is timed in its own blocks (warm-up, then its repetitions, then the next library), never two
at once: two OpenMP runtimes spin-waiting side by side interfere on a small machine. The blocks
alternate (``--rounds`` per row, samples pooled), so a slow spell of the shared machine hits every
library alike.

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
    BackgroundLoad,
    Column,
    Table,
    TimingDefaults,
    add_common_arguments,
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
    resolve_common_arguments,
    time_call,
    time_interleaved,
    wait_for_idle,
)

DTYPE = np.float32
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
        "pyattn_ms": t_pyattn.median * 1e3,
        "pyattn_min_ms": t_pyattn.min * 1e3,
        "pyattn_runs": t_pyattn.runs,
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
        "pyattn_ms": step * 1e3,
        "pyattn_min_ms": t_pyattn.min / DECODE_STEPS * 1e3,
        "pyattn_runs": t_pyattn.runs,
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
        "pyattn_ms": t_pyattn.median * 1e3,
        "pyattn_min_ms": t_pyattn.min * 1e3,
        "pyattn_runs": t_pyattn.runs,
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
    """FMA peak (GFLOP/s, float32, pyattn's ISA): the best of `readings` readings, and the background load
    during that reading. Any reading can come out low (other processes, or the hypervisor taking the
    CPU, which /proc/stat does not show as busy), and a ceiling is what the best reading says."""
    best, busy = 0.0, None
    for _ in range(readings):
        with BackgroundLoad() as load:
            peak = float(machine(pyattn).fma_peak_gflops(args.threads, 0.1 if args.quick else 0.5))
        if peak > best:
            best, busy = peak, load.cpus
    return best, busy


def rescale_peak(results: dict[str, list[dict]], old_peak: float, new_peak: float) -> None:
    """Recompute every row's %peak against `new_peak` (rows were printed with `old_peak`)."""
    for rows in results.values():
        for row in rows:
            if row.get("pct_fma_peak") is not None:
                row["pct_fma_peak"] *= old_peak / new_peak


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
    peak = info["fma_peak_gflops"]
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
    print(f"FMA peak (measured now, float32, pyattn's ISA): {peak:.1f} GFLOP/s")
    peak_busy = info["fma_peak_background_cpus"]
    if peak_busy is not None and peak_busy > BUSY_WARN_CPUS:
        print(f"WARNING: {peak_busy:.1f} CPUs were busy while measuring the FMA peak; %peak is overstated")
    for line in openblas_env_warnings():
        print(line)
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
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
    layers = [c for c in LAYER_SUITE if c.name in QUICK_LAYERS] if args.quick else list(LAYER_SUITE)
    decodes = [c for c in DECODE_SUITE if c.name in QUICK_DECODE] if args.quick else list(DECODE_SUITE)
    if args.layers:
        filters = [f.strip() for f in args.layers.split(",") if f.strip()]
        layers = [c for c in layers if any(f in c.name for f in filters)]
        decodes = [c for c in decodes if any(f in c.name for f in filters)]
        if not layers and not decodes:
            sys.exit("bench_mha: no layer or decode step matches --layers")
    gemms = gemm_suite(layers)
    args.blas_limit, blas_threads = blas_thread_limiter(args.threads)

    busy = wait_for_idle(args.wait_idle)
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
        "fma_peak_gflops": peak,
        "fma_peak_background_cpus": peak_busy,
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
    print_header(info)

    results: dict[str, list[dict]] = {"layer": [], "gemm": [], "decode": []}
    if not args.no_layer:
        print("Layer: self-attention, x (B, L, E), no mask")
        print(LAYER_TABLE.header(), flush=True)
        for case in layers:
            row = guarded(layer_row, pyattn, case, args, peak)
            results["layer"].append(row)
            print(LAYER_TABLE.add(layer_cells(row)), flush=True)
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
    info["fma_peak_gflops_end"] = end_peak
    if end_peak > peak:
        print(f"\nFMA peak re-measured after the rows: {end_peak:.1f} GFLOP/s (was {peak:.1f});", end=" ")
        print("%peak in the Markdown and JSON output uses the higher value")
        rescale_peak(results, peak, end_peak)
        info["fma_peak_gflops"] = end_peak
    if args.markdown:
        for title, table, cells, rows in (
            ("Layer", LAYER_TABLE, layer_cells, results["layer"]),
            ("GEMM", GEMM_TABLE, gemm_cells, results["gemm"]),
            ("Decode step", DECODE_TABLE, decode_cells, results["decode"]),
        ):
            if rows:
                fresh = Table(table.columns)
                for row in rows:
                    fresh.add(cells(row))
                print(f"\n{title}\n")
                print(fresh.markdown())
    return finish_run(
        info,
        args.json,
        results,
        f"{len(results['layer'])} layer, {len(results['gemm'])} GEMM and {len(results['decode'])} decode rows",
    )


if __name__ == "__main__":
    sys.exit(main())
