# SPDX-License-Identifier: MIT
"""Type stubs for the compiled extension pyattn._core (src/cpp/bindings*.cpp).

Private module: the public API is the pyattn package. `sdpa` is scaled_dot_product_attention's whole
contract (bindings_sdpa.cpp); the layer entries (mha, mha_cached, linear, pack_weights) take
arguments prepared by pyattn._mha and re-check every invariant the C++ side relies on; a failed
check raises ValueError or TypeError naming the argument.
"""

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

__version__: str
# Longest query (rows per head) the driver gives the decode kernel (kDecodeMaxLen, attention.h).
DECODE_MAX_Q_LEN: int

# (name, mask array, per-(batch, head) int64 offsets, stride_l, stride_s, true_forbids)
_MaskEntry = Tuple[str, np.ndarray, npt.NDArray[np.int64], int, int, bool]
# The layer's q, k, v, out projection weights (each packed by pack_weights for the active ISA, or
# the (out_features, in_features) array itself, packed by the GEMM's tasks as they go), then their
# optional biases.
_LayerWeights = Tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray,
    Optional[np.ndarray], Optional[np.ndarray], Optional[np.ndarray], Optional[np.ndarray],
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
) -> Any:
    """pyattn.scaled_dot_product_attention on NumPy arrays (the whole contract: see its docstring)."""

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
) -> np.ndarray:
    """KVCache.attend: queries (batch, num_heads, chunk, head_dim) over the cache's storage (batch,
    num_kv_heads, max_len, dim), 16-bit storage as uint16 views (storage 1 = float16, 2 = bfloat16);
    row b sees its first lengths[b] keys, query i at position causal_offsets[b] + i."""

def kernel_layout(x: np.ndarray, name: str, contiguous_last: bool = True) -> np.ndarray:
    """x itself when the kernels can read it through its strides, else a C-contiguous copy."""

def pack_weights(weight: np.ndarray) -> Tuple[np.ndarray, int]:
    """Pack a (out_features, in_features) weight for the active ISA's GEMM; returns (packed, panel)."""

def linear(
    x: np.ndarray,
    packed: np.ndarray,
    panel: int,
    n: int,
    bias: Optional[np.ndarray],
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
    attn_weights: Optional[np.ndarray],
    num_threads: Any,
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

def available_isas() -> list[str]:
    """ISAs compiled into this build and supported by this CPU, worst to best."""

def _set_isa(name: str) -> None:
    """Force a kernel ISA (for tests and benchmarks); ValueError for an unknown or unsupported one."""

def empty_on_line(dtype: np.dtype, shape: Sequence[int], name: str, start: int = 0, zero: bool = False) -> np.ndarray:
    """A fresh uninitialised C-contiguous array that starts on a 64-byte cache line (a view into a
    slightly larger uint8 array); `name` is the argument an error names."""

def _set_packed_mask_limit(nbytes: int) -> int:
    """Largest packed (bit) copy of a boolean mask a call makes (default 8 MiB); 0 makes the kernels
    read the mask bytes themselves (for tests). Returns the previous limit; a negative nbytes
    raises ValueError and leaves the limit as it was."""

def _set_prefetch(mode: int) -> int:
    """What the query tiles prefetch: -1 decided per call from the cache sizes (default), 0 nothing,
    1 always the next key block's K/V rows, 2 always the next work item's rows (for tests). Returns
    the previous mode."""

def _set_group_tiles(on: int) -> int:
    """Whether the query tiles take the heads of a GQA group together (1, the default) or head by
    head (0, for tests). Returns the previous setting."""

def _set_pack_heads(mode: int) -> int:
    """Whether the query tiles copy the rows of K/V heads that interleave in memory into a
    per-thread buffer, head by head: -1 decided per call from the sizes (the default), 0 never, 1
    whenever they interleave (for tests). Returns the previous setting."""

def _set_decode_heads(mode: int) -> int:
    """Whether decode calls over K/V heads that interleave in memory read every head's rows of a key
    block in turn: -1 by rule (the default: wherever they interleave; on Zen 5 only for 16-bit K/V with
    fewer than 4 query rows per K/V row), 0 never (head by head), 1 wherever they interleave (for
    tests). Returns the previous setting."""

def _set_decode_block16(keys: int) -> int:
    """Keys per block of the decode kernel for 16-bit K/V: -1 decided per call (the default), 32 or 64
    always (for tests). Returns the previous setting."""

def _set_decode_streams(streams: int) -> int:
    """How many parts of a work item's keys the decode kernel reads side by side: -1 decided per
    call (the default), 1, 2 or 4 always (for tests). Returns the previous setting."""

def _convert_half(src: np.ndarray, dst: np.ndarray, num_threads: int = 0, bfloat16: bool = False) -> None:
    """float16 bit patterns (uint16) to float32 or float32 to float16 bits, C-contiguous arrays of the
    same size aligned to their element size, rounding to nearest even like NumPy's astype;
    TypeError/ValueError otherwise. bfloat16=True: bfloat16 bits, rounded like ml_dtypes' astype
    (to nearest even; NaN to the quiet NaN of its sign)."""

def cpu_vendor() -> str:
    """CPUID's vendor string ("GenuineIntel", "AuthenticAMD", ...), "" off x86."""

def cpu_family() -> int:
    """CPUID's display family (base + extended: 0x19 AMD Zen 3/4, 0x1A Zen 5, 6 Intel cores), 0 off x86."""

def cpu_is_intel() -> bool:
    """An Intel core (CPUID vendor 'GenuineIntel'), which has rules of its own."""

def cpu_is_amd_zen5_on() -> bool:
    """An AMD core of family 1Ah or later (Zen 5 on), which has per-core rules of its own."""

def cache_bytes(level: int) -> int:
    """Bytes of this CPU's level 1-3 data cache per core, from CPUID (0 where it does not say)."""

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

def fma_peak_gflops(num_threads: int, seconds: float = 0.5) -> float:
    """float32 FMA throughput of the active ISA, GFLOP/s."""

def read_bandwidth_gbs(num_threads: int, nbytes: int = 1073741824) -> float:
    """Streaming read bandwidth, GB/s (best of 5)."""

def read_buffers_gbs(arrays: Sequence[npt.NDArray[Any]], num_threads: int, repeats: int = 5) -> float:
    """GB/s of reading these C-contiguous arrays once, each split across num_threads threads (best of
    `repeats` passes; bench_decode --cold uses one pass over a large buffer to evict the caches)."""
