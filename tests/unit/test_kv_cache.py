"""The in-place key/value cache (`stapo_trl.cpu.kv_cache`): each layer's keys and values grow inside one buffer
instead of by concatenation, and `generate()` samples the same tokens from bit-identical logits, with the frozen-layer
replay's shared prefill and without."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import build_char_tokenizer, build_tiny_qwen3, tiny_config, tiny_trainer
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from stapo_trl import STAPOConfig, STAPOTrainer, cpu_runtime
from stapo_trl.cpu.frozen_layer_replay import replay_frozen_prefix
from stapo_trl.cpu.kv_cache import InPlaceLayer, inplace_cache, inplace_kv_cache

PROMPTS = ("1+2=", "33+4=", "5+6=")
REPEATED_PROMPTS = ("1+2=", "1+2=", "33+4=", "33+4=", "5+6=", "5+6=")
UNPADDED_PROMPTS = ("1+2=", "3+4=", "5+6=")
UNPADDED_REPEATED_PROMPTS = ("1+2=", "1+2=", "3+4=", "3+4=")
PROMPT_SETS = {
    "distinct-padded": PROMPTS,
    "repeated-padded": REPEATED_PROMPTS,
    "distinct-unpadded": UNPADDED_PROMPTS,
    "repeated-unpadded": UNPADDED_REPEATED_PROMPTS,
}
"""Padded prompts give attention a mask, prompts of one length none. At each decoding step transformers' SDPA path
hands the cached keys and values, with their 2 heads, to torch as they are either way: with a mask it folds the 4
query heads over them, without one it asks torch for grouped-query attention."""
TIMINGS = {"step_time"}
"""Logged values that measure time, left out where runs are compared."""


def states(batch: int, length: int, start: float) -> torch.Tensor:
    """``[batch, 2 heads, length, 3]`` keys or values numbered from ``start``, so that every entry is told apart."""
    return torch.arange(batch * 2 * length * 3, dtype=torch.float32).reshape(batch, 2, length, 3) + start


def test_updates_write_into_one_buffer_and_read_as_the_concatenation():
    layer = InPlaceLayer(capacity=6)
    pieces = [(states(2, 4, 0.0), states(2, 4, 1000.0))]
    keys, values = layer.update(*pieces[0])
    buffer = keys.data_ptr()
    for step in range(2):
        pieces.append((states(2, 1, 100.0 * (step + 1)), states(2, 1, 2000.0 + step)))
        keys, values = layer.update(*pieces[-1])
    assert torch.equal(keys, torch.cat([key for key, _ in pieces], dim=-2))
    assert torch.equal(values, torch.cat([value for _, value in pieces], dim=-2))
    assert keys.data_ptr() == buffer and keys.shape == (2, 2, 6, 3) and layer.get_seq_length() == 6


def test_a_position_beyond_the_capacity_moves_the_layer_to_a_buffer_twice_as_long():
    layer = InPlaceLayer(capacity=4)
    first = states(1, 4, 0.0)
    layer.update(first, first)
    extra = states(1, 1, 50.0)
    keys, _ = layer.update(extra, extra)
    assert torch.equal(keys, torch.cat([first, extra], dim=-2))
    assert layer._buffers[0].shape[-2] == 8


def test_reordering_the_rows_reorders_the_buffers_and_later_updates_follow_it():
    """What the shared prefill does: one row per distinct prompt, then copied out to every repeat."""
    layer = InPlaceLayer(capacity=5)
    distinct = states(2, 3, 0.0)
    layer.update(distinct, distinct + 0.5)
    layer.reorder_cache(torch.tensor([0, 0, 1, 1, 1]))
    new = states(5, 1, 500.0)
    keys, values = layer.update(new, new + 0.5)
    expected = torch.cat([distinct[[0, 0, 1, 1, 1]], new], dim=-2)
    assert torch.equal(keys, expected) and torch.equal(values, expected + 0.5)
    assert keys.data_ptr() == layer._buffers[0].data_ptr()


def test_keys_replaced_by_transformers_are_taken_into_new_buffers_at_the_next_update():
    layer = InPlaceLayer(capacity=8)
    first = states(3, 4, 0.0)
    layer.update(first, first)
    layer.batch_select_indices(torch.tensor([2, 0]))
    layer.crop(-1)
    new = states(2, 1, 900.0)
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([first[[2, 0], :, :3], new], dim=-2))
    assert keys.data_ptr() == layer._buffers[0].data_ptr()
    layer.reset()
    assert layer.get_seq_length() == 0
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, new)


def test_the_cache_is_transformers_default_with_in_place_full_attention_layers():
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    cache = inplace_cache(model, capacity=12)
    default = DynamicCache(config=model.config.get_text_config(decoder=True))
    assert len(cache.layers) == len(default.layers) == 2
    assert all(type(layer) is InPlaceLayer and layer.capacity == 12 for layer in cache.layers)
    assert all(type(layer) is DynamicLayer for layer in default.layers)


def lora_policy(attention: str = "sdpa"):
    """The tiny Qwen3 (grouped-query attention: 4 heads over 2 key/value heads) with LoRA on its last layer, no
    dropout, the adapter's B matrices non-zero so that the adapted layer matters, its attention run by ``attention``
    (transformers' ``attn_implementation``)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, seed=2)
    model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]
    )
    policy = get_peft_model(model, lora)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    return tokenizer, policy


def sample(tokenizer, policy, prompts, **generate_options):
    """Sample 8 tokens per prompt at temperature 1 from seed 0; returns the sequences and the LM head's logits at
    every decoding step."""
    encoded = tokenizer(list(prompts), return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=8, do_sample=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    logits = []
    handle = policy.get_base_model().lm_head.register_forward_hook(lambda m, a, out: logits.append(out.clone()))
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            sequences = policy.generate(**encoded, generation_config=config, **generate_options)
    finally:
        handle.remove()
    return sequences, logits


def count_inplace_updates(monkeypatch) -> list[int]:
    calls = []
    original = InPlaceLayer.update

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(InPlaceLayer, "update", counted)
    return calls


@pytest.mark.parametrize("prompts", PROMPT_SETS.values(), ids=PROMPT_SETS.keys())
@pytest.mark.parametrize("shared_prefill", [False, True], ids=["plain", "with-the-replays-shared-prefill"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_generate_samples_the_same_tokens_from_bit_identical_logits(monkeypatch, prompts, shared_prefill, attention):
    """The same seed samples the same tokens with the in-place cache as with transformers' `DynamicCache`, from logits
    equal bit for bit at every decoding step. With the replay's shared prefill, the reference is the replay with
    transformers' cache (and the plain run as well: the shared prefill changes no bit here either)."""
    tokenizer, policy = lora_policy(attention)
    base = policy.get_base_model()
    plain_sequences, plain_logits = sample(tokenizer, policy, prompts)
    references = [(plain_sequences, plain_logits)]
    repeats = len(set(prompts)) < len(prompts)
    if shared_prefill:
        with replay_frozen_prefix(base) as replay:
            references.append(sample(tokenizer, policy, prompts))
        assert replay.shared_prefills == (1 if repeats else 0)
    updates = count_inplace_updates(monkeypatch)
    with inplace_kv_cache(base):
        if shared_prefill:
            with replay_frozen_prefix(base) as replay:
                got_sequences, got_logits = sample(tokenizer, policy, prompts)
            assert replay.shared_prefills == (1 if repeats else 0)
        else:
            got_sequences, got_logits = sample(tokenizer, policy, prompts)
    assert updates, "generate() did not use the in-place cache"
    assert len(set(map(tuple, got_sequences[:, -8:].tolist()))) > 1, (
        "every row sampled one completion: a weak comparison"
    )
    for want_sequences, want_logits in references:
        assert torch.equal(got_sequences, want_sequences)
        assert len(got_logits) == len(want_logits) == 8
        assert all(torch.equal(got, want) for got, want in zip(got_logits, want_logits, strict=True))


@pytest.mark.parametrize(
    "options",
    [
        {"cache": "given"},
        {"cache_implementation": "static"},
        {"use_cache": False},
    ],
    ids=["a-cache-handed-in", "a-cache-implementation-asked-for", "no-cache"],
)
def test_a_call_that_chooses_its_own_cache_runs_unchanged(monkeypatch, options):
    tokenizer, policy = lora_policy()
    base = policy.get_base_model()
    if options.get("cache") == "given":
        options = {"cache": DynamicCache(config=base.config)}
    updates = count_inplace_updates(monkeypatch)
    with inplace_kv_cache(base):
        sample(tokenizer, policy, PROMPTS, **options)
    assert updates == []


def test_a_generation_config_passed_by_position_is_read_like_one_passed_by_keyword(monkeypatch):
    tokenizer, policy = lora_policy()
    base = policy.get_base_model()
    encoded = tokenizer(list(PROMPTS), return_tensors="pt", padding=True)
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    updates = count_inplace_updates(monkeypatch)
    with inplace_kv_cache(base), torch.no_grad():
        base.generate(encoded["input_ids"], GenerationConfig(**options, cache_implementation="static"))
        assert updates == []
        base.generate(encoded["input_ids"], GenerationConfig(**options))
    assert updates != []


def test_the_block_puts_generate_back():
    _, policy = lora_policy()
    base = policy.get_base_model()
    with inplace_kv_cache(base):
        assert "generate" in vars(base)
    assert "generate" not in vars(base)


@pytest.mark.slow
def test_a_stapo_run_logs_every_number_as_without_the_in_place_cache(tmp_path, monkeypatch):
    """Two STAPO steps (mask on, at a probability threshold that gives it candidates) on the tiny model with LoRA on
    its last layer, inside `cpu_runtime` with the CPU head and the replay, with the in-place cache and without: every
    logged number is the same, bit for bit, and so are the trained adapter's weights."""
    updates = count_inplace_updates(monkeypatch)
    runs = []
    for inplace in (False, True):
        config = tiny_config(STAPOConfig, tmp_path / str(inplace), learning_rate=5e-2, prob_threshold=0.05)
        with cpu_runtime(config, inplace_kv_cache=inplace):
            lora = LoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]
            )
            trainer = tiny_trainer(
                STAPOTrainer, config, model=build_tiny_qwen3(build_char_tokenizer(), seed=3), peft_config=lora
            )
            trainer.train()
        assert bool(updates) == inplace, "the training generations use the in-place cache when, and only when, asked"
        logs = [
            {key: value for key, value in entry.items() if key not in TIMINGS}
            for entry in trainer.state.log_history
            if "loss" in entry and "train_runtime" not in entry
        ]
        runs.append(
            (logs, {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora" in name})
        )
    (logs_without, weights_without), (logs_with, weights_with) = runs
    assert len(logs_with) == 2 and logs_with == logs_without
    assert any(entry["s2t/num_candidates"] > 0 for entry in logs_with)
    assert all(torch.equal(weights_with[name], weights_without[name]) for name in weights_without)
