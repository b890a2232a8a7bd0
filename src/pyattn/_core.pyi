# SPDX-License-Identifier: MIT
"""Type stubs for the compiled extension pyattn._core (src/cpp/bindings*.cpp).

Private module: the public API is the pyattn package. `sdpa` is scaled_dot_product_attention's whole
contract (bindings_sdpa.cpp); the layer entries (mha, mha_cached, linear, pack_weights) take
arguments prepared by pyattn._mha and re-check every invariant the C++ side relies on; a failed
check raises ValueError or TypeError naming the argument.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str
# Longest query (rows per head) the driver gives the decode kernel (kDecodeMaxLen, tuning.h).
DECODE_MAX_Q_LEN: int

# (name, mask array, per-(batch, head) int64 offsets, stride_l, stride_s, true_forbids)
_MaskEntry = tuple[str, np.ndarray, npt.NDArray[np.int64], int, int, bool]
# The layer's q, k, v, out projection weights (each packed by pack_weights for the active ISA, or
# the (out_features, in_features) array itself, packed by the GEMM's tasks as they go), then their
# optional biases.
_LayerWeights = tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
]

def sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    return_weights: Any,
    out: Any,
    num_threads: Any,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    return_lse: Any = False,
    diagonal: Any = None,
    precision: Any = "fast",
) -> Any:
    """pyattn.scaled_dot_product_attention on NumPy arrays (the whole contract: see its docstring)."""

def varlen(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    out: Any,
    num_threads: Any,
    window: Any,
    softcap: Any,
    sinks: Any,
    alibi_slopes: Any,
    return_lse: Any = False,
    precision: Any = "fast",
) -> Any:
    """pyattn.varlen_attention on NumPy arrays (the whole contract: see its docstring)."""

def sdpa_cache(
    query: np.ndarray,
    k_storage: np.ndarray,
    v_storage: np.ndarray,
    storage: int,
    kv_len: int,
    lengths: npt.NDArray[np.int64],
    causal_offsets: npt.NDArray[np.int64],
    scale: Any,
    num_threads: Any,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    return_lse: bool = False,
    k_scales: np.ndarray | None = None,
    v_scales: np.ndarray | None = None,
) -> Any:
    """KVCache.attend: queries (batch, num_heads, chunk, head_dim) over the cache's storage (batch,
    num_kv_heads, max_len, dim), 16-bit storage as uint16 views (storage 1 = float16, 2 = bfloat16),
    storage 3 = int8 with (batch, num_kv_heads, max_len) float32 row scales k_scales / v_scales; row
    b sees its first lengths[b] keys, query i at position causal_offsets[b] + i. return_lse: (out,
    lse)."""

def kernel_layout(x: np.ndarray, name: str, contiguous_last: bool = True) -> np.ndarray:
    """x itself when the kernels can read it through its strides, else a C-contiguous copy."""

def pack_weights(weight: np.ndarray) -> tuple[np.ndarray, int]:
    """Pack a (out_features, in_features) weight for the active ISA's GEMM; returns (packed, panel)."""

def linear(
    x: np.ndarray,
    packed: np.ndarray,
    panel: int,
    n: int,
    bias: np.ndarray | None,
    out: np.ndarray,
    num_threads: int,
) -> None:
    """out = x @ W.T + bias with W packed by pack_weights, or W itself (n, k) (x, out 2-D, last axis contiguous)."""

def mha(
    xq: np.ndarray,
    xk: np.ndarray,
    xv: np.ndarray,
    weights: _LayerWeights,
    dims: Sequence[int],
    masks: Sequence[_MaskEntry],
    is_causal: Any,
    out: np.ndarray,
    attn_weights: np.ndarray | None,
    num_threads: Any,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    cu_seqlens: Any = None,
) -> None:
    """Low-level multi-head attention entry; arguments prepared by pyattn._mha.

    weights: packed (q, k, v, out) projections then their optional biases. dims: (batch, q_len,
    kv_len, embed_dim, kdim, vdim, num_heads, num_kv_heads, head_dim). At most two masks.
    """

def mha_cached(
    x: np.ndarray,
    weights: _LayerWeights,
    dims: Sequence[int],
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    storage: int,
    lengths_before: np.ndarray,
    lengths_after: np.ndarray,
    left_padded: bool,
    out: np.ndarray,
    num_threads: Any,
    window: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    k_scales: np.ndarray | None = None,
    v_scales: np.ndarray | None = None,
) -> None:
    """Low-level layer step over a KV cache; arguments prepared by pyattn._mha and pyattn.KVCache.

    x: (batch * chunk, embed_dim) rows. dims: (batch, chunk, embed_dim, num_heads, num_kv_heads,
    head_dim). k_cache/v_cache: (batch, num_kv_heads, max_len, head_dim), uint16 bit patterns for
    storage 1 (float16) or 2 (bfloat16). Row b's real tokens (the first or, left_padded, the last
    lengths_after[b] - lengths_before[b] of its chunk) are written at positions lengths_before[b]..,
    then the chunk attends to each row's first lengths_after[b] keys (lower-right causal).
    """

def isa() -> str:
    """Name of the kernel ISA in use."""

def bf16_dots(precision: str = "fast") -> bool:
    """Whether the ISA in use computes bfloat16 inputs with bfloat16 dot products under `precision` (the
    error every entry point gives for a precision other than 'fast' or 'highest')."""

def available_isas() -> list[str]:
    """ISAs compiled into this build and supported by this CPU, worst to best."""

def _set_isa(name: str) -> None:
    """Force a kernel ISA (for tests and benchmarks); ValueError for an unknown or unsupported one."""

def empty_on_line(dtype: np.dtype, shape: Sequence[int], name: str, start: int = 0, zero: bool = False) -> np.ndarray:
    """A fresh uninitialised C-contiguous array that starts on a 64-byte cache line (a view into a
    slightly larger uint8 array); `name` is the argument an error names."""

def _convert_half(src: np.ndarray, dst: np.ndarray, num_threads: int | None = None, bfloat16: bool = False) -> None:
    """float16 bit patterns (uint16) to float32 or float32 to float16 bits, C-contiguous arrays of the
    same size aligned to their element size, rounding to nearest even like NumPy's astype;
    TypeError/ValueError otherwise. bfloat16=True: bfloat16 bits, rounded like ml_dtypes' astype
    (to nearest even; NaN to the quiet NaN of its sign)."""

def quantize_int8(src: np.ndarray, dst: np.ndarray, scales: np.ndarray) -> None:
    """KVCache.append into int8 storage: src (heads, n, dim) C-contiguous float32 rows quantised into
    dst (heads, n, dim) int8 with scales (heads, n) float32 = max |x| / 127 per row (NaN for a row
    holding Inf or NaN, 0 for a zero row)."""

def set_num_threads(n: int) -> None:
    """Default thread count; 0 restores OpenMP's default. ValueError when negative."""

def get_num_threads() -> int:
    """Threads a call without num_threads will use."""

def openmp_runtime() -> str:
    """The OpenMP runtime this build links, or a note that it was built without OpenMP."""

def openmp_enabled() -> bool:
    """Whether this build was compiled with OpenMP."""

def compiler() -> str:
    """Compiler name and version that built the extension."""

def isa_flags() -> str:
    """Compiler flags of each ISA's kernels."""

def cpu_info() -> dict[str, Any]:
    """The CPU as the tuning module plans with it: vendor ("intel", "amd" or "unknown"), CPUID family
    and model, l1d_bytes / l2_bytes / llc_bytes per core (0 where CPUID does not say), avx2 and avx512
    (usable, with OS support); with _set_tuning's CPU fields in place of the probed ones."""

def kv_storage_offset(itemsize: int, bfloat16: bool) -> int:
    """Bytes past a 64-byte line at which a KVCache's storage of this element size starts: the decode
    kernel's fastest placement on this CPU."""

def _set_tuning(settings: dict[str, Any]) -> dict[str, Any]:
    """Forces tuning decisions, or the CPU the planner sees (tests and benchmarks; see
    pyattn._tuning.override). Keys: tile_prefetch ("off", "kv_rows", "next_items"), group_heads (1-8),
    pack_heads (bool), decode_prefetch ("off", "l1", "l2"), decode_streams (1, 2, 4), decode_block16
    (32, 64), decode_across_heads (bool), decode_fuse (bool), packed_mask_limit (bytes >= 0),
    cpu_vendor ("intel", "amd", "unknown"), cpu_family, cpu_model, l2_bytes, llc_bytes (0: unknown);
    None leaves a key to the rules, keys not given keep their setting. Returns every key's previous
    value (pass it back to restore). An unknown key or a value outside a key's range raises ValueError
    naming the key, and changes nothing."""
