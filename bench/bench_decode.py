# SPDX-License-Identifier: MIT
"""Benchmark one decode step: attention of a single new token over a KV cache (pyattn.KVCache).

Run (from the repository root, with pyattn installed in the interpreter's environment; torch is
optional)::

    python bench/bench_decode.py                 # full suite (a few minutes, ~6 GiB of memory at 64k)
    python bench/bench_decode.py --quick         # smoke, < 30 s
    python bench/bench_decode.py --threads 1 --markdown --json decode.json
    python bench/bench_decode.py --new-tokens 8    # 8 query tokens per step (speculative decoding)
    python bench/bench_decode.py --cold            # caches evicted before every timed call

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set, slow NumPy's BLAS (the numpy peer); the script never
changes them, it prints a warning: unset them in the command (``env -u OPENBLAS_CORETYPE -u
OPENBLAS_L2_SIZE python bench/bench_decode.py``).

Shapes: B=1 with 32 query heads, 8 (GQA) or 32 (MHA) key/value heads, head_dim 128, and cache
lengths S = 1k, 4k, 16k, 64k; plus B=8 at S=4k. Cache storage float32, float16, bfloat16 and int8
(int8 values with one float32 scale per token and head; its bytes include the scales).

What is timed (the same work in every timed call): a KVCache with max_len = S is pre-filled once with
S - 1 random tokens, then one more token is appended (untimed), so the last appended chunk is that one
token at position S - 1. The timed call is ``cache.attend(q, num_threads=T)`` with q (B, 32, 1, 128)
float32: one query per head over all S cached keys (lower-right causal = every key is visible), the
Python-side argument handling and the output allocation included. With ``--new-tokens N`` the last
appended chunk is N tokens (S - N pre-filled) and q is (B, 32, N, 128): a step of speculative
decoding or a short prefill chunk, lower-right causal (new token i sees the S - N cached keys and
new tokens 0..i). attend() does not modify the
cache, so every repetition reads exactly the same S keys and values.

Warm or cold: by default the calls repeat back to back, so K and V that fit in the last-level cache
(a few MiB to ~100 MiB, depending on the CPU) are read from it, not from memory, from the second call
on. In a model, the step of one layer comes after the steps of all the others, whose K/V caches and
weights have passed through the CPU caches in between: this layer's K/V come from memory. With
``--cold`` every timed call (every library's alike) is preceded, untimed, by one pass of the same
library's threads over a buffer of twice the last-level cache plus every core's L2, at least 256 MiB
(pyattn: ``_machine.read_buffers_gbs(..., repeats=1)``; torch: ``Tensor.sum``), which evicts them (the
practice of GPU benchmarks such as ``triton.testing.do_bench``, which clears the L2 before each run).
Each library evicts with its own threads, so that no other thread pool is still spinning when its
call starts. NumPy is the exception: it has no threads of its own to read a buffer with (its
reductions run on one thread; its BLAS pool runs only inside BLAS calls), so the numpy peer's calls
are preceded by pyattn's pass.

Peers (each library timed in its own blocks, with a pause before each block: two OpenMP runtimes
spin-waiting side by side interfere on a machine with few cores; the peers and every cache dtype
take turns in --rounds alternating blocks per shape, samples pooled, so that a slow spell of the
machine hits all of them alike). Both peers read the float32 cache and are timed once per shape, in
float32: the 16-bit rows compare pyattn's 16-bit cache against those same float32 times.

* numpy (always): ``_common.numpy_attention``, float32 NumPy on the float32 cache's own memory
  (``cache.keys()``/``values()``, contiguous views): q viewed as (B, Hkv, group * N, 128) so that
  each K/V head serves its group of query heads in one batched matmul, scores = q K^T * scale, the
  lower-right causal mask when N > 1 (built outside the timed call), max-subtracted exp, matmul
  with V, division by the sums. Its BLAS threads are limited to T through threadpoolctl when
  installed (else the header says how many it uses);
* torch (when installed; its columns show "-" otherwise):
  ``torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` (with
  ``attn_mask=torch.nn.attention.bias.causal_lower_right(N, S)`` when N > 1) under
  ``torch.inference_mode()`` and ``torch.set_num_threads(T)``, on the float32 cache's own memory
  (``torch.from_numpy(cache.keys())``, no copy);
* ref: ``pyattn.reference.scaled_dot_product_attention`` (float64 NumPy) on the cache's stored values
  (already rounded for 16-bit caches), only where B*S <= 4096: it is the error yardstick, and its time
  is shown for scale, not as a tuned peer.

Columns: ms = median over runs after warm-up (runs repeat until --min-time s and --min-runs runs);
GB/s = bytes of K and V actually stored for the S filled tokens (B*Hkv*S*(D+Dv)*itemsize of the
storage dtype; each K/V row is read once per GQA group) / median time; %bw = of the streaming read
bandwidth measured at start-up in the same run (``pyattn._machine.read_bandwidth_gbs(T, 1 << 30)``);
rows whose K+V fit in the last-level cache can exceed 100%. read = GB/s of a plain streaming read of
this row's own K and V arrays (``pyattn._machine.read_buffers_gbs([K, V], T)``, same threads, measured
just before and just after the row, the higher of the two): the ceiling for exactly these pages,
which also reflects whether the OS backed them (and the 1 GiB buffer) with transparent huge pages,
worth up to 2x on some machines; with
--cold, the median of 7 reads, each after the same eviction pass as the timed calls: the ceiling of
these bytes from memory in one call, start-up included; %rd =
GB/s / read, the fraction of that ceiling the decode step reaches. max err = max |pyattn - ref| where the
reference runs, else (float32 rows only) max |pyattn - torch|, or max |pyattn - numpy| without torch
(a float32 peer: it measures agreement, ~1e-7, and still exposes a wrong answer); column "vs" says
which, and a row above 1e-3 or NaN makes the script exit with status 1. The JSON rows also hold
each peer's own error against the reference (torch_max_abs_err, numpy_max_abs_err) where it runs.
numpy ms, torch ms = the peers' medians; numpy x, torch x = peer ms / pyattn ms (> 1: pyattn is
faster); vs f32 = pyattn float32-cache ms / this row's
ms (the speedup of 16-bit or int8 storage at the same length); f32 err = max |this row's output - the
float32 cache's| on the same queries: what the storage's rounding (or int8 quantisation) costs,
beside the kernel's own error in max err (against the reference on the stored values); bg = CPUs
other processes kept busy while the shape ran (rows with bg > 0.2 are noisy; ``--wait-idle SECONDS``
waits for idle CPUs before each shape and redoes disturbed ones).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
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
    pyattn_timing,
    resolve_common_arguments,
    settle,
    settled,
    time_call,
    time_interleaved,
    wait_for_idle,
)

NUM_HEADS = 32
HEAD_DIM = 128
CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")
REFERENCE_MAX_TOKENS = 4096  # the float64 reference runs where batch * S <= this
FILL_CHUNK = 4096  # tokens appended per call while pre-filling (bounds the temporary float32 chunk)
WARMUP = 3
PAUSE = 0.2  # seconds of sleep before each library's block
REDO = 3  # with --wait-idle: times a shape disturbed by other processes is redone
TIMING = TimingDefaults(min_time=0.5, min_runs=20, quick_min_runs=5)  # --min-time / --min-runs


@dataclass(frozen=True)
class Case:
    """One decode step: batch rows, num_kv_heads key/value heads, kv_len cached tokens."""

    batch: int
    num_kv_heads: int
    kv_len: int

    @property
    def name(self) -> str:
        s = f"{self.kv_len // 1024}k" if self.kv_len % 1024 == 0 else str(self.kv_len)
        return f"B{self.batch} Hkv{self.num_kv_heads} S{s}"

    def kv_bytes(self, itemsize: int) -> int:
        return self.batch * self.num_kv_heads * self.kv_len * 2 * HEAD_DIM * itemsize

    @property
    def has_reference(self) -> bool:
        return self.batch * self.kv_len <= REFERENCE_MAX_TOKENS


SUITE = tuple(
    [Case(1, hk, s) for hk in (8, 32) for s in (1024, 4096, 16384, 65536)] + [Case(8, hk, 4096) for hk in (8, 32)]
)
QUICK = (Case(1, 8, 1024), Case(1, 32, 4096), Case(8, 8, 4096))


# ----------------------------------------------------------------------------------------------
# Inputs


def storage_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def filled_cache(pyattn, case: Case, dtype_name: str, rng, new_tokens: int, source=None):
    """A KVCache (max_len = S) holding S - N tokens plus N appended ones (the last chunk: N tokens).

    Values are random normal, appended FILL_CHUNK tokens at a time, or copied (converted) from the
    float32 cache `source`, so at most one chunk of temporaries exists besides the caches.
    """
    b, hk, s = case.batch, case.num_kv_heads, case.kv_len
    cache = pyattn.KVCache(b, hk, HEAD_DIM, s, dtype=dtype_name)

    def chunk(start, stop):
        if source is not None:
            return source.keys()[:, :, start:stop], source.values()[:, :, start:stop]
        shape = (b, hk, stop - start, HEAD_DIM)
        return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)

    for start in range(0, s - new_tokens, FILL_CHUNK):
        cache.append(*chunk(start, min(start + FILL_CHUNK, s - new_tokens)))
    cache.append(*chunk(s - new_tokens, s))  # the new tokens: attend() works on this chunk
    assert cache.lengths.tolist() == [s] * b
    return cache


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------------------------
# Rows


def torch_step(q, cache):
    """torch SDPA (enable_gqa, inference_mode) on the float32 cache's memory, as a callable; lower-right
    causal (torch's CausalBias) when q has more than one token."""
    import torch

    tq, tk, tv = torch.from_numpy(q), torch.from_numpy(cache.keys()), torch.from_numpy(cache.values())
    mask = None
    if q.shape[2] > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[2], tk.shape[2])

    def run():
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

    return run


def numpy_step(q, cache):
    """_common.numpy_attention on the float32 cache's memory, as a callable; the lower-right causal
    mask (query i sees keys j <= S - N + i) is built here, outside the timing, when q has N > 1 tokens."""
    keys, values = cache.keys(), cache.values()
    n, s = q.shape[2], keys.shape[2]
    allowed = np.arange(s)[None, :] <= np.arange(n)[:, None] + (s - n) if n > 1 else None
    scale = 1.0 / np.sqrt(HEAD_DIM)
    return lambda: numpy_attention(q, keys, values, allowed, scale)


def time_reference(pyattn, q, cache, timing):
    """The float64 reference on the cache's stored K/V (float64 copies made outside the timing)."""
    keys, values = cache.keys().astype(np.float64), cache.values().astype(np.float64)
    return time_call(
        lambda: pyattn.reference.scaled_dot_product_attention(
            q, keys, values, enable_gqa=True, is_causal="lower_right"
        ),
        **timing,
    )


COLD_READS = 7  # --cold: evicted plain reads of a row's K and V per measurement of its "read" ceiling


def stored_arrays(cache) -> list:
    """The arrays a step over the cache reads, as bytes: K and V (max_len == S: the whole storage),
    and an int8 cache's row scales."""
    arrays = [cache._k, cache._v]
    if cache.dtype == np.int8:
        arrays += [cache._k_scales, cache._v_scales]
    return [a.reshape(-1).view(np.uint8) for a in arrays]


def stored_bytes(cache) -> int:
    return sum(a.nbytes for a in stored_arrays(cache))


def kv_read_gbs(pyattn, cache, threads, flush=None) -> float:
    """A plain streaming read of the cache's K and V arrays (any dtype, ml_dtypes too), best of five.
    With flush (--cold), the median of COLD_READS reads, each after the eviction pass the timed calls
    get: the ceiling those calls face, these bytes from memory in one pass with the same start-up (the
    first misses of every thread) that a short step pays. A median, like the timed calls, because
    how much of the K/V an eviction pass leaves in the last-level cache varies from pass to pass."""
    arrays = stored_arrays(cache)
    if flush is None:
        return float(settled(machine(pyattn).read_buffers_gbs, arrays, threads))
    settle()
    reads = []
    for _ in range(COLD_READS):
        machine(pyattn).read_buffers_gbs([flush], threads, repeats=1)
        reads.append(float(machine(pyattn).read_buffers_gbs(arrays, threads, repeats=1)))
    return float(np.median(reads))


def evictors(pyattn, args, names) -> dict | None:
    """With --cold: per timed callable, the untimed pass over args.flush that precedes each of its
    calls, made with that library's own threads; pyattn's for the numpy peer, NumPy having none to
    read a buffer with (see the module docstring)."""
    if args.flush is None:
        return None

    def by_pyattn():
        machine(pyattn).read_buffers_gbs([args.flush], args.threads, repeats=1)

    before = dict.fromkeys(names, by_pyattn)
    if "torch" in before:
        import torch

        flush_t = torch.from_numpy(args.flush.view(np.float32))
        before["torch"] = lambda: float(flush_t.sum())
    return before


def case_rows(pyattn, case: Case, args, bandwidth) -> list[dict]:
    """All rows of one shape: pyattn per cache dtype and the peers (float32 cache: numpy, torch when
    installed) timed in alternating blocks (time_interleaved), the reference if small."""
    rng = np.random.default_rng(args.seed)
    q = rng.standard_normal((case.batch, NUM_HEADS, args.new_tokens, HEAD_DIM), dtype=np.float32)
    t0 = time.perf_counter()
    f32 = filled_cache(pyattn, case, "float32", rng, args.new_tokens)
    fill_s = time.perf_counter() - t0
    caches = {
        name: f32 if name == "float32" else filled_cache(pyattn, case, name, rng, args.new_tokens, source=f32)
        for name in args.dtypes
    }
    read_before = {name: kv_read_gbs(pyattn, c, args.threads, args.flush) for name, c in caches.items()}

    # The peers on the float32 cache's memory (max_len == S, so keys()/values() are contiguous views).
    fns = {}
    if args.torch:
        import torch

        torch.set_num_threads(args.threads)
        fns["torch"] = torch_step(q, f32)
    fns["numpy"] = numpy_step(q, f32)
    for name, cache in caches.items():
        fns[name] = lambda c=cache: c.attend(q, num_threads=args.threads)
    timed = time_interleaved(
        fns,
        rounds=args.rounds,
        min_time=args.min_time,
        min_runs=args.min_runs,
        warmup=WARMUP,
        settle=PAUSE,
        contexts={"numpy": args.blas_limit},
        raise_errors=True,
        before=evictors(pyattn, args, fns),
    )
    t_numpy, numpy_out = timed["numpy"]
    t_torch, torch_out = timed["torch"] if args.torch else (None, None)
    torch_out = None if torch_out is None else torch_out.numpy()
    # Without a float64 reference (large shapes), the float32 row is checked against a float32 peer.
    peer_name, peer_out = ("torch", torch_out) if args.torch else ("numpy", numpy_out)

    rows = []
    f32_ms = None
    for name, cache in caches.items():
        t_pyattn, out = timed[name]
        # Again after: the kernel's khugepaged may have turned the arrays into huge pages meanwhile.
        read_gbs = max(read_before[name], kv_read_gbs(pyattn, cache, args.threads, args.flush))
        ms = t_pyattn.median * 1e3
        nbytes = stored_bytes(cache)
        gbs = nbytes / t_pyattn.median / 1e9
        row = {
            "case": case.name,
            "batch": case.batch,
            "num_heads": NUM_HEADS,
            "num_kv_heads": case.num_kv_heads,
            "head_dim": HEAD_DIM,
            "kv_len": case.kv_len,
            "new_tokens": args.new_tokens,
            "cold": args.flush is not None,
            "cache_dtype": name,
            "kv_bytes": nbytes,
            **pyattn_timing(t_pyattn),
            "gbs": gbs,
            "pct_read_bw": 100 * gbs / bandwidth if bandwidth else None,
            "own_read_gbs": read_gbs,
            "pct_own_read": 100 * gbs / read_gbs,
            **peer_timing("torch", t_torch, t_pyattn),
            "torch_gbs": None if t_torch is None else case.kv_bytes(4) / t_torch.median / 1e9,
            **peer_timing("numpy", t_numpy, t_pyattn),
            "numpy_gbs": case.kv_bytes(4) / t_numpy.median / 1e9,
            "vs_f32_cache": None,
            "reference_ms": None,
            "max_abs_err": None,
            "err_vs": None,
            "torch_max_abs_err": None,
            "numpy_max_abs_err": None,
            # The storage's own error: this row's output against the float32 cache's, same queries.
            "vs_f32_err": None
            if name == "float32"
            else max_abs_diff(out, timed["float32"][1])
            if "float32" in timed
            else None,
            "fill_s": fill_s,
        }
        if name == "float32":
            f32_ms = ms
        elif f32_ms is not None:
            row["vs_f32_cache"] = f32_ms / ms
        if case.has_reference:
            ref_timing = dict(min_runs=min(args.min_runs, 3), warmup=0, min_time=0.0, settle=PAUSE)
            t_ref, ref = time_reference(pyattn, q, cache, ref_timing)
            row["reference_ms"] = t_ref.median * 1e3
            row["max_abs_err"], row["err_vs"] = max_abs_diff(out, ref), "ref"
            if name == "float32":
                row["torch_max_abs_err"] = None if torch_out is None else max_abs_diff(torch_out, ref)
                row["numpy_max_abs_err"] = max_abs_diff(numpy_out, ref)
        elif name == "float32":
            row["max_abs_err"], row["err_vs"] = max_abs_diff(out, peer_out), peer_name
        rows.append(row)
    return rows


def guarded_rows(pyattn, case: Case, args, bandwidth) -> list[dict]:
    """case_rows under a BackgroundLoad monitor (rows get "background_cpus"). With --wait-idle, a shape
    disturbed by other processes is redone (after waiting for idle CPUs) up to REDO times."""
    for attempt in range(1 + (REDO if args.wait_idle > 0 else 0)):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            rows = case_rows(pyattn, case, args, bandwidth)
        for row in rows:
            row["background_cpus"] = load.cpus
            row["attempt"] = attempt + 1
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
        print(f"  note: {case.name}: other processes used {load.cpus:.1f} CPUs", file=sys.stderr)
    return rows


def measure_bandwidth(pyattn, args) -> tuple[float, float | None]:
    """Streaming read bandwidth (GB/s) of a 1 GiB buffer and the background load while measuring;
    redone like a disturbed shape."""
    for _ in range(1 + (REDO if args.wait_idle > 0 else 0)):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            gbs = float(machine(pyattn).read_bandwidth_gbs(args.threads, 1 << 30))
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
    return gbs, load.cpus


# ----------------------------------------------------------------------------------------------
# Table

TABLE = Table(
    [
        Column("case", 14, right=False),
        Column("cache", 8, right=False),
        Column("K+V MiB", 7),
        Column("ms", 7),
        Column("GB/s", 5),
        Column("%bw", 4),
        Column("read", 5),
        Column("%rd", 4),
        Column("max err", 7),
        Column("vs", 5, right=False),
        Column("numpy ms", 8),
        Column("numpy x", 7),
        Column("torch ms", 8),
        Column("torch x", 7),
        Column("vs f32", 6),
        Column("f32 err", 7),
        Column("ref ms", 7),
        Column("bg", 3),
    ]
)


def cells(row: dict) -> list[str]:
    return [
        row["case"],
        row["cache_dtype"],
        fmt(row["kv_bytes"] / 2**20, ".0f"),
        fmt_ms(row["pyattn_ms"]),
        fmt(row["gbs"], ".1f"),
        fmt(row["pct_read_bw"], ".0f"),
        fmt(row["own_read_gbs"], ".1f"),
        fmt(row["pct_own_read"], ".0f"),
        fmt(row["max_abs_err"], ".1e"),
        row["err_vs"] or "-",
        fmt_ms(row["numpy_ms"]),
        fmt(row["numpy_vs_pyattn"], ".2f"),
        fmt_ms(row["torch_ms"]),
        fmt(row["torch_vs_pyattn"], ".2f"),
        fmt(row["vs_f32_cache"], ".2f"),
        fmt(row.get("vs_f32_err"), ".1e"),
        fmt_ms(row["reference_ms"]),
        fmt(row.get("background_cpus"), ".1f"),
    ]


# ----------------------------------------------------------------------------------------------
# Command line


def parse_case(text: str) -> Case:
    """'1x8x64k' -> Case(batch=1, num_kv_heads=8, kv_len=65536)."""
    batch, kv_heads, length = text.strip().lower().split("x")
    kv_len = int(length[:-1]) * 1024 if length.endswith("k") else int(length)
    case = Case(int(batch), int(kv_heads), kv_len)
    if min(case.batch, case.num_kv_heads, case.kv_len) < 1 or NUM_HEADS % case.num_kv_heads:
        raise ValueError(text)
    return case


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time one decode step (1 query token over a KV cache) with pyattn.KVCache.attend for "
        "float32/float16/bfloat16 caches, against float32 NumPy, torch SDPA (float32, when installed) and the "
        "float64 NumPy reference.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ENVIRONMENT_HELP.format(script="bench/bench_decode.py"),
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test: {', '.join(c.name for c in QUICK)}, few runs (< 30 s)"
    )
    parser.add_argument(
        "--cases",
        default=None,
        metavar="BxHKVxS,...",
        help="run only these shapes, e.g. 1x8x64k,8x32x4096 (batch x kv heads x cache length; k = 1024)",
    )
    parser.add_argument(
        "--dtypes", default=",".join(CACHE_DTYPES), help="comma-separated cache dtypes (default: %(default)s)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict the CPU caches before every timed call (a layer's step in a many-layer model: its K/V "
        "come from memory); default: calls back to back, K/V that fit stay in the last-level cache",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=1,
        metavar="N",
        help="query tokens per step, the last N of the S cached ones, lower-right causal (speculative "
        "decoding, short prefill chunks; default: %(default)s)",
    )
    add_common_arguments(
        parser,
        TIMING,
        seed_of="the cache contents and queries",
        wait_idle_help="shared machines: before each shape wait up to SECONDS for other processes to go idle, "
        f"and redo a shape they disturbed (up to {REDO} times)",
    )
    args = parser.parse_args(argv)
    resolve_common_arguments(args, parser, TIMING)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in CACHE_DTYPES]
    if unknown or not args.dtypes:
        parser.error(f"--dtypes: choose from {', '.join(CACHE_DTYPES)}, got {args.dtypes}")
    if "float32" in args.dtypes:  # the float32 cache is built anyway (the peers read it); time it first
        args.dtypes.remove("float32")
        args.dtypes.insert(0, "float32")
    if args.cases is not None:
        try:
            args.cases = [parse_case(text) for text in args.cases.split(",") if text.strip()]
        except ValueError:
            parser.error(f"--cases: expected BxHKVxS items like 1x8x64k, got {args.cases!r}")
    args.cases = args.cases or list(QUICK if args.quick else SUITE)
    shortest = min(c.kv_len for c in args.cases)
    if not 1 <= args.new_tokens <= shortest:
        parser.error(f"--new-tokens: expected 1 .. {shortest} (the shortest cache length), got {args.new_tokens}")
    return args


def last_level_cache() -> str:
    """Size of the largest CPU cache of cpu0 as Linux reports it ('?' when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = (0, "?")
    try:
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "level"), encoding="utf-8") as f:
                    level = int(f.read())
                with open(os.path.join(base, entry, "size"), encoding="utf-8") as f:
                    size = f.read().strip()
                best = max(best, (level, f"L{level} {size}"))
    except (OSError, ValueError):
        pass
    return best[1]


def print_header(info: dict) -> None:
    rt = info["pyattn"]
    print(f"pyattn bench_decode   {info['date']}")
    print(
        f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs, last-level cache {info['llc']}); "
        f"threads, every library: {info['threads']}"
    )
    print(
        f"pyattn {rt.get('version')}: isa={rt.get('isa')} available={rt.get('available_isas')} "
        f"openmp={rt.get('openmp')} compiler={rt.get('compiler')}"
    )
    print(
        f"numpy {np.__version__} ({info['numpy_blas']}); "
        f"torch {info['torch'] or 'not installed (peer skipped: its columns show -)'}"
    )
    print_peer_isa(info["peer_isa_env"])
    for line in openblas_env_warnings():
        print(line)
    bandwidth = info["read_bandwidth_gbs"]
    print(f"streaming read bandwidth (measured now, {info['threads']} threads, 1 GiB): {bandwidth:.1f} GB/s")
    bw_busy = info["read_bandwidth_background_cpus"]
    if bw_busy is not None and bw_busy > BUSY_WARN_CPUS:
        print(f"WARNING: other processes used {bw_busy:.1f} CPUs while the bandwidth was measured; %bw is suspect")
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
    n = info["new_tokens"]
    print(
        f"one decode step: q (B, {NUM_HEADS}, {n}, {HEAD_DIM}) float32 over a cache of S tokens (Hkv heads, "
        f"D = Dv = {HEAD_DIM}); timed call = cache.attend(q) after pre-filling S-{n} tokens and appending {n}"
        + (" (lower-right causal)" if n > 1 else "")
    )
    if info["cold"]:
        print(
            f"--cold: before every timed call (untimed) the library's own threads (pyattn's for numpy) read "
            f"{info['flush_bytes'] / 2**20:.0f} MiB (2 x (last-level cache + every core's L2), >= 256 MiB), "
            "evicting K/V"
        )
    else:
        print("warm: calls back to back; K/V that fit in the last-level cache are read from it (--cold: from memory)")
    print(
        "ms = median after warm-up; GB/s = K+V bytes stored for S tokens / ms; %bw = of the read bandwidth above;"
        " read = streaming read of this row's own K and V arrays (GB/s"
        + (", each after the eviction pass" if info["cold"] else "")
        + "); %rd = GB/s / read"
    )
    print(
        "numpy = float32 NumPy (one batched matmul per K/V head and its query group, softmax, matmul); "
        "torch = F.scaled_dot_product_attention(enable_gqa=True), float32; both on the float32 cache's memory; "
        "<peer> x = peer ms / pyattn ms"
    )
    print(
        f"max err vs ref = float64 reference on the stored (rounded) K/V, where B*S <= {REFERENCE_MAX_TOKENS}; "
        "else (float32 rows) vs torch, or numpy without torch; vs f32 = float32-cache ms / this ms; "
        "f32 err = max |out - float32 cache's out| (the storage's rounding or quantisation)"
    )
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    pyattn = import_pyattn(args.isa, "bench_decode")
    peer_env = limit_peer_isa(args.isa, args.peers_isa)  # before torch is imported
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # an optional peer (not a bench dependency): its columns show "-"
        torch_version = None
    args.torch = torch_version is not None
    args.blas_limit, blas_threads = blas_thread_limiter(args.threads)
    if not hasattr(pyattn, "KVCache"):
        sys.exit("bench_decode: this pyattn has no KVCache")
    if any(d == "bfloat16" for d in args.dtypes):
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            print("note: ml_dtypes is not installed; skipping the bfloat16 cache", file=sys.stderr)
            args.dtypes.remove("bfloat16")
    cases = args.cases

    args.flush = None
    if args.cold:
        rt = pyattn.runtime_info()
        cpu = rt.get("cpu", {})  # builds before the tuning module: flat keys
        llc = cpu.get("llc_bytes", rt.get("l3_cache_bytes")) or 0
        l2 = cpu.get("l2_bytes", rt.get("l2_cache_bytes")) or 0
        nbytes = max(2 * (llc + (os.cpu_count() or 1) * l2), 256 << 20) if llc else 512 << 20
        args.flush = np.ones(nbytes, np.uint8)  # written, so backed by pages before any timing

    busy = wait_for_idle(args.wait_idle)
    bandwidth, bandwidth_bg = measure_bandwidth(pyattn, args)
    info = {
        "date": now_iso(),
        "cpu": cpu_model(),
        "llc": last_level_cache(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": args.threads,
        "pyattn": dict(pyattn.runtime_info()),
        "numpy_blas": f"{numpy_blas_name()}; BLAS threads: {blas_threads}",
        "torch": torch_version,
        "read_bandwidth_gbs": bandwidth,
        "read_bandwidth_background_cpus": bandwidth_bg,
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
        "num_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "new_tokens": args.new_tokens,
        "cold": args.cold,
        "flush_bytes": None if args.flush is None else args.flush.nbytes,
    }
    print_header(info)

    results: list[dict] = []
    print(TABLE.header(), flush=True)
    for case in cases:
        for row in guarded_rows(pyattn, case, args, bandwidth):
            results.append(row)
            print(TABLE.add(cells(row)), flush=True)

    if args.markdown:
        print()
        print(TABLE.markdown())
    return finish_run(info, args.json, results, f"{len(results)} rows")


if __name__ == "__main__":
    sys.exit(main())
