# SPDX-License-Identifier: MIT
"""``python -m pyattn explain``: attention worked through by hand on a six-token sentence.

The built-in example is 我用毒毒毒蛇 ("I use poison to poison the poisonous snake"): one character
per token, the three 毒 being a noun ("poison"), a verb ("to poison") and an adjective
("poisonous"). Each token gets a hand-made three-feature embedding (noun, verb, adjective scores;
毒 is ambiguous and gets the same vector all three times) and a single head with hand-made 3 x 3
projections, so the scale is 1/√3. It runs without a mask and with the causal mask and prints every
step. Nothing distinguishes the three 毒 except what the mask lets them see (there are no position
embeddings here), so their outputs are identical without the mask and differ with it.

Own tokens (``--tokens "the cat sat"``): tokens found in the built-in lexicon keep their hand-made
embedding and layer; otherwise each distinct token gets a random embedding of ``--dim`` features
(default 4; numpy's default_rng(``--seed``), drawn in order of first appearance, so identical
tokens share a vector) and a random layer with ``--heads`` heads, unless ``--weights`` gives one.
"""

from __future__ import annotations

import argparse

import numpy as np

from ._explain import explain
from ._explain_render import display_width, plot_heatmaps

SENTENCE = "我用毒毒毒蛇"
FEATURES = ("noun", "verb", "adj")
LEXICON = {  # hand-made (noun, verb, adjective) scores
    "我": (0.9, 0.1, 0.0),  # "I": a pronoun, noun-ish
    "用": (0.1, 1.0, 0.0),  # "use": a verb
    "毒": (0.5, 0.5, 0.5),  # "poison" / "to poison" / "poisonous": all three at once
    "蛇": (1.0, 0.0, 0.2),  # "snake": a noun
}


def demo_weights():
    """The hand-made single-head layer, as a state dict (torch layout: rows = outputs)."""
    seeks = np.array(
        [
            [0.0, 2.0, 2.0],  # "looking for a noun": verbs (objects) and adjectives (what they modify) do
            [2.0, 0.0, 0.0],  # "looking for a verb": nouns (subjects, objects) do
            [1.0, 0.0, 0.0],  # "looking for an adjective": nouns, a little
        ]
    )
    return {
        "q_proj_weight": seeks,
        "k_proj_weight": 2.0 * np.eye(3),  # each key announces its own (noun, verb, adj) scores, doubled
        "v_proj_weight": np.eye(3),  # values pass the scores on, so outputs read as roles in context
        "in_proj_bias": np.zeros(9),
        "out_proj.weight": np.eye(3),
        "out_proj.bias": np.zeros(3),
        "num_heads": 1,
    }


def random_weights(embed_dim, num_heads, seed):
    """A random self-attention layer (state dict) with weights of variance 1/embed_dim."""
    rng = np.random.default_rng(seed)
    std = 1.0 / np.sqrt(embed_dim)
    return {
        "in_proj_weight": rng.normal(0.0, std, (3 * embed_dim, embed_dim)),
        "in_proj_bias": np.zeros(3 * embed_dim),
        "out_proj.weight": rng.normal(0.0, std, (embed_dim, embed_dim)),
        "out_proj.bias": np.zeros(embed_dim),
        "num_heads": num_heads,
    }


def random_embedding(tokens, embed_dim, seed):
    """One standard-normal vector per distinct token (in order of first appearance)."""
    rng = np.random.default_rng(seed)
    vectors = {}
    for token in tokens:
        if token not in vectors:
            vectors[token] = rng.standard_normal(embed_dim)
    return np.array([vectors[token] for token in tokens]).reshape(len(tokens), embed_dim)


def _matrix_lines(name, matrix, row_labels, col_labels):
    width = max(display_width(label) for label in row_labels)
    lines = [f"  {name}" + " " * max(width - len(name), 0) + "".join(f"{c:>7}" for c in col_labels)]
    for label, row in zip(row_labels, matrix):
        lines.append("  " + label + " " * (width - display_width(label)) + "".join(f"{v:7.2f}" for v in row))
    return lines


def _intro():
    rows = ["seeks noun", "seeks verb", "seeks adj"]
    return "\n".join(
        [
            f"Built-in example: {SENTENCE} = 我 I / 用 use / 毒 poison / 毒 to poison / 毒 poisonous / 蛇 snake",
            "Each token is a hand-made embedding of three scores: (noun, verb, adjective). The three 毒",
            "are the same character with the same, ambiguous embedding (0.5, 0.5, 0.5).",
            "One head with hand-made 3x3 projections (rows = outputs, torch layout):",
            *_matrix_lines("Wq", demo_weights()["q_proj_weight"], rows, FEATURES),
            "  Wk = 2·I (a key announces its own scores), Wv = I (values pass them on), Wo = I, no biases.",
            "  head_dim d = 3, so scores are scaled by 1/√3.",
        ]
    )


def _summary(runs):
    """The closing paragraph of the built-in demo, read off the computed numbers."""
    lines = ["", "Why the three 毒 end up different:"]
    for ex in runs:
        positions = [i for i, token in enumerate(ex.tokens) if token == "毒"]
        outputs = ex.output[positions]
        spread = float(np.max(np.abs(outputs - outputs[0])))
        rows = ", ".join("(" + ", ".join(f"{v:.3f}" for v in row) + ")" for row in outputs)
        if ex.is_causal is False:
            verdict = "identical" if spread == 0 else f"different (by up to {spread:.3g})"
            lines.append(f"  Without a mask their outputs are {verdict}: {rows}.")
            if spread == 0:
                lines.append("    Same input and the same keys to look at: same weights over the same values.")
        else:
            seen = ", ".join(str(int(ex.allowed[0, i].sum())) for i in positions)
            on_poison = ", ".join(f"{100 * ex.heads[0].weights[i, positions].sum():.1f}%" for i in positions)
            verdict = "identical" if spread == 0 else f"differ by up to {spread:.3f}"
            lines.append(f"  With the causal mask they see {seen} tokens, and their outputs {verdict}:")
            lines.append(f"    {rows}.")
            lines.append(f"    Each later 毒 also sees the earlier ones: the weight on 毒 keys is {on_poison}.")
            if spread > 0:
                lines.append("    The more weight on 毒, the closer a mix is to 毒's own ambiguous (0.5, 0.5, 0.5).")
    lines.append("  Identical tokens get different outputs only through their context. Here the causal mask is")
    lines.append("  the only thing that tells the three 毒 apart; a real model also adds position information.")
    return "\n".join(lines)


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m pyattn explain",
        description="Print every step of multi-head self-attention on a small example (default: 我用毒毒毒蛇).",
        epilog="Tokens all from the built-in lexicon (我 用 毒 蛇) keep their hand-made (noun, verb, adjective) "
        "embedding and layer. Other tokens get a random embedding of --dim features (default 4) from numpy's "
        "default_rng(--seed), one vector per distinct token, and a random layer with --heads heads, unless "
        "--weights gives the layer (then the embedding size is the layer's).",
    )
    parser.add_argument("--tokens", help='whitespace-separated tokens, e.g. "the cat sat on the mat"')
    parser.add_argument("--dim", type=int, help="embedding size for random embeddings (default 4)")
    parser.add_argument("--heads", type=int, default=1, help="heads of a random layer (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random embeddings and layers (default 0)")
    parser.add_argument("--weights", help=".npz with torch state_dict keys (in_proj_weight, ...) and num_heads")
    causal = parser.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_true", default=None, help="only with the causal mask")
    causal.add_argument("--no-causal", dest="causal", action="store_false", help="only without a mask")
    parser.add_argument("--digits", type=int, default=3, help="decimals in the tables (default 3)")
    parser.add_argument("--plot", metavar="PATH", help="save weight heatmaps (needs matplotlib)")
    return parser


def _load_npz(path, heads):
    with np.load(path) as data:
        weights = {key: data[key] for key in data.files}
    if "num_heads" not in weights:
        weights["num_heads"] = heads
    return weights


def _inputs(args, tokens):
    """(x, layer, hand_made): the embedding and layer the options ask for."""
    layer = _load_npz(args.weights, args.heads) if args.weights else None
    layer_dim = None
    if layer is not None:
        layer_dim = np.shape(layer.get("out_proj.weight", layer.get("out_proj_weight")))[0]
    if all(t in LEXICON for t in tokens) and args.dim is None and layer_dim in (None, 3):
        x = np.array([LEXICON[t] for t in tokens])
        return x, demo_weights() if layer is None else layer, layer is None
    embed_dim = layer_dim or args.dim or 4
    x = random_embedding(tokens, embed_dim, args.seed)
    return x, random_weights(embed_dim, args.heads, args.seed) if layer is None else layer, False


def main(argv=None):
    """Entry point of ``python -m pyattn explain``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    tokens = args.tokens.split() if args.tokens is not None else list(SENTENCE)
    if not tokens:
        parser.error("--tokens: give at least one token")
    modes = [False, True] if args.causal is None else [args.causal]
    try:
        x, layer, hand_made = _inputs(args, tokens)
        runs = [explain(x, layer, tokens=tokens, is_causal=is_causal) for is_causal in modes]
    except (OSError, KeyError, TypeError, ValueError) as error:
        parser.error(str(error))

    full_demo = hand_made and tokens == list(SENTENCE)
    if full_demo:
        print(_intro())
    elif hand_made:
        print("Hand-made (noun, verb, adjective) embeddings and layer of the built-in example (see --help).")
    for ex in runs:
        banner = "WITH THE CAUSAL MASK" if ex.is_causal else "WITHOUT A MASK"
        print(f"\n{'=' * 20} {banner} {'=' * 20}")
        print(ex.to_text(digits=args.digits, feature_names=FEATURES if x.shape[1] == 3 and hand_made else None))
    if full_demo and len(runs) == 2:
        print(_summary(runs))
    if args.plot:
        plot_heatmaps(runs, args.plot, titles=["causal mask" if ex.is_causal else "no mask" for ex in runs])
        print(f"\nSaved the weight heatmaps to {args.plot}")
    return 0
