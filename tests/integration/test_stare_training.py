"""STARE in STAPOTrainer: hand-computed losses, GRPO equivalence with the gate shut, the closed loop, checkpoint and
resume of the controller, the selection pools, S2T with STARE, and a user-registered rule."""

import json
import math

import pytest
import torch
from loss_batches import HIGH, LOW, make_batch, make_trainer
from tiny import build_char_tokenizer, build_tiny_qwen3, count_vowels_reward, prompt_dataset, tiny_config, tiny_trainer
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.names import ADVANTAGES_BEFORE_RULES_KEY, SILENCED_KEY, TOKEN_WEIGHTS_KEY
from stapo_trl.core.token_rules import TOKEN_RULES, TokenRuleResult, register_token_rule
from stapo_trl.core.token_rules.stare_controller import STARE_STATE_FILE

STARE = {"use_s2t_mask": False, "use_stare": True}
P = {"half": math.log(0.5), "most": math.log(0.9), "some": math.log(0.6)}


def parameters(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def train_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


# ------------------------------------------------------------------------------------- hand-computed losses
# Row 0 (A = +1): p = 0.001, 0.9, 0.5. Row 1 (A = -0.5): p = 0.001, 0.01, 0.9. P = 0.5 selects ceil(1.5) = 2 tokens
# per sign: row 0 tokens 0 and 2, row 1 tokens 0 and 1. With ratio 1 each token's loss is -A times its weight.
def stare_batch():
    log_probs = torch.tensor([[LOW, HIGH, P["half"]], [LOW, math.log(0.01), HIGH]])
    return make_batch(log_probs, torch.ones(2, 3), [1.0, -0.5])


# O1: row 0 = -(1.1 + 1 + 1.1) = -3.2, row 1 = 3 * 0.5 = 1.5. C2: row 1 = 0.5 * (0.9 + 0.9 + 1) = 1.4.
# dapo divides by the 6 tokens, not by the weights' sum (6.2 under O1); grpo averages each row over its 3 tokens.
EXPECTED_STARE_LOSS = {
    ("O1", "dapo"): (-3.2 + 1.5) / 6,
    ("O1", "grpo"): (-3.2 / 3 + 1.5 / 3) / 2,
    ("C2", "dapo"): (-3.2 + 1.4) / 6,
    ("C2", "grpo"): (-3.2 / 3 + 1.4 / 3) / 2,
}


@pytest.mark.parametrize(("variant", "loss_type"), sorted(EXPECTED_STARE_LOSS))
def test_stare_weights_the_token_mean_without_dividing_by_the_weights(tmp_path, variant, loss_type):
    trainer = make_trainer(
        tmp_path, loss_type=loss_type, stare_variant=variant, stare_top_surprisal_share=0.5, **STARE
    )
    batch = stare_batch()
    stats = trainer.apply_token_rules([batch])["stare"]  # the gate starts on
    weight_m = 0.9 if variant == "C2" else 1.0
    assert torch.allclose(batch[TOKEN_WEIGHTS_KEY], torch.tensor([[1.1, 1.0, 1.1], [weight_m, weight_m, 1.0]]))
    assert batch["advantages"].shape == (2, 3)
    assert batch["num_items_in_batch"].item() == 6 and batch["tool_mask"].all()
    assert stats["num_selected_positive"] == 2
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(EXPECTED_STARE_LOSS[(variant, loss_type)], rel=1e-6)


def test_stare_after_s2t_renormalizes_and_weights_the_kept_tokens(tmp_path):
    # S2T silences row 0 token 0 (candidates H = 0.1 and 0.5, tau_h = 0.42). STARE then selects ceil(0.1 * 2) = 1 of
    # the two kept positive tokens, the p = 0.001 one (token 2): loss = (-1 - 1.1 + 3 * 0.5) / 5 kept tokens.
    trainer = make_trainer(tmp_path, loss_type="dapo", use_stare=True)
    batch = make_batch(
        torch.tensor([[LOW, HIGH, LOW], [LOW, LOW, LOW]]), torch.tensor([[0.1, 0.3, 0.5], [0.0] * 3]), [1.0, -0.5]
    )
    stats = trainer.apply_token_rules([batch])
    assert stats["s2t"]["num_silenced"] == 1 and stats["stare"]["num_selected_positive"] == 1
    assert batch[SILENCED_KEY].tolist() == [[True, False, False], [False] * 3]
    assert torch.allclose(batch[TOKEN_WEIGHTS_KEY], torch.tensor([[1.0, 1.0, 1.1], [1.0] * 3]))
    assert batch["num_items_in_batch"].item() == 5
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx((-2.1 + 1.5) / 5, rel=1e-6)


def test_selection_pools_per_micro_batch_or_per_optimizer_step(tmp_path):
    # Two micro-batches of one A > 0 row each, P = 0.25. Per micro-batch each picks its own most surprising token;
    # over the optimizer step the two p = 0.001 / 0.002 tokens of the first micro-batch win.
    def batches():
        return [
            make_batch(torch.log(torch.tensor([[0.001, 0.002, 0.5, 0.6]])), torch.ones(1, 4), [1.0]),
            make_batch(torch.log(torch.tensor([[0.3, 0.4, 0.5, 0.6]])), torch.ones(1, 4), [1.0]),
        ]

    selected = {}
    for pool in ("micro_batch", "optimizer_step"):
        trainer = make_trainer(
            tmp_path / pool,
            per_device_train_batch_size=1,
            num_generations=2,
            generation_batch_size=2,
            gradient_accumulation_steps=2,
            stare_top_surprisal_share=0.25,
            stare_selection_pool=pool,
            **STARE,
        )
        step = batches()
        trainer.apply_token_rules(step)
        selected[pool] = [(batch[TOKEN_WEIGHTS_KEY] > 1).flatten().tolist() for batch in step]
    assert selected["micro_batch"] == [[True, False, False, False], [True, False, False, False]]
    assert selected["optimizer_step"] == [[True, True, False, False], [False, False, False, False]]


# ------------------------------------------------------------------------------------------ training runs
def run(tmp_path, trainer_class=STAPOTrainer, config_class=STAPOConfig, **overrides):
    trainer = tiny_trainer(trainer_class, tiny_config(config_class, tmp_path, **overrides))
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    ("loss_type", "gate"), [("dapo", {"stare_gate": "off"}), ("grpo", {"stare_gate": "off"}), ("dapo", {})]
)
def test_stare_with_its_gate_shut_trains_exactly_like_grpo(tmp_path, loss_type, gate):
    # {} is the closed loop at the default 0.3-nat target: the tiny model's entropy is far above it, so it stays shut.
    common = {"loss_type": loss_type, "epsilon_high": 0.28, "gradient_accumulation_steps": 2, "max_steps": 3}
    grpo = run(tmp_path / "grpo", GRPOTrainer, GRPOConfig, **common)
    stare = run(tmp_path / "stare", **STARE, **gate, **common)
    assert logged(stare, "stare/gate_on") == [0.0, 0.0, 0.0]
    assert all(count > 0 for count in logged(stare, "stare/num_selected_positive"))
    assert train_losses(stare) == train_losses(grpo)
    grpo_parameters = parameters(grpo)
    for name, value in parameters(stare).items():
        assert torch.equal(value, grpo_parameters[name]), name


def test_the_gate_opens_below_the_target_and_changes_training(tmp_path):
    common = {"max_steps": 3, "gradient_accumulation_steps": 2}
    grpo = run(tmp_path / "grpo", **common, use_s2t_mask=False)
    stare = run(tmp_path / "stare", **common, **STARE, stare_target_entropy=10.0)
    assert logged(stare, "stare/gate_on") == [1.0, 1.0, 1.0]
    assert all(weight > 1.0 for weight in logged(stare, "stare/mean_weight"))
    assert logged(stare, "stare/positive_weight") == [1.1, 1.1, 1.1]
    assert train_losses(stare)[0] != train_losses(grpo)[0]
    assert any(not torch.equal(value, parameters(grpo)[name]) for name, value in parameters(stare).items())


def test_the_gate_reads_the_generating_policys_mean_entropy(tmp_path):
    # One optimizer step per generation: the policy that generated a batch is the one TRL's loss sees, so the
    # controller's entropy equals the `entropy` TRL logs at loss time.
    stare = run(tmp_path, max_steps=3, **STARE, stare_target_entropy=10.0)
    controller_entropy, loss_entropy = logged(stare, "stare/batch_entropy"), logged(stare, "entropy")
    assert all(math.isfinite(value) and value > 0.3 for value in controller_entropy)
    assert controller_entropy == pytest.approx(loss_entropy, rel=1e-5)
    assert stare.rule_controllers["stare"].num_updates == 3


def test_s2t_and_stare_train_together_and_log_both(tmp_path):
    trainer = run(tmp_path, max_steps=3, prob_threshold=0.05, use_stare=True, stare_target_entropy=10.0)
    assert sum(logged(trainer, "s2t/num_silenced")) > 0
    assert sum(logged(trainer, "stare/num_selected_positive")) > 0
    assert logged(trainer, "stare/gate_on") == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------- checkpoint and resume
ADAPTIVE = {
    **STARE,
    "stare_target_entropy": 10.0,
    "stare_adaptive": True,
    "stare_variant": "C2",
    "gradient_accumulation_steps": 2,
    # A run cut at step 2 must see the same learning rates as one planned for 4 steps.
    "lr_scheduler_type": "constant",
    "save_strategy": "steps",
    "save_steps": 2,
}


def resumable_trainer(output_dir, max_steps):
    """Four steps of 4 prompts fit in one epoch of 16 prompts. (TRL 1.16's RepeatSampler draws each epoch's order
    from one running generator, so a run resumed exactly at an epoch boundary sees a different order.)"""
    tokenizer = build_char_tokenizer()
    return STAPOTrainer(
        model=build_tiny_qwen3(tokenizer),
        reward_funcs=count_vowels_reward,
        args=tiny_config(STAPOConfig, output_dir, max_steps=max_steps, **ADAPTIVE),
        train_dataset=prompt_dataset(16),
        processing_class=tokenizer,
    )


def test_resume_restores_the_controller_exactly(tmp_path):
    straight = resumable_trainer(tmp_path / "straight", max_steps=4)
    straight.train()
    # Below target at every generation: W and M move one step of 0.01 per generation.
    assert straight.rule_controllers["stare"].positive_weight == pytest.approx(1.14)
    assert straight.rule_controllers["stare"].negative_weight == pytest.approx(0.86)

    first = resumable_trainer(tmp_path / "split", max_steps=2)
    first.train()
    checkpoint = tmp_path / "split" / "checkpoint-2"
    saved = json.loads((checkpoint / STARE_STATE_FILE).read_text())
    assert saved == first.rule_controllers["stare"].state_dict()
    assert saved["num_updates"] == 2 and saved["positive_weight"] == pytest.approx(1.12)

    resumed = resumable_trainer(tmp_path / "split", max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.rule_controllers["stare"].state_dict() == straight.rule_controllers["stare"].state_dict()
    assert train_losses(resumed) == train_losses(straight)
    assert logged(resumed, "stare/positive_weight") == logged(straight, "stare/positive_weight")
    straight_parameters = parameters(straight)
    for name, value in parameters(resumed).items():
        assert torch.allclose(value, straight_parameters[name], atol=1e-6), name


def test_a_checkpoint_without_controller_state_warns_and_starts_fresh(tmp_path, caplog):
    resumable_trainer(tmp_path, max_steps=2).train()
    (tmp_path / "checkpoint-2" / STARE_STATE_FILE).unlink()
    resumed = resumable_trainer(tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "has no stare_controller_state.json" in caplog.text
    assert resumed.rule_controllers["stare"].num_updates == 1
    assert resumed.rule_controllers["stare"].positive_weight == pytest.approx(1.11)


# ------------------------------------------------------------------------------------- a rule of your own
@pytest.fixture
def first_token_rule():
    @register_token_rule("test_drop_first_token")
    def drop_first_token(log_probs, entropies, advantages, loss_mask, *, weight=1.0):
        """Silence the first completion token of every response; weight the rest."""
        keep = torch.ones_like(loss_mask)
        keep[:, 0] = False
        weights = torch.full_like(log_probs, weight)
        return TokenRuleResult(keep=keep, weights=weights, stats={"num_dropped": int((loss_mask & ~keep).sum())})

    yield "test_drop_first_token"
    del TOKEN_RULES["test_drop_first_token"]


def test_a_registered_rule_runs_in_the_trainer_from_the_config(tmp_path, first_token_rule):
    trainer = run(
        tmp_path,
        max_steps=2,
        use_s2t_mask=False,
        token_rules=[first_token_rule],
        token_rule_kwargs={first_token_rule: {"weight": 2.0}},
    )
    rows = trainer.args.per_device_train_batch_size
    assert logged(trainer, f"{first_token_rule}/num_dropped") == [rows, rows]
    batch = trainer._buffered_inputs[0]
    assert batch[SILENCED_KEY][:, 0].all() and not batch[SILENCED_KEY][:, 1:].any()
    doubled = batch[ADVANTAGES_BEFORE_RULES_KEY].unsqueeze(1) * 2.0
    assert torch.equal(batch["advantages"], doubled.expand_as(batch["completion_mask"]))
