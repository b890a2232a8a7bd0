# SPDX-License-Identifier: MIT
"""Any array with __dlpack__ on the CPU is read in place; other devices are a clear error.

A minimal DLPack exporter (not an ndarray, not a torch tensor) stands for JAX or CuPy host arrays:
pyattn reads its memory without a copy and returns NumPy arrays; one that reports a GPU device, and a
torch tensor on a device other than the CPU (the "meta" device here), raise a TypeError naming the
argument instead of being copied to the host.
"""

import numpy as np
import pytest

import pyattn
from pyattn._arrays import as_array

from conftest import tol


class Exporter:
    """Exports a NumPy array through DLPack only, reporting `device` as its DLPack device."""

    def __init__(self, array, device=(1, 0)):
        self.array, self.device = array, device

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device


def test_cpu_dlpack_arrays_are_read_in_place(rng):
    q, k, v = (rng.standard_normal((2, 3, 17, 8)).astype(np.float32) for _ in range(3))
    view = as_array(Exporter(k), "key")
    assert isinstance(view, np.ndarray) and np.shares_memory(view, k)
    got = pyattn.scaled_dot_product_attention(Exporter(q), Exporter(k), Exporter(v), is_causal=True)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, pyattn.scaled_dot_product_attention(q, k, v, is_causal=True))
    cu = np.array([0, 5, 17])
    packed = rng.standard_normal((17, 3, 8)).astype(np.float32)
    got = pyattn.varlen_attention(Exporter(packed), Exporter(packed), Exporter(packed), cu, cu)
    np.testing.assert_allclose(got, pyattn.varlen_attention(packed, packed, packed, cu, cu), *tol(np.float32))


@pytest.mark.parametrize("device", [(2, 0), (13, 1)])
def test_other_devices_are_refused(rng, device):
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="query: the array lives on device"):
        pyattn.scaled_dot_product_attention(Exporter(q, device), q, q)


def test_torch_tensor_off_the_cpu_is_refused():
    torch = pytest.importorskip("torch")
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="key: the array lives on device meta"):
        pyattn.scaled_dot_product_attention(q, torch.empty((1, 2, 4, 8), device="meta"), q)
