# SPDX-License-Identifier: MIT
"""Array conversion and allocation shared by the public modules (_api, _mha, _cache, _explain).

Data flows one way: a public module turns what the user passed into NumPy arrays here, then calls the
compiled core, which owns the rest of the contract (shapes, dtypes, broadcasting, options; see
src/cpp/bindings_sdpa.cpp and binding_checks.h). Nothing here decides semantics beyond "which object
is an array".
"""

from __future__ import annotations

import sys

import numpy as np

from . import _core

ndarray = np.ndarray
# The dtypes the core computes in; float16 and bfloat16 (ml_dtypes) compute in float32.
COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
HALF_DTYPES = ("float16", "bfloat16")


def is_half(dtype):
    """float16 or bfloat16 in native byte order (the kernels read the CPU's own bit patterns)."""
    return dtype.itemsize == 2 and dtype.name in HALF_DTYPES and dtype.isnative


def refuse_masked(x, name):
    """TypeError for a numpy.ma masked array: its masked entries would be read as if unmasked (a
    masked key attended to, a masked out= entry overwritten but still hidden), silently. Cheap for
    plain arrays: numpy.ma is only consulted when it is loaded already."""
    if type(x) is not ndarray:
        ma = sys.modules.get("numpy.ma")
        if ma is not None and isinstance(x, ma.MaskedArray):
            raise TypeError(
                f"{name}: masked arrays (numpy.ma) are not supported: their masked entries would be read as "
                f"if unmasked; pass a plain array (e.g. {name}.filled(...))"
            )


# DLPack device types whose memory the CPU reads directly: kDLCPU, kDLCUDAHost (pinned host memory).
_CPU_DEVICES = (1, 3)


def _device_error(name, device):
    return TypeError(
        f"{name}: the array lives on device {device}; pyattn computes on the CPU: move it to host memory "
        "first (e.g. tensor.cpu(), jax.device_get, cupy.asnumpy)"
    )


def _tensor_values(x, name):
    """A CPU torch tensor's values as a NumPy array (no copy): detached (pyattn is inference only),
    bfloat16 as ml_dtypes.bfloat16 (numpy() has no bfloat16), a dtype NumPy lacks a TypeError naming
    the argument, and a tensor on another device a TypeError (never a silent copy to the host)."""
    device = getattr(x, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise _device_error(name, device)
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}: a bfloat16 tensor needs the ml_dtypes package (pip install ml_dtypes)") from None
        return t.view(sys.modules["torch"].int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{name}: a torch tensor of dtype {t.dtype} has no NumPy equivalent ({exc})") from None


def _dlpack_values(x, name):
    """An object with __dlpack__ (JAX, CuPy host arrays, ...) as a NumPy array sharing its memory;
    another device is a TypeError. A dtype NumPy's DLPack import lacks (bfloat16) goes through
    np.asarray (the exporter's own conversion)."""
    try:
        device = x.__dlpack_device__()
    except Exception:  # noqa: BLE001  (an exporter without a device query: np.asarray decides)
        return np.asarray(x)
    if int(device[0]) not in _CPU_DEVICES:
        raise _device_error(name, tuple(int(d) for d in device))
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return np.asarray(x)


def as_array(x, name):
    """x as a NumPy array: an ndarray itself (a masked one refused), a CPU torch tensor's values, a
    DLPack exporter's memory on the CPU (no copy), anything else through np.asarray."""
    if type(x) is ndarray:
        return x
    if isinstance(x, ndarray):
        refuse_masked(x, name)
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):  # a torch tensor
        return _tensor_values(x, name)
    if hasattr(x, "__dlpack__"):
        return _dlpack_values(x, name)
    return np.asarray(x)


def allocate(shape, dtype, name, start=0, zero=False):
    """A fresh C-contiguous array whose data starts `start` bytes past a 64-byte cache line (the
    kernels' vector loads and stores of rows that straddle two lines cost two), zero-filled if
    `zero`. An impossible size is a ValueError naming `name`."""
    return _core.empty_on_line(np.dtype(dtype), tuple(shape), name, start, zero)


def kernel_layout(x, name, contiguous_last=True):
    """x itself when the kernels can read it through its strides, else a C-contiguous copy."""
    return _core.kernel_layout(x, name, contiguous_last)


def check_batch_first(batch_first):
    """batch_first must be exactly True or False (a truthy array or string would be ambiguous)."""
    if type(batch_first) is not bool:
        raise TypeError(f"batch_first: expected True or False, got {batch_first!r}")
    return batch_first
