# SPDX-License-Identifier: MIT
"""pyattn.distributed on a real Dask cluster: a LocalCluster of 2 worker processes on 127.0.0.1
(ephemeral ports, no dashboard), started and stopped by this module's fixtures.

Sharded results equal the single-process call to the float32 tolerance: encoder (no mask), causal
with the queries split too (context parallelism), windowed with every variant option, GQA, uneven
and empty shards, shards as futures and as a dask array; map_batches equals the layer on the whole
batch; the sharded KV cache's decode steps equal a KVCache's, across shard boundaries; inputs are
never modified; a worker that dies with the shards it held gives an error, and a call that can
resend its inputs gives the right result; errors name their argument. Skipped without Dask.
"""

import contextlib
import os

import numpy as np
import pytest

pytest.importorskip("distributed")

from distributed import Client, LocalCluster  # noqa: E402

import pyattn  # noqa: E402
import pyattn.distributed as pd  # noqa: E402

from conftest import tol  # noqa: E402


def local_cluster():
    # Every server on 127.0.0.1 and an ephemeral port: the scheduler, the workers and the scheduler's
    # HTTP endpoint (which it starts even without a dashboard, on 8787 unless told otherwise).
    return LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        scheduler_port=0,
        dashboard_address="127.0.0.1:0",
        scheduler_kwargs={"dashboard": False},
    )


@pytest.fixture(scope="module")
def client():
    with local_cluster() as cluster, Client(cluster) as c:
        yield c


def problem(rng, dtype=np.float32, batch=1, hq=4, hk=2, q_len=90, kv_len=300, dim=16):
    q = rng.standard_normal((batch, hq, q_len, dim)).astype(dtype)
    k = rng.standard_normal((batch, hk, kv_len, dim)).astype(dtype)
    v = rng.standard_normal((batch, hk, kv_len, dim)).astype(dtype)
    return q, k, v


def shards(x, cuts):
    return [x[..., a:b, :] for a, b in zip(cuts[:-1], cuts[1:])]


CUTS = {"even": [0, 150, 300], "uneven": [0, 7, 7, 200, 300], "one": [0, 300], "empty_last": [0, 300, 300]}
OPTIONS = {
    "encoder": {},
    "causal": {"is_causal": True},
    "lower_right": {"is_causal": "lower_right"},
    "window+all": {
        "is_causal": "lower_right",
        "window": (40, 0),
        "softcap": 3.0,
        "sinks": np.array([0.5, -1.0, 2.0, 0.0]),
        "alibi_slopes": np.linspace(0, 0.2, 4),
    },
    "local window": {"window": (10, 10)},
}


@pytest.mark.parametrize("cuts", sorted(CUTS))
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("query_blocks", [1, 3])
def test_sharded_equals_single_process(client, rng, cuts, options, query_blocks):
    q, k, v = problem(rng)
    before = [x.copy() for x in (q, k, v)]
    got = pd.sharded_attention(
        q,
        shards(k, CUTS[cuts]),
        shards(v, CUTS[cuts]),
        client=client,
        enable_gqa=True,
        query_blocks=query_blocks,
        **OPTIONS[options],
    )
    want = pyattn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **OPTIONS[options])
    np.testing.assert_allclose(got, want, *tol(np.float32))
    for x, b in zip((q, k, v), before):
        np.testing.assert_array_equal(x, b)


def test_sharded_float64_futures_and_dask_arrays(client, rng):
    da = pytest.importorskip("dask.array")
    q, k, v = problem(rng, np.float64, batch=2)
    k_futures = client.scatter(shards(k, [0, 100, 300]), hash=False)
    v_futures = client.scatter(shards(v, [0, 100, 300]), hash=False)
    got = pd.sharded_attention(q, k_futures, v_futures, client=client, is_causal=True, enable_gqa=True)
    want = pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(got, want, *tol(np.float64))
    kd = da.from_array(k, chunks=(2, 2, 60, 16))
    vd = da.from_array(v, chunks=(2, 2, 60, 16))
    got = pd.sharded_attention(q, kd, vd, client=client, is_causal=True, enable_gqa=True, query_blocks=2)
    np.testing.assert_allclose(got, want, *tol(np.float64))


def test_map_batches_equals_the_layer(client, rng):
    layer = pyattn.MultiHeadAttention(32, 4, num_kv_heads=2, seed=1, window=(5, 0), sinks=True)
    x = rng.standard_normal((7, 20, 32)).astype(np.float32)
    got = pd.map_batches(layer, x, client=client, batch_chunk=3, is_causal=True).compute()
    np.testing.assert_allclose(got, layer(x, is_causal=True), *tol(np.float32))


def test_sharded_kv_cache_decode_equals_a_kv_cache(client, rng):
    q, k, v = problem(rng, q_len=1, kv_len=300)
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    sharded = pd.ShardedKVCache(client, 2, 1, 2, 16, 160)
    single = pyattn.KVCache(1, 2, 16, 320)
    for cache in (sharded, single):
        cache.append(k[:, :, :150], v[:, :, :150])
    for t in range(150, 300, 13):  # the 11th token of this chunk starts the second shard
        n = min(13, 300 - t)
        for cache in (sharded, single):
            cache.append(k[:, :, t : t + n], v[:, :, t : t + n])
        query = rng.standard_normal((1, 4, n, 16)).astype(np.float32)
        got = sharded.attend(query, sinks=sinks, softcap=4.0)
        want = single.attend(query, sinks=sinks, softcap=4.0)
        np.testing.assert_allclose(got, want, *tol(np.float32))
    assert sharded.lengths == [160, 140]
    with pytest.raises(ValueError, match="fit"):
        sharded.append(k[:, :, :30], v[:, :, :30])


def test_a_worker_that_dies_gives_an_error_or_the_right_result(rng):
    q, k, v = problem(rng)
    want = pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with local_cluster() as cluster, Client(cluster) as client:
        k_futures = client.scatter(shards(k, [0, 150, 300]), hash=False)
        v_futures = client.scatter(shards(v, [0, 150, 300]), hash=False)
        holders = {w for f in k_futures for w in client.who_has([f])[f.key]}
        victim = sorted(holders)[0]
        with contextlib.suppress(Exception):  # the run's own reply is lost with the process
            client.run(os._exit, 1, workers=[victim])  # the process dies with the shards it held
        try:
            got = pd.sharded_attention(q, k_futures, v_futures, client=client, is_causal=True, enable_gqa=True)
        except Exception as exc:  # noqa: BLE001  (Dask's own errors: lost data, cancelled futures)
            assert "lost" in str(exc).lower() or "cancel" in str(exc).lower() or "worker" in str(exc).lower(), exc
        else:
            np.testing.assert_allclose(got, want, *tol(np.float32))
        # Inputs the call scatters itself are sent again: the right result.
        client.wait_for_workers(2, timeout=60)
        got = pd.sharded_attention(
            q, shards(k, [0, 150, 300]), shards(v, [0, 150, 300]), client=client, is_causal=True, enable_gqa=True
        )
        np.testing.assert_allclose(got, want, *tol(np.float32))


def test_errors(client, rng):
    q, k, v = problem(rng)
    with pytest.raises(TypeError, match="client"):
        pd.sharded_attention(q, [k], [v], client="tcp://nowhere")
    with pytest.raises(ValueError, match="shard lengths"):
        pd.sharded_attention(q, shards(k, [0, 100, 300]), shards(v, [0, 200, 300]), client=client, enable_gqa=True)
    with pytest.raises(ValueError, match="query_blocks"):
        pd.sharded_attention(q, [k], [v], client=client, enable_gqa=True, query_blocks=0)
    with pytest.raises(ValueError, match="window"):
        pd.sharded_attention(q, [k], [v], client=client, enable_gqa=True, window=(-1, 0))
    with pytest.raises(ValueError, match="key"):
        pd.sharded_attention(q, [k[..., :8]], [v], client=client, enable_gqa=True)
    with pytest.raises(TypeError, match="key_shards"):
        pd.sharded_attention(q, k, v, client=client)
