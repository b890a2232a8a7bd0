# SPDX-License-Identifier: MIT
"""The error policy (DESIGN §2), out=, and the runtime API (ISA choice, threads, config)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pyattn
import pyattn._machine

from conftest import make_qkv

sdpa = pyattn.scaled_dot_product_attention


@pytest.fixture
def qkv(rng):
    return make_qkv(rng, np.float32, batch=(2,), q_heads=4, q_len=5, kv_len=7, head_dim=8, value_dim=6)


# --- shapes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("ndim", [0, 1])
def test_too_few_dims(qkv, name, ndim):
    args = dict(zip(["query", "key", "value"], qkv))
    args[name] = np.asarray(args[name][(0,) * (args[name].ndim - ndim)])
    with pytest.raises(ValueError, match=rf"{name}.*{re.escape(str(args[name].shape))}"):
        sdpa(**args)


def test_head_dim_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"key.*\(2, 4, 7, 7\)"):
        sdpa(q, k[..., :7], v)


def test_kv_len_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"value.*\(2, 4, 6, 6\)"):
        sdpa(q, k, v[..., :6, :])


def test_batch_not_broadcastable(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="key|value"):
        sdpa(q, np.concatenate([k, k, k]), np.concatenate([v, v, v]))


def test_kv_heads_mismatch(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="value"):
        sdpa(q, k, v[:, :2], enable_gqa=True)


@pytest.mark.parametrize("mask_shape", [(6,), (5, 6), (3, 5, 7), (3, 1, 1, 7), (4, 5, 1, 7)])
def test_mask_not_broadcastable(qkv, mask_shape):
    with pytest.raises(ValueError, match=rf"attn_mask.*{re.escape(str(mask_shape))}"):
        sdpa(*qkv, np.ones(mask_shape, dtype=bool))


def test_gqa_heads_not_divisible(rng):
    q, k, v = make_qkv(rng, np.float32, q_heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_heads_differ_without_gqa(rng, kv_heads):
    q, k, v = make_qkv(rng, np.float32, q_heads=4, kv_heads=kv_heads)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k, v)


# --- dtypes and types ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("bad_dtype", [np.int32, np.int64, np.bool_, np.complex64, np.complex128, object])
def test_non_float_dtype(qkv, name, bad_dtype):
    args = dict(zip(["query", "key", "value"], qkv))
    args[name] = args[name].astype(bad_dtype)
    with pytest.raises(TypeError, match=rf"{name}.*{np.dtype(bad_dtype)}"):
        sdpa(**args)


@pytest.mark.parametrize("name", ["key", "value"])
def test_mixed_dtypes(qkv, name):
    args = dict(zip(["query", "key", "value"], qkv))
    args[name] = args[name].astype(np.float64)
    with pytest.raises(TypeError, match=rf"{name}.*float64"):
        sdpa(**args)


def _swapped(dtype):
    return np.dtype(dtype).newbyteorder()


@pytest.mark.parametrize("which", ["query", "key", "value", "all"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_non_native_byte_order_is_refused(rng, which, dtype):
    # A big-endian float16 still names itself "float16": read as the CPU's own bits it gave wrong
    # values (max error ~3 on N(0, 1) inputs) instead of an error.
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    q, k, v = (x.astype(dtype) for x in make_qkv(rng, np.float32))
    args = {"query": q, "key": k, "value": v}
    for name in args if which == "all" else [which]:
        args[name] = args[name].astype(_swapped(dtype))
    first = "query" if which == "all" else which
    with pytest.raises(TypeError, match=rf"{first}: dtype must be .*native byte order"):
        sdpa(**args)


@pytest.mark.parametrize("name", ["query", "key", "value", "attn_mask", "out"])
@pytest.mark.parametrize("masked", ["one entry", "none"])
def test_masked_arrays_are_refused(qkv, name, masked):
    # np.asarray keeps a numpy.ma array's data and drops its mask, so a masked key was attended to
    # (and a masked out= entry overwritten but still hidden) without a word. Refused, like any input
    # pyattn cannot honour, even with nothing masked: the type promises what the kernels ignore.
    q, k, v = qkv
    args = {
        "query": q,
        "key": k,
        "value": v,
        "attn_mask": np.ones((5, 7), bool),
        "out": np.empty((2, 4, 5, 6), np.float32),
    }
    plain = sdpa(q, k, v, attn_mask=args["attn_mask"])
    mask = np.zeros(args[name].shape, bool)
    if masked == "one entry":
        mask.flat[0] = True
    args[name] = np.ma.masked_array(args[name], mask=mask)
    with pytest.raises(TypeError, match=rf"^{name}: masked arrays \(numpy.ma\) are not supported"):
        sdpa(args.pop("query"), args.pop("key"), args.pop("value"), **args)
    np.testing.assert_array_equal(sdpa(q, k, v, attn_mask=np.ones((5, 7), bool)), plain)  # nothing else changed


@pytest.mark.parametrize("source", ["unpickled", "metadata"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_equal_dtype_objects_are_the_same_dtype(rng, source, dtype):
    # An unpickled array's dtype (pickle rebuilds the descriptor), or one carrying metadata, equals
    # float32 but is another object; the core compared dtypes by identity and refused such arrays
    # ("query, key and value must share one dtype"). Every path: plain, mask, out=, weights.
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=4, q_len=5, kv_len=7, head_dim=8, value_dim=6)
    mask = rng.random((5, 7)) < 0.7
    fmask = np.where(mask, 0.5, -np.inf).astype(dtype)
    if source == "unpickled":
        import pickle

        same = lambda x: pickle.loads(pickle.dumps(x))  # noqa: E731
    else:
        same = lambda x: x.view(np.dtype(x.dtype, metadata={"source": "test"}))  # noqa: E731
    assert same(q).dtype == q.dtype and same(q).dtype is not q.dtype
    for kwargs in ({}, {"attn_mask": mask}, {"attn_mask": fmask}, {"is_causal": True}, {"return_weights": True}):
        expected = sdpa(q, k, v, **kwargs)
        changed = {n: same(a) if isinstance(a, np.ndarray) and a.dtype != bool else a for n, a in kwargs.items()}
        got = sdpa(same(q), same(k), same(v), **changed)
        for g, e in zip(
            got if isinstance(got, tuple) else [got], expected if isinstance(expected, tuple) else [expected]
        ):
            np.testing.assert_array_equal(g, e)
    out = same(np.empty((2, 4, 5, 6), dtype))
    assert sdpa(same(q), k, v, out=out) is out
    np.testing.assert_array_equal(out, sdpa(q, k, v))


def test_list_inputs_are_not_silently_promoted(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError):
        sdpa(q.tolist(), k, v)


@pytest.mark.parametrize("bad_dtype", [np.int8, np.int64, np.uint8, np.float64, np.complex64, object])
def test_mask_dtype(qkv, bad_dtype):
    with pytest.raises(TypeError, match=rf"attn_mask.*{np.dtype(bad_dtype)}"):
        sdpa(*qkv, np.zeros((5, 7), dtype=bad_dtype))


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf])
def test_non_finite_scale(qkv, scale):
    with pytest.raises(ValueError, match="scale"):
        sdpa(*qkv, scale=scale)


@pytest.mark.parametrize("is_causal", ["upper", "lower", "", "Upper_Left", 2, 0.5])
def test_bad_is_causal(qkv, is_causal):
    with pytest.raises((ValueError, TypeError), match="is_causal"):
        sdpa(*qkv, is_causal=is_causal)


def test_is_causal_unknown_string_is_value_error(qkv):
    with pytest.raises(ValueError, match="is_causal"):
        sdpa(*qkv, is_causal="diagonal")


# --- out= ---------------------------------------------------------------------------------------


def test_out_is_returned(qkv):
    out = np.empty((2, 4, 5, 6), dtype=np.float32)
    assert sdpa(*qkv, out=out) is out
    result, weights = sdpa(*qkv, out=out, return_weights=True)
    assert result is out
    assert weights.shape == (2, 4, 5, 7)


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (2, 4, 5), (1, 4, 5, 6), (2, 4, 5, 6, 1), (8, 5, 6)])
def test_out_wrong_shape(qkv, shape):
    with pytest.raises(ValueError, match=rf"out.*{re.escape(str(shape))}"):
        sdpa(*qkv, out=np.empty(shape, dtype=np.float32))


@pytest.mark.parametrize("bad_dtype", [np.float64, np.float16, np.int32])
def test_out_wrong_dtype(qkv, bad_dtype):
    with pytest.raises(TypeError, match="out"):
        sdpa(*qkv, out=np.empty((2, 4, 5, 6), dtype=bad_dtype))


@pytest.mark.parametrize("view", ["stepped", "transposed", "offset_rows", "fortran"])
def test_out_not_c_contiguous(qkv, view):
    if view == "stepped":
        out = np.empty((2, 4, 10, 6), dtype=np.float32)[:, :, ::2]
    elif view == "transposed":
        out = np.empty((2, 5, 4, 6), dtype=np.float32).swapaxes(1, 2)
    elif view == "offset_rows":
        out = np.full((2, 4, 5, 8), np.nan, dtype=np.float32)[..., 1:7]
    else:
        out = np.asfortranarray(np.empty((2, 4, 5, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="out"):
        sdpa(*qkv, out=out)


def test_out_read_only(qkv):
    out = np.empty((2, 4, 5, 6), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        sdpa(*qkv, out=out)


def test_out_not_an_array(qkv):
    with pytest.raises(TypeError, match="out"):
        sdpa(*qkv, out=np.zeros((2, 4, 5, 6), dtype=np.float32).tolist())


@pytest.mark.parametrize("name", ["query", "key", "value", "attn_mask"])
def test_out_overlaps_input(rng, name):
    # Every array is a view into one buffer; out covers the bytes of `name`.
    buffer = rng.standard_normal((4, 2, 5, 6)).astype(np.float32)
    inputs = dict(query=buffer[0], key=buffer[1], value=buffer[2], attn_mask=buffer[3, 0, :, :5])
    out = buffer[3] if name == "attn_mask" else inputs[name]
    with pytest.raises(ValueError, match="out"):
        sdpa(**inputs, out=out)


def test_out_overlaps_input_partially(rng):
    buffer = rng.standard_normal(3 * 60 + 7).astype(np.float32)
    q, k, v = (buffer[i * 60 : (i + 1) * 60].reshape(2, 5, 6) for i in range(3))
    with pytest.raises(ValueError, match="out"):
        sdpa(q, k, v, out=buffer[7:67].reshape(2, 5, 6))


def test_out_overlaps_a_strided_input(rng):
    # key reads every other row of `parent`; out is a contiguous block that straddles some of them.
    parent = rng.standard_normal((2, 10, 6)).astype(np.float32)
    q, v = (rng.standard_normal((2, 5, 6)).astype(np.float32) for _ in range(2))
    out = parent.reshape(-1)[6:66].reshape(2, 5, 6)
    with pytest.raises(ValueError, match="out"):
        sdpa(q, parent[:, ::2], v, out=out)


def test_out_next_to_an_input_is_fine(rng):
    buffer = rng.standard_normal(4 * 60).astype(np.float32)
    q, k, v, out = (buffer[i * 60 : (i + 1) * 60].reshape(2, 5, 6) for i in range(4))
    expected = sdpa(q.copy(), k.copy(), v.copy())
    assert sdpa(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, expected)


# --- num_threads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_threads", [0, -1, -8])
def test_num_threads_value(qkv, num_threads):
    with pytest.raises(ValueError, match="num_threads"):
        sdpa(*qkv, num_threads=num_threads)


@pytest.mark.parametrize("num_threads", [2.0, 2.5, "2", [2]])
def test_num_threads_type(qkv, num_threads):
    with pytest.raises(TypeError, match="num_threads"):
        sdpa(*qkv, num_threads=num_threads)


def test_num_threads_numpy_int(qkv):
    np.testing.assert_array_equal(sdpa(*qkv, num_threads=np.int64(2)), sdpa(*qkv, num_threads=2))


@pytest.mark.parametrize("num_threads", [2**31 - 1, 2**31, 2**40, np.int64(2**40)])
def test_num_threads_beyond_a_c_int_is_capped(qkv, num_threads):
    # More threads than work items are never started; a count beyond a C int is no error.
    out = np.empty_like(sdpa(*qkv))
    np.testing.assert_array_equal(sdpa(*qkv, num_threads=num_threads), sdpa(*qkv))
    np.testing.assert_array_equal(sdpa(*qkv, num_threads=num_threads, out=out), sdpa(*qkv))


@pytest.fixture
def restore_num_threads():
    yield
    pyattn.set_num_threads(None)  # back to the default (OMP_NUM_THREADS or all cores)


def test_set_get_num_threads(restore_num_threads, qkv):
    pyattn.set_num_threads(3)
    assert pyattn.get_num_threads() == 3
    assert pyattn.runtime_info()["num_threads"] == 3
    with_three = sdpa(*qkv)
    pyattn.set_num_threads(1)
    assert pyattn.get_num_threads() == 1
    np.testing.assert_array_equal(sdpa(*qkv), with_three)


def test_set_num_threads_beyond_a_c_int_is_capped(restore_num_threads, qkv):
    pyattn.set_num_threads(2**40)
    assert pyattn.get_num_threads() == 2**31 - 1
    expected = sdpa(*qkv, num_threads=1)
    np.testing.assert_array_equal(sdpa(*qkv), expected)


@pytest.mark.parametrize("bad", [0, -2])
def test_set_num_threads_rejects(restore_num_threads, bad):
    with pytest.raises(ValueError, match=r"\bn\b|num_threads"):
        pyattn.set_num_threads(bad)


def test_set_num_threads_none_restores_default(restore_num_threads):
    default = pyattn.get_num_threads()
    pyattn.set_num_threads(1 if default != 1 else 2)
    assert pyattn.get_num_threads() != default
    pyattn.set_num_threads(None)
    assert pyattn.get_num_threads() == default


def test_threadpoolctl_limits_pyattn(restore_num_threads, qkv):
    """README (Threads): the OpenMP runtime shows up in threadpool_info(), a threadpool_limits(1)
    block runs pyattn on one thread, and set_num_threads() / num_threads= take precedence."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not pyattn._core.openmp_enabled():
        pytest.skip("built without OpenMP")
    assert any(pool["user_api"] == "openmp" for pool in threadpoolctl.threadpool_info())
    pyattn.set_num_threads(None)
    default = pyattn.get_num_threads()
    expected = sdpa(*qkv)
    for user_api in (None, "openmp"):
        with threadpoolctl.threadpool_limits(1, user_api=user_api):
            assert pyattn.get_num_threads() == 1, user_api
            np.testing.assert_array_equal(sdpa(*qkv), expected)
            pyattn.set_num_threads(2)  # an explicit count wins over the limit
            assert pyattn.get_num_threads() == 2
            pyattn.set_num_threads(None)
            assert pyattn.get_num_threads() == 1
        assert pyattn.get_num_threads() == default, user_api


@pytest.mark.parametrize("count", ["1", "3"])
def test_omp_num_threads_is_the_default(count):
    """README (Threads): without set_num_threads(), OMP_NUM_THREADS gives the count."""
    result = _run_python("import pyattn; print(pyattn.get_num_threads())", OMP_NUM_THREADS=count)
    assert result.returncode == 0, result.stderr
    if pyattn._core.openmp_enabled():
        assert _last_line(result.stdout) == count


# --- sizes that cannot exist --------------------------------------------------------------------


def test_huge_broadcast_output_is_refused_cleanly():
    # Stride-0 inputs whose output would need petabytes: an exception, never a crash.
    q = np.broadcast_to(np.zeros((1, 1, 1, 8), dtype=np.float32), (2**25, 2**25, 1, 8))
    k = np.zeros((1, 1, 8), dtype=np.float32)
    with pytest.raises((ValueError, MemoryError)):
        sdpa(q, k, k)


def _run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "PYATTN_ISA"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


def _last_line(stdout):
    # What the probe printed: the last line (an editable install that rebuilds on import, as in
    # `pip install -Ceditable.rebuild=true -e .`, prints its own line to stdout first).
    lines = stdout.strip().splitlines()
    return lines[-1].strip() if lines else ""


# Peak resident memory (KiB) added by one call with L = S = 8192 in a fresh process; the scores
# alone would be 256 MiB in float32. Masks are stride-0 broadcasts of one row.
_MEMORY_PROBE = """
import resource, numpy as np, pyattn
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8192, 16), dtype=np.float32) for _ in range(3))
row = rng.random(8192) < 0.9
masks = dict(none=None, bool=np.broadcast_to(row, (8192, 8192)),
             float=np.broadcast_to(np.where(row, 0, -np.inf).astype(np.float32), (1, 8192, 8192)))
pyattn.scaled_dot_product_attention(q[:, :64], k[:, :64], v[:, :64], is_causal=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pyattn.scaled_dot_product_attention(q, k, v, masks[{mask!r}], is_causal={causal!r}, num_threads=2)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.parametrize("mask, causal", [("none", False), ("bool", "lower_right"), ("float", True)])
def test_no_quadratic_working_memory(mask, causal):
    result = _run_python(_MEMORY_PROBE.format(mask=mask, causal=causal))
    assert result.returncode == 0, result.stderr
    grown_kib = int(result.stdout.split()[-1])
    assert grown_kib < 32 * 1024, f"one call grew the peak RSS by {grown_kib} KiB"


# --- runtime ------------------------------------------------------------------------------------


def test_runtime_info_keys():
    info = pyattn.runtime_info()
    assert {"version", "isa", "available_isas", "num_threads", "openmp", "compiler"} <= set(info)
    assert info["isa"] == pyattn.get_isa()
    assert info["isa"] in info["available_isas"]
    assert list(info["available_isas"]) == list(pyattn.available_isas())
    assert info["version"] == pyattn.__version__
    assert isinstance(info["num_threads"], int) and info["num_threads"] >= 1
    # The CPU as the tuning module plans with it (CPUID): a known vendor or "unknown", the display
    # family (0 off x86, else 3 .. 0xf + 0xff), cache sizes 0 (unknown) or plausible, the last level
    # not below L2, and the ISA features agreeing with the ISAs this CPU runs.
    cpu = info["cpu"]
    assert set(cpu) == {"vendor", "family", "model", "l1d_bytes", "l2_bytes", "llc_bytes", "avx2", "avx512"}
    assert cpu["vendor"] in ("intel", "amd", "unknown")
    assert 0 <= cpu["family"] <= 0xF + 0xFF and 0 <= cpu["model"] <= 0xFF
    assert cpu["l2_bytes"] == 0 or 64 * 1024 <= cpu["l2_bytes"] <= 64 * 1024 * 1024
    assert cpu["llc_bytes"] >= cpu["l2_bytes"]
    assert cpu["avx2"] == ("avx2" in info["available_isas"])
    assert cpu["avx512"] == ("avx512" in info["available_isas"])
    assert cpu == pyattn._core.cpu_info()


@pytest.mark.parametrize("nbytes", [0, 1, 63, 255, 257, 4096 + 17])
def test_read_buffers_every_length(isa, nbytes):
    # The benchmarks' read ceiling, read with each ISA's widest loads: whole vectors, then a byte
    # tail (an over-read past an odd-sized buffer shows under the sanitizer build); sizes are not
    # timed, only that a rate comes back and the buffer is left as it was.
    parent = np.full(nbytes + 128, 0xAB, np.uint8)
    buf = parent[64 : 64 + nbytes]
    before = buf.copy()
    gbs = pyattn._machine.read_buffers_gbs([buf, parent[:3]], 2)
    assert np.isfinite(gbs) and gbs >= 0
    np.testing.assert_array_equal(buf, before)
    once = pyattn._machine.read_buffers_gbs([buf], 1, repeats=1)
    assert np.isfinite(once) and once >= 0
    np.testing.assert_array_equal(buf, before)


def test_read_buffers_rejects_no_passes():
    with pytest.raises(ValueError, match="repeats"):
        pyattn._machine.read_buffers_gbs([np.zeros(64, np.uint8)], 1, repeats=0)


def test_machine_ceilings_take_only_isas_this_cpu_runs():
    # The benchmark ceilings (pyattn._machine) run the loops of the ISA pyattn runs, or of one named
    # among pyattn.available_isas(); any other name is refused before a loop runs.
    for name in pyattn.available_isas():
        assert pyattn._machine.fma_peak_gflops(1, 0.001, isa=name) > 0
    for bad in ("sse9", *(n for n in ("avx2", "avx512", "avx512bf16") if n not in pyattn.available_isas())):
        with pytest.raises(ValueError, match="isa"):
            pyattn._machine.fma_peak_gflops(1, 0.001, isa=bad)
        with pytest.raises(ValueError, match="isa"):
            pyattn._machine.dot16_peak_gflops(1, 0.001, isa=bad)


def test_machine_dot16_ceiling_only_where_the_isa_has_it():
    for name in pyattn.available_isas():
        if name == "avx512bf16":
            assert pyattn._machine.dot16_peak_gflops(1, 0.001, isa=name) > 0
        else:
            with pytest.raises(ValueError, match="no bfloat16 dot product"):
                pyattn._machine.dot16_peak_gflops(1, 0.001, isa=name)


def test_show_config_prints(capsys):
    pyattn.show_config()
    printed = capsys.readouterr().out
    assert pyattn.get_isa() in printed
    assert pyattn.__version__ in printed


def test_isa_fixture_follows_pyattn_isa(monkeypatch):
    # PYATTN_ISA=name pytest runs the ISA-parametrised tests on that ISA only; unset, on every ISA.
    from conftest import _fixture_isas

    monkeypatch.delenv("PYATTN_ISA", raising=False)
    assert _fixture_isas() == pyattn.available_isas()
    monkeypatch.setenv("PYATTN_ISA", "generic")
    assert _fixture_isas() == ["generic"]


def test_available_isas():
    isas = pyattn.available_isas()
    assert isas[0] == "generic"
    assert set(isas) <= {"generic", "avx2", "avx512", "avx512bf16"}
    assert len(set(isas)) == len(isas)
    # avx512bf16 is the avx512 kernels plus bfloat16 dot products: never without them
    assert "avx512bf16" not in isas or "avx512" in isas


def test_set_isa(isa):
    assert pyattn.get_isa() == isa


def test_set_isa_unknown_name():
    before = pyattn.get_isa()
    with pytest.raises(ValueError):
        pyattn._core._set_isa("sse9")
    assert pyattn.get_isa() == before


@pytest.mark.parametrize("name", pyattn.available_isas())
def test_pyattn_isa_env_forces_isa(name):
    result = _run_python("import pyattn; print(pyattn.get_isa())", PYATTN_ISA=name)
    assert result.returncode == 0, result.stderr
    assert _last_line(result.stdout) == name


def test_pyattn_isa_env_unknown_name_fails_clearly():
    result = _run_python("import pyattn", PYATTN_ISA="sse9")
    assert result.returncode != 0
    assert "PYATTN_ISA" in result.stderr
    assert "sse9" in result.stderr


def test_no_env_picks_best_isa():
    result = _run_python("import pyattn; print(pyattn.get_isa())")
    assert result.returncode == 0, result.stderr
    assert _last_line(result.stdout) == pyattn.available_isas()[-1]


def test_outputs_start_on_a_cache_line(rng):
    """Outputs pyattn allocates (out, return_weights / need_weights) start on a 64-byte line, not
    NumPy's 16 bytes: the kernels' vector stores into rows that straddle two lines cost two."""
    for dtype in (np.float32, np.float64):
        for shape in ((1, 1, 1, 1), (2, 3, 5, 7), (1, 4, 33, 16), (3, 1, 9, 24)):
            q = rng.standard_normal(shape).astype(dtype)
            out, weights = pyattn.scaled_dot_product_attention(q, q, q, return_weights=True)
            assert out.ctypes.data % 64 == 0 and weights.ctypes.data % 64 == 0, (dtype, shape)
            assert out.flags.c_contiguous and out.flags.writeable and weights.flags.c_contiguous
            # Plain q/k/v calls take the core's one-step path, which allocates `out` itself.
            assert pyattn.scaled_dot_product_attention(q, q, q).ctypes.data % 64 == 0, (dtype, shape)
            assert pyattn.scaled_dot_product_attention(q, q, q, is_causal=True).ctypes.data % 64 == 0, (dtype, shape)
        x = rng.standard_normal((2, 5, 16)).astype(dtype)
        layer = pyattn.MultiHeadAttention(16, 4, dtype=dtype, seed=0)
        y, w = layer(x, need_weights=True, average_attn_weights=False)
        assert y.ctypes.data % 64 == 0 and w.ctypes.data % 64 == 0, dtype
        assert layer(x).ctypes.data % 64 == 0, dtype
        # Decoding: the layer's step over a KV cache, and a cache's own attend().
        layer = pyattn.MultiHeadAttention(16, 4, dtype=dtype, seed=0, num_kv_heads=2)
        for storage in (dtype, np.float16):
            if storage == np.float16 and dtype != np.float32:
                continue  # 16-bit caches compute in float32
            cache = pyattn.KVCache(2, 2, 4, 16, dtype=storage)
            for chunk in (3, 1, 1):
                step = layer(rng.standard_normal((2, chunk, 16)).astype(dtype), kv_cache=cache)
                assert step.ctypes.data % 64 == 0, (dtype, storage, chunk)
            cache = pyattn.KVCache(2, 2, 8, 16, dtype=storage)
            kv = rng.standard_normal((2, 2, 3, 8)).astype(dtype)
            cache.append(kv, kv)
            attended = cache.attend(rng.standard_normal((2, 4, 3, 8)).astype(dtype))
            assert attended.ctypes.data % 64 == 0, (dtype, storage)
    # 16-bit inputs: computed in float32, the result rounded into a fresh 16-bit array, also on a line.
    halves = [np.float16]
    try:
        import ml_dtypes

        halves.append(ml_dtypes.bfloat16)
    except ImportError:  # bfloat16 arrays need ml_dtypes (the test extra installs it)
        pass
    for dtype in halves:
        q = rng.standard_normal((2, 3, 5, 7)).astype(dtype)
        out, weights = pyattn.scaled_dot_product_attention(q, q, q, return_weights=True)
        assert out.dtype == dtype and out.ctypes.data % 64 == 0 and weights.ctypes.data % 64 == 0, dtype
        assert pyattn.scaled_dot_product_attention(q, q, q).ctypes.data % 64 == 0, dtype
