# SPDX-License-Identifier: MIT
"""KVCache: preallocated key/value storage for incremental decoding.

A generating model appends the keys and values of its new tokens at every step and attends from the
new queries to everything cached, with the lower-right causal alignment (query i of the new chunk
sits at position length_before + i and sees keys up to there). Each batch row has its own length,
so prompts of different lengths need no padding mask: the attention of row b reads only its first
lengths[b] keys (the core takes per-row lengths and causal offsets; nothing is materialised).

Storage may be float32, float64, float16 or bfloat16 (``ml_dtypes.bfloat16``); 16-bit storage halves
the bytes a decode step streams, and the core converts it to float32 one block at a time. int8
storage halves them again: each stored row (one token of one head) keeps its values as int8 times
one float32 scale, max(abs(x)) / 127, quantised on append (x within scale / 2 of its stored value) and
converted back, scale applied, a block at a time by the kernels.
"""

from __future__ import annotations

import numpy as np

from . import _core
from ._arrays import COMPUTE_DTYPES, allocate, as_array, is_half

# The kernels' codes for converted storage: 16-bit floats, int8 with row scales.
_HALF_STORAGE = {"float16": 1, "bfloat16": 2, "int8": 3}


def _storage_dtype(dtype):
    if isinstance(dtype, str) and dtype == "int8":
        return np.dtype(np.int8)
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the environment
            raise TypeError("dtype: bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:  # None too: np.dtype(None) is float64, which None would not suggest
        parsed = None if dtype is None else np.dtype(dtype)
    except TypeError:
        parsed = None
    # The dtypes scaled_dot_product_attention takes (native byte order: a big-endian float16 or
    # float32 still calls itself "float16" / "float32", but the kernels read the CPU's own numbers),
    # and int8 (quantised storage).
    if parsed == np.dtype(np.int8):
        return parsed
    if parsed is None or (parsed not in COMPUTE_DTYPES and not is_half(parsed)):
        raise TypeError(
            f"dtype: must be float32, float64, float16, bfloat16 (native byte order) or int8, got {dtype!r}"
        )
    return parsed


def _storage_start(dtype):
    """Bytes past a cache line where K/V storage of this dtype starts: where the decode kernel reads it
    fastest on this CPU (the core's tuning module decides)."""
    return _core.kv_storage_offset(dtype.itemsize, dtype.name == "bfloat16")


def _storage_zeros(shape, dtype):
    """Zero-filled (shape, dtype) storage that starts _storage_start(dtype) bytes past a cache line."""
    return allocate(shape, dtype, "max_len", start=_storage_start(dtype), zero=True)


def _positive_int(value, name, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def _filled_ints(value, batch):
    """(batch,) int64 array of value (cheaper than np.full on a decode step's path)."""
    arr = np.empty(batch, np.int64)
    arr.fill(value)
    return arr


def _per_row(value, name, batch):
    """An int, or one int per batch row, as (batch,) int64; TypeError/ValueError naming `name`."""
    if type(value) is int and value >= 0:  # the common case, without NumPy's checks
        return _filled_ints(value, batch)
    arr = as_array(value, name)
    if arr.dtype.kind not in "iu":  # bool is kind "b"
        raise TypeError(f"{name}: expected an int or {batch} ints, got {value!r}")
    if arr.shape not in ((), (batch,)):
        raise ValueError(f"{name}: expected an int or {batch} ints (one per batch row), got shape {arr.shape}")
    arr = np.broadcast_to(arr.astype(np.int64), (batch,))
    if (arr < 0).any():
        raise ValueError(f"{name}: must be >= 0, got {arr.tolist()}")
    return arr


class KVCache:
    """Key/value cache of shape (batch, num_kv_heads, max_len, head_dim / value_dim).

    Parameters
    ----------
    batch : int
        Batch rows (sequences decoded together); each has its own length.
    num_kv_heads : int
        Key/value heads; the queries that attend may have a multiple of this many heads (GQA).
    head_dim : int
        Features per key (and query) head.
    max_len : int
        Tokens each row can hold; the storage is allocated once (zero pages are not touched until
        written).
    value_dim : int, optional
        Features per value head; defaults to head_dim.
    dtype : float32 (default), float64, float16, bfloat16 or "int8"
        Storage dtype. 16-bit caches are read by the core directly and computed in float32. An int8
        cache stores each token's row of each head as int8 values times one float32 scale
        (``max(abs(x)) / 127``, so every value is kept within ``scale / 2``; a row holding Inf or NaN
        is stored as NaN),
        quantised on append and computed in float32: a quarter of float32's bytes per decode step.

    Attributes
    ----------
    lengths : ndarray of int64, (batch,)
        Filled length of each batch row.
    """

    def __init__(self, batch, num_kv_heads, head_dim, max_len, *, value_dim=None, dtype=np.float32):
        self.batch = _positive_int(batch, "batch")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.max_len = _positive_int(max_len, "max_len")
        self.value_dim = self.head_dim if value_dim is None else _positive_int(value_dim, "value_dim")
        self.dtype = _storage_dtype(dtype)
        nbytes = self.batch * self.num_kv_heads * self.max_len * (self.head_dim + self.value_dim) * self.dtype.itemsize
        rows = (self.batch, self.num_kv_heads, self.max_len)
        try:
            self._k = _storage_zeros(rows + (self.head_dim,), self.dtype)
            self._v = _storage_zeros(rows + (self.value_dim,), self.dtype)
            # int8: one float32 scale per stored row (token and head); None otherwise.
            int8 = self.dtype == np.int8
            self._k_scales = allocate(rows, np.float32, "max_len", zero=True) if int8 else None
            self._v_scales = allocate(rows, np.float32, "max_len", zero=True) if int8 else None
        except (MemoryError, ValueError):
            raise ValueError(f"max_len: a cache of {nbytes} bytes cannot be allocated") from None
        self.lengths = np.zeros(self.batch, np.int64)
        # What the last append added: per-row count, the chunk length, and the chunk index of each
        # row's first real token (0 with right padding, chunk - count with left padding).
        self._last_new = np.zeros(self.batch, np.int64)
        self._last_chunk = 0
        self._last_first = np.zeros(self.batch, np.int64)
        self._bind_storage()

    # What __init__ derives from the storage, rebuilt rather than pickled or copied (__setstate__).
    _DERIVED = ("_half", "_compute", "_k_core", "_v_core", "_attend_key", "_attend_state")

    def _bind_storage(self):
        self._half = _HALF_STORAGE.get(self.dtype.name, 0)  # the kernels' code for converted storage
        self._compute = np.dtype(np.float32) if self._half else self.dtype  # what attention computes in
        # The storage as the core reads and writes it: 16-bit floats as their uint16 bit patterns.
        converted = self._half in (1, 2)
        self._k_core = self._k.view(np.uint16) if converted else self._k
        self._v_core = self._v.view(np.uint16) if converted else self._v
        self._attend_key = None
        self._attend_state = None

    def __getstate__(self):
        """Pickling (and copy.deepcopy): the storage and the lengths, not the core's views of the
        storage. A pickled view comes back as an array of its own: a 16-bit cache's uint16 view,
        which the core writes, would no longer be the storage that keys()/values() show."""
        return {name: value for name, value in self.__dict__.items() if name not in self._DERIVED}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for name in ("_k", "_v"):  # back at the storage's place relative to a cache line, as allocated
            stored = self.__dict__[name]
            fresh = _storage_zeros(stored.shape, self.dtype)
            fresh[...] = stored
            setattr(self, name, fresh)
        for name in ("_k_scales", "_v_scales"):  # int8 scales (None otherwise; absent in older pickles)
            stored = self.__dict__.get(name)
            if stored is not None:
                fresh = allocate(stored.shape, np.float32, "max_len")
                fresh[...] = stored
                stored = fresh
            setattr(self, name, stored)
        # The per-row state too, so that even copy.copy gives a cache of its own (a shallow copy
        # sharing the lengths with separate storage: reset() on one would empty both).
        for name in ("lengths", "_last_new", "_last_first"):
            value = self.__dict__[name]
            if isinstance(value, np.ndarray):
                setattr(self, name, value.copy())
        self._bind_storage()

    def __repr__(self):
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"max_len={self.max_len}, value_dim={self.value_dim}, dtype={self.dtype}, lengths={self.lengths.tolist()})"
        )

    # -- filling ----------------------------------------------------------------------------------
    def append(self, key, value, *, num_new=None, left_padded=False):
        """Append a chunk of new tokens' keys and values.

        Parameters
        ----------
        key : ndarray, (batch, num_kv_heads, chunk, head_dim)
        value : ndarray, (batch, num_kv_heads, chunk, value_dim)
            Any float dtype; converted to the storage dtype.
        num_new : int or ndarray of int, optional
            (batch,) ints in [0, chunk]: how many of the chunk's tokens are real in each row
            (prompts of different lengths); default: all of them.
        left_padded : bool
            The real tokens are the last num_new[b] of row b's chunk instead of the first.

        Raises
        ------
        ValueError
            A row would exceed max_len, or a shape or count is wrong (nothing is changed).
        TypeError
            key/value not floating, or counts that are not integers (nothing is changed).
        """
        k = as_array(key, "key")
        v = as_array(value, "value")
        if k.ndim != 4 or k.shape[0] != self.batch or k.shape[1] != self.num_kv_heads or k.shape[3] != self.head_dim:
            raise ValueError(
                f"key: expected shape ({self.batch}, {self.num_kv_heads}, chunk, {self.head_dim}), got {k.shape}"
            )
        chunk = k.shape[2]
        if v.shape != (self.batch, self.num_kv_heads, chunk, self.value_dim):
            raise ValueError(
                f"value: expected shape {(self.batch, self.num_kv_heads, chunk, self.value_dim)}, got {v.shape}"
            )
        for name, x in (("key", k), ("value", v)):
            if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
                raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
        before, counts, end = self._plan_append(num_new, chunk)
        int8 = self._k_scales is not None
        for b in range(self.batch):
            n = int(counts[b])
            start = chunk - n if left_padded else 0
            pos = int(before[b])
            if int8:  # quantised in the core, one scale per row
                for src, dst, scales in ((k, self._k, self._k_scales), (v, self._v, self._v_scales)):
                    rows = np.ascontiguousarray(src[b, :, start : start + n], dtype=np.float32)
                    _core.quantize_int8(rows, dst[b, :, pos : pos + n], scales[b, :, pos : pos + n])
                continue
            self._k[b, :, pos : pos + n] = k[b, :, start : start + n]
            self._v[b, :, pos : pos + n] = v[b, :, start : start + n]
        self._commit_append(counts, end, chunk, left_padded)

    def _plan_append(self, num_new, chunk):
        """(lengths before, tokens per row, lengths after) of appending a chunk; raises, changing
        nothing, TypeError for counts that are not integers and ValueError for counts of the wrong
        shape or range or a row that would exceed max_len."""
        if num_new is None:  # every row appends the whole chunk (a decode step: keep it cheap)
            counts = _filled_ints(chunk, self.batch)
            before = self._lengths_if_valid(chunk)
            if before is not None:
                return before, counts, before + counts
        else:
            counts = as_array(num_new, "num_new")
            if counts.dtype.kind not in "iu":  # bool is kind "b"; as _per_row, a wrong type is a TypeError
                raise TypeError(f"num_new: expected {self.batch} integers, got {counts!r}")
            if counts.shape != (self.batch,):
                raise ValueError(
                    f"num_new: expected {self.batch} integers (one per batch row), got shape {counts.shape}"
                )
            counts = counts.astype(np.int64)
            if (counts < 0).any() or (counts > chunk).any():
                raise ValueError(f"num_new: entries must lie in [0, {chunk}], got {counts.tolist()}")
        before = self._checked_lengths()
        end = before + counts
        if (end > self.max_len).any():
            b = int(np.argmax(end > self.max_len))
            raise ValueError(
                f"max_len: appending {int(counts[b])} tokens to batch row {b} (length {int(before[b])}) "
                f"exceeds max_len={self.max_len}"
            )
        return before, counts, end

    def _commit_append(self, counts, end, chunk, left_padded):
        """Records an append whose K/V rows are in the storage (by append, or by the core's layer step)."""
        self.lengths = end
        self._last_new, self._last_chunk = counts, chunk
        self._last_first = chunk - counts if left_padded else np.zeros(self.batch, np.int64)  # counts: int64

    def reset(self):
        """Empty every row (storage is kept)."""
        self.lengths[:] = 0
        self._last_new[:] = 0
        self._last_chunk = 0
        self._last_first[:] = 0

    def truncate(self, length):
        """Keep at most `length` tokens per row.

        Parameters
        ----------
        length : int or ndarray of int
            One length for every row, or (batch,) lengths.

        Notes
        -----
        The last appended chunk's queries keep their positions (attend()): a cut that removes
        nothing changes nothing, and the chunk's tokens that were cut no longer count as new.
        """
        length = _per_row(length, "length", self.batch)
        before = self._checked_lengths()
        self._cut(before, np.minimum(before, length))

    def trim(self, count):
        """Drop the last `count` tokens of every row; see truncate().

        Parameters
        ----------
        count : int or ndarray of int
            One count for every row, or (batch,) counts.
        """
        count = _per_row(count, "count", self.batch)
        before = self._checked_lengths()
        self._cut(before, np.maximum(before - count, 0))

    def _cut(self, before, after):
        self.lengths = after
        self._last_new = np.maximum(self._last_new - (before - after), 0)

    def _lengths_if_valid(self, room=0):
        """self.lengths itself when it is a (batch,) int64 array whose entries lie in [0, max_len -
        room], else None (the caller then goes through _checked_lengths, which says what is wrong).
        The bounds are checked on a Python list for a few rows (cheaper there than two NumPy
        reductions, which the decode step's path would pay every step)."""
        lengths = self.lengths
        if type(lengths) is not np.ndarray or lengths.dtype != np.int64 or lengths.shape != (self.batch,):
            return None
        if self.batch > 64:
            return lengths if lengths.min() >= 0 and lengths.max() <= self.max_len - room else None
        values = lengths.tolist()
        return lengths if min(values) >= 0 and max(values) <= self.max_len - room else None

    def _checked_lengths(self):
        """The lengths as (batch,) int64 within [0, max_len]; ValueError naming `lengths` when they
        were edited in place to anything else."""
        valid = self._lengths_if_valid()
        if valid is not None:
            return valid.copy()
        lengths = as_array(self.lengths, "lengths")
        if (
            lengths.shape != (self.batch,)
            or lengths.dtype.kind not in "iu"
            or (lengths < 0).any()
            or (lengths > self.max_len).any()
        ):
            raise ValueError(f"lengths: expected {self.batch} lengths in [0, {self.max_len}], got {self.lengths!r}")
        return lengths.astype(np.int64)

    # -- views --------------------------------------------------------------------------------------
    def _filled(self, storage, row):
        lengths = self._checked_lengths()
        if row is not None:
            if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
                raise TypeError(f"row: expected an int batch row, got {row!r}")
            if not -self.batch <= row < self.batch:
                raise ValueError(f"row: expected a batch row in [-{self.batch}, {self.batch}), got {row}")
            return storage[row, :, : int(lengths[row])]
        if (lengths != lengths[0]).any():
            raise ValueError(f"row: rows have different lengths {lengths.tolist()}: pass a batch row")
        return storage[:, :, : int(lengths[0])]

    def _dequantized(self, storage, scales, row):
        if scales is None:
            return self._filled(storage, row)
        return self._filled(storage, row).astype(np.float32) * self._filled(scales[..., None], row)

    def keys(self, row=None):
        """View of the filled keys: (num_kv_heads, length, head_dim) of batch row `row`, or all rows
        (batch, num_kv_heads, length, head_dim) when they have the same length. An int8 cache gives
        its values as float32 (stored int8 times the row's scale, a new array)."""
        return self._dequantized(self._k, self._k_scales, row)

    def values(self, row=None):
        """View of the filled values of batch row `row` (or of all rows when `row` is None and they
        have the same length), like keys()."""
        return self._dequantized(self._v, self._v_scales, row)

    # -- attention ----------------------------------------------------------------------------------
    def _causal_state(self):
        """(kv_len, lengths, causal_offsets) for attend(): the longest row, a snapshot of the lengths
        and each row's lower-right causal offset. They change only with the lengths and the last
        append, so a decode loop computes them once per append, not on every attend; the key is
        exactly what they are computed from, so any change is seen, lengths edited in place included."""
        key = (
            np.asarray(self.lengths).tobytes(),
            self._last_new.tobytes(),
            self._last_first.tobytes(),
            self._last_chunk,
        )
        if key != self._attend_key:
            lengths = self._checked_lengths()  # a copy: the state must not change under it
            causal_offsets = np.ascontiguousarray(lengths - self._last_new - self._last_first, dtype=np.int64)
            # The core sees the filled part only (kv_len = the longest row, not max_len): its work
            # split depends on kv_len, and chunks past every row's length would be empty work items.
            self._attend_state = (int(lengths.max()), lengths, causal_offsets)
            self._attend_key = key
        return self._attend_state

    def attend(
        self,
        query,
        *,
        scale=None,
        num_threads=None,
        window=None,
        softcap=None,
        sinks=None,
        alibi_slopes=None,
        return_lse=False,
    ):
        """Attention of the last appended chunk's queries over each row's cached keys.

        Query i of row b is at position lengths[b] - num_new[b] - first[b] + i, with first[b] = 0
        (right padding) or chunk - num_new[b] of that append (left padding), and sees keys up to
        there (lower-right causal alignment); padding query rows of a shorter row produce values
        that should be ignored. truncate()/trim() take the chunk's tokens they cut off num_new[b],
        so the queries keep their positions.

        Parameters
        ----------
        query : ndarray, (batch, num_heads, chunk, head_dim)
            num_heads a multiple of num_kv_heads (grouped-query attention); chunk as appended last.
        scale : float, optional
            Multiplies Q Kᵀ; default 1/sqrt(head_dim).
        num_threads : int, optional
            Threads for this call; default pyattn.get_num_threads().
        window, softcap, sinks, alibi_slopes : optional
            As in :func:`pyattn.scaled_dot_product_attention`, with d(i) each query's own position
            (the causal alignment); only the keys inside a window are read. alibi_slopes is (num_heads,)
            or (batch, num_heads).
        return_lse : bool
            Also return the rows' log-sum-exp (batch, num_heads, chunk), as in
            :func:`pyattn.scaled_dot_product_attention`: the partial result of a cache shard that
            :func:`pyattn.merge_attention_states` merges exactly.

        Returns
        -------
        out : ndarray, (batch, num_heads, chunk, value_dim)
            float32 for 16-bit and int8 caches, else the cache dtype.
        lse : ndarray, (batch, num_heads, chunk), only with return_lse=True
        """
        q = as_array(query, "query")
        if q.ndim != 4 or q.shape[0] != self.batch or q.shape[3] != self.head_dim:
            raise ValueError(f"query: expected shape ({self.batch}, num_heads, chunk, {self.head_dim}), got {q.shape}")
        num_heads, chunk = q.shape[1], q.shape[2]
        if num_heads % self.num_kv_heads:
            raise ValueError(f"query: num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if chunk != self._last_chunk:
            if self._last_chunk == 0:
                raise ValueError(
                    f"query: a chunk of {chunk} queries, but no token was appended since the cache was "
                    "made or reset (attend() takes the queries of the tokens appended last)"
                )
            raise ValueError(
                f"query: chunk length {chunk} does not match the last append's ({self._last_chunk} tokens; "
                "attend() takes the queries of the tokens appended last)"
            )
        if q.dtype != self._compute:
            if q.dtype.kind != "f" and q.dtype.name != "bfloat16":
                raise TypeError(f"query: expected a floating dtype, got {q.dtype}")
            q = q.astype(self._compute)
        kv_len, lengths, causal_offsets = self._causal_state()
        # Read in place by the kernels (16-bit and int8 storage converted to float32 a key block at a
        # time).
        if (
            window is None
            and softcap is None
            and sinks is None
            and alibi_slopes is None
            and not return_lse
            and self._k_scales is None
        ):
            return _core.sdpa_cache(
                q, self._k_core, self._v_core, self._half, kv_len, lengths, causal_offsets, scale, num_threads
            )
        return _core.sdpa_cache(
            q,
            self._k_core,
            self._v_core,
            self._half,
            kv_len,
            lengths,
            causal_offsets,
            scale,
            num_threads,
            window,
            softcap,
            sinks,
            alibi_slopes,
            return_lse,
            self._k_scales,
            self._v_scales,
        )


def compute_dtype(cache):
    """The dtype attention over `cache` computes in: float32 for 16-bit and int8 storage, else the
    storage's."""
    return cache._compute


def layer_step(
    cache, rows, weights, dims, num_new, left_padded, out, num_threads, variants=(None, None, None, None), bf16=False
):
    """One step of a multi-head layer over `cache` (pyattn.mha / MultiHeadAttention with kv_cache=):
    the chunk's rows (batch * chunk, embed_dim) are projected, their K/V appended (num_new and
    left_padded as in KVCache.append), the queries attend over each row's cached keys, and the output
    projection writes `out`, all in one core call. Raises, changing nothing, as KVCache.append does.

    weights: the layer's (q, k, v, out) projections as the core takes them, then their biases; dims:
    (batch, chunk, embed_dim, num_heads, num_kv_heads, head_dim); variants: (window, softcap, sinks,
    alibi_slopes) as KVCache.attend takes them; bf16: a bfloat16 layer's pair projections (rows the
    uint16 view of bfloat16 rows, weights from pack_weights16, out float32)."""
    before, counts, end = cache._plan_append(num_new, dims[1])
    # Positional arguments: keyword matching costs time on every decode step.
    _core.mha_cached(
        rows,
        weights,
        dims,
        cache._k_core,
        cache._v_core,
        cache._half,
        before,
        end,
        bool(left_padded),
        out,
        num_threads,
        *variants,
        cache._k_scales,
        cache._v_scales,
        bf16,
    )
    cache._commit_append(counts, end, dims[1], left_padded)


def attend_from(cache, query, position, scale, softcap, num_threads):
    """(out, lse) of queries at positions position + i (counted from the cache's first key, possibly
    beyond its filled length: then every cached key is visible) over every row's cached keys, for a
    cache holding one shard of a longer sequence (pyattn.distributed.ShardedKVCache)."""
    q = as_array(query, "query")
    if q.dtype != cache._compute:
        q = q.astype(cache._compute)
    lengths = cache._checked_lengths()
    offsets = np.full(cache.batch, int(position), dtype=np.int64)
    return _core.sdpa_cache(
        q,
        cache._k_core,
        cache._v_core,
        cache._half,
        int(lengths.max()),
        lengths,
        offsets,
        scale,
        num_threads,
        None,
        softcap,
        None,
        None,
        True,
        cache._k_scales,
        cache._v_scales,
    )
