# SPDX-License-Identifier: MIT
"""Benchmark pyattn.distributed on one machine: what sharding over Dask workers costs.

Run (from the repository root, with pyattn and Dask installed: ``pip install ".[bench,dask]"``)::

    python bench/bench_distributed.py                  # 1x16x65536x64 causal prefill, 64k/256k decode
    python bench/bench_distributed.py --quick          # smoke, < 1 minute
    python bench/bench_distributed.py --workers 2 --threads-per-worker 1 --prefill-len 32768

A ``distributed.LocalCluster`` of ``--workers`` processes with ``--threads-per-worker`` threads each
(default 2 x 1 on a 2-core machine; every server on 127.0.0.1 and an ephemeral port) runs the
sharded calls; the single-process call runs in this process with workers x threads pyattn threads
(the same cores), between the cluster's runs (the workers idle meanwhile).

Rows:

* prefill: 1 x H x L x 64 float32 causal (default H 16, L 65536). Sharded: K/V in 2 x workers shards
  scattered round-robin, queries in as many blocks (context parallelism: the (block, shard) pairs
  the causal rule forbids are not scheduled), partials merged in a tree of merge tasks on the
  workers; timed from the NumPy query on the client to the gathered output (the query blocks'
  scatter included, the K/V shards already on the workers). Against
  ``scaled_dot_product_attention`` in one process. Target: within 1.3x of the single process.
* decode: one step of a 32-head (8 KV heads, head_dim 128) float32 cache of S tokens (default 64k
  and 256k) split over ``ShardedKVCache`` actors, one per worker: the new query row to every shard,
  (output, lse) back, merged on the client; against ``KVCache.attend`` on the whole cache in one
  process. ``overhead`` = sharded - single-process time; on the ``one shard, in process`` row (the
  last shard's attention in this process on one worker's threads: what each worker computes),
  sharded - that time: scheduling, transfer and the merge (target <= 3 ms over 2 shards), with the
  round trip of an empty actor call for scale. ``--prefill-len 0`` skips the prefill.

Errors: ``max err`` = max |sharded - single-process| (float32 rounding of the merge).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from _common import Column, Table, fmt, fmt_ms, import_pyattn, now_iso


def timed(fn, runs):
    """Median and min seconds of `runs` calls after one warm-up, and the last result."""
    result = fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)), float(np.min(samples)), result


def prefill_row(pyattn, pd, client, args, rng):
    h, length, dim, shards = args.heads, args.prefill_len, 64, 2 * args.workers
    q, k, v = (rng.standard_normal((1, h, length, dim), dtype=np.float32) for _ in range(3))
    cuts = [round(s * length / shards) for s in range(shards + 1)]
    workers = sorted(client.scheduler_info()["workers"])
    k_shards, v_shards = [], []
    for s in range(shards):  # round-robin: each worker holds every other shard
        where = [workers[s % len(workers)]]
        k_shards.append(client.scatter(k[..., cuts[s] : cuts[s + 1], :], workers=where, hash=False))
        v_shards.append(client.scatter(v[..., cuts[s] : cuts[s + 1], :], workers=where, hash=False))
    threads = args.workers * args.threads_per_worker

    def sharded():
        return pd.sharded_attention(
            q,
            k_shards,
            v_shards,
            client=client,
            is_causal=True,
            query_blocks=shards,
            threads_per_task=args.threads_per_worker,
        )

    def single():
        return pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=threads)

    rows = []
    times = {}
    for _ in range(args.rounds):  # alternating: a slow spell hits both alike
        for name, fn in (("single process", single), ("sharded", sharded)):
            med, low, out = timed(fn, args.runs)
            times.setdefault(name, []).append((med, low, out))
    flops = 4 * h * dim * length * (length + 1) / 2
    reference = times["single process"][-1][2]
    for name in ("single process", "sharded"):
        med = float(np.median([t[0] for t in times[name]]))
        low = min(t[1] for t in times[name])
        err = float(np.abs(times[name][-1][2] - reference).max())
        rows.append(
            {
                "row": f"prefill 1x{h}x{length}x{dim} causal",
                "how": name,
                "ms": med * 1e3,
                "min_ms": low * 1e3,
                "gflops": flops / med / 1e9,
                "max_err": err,
            }
        )
    rows[1]["vs_single"] = rows[1]["ms"] / rows[0]["ms"]
    rows[1]["overhead_ms"] = rows[1]["ms"] - rows[0]["ms"]
    return rows


def decode_rows(pyattn, pd, client, args, rng, length):
    hq, hk, dim = 32, 8, 128
    threads = args.workers * args.threads_per_worker
    per_shard = -(-length // args.workers)
    sharded = pd.ShardedKVCache(client, args.workers, 1, hk, dim, per_shard, threads_per_task=args.threads_per_worker)
    single = pyattn.KVCache(1, hk, dim, length)
    chunk = 8192
    for t in range(0, length - 1, chunk):
        n = min(chunk, length - 1 - t)
        k = rng.standard_normal((1, hk, n, dim), dtype=np.float32)
        v = rng.standard_normal((1, hk, n, dim), dtype=np.float32)
        sharded.append(k, v)
        single.append(k, v)
    k = rng.standard_normal((1, hk, 1, dim), dtype=np.float32)
    v = rng.standard_normal((1, hk, 1, dim), dtype=np.float32)
    sharded.append(k, v)
    single.append(k, v)
    q = rng.standard_normal((1, hq, 1, dim), dtype=np.float32)
    # What one worker computes: its shard (the last one, which holds the new token), on its threads.
    shard = pyattn.KVCache(1, hk, dim, per_shard)
    tail = length - (args.workers - 1) * per_shard
    shard.append(single.keys()[:, :, length - tail : length - 1], single.values()[:, :, length - tail : length - 1])
    shard.append(single.keys()[:, :, length - 1 :], single.values()[:, :, length - 1 :])
    times = {}
    for _ in range(args.rounds):
        for name, fn in (
            ("single process", lambda: single.attend(q, num_threads=threads)),
            ("sharded", lambda: sharded.attend(q)),
            ("one shard, in process", lambda: shard.attend(q, num_threads=args.threads_per_worker)),
            ("empty actor round trip", sharded.shard_lengths),
        ):
            med, low, out = timed(fn, args.decode_runs)
            times.setdefault(name, []).append((med, low, out))
    reference = times["single process"][-1][2]
    rows = []
    for name in ("single process", "sharded", "one shard, in process", "empty actor round trip"):
        med = float(np.median([t[0] for t in times[name]]))
        low = min(t[1] for t in times[name])
        out = times[name][-1][2]
        rows.append(
            {
                "row": f"decode 1x{hq}x1x{dim} Hkv{hk} S={length}",
                "how": name,
                "ms": med * 1e3,
                "min_ms": low * 1e3,
                "gflops": None if name.startswith(("empty", "one")) else 4 * hq * dim * length / med / 1e9,
                "max_err": None if name.startswith(("empty", "one")) else float(np.abs(out - reference).max()),
            }
        )
    rows[1]["vs_single"] = rows[1]["ms"] / rows[0]["ms"]
    rows[1]["overhead_ms"] = rows[1]["ms"] - rows[0]["ms"]
    # Beyond the slowest shard's own work: scheduling, transfer and the merge.
    rows[2]["overhead_ms"] = rows[1]["ms"] - rows[2]["ms"]
    return rows


COLUMNS = [
    Column("row", 34, False),
    Column("how", 22, False),
    Column("ms", 8),
    Column("min ms", 8),
    Column("GFLOP/s", 8),
    Column("vs single", 9),
    Column("overhead ms", 11),
    Column("max err", 8),
]


def cells(r):
    return [
        r["row"],
        r["how"],
        fmt_ms(r["ms"]),
        fmt_ms(r["min_ms"]),
        fmt(r.get("gflops"), ".1f"),
        fmt(r.get("vs_single"), ".2f"),
        fmt(r.get("overhead_ms"), ".2f"),
        fmt(r.get("max_err"), ".1e"),
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=65536)
    p.add_argument("--decode-lens", default="65536,262144", help="comma-separated cache lengths")
    p.add_argument("--rounds", type=int, default=2, help="alternating timing rounds")
    p.add_argument("--runs", type=int, default=1, help="timed prefill calls per round")
    p.add_argument("--decode-runs", type=int, default=30, help="timed decode steps per round")
    p.add_argument("--quick", action="store_true", help="small shapes, one round: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prefill_len, args.heads, args.decode_lens, args.rounds, args.decode_runs = 4096, 4, "8192", 1, 10
    args.decode_lens = [int(x) for x in args.decode_lens.split(",") if x]
    return args


def main(argv=None):
    args = parse_args(argv)
    pyattn = import_pyattn(None, "bench_distributed")
    try:
        from distributed import Client, LocalCluster

        import pyattn.distributed as pd
    except ImportError as exc:
        sys.exit(f'bench_distributed: needs Dask ({exc}); pip install ".[dask]"')
    rng = np.random.default_rng(args.seed)
    print(f"pyattn bench_distributed   {now_iso()}")
    print(f"pyattn {pyattn.__version__}: isa={pyattn.get_isa()}; {os.cpu_count()} logical CPUs")
    print(
        f"LocalCluster: {args.workers} worker processes x {args.threads_per_worker} threads; single process: "
        f"{args.workers * args.threads_per_worker} pyattn threads; rounds {args.rounds}"
    )
    table = Table(COLUMNS)
    print(table.header(), flush=True)
    rows = []
    with (
        LocalCluster(
            n_workers=args.workers,
            threads_per_worker=args.threads_per_worker,
            processes=True,
            host="127.0.0.1",
            scheduler_port=0,
            dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"dashboard": False},
        ) as cluster,
        Client(cluster) as client,
    ):
        for r in prefill_row(pyattn, pd, client, args, rng) if args.prefill_len > 0 else []:
            rows.append(r)
            print(table.add(cells(r)), flush=True)
        for length in args.decode_lens:
            for r in decode_rows(pyattn, pd, client, args, rng, length):
                rows.append(r)
                print(table.add(cells(r)), flush=True)
    if args.markdown:
        print("\n" + table.markdown())
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    bad = [r for r in rows if r.get("max_err") is not None and not r["max_err"] <= 1e-3]
    for r in bad:
        print(f"ERROR: wrong result: {r['row']} {r['how']}: max err {r['max_err']:.3g}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
