# SPDX-License-Identifier: MIT
"""The mistake catalogue of the KV-cache fuzzer (tests/fuzz_cache.py): 43 kinds of wrong call to
append, attend, truncate, trim, keys/values, KVCache() or a layer step over the cache, each built for
the cache's current state with the error the policy prescribes (DESIGN §2) and the argument names its
message must contain; the check that it raises that error and leaves the cache exactly as it was;
and the reported, not yet fixed, discrepancies (KNOWN_ISSUES).
"""

from __future__ import annotations

import numpy as np

import pyattn

from fuzz_cache_model import MAX_EMBED, Snapshot, _cache_state

# What programs() draws for half the programs (at most one per program); Mistakes._mistake builds it.
MISTAKES = (
    # append
    "append_key_dim",
    "append_key_batch",
    "append_key_heads",
    "append_key_ndim",
    "append_value_dim",
    "append_value_chunk",
    "append_bad_dtype",
    "append_overflow",
    "append_overflow_ragged",
    "append_num_new_range",
    "append_num_new_shape",
    "append_num_new_dtype",
    "append_bad_lengths",
    # attend
    "attend_head_dim",
    "attend_batch",
    "attend_heads",
    "attend_chunk",
    "attend_ndim",
    "attend_bad_dtype",
    "attend_scale_nonfinite",
    "attend_scale_type",
    "attend_threads_value",
    "attend_threads_type",
    "attend_bad_lengths",
    # truncate / trim / views / constructor
    "trim_negative",
    "truncate_negative",
    "trim_shape",
    "truncate_type",
    "view_row",
    "cache_ctor",
    # a decode step through a layer or pyattn.mha
    "mha_embed_dim",
    "mha_query_dtype",
    "mha_cache_dtype",
    "mha_cache_shape",
    "mha_batch",
    "mha_need_weights",
    "mha_mask",
    "mha_not_cache",
    "mha_overflow",
    "mha_num_new",
    "mha_threads",
    "mha_ndim",
    "mha_bad_lengths",
)


class KnownIssue(Exception):
    """Raised by a mistake whose outcome matches a reported, not yet fixed, discrepancy (see
    KNOWN_ISSUES): the example stops there (the model may be stale), counted as known:<label>."""


# Discrepancies this fuzzer found and reported, each recognised narrowly by its mistake and outcome. A
# matching outcome is counted (event "known:...") instead of failing, so the test guards everything
# else meanwhile. Delete an entry once it is fixed: the mistake is then held to the error policy.
KNOWN_ISSUES: dict = {
    # None open. Found by this fuzzer and fixed (2026-12-03): trim/truncate arguments, attend's
    # scale, keys(row)/values(row) rows, KVCache's dtype names and lengths edited out of range before
    # attend now raise the ValueError/TypeError naming the argument; trim(0) no longer made the last
    # chunk's queries see every key.
}


def _known_issue(what, exc):
    """The label of a known issue if `exc` (None: the call succeeded) is the outcome it describes:
    the mistake accepted, or refused with an exception the error policy does not name."""
    label = KNOWN_ISSUES.get(what)
    if label is None:
        return None
    return label if exc is None or not isinstance(exc, (ValueError, TypeError)) else None


class Mistakes:
    """The mistake operations of fuzz_cache.Runner (a mixin): they read the runner's cache, model,
    rng and sizes, build inputs and layers with its helpers (_values, _layer, _group_for_layer,
    _weights_args) and record through its tag and trace."""

    def _valid_query(self, group=1, chunk=None, dtype=None):
        chunk = self.model.last_chunk if chunk is None else chunk
        return self._values((self.batch, self.hk * group, chunk, self.d), dtype or self.compute)

    def _mistake(self, what):
        """(call, expected exception class(es), names one of which the message must contain, inputs
        that must stay untouched, restore) for a mistake in the current state; what may change when
        the mistake needs a state it does not have (the tag records the effective one)."""
        B, hk, d, dv, m = self.batch, self.hk, self.d, self.dv, self.model
        cache, rng = self.cache, self.rng
        rooms = m.rooms()
        chunk = min(int(rng.integers(1, 4)), int(rooms.min()))  # fits: the mistake is the only problem
        kv = lambda shape: self._values(shape, np.float32)  # noqa: E731
        good_k, good_v = kv((B, hk, chunk, d)), kv((B, hk, chunk, dv))
        restore = None

        if what == "attend_heads" and hk == 1:
            what = "attend_head_dim"  # every head count is a multiple of one KV head
        needs_layer = what.startswith("mha_") and what not in ("mha_cache_shape", "mha_not_cache")
        if needs_layer and self._group_for_layer(1) is None:
            what = "mha_cache_shape"  # no layer fits this cache: that is the mistake then

        if what.startswith("append_"):
            key, value, kwargs = good_k, good_v, {}
            if what == "append_key_dim":
                key, names, exc = kv((B, hk, chunk, d + 1)), ("key",), ValueError
            elif what == "append_key_batch":
                key, names, exc = kv((B + 1, hk, chunk, d)), ("key",), ValueError
            elif what == "append_key_heads":
                key, names, exc = kv((B, hk + 1, chunk, d)), ("key",), ValueError
            elif what == "append_key_ndim":
                key = kv((hk, chunk, d)) if rng.random() < 0.5 else kv((1, B, hk, chunk, d))
                names, exc = ("key",), ValueError
            elif what == "append_value_dim":
                value, names, exc = kv((B, hk, chunk, dv + 1)), ("value",), ValueError
            elif what == "append_value_chunk":
                value, names, exc = kv((B, hk, chunk + 1, dv)), ("value",), ValueError
            elif what == "append_bad_dtype":
                bad = rng.choice(["int32", "int64", "complex64", "bool", "object", "uint8"])
                which = rng.choice(["key", "value"])
                arr = good_k if which == "key" else good_v
                arr = (arr > 0) if bad == "bool" else arr.astype(bad)
                key, value = (arr, good_v) if which == "key" else (good_k, arr)
                names, exc = (str(which),), TypeError
            elif what == "append_overflow":
                chunk = int(rooms.min()) + 1 + (int(rng.integers(1, 3)) if rng.random() < 0.3 else 0)
                key, value = kv((B, hk, chunk, d)), kv((B, hk, chunk, dv))
                names, exc = ("max_len",), ValueError
            elif what == "append_overflow_ragged":
                b = int(rng.integers(0, B))
                chunk = int(rooms[b]) + 1 + int(rng.integers(0, 2))
                counts = np.array([rng.integers(0, min(chunk, int(r)) + 1) for r in rooms], np.int64)
                counts[b] = rooms[b] + 1
                key, value = kv((B, hk, chunk, d)), kv((B, hk, chunk, dv))
                kwargs = dict(num_new=counts, left_padded=bool(rng.random() < 0.5))
                names, exc = ("max_len",), ValueError
            elif what == "append_num_new_range":
                counts = np.zeros(B, np.int64)
                counts[int(rng.integers(0, B))] = chunk + 1 if rng.random() < 0.5 else -1
                kwargs, names, exc = dict(num_new=counts), ("num_new",), ValueError
            elif what == "append_num_new_shape":
                kwargs = dict(num_new=np.zeros(B + 1, np.int64) if rng.random() < 0.5 else 0)
                names, exc = ("num_new",), ValueError
            elif what == "append_num_new_dtype":
                kwargs = dict(num_new=np.zeros(B, np.float64) if rng.random() < 0.5 else np.zeros(B, bool))
                names, exc = ("num_new",), TypeError
            else:  # append_bad_lengths: the public lengths set out of [0, max_len] by hand
                restore = self._corrupt_lengths()
                names, exc = ("lengths", "max_len"), ValueError
            untouched = (key, value, kwargs.get("num_new"))
            return (lambda: cache.append(key, value, **kwargs)), exc, names, untouched, restore, what

        if what.startswith("attend_"):
            query, kwargs = self._valid_query(group=int(rng.integers(1, 3))), {}
            if what == "attend_head_dim":
                query, names, exc = self._values((B, hk, m.last_chunk, d + 1), self.compute), ("query",), ValueError
            elif what == "attend_batch":
                query, names, exc = self._values((B + 1, hk, m.last_chunk, d), self.compute), ("query",), ValueError
            elif what == "attend_heads":
                query, names, exc = self._values((B, hk + 1, m.last_chunk, d), self.compute), ("query",), ValueError
            elif what == "attend_chunk":
                wrong = m.last_chunk + 1 if m.last_chunk == 0 or rng.random() < 0.5 else m.last_chunk - 1
                query, names, exc = self._valid_query(chunk=wrong), ("query",), ValueError
            elif what == "attend_ndim":
                query, names, exc = query[0], ("query",), ValueError
            elif what == "attend_bad_dtype":
                bad = rng.choice(["int32", "int64", "complex64", "bool"])
                query = (query > 0) if bad == "bool" else query.astype(bad)
                names, exc = ("query",), TypeError
            elif what == "attend_scale_nonfinite":
                kwargs, names, exc = dict(scale=float(rng.choice([np.nan, np.inf, -np.inf]))), ("scale",), ValueError
            elif what == "attend_scale_type":
                kwargs = dict(scale=["0.5", True, 1j, [1.0]][int(rng.integers(0, 4))])
                names, exc = ("scale",), TypeError
            elif what == "attend_threads_value":
                kwargs = dict(num_threads=int(rng.choice([0, -1, -(2**40)])))
                names, exc = ("num_threads",), ValueError
            elif what == "attend_threads_type":
                kwargs = dict(num_threads=[2.0, "2", True][int(rng.integers(0, 3))])
                names, exc = ("num_threads",), TypeError
            else:  # attend_bad_lengths
                restore = self._corrupt_lengths()
                names, exc = ("lengths",), ValueError
            return (lambda: cache.attend(query, **kwargs)), exc, names, (query,), restore, what

        if what in ("trim_negative", "truncate_negative", "trim_shape", "truncate_type"):
            method = cache.trim if what.startswith("trim") else cache.truncate
            name = "count" if what.startswith("trim") else "length"
            if what.endswith("negative"):
                arg = -1 if rng.random() < 0.7 else np.array([0] * (B - 1) + [-2])
                exc = ValueError
            elif what == "trim_shape":
                arg = np.zeros(B + 1, np.int64) if rng.random() < 0.5 else [0] * (B + 1)
                exc = ValueError
            else:
                arg = [None, "abc", 2.5, np.full(B, 1.5)][int(rng.integers(0, 4))]
                exc = (TypeError, ValueError)
            return (lambda: method(arg)), exc, (name,), (arg,), None, what

        if what == "view_row":
            row = [B, -B - 1, 1.5, "0"][int(rng.integers(0, 4))]
            method = cache.keys if rng.random() < 0.5 else cache.values
            return (lambda: method(row)), (ValueError, TypeError), ("row",), (), None, what

        if what == "cache_ctor":
            args = dict(batch=B, num_kv_heads=hk, head_dim=d, max_len=self.max_len, value_dim=dv, dtype=self.storage)
            name = str(rng.choice(list(args)))
            if name == "dtype":
                args["dtype"] = [np.int32, "int16", np.complex64, object, "float8"][int(rng.integers(0, 5))]
                exc = TypeError
            else:
                args[name] = [0, -1, 2.5, True, "3", None if name != "value_dim" else 0][int(rng.integers(0, 6))]
                if name == "max_len" and rng.random() < 0.3:
                    args[name] = 2**62  # more bytes than can be allocated
                exc = ValueError
            positional = [args.pop(n) for n in ("batch", "num_kv_heads", "head_dim", "max_len")]
            return (lambda: pyattn.KVCache(*positional, **args)), exc, (name,), (), None, what

        # a decode step through a layer (or pyattn.mha) that goes wrong
        form = "layer" if rng.random() < 0.6 else "function"
        group = self._group_for_layer(int(rng.integers(1, 3))) or 1
        dtype, kwargs = self.compute, {}
        layer_names = (
            ("query",)
            if form == "layer"
            else ("query", "num_heads", "in_proj_weight", "q_proj_weight", "out_proj_weight")
        )
        if what == "mha_cache_shape":
            if self.dv != self.d:  # the cache's KV heads and head_dim (or 1): value_dim differs
                layer = self._layer(1, self.compute, head_dim=self.d if self.hk * self.d <= MAX_EMBED else 1)
            elif rng.random() < 0.5:
                layer = self._layer(1, self.compute, hk=hk + 1)
            else:
                layer = self._layer(1, self.compute, head_dim=d + 1)
            names, exc = ("kv_cache",), ValueError
        elif what == "mha_cache_dtype":
            dtype = np.dtype(np.float64) if self.compute == np.float32 else np.dtype(np.float32)
            layer, names, exc = self._layer(group, dtype), ("kv_cache",), TypeError
        elif what == "mha_not_cache":
            layer = self._layer(1, self.compute, hk=1, head_dim=4)
            names, exc = ("kv_cache",), TypeError
        else:
            layer = self._layer(group, self.compute)
        e = layer.embed_dim
        chunk = min(chunk, int(rooms.min()))
        x = self._values((B, chunk, e), dtype)
        kv_cache = cache
        if what == "mha_not_cache":
            kv_cache = [{"k": None}, "cache", cache.keys(0)][int(rng.integers(0, 3))]
        if what == "mha_embed_dim":
            x = self._values((B, chunk, e + int(rng.choice([-1, 1]) if e > 1 else 1)), dtype)
            names, exc = layer_names, ValueError
        elif what == "mha_query_dtype":
            x = x.astype(np.float64 if dtype == np.float32 else np.float32)
            names, exc = layer_names + ("in_proj_bias", "out_proj_bias"), TypeError
        elif what == "mha_batch":
            x = self._values((B + 1, chunk, e), dtype) if B == 1 or rng.random() < 0.5 else x[0]
            names, exc = ("query",), ValueError
        elif what == "mha_need_weights":
            kwargs, names, exc = dict(need_weights=True), ("need_weights",), ValueError
        elif what == "mha_mask":
            choice = int(rng.integers(0, 3))
            kwargs = [
                dict(attn_mask=np.zeros((chunk, chunk), bool)),
                dict(key_padding_mask=np.zeros((B, chunk), bool)),
                dict(key=x, value=x),
            ][choice]
            names, exc = ("kv_cache",), ValueError
        elif what == "mha_overflow":
            chunk = int(rooms.min()) + 1 + (int(rng.integers(1, 3)) if rng.random() < 0.3 else 0)
            x = self._values((B, chunk, e), dtype)
            names, exc = ("max_len",), ValueError
        elif what == "mha_num_new":
            pick = int(rng.integers(0, 4))
            kwargs = dict(num_new=[np.full(B, chunk + 1), np.full(B, -1), np.zeros(B + 1, np.int64), np.zeros(B)][pick])
            names, exc = ("num_new",), TypeError if pick == 3 else ValueError
        elif what == "mha_threads":
            bad = [0, -3, "2", 2.0][int(rng.integers(0, 4))]
            kwargs, names = dict(num_threads=bad), ("num_threads",)
            exc = ValueError if isinstance(bad, int) else TypeError
        elif what == "mha_ndim":
            x = self._values((e,), dtype) if rng.random() < 0.5 else x[None]  # 1-D or 4-D
            names, exc = ("query",), ValueError
        elif what == "mha_bad_lengths":
            restore = self._corrupt_lengths()
            names, exc = ("lengths", "max_len"), ValueError
        if form == "layer":
            call = lambda: layer(x, kv_cache=kv_cache, **kwargs)  # noqa: E731
            untouched = (x, kwargs.get("num_new"))
        else:
            args, _ = self._weights_args(layer, "in_proj" if rng.random() < 0.5 else "separate")
            call = lambda: pyattn.mha(x, kv_cache=kv_cache, **args, **kwargs)  # noqa: E731
            untouched = (x, kwargs.get("num_new"), args)
        self.trace(f"  (mha mistake through {form}, layer {layer!r}, x {np.shape(x)})")
        return call, exc, names, untouched, restore, what

    def _corrupt_lengths(self):
        """Sets one row's public length out of [0, max_len]; returns the function that restores it."""
        b = int(self.rng.integers(0, self.batch))
        good = int(self.cache.lengths[b])
        self.cache.lengths[b] = -1 - int(self.rng.integers(0, 3)) if self.rng.random() < 0.5 else self.max_len + 1

        def restore():
            self.cache.lengths[b] = good

        return restore

    def op_mistake(self, what, seed):
        self.rng = np.random.default_rng(seed)
        call, exc_type, names, inputs, restore, what = self._mistake(what)
        self.tag(f"mistake:{what}")
        self.trace(f"mistake {what}: expects {exc_type} naming one of {names}")
        snap = Snapshot(*inputs)
        state = _cache_state(self.cache)
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the type is what is checked
            error = exc
        else:
            error = None
        snap.assert_unchanged()
        if error is None:  # a known issue accepting the mistake stops the example (the model is stale)
            known = _known_issue(what, None)
            if known:
                raise KnownIssue(known)
            raise AssertionError(f"mistake {what}: expected {exc_type}, the call succeeded")
        assert _cache_state(self.cache) == state, f"mistake {what} changed the cache ({error!r})"
        if restore is not None:
            restore()
        known = _known_issue(what, error)
        if known:
            raise KnownIssue(known)
        if not isinstance(error, exc_type):
            raise AssertionError(f"mistake {what}: expected {exc_type}, got {type(error).__name__}: {error}") from error
        if not any(name in str(error) for name in names):
            raise AssertionError(f"mistake {what}: message names none of {names}: {error}") from error
        self.tag("outcome:" + type(error).__name__)
