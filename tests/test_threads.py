# SPDX-License-Identifier: MIT
"""Threads: bitwise determinism over num_threads, and concurrent calls from several Python threads."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pyattn
from pyattn import reference

from conftest import assert_close, make_qkv, random_mask

sdpa = pyattn.scaled_dot_product_attention


@pytest.mark.parametrize(
    "batch, heads, q_len, kv_len, options",
    [
        (2, 3, 300, 257, dict(is_causal=True)),
        (1, 2, 513, 513, dict(mask="bool")),
        (3, 4, 64, 1000, dict(mask="float", is_causal="lower_right")),
        (1, 1, 1030, 77, dict(return_weights=True)),
    ],
)
def test_bitwise_identical_for_any_thread_count(isa, dtype, rng, batch, heads, q_len, kv_len, options):
    options = dict(options)
    mask_kind = options.pop("mask", None)
    q, k, v = make_qkv(rng, dtype, batch=(batch,), q_heads=heads, q_len=q_len, kv_len=kv_len, head_dim=64)
    mask = None if mask_kind is None else random_mask(rng, (q_len, kv_len), mask_kind, dtype)
    results = []
    for n in (1, 2, 3, 4):
        result = sdpa(q, k, v, mask, num_threads=n, **options)
        results.append(result if isinstance(result, tuple) else (result,))
    for result in results[1:]:
        for first, other in zip(results[0], result):
            np.testing.assert_array_equal(first, other)


def test_more_threads_than_work(isa, dtype, rng):
    q, k, v = make_qkv(rng, dtype, q_heads=3, q_len=33, kv_len=65, head_dim=8)
    expected = sdpa(q, k, v, num_threads=1)
    for n in (7, 64):
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=n), expected)


def test_decode_shape_across_thread_counts(isa, dtype, rng):
    # One query row against a long cache: DESIGN allows splitting the row across threads here, so
    # results need only agree within tolerance (and with the reference).
    q, k, v = make_qkv(rng, dtype, batch=(1,), q_heads=2, q_len=1, kv_len=4099, head_dim=64)
    expected = reference.scaled_dot_product_attention(q, k, v)
    for n in (1, 2, 3, 4):
        assert_close(sdpa(q, k, v, num_threads=n), expected, dtype)


def test_concurrent_calls_from_python_threads(dtype, rng):
    jobs = []
    for i in range(12):
        q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=60 + 7 * i, kv_len=90 + 11 * i, head_dim=32)
        mask = random_mask(rng, (q.shape[-2], k.shape[-2]), "bool", dtype) if i % 3 == 0 else None
        causal = [False, True, "lower_right"][i % 3]
        jobs.append(dict(query=q, key=k, value=v, attn_mask=mask, is_causal=causal, num_threads=1 + i % 3))
    expected = [sdpa(**dict(job, num_threads=1)) for job in jobs]

    def run(job):
        return [sdpa(**job) for _ in range(3)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, jobs))
    for want, got in zip(expected, results):
        for result in got:
            np.testing.assert_array_equal(result, want)


def test_concurrent_calls_writing_to_out(dtype, rng):
    q, k, v = make_qkv(rng, dtype, batch=(2,), q_heads=2, q_len=100, kv_len=100, head_dim=32)
    expected = sdpa(q, k, v, num_threads=1)
    outs = [np.full(expected.shape, np.nan, dtype=dtype) for _ in range(8)]

    def run(i):
        return sdpa(q, k, v, out=outs[i], num_threads=1 + i % 2)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(8)))
    for out, result in zip(outs, results):
        assert result is out
        np.testing.assert_array_equal(out, expected)


_FORK_CHILD = r"""
import os, sys
import numpy as np
import pyattn

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 256, 64)).astype(np.float32) for _ in range(3))
x = rng.standard_normal((2, 8, 32)).astype(np.float32)
layer = pyattn.MultiHeadAttention(32, 4, seed=0)
if sys.argv[1] == "after":  # the parent runs teams of two threads before forking
    expected, expected_layer = pyattn.scaled_dot_product_attention(q, k, v, num_threads=2), layer(x, num_threads=2)
else:  # the parent forks before any team ran
    pyattn.set_num_threads(2)
    expected, expected_layer = pyattn.scaled_dot_product_attention(q, k, v, num_threads=1), layer(x, num_threads=1)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    got = pyattn.scaled_dot_product_attention(q, k, v, num_threads=2)
    same = np.array_equal(got, expected) and np.array_equal(layer(x, num_threads=2), expected_layer)
    report = f"{int(same)} {pyattn.get_num_threads()} {pyattn.runtime_info()['openmp']}"
    os.write(write, report.encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
print(os.read(read, 1000).decode(), "|", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(
    not hasattr(os, "fork") or pyattn._core.openmp_runtime() != "libgomp (GNU)", reason="fork and GNU libgomp only"
)
@pytest.mark.parametrize("when", ["after", "before"])
def test_forked_children_do_not_hang(when):
    """A process forked after a parallel region (multiprocessing's "fork" start method, pre-forking
    servers) inherits libgomp's pool without its threads, and its first team waited for them
    forever. Such a child now runs single-threaded (same bits) and says so; a child forked before
    any team ran keeps its threads. In a fresh interpreter, so that no team ran in it before."""
    done = subprocess.run([sys.executable, "-c", _FORK_CHILD, when], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report, exit_code = done.stdout.strip().rsplit("|", 1)
    same, threads, runtime = report.strip().split(" ", 2)
    assert exit_code.strip() == "0" and same == "1", done.stdout
    if when == "after":
        assert threads == "1" and "single-threaded: this process was forked" in runtime, report
    else:
        assert threads == "2" and runtime == "libgomp (GNU)", report


_SMALLER_TEAM = """
import numpy as np, pyattn
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 200, 64), dtype=np.float32) for _ in range(3))
cache = pyattn.KVCache(2, 2, 64, 600)
cache.append(*(rng.standard_normal((2, 2, 500, 64), dtype=np.float32) for _ in range(2)))
query = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
cache.append(*(rng.standard_normal((2, 2, 1, 64), dtype=np.float32) for _ in range(2)))
layer = pyattn.MultiHeadAttention(64, 4, seed=0)
x = rng.standard_normal((3, 40, 64), dtype=np.float32)
def run(n):
    return (pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=n),
            pyattn.scaled_dot_product_attention(q[:, :, :1], k, v, num_threads=n),
            cache.attend(query, num_threads=n), layer(x, num_threads=n))
print(int(all(np.array_equal(a, b) for a, b in zip(run(1), run(4)))))
"""


@pytest.mark.parametrize("limit", ["1", "3"])
def test_every_item_runs_when_the_team_is_smaller_than_asked(limit):
    """Each thread of a loop owns a range of the items and takes what is left of the others' once
    its own are done (ItemRanges, parallel.h). OpenMP may start fewer threads than a call asks for
    (OMP_THREAD_LIMIT here; nested regions, OMP_DYNAMIC): the ranges of threads that never started
    must still run, by the ones that did. Four threads asked, one or three started: the same bits
    as one thread (attention, a decode step, a layer). In a fresh interpreter for the limit."""
    env = dict(os.environ, OMP_THREAD_LIMIT=limit)
    done = subprocess.run([sys.executable, "-c", _SMALLER_TEAM], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", done.stdout
