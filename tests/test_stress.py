# SPDX-License-Identifier: MIT
"""Thread safety under load: many Python threads call every public function at once.

Covered: scaled_dot_product_attention, mha, MultiHeadAttention.__call__ (also over a KV cache),
KVCache (append/attend),
runtime_info, get_isa, available_isas, show_config, set_num_threads / get_num_threads. (explain()
is float64 NumPy without the core, so it has no shared state to race on.)

Each job is computed once single-threaded first; then a pool of Python threads runs all jobs several
times, interleaved, each with its own per-call OpenMP thread count, while other threads read the
runtime configuration and change the default thread count. Every concurrent result must equal the
single-threaded one bit for bit (DESIGN: results are identical for any thread count, and the GIL is
released during the computation). The default thread count is restored afterwards.
"""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pyattn

from conftest import make_qkv, random_mask

sdpa = pyattn.scaled_dot_product_attention
ROUNDS = 4


@pytest.fixture
def restore_default_threads():
    before = pyattn.get_num_threads()
    try:
        yield
    finally:
        pyattn.set_num_threads(None)
        if pyattn.get_num_threads() != before:  # it had been set explicitly
            pyattn.set_num_threads(before)


def _sdpa_jobs(rng):
    """A mix of shapes and options: causal variants, masks, GQA, decode rows, weights, out=."""
    jobs = []
    for i, dtype in enumerate([np.float32, np.float64] * 5):
        q_len = [1, 7, 64, 130, 1][i % 5]
        kv_len = [300, 65, 128, 257, 1500][i % 5]
        q, k, v = make_qkv(
            rng,
            dtype,
            batch=(2,),
            q_heads=4,
            kv_heads=[4, 2, 1, 4, 2][i % 5],
            q_len=q_len,
            kv_len=kv_len,
            head_dim=[64, 32, 16, 48, 64][i % 5],
        )
        kwargs = dict(is_causal=[False, True, "lower_right", False, "upper_left"][i % 5], enable_gqa=True)
        mask = None
        if i % 3 == 1:
            mask = random_mask(rng, (q_len, kv_len), "bool", dtype)
        elif i % 3 == 2:
            mask = random_mask(rng, (1, 4, q_len, kv_len), "float", dtype)
        if i % 4 == 3:
            kwargs["return_weights"] = True
        jobs.append(("sdpa", (q, k, v, mask), kwargs))
    return jobs


def _mha_jobs(rng):
    jobs = []
    for dtype in (np.float32, np.float64):
        for num_kv_heads in (4, 2):
            seed = int(rng.integers(1000))
            layer = pyattn.MultiHeadAttention(64, 4, num_kv_heads=num_kv_heads, dtype=dtype, seed=seed)
            x = rng.standard_normal((2, 33, 64)).astype(dtype)
            mem = rng.standard_normal((2, 70, 64)).astype(dtype)
            jobs.append(("layer", (layer, x), dict(is_causal=True)))
            jobs.append(("layer", (layer, x, mem, mem), dict(need_weights=True, average_attn_weights=False)))
            padding = rng.random((2, 70)) < 0.2
            jobs.append(("layer", (layer, x, mem, mem), dict(key_padding_mask=padding)))
            state = layer.state_dict()
            weights = dict(
                in_proj_weight=state.get("in_proj_weight"),
                in_proj_bias=state.get("in_proj_bias"),
                q_proj_weight=state.get("q_proj_weight"),
                k_proj_weight=state.get("k_proj_weight"),
                v_proj_weight=state.get("v_proj_weight"),
                out_proj_weight=state["out_proj.weight"],
                out_proj_bias=state.get("out_proj.bias"),
            )
            weights = {name: w for name, w in weights.items() if w is not None}
            jobs.append(("mha", (x,), dict(num_heads=4, num_kv_heads=num_kv_heads, is_causal="lower_right", **weights)))
    return jobs


def _cache_jobs(rng):
    """Incremental decoding with a KVCache: a prompt of per-row lengths, then single-token steps.

    A cache is stateful, so every run builds its own from the same arrays."""
    if not hasattr(pyattn, "KVCache"):
        return []
    jobs = []
    for storage in ("float32", "float64", "float16"):
        compute = np.float64 if storage == "float64" else np.float32
        prompt = [rng.standard_normal((2, 2, 12, 32)).astype(compute) for _ in range(3)]
        steps = [[rng.standard_normal((2, n, 1, 32)).astype(compute) for n in (2, 2, 4)] for _ in range(4)]
        jobs.append(("cache", (storage, prompt, steps), {}))
    for storage in ("float32", "bfloat16" if _has_ml_dtypes() else "float16"):
        # The layer's step over a cache (one call into the core: projections, K/V into the cache,
        # attention, output projection): a shared layer, a cache per run.
        layer = pyattn.MultiHeadAttention(32, 4, num_kv_heads=2, seed=int(rng.integers(1 << 30)))
        tokens = [rng.standard_normal((2, n, 32)).astype(np.float32) for n in (5, 1, 1, 3, 1)]
        jobs.append(("layer_cache", (layer, storage, tokens), {}))
    return jobs


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def _decode_layer(layer, storage, tokens, num_threads):
    cache = pyattn.KVCache(2, 2, 8, 16, dtype=storage)
    outs = [layer(tokens[0], kv_cache=cache, num_new=np.array([5, 2]), num_threads=num_threads)]
    outs += [layer(x, kv_cache=cache, num_threads=num_threads) for x in tokens[1:]]
    return tuple(outs)


def _decode(storage, prompt, steps, num_threads):
    cache = pyattn.KVCache(2, 2, 32, 64, dtype=storage)
    k, v, q = prompt
    cache.append(k, v, num_new=np.array([12, 7]))
    outs = [cache.attend(np.concatenate([q, q], axis=1), num_threads=num_threads)]
    for k1, v1, q1 in steps:
        cache.append(k1, v1)
        outs.append(cache.attend(q1, num_threads=num_threads))
    return tuple(outs)


def _run(job, num_threads):
    kind, args, kwargs = job
    if kind == "sdpa":
        return sdpa(*args, num_threads=num_threads, **kwargs)
    if kind == "cache":
        return _decode(*args, num_threads)
    if kind == "layer_cache":
        return _decode_layer(*args, num_threads)
    if kind == "layer":
        layer, *inputs = args
        return layer(*inputs, num_threads=num_threads, **kwargs)
    return pyattn.mha(*args, num_threads=num_threads, **kwargs)


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def test_concurrent_calls_of_every_public_function(rng, restore_default_threads):
    jobs = _sdpa_jobs(rng) + _mha_jobs(rng) + _cache_jobs(rng)
    expected = [_as_tuple(_run(job, 1)) for job in jobs]
    work = [(n, r) for r in range(ROUNDS) for n in range(len(jobs))]
    random.Random(7).shuffle(work)
    stop = threading.Event()
    config_errors = []

    def check(item):
        n, r = item
        threads = None if (n + r) % 4 == 0 else 1 + (n + r) % 3  # None: the (changing) default
        got = _as_tuple(_run(jobs[n], threads))
        assert len(got) == len(expected[n])
        for a, b in zip(got, expected[n]):
            np.testing.assert_array_equal(a, b, err_msg=f"job {n} ({jobs[n][0]}) round {r} threads {threads}")
        return n

    def configure():
        # Reads and changes of the runtime configuration while calls are in flight.
        k = 0
        while not stop.is_set():
            try:
                pyattn.set_num_threads(1 + k % 3)
                assert pyattn.get_num_threads() >= 1
                info = pyattn.runtime_info()
                assert info["isa"] in info["available_isas"] and info["num_threads"] >= 1
                assert pyattn.get_isa() in pyattn.available_isas()
                k += 1
            except Exception as exc:  # reported after the pool finishes
                config_errors.append(exc)
                return

    configurer = threading.Thread(target=configure)
    configurer.start()
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            done = list(pool.map(check, work))
    finally:
        stop.set()
        configurer.join()
    assert sorted(done) == sorted(n for n, _ in work)
    assert not config_errors, config_errors


def test_show_config_and_runtime_info_from_threads(capsys):
    def query(_):
        info = pyattn.runtime_info()
        pyattn.show_config()
        return info

    with ThreadPoolExecutor(max_workers=8) as pool:
        infos = list(pool.map(query, range(64)))
    assert all(info == infos[0] for info in infos)
    assert capsys.readouterr().out.count("available_isas") == 64


def test_same_out_array_from_many_threads_is_never_corrupted(rng):
    # Distinct out= arrays written concurrently, inputs shared read-only by every thread.
    q, k, v = make_qkv(rng, np.float32, batch=(1,), q_heads=8, q_len=96, kv_len=200, head_dim=64)
    expected = sdpa(q, k, v, is_causal=True, num_threads=1)
    outs = [np.full(expected.shape, np.nan, dtype=np.float32) for _ in range(24)]

    def fill(i):
        for _ in range(3):
            assert sdpa(q, k, v, is_causal=True, out=outs[i], num_threads=1 + i % 4) is outs[i]

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(fill, range(len(outs))))
    for out in outs:
        np.testing.assert_array_equal(out, expected)
