# SPDX-License-Identifier: MIT
"""pyattn as a Hugging Face ``transformers`` attention implementation (skipped without torch or transformers).

Tiny randomly initialised models (no network: ``AutoConfig.for_model`` + ``from_config``) run with
``attn_implementation="pyattn"`` and ``"eager"`` on the same weights:

- float32 outputs match on a padded batch (left-padded, right-padded and unpadded rows), for an encoder
  (BERT), plain decoders (GPT-2, Llama, Qwen2) and the features pyattn takes as options: sliding windows
  (Mistral, Gemma 2, gpt-oss), Gemma 2's logit softcap and gpt-oss' attention sinks. Each feature is
  also switched off in the eager model to show it changes the output far beyond the tolerance, so a
  pyattn that ignored it would fail the comparison;
- bfloat16 models are no less accurate with pyattn than with eager, against a float32 reference;
- greedy generation gives the same tokens (and logits) as eager, with dynamic and static caches;
- the mask the attention function receives is the :class:`MaskStructure` the model's request implies
  (prefill and cached decode steps), and requests it does not recognise fall back to a dense mask;
- ``register()``, grouped-query heads without ``repeat_kv``, the inference-only errors;
- ``mask_function`` against ``transformers.masking_utils.sdpa_mask``, request by request.

Outputs are compared at real (non-padding) query positions only: a padding query row is defined
differently by eager (attends to whatever its mask leaves) and pyattn (zeros when nothing is left).
"""

import contextlib
import sys

import numpy as np
import pytest

from conftest import tol

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
integration = pytest.importorskip("pyattn.integrations.transformers")

MaskStructure = integration.MaskStructure
NAME = integration.register()

WINDOW = 8  # sliding window of the windowed models: shorter than every sequence below
VOCAB = 1000
PAD = 0
SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
GQA = dict(SMALL, num_key_value_heads=2)
CONFIGS = {
    "bert": SMALL,
    # scale_attn_by_inverse_layer_idx: the scaling the module passes is not the default 1/sqrt(head_dim)
    "gpt2": dict(
        n_embd=64,
        n_head=4,
        n_layer=2,
        scale_attn_by_inverse_layer_idx=True,
        vocab_size=VOCAB,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama": GQA,
    "qwen2": GQA,
    "mistral": dict(GQA, sliding_window=WINDOW),
    # softcap 5.0 (Gemma 2's own is 50.0): build() scales the scores up to where the cap bends them
    "gemma2": dict(GQA, sliding_window=WINDOW, head_dim=16, attn_logit_softcapping=5.0),
    "gpt_oss": dict(
        GQA, sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64
    ),
}
GQA_MODELS = [name for name, config in CONFIGS.items() if config.get("num_key_value_heads", 4) != 4]

RTOL, ATOL = tol(np.float32)


def build(name, seed=0, attn_implementation="eager", **overrides):
    """A tiny model with random weights, in eval mode."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(name, **{**CONFIGS[name], **overrides})
    auto = transformers.AutoModel if name == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=attn_implementation).eval()
    if name == "gemma2":
        # Random weights give scores far below any softcap (tanh(s / c) * c == s): scale the query and key
        # projections by 16 each, so that scores reach the cap of 5.0.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(16.0)
                layer.self_attn.k_proj.weight.mul_(16.0)
    if name == "gpt_oss":
        # The default init draws the sinks with std 0.02, too small to matter: give them weight.
        for layer in model.model.layers:
            layer.self_attn.sinks.data.copy_(torch.randn(layer.self_attn.sinks.shape) * 1.5)
    return model


def padded_batch(seed=0, length=40, left=7, right=9):
    """input_ids and attention_mask (3, length): a left-padded row, a right-padded row, an unpadded row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, length), generator=generator)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, :left] = 0
    mask[1, length - right :] = 0
    ids[mask == 0] = PAD
    return ids, mask


def output(model, **inputs):
    out = model(**inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def run(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return output(model, **inputs)
    finally:
        model.set_attn_implementation("eager")


def assert_close_at(got, expected, valid):
    torch.testing.assert_close(got[valid], expected[valid], rtol=RTOL, atol=ATOL)


@contextlib.contextmanager
def ablated(model, feature):
    """The eager model without one attention feature (a pyattn that ignored it would compute this)."""
    saved = []
    if feature == "window":
        saved.append((model.config, "sliding_window", model.config.sliding_window))
        model.config.sliding_window = 10_000
    elif feature == "softcap":
        for layer in model.model.layers:
            saved.append((layer.self_attn, "attn_logit_softcapping", layer.self_attn.attn_logit_softcapping))
            layer.self_attn.attn_logit_softcapping = None
    elif feature == "sinks":
        for layer in model.model.layers:
            saved.append((layer.self_attn.sinks, "data", layer.self_attn.sinks.data.clone()))
            layer.self_attn.sinks.data.fill_(float("-inf"))
    else:
        raise AssertionError(feature)
    try:
        yield model
    finally:
        for owner, attribute, value in saved:
            setattr(owner, attribute, value)


FEATURES = {"mistral": ["window"], "gemma2": ["window", "softcap"], "gpt_oss": ["window", "sinks"]}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_eager_on_padded_batch(name):
    model = build(name)
    ids, mask = padded_batch()
    valid = mask.bool()
    expected = run(model, "eager", input_ids=ids, attention_mask=mask)
    got = run(model, NAME, input_ids=ids, attention_mask=mask)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert_close_at(got, expected, valid)

    # The comparison can fail: without the padding (and each option the model uses), eager's result
    # at the same positions moves by far more than the tolerance.
    unpadded = run(model, "eager", input_ids=ids, attention_mask=torch.ones_like(mask))
    assert (unpadded - expected)[valid].abs().max() > 100 * ATOL
    for feature in FEATURES.get(name, []):
        with ablated(model, feature):
            without = run(model, "eager", input_ids=ids, attention_mask=mask)
        assert (without - expected)[valid].abs().max() > 100 * ATOL, feature
    # ablated() restored the model
    torch.testing.assert_close(run(model, "eager", input_ids=ids, attention_mask=mask), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["bert", "llama", "gemma2"])
def test_bfloat16_no_worse_than_eager(name):
    model = build(name)
    ids, mask = padded_batch()
    valid = mask.bool()
    reference = run(model, "eager", input_ids=ids, attention_mask=mask)
    model.to(torch.bfloat16)
    eager = run(model, "eager", input_ids=ids, attention_mask=mask)
    got = run(model, NAME, input_ids=ids, attention_mask=mask)
    assert got.dtype == torch.bfloat16
    slack = 1e-3 * reference[valid].abs().max()
    eager_error = (eager.float() - reference)[valid].abs()
    error = (got.float() - reference)[valid].abs()
    assert error.max() <= 1.5 * eager_error.max() + slack
    rms = lambda e: e.pow(2).mean().sqrt()  # noqa: E731
    assert rms(error) <= 1.5 * rms(eager_error) + slack / 10


def left_padded_prompts(length=20, pad=6, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :pad] = PAD
    mask[0, :pad] = 0
    return ids, mask


def generate(model, implementation, ids, mask, **options):
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                min_new_tokens=32,
                max_new_tokens=32,
                pad_token_id=PAD,
                return_dict_in_generate=True,
                output_logits=True,
                **options,
            )
    finally:
        model.set_attn_implementation("eager")


def check_generate(name, **options):
    model = build(name)
    ids, mask = left_padded_prompts()
    expected = generate(model, "eager", ids, mask, **options)
    got = generate(model, NAME, ids, mask, **options)
    assert expected.sequences.shape == (2, ids.shape[1] + 32)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.logits) == len(expected.logits) == 32
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_greedy_generate_matches_eager(name):
    # 20 prompt tokens + 32 new ones: the windowed models' caches drop keys (WINDOW = 8).
    check_generate(name)


# Llama has no config.layer_types: generate() passes its prebuilt MaskStructure back to the model, whose
# create_causal_mask hands it to the mask function again.
@pytest.mark.parametrize("name", ["gemma2", "llama"])
def test_greedy_generate_static_cache_matches_eager(name):
    model = build(name)
    ids, mask = left_padded_prompts()
    try:
        generate(model, "eager", ids, mask, cache_implementation="static")
    except (ValueError, NotImplementedError) as error:  # pragma: no cover - depends on the transformers version
        pytest.skip(f"transformers does not generate with a static cache here: {error}")
    check_generate(name, cache_implementation="static")


# -- what the attention function receives ------------------------------------------------------------


@pytest.fixture
def calls():
    """Records (layer_idx, query, key, attention_mask) of every call to the registered "pyattn" attention."""
    mapping = transformers.AttentionInterface._global_mapping
    registered = mapping[NAME]
    assert registered is integration.attention_forward
    recorded = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        recorded.append((module.layer_idx, query.shape, key.shape, attention_mask))
        return registered(module, query, key, value, attention_mask, **kwargs)

    mapping[NAME] = spy
    try:
        yield recorded
    finally:
        mapping[NAME] = registered


def sliding_layers(model):
    config = model.config
    if getattr(config, "layer_types", None) is not None:
        return {i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"}
    return set(range(config.num_hidden_layers)) if getattr(config, "sliding_window", None) else set()


def check_structure(model, recorded, mask, q_len, past):
    """Every recorded call is a MaskStructure for `q_len` queries after `past` cached tokens, under the
    2-D padding `mask` (batch, past + q_len), as the model's layer (sliding or full) needs it."""
    config = model.config
    sliding = sliding_layers(model)
    assert sorted(layer for layer, *_ in recorded) == list(range(config.num_hidden_layers))
    for layer, query_shape, key_shape, structure in recorded:
        assert isinstance(structure, MaskStructure), (layer, structure)
        assert query_shape[-2] == q_len
        assert key_shape[1] == config.num_key_value_heads  # grouped-query heads are not repeated
        assert structure.kv_length == key_shape[-2]
        assert structure.causal is True
        if layer in sliding:
            assert structure.window == (config.sliding_window - 1, 0)
            kv_offset = max(past - config.sliding_window + 1, 0)
        else:
            assert structure.window is None
            kv_offset = 0
        assert structure.diagonal == past - kv_offset
        assert key_shape[-2] == past + q_len - kv_offset
        expected_padding = mask[:, kv_offset : past + q_len].bool()
        if expected_padding.all():
            assert structure.padding is None
        else:
            assert structure.padding is not None and structure.padding.dtype == torch.bool
            assert torch.equal(structure.padding, expected_padding)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_structure_prefill_and_decode(calls, name, padded):
    model = build(name, attn_implementation=NAME)
    ids, mask = left_padded_prompts(length=12, pad=3 if padded else 0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        check_structure(model, calls, mask, q_len=ids.shape[1], past=0)
        assert any(s.padding is not None for *_, s in calls) == padded
        cache, past = out.cache, ids.shape[1]
        for _ in range(12):  # decode past the window: the sliding layers' padding goes away
            calls.clear()
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            check_structure(model, calls, mask, q_len=1, past=past)
            past += 1
    if padded:  # the full layers still see the left padding
        assert all(s.padding is not None for layer, *_, s in calls if layer not in sliding_layers(model))


def test_structure_bidirectional_bert(calls):
    model = build("bert", attn_implementation=NAME)
    ids, mask = padded_batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        assert len(calls) == 2
        for _, query_shape, key_shape, structure in calls:
            assert isinstance(structure, MaskStructure)
            assert (structure.causal, structure.window, structure.diagonal) == (False, None, 0)
            assert structure.kv_length == key_shape[-2] == query_shape[-2] == 40
            assert torch.equal(structure.padding, mask.bool())
        calls.clear()
        model(input_ids=ids[2:], attention_mask=mask[2:])
        assert [s.padding for *_, s in calls] == [None, None]


def test_packed_sequences_fall_back_to_dense(calls):
    model = build("llama")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 24), generator=generator)
    starts = [10, 17]  # where each row's second sequence begins
    position_ids = torch.stack([torch.cat([torch.arange(s), torch.arange(24 - s)]) for s in starts])
    inputs = dict(input_ids=ids, position_ids=position_ids, use_cache=False)
    expected = run(model, "eager", **inputs)
    got = run(model, NAME, **inputs)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)

    # transformers detected the packing and built a dense block-causal mask through the fallback
    assert len(calls) == model.config.num_hidden_layers
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    for _, _, _, dense in calls:
        assert isinstance(dense, torch.Tensor) and dense.dtype == torch.bool and dense.shape == (2, 1, 24, 24)
        for row, s in enumerate(starts):
            block = torch.zeros(24, 24, dtype=torch.bool)
            block[:s, :s] = True
            block[s:, s:] = True
            assert torch.equal(dense[row, 0], causal & block)
    # ... which matters: the plain causal result differs
    unpacked = run(model, "eager", input_ids=ids, use_cache=False)
    assert (unpacked - expected).abs().max() > 100 * ATOL


# -- registration, grouped-query heads, errors -------------------------------------------------------


def test_register_is_idempotent():
    attention = transformers.AttentionInterface._global_mapping
    masks = masking_utils.AttentionMaskInterface._global_mapping
    assert integration.register() == "pyattn" == NAME
    first = (attention[NAME], masks[NAME])
    assert integration.register() == "pyattn"
    assert (attention[NAME], masks[NAME]) == first
    assert first == (integration.attention_forward, integration.mask_function)
    assert transformers.AttentionInterface()[NAME] is integration.attention_forward
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[NAME] is integration.mask_function


@pytest.mark.parametrize("name", GQA_MODELS)
def test_gqa_without_repeat_kv(monkeypatch, name):
    model = build(name)
    ids, mask = padded_batch(length=16, left=3, right=4)
    expected = run(model, "eager", input_ids=ids, attention_mask=mask)

    def refuse(*args, **kwargs):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(transformers.integrations.sdpa_attention, "repeat_kv", refuse)
    monkeypatch.setattr(sys.modules[type(model).__module__], "repeat_kv", refuse)
    got = run(model, NAME, input_ids=ids, attention_mask=mask)
    assert_close_at(got, expected, mask.bool())
    with pytest.raises(AssertionError, match="repeat_kv called"):  # the patch reaches the model
        run(model, "eager", input_ids=ids, attention_mask=mask)


def test_training_with_dropout_is_an_error():
    model = build("bert", attn_implementation=NAME, attention_probs_dropout_prob=0.1)
    ids, mask = padded_batch(length=12, left=2, right=3)
    model.train()
    with torch.no_grad(), pytest.raises(ValueError, match=r"model\.eval\(\)"):
        model(input_ids=ids, attention_mask=mask)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)


def test_grad_mode_is_an_error():
    model = build("llama", attn_implementation=NAME)
    ids, mask = padded_batch(length=12, left=2, right=3)
    with pytest.raises(RuntimeError, match=r"inference_mode\(\) or torch\.no_grad\(\)"):
        model(input_ids=ids, attention_mask=mask)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)


# -- mask_function against sdpa_mask ---------------------------------------------------------------


def expand(structure, batch_size, q_length):
    """The dense (batch, q_length, kv_length) bool mask a MaskStructure stands for."""
    i = torch.arange(q_length)[:, None]
    j = torch.arange(structure.kv_length)[None, :]
    diagonal = i + structure.diagonal
    allowed = torch.ones(q_length, structure.kv_length, dtype=torch.bool)
    if structure.causal:
        allowed &= j <= diagonal
    if structure.window is not None:
        left, right = structure.window
        if left is not None:
            allowed &= j >= diagonal - left
        if right is not None:
            allowed &= j <= diagonal + right
    allowed = allowed.expand(batch_size, -1, -1)
    if structure.padding is not None:
        assert structure.padding.shape == (batch_size, structure.kv_length)
        allowed = allowed & structure.padding[:, None, :]
    return allowed


# (q_length, kv_length, q_offset, kv_offset): prefill, decode, chunked prefill after a cache, a sliding
# cache that dropped keys (kv_offset > 0), a static cache longer than the tokens seen.
GEOMETRIES = [(9, 9, 0, 0), (1, 14, 13, 0), (4, 15, 11, 0), (1, 5, 17, 13), (3, 8, 20, 15), (5, 16, 3, 0)]


def padding_masks(kv_length, kv_offset, batch_size=3):
    """2-D attention masks for the request: none, all ones, and left/right/inner padding of length
    kv_offset + kv_length, shorter (prepare_padding_mask pads it with zeros), longer, as ints."""
    total = kv_offset + kv_length
    padded = torch.ones(batch_size, total, dtype=torch.bool)
    padded[0, : min(3, total - 1)] = False
    padded[1, -2:] = False
    padded[2, total // 2] = False
    yield "none", None
    yield "ones", torch.ones(batch_size, total, dtype=torch.bool)
    yield "padded", padded
    yield "short", padded[:, : max(total - 3, 1)]
    yield "long", torch.cat([padded, torch.zeros(batch_size, 4, dtype=torch.bool)], dim=1)
    yield "int", padded.long()


def requests():
    for q_length, kv_length, q_offset, kv_offset in GEOMETRIES:
        for label, attention_mask in padding_masks(kv_length, kv_offset):
            yield (
                f"{q_length}x{kv_length}@{q_offset},{kv_offset}/{label}",
                dict(
                    batch_size=3,
                    q_length=q_length,
                    kv_length=kv_length,
                    q_offset=q_offset,
                    kv_offset=kv_offset,
                    attention_mask=attention_mask,
                ),
            )


def has_padding(request):
    """Whether the request's 2-D mask, zero-padded to kv_offset + kv_length, hides one of its keys."""
    mask = request["attention_mask"]
    if mask is None:
        return False
    start, stop = request["kv_offset"], request["kv_offset"] + request["kv_length"]
    mask = torch.nn.functional.pad(mask.bool(), (0, max(stop - mask.shape[-1], 0)))
    return not bool(mask[:, start:stop].all())


def sdpa_reference(request, mask_function):
    """transformers' dense bool mask for the request (a 2-D padding mask as bool, as transformers'
    own mask builders hand it over)."""
    padding = request.get("attention_mask")
    if padding is not None:
        request = {**request, "attention_mask": padding.to(torch.bool)}
    return masking_utils.sdpa_mask(**request, mask_function=mask_function, allow_is_causal_skip=False)


RECOGNISED = {
    "causal": (lambda: masking_utils.causal_mask_function, True, None),
    "bidirectional": (lambda: masking_utils.bidirectional_mask_function, False, None),
    **{
        f"sliding{w}": (lambda w=w: masking_utils.sliding_window_causal_mask_function(w), True, (w - 1, 0))
        for w in (1, 2, 5, 8, 100)
    },
    **{
        f"bidirectional_sliding{w}": (
            lambda w=w: masking_utils.sliding_window_bidirectional_mask_function(w),
            False,
            (w, w),
        )
        for w in (0, 1, 3, 8)
    },
}


@pytest.mark.parametrize("kind", list(RECOGNISED))
def test_mask_function_structure_matches_sdpa_mask(kind):
    factory, causal, window = RECOGNISED[kind]
    for label, request in requests():
        structure = integration.mask_function(**request, mask_function=factory())
        assert isinstance(structure, MaskStructure), label
        assert (structure.causal, structure.window) == (causal, window), label
        assert structure.diagonal == request["q_offset"] - request["kv_offset"]
        assert structure.kv_length == request["kv_length"]
        assert (structure.padding is not None) == has_padding(request), label
        expected = sdpa_reference(request, factory())
        assert expected.shape == (3, 1, request["q_length"], request["kv_length"])
        assert torch.equal(expand(structure, 3, request["q_length"]), expected[:, 0]), label


def test_mask_function_tensor_offsets():
    # StaticLayer reports its query offset as a tensor
    request = dict(batch_size=2, q_length=1, kv_length=12, kv_offset=0, attention_mask=None)
    fn = masking_utils.sliding_window_causal_mask_function(4)
    structure = integration.mask_function(**request, q_offset=torch.tensor(7), mask_function=fn)
    assert isinstance(structure, MaskStructure) and structure.diagonal == 7
    assert torch.equal(expand(structure, 2, 1), sdpa_reference(dict(request, q_offset=7), fn)[:, 0])


def _custom(batch_idx, head_idx, q_idx, kv_idx):
    return (q_idx + kv_idx) % 3 != 1


UNRECOGNISED = {
    "and_custom": lambda: masking_utils.and_masks(masking_utils.causal_mask_function, _custom),
    "or_custom": lambda: masking_utils.or_masks(masking_utils.causal_mask_function, _custom),
    "custom": lambda: _custom,
    "chunked": lambda: masking_utils.chunked_causal_mask_function(4, torch.tensor([0, 1, 2])),
    "sliding_then_custom": lambda: masking_utils.and_masks(
        masking_utils.sliding_window_overlay(3), masking_utils.causal_mask_function, _custom
    ),
    "sliding_overlay_on_bidirectional": lambda: masking_utils.and_masks(
        masking_utils.sliding_window_overlay(3), masking_utils.bidirectional_mask_function
    ),
    "bidirectional_overlay_on_causal": lambda: masking_utils.and_masks(
        masking_utils.sliding_window_bidirectional_overlay(3), masking_utils.causal_mask_function
    ),
    "sliding_on_custom": lambda: masking_utils.and_masks(masking_utils.sliding_window_overlay(3), _custom),
    "sliding0": lambda: masking_utils.sliding_window_causal_mask_function(0),
}


@pytest.mark.parametrize("kind", list(UNRECOGNISED))
def test_mask_function_unrecognised_is_dense(kind):
    for label, request in requests():  # an int 2-D mask too: the dense mask is bool all the same
        dense = integration.mask_function(**request, mask_function=UNRECOGNISED[kind]())
        assert isinstance(dense, torch.Tensor), label
        expected = sdpa_reference(request, UNRECOGNISED[kind]())
        assert dense.dtype == torch.bool and dense.shape == expected.shape, label
        assert torch.equal(dense, expected), label


def test_integer_4d_mask_is_refused():
    """A dense 4-D mask must say what it means: bool (True = attend) or floating (added); an integer
    one would be read as either, so it is a TypeError naming attention_mask."""
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    with torch.no_grad():
        with pytest.raises(TypeError, match="attention_mask"):
            integration.attention_forward(module, q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.int64))
        out, weights = integration.attention_forward(module, q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert weights is None and out.shape == (1, 3, 2, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(out, expected)


def test_compiled_model_matches_eager():
    """torch.compile of a whole model with attn_implementation="pyattn" (graph breaks where the mask
    function reads the padding as a Python value) gives eager's logits on a padded batch."""
    model = build("mistral")
    ids, mask = padded_batch()
    expected = run(model, "eager", input_ids=ids, attention_mask=mask)
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            got = output(compiled, input_ids=ids, attention_mask=mask)
    finally:
        torch._dynamo.reset()
        model.set_attn_implementation("eager")
    assert_close_at(got, expected, mask.bool())
