"""Frozen-layer replay (`stapo_trl.cpu.frozen_layer_replay`): the loss pass over generated sequences reuses the hidden states
`generate()` (or a pass without gradients, such as TRL's old-log-prob pass) computed in the frozen bottom layers, and
gives the log-probabilities and gradients of the full forward to float tolerance; it steps aside whenever the
recording does not cover the call."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny import build_char_tokenizer, build_tiny_qwen3, tiny_config, tiny_trainer
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from stapo_trl.cpu.frozen_layer_replay import FrozenPrefixReplay, replay_blockers, replay_frozen_prefix
from stapo_trl.trl_boundary.helpers import decoder_layers

LORA_ON_LAST_LAYER = {
    "r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.1,
    "target_modules": ["q_proj", "v_proj"],
    "layers_to_transform": [1],
    "task_type": "CAUSAL_LM",
}


def lora_policy(**config_overrides):
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, seed=2)
    for name, value in config_overrides.items():
        setattr(model.config, name, value)
    add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    policy = get_peft_model(model, LoraConfig(**LORA_ON_LAST_LAYER))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    policy.train()
    return tokenizer, policy


def generate(tokenizer, policy, prompts=("1+2=", "33+4=", "5+6=")):
    encoded = tokenizer(list(prompts), return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=8, do_sample=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    with torch.no_grad():
        sequences = policy.generate(**encoded, generation_config=config)
    prompt_length = encoded["input_ids"].shape[1]
    completion = sequences[:, prompt_length:]
    is_eos = completion == tokenizer.eos_token_id
    no_eos = torch.full((completion.shape[0],), completion.shape[1])
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), no_eos)
    completion_mask = (torch.arange(completion.shape[1])[None] <= first_eos[:, None]).long()
    input_ids = torch.cat([encoded["input_ids"], completion.masked_fill(completion_mask == 0, 0)], dim=1)
    attention_mask = torch.cat([encoded["attention_mask"], completion_mask], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :prompt_length] = -100
    return input_ids, attention_mask, labels


REPEATED_PROMPTS = ("1+2=", "33+4=", "1+2=", "5+6=", "33+4=", "1+2=")


def rows_seen_by(layer: torch.nn.Module) -> list[int]:
    """The batch size of every call to ``layer`` from now on."""
    sizes: list[int] = []
    layer.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    return sizes


def test_repeated_prompts_share_the_frozen_layers_prefill_and_sample_the_same_tokens():
    """GRPO's groups repeat each prompt: the frozen layer runs on one row per prompt at the first forward, its cache
    entries are copied to the repeats, and sampling (with LoRA dropout live above it) draws the same tokens."""
    tokenizer, policy = lora_policy()
    want = generate(tokenizer, policy, REPEATED_PROMPTS)
    base = policy.get_base_model()
    frozen_layer = base.model.layers[0]
    batch_sizes = rows_seen_by(frozen_layer)
    with replay_frozen_prefix(base) as replay:
        got = generate(tokenizer, policy, REPEATED_PROMPTS)
        assert replay.shared_prefills == 1
        assert base.model.layers[0] is frozen_layer
    assert batch_sizes[0] == 3 and set(batch_sizes[1:]) == {6}, batch_sizes
    assert replay.shared_layers == 1  # the frozen layer only: the adapted one above it has live dropout
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_without_active_dropout_every_layer_is_shared_at_the_prefill_and_the_recording_covers_every_row():
    """With no dropout anywhere, the repeats of a prompt compute the same thing in every layer: the adapted layer
    also runs on one row per prompt at the first forward, the samples are the same as without sharing, and the loss
    pass replays the recording (expanded to every row) with the full forward's log-probabilities."""
    tokenizer, policy = lora_policy()
    for module in policy.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    want_batch = generate(tokenizer, policy, REPEATED_PROMPTS)
    want = loss_pass(policy, *want_batch)
    base = policy.get_base_model()
    frozen_layer, adapted_layer = base.model.layers
    batch_sizes = rows_seen_by(adapted_layer)
    with replay_frozen_prefix(base) as replay:
        got_batch = generate(tokenizer, policy, REPEATED_PROMPTS)
        assert (replay.shared_prefills, replay.shared_layers) == (1, 2)
        assert list(base.model.layers) == [frozen_layer, adapted_layer]  # both put back after the prefill
        assert replay.recording is not None and replay.recording.hidden_states.shape[0] == 6
        got = loss_pass(policy, *got_batch)
        assert (replay.replayed, replay.computed) == (1, 0)
    assert batch_sizes[0] == 3 and set(batch_sizes[1:]) == {6}, batch_sizes
    assert all(torch.equal(a, b) for a, b in zip(got_batch, want_batch, strict=True))
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    for name in want[2]:
        assert torch.allclose(got[2][name], want[2][name], rtol=1e-4, atol=1e-6), name


def loss_pass(policy, input_ids, attention_mask, labels):
    """TRL's loss pass: the fused head over the batch, in train mode (LoRA dropout live, same seed each time)."""
    policy.zero_grad()
    torch.manual_seed(1)
    output = policy(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    (output.loss + 0.1 * output.entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    return output.log_probs.detach(), output.entropy.detach(), grads


def assert_same_as_the_full_forward(got, want):
    """Log-probabilities and entropies to 1e-5, and the same LoRA gradients to float tolerance."""
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert got[2].keys() == want[2].keys() and any("lora" in name for name in got[2])
    for name in want[2]:
        assert torch.allclose(got[2][name], want[2][name], rtol=1e-4, atol=1e-6), name


def test_the_loss_pass_over_generated_sequences_replays_and_matches_the_full_forward():
    """TRL shuffles the generation batch before the loss pass: the rows are found in the recording in any order."""
    tokenizer, policy = lora_policy()
    batch = generate(tokenizer, policy)
    shuffled = [tensor[[2, 0, 1]] for tensor in batch]
    want = loss_pass(policy, *shuffled)
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        assert isinstance(replay, FrozenPrefixReplay) and replay.first_trainable == 1
        batch_again = generate(tokenizer, policy)
        assert all(torch.equal(a, b) for a, b in zip(batch, batch_again, strict=True))
        got = loss_pass(policy, *shuffled)
        assert (replay.replayed, replay.computed) == (1, 0)
    assert (batch[2] != -100).sum() > 6, "too few scored tokens for the comparison to mean anything"
    assert_same_as_the_full_forward(got, want)


def test_sequences_generate_did_not_produce_run_every_layer_and_give_the_same_result_as_without_replay():
    tokenizer, policy = lora_policy()
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        input_ids, attention_mask, labels = generate(tokenizer, policy)
        changed = input_ids.clone()
        changed[0, -3] = (changed[0, -3] + 1) % 40
        kept = attention_mask.clone()
        kept[0, -3] = 1
        got = loss_pass(policy, changed, kept, labels)
        assert (replay.replayed, replay.computed) == (0, 1)
    want = loss_pass(policy, changed, kept, labels)
    assert torch.equal(got[0], want[0])


def test_passes_without_gradients_record_what_generate_did_not_produce_and_the_loss_pass_replays_it():
    """Colocated vLLM samples outside `generate()`; TRL's old-log-prob pass then scores the generation batch in chunks
    without gradients. Those chunks join one recording, and the loss pass over the shuffled rows replays it and gives
    the full forward's log-probabilities and gradients."""
    tokenizer, policy = lora_policy()
    batch = generate(tokenizer, policy)
    shuffled = [tensor[[2, 0, 1]] for tensor in batch]
    want = loss_pass(policy, *shuffled)
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        with torch.no_grad():
            for rows in ([0, 1], [2]):
                policy(
                    input_ids=batch[0][rows], attention_mask=batch[1][rows], labels=batch[2][rows], fused_lm_head=True
                )
        assert (replay.replayed, replay.computed) == (0, 2)
        assert torch.equal(replay.recording.sequences, batch[0])
        got = loss_pass(policy, *shuffled)
        assert (replay.replayed, replay.computed) == (1, 2)
    assert_same_as_the_full_forward(got, want)


def test_a_pass_with_gradients_closes_the_recording_so_the_next_generation_batch_starts_a_new_one():
    tokenizer, policy = lora_policy()
    first = generate(tokenizer, policy)
    first_completion_column = int((first[2] != -100).any(0).int().argmax())
    second = [tensor.clone() for tensor in first]
    second[0][:, first_completion_column] = (second[0][:, first_completion_column] + 1) % 40
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        with torch.no_grad():
            policy(input_ids=first[0], attention_mask=first[1], labels=first[2], fused_lm_head=True)
        loss_pass(policy, *first)
        with torch.no_grad():
            policy(input_ids=second[0], attention_mask=second[1], labels=second[2], fused_lm_head=True)
        assert torch.equal(replay.recording.sequences, second[0])
        loss_pass(policy, *first)
        assert (replay.replayed, replay.computed) == (1, 3)


def test_a_frozen_parameter_changed_in_place_stops_the_replay():
    tokenizer, policy = lora_policy()
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        batch = generate(tokenizer, policy)
        with torch.no_grad():
            policy.get_base_model().model.layers[0].mlp.up_proj.weight.mul_(1.01)
        loss_pass(policy, *batch)
        assert (replay.replayed, replay.computed) == (0, 1)


def test_positions_never_fed_back_are_not_replayed_without_the_shift():
    tokenizer, policy = lora_policy()
    with replay_frozen_prefix(policy.get_base_model()) as replay:
        input_ids, attention_mask, labels = generate(tokenizer, policy)
        policy(input_ids=input_ids, attention_mask=attention_mask, shift_labels=labels, fused_lm_head=True)
        assert (replay.replayed, replay.computed) == (0, 0)


def test_detach_puts_trls_forward_and_the_class_generate_back():
    tokenizer, policy = lora_policy()
    base = policy.get_base_model()
    forward = vars(base)["forward"]
    with replay_frozen_prefix(base):
        assert vars(base)["forward"] is not forward and "generate" in vars(base)
    assert vars(base)["forward"] is forward and "generate" not in vars(base)
    layers, problems = decoder_layers(base)
    assert problems == [] and all(type(layer).__name__ == "Qwen3DecoderLayer" for layer in layers)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("full", "the first decoder layer has trainable parameters"),
        ("attention_dropout", "dropout in the frozen layers: config.attention_dropout=0.1"),
        ("checkpointing", "gradient checkpointing"),
    ],
)
def test_it_is_not_installed_where_it_would_change_results(setup, reason):
    if setup == "full":
        tokenizer = build_char_tokenizer()
        model = build_tiny_qwen3(tokenizer)
    else:
        overrides = {"attention_dropout": 0.1} if setup == "attention_dropout" else {}
        _, policy = lora_policy(**overrides)
        model = policy.get_base_model()
        if setup == "checkpointing":
            model.gradient_checkpointing_enable()
    assert any(reason in blocker for blocker in replay_blockers(model))
    with replay_frozen_prefix(model) as replay:
        assert replay is None
    assert "generate" not in vars(model)


def test_a_grpo_run_with_replay_trains_as_without(tmp_path):
    """Two GRPO steps on the tiny model with LoRA on its last layer: same samples, same losses and parameters to float
    tolerance, and every loss pass replayed."""
    lora = LoraConfig(**{**LORA_ON_LAST_LAYER, "lora_dropout": 0.0})
    results = []
    for replay_on in (False, True):
        trainer = tiny_trainer(
            GRPOTrainer,
            tiny_config(GRPOConfig, tmp_path / str(replay_on), learning_rate=5e-2),
            model=build_tiny_qwen3(build_char_tokenizer(), seed=3),
            peft_config=lora,
        )
        if replay_on:
            with replay_frozen_prefix(trainer.model.get_base_model()) as replay:
                trainer.train()
            assert replay.replayed == 2 and replay.computed == 0 and replay.shared_prefills == 2
            assert replay.shared_layers == 2  # no dropout: the adapted layer's prefill is shared too
        else:
            trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
        lora_parameters = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora" in name}
        results.append((logs, lora_parameters))
    (logs_off, parameters_off), (logs_on, parameters_on) = results
    for off, on in zip(logs_off, logs_on, strict=True):
        assert off["completions/mean_length"] == on["completions/mean_length"]
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-4, abs=1e-6)
    for name in parameters_off:
        assert torch.allclose(parameters_on[name], parameters_off[name], rtol=1e-4, atol=1e-6), name
