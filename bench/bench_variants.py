# SPDX-License-Identifier: MIT
"""Benchmark pyattn's attention variants: sliding window, logit softcap, sinks, ALiBi, the
decode step with each of them, and packed variable-length batches.

Run (from the repository root, with pyattn installed in the interpreter's environment; torch is
optional)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_variants.py            # all groups
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_variants.py --quick    # smoke, < 30 s
    python bench/bench_variants.py --groups window,decode --peers torch --markdown --json out.json

Groups, all float32 with batch 1 unless said; "plain" is the same pyattn call without the variant:

* window: 1x16x8192x64 causal, ``window=(511, 0)`` (Hugging Face ``sliding_window=512``), against
  pyattn given the same problem as an explicit bool (L, S) mask (the causal band, ``is_causal=False``:
  the mask says it all, as a Hugging Face sdpa path passes it) and against plain causal attention.
  Peer, only with an explicit ``--peers torch`` (it takes seconds per call): torch SDPA with that mask;
* softcap: 1x16x2048x64 causal, ``softcap=50``. Peer: Hugging Face's eager attention (Gemma 2):
  matmul, * scale, c * tanh(s / c), + the causal mask (float, finfo.min above the diagonal),
  softmax, matmul; in torch, or in NumPy without torch;
* sinks: the same shape with ``sinks`` (16,) drawn N(0, 1). Peer: gpt-oss's eager attention (torch,
  or NumPy): scores + causal mask, the head's sink logit concatenated as one more column, the row max
  subtracted, softmax, that column dropped, matmul;
* alibi: the same shape with BLOOM's slopes 2^(-8 (h + 1) / H). Also pyattn with the bias as a float
  (1, H, L, S) additive mask (-slope_h * (i - j), -inf above the diagonal, ``is_causal=False``), and
  the peer torch SDPA with that mask. BLOOM adds slope_h * j instead: a per-row constant apart, which
  the softmax ignores;
* decode: a float32 ``KVCache`` with 8 KV heads, head_dim 128 and 16384 cached tokens, one query token
  of 32 heads (grouped-query): ``attend`` with no option, ``window=(4095, 0)``, ``softcap=30``,
  ``sinks`` (32,) or ``alibi_slopes`` (32,); no peer (bench_decode.py times the plain step's peers);
* varlen: 16 BERT-style sentences, lengths uniform in 16..512 (drawn with the fixed seed VARLEN_SEED,
  so the shape does not move with --seed), 12 heads of 64, no causal mask.
  sdpa level: ``pyattn.varlen_attention`` on the packed (total, 12, 64) tokens against
  ``scaled_dot_product_attention`` on the zero-padded batch (stored (B, Lmax, 12, 64) as a model's
  projection leaves it, passed as a (B, 12, Lmax, 64) view) with a (B, 1, 1, Lmax) bool key mask;
  peer torch SDPA on the same padded batch and mask.
  layer level: ``pyattn.MultiHeadAttention(768, 12)`` on the packed (total, 768) tokens with
  ``cu_seqlens`` against the padded (B, Lmax, 768) batch with ``key_padding_mask`` (True at padding);
  peer torch.nn.MultiheadAttention (eval, inference_mode, need_weights=False, the same random
  weights) on the padded batch.

``--quick``: window L = 2048, softcap/sinks/alibi L = 1024, decode 8192 tokens, 8 sentences of
16..256 tokens, and fewer runs.

Timing: every entry of a group (pyattn calls and peers) is timed by ``time_interleaved``: its own
blocks of back-to-back calls after a warm-up, ``--rounds`` alternating blocks per entry, samples
pooled, so a slow spell of the shared machine hits every entry alike; ms = median, min ms = fastest.
Every library gets ``--threads`` threads (pyattn ``num_threads=``, torch.set_num_threads, NumPy's
BLAS through threadpoolctl when installed). Inputs, masks and biases are built outside the timed
calls. x = ms / ms of the group's reference row (named in the table's title: pyattn's variant call;
decode: ``attend`` without options; varlen: the packed call).

FLOP count (E == Ev): 4 * head_dim * (allowed (query, key) pairs) per head, i.e. 2 * head_dim for
q.k and 2 * head_dim for p.v, on the pairs the variant allows only: causal L (L + 1) / 2 per head,
causal window=(511, 0) sum_i min(i + 1, 512), decode S keys (window: 4096), varlen sum of len^2 per
head, the same for the padded calls (their padding is not useful work), and the layer rows add the
projections, 8 * T * E^2 for the T real tokens. Every entry of a group is credited the pairs of its
own problem: the same for all but the window group's causal call (L (L + 1) / 2) and the decode
window (4096 keys); %plain = GFLOP/s as % of the plain call's.

Errors: max err = max |pyattn - float64| (``pyattn.reference``). Where a full float64 computation
would be large (a causal (L, L) problem with 16 heads) it runs on head 0's first 1024 queries against
keys < 1024, the same causal problem truncated (query i < 1024 sees no key >= 1024; window, ALiBi
distances and sinks are unchanged by the cut): "err vs" says "f64 h0 :1024"; "f64" = the whole output
(decode: per KV head; varlen: per sentence, padded outputs on their real rows). A peer's column holds
its max |peer - pyattn| ("pyattn"), and a note is printed when it passes PEER_AGREEMENT_TOL. A pyattn
error above _common.WRONG_ANSWER_ERR (or NaN) makes the script exit with status 1 (finish_run).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from _common import (
    BUSY_WARN_CPUS,
    ENVIRONMENT_HELP,
    BackgroundLoad,
    Column,
    Table,
    TimingDefaults,
    add_common_arguments,
    blas_thread_limiter,
    cpu_model,
    finish_run,
    fmt,
    fmt_ms,
    import_pyattn,
    limit_peer_isa,
    machine,
    now_iso,
    numpy_blas_name,
    openblas_env_warnings,
    print_peer_isa,
    resolve_common_arguments,
    time_interleaved,
    wait_for_idle,
)

DTYPE = np.float32
HEAD_DIM = 64
WINDOW = (511, 0)  # Hugging Face sliding_window=512 on a causal model
SOFTCAP = 50.0  # Gemma 2's attention logit softcap
DECODE = {"num_kv_heads": 8, "num_heads": 32, "head_dim": 128, "window": (4095, 0), "softcap": 30.0}
VARLEN = {"num_heads": 12, "embed_dim": 768, "min_len": 16}
VARLEN_SEED = 53  # sentence lengths: a fixed shape, whatever --seed draws for the values
ERR_ROWS = 1024  # causal rows: float64 check on head 0's first ERR_ROWS queries and keys
FILL_CHUNK = 4096  # tokens appended per KVCache.append while filling
PEER_AGREEMENT_TOL = 1e-3  # a peer further than this from pyattn is reported
ROW_RETRIES = 2  # with --wait-idle: redo a group disturbed by other processes at most this often
TIMING = TimingDefaults(min_time=0.3, min_runs=5, quick_min_runs=3)  # --min-time / --min-runs
GROUPS = ("window", "softcap", "sinks", "alibi", "decode", "varlen")
PEERS = ("torch", "numpy")
ENV_RECORDED = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "PYATTN_ISA")


@dataclass(frozen=True)
class Sizes:
    """The problem sizes of one run (default or --quick)."""

    num_heads: int  # window, softcap, sinks, alibi
    window_len: int
    short_len: int  # softcap, sinks, alibi
    decode_len: int
    sentences: int
    max_sentence: int


FULL = Sizes(num_heads=16, window_len=8192, short_len=2048, decode_len=16384, sentences=16, max_sentence=512)
QUICK = Sizes(num_heads=16, window_len=2048, short_len=1024, decode_len=8192, sentences=8, max_sentence=256)


@dataclass
class Entry:
    """One timed callable of a group. pyattn entries have `check` (normalized output -> (max abs error
    against float64, what it was compared with)); peers have `agree`, the key of the pyattn entry
    whose output theirs is compared with. `normalize` maps the raw result to the form both use."""

    label: str
    fn: Callable[[], Any]
    flops: int
    check: Callable[[np.ndarray], tuple[float, str]] | None = None
    agree: str | None = None
    normalize: Callable[[Any], np.ndarray] = np.asarray
    context: Callable[[], Any] | None = None


@dataclass
class Group:
    """A table: entries timed together; x is relative to entries[ref], %plain to entries[plain]."""

    key: str
    case: str
    title: str
    entries: dict[str, Entry]
    ref: str
    plain: str


# ----------------------------------------------------------------------------------------------
# Helpers: inputs, work counts, float64 checks


def normal(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=DTYPE)


def causal_pairs(length: int, left: int | None = None) -> int:
    """Allowed (query, key) pairs of an (L, L) causal problem, with a window of `left` earlier keys."""
    seen = np.arange(1, length + 1)
    return int((seen if left is None else np.minimum(seen, left + 1)).sum())


def bloom_slopes(num_heads: int) -> np.ndarray:
    """BLOOM's ALiBi slopes 2^(-8 (h + 1) / H) (num_heads a power of two)."""
    return (2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)).astype(DTYPE)


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def head0_check(reference, q, k, v, **variant) -> Callable[[np.ndarray], tuple[float, str]]:
    """check(out) for a causal (1, H, L, L) problem: max |out - float64| on head 0's first n =
    min(L, ERR_ROWS) queries against keys < n (the same problem truncated: query i < n sees no key
    >= n); per-head arguments (sinks, alibi_slopes) are cut to head 0 too."""
    n = min(q.shape[2], ERR_ROWS)
    per_head = {name: (np.asarray(a)[:1] if name in ("sinks", "alibi_slopes") else a) for name, a in variant.items()}
    cut = (slice(None), slice(0, 1), slice(0, n))
    scope = "f64" if (q.shape[1], q.shape[2]) == (1, n) else f"f64 h0 :{n}"

    def check(out):
        ref = reference.scaled_dot_product_attention(
            *(x[cut].astype(np.float64) for x in (q, k, v)), is_causal=True, **per_head
        )
        return max_abs_diff(out[cut], ref), scope

    return check


def first(result):
    """The output of a call returning `out` or `(out, weights)`."""
    return result[0] if isinstance(result, tuple) else result


# ----------------------------------------------------------------------------------------------
# Peers: eager formulas and torch SDPA, each a zero-argument callable


def torch_eager(q, k, v, mask, *, softcap=None, sinks=None):
    """Hugging Face's eager attention in torch (Gemma 2 with softcap, gpt-oss with sinks): matmul,
    * scale, softcap, + float mask, softmax (with the sink column), matmul."""
    import torch

    tq, tk, tv, tmask = (torch.from_numpy(x) for x in (q, k, v, mask))
    scale = 1.0 / math.sqrt(q.shape[-1])
    tsinks = (
        None if sinks is None else torch.from_numpy(sinks).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    )

    def run():
        with torch.inference_mode():
            w = torch.matmul(tq, tk.transpose(2, 3)) * scale
            if softcap is not None:
                w = torch.tanh(w / softcap) * softcap
            w = w + tmask
            if tsinks is None:
                p = torch.softmax(w, dim=-1, dtype=torch.float32)
            else:
                logits = torch.cat([w, tsinks], dim=-1)
                logits = logits - logits.max(dim=-1, keepdim=True).values
                p = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
            return torch.matmul(p, tv).numpy()

    return run


def numpy_eager(q, k, v, mask, *, softcap=None, sinks=None):
    """The same eager formula in float32 NumPy (the peer without torch)."""
    scale = DTYPE(1.0 / math.sqrt(q.shape[-1]))
    kt = k.transpose(0, 1, 3, 2)
    column = None if sinks is None else np.broadcast_to(sinks.reshape(1, -1, 1, 1), (*q.shape[:3], 1))

    def run():
        w = np.matmul(q, kt) * scale
        if softcap is not None:
            w = np.tanh(w / DTYPE(softcap)) * DTYPE(softcap)
        w += mask
        if column is not None:
            w = np.concatenate([w, column], axis=-1)
        w -= w.max(axis=-1, keepdims=True)
        np.exp(w, out=w)
        w /= w.sum(axis=-1, keepdims=True)
        return np.matmul(w if column is None else w[..., :-1], v)

    return run


def torch_sdpa(q, k, v, mask):
    """torch.nn.functional.scaled_dot_product_attention with an explicit mask, inference mode."""
    import torch
    import torch.nn.functional as F

    tq, tk, tv, tmask = (torch.from_numpy(x) for x in (q, k, v, mask))

    def run():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask).numpy()

    return run


def eager_peers(args, q, k, v, flops, agree, **variant) -> dict[str, Entry]:
    """The eager-formula peers (torch and/or NumPy, as args.peers says) of a causal (1, H, L, L) row."""
    length = q.shape[2]
    upper = np.arange(length)[None, :] > np.arange(length)[:, None]
    mask = np.where(upper, np.finfo(DTYPE).min, 0.0).astype(DTYPE)  # Hugging Face's causal float mask
    name = "Gemma 2" if "softcap" in variant else "gpt-oss"
    peers = {}
    if "torch" in args.peers:
        peers["torch"] = Entry(f"torch eager ({name})", torch_eager(q, k, v, mask, **variant), flops, agree=agree)
    if "numpy" in args.peers:
        peers["numpy"] = Entry(
            f"numpy eager ({name})", numpy_eager(q, k, v, mask, **variant), flops, agree=agree, context=args.blas_limit
        )
    return peers


# ----------------------------------------------------------------------------------------------
# Groups


def sdpa(pyattn, args, q, k, v, mask=None, **kw):
    """A pyattn.scaled_dot_product_attention call as a zero-argument callable."""
    return lambda: pyattn.scaled_dot_product_attention(q, k, v, mask, num_threads=args.threads, **kw)


def window_groups(pyattn, sizes, rng, args) -> list[Group]:
    h, length = sizes.num_heads, sizes.window_len
    q, k, v = (normal(rng, (1, h, length, HEAD_DIM)) for _ in range(3))
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    band = (j <= i) & (j >= i - WINDOW[0])
    flops = 4 * HEAD_DIM * h * causal_pairs(length, WINDOW[0])
    win_check = head0_check(pyattn.reference, q, k, v, window=WINDOW)
    entries = {
        "window": Entry(
            f"pyattn window={WINDOW}", sdpa(pyattn, args, q, k, v, is_causal=True, window=WINDOW), flops, win_check
        ),
        "mask": Entry("pyattn bool mask (L x S)", sdpa(pyattn, args, q, k, v, band), flops, win_check),
        "causal": Entry(
            "pyattn causal (no window)",
            sdpa(pyattn, args, q, k, v, is_causal=True),
            4 * HEAD_DIM * h * causal_pairs(length),
            head0_check(pyattn.reference, q, k, v),
        ),
    }
    if args.slow_torch:
        entries["torch"] = Entry("torch sdpa, bool mask (L x S)", torch_sdpa(q, k, v, band), flops, agree="window")
    case = f"1x{h}x{length}x{HEAD_DIM}"
    title = f"window: {case} float32 causal, window={WINDOW}; x = ms / pyattn window ms; %plain = of causal's GFLOP/s"
    return [Group("window", case, title, entries, "window", "causal")]


def variant_groups(key: str):
    """The builder of the softcap, sinks or alibi group: pyattn with the variant, without it, peers."""

    def build(pyattn, sizes, rng, args) -> list[Group]:
        h, length = sizes.num_heads, sizes.short_len
        q, k, v = (normal(rng, (1, h, length, HEAD_DIM)) for _ in range(3))
        flops = 4 * HEAD_DIM * h * causal_pairs(length)
        variant = {
            "softcap": {"softcap": SOFTCAP},
            "sinks": {"sinks": normal(rng, (h,))},
            "alibi": {"alibi_slopes": bloom_slopes(h)},
        }[key]
        name, value = next(iter(variant.items()))
        label = f"pyattn {name}={value:g}" if key == "softcap" else f"pyattn {name}"
        check = head0_check(pyattn.reference, q, k, v, **variant)
        entries = {
            key: Entry(label, sdpa(pyattn, args, q, k, v, is_causal=True, **variant), flops, check),
            "plain": Entry(
                f"pyattn causal (no {key})",
                sdpa(pyattn, args, q, k, v, is_causal=True),
                flops,
                head0_check(pyattn.reference, q, k, v),
            ),
        }
        if key == "alibi":
            i, j = np.arange(length)[:, None], np.arange(length)[None, :]
            slopes = variant["alibi_slopes"][:, None, None]
            bias = np.where(j <= i, -slopes * (i - j).astype(DTYPE), -np.inf).astype(DTYPE)[None]
            entries["mask"] = Entry("pyattn float mask (H x L x S)", sdpa(pyattn, args, q, k, v, bias), flops, check)
            if "torch" in args.peers:
                entries["torch"] = Entry("torch sdpa, float mask", torch_sdpa(q, k, v, bias), flops, agree=key)
        else:
            entries.update(eager_peers(args, q, k, v, flops, key, **variant))
        case = f"1x{h}x{length}x{HEAD_DIM}"
        what = {"softcap": f"softcap={SOFTCAP:g}", "sinks": f"sinks ({h},) N(0, 1)", "alibi": "BLOOM ALiBi slopes"}
        title = f"{key}: {case} float32 causal, {what[key]}; x = ms / {label} ms; %plain = of no-{key} GFLOP/s"
        return [Group(key, case, title, entries, key, "plain")]

    return build


def decode_groups(pyattn, sizes, rng, args) -> list[Group]:
    hkv, hq, d, s = DECODE["num_kv_heads"], DECODE["num_heads"], DECODE["head_dim"], sizes.decode_len
    cache = pyattn.KVCache(1, hkv, d, s, dtype=DTYPE)
    for start in range(0, s - 1, FILL_CHUNK):
        n = min(FILL_CHUNK, s - 1 - start)
        cache.append(normal(rng, (1, hkv, n, d)), normal(rng, (1, hkv, n, d)))
    cache.append(normal(rng, (1, hkv, 1, d)), normal(rng, (1, hkv, 1, d)))  # the token attend() serves
    q = normal(rng, (1, hq, 1, d))
    keys, values = cache.keys(), cache.values()
    group = hq // hkv
    variants = {
        "none": {},
        "window": {"window": DECODE["window"]},
        "softcap": {"softcap": DECODE["softcap"]},
        "sinks": {"sinks": normal(rng, (hq,))},
        "alibi": {"alibi_slopes": bloom_slopes(hq)},
    }

    def check_of(variant):
        def check(out):  # float64 per KV head: query heads g*group .. (g+1)*group - 1 read KV head g
            err = 0.0
            for g in range(hkv):
                heads = slice(g * group, (g + 1) * group)
                per_head = {n: (a[heads] if n in ("sinks", "alibi_slopes") else a) for n, a in variant.items()}
                ref = pyattn.reference.scaled_dot_product_attention(
                    q[:, heads].astype(np.float64),
                    keys[:, g : g + 1].astype(np.float64),
                    values[:, g : g + 1].astype(np.float64),
                    is_causal="lower_right",
                    enable_gqa=True,
                    **per_head,
                )
                err = max(err, max_abs_diff(out[:, heads], ref))
            return err, "f64"

        return check

    def attend(variant):
        return lambda: cache.attend(q, num_threads=args.threads, **variant)

    entries = {}
    for key, variant in variants.items():
        keys_read = min(s, DECODE["window"][0] + 1) if key == "window" else s
        label = "attend" + "".join(f" {n}={a}" if n in ("window", "softcap") else f" {n}" for n, a in variant.items())
        entries[key] = Entry(label, attend(variant), 4 * d * hq * keys_read, check_of(variant))
    case = f"B1 Hq{hq} Hkv{hkv} D{d} S{s}"
    title = f"decode: KVCache float32 {case}, one query token; x = ms / attend (no option) ms; %plain = of its GFLOP/s"
    return [Group("decode", case, title, entries, "none", "none")]


def sentence_lengths(sizes: Sizes) -> np.ndarray:
    rng = np.random.default_rng(VARLEN_SEED)
    return rng.integers(VARLEN["min_len"], sizes.max_sentence, size=sizes.sentences, endpoint=True)


def padded(packed: np.ndarray, cu: np.ndarray, max_len: int) -> np.ndarray:
    """(total, ...) packed tokens as a zero-padded (B, max_len, ...) batch."""
    out = np.zeros((cu.size - 1, max_len, *packed.shape[1:]), dtype=packed.dtype)
    for b in range(cu.size - 1):
        out[b, : cu[b + 1] - cu[b]] = packed[cu[b] : cu[b + 1]]
    return out


def unpadded(batch: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """The real rows of a (B, max_len, ...) batch, packed (total, ...)."""
    return np.concatenate([batch[b, : cu[b + 1] - cu[b]] for b in range(cu.size - 1)])


def varlen_groups(pyattn, sizes, rng, args) -> list[Group]:
    lengths = sentence_lengths(sizes)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, max_len, batch = int(cu[-1]), int(lengths.max()), lengths.size
    h, e = VARLEN["num_heads"], VARLEN["embed_dim"]
    pairs = int((lengths.astype(np.int64) ** 2).sum())
    case = f"B{batch} T{total} Lmax{max_len} H{h} D{e // h}"
    return [
        sdpa_varlen_group(pyattn, args, rng, cu, max_len, pairs, case),
        layer_varlen_group(pyattn, args, rng, cu, max_len, pairs, case),
    ]


def sdpa_varlen_group(pyattn, args, rng, cu, max_len, pairs, case) -> Group:
    """varlen_attention on packed tokens vs the padded batch with a key mask (sdpa level)."""
    h, d = VARLEN["num_heads"], VARLEN["embed_dim"] // VARLEN["num_heads"]
    total = int(cu[-1])
    q, k, v = (normal(rng, (total, h, d)) for _ in range(3))
    qp, kp, vp = (padded(x, cu, max_len).transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, H, Lmax, D) views
    real = np.arange(max_len)[None, :] < np.diff(cu)[:, None]
    mask = real[:, None, None, :]  # (B, 1, 1, Lmax), True = may attend
    exact = np.concatenate(
        [
            pyattn.reference.scaled_dot_product_attention(
                *(x[cu[b] : cu[b + 1]].transpose(1, 0, 2).astype(np.float64) for x in (q, k, v))
            ).transpose(1, 0, 2)
            for b in range(cu.size - 1)
        ]
    )

    def check(out):
        return max_abs_diff(out, exact), "f64"

    def from_padded(out):
        return unpadded(np.asarray(out).transpose(0, 2, 1, 3), cu)

    flops = 4 * d * h * pairs
    entries = {}
    entries["varlen"] = Entry(
        "pyattn varlen_attention",
        lambda: pyattn.varlen_attention(q, k, v, cu, cu, num_threads=args.threads),
        flops,
        check,
    )
    entries["padded"] = Entry(
        "pyattn sdpa padded, (B,1,1,Lmax) mask",
        sdpa(pyattn, args, qp, kp, vp, mask),
        flops,
        check,
        normalize=from_padded,
    )
    ref = "varlen"
    if "torch" in args.peers:
        entries["torch"] = Entry(
            "torch sdpa padded, mask", torch_sdpa(qp, kp, vp, mask), flops, agree=ref, normalize=from_padded
        )
    title = f"varlen, sdpa level: {case} float32, not causal; x = ms / {entries[ref].label} ms; %plain = of padded's"
    return Group("varlen_sdpa", case, title, entries, ref, "padded")


def layer_varlen_group(pyattn, args, rng, cu, max_len, pairs, case) -> Group:
    """MultiHeadAttention on packed tokens with cu_seqlens vs the padded batch with key_padding_mask."""
    h, e = VARLEN["num_heads"], VARLEN["embed_dim"]
    total = int(cu[-1])
    shapes = {"in_proj_weight": (3 * e, e), "in_proj_bias": (3 * e,), "out_proj.weight": (e, e), "out_proj.bias": (e,)}
    state = {name: (normal(rng, shape) / np.sqrt(e)).astype(DTYPE) for name, shape in shapes.items()}
    layer = pyattn.MultiHeadAttention(e, h, batch_first=True)
    layer.load_state_dict(state)
    x = normal(rng, (total, e))
    xp = padded(x, cu, max_len)
    padding = np.arange(max_len)[None, :] >= np.diff(cu)[:, None]  # (B, Lmax), True at padding
    weights = {
        "in_proj_weight": state["in_proj_weight"],
        "in_proj_bias": state["in_proj_bias"],
        "out_proj_weight": state["out_proj.weight"],
        "out_proj_bias": state["out_proj.bias"],
    }
    exact = np.concatenate(
        [pyattn.reference.mha(x[None, cu[b] : cu[b + 1]], num_heads=h, **weights)[0] for b in range(cu.size - 1)]
    )

    def check(out):
        return max_abs_diff(out, exact), "f64"

    def from_padded(out):
        return unpadded(np.asarray(first(out)), cu)

    flops = 8 * total * e * e + 4 * e * pairs
    entries = {}
    entries["packed"] = Entry(
        "pyattn layer, cu_seqlens",
        lambda: layer(x, cu_seqlens=cu, num_threads=args.threads),
        flops,
        check,
    )
    entries["padded"] = Entry(
        "pyattn layer padded, key_padding_mask",
        lambda: layer(xp, xp, xp, key_padding_mask=padding, need_weights=False, num_threads=args.threads),
        flops,
        check,
        normalize=from_padded,
    )
    ref = "packed"
    if "torch" in args.peers:
        entries["torch"] = Entry(
            "torch MultiheadAttention padded",
            torch_layer(state, h, xp, padding),
            flops,
            agree=ref,
            normalize=from_padded,
        )
    title = (
        f"varlen, layer level: MultiHeadAttention({e}, {h}) {case}; x = ms / {entries[ref].label} ms; "
        "%plain = of padded's"
    )
    return Group("varlen_layer", case, title, entries, ref, "padded")


def torch_layer(state, num_heads, xp, padding):
    """torch.nn.MultiheadAttention (batch_first, eval, inference mode) on the padded batch."""
    import torch

    e = xp.shape[-1]
    module = torch.nn.MultiheadAttention(e, num_heads, batch_first=True).eval()
    module.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    tx, tpad = torch.from_numpy(xp), torch.from_numpy(padding)

    def run():
        with torch.inference_mode():
            return module(tx, tx, tx, key_padding_mask=tpad, need_weights=False)[0].numpy()

    return run


BUILDERS: dict[str, Callable[..., list[Group]]] = {
    "window": window_groups,
    "softcap": variant_groups("softcap"),
    "sinks": variant_groups("sinks"),
    "alibi": variant_groups("alibi"),
    "decode": decode_groups,
    "varlen": varlen_groups,
}


# ----------------------------------------------------------------------------------------------
# Running a group


def run_group(group: Group, args) -> list[dict]:
    """Time every entry of `group` interleaved and return its rows (pyattn entries first checked
    against float64, then peers against pyattn); a failing pyattn entry raises, a failing peer is
    reported in its row."""
    timed = time_interleaved(
        {key: e.fn for key, e in group.entries.items()},
        rounds=args.rounds,
        min_time=args.min_time,
        min_runs=args.min_runs,
        contexts={key: e.context for key, e in group.entries.items() if e.context},
    )
    rows, outputs = {}, {}
    for key, e in sorted(group.entries.items(), key=lambda item: item[1].agree is not None):
        row = {"group": group.key, "case": group.case, "entry": key, "variant": e.label, "flops": e.flops}
        row["kind"] = "pyattn" if e.agree is None else "peer"
        result = timed[key]
        if isinstance(result, Exception):
            if e.agree is None:
                raise result
            row["error"] = f"{type(result).__name__}: {result}"
            print(f"  note: {e.label} failed on {group.case}: {row['error']}", file=sys.stderr)
            rows[key] = row
            continue
        t, out = result
        outputs[key] = e.normalize(out)
        row.update(ms=t.median * 1e3, min_ms=t.min * 1e3, runs=t.runs, gflops=e.flops / t.median / 1e9)
        if e.agree is None:
            row["max_abs_err"], row["err_vs"] = e.check(outputs[key])
        else:
            row["max_diff_vs_pyattn"], row["err_vs"] = max_abs_diff(outputs[key], outputs[e.agree]), "pyattn"
            if not row["max_diff_vs_pyattn"] <= PEER_AGREEMENT_TOL:
                print(f"  note: {e.label} differs from pyattn by {row['max_diff_vs_pyattn']:.2e}", file=sys.stderr)
        rows[key] = row
    ref_ms, plain_gflops = rows[group.ref].get("ms"), rows[group.plain].get("gflops")
    for row in rows.values():
        if "ms" in row:
            row["x"] = row["ms"] / ref_ms
            row["pct_plain"] = 100 * row["gflops"] / plain_gflops
    return [rows[key] for key in group.entries]  # in the group's order


def run_group_guarded(group: Group, args) -> list[dict]:
    """run_group under a BackgroundLoad monitor; with --wait-idle, wait for idle CPUs first and redo
    a group that other processes disturbed (at most ROW_RETRIES times)."""
    attempts = 1 + (ROW_RETRIES if args.wait_idle > 0 else 0)
    for attempt in range(1, attempts + 1):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            rows = run_group(group, args)
        for row in rows:
            row["background_cpus"], row["attempts"] = load.cpus, attempt
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
        action = "redoing the group" if attempt < attempts else "keeping it"
        print(f"  note: {group.key}: other processes used {load.cpus:.1f} CPUs; {action}", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------------------------
# Tables and summary


COLUMNS = (
    Column("entry", 38, right=False),
    Column("ms", 7),
    Column("min ms", 7),
    Column("GFLOP/s", 7),
    Column("%plain", 6),
    Column("x", 5),
    Column("max err", 7),
    Column("err vs", 12, right=False),
    Column("bg", 3),
)


def cells(row: dict) -> list[str]:
    err = row.get("max_abs_err", row.get("max_diff_vs_pyattn"))
    return [
        row["variant"],
        fmt_ms(row.get("ms")),
        fmt_ms(row.get("min_ms")),
        fmt(row.get("gflops"), ".1f"),
        fmt(row.get("pct_plain"), ".0f"),
        fmt(row.get("x"), ".2f"),
        fmt(err, ".1e"),
        row.get("err_vs", "failed" if "error" in row else "-"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


def ratio(results: dict, group: str, a: str, b: str) -> float | None:
    """ms of entry a / ms of entry b in `group`, None when either did not run."""
    ms = {row["entry"]: row.get("ms") for row in results.get(group, [])}
    return ms[a] / ms[b] if ms.get(a) and ms.get(b) else None


def pct_plain(results: dict, group: str, entry: str) -> float | None:
    return next((r.get("pct_plain") for r in results.get(group, []) if r["entry"] == entry), None)


def summary_lines(results: dict) -> list[str]:
    """The ratios the issue asks about, one line per group that ran (time ratios; < 1: the first is faster)."""

    def r(group, a, b, spec=".2f"):
        return fmt(ratio(results, group, a, b), spec)

    lines = []
    if "window" in results:
        speedup = ratio(results, "window", "causal", "window")
        lines.append(
            f"window={WINDOW}: window/mask {r('window', 'window', 'mask')}, window/causal "
            f"{r('window', 'window', 'causal')} ({fmt(speedup, '.1f')}x faster); window GFLOP/s = "
            f"{fmt(pct_plain(results, 'window', 'window'), '.0f')}% of causal's; torch mask/window "
            f"{r('window', 'torch', 'window')}"
        )
    peers = {"softcap": "HF eager", "sinks": "gpt-oss eager"}
    for key in ("softcap", "sinks", "alibi"):
        if key in results:
            line = f"{key}: with/without {r(key, key, 'plain', '.3f')}"
            if key == "alibi":
                line += (
                    f"; float mask/slopes {r(key, 'mask', key)}; torch sdpa float mask/slopes {r(key, 'torch', key)}"
                )
            else:
                line += f"; {peers[key]}/pyattn: torch {r(key, 'torch', key)}, numpy {r(key, 'numpy', key)}"
            lines.append(line)
    if "decode" in results:
        parts = [f"{key} {r('decode', key, 'none', '.3f')}" for key in ("window", "softcap", "sinks", "alibi")]
        speedup = ratio(results, "decode", "none", "window")
        lines.append(f"decode (each / none): {', '.join(parts)}; window speedup {fmt(speedup, '.2f')}x")
    for key, packed, what in (("varlen_sdpa", "varlen", "sdpa"), ("varlen_layer", "packed", "layer")):
        if key in results:
            lines.append(
                f"varlen {what}: padded/packed {r(key, 'padded', packed)} (speedup of packed); "
                f"torch padded/packed {r(key, 'torch', packed)}"
            )
    return lines


# ----------------------------------------------------------------------------------------------
# Command line and header


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time pyattn's attention variants (window, softcap, sinks, ALiBi, decode, varlen) against "
        "the same calls without them, equivalent masks and eager peers (float32, same thread count).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ENVIRONMENT_HELP.format(script="bench/bench_variants.py"),
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: smaller sizes and few runs (< 30 s)")
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of %(default)s")
    parser.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated subset of {','.join(PEERS)}, or 'none'. Default: torch when installed, else numpy "
        "(the eager formulas), without the window group's torch SDPA peer, which takes seconds per call and "
        "runs only when torch is named here",
    )
    add_common_arguments(
        parser,
        TIMING,
        seed_of="inputs (the varlen lengths have their own fixed seed)",
        wait_idle_help="shared machines: before each group wait up to SECONDS for idle CPUs, and redo a group "
        f"that other processes disturbed (up to {ROW_RETRIES} times; default 0 = only report it)",
    )
    args = parser.parse_args(argv)
    resolve_common_arguments(args, parser, TIMING)
    args.groups = _split(args.groups, GROUPS, parser, "--groups")
    if args.peers is not None and args.peers.strip() != "none":
        args.peers = _split(args.peers, PEERS, parser, "--peers")
    return args


def _split(text: str, allowed: tuple[str, ...], parser, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        parser.error(f"{flag}: unknown {bad}; choose from {list(allowed)}")
    return items


def resolve_peers(args) -> str | None:
    """Fill args.peers (the peers that will run) and args.slow_torch; return torch's version (None
    when it is not installed). torch gets --threads threads."""
    try:
        import torch

        version = torch.__version__
        torch.set_num_threads(args.threads)
    except ImportError:
        version = None
    explicit = args.peers
    if explicit is None:
        args.peers = ["torch"] if version else ["numpy"]
    elif explicit == "none":
        args.peers = []
    args.slow_torch = explicit not in (None, "none") and "torch" in explicit and version is not None
    if "torch" in args.peers and version is None:
        print("note: torch is not installed; its peers are skipped", file=sys.stderr)
        args.peers = [p for p in args.peers if p != "torch"]
    return version


def print_header(info: dict, args) -> None:
    rt = info["pyattn"]
    peak = info["fma_peak_gflops"]
    print(f"pyattn bench_variants   {info['date']}")
    print(f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs); threads, every library: {info['threads']}")
    print(
        f"pyattn {rt.get('version')}: isa={rt.get('isa')} available={rt.get('available_isas')} "
        f"openmp={rt.get('openmp')} compiler={rt.get('compiler')}"
    )
    print(f"numpy {np.__version__} ({info['numpy_blas']}); torch {info['torch'] or 'not installed'}")
    print_peer_isa(info["peer_isa_env"])
    print("FMA peak (measured now, float32, pyattn's ISA): " + (f"{peak:.1f} GFLOP/s" if peak else "n/a"))
    for line in openblas_env_warnings():
        print(line)
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
    peers = ", ".join(args.peers) or "none"
    print(f"peers: {peers}{' (+ torch sdpa in the window group)' if args.slow_torch else ''}")
    print(
        f"float32; ms = median over runs after warm-up (min ms = fastest); {args.rounds} alternating blocks per "
        "entry, samples pooled"
    )
    print(
        "GFLOP/s = 4 * head_dim * heads * allowed (query, key) pairs / time (E == Ev; layer rows + 8*T*E^2 "
        "projections): only the pairs the variant allows; %plain = of the plain call's GFLOP/s"
    )
    print("x = ms / ms of the group's reference row (see its title; > 1: the reference row is faster)")
    print(
        f"max err = max|pyattn - float64 (pyattn.reference)|: 'f64' = whole output, 'f64 h0 :{ERR_ROWS}' = head 0, "
        f"first {ERR_ROWS} queries and keys (the same causal problem truncated); peers: max|peer - pyattn|"
    )
    print(f"bg = CPUs other processes kept busy during the group; > {BUSY_WARN_CPUS} is noisy")
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    pyattn = import_pyattn(args.isa, "bench_variants")
    args.peer_env = limit_peer_isa(args.isa, args.peers_isa)  # before torch is imported
    torch_version = resolve_peers(args)
    args.blas_limit, blas_threads = blas_thread_limiter(args.threads)
    sizes = QUICK if args.quick else FULL
    busy = wait_for_idle(args.wait_idle)
    measure_peak = getattr(machine(pyattn), "fma_peak_gflops", None)
    info = {
        "date": now_iso(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": args.threads,
        "pyattn": dict(pyattn.runtime_info()),
        "numpy_blas": f"{numpy_blas_name()}; BLAS threads: {blas_threads}",
        "torch": torch_version,
        "fma_peak_gflops": float(measure_peak(args.threads, 0.1 if args.quick else 0.5)) if measure_peak else None,
        "busy_cpus_before": busy,
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "peer_isa_env": args.peer_env,
        "peers": args.peers,
        "sizes": sizes.__dict__,
        "quick": args.quick,
        "min_time_s": args.min_time,
        "min_runs": args.min_runs,
        "rounds": args.rounds,
        "seed": args.seed,
    }
    print_header(info, args)

    rng = np.random.default_rng(args.seed)
    results: dict[str, list[dict]] = {}
    tables: list[tuple[str, Table]] = []
    for key in args.groups:
        groups = BUILDERS[key](pyattn, sizes, rng, args)
        while groups:
            group = groups.pop(0)
            table = Table(COLUMNS)
            print(group.title)
            print(table.header(), flush=True)
            rows = run_group_guarded(group, args)
            for row in rows:
                print(table.add(cells(row)))
            print(flush=True)
            results[group.key] = rows
            tables.append((group.title, table))
            del group  # its inputs are freed before the next group is built

    print("Summary (time ratios; < 1: the first is faster):")
    for line in summary_lines(results):
        print(f"  {line}")
    if args.markdown:
        for title, table in tables:
            print(f"\n{title}\n")
            print(table.markdown())
    return finish_run(info, args.json, results, f"{sum(len(r) for r in results.values())} rows")


if __name__ == "__main__":
    sys.exit(main())
