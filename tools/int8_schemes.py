# SPDX-License-Identifier: MIT
"""Accuracy of int8 KV-cache quantisation schemes on one decode step, in float64 NumPy.

Why pyattn's int8 KVCache keeps one scale per token and head: this script quantises K and V with
each scheme, runs one attention step (32 query heads over 8 KV heads, head_dim 128) against the
dequantised cache and prints the max and RMS error of the output against the unquantised one.

Schemes (symmetric, round to nearest, scale = max |x| / 127 over the group):
  token      one scale per token and head (pyattn's choice: a multiply per key in the kernel);
  q8_0       one scale per block of 32 channels of a token (llama.cpp's Q8_0);
  kivi       K: one scale per channel over groups of 32 tokens, V: per token (KIVI's split).

Data: "gaussian" K/V ~ N(0, 1); "outliers" K with 4 of 128 channels 15x larger (the channel
outliers of real models' keys, which per-channel K scales are meant for), V ~ N(0, 1).

Run: python tools/int8_schemes.py [--tokens 4096] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np


def quantise(x, axis_groups):
    """x (..., n) dequantised after int8 quantisation with one scale per group; axis_groups reshapes
    x so that each group is the last axis."""
    g = axis_groups(x)
    scale = np.abs(g).max(axis=-1, keepdims=True) / 127.0
    q = np.clip(np.rint(np.divide(g, scale, out=np.zeros_like(g), where=scale > 0)), -127, 127)
    return q * scale


def per_token(x):
    return quantise(x, lambda a: a)


def q8_0(x):
    d = x.shape[-1]
    return quantise(x.reshape(*x.shape[:-1], d // 32, 32), lambda a: a).reshape(x.shape)


def per_channel_groups(x, group=32):
    """K (heads, S, D): one scale per (head, channel, group of `group` tokens)."""
    h, s, d = x.shape
    pad = (-s) % group
    xp = np.concatenate([x, np.zeros((h, pad, d))], axis=1) if pad else x
    g = xp.reshape(h, -1, group, d).transpose(0, 1, 3, 2)  # (h, groups, d, group)
    deq = quantise(g, lambda a: a).transpose(0, 1, 3, 2).reshape(h, -1, d)
    return deq[:, :s]


def attend(q, k, v):
    """One query token per head: q (Hq, D), k/v (Hk, S, D) -> (Hq, D), GQA groups."""
    group = q.shape[0] // k.shape[0]
    kk, vv = np.repeat(k, group, 0), np.repeat(v, group, 0)
    s = np.einsum("hd,hsd->hs", q, kk) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hs,hsd->hd", p, vv)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    hq, hk, d, s = 32, 8, 128, args.tokens
    print(f"one decode step, {hq} query heads over {hk} KV heads, head_dim {d}, {s} tokens; |out - exact|")
    print(f"{'data':10} {'scheme':8} {'max err':>9} {'rms err':>9}")
    for data in ("gaussian", "outliers"):
        k = rng.standard_normal((hk, s, d))
        v = rng.standard_normal((hk, s, d))
        if data == "outliers":
            k[:, :, rng.choice(d, 4, replace=False)] *= 15.0
        q = rng.standard_normal((hq, d))
        exact = attend(q, k, v)
        schemes = {
            "token": (per_token(k), per_token(v)),
            "q8_0": (q8_0(k), q8_0(v)),
            "kivi": (per_channel_groups(k), per_token(v)),
        }
        for name, (kq, vq) in schemes.items():
            err = attend(q, kq, vq) - exact
            print(f"{data:10} {name:8} {np.abs(err).max():9.2e} {np.sqrt((err**2).mean()):9.2e}")


if __name__ == "__main__":
    main()
