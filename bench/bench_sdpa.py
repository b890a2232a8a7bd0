# SPDX-License-Identifier: MIT
"""Benchmark pyattn.scaled_dot_product_attention against its peers on the DESIGN shape suite.

Run (from the repository root, with pyattn installed in the interpreter's environment)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_sdpa.py            # full suite
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_sdpa.py --quick    # smoke, < 30 s
    python bench/bench_sdpa.py --threads 1 --shapes 1x16x1024x64,decode --markdown --json out.json
    python bench/bench_sdpa.py --dtype bfloat16 --quick                                # bfloat16 smoke

What is measured, per (shape, variant) row, all in float32 (``--dtype bfloat16``: see below) with the
same thread count everywhere:

* shapes: (B, H, L, D) self-attention with S = L keys, plus decode rows: one query (L = 1) against
  S = 4096 and 16384 keys (B=1, H=32, D=128); the first shape, 1x1x16x64, does almost no arithmetic
  and shows each library's per-call overhead;
* variants: ``none`` (no mask), ``causal`` (``is_causal=True``; decode rows use ``"lower_right"`` for
  pyattn, and ``is_causal=False`` for torch/onnxruntime, which is the same thing when L = 1: the single
  query sees every key), ``mask`` (an explicit bool (L, S) mask, True = may attend, broadcast over
  batch and heads: the last 25% of keys are padding, plus ~10% random holes; key 0 is always allowed
  so no row is fully masked);
* pyattn time (median and min of many runs after a warm-up; runs repeat until both ``--min-time``
  seconds and ``--min-runs`` runs are reached, spread over ``--rounds`` blocks that alternate with
  the peers' blocks, so a slow spell of the machine hits every library alike), GFLOP/s, % of the FMA peak
  measured right before and after the row (the higher one; the header's peak is the run's start),
  and for decode rows the K+V read bandwidth (GB/s, % of the measured read bandwidth, and %rd: % of a
  plain streaming read of that row's own K and V arrays, which shares their page backing). Like
  GFLOP/s, GB/s counts all of K and V on ``mask`` rows, though pyattn does not read the padding (the
  last 25% of keys), so those rows can pass 100%;
* max abs error of pyattn's output against ``pyattn.reference`` (float64). Rows with
  B*H*L*S > 2**23 are checked on the first batch and head only (inputs sliced to [:1, :1]);
* peers: "numpy" (a float32 NumPy implementation, ``_common.numpy_attention``: matmul, masked
  softmax, matmul; the float64 pyattn.reference would not be a fair peer),
  ``torch.nn.functional.scaled_dot_product_attention`` (inference_mode, torch.set_num_threads) and
  onnxruntime (ONNX ``Attention`` op, opset 23) when installed. Each peer shows its median ms and
  ``peer_ms / pyattn_ms`` (> 1: pyattn is faster).

``--dtype bfloat16``: the same shapes and variants on ml_dtypes.bfloat16 inputs (drawn in float32 and
rounded to bfloat16). Per row: pyattn with ``precision="fast"`` (the pyattn columns; with AVX512-BF16,
ISA avx512bf16, Q.K and P.V are bfloat16 dot products, elsewhere it computes as "highest"), pyattn
with ``precision="highest"`` (float32 compute) on the same inputs, timed in the same alternating
blocks (``highest ms``, ``hi/fast`` = highest ms / fast ms, ``hi err``), and torch's SDPA on
``torch.from_numpy(float32 values).to(torch.bfloat16)`` (the same values; the conversion is not
timed). NumPy (no bfloat16 matmul) and onnxruntime (its CPU provider has no bfloat16 ``Attention``)
are not run on bfloat16 rows: their float32 numbers are the default run's. Errors are against the
float64 reference on the bfloat16 values, for pyattn (``max err``) and for torch's bfloat16 output
(``torch err``); ``err/torch`` = max err / torch err (the accuracy target: <= 1.5). ``%peak`` of
non-decode rows is of the bfloat16 dot-product peak (``pyattn._machine.dot16_peak_gflops``) when
pyattn's ISA has one, else of the FMA peak; the header says which. A bfloat16 result is wrong (exit
status 1) above BF16_ERR_ATOL + BF16_ERR_RTOL * max|reference| instead of WRONG_ANSWER_ERR: the
output alone is rounded to bfloat16 (up to 2**-8 of its magnitude).

FLOP count: 4 * B * H * D * (number of (query, key) pairs computed); a pair costs 2*D for q.k and 2*D
for p*v. ``none`` and ``mask`` rows count all L*S pairs (a mask does not reduce the work credited);
``causal`` rows count only the allowed pairs (about half for L == S).

Fairness: every library gets ``--threads`` threads (pyattn ``num_threads=``, torch.set_num_threads,
onnxruntime intra_op_num_threads, NumPy's BLAS through threadpoolctl when installed; without it the
header says so). Inputs, masks and the numpy peer's causal mask are built outside the timed calls.
Each library's timing starts with a 0.1 s pause, because OpenBLAS worker threads keep spinning for
about that long after a call and slow whatever runs next on a machine with few cores.

Shared machines: the ``bg`` column is the number of CPUs other processes kept busy while the row ran
(from /proc/stat minus this process's CPU time); rows with bg > 0.2 are noisy. ``--wait-idle SECONDS``
waits for idle CPUs before each row and redoes disturbed rows.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
from collections.abc import Callable
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
    measure_ceilings,
    now_iso,
    numpy_attention,
    numpy_blas_name,
    openblas_env_warnings,
    print_peer_isa,
    pyattn_timing,
    resolve_common_arguments,
    settled,
    time_interleaved,
    wait_for_idle,
)

DTYPE = np.float32
DTYPES = ("float32", "bfloat16")  # --dtype
BF16_PEERS = ("torch",)  # the peers that run bfloat16 rows; why the others do not:
BF16_NOT_RUN = {
    "numpy": "NumPy has no bfloat16 matmul",
    "onnxruntime": "onnxruntime's CPU provider has no bfloat16 Attention",
    "ort-mha": "onnxruntime's CPU provider has no bfloat16 Attention",
}
# A bfloat16 row's result is wrong above BF16_ERR_ATOL + BF16_ERR_RTOL * max|reference| (on the rows
# checked): twice the test suite's bounds for precision="fast" bfloat16 (tests/conftest.py TOL,
# elementwise 6e-3 + 1.6e-2 * |reference|). Correct rows measure about 2**-8 * max|reference| (the
# output's own rounding to bfloat16); a lost mask or a wrong head is far above.
BF16_ERR_ATOL = 1.2e-2
BF16_ERR_RTOL = 3.2e-2
FULL_CHECK_MAX_SCORES = 1 << 23  # B*H*L*S above this: the error is checked on [:1, :1] only
ROW_RETRIES = 2  # with --wait-idle: redo a row disturbed by other processes at most this often
TIMING = TimingDefaults(min_time=0.3, min_runs=5, quick_min_runs=3)  # --min-time / --min-runs
PEER_AGREEMENT_TOL = 1e-3  # a peer further than this from pyattn is reported (bench bug or real bug)


@dataclass(frozen=True)
class Case:
    """One attention shape: query (B, H, L, D), key/value (B, H, S, D)."""

    batch: int
    num_heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @property
    def is_decode(self) -> bool:
        return self.q_len == 1

    @property
    def name(self) -> str:
        base = f"{self.batch}x{self.num_heads}x{self.q_len}x{self.head_dim}"
        return f"{base} S={self.kv_len}" if self.q_len != self.kv_len else base


SUITE = (
    Case(1, 1, 16, 16, 64),  # per-call overhead: almost no arithmetic, so the time is the call itself
    Case(1, 12, 128, 128, 64),
    Case(8, 12, 128, 128, 64),
    Case(32, 12, 128, 128, 64),  # a batch whose arrays (50 MB) outgrow the last-level cache
    Case(1, 12, 512, 512, 64),
    Case(4, 12, 512, 512, 64),
    Case(1, 16, 1024, 1024, 64),
    Case(1, 16, 2048, 2048, 64),
    Case(1, 8, 4096, 4096, 64),
    Case(1, 16, 1024, 1024, 128),
    Case(1, 32, 1, 4096, 128),
    Case(1, 32, 1, 16384, 128),
)
QUICK_SUITE = ("1x1x16x64", "1x12x128x64", "1x12x512x64", "1x32x1x128 S=4096")
VARIANTS = ("none", "causal", "mask")
PEERS = ("numpy", "torch", "onnxruntime", "ort-mha")
ENV_RECORDED = (
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "PYATTN_ISA",
)


# ----------------------------------------------------------------------------------------------
# Inputs, masks and work counts


def make_inputs(
    case: Case, rng: np.random.Generator, layout: str = "bhsd"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard-normal float32 query, key, value of shape (B, H, len, D): stored that way ("bhsd"),
    or stored (B, len, H, D) and viewed heads first ("bshd", the layout Hugging Face models pass:
    every library gets the same strided views)."""
    b, h, d = case.batch, case.num_heads, case.head_dim

    def array(length):
        if layout == "bshd":
            return rng.standard_normal((b, length, h, d), dtype=DTYPE).transpose(0, 2, 1, 3)
        return rng.standard_normal((b, h, length, d), dtype=DTYPE)

    return array(case.q_len), array(case.kv_len), array(case.kv_len)


def make_padding_mask(q_len: int, kv_len: int, rng: np.random.Generator) -> np.ndarray:
    """Bool (L, S) mask, True = may attend: last 25% of keys are padding, ~10% random holes,
    key 0 always allowed so that no row is fully masked (torch would return NaN for it)."""
    allowed = rng.random((q_len, kv_len)) >= 0.10
    allowed[:, math.ceil(0.75 * kv_len) :] = False
    allowed[:, 0] = True
    return allowed


def causal_offset(case: Case) -> int:
    """Query i sees keys j <= i + offset: 0 for upper-left (L == S), S - L for decode (lower-right)."""
    return case.kv_len - case.q_len if case.is_decode else 0


def causal_allowed(case: Case) -> np.ndarray:
    """Bool (L, S) causal mask with the alignment pyattn uses for this case."""
    i = np.arange(case.q_len)[:, None]
    j = np.arange(case.kv_len)[None, :]
    return j <= i + causal_offset(case)


def pyattn_is_causal(case: Case, variant: str) -> bool | str:
    """pyattn's is_causal argument: True for L == S, "lower_right" for decode rows."""
    if variant != "causal":
        return False
    return "lower_right" if case.is_decode else True


def peer_is_causal(case: Case, variant: str) -> bool:
    """is_causal for torch/onnxruntime (upper-left only): for decode (L = 1) lower-right causal
    allows every key, i.e. no mask, so they get False there."""
    return variant == "causal" and not case.is_decode


def allowed_pairs(case: Case, variant: str) -> int:
    """(query, key) pairs credited in the FLOP count: all L*S, except allowed ones for causal rows."""
    if variant != "causal":
        return case.q_len * case.kv_len
    seen = np.clip(np.arange(case.q_len) + causal_offset(case) + 1, 0, case.kv_len)
    return int(seen.sum())


def flop_count(case: Case, variant: str) -> int:
    """4 * B * H * D * pairs (2*D for q.k, 2*D for p*v per pair)."""
    return 4 * case.batch * case.num_heads * case.head_dim * allowed_pairs(case, variant)


def kv_bytes(case: Case, itemsize: int = np.dtype(DTYPE).itemsize) -> int:
    """Bytes of K and V (each read once by a streaming decode kernel), `itemsize` bytes per element."""
    return 2 * case.batch * case.num_heads * case.kv_len * case.head_dim * itemsize


# ----------------------------------------------------------------------------------------------
# Peers: each factory returns a zero-argument callable that computes the row's attention.


def make_numpy_peer(case, variant, q, k, v, mask, threads):
    """The NumPy peer; the causal mask is built once here, outside the timed call (like `mask`)."""
    allowed = mask
    if variant == "causal":
        causal = causal_allowed(case)
        allowed = None if causal.all() else causal
    scale = 1.0 / math.sqrt(case.head_dim)
    return lambda: numpy_attention(q, k, v, allowed, scale)


def make_torch_peer(case, variant, q, k, v, mask, threads, bfloat16=False):
    """torch.nn.functional.scaled_dot_product_attention on zero-copy tensors, inference mode. With
    bfloat16: q, k, v are float32 values converted by .to(torch.bfloat16) here, outside the timed
    call, which returns torch's bfloat16 output tensor (as_float64 reads it afterwards)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tmask = None if mask is None else torch.from_numpy(mask)
    causal = peer_is_causal(case, variant)
    if bfloat16:
        tq, tk, tv = (t.to(torch.bfloat16) for t in (tq, tk, tv))

        def run_bf16():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=causal)

        return run_bf16

    def run():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, is_causal=causal).numpy()

    return run


def make_onnxruntime_peer(case, variant, q, k, v, mask, threads):
    """onnxruntime session running the ONNX opset-23 `Attention` op (bool mask, True = attend)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = ["q", "k", "v"] + ([] if mask is None else ["mask"])
    feeds = dict(zip(names, (q, k, v, mask)))
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.BOOL if name == "mask" else TensorProto.FLOAT, list(arr.shape))
        for name, arr in feeds.items()
    ]
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, [*q.shape[:-1], v.shape[-1]])
    node = helper.make_node("Attention", names, ["out"], is_causal=int(peer_is_causal(case, variant)))
    graph = helper.make_graph([node], "sdpa", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)[0]


def make_ort_mha_peer(case, variant, q, k, v, mask, threads):
    """onnxruntime's `com.microsoft.MultiHeadAttention` contrib op (its MLAS flash-attention path) on
    q/k/v already projected, in the op's (B, L, H*D) layout (transposed once, outside the timing); an
    explicit bool mask becomes the op's additive attention_bias (0 / -inf), causal its
    `unidirectional` attribute."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    batch, heads, q_len, dim = q.shape
    kv_len, vdim = k.shape[2], v.shape[3]

    def packed(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))

    feeds = {"q": packed(q), "k": packed(k), "v": packed(v)}
    names = ["q", "k", "v"]
    if mask is not None:
        bias = np.where(np.broadcast_to(mask, (q_len, kv_len)), 0.0, -np.inf).astype(np.float32)
        feeds["bias"] = bias.reshape(1, 1, q_len, kv_len)
        names += ["", "", "bias"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[n].shape)) for n in feeds]
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, q_len, heads * vdim])
    node = helper.make_node(
        "MultiHeadAttention",
        names,
        ["out"],
        domain="com.microsoft",
        num_heads=heads,
        unidirectional=int(peer_is_causal(case, variant)),
    )
    graph = helper.make_graph([node], "mha", inputs, [output])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = min(model.ir_version, 10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run():
        out = session.run(None, feeds)[0]
        return out.reshape(batch, q_len, heads, vdim).transpose(0, 2, 1, 3)

    return run


PEER_FACTORIES: dict[str, Callable] = {
    "numpy": make_numpy_peer,
    "torch": make_torch_peer,
    "onnxruntime": make_onnxruntime_peer,
    "ort-mha": make_ort_mha_peer,
}


def detect_peers(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    """Available peers among `wanted`, and a version-or-reason string for every library."""
    versions = {"numpy": np.__version__}
    available = ["numpy"] if "numpy" in wanted else []
    try:
        import torch

        versions["torch"] = torch.__version__
        if "torch" in wanted:
            available.append("torch")
    except ImportError:
        versions["torch"] = "not installed (peer skipped)"
    try:
        import onnxruntime

        versions["onnxruntime"] = onnxruntime.__version__
        try:
            import onnx  # noqa: F401  (builds the graph)

            available += [p for p in ("onnxruntime", "ort-mha") if p in wanted]
        except ImportError:
            versions["onnxruntime"] += " (onnx not installed, needed to build the graph: peer skipped)"
    except ImportError:
        versions["onnxruntime"] = "not installed (peer skipped)"
    return available, versions


# ----------------------------------------------------------------------------------------------
# bfloat16 rows: ceiling and tolerance


def measure_dot16_peak(pyattn, threads: int, quick: bool) -> tuple[float | None, str]:
    """The bfloat16 dot-product (vdpbf16ps) peak of pyattn's ISA in GFLOP/s, and what it is or why
    there is none: None when the ISA has no such instruction (only avx512bf16 has) or the build
    predates pyattn._machine.dot16_peak_gflops."""
    measure = getattr(machine(pyattn), "dot16_peak_gflops", None)
    if measure is None:
        return None, "pyattn._machine.dot16_peak_gflops missing"
    try:
        return float(measure(threads, 0.1 if quick else 0.5)), "vdpbf16ps, pyattn._machine.dot16_peak_gflops"
    except ValueError:
        return None, f"ISA {pyattn.get_isa()} has no bfloat16 dot product"


def row_ceiling(case: Case, dtype: str, ceilings: dict) -> str:
    """The ceiling a row's %peak is of: "dot16_peak_gflops" for bfloat16 rows when pyattn's ISA has a
    bfloat16 dot product, except decode rows (precision="fast" computes few query rows as "highest"),
    else "fma_peak_gflops"."""
    if dtype == "bfloat16" and ceilings.get("dot16_peak_gflops") and not case.is_decode:
        return "dot16_peak_gflops"
    return "fma_peak_gflops"


def bf16_err_tol(ref_max: float) -> float:
    """The max abs error above which a bfloat16 row's result is wrong (BF16_ERR_ATOL, BF16_ERR_RTOL)."""
    return BF16_ERR_ATOL + BF16_ERR_RTOL * ref_max


# ----------------------------------------------------------------------------------------------
# Machine description


def machine_info(pyattn, threads, versions, blas_threads, ceilings, busy, args) -> dict:
    """Everything about the run that a reader needs to trust (or reproduce) the numbers."""
    return {
        "date": now_iso(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": threads,
        "pyattn": dict(pyattn.runtime_info()),
        "numpy_blas": f"{numpy_blas_name()}; BLAS threads: {blas_threads}",
        "versions": versions,
        "ceilings": ceilings,
        "busy_cpus_before": busy,
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "peer_isa_env": args.peer_env,
        "quick": args.quick,
        "min_time_s": args.min_time,
        "min_runs": args.min_runs,
        "rounds": args.rounds,
        "seed": args.seed,
        "layout": args.layout,
        "dtype": args.dtype,
    }


def print_header(info: dict, peers: list[str]) -> None:
    """Human-readable description of the machine, the libraries and the definitions used."""
    rt = info["pyattn"]
    ceil = info["ceilings"]
    fma = ceil["fma_peak_gflops"]
    bw = ceil["read_bandwidth_gbs"]
    half = info["dtype"] == "bfloat16"
    dot16 = ceil.get("dot16_peak_gflops")
    print(f"pyattn bench_sdpa   {info['date']}")
    print(f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs); threads, every library: {info['threads']}")
    print(
        f"pyattn {rt.get('version')}: isa={rt.get('isa')} available={rt.get('available_isas')} "
        f"openmp={rt.get('openmp')} compiler={rt.get('compiler')}"
    )
    if info["layout"] != "bhsd":
        print(f"inputs: stored {info['layout'].upper()}, passed to every library as (B, H, L, D) views")
    print(f"numpy {info['versions']['numpy']} ({info['numpy_blas']})")
    print(f"torch {info['versions']['torch']};  onnxruntime {info['versions']['onnxruntime']}")
    print_peer_isa(info["peer_isa_env"])
    print(
        "ceilings (measured now): FMA peak (pyattn's ISA) "
        + (f"{fma:.1f} GFLOP/s" if fma else "n/a (pyattn._machine.fma_peak_gflops missing)")
        + ", read bandwidth "
        + (f"{bw:.1f} GB/s" if bw else "n/a (pyattn._machine.read_bandwidth_gbs missing)")
        + ((", bfloat16 dot peak " + (f"{dot16:.1f} GFLOP/s" if dot16 else "n/a")) if half else "")
        + (f" ({ceil['dot16_peak_note']})" if half else "")
    )
    for line in openblas_env_warnings():
        print(line)
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
    if half:
        print(
            "dtype bfloat16 (ml_dtypes): inputs drawn in float32 and rounded to bfloat16; pyattn ms = "
            f"precision='fast', which on this ISA computes with: {rt.get('precision_fast', '?')}"
        )
        print(
            "highest ms = pyattn precision='highest' (float32 compute) on the same inputs, timed in the same "
            "alternating blocks; hi/fast = highest ms / pyattn ms (> 1: 'fast' is faster)"
        )
    print(f"dtype {info['dtype']}; times in ms = median over runs (min ms = fastest run); warm-up excluded")
    print("GFLOP/s = 4*B*H*D*pairs / time; none/mask rows count all L*S pairs, causal only allowed ones")
    if not half:
        print("%peak = of the FMA peak measured right before and after the row (the higher; the machine drifts)")
    elif dot16:
        print(
            "%peak = of the bfloat16 dot-product peak (vdpbf16ps) measured right before and after the row (the "
            "higher); decode rows (L = 1: 'fast' computes few query rows as 'highest') of the FMA peak"
        )
    else:
        print(
            "%peak = of the float32 FMA peak measured right before and after the row (the higher): "
            f"{ceil['dot16_peak_note']}, so 'fast' computes as 'highest' here"
        )
    print(
        "GB/s (decode rows only) = bytes of K+V / time (mask rows: all of K+V, though the padding is not"
        " read); %bw = of the read bandwidth above; %rd = of a plain streaming read of the row's own K and V"
        " arrays (pyattn._machine.read_buffers_gbs, same threads)"
    )
    print(
        "bg = CPUs other processes kept busy during the row (machine busy time - this process's);"
        f" rows with bg > {BUSY_WARN_CPUS} are noisy"
    )
    if half:
        print(
            "max err = max|pyattn 'fast' - pyattn.reference (float64, on the bfloat16 values)|; hi err = the same "
            "for 'highest'; torch err = the same for torch's bfloat16 output; err/torch = max err / torch err "
            "(the accuracy target: <= 1.5)"
        )
        print(
            f"err on 'all' = whole output, 'b0h0' = first batch & head only (inputs sliced) when B*H*L*S > "
            f"{FULL_CHECK_MAX_SCORES}; wrong result (exit status 1): max err or hi err > {BF16_ERR_ATOL:g} + "
            f"{BF16_ERR_RTOL:g} * max|reference|"
        )
    else:
        print(
            f"max err = max|pyattn - pyattn.reference (float64)|; err on 'all' = whole output, "
            f"'b0h0' = first batch & head only (inputs sliced) when B*H*L*S > {FULL_CHECK_MAX_SCORES}"
        )
    if peers:
        print(
            f"peers: {', '.join(peers)}; '<peer> x' = peer ms / pyattn ms (> 1: pyattn faster); "
            "'vs best' = fastest peer ms / pyattn ms"
        )
    if half:
        if "torch" in peers:
            print("torch: bfloat16 tensors, torch.from_numpy(float32 values).to(torch.bfloat16) (not timed)")
        if info["peers_not_run"]:
            why = "; ".join(dict.fromkeys(BF16_NOT_RUN[p] for p in info["peers_not_run"]))
            print(
                f"not run on bfloat16: {', '.join(info['peers_not_run'])} ({why}); their float32 rows: --dtype float32"
            )
    print(
        "decode causal rows: pyattn is_causal='lower_right'; torch/onnxruntime is_causal=False "
        "(same for L=1: the query sees all S keys)"
    )
    print()


# ----------------------------------------------------------------------------------------------
# One row


def reference_errors(reference, q, k, v, mask, is_causal, outs: dict) -> tuple[dict[str, float], str, float]:
    """Max abs error of each output in `outs` (name -> array or torch tensor) against the float64
    reference on q, k, v's values, on a slice for large rows; also the scope and max|reference|."""
    b, h, q_len, _ = q.shape
    if b * h * q_len * k.shape[2] <= FULL_CHECK_MAX_SCORES:
        part, scope = (slice(None), slice(None)), "all"
    else:
        part, scope = (slice(0, 1), slice(0, 1)), "b0h0"
    ref = reference.scaled_dot_product_attention(
        *(x[part].astype(np.float64) for x in (q, k, v)), attn_mask=mask, is_causal=is_causal
    )
    errors = {name: float(np.max(np.abs(as_float64(out[part]) - ref))) for name, out in outs.items()}
    return errors, scope, float(np.max(np.abs(ref)))


def run_row(pyattn, case, variant, inputs, mask, peers, args, ceilings, peer_inputs=None) -> dict:
    """Time pyattn and every peer on one (case, variant) and return the row as a dict. The libraries
    are timed in args.rounds alternating blocks (time_interleaved). With --dtype bfloat16, `inputs`
    are the bfloat16 arrays, `peer_inputs` their float32 values (torch converts them itself), and
    pyattn runs with precision "fast" (the row's pyattn entries) and "highest"."""
    q, k, v = inputs
    half = args.dtype == "bfloat16"
    is_causal = pyattn_is_causal(case, variant)
    own_read = None
    if case.is_decode and hasattr(machine(pyattn), "read_buffers_gbs"):
        # The read ceiling of these very K/V pages (huge pages or not), measured just before the row.
        arrays = [np.ascontiguousarray(k).view(np.uint8), np.ascontiguousarray(v).view(np.uint8)]
        own_read = float(settled(machine(pyattn).read_buffers_gbs, arrays, args.threads))
    if half:
        fns = {
            name: functools.partial(
                pyattn.scaled_dot_product_attention,
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=is_causal,
                num_threads=args.threads,
                precision=precision,
            )
            for name, precision in (("pyattn", "fast"), ("highest", "highest"))
        }
    else:
        fns = {
            "pyattn": lambda: pyattn.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, num_threads=args.threads
            )
        }
    peer_errors = {}
    for name in peers:
        try:
            if half:
                fns[name] = make_torch_peer(case, variant, *peer_inputs, mask, args.threads, bfloat16=True)
            else:
                fns[name] = PEER_FACTORIES[name](case, variant, q, k, v, mask, args.threads)
        except Exception as exc:  # noqa: BLE001  (an optional peer must not stop the bench)
            peer_errors[name] = exc
    # The FMA peak right before and after the row (the higher one): on a shared VM the machine's speed
    # drifts by 20-40% within a run (a Zen 3 host measured 126-184 GFLOP/s at the start of three runs
    # on one morning), so %peak is taken against the row's own spell, like %rd for the decode rows.
    # bfloat16 rows on an ISA with a bfloat16 dot product: that instruction's peak (row_ceiling).
    ceiling = row_ceiling(case, args.dtype, ceilings)
    measure_peak = getattr(machine(pyattn), ceiling, None)
    peak_seconds = 0.05 if args.quick else 0.15
    row_peak = [float(settled(measure_peak, args.threads, peak_seconds))] if measure_peak else []
    timed = time_interleaved(
        fns,
        rounds=args.rounds,
        min_time=args.min_time,
        min_runs=args.min_runs,
        contexts={"numpy": args.blas_limit},
    )
    if measure_peak:
        row_peak.append(float(settled(measure_peak, args.threads, peak_seconds)))
    for name in ("pyattn", "highest"):
        if isinstance(timed.get(name), Exception):
            raise timed[name]
    t, out = timed["pyattn"]
    outs = {"pyattn": out}
    if half:  # also the errors of "highest" and of the peers' bfloat16 outputs
        outs.update((name, timed[name][1]) for name in ("highest", *peers) if isinstance(timed.get(name), tuple))
    errors, err_scope, ref_max = reference_errors(pyattn.reference, q, k, v, mask, is_causal, outs)
    err = errors["pyattn"]
    flops = flop_count(case, variant)
    gflops = flops / t.median / 1e9
    peak = max(row_peak) if row_peak else ceilings[ceiling]
    bw = ceilings["read_bandwidth_gbs"]
    row = {
        "case": case.name,
        "batch": case.batch,
        "num_heads": case.num_heads,
        "q_len": case.q_len,
        "kv_len": case.kv_len,
        "head_dim": case.head_dim,
        "variant": variant,
        "is_causal": is_causal,
        "allowed_pairs": allowed_pairs(case, variant),
        "flops": flops,
        **pyattn_timing(t),
        "gflops": gflops,
        "fma_peak_gflops": peak,
        "pct_fma_peak": 100 * gflops / peak if peak else None,
        "kv_gbs": kv_bytes(case, k.dtype.itemsize) / t.median / 1e9 if case.is_decode else None,
        "max_abs_err": err,
        "err_scope": err_scope,
        "peers": {},
    }
    if half:
        # The ceiling's own keys (a dot16 peak is not an FMA peak), the "highest" run and the errors.
        del row["fma_peak_gflops"], row["pct_fma_peak"]
        t_hi = timed["highest"][0]
        row.update(
            dtype=args.dtype,
            precision="fast",
            peak_ceiling=ceiling,
            peak_gflops=peak,
            pct_peak=100 * gflops / peak if peak else None,
            highest_ms=t_hi.median * 1e3,
            highest_min_ms=t_hi.min * 1e3,
            highest_runs=t_hi.runs,
            highest_vs_fast=t_hi.median / t.median,
            highest_max_abs_err=errors["highest"],
            ref_max_abs=ref_max,
            err_tol=bf16_err_tol(ref_max),
        )
    row["pct_read_bw"] = 100 * row["kv_gbs"] / bw if (bw and row["kv_gbs"]) else None
    row["own_read_gbs"] = own_read
    row["pct_own_read"] = 100 * row["kv_gbs"] / own_read if (own_read and row["kv_gbs"]) else None
    for name in peers:
        timing = peer_errors.get(name) or timed[name]
        if half:  # agreement within the row's tolerance; the peer's own error against the reference
            peer = peer_result(name, case, variant, timing, as_float64(out), row["err_tol"])
            if name in errors:
                peer["max_abs_err"] = errors[name]
                row[f"err_vs_{name}"] = err / errors[name] if errors[name] else None
        else:
            peer = peer_result(name, case, variant, timing, out)
        if "median_ms" in peer:
            peer["ratio"] = peer["median_ms"] / row["pyattn_ms"]
        row["peers"][name] = peer
    ok = {n: p for n, p in row["peers"].items() if "ratio" in p}
    if ok:
        best = min(ok, key=lambda n: ok[n]["median_ms"])
        row["best_peer"], row["vs_best_peer"] = best, ok[best]["ratio"]
    return row


def run_row_guarded(pyattn, case, variant, inputs, mask, peers, args, ceilings, peer_inputs=None) -> dict:
    """run_row() under a BackgroundLoad monitor. With --wait-idle, wait for idle CPUs first and
    redo a row that other processes disturbed (at most ROW_RETRIES times)."""
    attempts = 1 + (ROW_RETRIES if args.wait_idle > 0 else 0)
    for attempt in range(1, attempts + 1):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            row = run_row(pyattn, case, variant, inputs, mask, peers, args, ceilings, peer_inputs)
        row["background_cpus"], row["attempts"] = load.cpus, attempt
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
        action = "redoing the row" if attempt < attempts else "keeping it"
        print(
            f"  note: {case.name}/{variant}: other processes used {load.cpus:.1f} CPUs; {action}",
            file=sys.stderr,
        )
    return row


def peer_result(name, case, variant, timed, pyattn_out, tol=PEER_AGREEMENT_TOL) -> dict:
    """One peer's entry: its timing and agreement with pyattn (a difference above `tol` is noted), or
    the error that stopped it (a peer that fails is reported, not fatal)."""
    if isinstance(timed, Exception):
        error = f"{type(timed).__name__}: {timed}"
        print(f"  note: peer {name} failed on {case.name}/{variant}: {error}", file=sys.stderr)
        return {"error": error}
    t, res = timed
    diff = float(np.max(np.abs(as_float64(res) - pyattn_out)))
    if not diff <= tol:
        print(f"  note: {name} differs from pyattn by {diff:.2e} on {case.name}/{variant}", file=sys.stderr)
    return {
        "median_ms": t.median * 1e3,
        "min_ms": t.min * 1e3,
        "runs": t.runs,
        "max_diff_vs_pyattn": diff,
    }


def wrong_highest(rows: list[dict]) -> list[str]:
    """bfloat16 rows whose precision="highest" result is above the row's err_tol (or NaN); the "fast"
    result (max_abs_err) is checked by finish_run."""
    return [
        f"{r['case']} {r['variant']} precision='highest': max err {r['highest_max_abs_err']:.3g} "
        f"(tolerance {r['err_tol']:.3g})"
        for r in rows
        if "highest_max_abs_err" in r and not r["highest_max_abs_err"] <= r["err_tol"]
    ]


# ----------------------------------------------------------------------------------------------
# Table


def make_table(peers: list[str], dtype: str = "float32") -> Table:
    half = dtype == "bfloat16"
    cols = [
        Column("case", 18, right=False),
        Column("variant", 7, right=False),
        Column("pyattn ms", 9),
        Column("min ms", 8),
        Column("GFLOP/s", 7),
        Column("%peak", 5),
        Column("GB/s", 5),
        Column("%bw", 4),
        Column("%rd", 4),
        Column("max err", 7),
        Column("err on", 6, right=False),
    ]
    if half:
        if "torch" in peers:
            cols += [Column("torch err", 7), Column("err/torch", 5)]
        cols += [Column("highest ms", 8), Column("hi/fast", 5), Column("hi err", 7)]
    cols.append(Column("bg", 3))
    for name in peers:
        cols += [Column(f"{name} ms", 8), Column(f"{name} x", 5)]
    if peers:
        cols.append(Column("vs best", 12, right=False))
    return Table(cols)


def row_cells(row: dict, peers: list[str], dtype: str = "float32") -> list[str]:
    half = dtype == "bfloat16"
    cells = [
        row["case"],
        row["variant"],
        fmt_ms(row["pyattn_ms"]),
        fmt_ms(row["pyattn_min_ms"]),
        fmt(row["gflops"], ".1f"),
        fmt(row["pct_peak"] if half else row["pct_fma_peak"], ".0f"),
        fmt(row["kv_gbs"], ".1f"),
        fmt(row["pct_read_bw"], ".0f"),
        fmt(row.get("pct_own_read"), ".0f"),
        fmt(row["max_abs_err"], ".1e"),
        row["err_scope"],
    ]
    if half:
        if "torch" in peers:
            cells += [fmt(row["peers"]["torch"].get("max_abs_err"), ".1e"), fmt(row.get("err_vs_torch"), ".2f")]
        cells += [fmt_ms(row["highest_ms"]), fmt(row["highest_vs_fast"], ".2f"), fmt(row["highest_max_abs_err"], ".1e")]
    cells.append(fmt(row.get("background_cpus"), ".1f"))
    for name in peers:
        p = row["peers"].get(name, {})
        cells += [fmt_ms(p.get("median_ms")), fmt(p.get("ratio"), ".2f")]
    if peers:
        best = row.get("best_peer")
        cells.append(f"{row['vs_best_peer']:.2f} ({best})" if best else "-")
    return cells


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time pyattn.scaled_dot_product_attention against NumPy, PyTorch and onnxruntime "
        "(float32, or bfloat16 with --dtype; same thread count) on the DESIGN shape suite.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            ENVIRONMENT_HELP.format(script="bench/bench_sdpa.py") + f"\nshape names: {', '.join(c.name for c in SUITE)}"
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: shapes {', '.join(QUICK_SUITE)} and few runs (< 30 s)",
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated filters; a shape runs if any filter is a substring of its name "
        "(e.g. '1x16x1024x64,S=16384') or the filter is 'decode' and L == 1",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of %(default)s")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="comma-separated subset of %(default)s (missing libraries are skipped)",
    )
    parser.add_argument(
        "--layout",
        choices=("bhsd", "bshd"),
        default="bhsd",
        help="how q, k, v are stored: (B, H, L, D) (default), or (B, L, H, D) viewed as (B, H, L, D) "
        "without a copy, for every library",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="input dtype (default %(default)s). bfloat16 (ml_dtypes): pyattn precision='fast' and 'highest' "
        f"and the bfloat16 peers ({', '.join(BF16_PEERS)}); the others are not run",
    )
    add_common_arguments(
        parser,
        TIMING,
        seed_of="inputs and masks",
        wait_idle_help="shared machines: before each row wait up to SECONDS for idle CPUs, and redo a row "
        f"that other processes disturbed (up to {ROW_RETRIES} times; default 0 = only report it)",
    )
    args = parser.parse_args(argv)
    resolve_common_arguments(args, parser, TIMING)
    args.variants = _split(args.variants, VARIANTS, parser, "--variants")
    args.peers = _split(args.peers, PEERS, parser, "--peers")
    return args


def _split(text: str, allowed: tuple[str, ...], parser, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        parser.error(f"{flag}: unknown {bad}; choose from {list(allowed)}")
    return items


def select_cases(args) -> list[Case]:
    cases = [c for c in SUITE if c.name in QUICK_SUITE] if args.quick else list(SUITE)
    if args.shapes:
        filters = [f.strip() for f in args.shapes.split(",") if f.strip()]
        cases = [c for c in cases if any(f in c.name or (f == "decode" and c.is_decode) for f in filters)]
    return cases


def main(argv=None) -> int:
    args = parse_args(argv)
    pyattn = import_pyattn(args.isa, "bench_sdpa")
    args.peer_env = limit_peer_isa(args.isa, args.peers_isa)  # before detect_peers imports torch
    cases = select_cases(args)
    if not cases:
        sys.exit("bench_sdpa: no shape matches --shapes")
    bf16 = bfloat16_dtype("bench_sdpa") if args.dtype == "bfloat16" else None
    peers, versions = detect_peers(args.peers)
    not_run = []
    if bf16 is not None:
        not_run = [p for p in peers if p not in BF16_PEERS]
        peers = [p for p in peers if p in BF16_PEERS]
    args.blas_limit, blas_threads = blas_thread_limiter(args.threads)
    busy = wait_for_idle(args.wait_idle)  # before anything of ours runs
    ceilings = measure_ceilings(pyattn, args.threads, args.quick)
    if bf16 is not None:
        ceilings["dot16_peak_gflops"], ceilings["dot16_peak_note"] = measure_dot16_peak(
            pyattn, args.threads, args.quick
        )
    info = machine_info(pyattn, args.threads, versions, blas_threads, ceilings, busy, args)
    if bf16 is not None:
        info["peers_not_run"] = not_run
    print_header(info, peers)

    table = make_table(peers, args.dtype)
    print(table.header(), flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for case in cases:
        inputs = make_inputs(case, rng, args.layout)
        peer_inputs = None
        if bf16 is not None:  # pyattn gets the bfloat16 arrays (same layout), torch their float32 values
            peer_inputs, inputs = inputs, tuple(x.astype(bf16) for x in inputs)
        for variant in args.variants:
            mask = make_padding_mask(case.q_len, case.kv_len, rng) if variant == "mask" else None
            row = run_row_guarded(pyattn, case, variant, inputs, mask, peers, args, ceilings, peer_inputs)
            rows.append(row)
            print(table.add(row_cells(row, peers, args.dtype)), flush=True)

    if args.markdown:
        print()
        print(table.markdown())
    status = finish_run(info, args.json, rows, f"{len(rows)} rows")
    bad = wrong_highest(rows)
    for line in bad:
        print(f"ERROR: wrong result: {line}", file=sys.stderr)
    return 1 if bad or status else 0


if __name__ == "__main__":
    sys.exit(main())
