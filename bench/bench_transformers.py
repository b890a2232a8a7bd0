# SPDX-License-Identifier: MIT
"""Benchmark pyattn inside Hugging Face transformers models, end to end: ``attn_implementation="pyattn"``
(``pyattn.integrations.transformers``) against transformers' own ``"sdpa"`` and ``"eager"``.

Run (from the repository root, with pyattn, torch and transformers installed)::

    python bench/bench_transformers.py                 # all groups, full size: tens of minutes on 2 cores
    python bench/bench_transformers.py --quick         # CI smoke: tiny models, < 60 s
    python bench/bench_transformers.py --groups llama --dtypes float32 --impls sdpa --markdown --json out.json

Models are built offline from a config (``AutoConfig.for_model`` + ``AutoModelForCausalLM`` /
``AutoModel.from_config``: random weights drawn after ``torch.manual_seed(--seed)``, nothing is
downloaded), put in ``.eval()`` and run under ``torch.inference_mode()``. Each model is built once and
the implementations run on that same instance, switched with ``model.set_attn_implementation(name)``.

Groups:

* llama: a Llama-style decoder, hidden 1024, 16 heads, 4 KV heads (head_dim 64, grouped-query),
  4 layers, intermediate 2816, vocab 32000, in each of ``--dtypes`` (float32, then the same weights
  ``model.to(torch.bfloat16)``):
  prefill: one forward of batch 1 and ``--llama-lengths`` tokens (512, 2048, 8192), ``use_cache=False``,
  ``logits_to_keep`` = KEEP_POSITIONS positions spread from the first token to the last (the LM head
  stays small; the first and middle positions check what the last alone hides, e.g. a causal diagonal
  off by one, which the last token sees only diluted through the later layers);
  decode: ``--decode-steps`` (32) cached single-token steps after a ``--context`` (4096) token prefill
  into a ``DynamicCache`` (the prefill is not timed; every timed run crops the cache back to the
  context first). Each step is one forward of one token plus the greedy argmax of its logits, as
  ``generate(do_sample=False)`` makes it, but the tokens fed are fixed (drawn with the seed) rather than
  the argmax: every implementation then computes the same steps, and their logits can be compared
  even where a near-tie would send greedy decoding down different paths (the cost is the same);
* gemma2: a Gemma 2-style decoder, hidden 1024, 8 heads, 4 KV heads, head_dim 128, 4 layers,
  intermediate 4096, vocab 32000, ``attn_logit_softcapping=50``, ``sliding_window=4096``, sliding
  and full layers alternating (the config's default ``layer_types``); prefill of ``--gemma2-lengths``
  (4096) tokens, float32, as llama's prefill. transformers refuses "sdpa" for Gemma 2 (no softcap):
  its row says so and shows "-". Note: Gemma 2's window lets query q see keys kv > q - 4096, so at
  4096 tokens it covers every key and the sliding layers compute what the full ones do; pass
  ``--gemma2-lengths 8192`` to make it cut (--quick uses a 64-token window on 128 tokens: it cuts);
* bert: a BERT-base-shaped encoder (hidden 768, 12 heads, 12 layers, intermediate 3072) on a padded
  batch of 8 sentences whose lengths are drawn uniform in 64..512 with the fixed seed BERT_LENGTH_SEED
  (a fixed shape, whatever --seed draws for the tokens), padded to the longest, ``attention_mask``
  marking the padding; compared: ``last_hidden_state`` on the real tokens (there are no logits).

``--quick``: 2 layers, hidden 256, 4 heads of 64 (llama: 2 KV heads), vocab 1000; llama prefill 128
tokens and 8 decode steps after 256; gemma2 128 tokens with a 64-token window; bert 2 sentences of
16..128 tokens; 2 timed runs per implementation. For CI: it fails (exit status 1) on a wrong result.

Implementations (``--impls``, compared with pyattn): "sdpa" (transformers' torch SDPA path) and
"eager" (matmul, mask, softmax, matmul). Eager materialises batch x heads x L x S float32 softmax
probabilities (bfloat16 models too: it takes the softmax in float32); where those would pass
``--eager-limit`` GiB (2; llama's 16 x 8192 x 8192 is 4 GiB) it is skipped and its row shows "-".

Timing: the implementations of a case are timed by ``time_interleaved``: for each, a warm-up call then
blocks of back-to-back calls, ``--rounds`` alternating blocks per implementation, samples pooled, so a
slow spell of the shared machine hits each alike. ms = median (decode: per step, the median run over
the steps), min ms = fastest; tok/s = tokens per second (prefill: the prompt's tokens; bert: the real
tokens; decode: generated tokens); x = ms / pyattn's ms (> 1: pyattn is faster). torch gets
``--threads`` threads (``torch.set_num_threads``) and so does pyattn (``pyattn.set_num_threads``).

Attention share: while a case is timed, the attention functions are wrapped by timers (the entries of
``transformers.AttentionInterface._global_mapping`` and the model modules' ``eager_attention_forward``,
through which the models call them), and so are the mask builders (``AttentionMaskInterface``'s
entries); attn% and mask% = the perf_counter time spent in them / the wall time of the same calls
(every timed call, pooled: one call alone is at the mercy of one slow spell; the warm-up call, with
its first-call costs, is left out). A wrapper costs well under a microsecond per call; all are
restored after the case.

Most of a full run's time goes to bfloat16 where the CPU has no bfloat16 arithmetic (PyTorch then
emulates its bfloat16 matrix products); ``--dtypes float32`` leaves it out.

Errors: max diff = max |output - reference output| on the same run's output (logits or hidden states,
as float32), the reference being eager's, or sdpa's where eager is skipped ("vs" names it; the
reference row says "ref"). The outputs are O(1) with these random weights. A pyattn row above the
tolerance, NaN, or an exception fails the run (exit status 1); another implementation above it is
only noted. Tolerances, absolute: float32 TOL_FLOAT32 = 1e-3, bfloat16 TOL_BFLOAT16 = 0.25 (bfloat16
keeps 8 bits of mantissa). Both sit far below what a broken mask does to the prefill logits (a lost
causal mask or window, a diagonal off by one: O(1) changes, caught in both dtypes); on a decode row a
diagonal off by one changes the logits far less, and only the float32 tolerance catches it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from _common import (
    BUSY_WARN_CPUS,
    BackgroundLoad,
    Column,
    Table,
    TimingDefaults,
    add_common_arguments,
    cpu_model,
    finish_run,
    fmt,
    fmt_ms,
    import_pyattn,
    limit_peer_isa,
    now_iso,
    print_peer_isa,
    resolve_common_arguments,
    time_interleaved,
    wait_for_idle,
)

IMPLS = ("pyattn", "sdpa", "eager")
GROUPS = ("llama", "gemma2", "bert")
DTYPES = ("float32", "bfloat16")
KEEP_POSITIONS = 8  # prefill: logits of this many positions, spread from the first token to the last
BERT_LENGTH_SEED = 53  # sentence lengths: a fixed shape, whatever --seed draws for the tokens
TOL_FLOAT32 = 1e-3  # max |logits - reference| above which a pyattn row is a wrong result
TOL_BFLOAT16 = 0.25
EAGER_LIMIT_GIB = 2.0  # default --eager-limit
ROW_RETRIES = 2  # with --wait-idle: redo a case disturbed by other processes at most this often
TIMING = TimingDefaults(min_time=3.0, min_runs=3, quick_min_runs=2)  # --min-time / --min-runs
ENV_RECORDED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYATTN_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


@dataclass(frozen=True)
class Sizes:
    """The models and problem sizes of one run (default or --quick)."""

    llama: dict
    llama_lengths: tuple[int, ...]
    context: int
    decode_steps: int
    gemma2: dict
    gemma2_lengths: tuple[int, ...]
    bert: dict
    sentences: int
    min_sentence: int
    max_sentence: int


FULL = Sizes(
    llama=dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=4,
        intermediate_size=2816,
        vocab_size=32000,
    ),
    llama_lengths=(512, 2048, 8192),
    context=4096,
    decode_steps=32,
    gemma2=dict(
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        num_hidden_layers=4,
        intermediate_size=4096,
        vocab_size=32000,
        attn_logit_softcapping=50.0,
        sliding_window=4096,
    ),
    gemma2_lengths=(4096,),
    bert=dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072),
    sentences=8,
    min_sentence=64,
    max_sentence=512,
)
QUICK = Sizes(
    llama=dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        intermediate_size=704,
        vocab_size=1000,
    ),
    llama_lengths=(128,),
    context=256,
    decode_steps=8,
    gemma2=dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        intermediate_size=512,
        vocab_size=1000,
        attn_logit_softcapping=50.0,
        sliding_window=64,
    ),
    gemma2_lengths=(128,),
    bert=dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=2, intermediate_size=1024, vocab_size=1000),
    sentences=2,
    min_sentence=16,
    max_sentence=128,
)


# ----------------------------------------------------------------------------------------------
# Models and switching implementations


def build_model(kind: str, overrides: dict, max_positions: int, seed: int):
    """A randomly initialised model of `kind` (a transformers model type), .eval(), eager attention."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    settings = dict(overrides)
    if kind != "bert":
        settings["max_position_embeddings"] = max(max_positions, 8192)
    config = AutoConfig.for_model(kind, **settings)
    torch.manual_seed(seed)
    auto = AutoModel if kind == "bert" else AutoModelForCausalLM
    return auto.from_config(config, attn_implementation="eager").eval()


class Clock:
    """Seconds spent per implementation: 'wall' in the timed callables (clocked), 'attn' in the
    attention functions and 'mask' in the mask builders they called (attention_timers), charged to
    `current`, the implementation whose calls are running. The first call of each implementation
    (time_interleaved's warm-up: first-call costs such as lazy imports) is not counted."""

    def __init__(self, impls):
        self.spent = {impl: {"wall": 0.0, "attn": 0.0, "mask": 0.0} for impl in impls}
        self.calls = dict.fromkeys(impls, 0)
        self.current = None

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.spent[self.current][key] += seconds

    def timed(self, fn, key: str):
        """fn wrapped so that its time is charged to `key` of the current implementation."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)

        return wrapper

    def clocked(self, fn, impl: str):
        """The timed callable of impl: fn, its wall time counted from its second call on."""

        @functools.wraps(fn)
        def run():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.calls[impl] += 1
                if self.calls[impl] == 1:
                    self.spent[impl] = dict.fromkeys(self.spent[impl], 0.0)
                else:
                    self.spent[impl]["wall"] += time.perf_counter() - t0

        return run

    @contextlib.contextmanager
    def using(self, model, impl: str):
        """Context: the model runs with attention implementation `impl`, its time charged to impl."""
        model.set_attn_implementation(impl)
        self.current = impl
        try:
            yield
        finally:
            self.current = None


def forward_parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def cache_keyword(model) -> str:
    """The forward keyword of the KV cache: 'cache' in recent transformers, else 'past_key_values'."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


@contextlib.contextmanager
def attention_timers(model, clock: Clock):
    """Context: the registered attention functions (AttentionInterface's global mapping, the model
    modules' eager_attention_forward) and mask builders (AttentionMaskInterface's global mapping)
    wrapped by clock.timed ('attn', 'mask'); every one is restored on exit."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    patches = []  # (setter, original, key)
    mappings = ((AttentionInterface._global_mapping, "attn"), (AttentionMaskInterface._global_mapping, "mask"))
    for mapping, key in mappings:
        for name in IMPLS:
            if name in mapping:
                patches.append((functools.partial(mapping.__setitem__, name), mapping[name], key))
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        if callable(getattr(module, "eager_attention_forward", None)):
            setter = functools.partial(setattr, module, "eager_attention_forward")
            patches.append((setter, module.eager_attention_forward, "attn"))
    try:
        for setter, original, key in patches:
            setter(clock.timed(original, key))
        yield
    finally:
        for setter, original, _ in reversed(patches):
            setter(original)


# ----------------------------------------------------------------------------------------------
# Cases: one problem, every implementation


@dataclass
class Case:
    """One table row per implementation. `prepare(impl)`, called with the model switched to impl,
    returns the zero-argument callable timed (its result: the float32 output compared across
    implementations). `scores` = elements of eager's softmax (batch x heads x L x S)."""

    label: str
    tokens: int  # tokens per call, for tok/s
    steps: int  # ms is per step: decode steps per call, else 1
    tol: float
    scores: int
    prepare: Callable[[str], Callable[[], object]]
    skipped: dict[str, str] = field(default_factory=dict)


def keep_positions(length: int):
    """logits_to_keep: KEEP_POSITIONS positions from 0 to length - 1 (a 1-D tensor of positions)."""
    import torch

    return torch.unique(torch.linspace(0, length - 1, min(KEEP_POSITIONS, length)).round().long())


def prefill_case(model, length: int, tol: float, gen, label: str) -> Case:
    """One forward of `length` random tokens, batch 1, logits of keep_positions (all of them when the
    model takes no logits_to_keep)."""
    import torch

    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, length), generator=gen)
    extra = {"logits_to_keep": keep_positions(length)} if "logits_to_keep" in forward_parameters(model) else {}

    def prepare(impl):
        def run():
            return model(input_ids=ids, use_cache=False, **extra).logits.float()

        return run

    return Case(label, length, 1, tol, config.num_attention_heads * length * length, prepare)


def decode_case(model, context: int, steps: int, tol: float, gen) -> Case:
    """`steps` cached single-token steps after a `context`-token prefill into a DynamicCache (prefill
    once per implementation, untimed; each timed run crops the cache back to `context` first)."""
    import torch
    from transformers import DynamicCache

    config = model.config
    prompt = torch.randint(0, config.vocab_size, (1, context), generator=gen)
    tokens = torch.randint(0, config.vocab_size, (steps, 1, 1), generator=gen)
    keyword = cache_keyword(model)

    def prepare(impl):
        cache = DynamicCache(config=config)
        model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{keyword: cache})

        def run():
            extra = cache.get_seq_length() - context
            if extra > 0:
                cache.crop(-extra)  # negative: remove that many tokens (transformers >= 5)
            logits = []
            for token in tokens:
                step = model(input_ids=token, use_cache=True, **{keyword: cache}).logits[:, -1]
                step.argmax(dim=-1)  # the greedy pick, as generate(do_sample=False) computes it
                logits.append(step)
            return torch.cat(logits).float()

        return run

    label = f"decode {context}+{steps}"
    return Case(label, steps, steps, tol, config.num_attention_heads * context * context, prepare)


def bert_lengths(sizes: Sizes) -> np.ndarray:
    rng = np.random.default_rng(BERT_LENGTH_SEED)
    return rng.integers(sizes.min_sentence, sizes.max_sentence, size=sizes.sentences, endpoint=True)


def bert_case(model, sizes: Sizes, gen) -> Case:
    """The padded batch of bert_lengths; output: last_hidden_state on the real tokens."""
    import torch

    lengths = torch.from_numpy(bert_lengths(sizes))
    longest = int(lengths.max())
    mask = torch.arange(longest)[None, :] < lengths[:, None]  # True at real tokens
    ids = torch.randint(0, model.config.vocab_size, (lengths.numel(), longest), generator=gen) * mask
    attention_mask = mask.long()

    def prepare(impl):
        def run():
            return model(input_ids=ids, attention_mask=attention_mask).last_hidden_state[mask].float()

        return run

    label = f"B{lengths.numel()} T{int(lengths.sum())} Lmax{longest}"
    scores = lengths.numel() * model.config.num_attention_heads * longest * longest
    return Case(label, int(lengths.sum()), 1, TOL_FLOAT32, scores, prepare)


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def run_case(model, case: Case, args) -> list[dict]:
    """Time the implementations of `case` interleaved on `model`, with their attention functions and
    mask builders timed meanwhile (attention_timers), and compare their outputs with the reference
    (eager, else sdpa); one row per implementation, in args.impls' order."""
    limit = args.eager_limit * 2**30
    if "eager" in args.impls and case.scores * 4 > limit:
        case.skipped["eager"] = f"skipped: its float32 softmax would take {case.scores * 4 / 2**30:.3g} GiB"
    fns, failed = {}, {}
    for impl in args.impls:
        if impl in case.skipped:
            continue
        try:
            model.set_attn_implementation(impl)
        except (ValueError, ImportError, KeyError) as exc:
            case.skipped[impl] = f"refused by transformers: {str(exc).splitlines()[0][:120].strip()}"
            continue
        try:
            fns[impl] = case.prepare(impl)
        except Exception as exc:  # noqa: BLE001  (reported in the row; a pyattn failure fails the run)
            failed[impl] = exc
    clock = Clock(fns)
    with attention_timers(model, clock):
        timed = time_interleaved(
            {impl: clock.clocked(fn, impl) for impl, fn in fns.items()},
            rounds=args.rounds,
            min_time=args.min_time,
            min_runs=args.min_runs,
            contexts={impl: functools.partial(clock.using, model, impl) for impl in fns},
        )
    timed.update(failed)
    outputs = {impl: result[1] for impl, result in timed.items() if not isinstance(result, Exception)}
    ref = next((impl for impl in ("eager", "sdpa") if impl in outputs), None)
    mine = timed.get("pyattn")
    pyattn_timing = mine[0] if isinstance(mine, tuple) else None
    rows = []
    for impl in args.impls:
        row = {"case": case.label, "impl": impl, "tokens": case.tokens, "steps": case.steps, "tolerance": case.tol}
        result = timed.get(impl)
        if impl in case.skipped:
            row["skipped"] = case.skipped[impl]
        elif isinstance(result, Exception):
            row["error"] = f"{type(result).__name__}: {result}"
            print(f"  ERROR: {impl} failed on {case.label}:", file=sys.stderr)
            traceback.print_exception(result, file=sys.stderr)
        else:
            t = result[0]
            row.update(
                ms=t.median / case.steps * 1e3,
                min_ms=t.min / case.steps * 1e3,
                runs=t.runs,
                tok_s=case.tokens / t.median,
                x=t.median / pyattn_timing.median if pyattn_timing else None,
                attn_pct=100 * clock.spent[impl]["attn"] / clock.spent[impl]["wall"],
                mask_pct=100 * clock.spent[impl]["mask"] / clock.spent[impl]["wall"],
            )
            if impl == ref:
                row["diff_vs"] = "ref"
            elif ref is not None:
                row["max_diff"], row["diff_vs"] = max_diff(outputs[impl], outputs[ref]), ref
        rows.append(row)
    del outputs, fns, timed
    gc.collect()
    return rows


def run_case_guarded(model, case: Case, args) -> list[dict]:
    """run_case under a BackgroundLoad monitor; with --wait-idle, wait for idle CPUs first and redo a
    case that other processes disturbed (at most ROW_RETRIES times)."""
    attempts = 1 + (ROW_RETRIES if args.wait_idle > 0 else 0)
    for attempt in range(1, attempts + 1):
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        with BackgroundLoad() as load:
            rows = run_case(model, case, args)
        for row in rows:
            row["background_cpus"], row["attempts"] = load.cpus, attempt
        if load.cpus is None or load.cpus <= BUSY_WARN_CPUS:
            break
        action = "redoing the case" if attempt < attempts else "keeping it"
        print(f"  note: {case.label}: other processes used {load.cpus:.1f} CPUs; {action}", file=sys.stderr)
    return rows


# ----------------------------------------------------------------------------------------------
# Groups: each yields (table key, title, model, cases, dtype) per table; the model is built once per group


def llama_tables(sizes: Sizes, args, gen):
    import torch

    longest = max([*args.llama_lengths, args.context + args.decode_steps])
    model = build_model("llama", sizes.llama, longest, args.seed)
    c = model.config
    shape = (
        f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads / "
        f"{c.num_key_value_heads} KV heads of {c.head_dim}, vocab {c.vocab_size}"
    )
    for dtype in args.dtypes:
        model.to(getattr(torch, dtype))
        tol = TOL_FLOAT32 if dtype == "float32" else TOL_BFLOAT16
        cases = [prefill_case(model, n, tol, gen, f"prefill {n}") for n in args.llama_lengths]
        if args.context > 0 and args.decode_steps > 0:
            cases.append(decode_case(model, args.context, args.decode_steps, tol, gen))
        title = (
            f"llama {dtype}: {shape}; batch 1; prefill: logits of {KEEP_POSITIONS} positions; decode: "
            "DynamicCache, ms and min ms per step, tok/s = generated tokens/s"
        )
        yield f"llama_{dtype}", title, model, cases, dtype


def gemma2_tables(sizes: Sizes, args, gen):
    model = build_model("gemma2", sizes.gemma2, max(args.gemma2_lengths), args.seed)
    c = model.config
    window = c.sliding_window
    cases = [prefill_case(model, n, TOL_FLOAT32, gen, f"prefill {n} w{window}") for n in args.gemma2_lengths]
    layers = "/".join("s" if t == "sliding_attention" else "f" for t in c.layer_types)
    title = (
        f"gemma2 float32: {c.num_hidden_layers} layers ({layers}: sliding/full), hidden {c.hidden_size}, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads of {c.head_dim}, softcap "
        f"{c.attn_logit_softcapping:g}, sliding_window {window}; batch 1, logits of {KEEP_POSITIONS} positions"
    )
    yield "gemma2", title, model, cases, "float32"


def bert_tables(sizes: Sizes, args, gen):
    model = build_model("bert", sizes.bert, sizes.max_sentence, args.seed)
    c = model.config
    case = bert_case(model, sizes, gen)
    title = (
        f"bert float32: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads; "
        f"padded batch, lengths {sizes.min_sentence}..{sizes.max_sentence} (seed {BERT_LENGTH_SEED}); "
        "compared: last_hidden_state on real tokens; tok/s = real tokens/s"
    )
    yield "bert", title, model, [case], "float32"


BUILDERS = {"llama": llama_tables, "gemma2": gemma2_tables, "bert": bert_tables}


# ----------------------------------------------------------------------------------------------
# Tables and summary


COLUMNS = (
    Column("case", 20, right=False),
    Column("impl", 6, right=False),
    Column("ms", 7),
    Column("min ms", 7),
    Column("tok/s", 7),
    Column("x", 5),
    Column("max diff", 8),
    Column("vs", 7, right=False),
    Column("attn%", 5),
    Column("mask%", 5),
    Column("bg", 3),
)


def absent(row: dict) -> str:
    """Why a row has no timing: 'failed', 'refused' (by transformers) or 'skipped' (eager's memory)."""
    return "failed" if "error" in row else row.get("skipped", "-").split(" ")[0].rstrip(":")


def cells(row: dict) -> list[str]:
    if "ms" not in row:
        bg = fmt(row.get("background_cpus"), ".1f")
        return [row["case"], row["impl"], "-", "-", "-", "-", "-", absent(row), "-", "-", bg]
    tok_s = row["tok_s"]
    return [
        row["case"],
        row["impl"],
        fmt_ms(row["ms"]),
        fmt_ms(row["min_ms"]),
        fmt(tok_s, ".0f" if tok_s >= 10 else ".2f"),
        fmt(row.get("x"), ".2f"),
        fmt(row.get("max_diff"), ".1e"),
        row.get("diff_vs", "-"),
        fmt(row.get("attn_pct"), ".0f"),
        fmt(row.get("mask_pct"), ".0f"),
        fmt(row.get("background_cpus"), ".1f"),
    ]


def summary_lines(results: dict) -> list[str]:
    """Per case: pyattn's speedup over each implementation (their ms / pyattn's) and its tok/s."""
    lines = []
    for key, rows in results.items():
        by_case: dict[str, dict[str, dict]] = {}
        for row in rows:
            by_case.setdefault(row["case"], {})[row["impl"]] = row
        for case, impls in by_case.items():
            mine = impls.get("pyattn", {})
            parts = [f"pyattn {fmt(mine.get('tok_s'), '.1f')} tok/s"]
            for other in ("sdpa", "eager"):
                row = impls.get(other)
                if row is not None:
                    x = row.get("x")
                    parts.append(f"{other} {fmt(x, '.2f')}x" if x is not None else f"{other} {absent(row)}")
            lines.append(f"{key.replace('_', ' ')} {case}: " + ", ".join(parts))
    return lines


def wrong_results(results: dict) -> tuple[list[str], list[str]]:
    """(pyattn rows that failed or passed their tolerance: they fail the run, other rows that did)."""
    bad, noted = [], []
    for key, rows in results.items():
        for row in rows:
            label = f"{key} {row['case']} {row['impl']}"
            diff = row.get("max_diff")
            if "error" in row:
                message = f"{label}: {row['error']}"
            elif diff is not None and not diff <= row["tolerance"]:  # NaN fails too
                message = f"{label}: max diff {diff:.3g} vs {row['diff_vs']} (tolerance {row['tolerance']:g})"
            else:
                continue
            (bad if row["impl"] == "pyattn" else noted).append(message)
    return bad, noted


# ----------------------------------------------------------------------------------------------
# Command line and header


EPILOG = """environment:
  Threads: --threads sets torch.set_num_threads and pyattn.set_num_threads (OMP_NUM_THREADS and
  MKL_NUM_THREADS are recorded, not needed). With --isa avx2 or generic, PyTorch is kept to that ISA
  too (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) unless --peers-isa native.
  Nothing is downloaded: the models are built from configs with random weights.

exit status:
  1 when a pyattn row failed or its max diff passed its tolerance (float32 {tol32:g}, bfloat16 {tol16:g},
  absolute, on logits / hidden states of size ~1), else 0.
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Time Hugging Face transformers models (random weights) with attn_implementation="pyattn" '
        'against "sdpa" and "eager" on the same model instance: prefill, cached decode and a padded encoder '
        "batch, with each output's max difference from eager's and the share of time spent in attention.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(tol32=TOL_FLOAT32, tol16=TOL_BFLOAT16),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test for CI: tiny models (2 layers, hidden 256), 128-token prefill, 8 decode steps after 256, "
        "2 BERT sentences, 2 timed runs (< 60 s); fails on a wrong result like every run",
    )
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of %(default)s")
    parser.add_argument(
        "--impls",
        default="sdpa,eager",
        help="comma-separated implementations compared with pyattn: subset of %(default)s, or 'none' "
        "(then no reference: errors are not checked)",
    )
    parser.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help="llama's dtypes, comma-separated subset of %(default)s (run float32 first; bfloat16 converts the "
        "same weights); gemma2 and bert run float32",
    )
    parser.add_argument(
        "--llama-lengths",
        default=None,
        help=f"llama prefill lengths, comma-separated (default {','.join(map(str, FULL.llama_lengths))}, "
        f"--quick {','.join(map(str, QUICK.llama_lengths))})",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"llama decode: tokens prefilled before the timed steps (default {FULL.context}, --quick "
        f"{QUICK.context}; 0: no decode rows)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help=f"llama decode: single-token steps per timed run (default {FULL.decode_steps}, --quick "
        f"{QUICK.decode_steps}; 0: no decode rows)",
    )
    parser.add_argument(
        "--gemma2-lengths",
        default=None,
        help=f"gemma2 prefill lengths, comma-separated (default {','.join(map(str, FULL.gemma2_lengths))}, "
        f"--quick {','.join(map(str, QUICK.gemma2_lengths))}); the window of {FULL.gemma2['sliding_window']} "
        "cuts only beyond that length",
    )
    parser.add_argument(
        "--eager-limit",
        type=float,
        default=EAGER_LIMIT_GIB,
        metavar="GIB",
        help="skip eager where its float32 softmax (batch x heads x L x S) would pass GIB GiB (default %(default)g)",
    )
    add_common_arguments(
        parser,
        TIMING,
        seed_of="the weights and tokens (the bert lengths have their own fixed seed)",
        wait_idle_help="shared machines: before each case wait up to SECONDS for idle CPUs, and redo a case "
        f"that other processes disturbed (up to {ROW_RETRIES} times; default 0 = only report it)",
        tables="tables",
    )
    args = parser.parse_args(argv)
    resolve_common_arguments(args, parser, TIMING)
    sizes = QUICK if args.quick else FULL
    args.groups = _split(args.groups, GROUPS, parser, "--groups")
    others = [] if args.impls.strip() == "none" else _split(args.impls, IMPLS[1:], parser, "--impls")
    args.impls = ["pyattn", *(i for i in IMPLS[1:] if i in others)]
    dtypes = _split(args.dtypes, DTYPES, parser, "--dtypes")
    args.dtypes = [d for d in DTYPES if d in dtypes]
    args.llama_lengths = _lengths(args.llama_lengths, sizes.llama_lengths, parser, "--llama-lengths")
    args.gemma2_lengths = _lengths(args.gemma2_lengths, sizes.gemma2_lengths, parser, "--gemma2-lengths")
    args.context = sizes.context if args.context is None else args.context
    args.decode_steps = sizes.decode_steps if args.decode_steps is None else args.decode_steps
    if args.context < 0 or args.decode_steps < 0:
        parser.error("--context and --decode-steps must be >= 0")
    if not args.eager_limit > 0:
        parser.error("--eager-limit must be > 0")
    return args


def _split(text: str, allowed: tuple[str, ...], parser, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        parser.error(f"{flag}: unknown {bad}; choose from {list(allowed)}")
    return items


def _lengths(text: str | None, default: tuple[int, ...], parser, flag: str) -> list[int]:
    if text is None:
        return list(default)
    try:
        lengths = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if any(n < 1 for n in lengths):
        parser.error(f"{flag}: lengths must be >= 1")
    return lengths


def print_header(info: dict, args) -> None:
    rt = info["pyattn"]
    print(f"pyattn bench_transformers   {info['date']}")
    print(
        f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs); threads, every library: {info['threads']} "
        "(torch.set_num_threads, pyattn.set_num_threads)"
    )
    print(
        f"pyattn {rt.get('version')}: isa={rt.get('isa')} available={rt.get('available_isas')} "
        f"openmp={rt.get('openmp')} compiler={rt.get('compiler')}"
    )
    print(f"torch {info['torch']} ({info['torch_capability']}); transformers {info['transformers']}")
    print_peer_isa(info["peer_isa_env"])
    busy = info["busy_cpus_before"]
    if busy is not None:
        print(f"background load before the run: {busy:.1f} of {info['logical_cpus']} CPUs busy")
        if busy > BUSY_WARN_CPUS:
            print("WARNING: other processes are using the CPUs; timings will be noisy and slow")
    print(
        f"models: random weights (seed {args.seed}), .eval(), torch.inference_mode(); implementations "
        f"{', '.join(args.impls)} on the same instance (model.set_attn_implementation)"
    )
    print(
        f"ms = median over runs after warm-up (min ms = fastest; decode: per step); {args.rounds} alternating "
        "blocks per implementation, samples pooled"
    )
    print("tok/s = tokens per second (prefill: prompt tokens; bert: real tokens; decode: generated tokens)")
    print("x = ms / pyattn's ms (> 1: pyattn is faster)")
    print(
        "max diff = max|output - reference| on the same run's output (logits; bert: hidden states), reference "
        f"eager, else sdpa ('vs'); tolerance float32 {TOL_FLOAT32:g}, bfloat16 {TOL_BFLOAT16:g}: a pyattn row "
        "above it fails the run"
    )
    print(
        "attn% / mask% = time in the attention functions / in the mask builders, of the timed calls' wall time; "
        f"eager is '-' where its float32 scores would pass {args.eager_limit:g} GiB"
    )
    print(f"bg = CPUs other processes kept busy during the case; > {BUSY_WARN_CPUS} is noisy")
    print()


def main(argv=None) -> int:
    args = parse_args(argv)
    pyattn = import_pyattn(args.isa, "bench_transformers")
    args.peer_env = limit_peer_isa(args.isa, args.peers_isa)  # before torch is imported
    try:
        import torch
        import transformers

        import pyattn.integrations.transformers as integration
    except ImportError as exc:
        sys.exit(f"bench_transformers: needs torch and transformers ({exc}); pip install torch transformers")
    integration.register()
    torch.set_num_threads(args.threads)
    pyattn.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    busy = wait_for_idle(args.wait_idle)
    info = {
        "date": now_iso(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "threads": args.threads,
        "pyattn": dict(pyattn.runtime_info()),
        "torch": torch.__version__,
        "torch_capability": f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "transformers": transformers.__version__,
        "busy_cpus_before": busy,
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "peer_isa_env": args.peer_env,
        "impls": args.impls,
        "dtypes": args.dtypes,
        "llama_lengths": args.llama_lengths,
        "context": args.context,
        "decode_steps": args.decode_steps,
        "gemma2_lengths": args.gemma2_lengths,
        "eager_limit_gib": args.eager_limit,
        "tolerance": {"float32": TOL_FLOAT32, "bfloat16": TOL_BFLOAT16},
        "sizes": sizes.__dict__,
        "quick": args.quick,
        "min_time_s": args.min_time,
        "min_runs": args.min_runs,
        "rounds": args.rounds,
        "seed": args.seed,
    }
    print_header(info, args)

    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    tables: list[tuple[str, Table]] = []
    with torch.inference_mode():
        for group in args.groups:
            gen = torch.Generator().manual_seed(args.seed)
            for key, title, model, cases, dtype in BUILDERS[group](sizes, args, gen):
                table = Table(COLUMNS)
                print(title)
                print(table.header(), flush=True)
                rows = []
                for case in cases:
                    case_rows = run_case_guarded(model, case, args)
                    for row in case_rows:
                        row.update(group=group, dtype=dtype)
                        print(table.add(cells(row)), flush=True)
                        if "skipped" in row:
                            print(f"  note: {row['impl']} {row['skipped']}", file=sys.stderr)
                    rows.extend(case_rows)
                print(flush=True)
                results[key] = rows
                tables.append((title, table))
                del model, cases
            gc.collect()
    elapsed = time.perf_counter() - started

    print("Summary (per case: pyattn's tok/s; each implementation's ms / pyattn's ms: > 1, pyattn is faster):")
    for line in summary_lines(results):
        print(f"  {line}")
    print(f"  wall time of the cases: {elapsed:.1f} s")
    if args.markdown:
        for title, table in tables:
            print(f"\n{title}\n")
            print(table.markdown())
    status = finish_run(info, args.json, results, f"{sum(len(r) for r in results.values())} rows")
    bad, noted = wrong_results(results)
    for line in noted:
        print(f"note: beyond the tolerance (not pyattn): {line}", file=sys.stderr)
    for line in bad:
        print(f"ERROR: wrong pyattn result: {line}", file=sys.stderr)
    return 1 if bad or status else 0


if __name__ == "__main__":
    sys.exit(main())
