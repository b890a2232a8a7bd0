# SPDX-License-Identifier: MIT
"""Exact attention beyond one machine, on Dask (``pip install "pyattn[dask]"``).

Attention over a key set split into shards is exact when every shard's partial result carries its
rows' log-sum-exp: with ``M = max_p lse_p`` and ``w_p = exp(lse_p - M)``, the output over all keys is
``Σ_p w_p out_p / Σ_p w_p`` and its log-sum-exp ``M + log Σ_p w_p``
(:func:`pyattn.merge_attention_states`). This module runs the partial calls as Dask tasks where the
shards live and merges them in a tree of merge tasks, so only query blocks, partial outputs and
their log-sum-exps travel, never keys or values:

- :func:`sharded_attention`: one attention call with K/V split along the sequence over workers
  (NumPy arrays to scatter, futures already there, or a ``dask.array`` chunked along the sequence),
  optionally with the queries split too (context parallelism: each (query block, key shard) pair is
  one task; pairs that the causal rule or the window forbid entirely are not scheduled).
- :func:`map_batches`: a layer or any pyattn call over a ``dask.array`` batch, the layer sent to each
  worker once.
- :class:`ShardedKVCache`: a KV cache for decoding whose shards are Dask actors on the workers; a
  decode step sends only the new query rows and merges the shards' (output, lse) pairs.

Every pyattn call in a task runs with an explicit thread count (``threads_per_task``, default 1: one
Dask worker thread drives that many pyattn threads), so workers never oversubscribe their cores.
Nothing listens but Dask's own scheduler and workers; point ``client`` at any cluster
(``Client("tcp://scheduler:8786")``) and the same code runs across machines.
"""

from __future__ import annotations

import numpy as np

from . import _core
from ._api import merge_attention_states, scaled_dot_product_attention
from ._cache import KVCache, attend_from

try:
    import dask.array as da
    from distributed import Client, Future, get_client
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('pyattn.distributed needs Dask: pip install "pyattn[dask]"') from exc

__all__ = ["ShardedKVCache", "map_batches", "sharded_attention"]


def _client(client):
    if client is None:
        return get_client()
    if not isinstance(client, Client):
        raise TypeError(f"client: expected a distributed.Client or None, got {type(client).__name__}")
    return client


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


# -- tasks (run on the workers) ----------------------------------------------------------------------


def _partial(query, key, value, diagonal, causal, options, threads):
    """One (query block, key shard) pair: the block's output over the shard and its lse. `diagonal`
    places the block in the whole problem: query row i's diagonal key is shard key i + diagonal."""
    return _core.sdpa(
        query,
        key,
        value,
        None,
        causal,
        options["scale"],
        options["enable_gqa"],
        False,
        None,
        threads,
        options["window"],
        options["softcap"],
        None,
        options["alibi_slopes"],
        True,
        diagonal,
    )


def _merge(parts, sinks, threads):
    """(out, lse) of several (out, lse) pairs of the same rows."""
    outs, lses = zip(*parts)
    return merge_attention_states(list(outs), list(lses), sinks=sinks, num_threads=threads)


def _shape(x):
    return tuple(np.shape(x))


def _slice_rows(query, begin, end):
    return np.ascontiguousarray(query[..., begin:end, :])


# -- sharded_attention ---------------------------------------------------------------------------------


def _as_shards(client, shards, name):
    """Futures of the shards, their lengths along the sequence axis (-2) and their shapes."""
    if isinstance(shards, da.Array):
        if shards.ndim < 2:
            raise ValueError(f"{name}: expected (..., seq_len, dim), got a {shards.ndim}-D dask array")
        if any(len(c) != 1 for c in shards.chunks[:-2] + shards.chunks[-1:]):
            raise ValueError(f"{name}: a dask array must be chunked along the sequence axis (-2) only")
        blocks = shards.to_delayed().reshape(-1)
        futures = client.compute(list(blocks))
        lengths = list(shards.chunks[-2])
        return futures, lengths, [shards.shape[:-2] + (n, shards.shape[-1]) for n in lengths]
    if isinstance(shards, (np.ndarray, Future)) or not isinstance(shards, (list, tuple)):
        raise TypeError(f"{name}: expected a list of arrays or futures, or a dask array, got {type(shards).__name__}")
    if not shards:
        raise ValueError(f"{name}: expected at least one shard")
    futures, lengths = [], []
    local = [i for i, s in enumerate(shards) if not isinstance(s, Future)]
    # hash=False: equal arrays of two calls (empty shards, the same data) must not share a key, or
    # the first call's release of its futures drops the second's data ("lost dependencies").
    scattered = client.scatter([np.asarray(shards[i]) for i in local], hash=False) if local else []
    by_index = dict(zip(local, scattered))
    for i, s in enumerate(shards):
        futures.append(by_index.get(i, s))
    shapes = client.gather([client.submit(_shape, f, pure=False) for f in futures])
    for i, shape in enumerate(shapes):
        if len(shape) < 2:
            raise ValueError(f"{name}[{i}]: expected (..., seq_len, dim), got shape {shape}")
        lengths.append(shape[-2])
    return futures, lengths, [tuple(shape) for shape in shapes]


def _pair_allowed(q0, q1, k0, k1, diagonal_base, causal, window):
    """Whether some query row in [q0, q1) may see some key in [k0, k1): row i's band is
    [i + base - left, i + base (+ right)] with base = S - L (lower-right) or 0."""
    if q1 <= q0 or k1 <= k0:
        return False
    lo_row, hi_row = q0 + diagonal_base, q1 - 1 + diagonal_base
    left, right = (None, None) if window is None else window
    upper = hi_row if causal else (None if right is None else hi_row + right)
    if upper is not None and k0 > upper:
        return False
    if left is not None and k1 - 1 < lo_row - left:
        return False
    return True


def sharded_attention(
    query,
    key_shards,
    value_shards,
    *,
    client=None,
    is_causal=False,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    scale=None,
    enable_gqa=False,
    query_blocks=1,
    threads_per_task=1,
):
    """Attention of `query` over keys and values split along the sequence across Dask workers.

    Equal to ``scaled_dot_product_attention(query, concat(key_shards), concat(value_shards), ...)``
    to float rounding (the same options; ``is_causal`` True/"upper_left"/"lower_right" and
    ``window`` refer to the whole, concatenated problem), computed as one partial call per
    (query block, key shard) pair where the shard lives, merged in a tree of merge tasks.

    Parameters
    ----------
    query : ndarray, shape (..., Hq, L, E)
    key_shards, value_shards : list of ndarray or distributed.Future, or dask.array
        Shard p is (..., Hk, S_p, E) / (..., Hk, S_p, Ev), in sequence order; shards may differ in
        length (empty ones included). NumPy arrays are scattered to the workers, futures stay where
        they are, a dask array is split along its chunks of axis -2.
    client : distributed.Client, optional
        Default: the current client (``distributed.get_client()``).
    is_causal, window, softcap, sinks, alibi_slopes, scale, enable_gqa
        As in :func:`pyattn.scaled_dot_product_attention`; sinks are applied once, in the last merge.
    query_blocks : int
        Split the queries into this many blocks along L (context parallelism): each (block, shard)
        pair is a task, and pairs the causal rule or the window forbid entirely are not scheduled.
    threads_per_task : int
        pyattn threads of every task (set it to the cores each worker thread may use).

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev)
        In the compute dtype (float32 for float32 and 16-bit inputs, float64 for float64).
    """
    client = _client(client)
    query = np.asarray(query)
    if query.ndim < 2:
        raise ValueError(f"query: expected (..., L, E), got shape {query.shape}")
    query_blocks = _positive(query_blocks, "query_blocks")
    threads = _positive(threads_per_task, "threads_per_task")
    k_shards = _as_shards(client, key_shards, "key_shards")
    v_shards = _as_shards(client, value_shards, "value_shards")
    k_futures, k_lengths = k_shards[0], k_shards[1]
    v_futures, v_lengths = v_shards[0], v_shards[1]
    if k_lengths != v_lengths:
        raise ValueError(f"key_shards, value_shards: shard lengths differ, {k_lengths} and {v_lengths}")
    causal_value = _core_causal(is_causal)
    q_len, kv_len = query.shape[-2], sum(k_lengths)
    base = kv_len - q_len if causal_value == "lower_right" else 0
    causal = causal_value is not False
    options = {
        "scale": scale,
        "enable_gqa": enable_gqa,
        "window": window,
        "softcap": softcap,
        "alibi_slopes": alibi_slopes,
    }
    # Every check of the call (shapes, dtypes, heads, options) once, here, on a one-key problem: a
    # mistake raises before any task is scheduled.
    k_shape, v_shape = k_shards[2][0], v_shards[2][0]
    scaled_dot_product_attention(
        query[..., :1, :],
        np.zeros(tuple(k_shape[:-2]) + (1, k_shape[-1]), query.dtype),
        np.zeros(tuple(v_shape[:-2]) + (1, v_shape[-1]), query.dtype),
        is_causal=is_causal,
        window=window,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    edges = [round(b * q_len / query_blocks) for b in range(query_blocks + 1)]
    starts = [0]
    for n in k_lengths:
        starts.append(starts[-1] + n)
    blocks = []
    for b in range(query_blocks):
        q0, q1 = edges[b], edges[b + 1]
        if q1 == q0:
            continue
        q_future = client.scatter(_slice_rows(query, q0, q1), hash=False)
        parts = []
        for s, (kf, vf) in enumerate(zip(k_futures, v_futures)):
            k0, k1 = starts[s], starts[s + 1]
            if not _pair_allowed(q0, q1, k0, k1, base, causal, window):
                continue
            diagonal = q0 + base - k0
            parts.append(client.submit(_partial, q_future, kf, vf, diagonal, causal, options, threads, pure=False))
        blocks.append((q0, q1, parts))
    merged = []
    for q0, q1, parts in blocks:
        if not parts:  # no key of any shard is visible to these rows
            merged.append((q0, q1, None))
            continue
        while len(parts) > 1:  # a tree: pairs of partials merged where they are
            parts = [
                client.submit(_merge, parts[i : i + 2], None, threads, pure=False) if i + 1 < len(parts) else parts[i]
                for i in range(0, len(parts), 2)
            ]
        merged.append((q0, q1, parts[0]))
    results = client.gather([m for _, _, m in merged if m is not None])
    ready = iter(results)
    pieces = []
    for q0, q1, m in merged:
        pieces.append((q0, q1, next(ready) if m is not None else None))
    return _assemble(query, pieces, sinks, threads, value_dim=v_shape[-1])


def _core_causal(is_causal):
    if isinstance(is_causal, np.bool_):
        is_causal = bool(is_causal)
    if is_causal is False:
        return False
    if is_causal is True or is_causal == "upper_left":
        return "upper_left"
    if is_causal == "lower_right":
        return "lower_right"
    raise ValueError(f"is_causal: expected False, True, 'upper_left' or 'lower_right', got {is_causal!r}")


def _assemble(query, pieces, sinks, threads, value_dim):
    """The blocks' (out, lse) into one output; sinks applied here, once per row."""
    compute = np.float64 if query.dtype == np.float64 else np.float32
    shape = None
    for _, _, piece in pieces:
        if piece is not None:
            shape = piece[0].shape[:-2]
            break
    if shape is None:
        shape = query.shape[:-2]
    out = np.zeros(shape + (query.shape[-2], value_dim), compute)
    for q0, q1, piece in pieces:
        if piece is None:
            if sinks is None:
                continue
            piece = (np.zeros(shape + (q1 - q0, value_dim), compute), np.full(shape + (q1 - q0,), -np.inf, compute))
        if sinks is not None:
            piece = merge_attention_states([piece[0]], [piece[1]], sinks=sinks, num_threads=threads)
        out[..., q0:q1, :] = piece[0]
    return out


# -- map_batches ---------------------------------------------------------------------------------------


def _apply(block, fn, kwargs, threads):
    return fn(block, num_threads=threads, **kwargs)


def map_batches(layer_or_fn, x, *, client=None, batch_chunk=None, threads_per_task=1, **call_kwargs):
    """``layer_or_fn`` applied to every batch chunk of `x` on the workers, as a lazy dask array.

    Parameters
    ----------
    layer_or_fn : pyattn.MultiHeadAttention or callable
        Called as ``layer_or_fn(block, num_threads=threads_per_task, **call_kwargs)`` on each chunk
        (a NumPy array of the chunk's rows); its result must have the block's shape (a layer's
        self-attention output, ``scaled_dot_product_attention(x, x, x)``, ...). It is sent to each
        worker once (``Client.scatter(..., broadcast=True)``), not with every task: a layer's packed
        weights travel once per worker.
    x : dask.array or ndarray, shape (B, ...)
        The batch; an ndarray becomes a dask array of ``batch_chunk`` rows per chunk.
    client : distributed.Client, optional
    batch_chunk : int, optional
        Rows per chunk (x is rechunked along axis 0 only); default: x's chunks (an ndarray: one per
        worker thread).
    threads_per_task : int
        pyattn threads of each task.

    Returns
    -------
    dask.array.Array
        Lazy; ``.compute()`` runs it on the client's cluster.
    """
    client = _client(client)
    threads = _positive(threads_per_task, "threads_per_task")
    if not callable(layer_or_fn):
        raise TypeError(f"layer_or_fn: expected a pyattn layer or a callable, got {type(layer_or_fn).__name__}")
    if not isinstance(x, da.Array):
        x = np.asarray(x)
        if x.ndim < 1:
            raise ValueError("x: expected an array with a batch axis")
        workers = max(1, sum(client.nthreads().values()))
        chunk = batch_chunk or max(1, -(-x.shape[0] // workers))
        x = da.from_array(x, chunks=(_positive(chunk, "batch_chunk"),) + x.shape[1:])
    elif batch_chunk is not None:
        x = x.rechunk({0: _positive(batch_chunk, "batch_chunk")})
    if any(len(c) != 1 for c in x.chunks[1:]):
        x = x.rechunk({axis: -1 for axis in range(1, x.ndim)})
    fn = client.scatter(layer_or_fn, broadcast=True, hash=False)
    return x.map_blocks(_apply, fn, call_kwargs, threads, dtype=x.dtype)


# -- a sharded KV cache --------------------------------------------------------------------------------


class _CacheShard:
    """A Dask actor holding one shard of a KV cache: tokens [start, start + length) of every row."""

    def __init__(self, batch, num_kv_heads, head_dim, max_len, value_dim, dtype):
        self.cache = KVCache(batch, num_kv_heads, head_dim, max_len, value_dim=value_dim, dtype=dtype)

    def append(self, key, value):
        self.cache.append(key, value)
        return int(self.cache.lengths[0])

    def attend(self, query, position, scale, softcap, threads):
        return attend_from(self.cache, query, position, scale, softcap, threads)

    def length(self):
        return int(self.cache.lengths[0])


class ShardedKVCache:
    """A KV cache for decoding split along the sequence over Dask workers, one shard per actor.

    Tokens fill the shards in order (a chunk that does not fit the current shard continues in the
    next); a decode step sends only the new queries to every shard that holds keys and merges the
    shards' (output, lse) pairs with :func:`pyattn.merge_attention_states` (sinks once, there). Each
    query sees every cached key up to its own position, as KVCache.attend: the shards together are
    one cache of ``num_shards * max_len_per_shard`` tokens per row. All rows hold the same number of
    tokens (appends are whole chunks, no per-row counts).

    Parameters
    ----------
    client : distributed.Client or None
    num_shards : int
        Actors, placed round-robin over the client's workers.
    batch, num_kv_heads, head_dim, max_len_per_shard, value_dim, dtype
        As KVCache's, per shard.
    threads_per_task : int
        pyattn threads of each shard's attention call.

    Memory: each shard holds batch * num_kv_heads * (head_dim + value_dim) * itemsize bytes per
    token, allocated when the actor starts.
    """

    def __init__(
        self,
        client,
        num_shards,
        batch,
        num_kv_heads,
        head_dim,
        max_len_per_shard,
        *,
        value_dim=None,
        dtype=np.float32,
        threads_per_task=1,
    ):
        self.client = _client(client)
        self.num_shards = _positive(num_shards, "num_shards")
        self.max_len_per_shard = _positive(max_len_per_shard, "max_len_per_shard")
        self.threads = _positive(threads_per_task, "threads_per_task")
        self.batch, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        workers = sorted(self.client.scheduler_info()["workers"])
        futures = [
            self.client.submit(
                _CacheShard,
                batch,
                num_kv_heads,
                head_dim,
                max_len_per_shard,
                value_dim,
                dtype,
                actor=True,
                workers=[workers[s % len(workers)]] if workers else None,
                pure=False,
            )
            for s in range(self.num_shards)
        ]
        self.shards = [f.result() for f in futures]
        self.lengths = [0] * self.num_shards
        self.last_chunk = 0

    @property
    def length(self):
        """Tokens cached per row, over all shards."""
        return sum(self.lengths)

    def shard_lengths(self):
        """Each shard's token count as its actor reports it (one round trip to every shard)."""
        return [f.result() for f in [shard.length() for shard in self.shards]]

    def append(self, key, value):
        """Append a chunk (batch, num_kv_heads, n, dim) of keys and values, shard after shard."""
        key, value = np.asarray(key), np.asarray(value)
        if key.ndim != 4 or value.ndim != 4 or key.shape[2] != value.shape[2]:
            raise ValueError(
                f"key, value: expected (batch, num_kv_heads, n, dim) chunks, got {key.shape}, {value.shape}"
            )
        n = key.shape[2]
        if self.length + n > self.num_shards * self.max_len_per_shard:
            raise ValueError(
                f"key: {n} more tokens do not fit ({self.length} of {self.num_shards * self.max_len_per_shard} used)"
            )
        done, pending = 0, []
        for s in range(self.num_shards):
            room = self.max_len_per_shard - self.lengths[s]
            if done == n:
                break
            if room <= 0:
                continue
            take = min(room, n - done)
            pending.append((s, self.shards[s].append(key[:, :, done : done + take], value[:, :, done : done + take])))
            done += take
        for s, future in pending:
            self.lengths[s] = future.result()
        self.last_chunk = n

    def attend(self, query, *, scale=None, softcap=None, sinks=None):
        """Attention of the last appended chunk's queries (batch, num_heads, chunk, head_dim) over the
        whole cache, as KVCache.attend: query i is at position length - chunk + i."""
        query = np.asarray(query)
        if query.ndim != 4 or query.shape[2] != self.last_chunk:
            raise ValueError(
                f"query: expected (batch, num_heads, {self.last_chunk}, head_dim) for the last chunk, got {query.shape}"
            )
        position, start, pending = self.length - self.last_chunk, 0, []
        for s in range(self.num_shards):
            if self.lengths[s]:
                pending.append(self.shards[s].attend(query, position - start, scale, softcap, self.threads))
            start += self.lengths[s]
        parts = [f.result() for f in pending]
        out, _ = merge_attention_states([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
        return out
