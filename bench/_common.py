# SPDX-License-Identifier: MIT
"""Small helpers shared by the pyattn benchmark scripts.

Importing pyattn, the machine ceilings it measures, adaptive timing, machine description,
environment warnings and table printing (plain text streamed row by row, or Markdown at the end),
and the one piece of attention the scripts share: numpy_attention, their float32 NumPy peer.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# OpenBLAS tuning variables that, when set on this machine, slow NumPy's BLAS; benches never change
# them, they only warn (unset them in the command: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`).
OPENBLAS_SLOW_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
BUSY_WARN_CPUS = 0.2  # background load (CPUs busy with other processes) above which benches warn
# Quiet time before each timing block and each ceiling probe: a library's worker threads keep
# spinning for a while after its last call (ONNX Runtime's: tens of milliseconds, halving a probe's
# reading or slowing the next library's first calls up to twofold); 0.1 s lets them go to sleep.
SETTLE_SECONDS = 0.1

# argparse epilog shared by the bench scripts; format with script="bench/<name>.py".
ENVIRONMENT_HELP = """environment:
  OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE may be set on this machine and slow NumPy's BLAS (the
  numpy peer). The bench never changes them; unset them in the command instead:
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python {script}
  A warning line is printed when either is set. Without threadpoolctl the numpy peer's BLAS thread
  count is not controlled; add OPENBLAS_NUM_THREADS=N to the command to pin it.
"""


def import_pyattn(isa: str | None, prog: str):
    """Import pyattn (and pyattn.reference), optionally forcing an ISA; exit with a message on failure."""
    try:
        import pyattn
        import pyattn.reference
    except ImportError as exc:
        sys.exit(f"{prog}: cannot import pyattn ({exc}); install it first (pip install -e .)")
    if isa is not None:
        try:
            pyattn._core._set_isa(isa)
        except ValueError as exc:
            sys.exit(f"{prog}: --isa {isa}: {exc}")
    return pyattn


NUMPY_CHUNK_SCORES = 1 << 22  # numpy_attention materialises at most this many float32 scores at once


def bfloat16_dtype(prog: str) -> np.dtype:
    """ml_dtypes' bfloat16 (imported only for --dtype bfloat16); exits naming `prog` without it."""
    try:
        import ml_dtypes
    except ImportError:
        sys.exit(f"{prog}: --dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    return np.dtype(ml_dtypes.bfloat16)


def as_float64(x) -> np.ndarray:
    """x's values in float64: a NumPy array of any float dtype (bfloat16 too) or a torch tensor (a
    bfloat16 one has no NumPy dtype: it goes through float32, which holds its values exactly)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "numpy"):
        x = x.float().numpy()
    return np.asarray(x, dtype=np.float64)


def numpy_attention(q, k, v, allowed, scale):
    """Float32 NumPy attention, the benches' NumPy peer: scores by matmul, masked softmax in place,
    matmul with V, then the division by the softmax sums (on the (.., L, Dv) output, cheaper than on
    the (.., L, S) weights).

    q (B, H, L, D); k, v (B, Hkv, S, D/Dv) with H a multiple of Hkv (grouped-query attention: query
    head h uses key/value head h // (H / Hkv), as torch's enable_gqa). q is viewed as (B, Hkv,
    group * L, D), so each K/V head serves its whole group in one batched matmul and is read once.
    `allowed` is None or a bool (L, S) mask (True = may attend; no row may be fully masked).
    (batch, K/V head) pairs are processed in chunks of at most NUMPY_CHUNK_SCORES scores, so memory
    stays bounded on long rows (bench_decode's one-token steps, up to 64k keys, are one chunk).
    """
    b, h, q_len, d = q.shape
    hkv, kv_len, ev = k.shape[1], k.shape[2], v.shape[3]
    rows = h // hkv * q_len  # query rows per K/V head
    qf = (q * np.float32(scale)).reshape(b * hkv, rows, d)
    kt = k.reshape(b * hkv, kv_len, d).transpose(0, 2, 1)
    vf = v.reshape(b * hkv, kv_len, ev)
    out = np.empty((b * hkv, rows, ev), dtype=np.float32)
    forbidden = None if allowed is None else np.tile(~allowed, (h // hkv, 1))  # (rows, S): group-major like qf
    step = max(1, NUMPY_CHUNK_SCORES // (rows * kv_len))
    for g0 in range(0, b * hkv, step):
        g = slice(g0, min(g0 + step, b * hkv))
        scores = np.matmul(qf[g], kt[g])
        if forbidden is not None:
            np.copyto(scores, -np.inf, where=forbidden)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denom = scores.sum(axis=-1, keepdims=True)
        np.matmul(scores, vf[g], out=out[g])
        out[g] /= denom
    return out.reshape(b, h, q_len, ev)


# Environment variables that keep PyTorch to one x86 instruction set: ATen's own vectorised kernels,
# oneDNN (its GEMMs, which PyTorch's CPU flash attention calls) and MKL. They are read when torch is
# imported. With pyattn forced to AVX2 (--isa avx2) on an AVX-512 machine, a PyTorch left on AVX-512
# measures the hardware's wider FMAs, not the AVX2 kernels: on a Xeon with two 512-bit FMA ports it
# ran 1x16x1024x64 in 26.5 ms with AVX-512 and 44.9 ms kept to AVX2 (ATEN_CPU_CAPABILITY alone,
# 28.1 ms, leaves oneDNN on AVX-512). onnxruntime (MLAS) and NumPy's OpenBLAS have no such switch that
# the benches may use (OPENBLAS_CORETYPE is one they never touch), so they keep their own kernels.
PEER_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def limit_peer_isa(isa: str | None, peers_isa: str) -> dict[str, str]:
    """With --isa avx2 or generic and --peers-isa same, set PEER_ISA_ENV for PyTorch (where the user
    has not set a variable already); call before torch is imported. Returns the variables in effect."""
    if peers_isa != "same" or isa not in PEER_ISA_ENV:
        return {}
    if "torch" in sys.modules:
        raise RuntimeError("limit_peer_isa must run before torch is imported")
    for name, value in PEER_ISA_ENV[isa].items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in PEER_ISA_ENV[isa]}


def print_peer_isa(env: dict[str, str]) -> None:
    """The header line saying how the peers' instruction set was limited (nothing when it was not)."""
    if env:
        settings = " ".join(f"{k}={v}" for k, v in env.items())
        print(
            f"PyTorch kept to pyattn's ISA ({settings}; --peers-isa native lifts it); "
            "onnxruntime and NumPy's OpenBLAS use their own kernels"
        )


def machine(pyattn):
    """The module of the machine's ceilings (fma_peak_gflops, read_bandwidth_gbs, read_buffers_gbs,
    each with pyattn's ISA): pyattn._machine, or pyattn._core in builds from before the ceilings had a
    module of their own (so that an old build can be benchmarked against a new one)."""
    try:
        from pyattn import _machine
    except ImportError:
        return pyattn._core
    return _machine


def measure_ceilings(pyattn, threads: int, quick: bool) -> dict[str, float | None]:
    """FMA peak (GFLOP/s, float32) and streaming read bandwidth (GB/s) of pyattn's ISA (machine()),
    when the build has those functions (None otherwise)."""
    ceilings: dict[str, float | None] = {"fma_peak_gflops": None, "read_bandwidth_gbs": None}
    ceiling = machine(pyattn)
    if hasattr(ceiling, "fma_peak_gflops"):
        ceilings["fma_peak_gflops"] = float(ceiling.fma_peak_gflops(threads, 0.1 if quick else 0.5))
    if hasattr(ceiling, "read_bandwidth_gbs"):
        ceilings["read_bandwidth_gbs"] = float(ceiling.read_bandwidth_gbs(threads, 1 << (28 if quick else 30)))
    return ceilings


@dataclass(frozen=True)
class Timing:
    """Wall-clock statistics of one benchmarked callable, in seconds."""

    median: float
    min: float
    runs: int

    @staticmethod
    def of(samples: Sequence[float]) -> Timing:
        return Timing(statistics.median(samples), min(samples), len(samples))


def settle() -> None:
    """SETTLE_SECONDS of quiet, so that every library's worker threads have gone to sleep."""
    time.sleep(SETTLE_SECONDS)


def settled(probe: Callable[..., Any], *args, **kwargs) -> Any:
    """probe(*args, **kwargs) after settle(): a ceiling probe (pyattn._machine) right after a peer's
    calls would share the cores with that peer's still-spinning threads."""
    settle()
    return probe(*args, **kwargs)


def _samples(
    fn: Callable[[], Any],
    min_time: float,
    min_runs: int,
    max_runs: int,
    warmup: int,
    settle: float,
    before: Callable[[], Any] | None = None,
) -> tuple[list[float], Any]:
    """Timed calls of fn (see time_call): the samples in seconds and the last call's result. `before`,
    if given, is called (untimed) before every timed call; its time counts towards min_time, so that
    a slow `before` does not multiply the number of runs."""
    time.sleep(settle)
    result = None
    for _ in range(warmup):
        result = fn()
    samples: list[float] = []
    total = 0.0
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(samples) < max_runs and (len(samples) < min_runs or total < min_time):
            if before is not None:
                t_before = time.perf_counter()
                before()
                total += time.perf_counter() - t_before
            t0 = time.perf_counter()
            result = fn()
            dt = time.perf_counter() - t0
            samples.append(dt)
            total += dt
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples, result


def time_call(
    fn: Callable[[], Any],
    *,
    min_time: float = 0.3,
    min_runs: int = 5,
    max_runs: int = 10_000,
    warmup: int = 1,
    settle: float = 0.1,
) -> tuple[Timing, Any]:
    """Time `fn()` with time.perf_counter: sleep `settle` s, `warmup` untimed calls, then repeat
    until both `min_runs` runs and `min_time` seconds of timed calls are reached (at most `max_runs`).

    Returns the timing and the result of the last call. The sleep lets the worker threads of the
    library timed before go idle: OpenBLAS threads keep spinning for ~0.1 s after a call and, on a
    machine with few cores, measurably slow whatever runs next. The garbage collector is paused
    while timing so that a collection of another library's garbage does not land in a sample.
    """
    samples, result = _samples(fn, min_time, min_runs, max_runs, warmup, settle)
    return Timing.of(samples), result


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    rounds: int = 3,
    min_time: float = 0.3,
    min_runs: int = 5,
    warmup: int = 1,
    settle: float = SETTLE_SECONDS,
    contexts: dict[str, Callable[[], Any]] | None = None,
    raise_errors: bool = False,
    before: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, tuple[Timing, Any] | Exception]:
    """Time several callables in `rounds` alternating blocks: a, b, c, a, b, c, ... Each block is one
    callable's calls back to back (as in time_call: two libraries' OpenMP threads spinning at once
    would slow each other), and every callable's samples are spread over the same stretch of time,
    so that a slow spell of this shared machine (another tenant, a frequency change) lands on all of
    them alike instead of on whichever happened to run then; the ratios of the medians of the pooled
    samples are what the tables report. min_time and min_runs are totals over the rounds; warm-up
    calls are made in the first round only. `contexts` optionally maps a name to a context manager
    factory entered around that callable's blocks (e.g. a BLAS thread limit); `before` optionally maps
    a name to a callable called, untimed, before each timed call of that one (see _samples; e.g.
    evicting the caches with the library's own threads). A callable that raises
    is reported as its exception and not called again, or, with raise_errors, the exception
    propagates."""
    pooled: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, Any] = {}
    failed: dict[str, Exception] = {}
    rounds = max(1, rounds)
    for r in range(rounds):
        for name, fn in fns.items():
            if name in failed:
                continue
            ctx = contexts.get(name) if contexts else None
            try:
                with ctx() if ctx else contextlib.nullcontext():
                    samples, results[name] = _samples(
                        fn,
                        min_time / rounds,
                        -(-min_runs // rounds),
                        10_000,
                        warmup if r == 0 else 0,
                        settle,
                        before.get(name) if before else None,
                    )
            except Exception as exc:  # noqa: BLE001  (reported to the caller, which decides)
                if raise_errors:
                    raise
                failed[name] = exc
                continue
            pooled[name].extend(samples)
    return {name: failed[name] if name in failed else (Timing.of(pooled[name]), results[name]) for name in fns}


def pyattn_timing(timing: Timing, per_call: int = 1) -> dict:
    """pyattn's row entries: pyattn_ms (median), pyattn_min_ms (fastest), per step when a timed call
    makes per_call steps, and pyattn_runs."""
    return {
        "pyattn_ms": timing.median / per_call * 1e3,
        "pyattn_min_ms": timing.min / per_call * 1e3,
        "pyattn_runs": timing.runs,
    }


def peer_timing(name: str, timing: Timing | None, baseline: Timing, per_call: int = 1) -> dict:
    """A peer's row entries: <name>_ms (median; per step when a timed call makes per_call steps),
    <name>_runs and <name>_vs_pyattn (peer median / pyattn median), all None when the peer did not
    run (timing None: an optional peer that is not installed)."""
    if timing is None:
        return dict.fromkeys((f"{name}_ms", f"{name}_runs", f"{name}_vs_pyattn"))
    return {
        f"{name}_ms": timing.median / per_call * 1e3,
        f"{name}_runs": timing.runs,
        f"{name}_vs_pyattn": timing.median / baseline.median,
    }


ROUNDS_DEFAULT = 3  # alternating timing blocks per library and row (time_interleaved); 1 with --quick


@dataclass(frozen=True)
class TimingDefaults:
    """A script's defaults for --min-time (timed seconds per library and row) and --min-runs."""

    min_time: float
    min_runs: int
    quick_min_runs: int
    quick_min_time: float = 0.05


def add_common_arguments(
    parser, defaults: TimingDefaults, *, seed_of: str, wait_idle_help: str, tables: str = "table"
) -> None:
    """The options every bench script has (each script adds --quick and its own selections):
    --threads, --isa, --peers-isa, --min-time, --min-runs, --rounds, --wait-idle, --seed, --json,
    --markdown.
    resolve_common_arguments checks them after parsing."""
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="threads for every library (default: os.cpu_count() = %(default)s)",
    )
    parser.add_argument("--isa", default=None, help="force a pyattn ISA via pyattn._core._set_isa (e.g. avx2)")
    parser.add_argument(
        "--peers-isa",
        choices=("same", "native"),
        default="same",
        help="with --isa avx2 or generic: keep PyTorch to that ISA too ('same', the default: like-for-like "
        "kernels) or leave it on the best one of this CPU ('native')",
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=None,
        help=f"timed seconds per library and row (default {defaults.min_time:g}, --quick {defaults.quick_min_time:g})",
    )
    parser.add_argument(
        "--min-runs",
        type=int,
        default=None,
        help=f"minimum timed runs (default {defaults.min_runs}, --quick {defaults.quick_min_runs})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"alternating timing blocks per library and row, samples pooled (default {ROUNDS_DEFAULT}, "
        "--quick 1): a slow spell of a shared machine then hits every library alike",
    )
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS", help=wait_idle_help)
    parser.add_argument("--seed", type=int, default=0, help=f"random seed for {seed_of}")
    parser.add_argument("--json", metavar="PATH", default=None, help="save machine info and all rows as JSON")
    parser.add_argument("--markdown", action="store_true", help=f"also print the {tables} as Markdown at the end")


def resolve_common_arguments(args, parser, defaults: TimingDefaults) -> None:
    """Checks --threads and --rounds, and fills in --min-time, --min-runs and --rounds from the
    script's defaults (the --quick ones with --quick)."""
    if args.threads is None or args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.min_time is None:
        args.min_time = defaults.quick_min_time if args.quick else defaults.min_time
    if args.min_runs is None:
        args.min_runs = defaults.quick_min_runs if args.quick else defaults.min_runs
    if args.rounds is None:
        args.rounds = 1 if args.quick else ROUNDS_DEFAULT
    elif args.rounds < 1:
        parser.error("--rounds must be >= 1")


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def numpy_blas_name() -> str:
    """'name version' of the BLAS NumPy was built with, as numpy.show_config reports it."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001  (show_config's layout is not a stable API)
        return "unknown BLAS"


def now_iso() -> str:
    """Local date and time, ISO 8601, seconds resolution."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _machine_busy_seconds() -> float:
    """CPU-seconds all processes have spent busy since boot, summed over CPUs (/proc/stat)."""
    with open("/proc/stat", encoding="utf-8") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class BackgroundLoad:
    """Context manager: how many CPUs *other* processes kept busy while it was entered, i.e.
    (machine busy CPU-seconds - this process's CPU-seconds, all threads) / wall seconds.

    After exit, `cpus` holds that average (None where /proc/stat is unavailable). On a shared
    machine a value well above 0 means the timings taken inside are noisy (and usually too slow).
    """

    cpus: float | None = None

    def __enter__(self) -> BackgroundLoad:
        self.cpus = None
        try:
            self._machine0: float | None = _machine_busy_seconds()
        except (OSError, ValueError):
            self._machine0 = None
        self._own0 = _own_cpu_seconds()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        wall = time.perf_counter() - self._wall0
        if self._machine0 is None or wall <= 0:
            return
        try:
            machine = _machine_busy_seconds() - self._machine0
        except (OSError, ValueError):
            return
        self.cpus = max(0.0, (machine - (_own_cpu_seconds() - self._own0)) / wall)


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def busy_cpus(interval: float = 0.25, settle: float = 0.2) -> float | None:
    """CPUs kept busy by other processes over `interval` s while this process sleeps (after
    `settle` s for its own worker threads to stop spinning); None without /proc/stat."""
    time.sleep(settle)
    with BackgroundLoad() as load:
        time.sleep(interval)
    return load.cpus


def wait_for_idle(max_wait: float, threshold: float = BUSY_WARN_CPUS) -> float | None:
    """Poll busy_cpus() until other processes use at most `threshold` CPUs or `max_wait` seconds
    have passed; return the last reading (None without /proc/stat)."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_cpus()
        if busy is None or busy <= threshold or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


def openblas_env_warnings() -> list[str]:
    """One warning line per slow-BLAS environment variable that is set (empty list if none)."""
    return [
        f"WARNING: {name}={os.environ[name]!r} is set and may slow NumPy's BLAS; "
        f"rerun with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE ...`"
        for name in OPENBLAS_SLOW_ENV
        if name in os.environ
    ]


def blas_thread_limiter(num_threads: int) -> tuple[Callable[[], Any], str]:
    """Limit NumPy's BLAS pool to `num_threads` via threadpoolctl when it is installed.

    Returns (a factory of context managers that apply the limit while entered, a description of
    what was done); without threadpoolctl the contexts do nothing and the description says which
    thread count BLAS will use.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        env = [f"{k}={os.environ[k]}" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ]
        note = ", ".join(env) if env else f"OpenBLAS default = all {os.cpu_count()} CPUs"
        return (
            contextlib.nullcontext,
            f"not controlled (threadpoolctl not installed; {note}; "
            f"set OPENBLAS_NUM_THREADS={num_threads} in the command to pin it)",
        )
    return (
        lambda: threadpool_limits(limits=num_threads, user_api="blas"),
        f"{num_threads} (threadpoolctl)",
    )


@dataclass(frozen=True)
class Column:
    """One table column: header text, plain-text width, and right alignment for numbers."""

    header: str
    width: int
    right: bool = True


class Table:
    """A result table that prints plain-text rows as they arrive and can render Markdown at the end."""

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)
        self.rows: list[list[str]] = []

    def _plain(self, cells: Sequence[str]) -> str:
        parts = []
        for col, cell in zip(self.columns, cells):
            width = max(col.width, len(col.header))
            parts.append(cell.rjust(width) if col.right else cell.ljust(width))
        return "  ".join(parts).rstrip()

    def header(self) -> str:
        """Plain-text header line followed by a rule."""
        line = self._plain([c.header for c in self.columns])
        return line + "\n" + "-" * len(line)

    def add(self, cells: Sequence[str]) -> str:
        """Store a row and return its plain-text rendering."""
        assert len(cells) == len(self.columns)
        self.rows.append(list(cells))
        return self._plain(cells)

    def markdown(self) -> str:
        """The whole table as GitHub-flavoured Markdown."""
        head = "| " + " | ".join(c.header for c in self.columns) + " |"
        rule = "|" + "|".join("---:" if c.right else ":---" for c in self.columns) + "|"
        body = ["| " + " | ".join(cell or " " for cell in row) + " |" for row in self.rows]
        return "\n".join([head, rule, *body])


def fmt_ms(ms: float | None) -> str:
    """Milliseconds with 3-4 significant digits, or '-' for None."""
    if ms is None:
        return "-"
    for limit, spec in ((100, ".0f"), (10, ".1f"), (1, ".2f")):
        if ms >= limit:
            return format(ms, spec)
    return format(ms, ".3f")


def fmt(value: float | None, spec: str) -> str:
    """Format a number with `spec`, or '-' for None/NaN."""
    if value is None or value != value:
        return "-"
    return format(value, spec)


# Every bench row carries pyattn's max abs error against a float64 computation (or a peer), on
# inputs of N(0, 1) scale whose outputs are O(1): correct results measure 1e-8 to 1e-5 (the README's
# tables). An error above this bound is not an accuracy question but a wrong answer (a lost mask, a
# wrong head, garbage memory), so the script then exits with status 1 (finish_run) and a smoke run of
# the benchmarks (.ci/run) fails on it instead of printing a fast wrong number. A row whose output is
# rounded to 16 bits carries its own bound instead, as "err_tol" (bench_sdpa.py --dtype bfloat16).
WRONG_ANSWER_ERR = 1e-3


def wrong_answers(results) -> list[str]:
    """Rows (of a list, or a dict of lists) whose max_abs_err is above their err_tol (WRONG_ANSWER_ERR
    for rows without one) or NaN."""
    rows = [r for group in results.values() for r in group] if isinstance(results, dict) else list(results)
    bad = []
    for r in rows:
        err = r.get("max_abs_err")
        tol = r.get("err_tol", WRONG_ANSWER_ERR)
        if err is not None and not err <= tol:  # NaN fails too
            label = " ".join(str(r[k]) for k in ("case", "variant", "cache_dtype", "layer") if r.get(k) is not None)
            own = "" if "err_tol" not in r else f" (above the row's err_tol {tol:.3g})"
            bad.append(f"{label or r}: max err {err:.3g}{own}")
    return bad


def finish_run(info: dict, json_path: str | None, results, summary: str) -> int:
    """End of every bench script: warn when other processes loaded the machine during the run, save
    machine info + results as JSON when asked (`summary` says what was saved), and return the exit
    status: 1 when a row's result was wrong (wrong_answers), else 0."""
    busy_after = busy_cpus()
    info["busy_cpus_after"] = busy_after
    if busy_after is not None and busy_after > BUSY_WARN_CPUS:
        print(f"\nWARNING: background load after the run: {busy_after:.1f} CPUs busy; timings are suspect")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)
        print(f"\nsaved {summary} to {json_path}")
    bad = wrong_answers(results)
    for line in bad:
        print(
            f"ERROR: wrong result (max abs error above {WRONG_ANSWER_ERR:g} or the row's err_tol): {line}",
            file=sys.stderr,
        )
    return 1 if bad else 0
