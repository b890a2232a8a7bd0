# SPDX-License-Identifier: MIT
"""pyattn: fast, exact transformer attention on the CPU.

A fused flash-attention core in C++ (SIMD kernels compiled per ISA and chosen at run time, OpenMP
threads) behind a NumPy API with PyTorch's names and semantics. See README.md.
"""

from __future__ import annotations

from . import _core
from ._api import merge_attention_states, scaled_dot_product_attention, varlen_attention
from ._cache import KVCache
from ._explain import Explanation, HeadSteps, explain, plot_heatmaps, render_text
from ._mha import MultiHeadAttention, mha

try:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _dist_version

    __version__ = _dist_version("pyattn")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    __version__ = getattr(_core, "__version__", "0+unknown")

__all__ = [
    "scaled_dot_product_attention",
    "varlen_attention",
    "merge_attention_states",
    "mha",
    "MultiHeadAttention",
    "KVCache",
    "explain",
    "Explanation",
    "HeadSteps",
    "render_text",
    "plot_heatmaps",
    "set_num_threads",
    "get_num_threads",
    "available_isas",
    "get_isa",
    "runtime_info",
    "show_config",
    "__version__",
]


def set_num_threads(n):
    """Set the default thread count of pyattn calls made without ``num_threads=``.

    Parameters
    ----------
    n : int or None
        Threads (>= 1; counts beyond a C int are capped), or None to restore OpenMP's default:
        ``OMP_NUM_THREADS``, threadpoolctl limits, else all cores.

    Raises
    ------
    TypeError
        n is not an int or None.
    ValueError
        n < 1.
    """
    if n is None:
        _core.set_num_threads(0)
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n: expected an int or None, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    _core.set_num_threads(min(n, 2**31 - 1))  # capped like num_threads= (a C int)


def get_num_threads():
    """Threads a call without ``num_threads=`` will use.

    Returns
    -------
    int
        set_num_threads()'s value, else OpenMP's default (1 in a process forked after a parallel
        region, and in builds without OpenMP).
    """
    return _core.get_num_threads()


def available_isas():
    """Kernel ISAs compiled into this build and supported by this CPU.

    Returns
    -------
    list of str
        Worst to best, e.g. ``["generic", "avx2", "avx512", "avx512bf16"]``; any of them can be forced with the
        ``PYATTN_ISA`` environment variable before import.
    """
    return list(_core.available_isas())


def get_isa():
    """The kernel ISA in use.

    Returns
    -------
    str
        The best of available_isas(), or the one ``PYATTN_ISA`` forced.
    """
    return _core.isa()


def runtime_info():
    """What this build runs with, for bug reports and benchmark records.

    Returns
    -------
    dict
        ``version``, ``isa``, ``available_isas``, ``num_threads``, ``openmp`` (runtime), ``compiler``,
        ``flags`` (per-ISA compiler flags) and ``cpu``: a dict of the CPU as the kernels plan with
        it: vendor ("intel", "amd" or "unknown"), CPUID family and model, L1d / L2 / last-level
        cache bytes per core (0 where CPUID does not say), and whether AVX2 and AVX-512 are usable.
        ``precision_fast`` says what ``precision="fast"`` (the default) computes 16-bit inputs with on
        the ISA in use: ``"bfloat16 dot products"`` or ``"float32"`` (as ``"highest"``).
    """
    return {
        "version": __version__,
        "isa": get_isa(),
        "available_isas": available_isas(),
        "num_threads": get_num_threads(),
        "openmp": _core.openmp_runtime(),
        "compiler": _core.compiler(),
        "flags": _core.isa_flags(),
        "cpu": _core.cpu_info(),
        "precision_fast": "bfloat16 dot products" if _core.bf16_dots() else "float32",
    }


def show_config():
    """Print runtime_info(), one line per entry."""
    for name, value in runtime_info().items():
        if isinstance(value, list):
            value = ", ".join(value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        print(f"{name:>15}: {value}")
