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


def _tensor_values(x, name):
    """A torch tensor's values as a NumPy array (no copy for a CPU tensor): detached (pyattn is
    inference only), bfloat16 as ml_dtypes.bfloat16 (numpy() has no bfloat16), and a dtype NumPy
    lacks a TypeError naming the argument."""
    t = x.detach().cpu()
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


def as_array(x, name):
    """x as a NumPy array: an ndarray itself (a masked one refused), a torch tensor's values,
    anything else through np.asarray."""
    if type(x) is ndarray:
        return x
    if isinstance(x, ndarray):
        refuse_masked(x, name)
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):  # a torch tensor
        return _tensor_values(x, name)
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
