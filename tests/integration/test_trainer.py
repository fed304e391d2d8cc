"""STAPOTrainer end to end on a tiny Qwen3: GRPO equivalence, training, LoRA, statistics sources and backends."""

import logging
import math

import pytest
import torch
from peft import LoraConfig
from tiny import build_char_tokenizer, build_tiny_qwen3, parameters, tiny_config, tiny_trainer, train_losses
from trl import GRPOConfig, GRPOTrainer

from stapo_trl import STAPOConfig, STAPOTrainer, spurious_token_mask
from stapo_trl.core.names import ENTROPIES_KEY, LOG_PROBS_KEY, SILENCED_KEY
from stapo_trl.core.token_stats.statistics import TokenStatistics

S2T_METRICS = [
    "s2t/silenced_fraction",
    "s2t/num_silenced",
    "s2t/num_candidates",
    "s2t/entropy_threshold",
    "s2t/entropy_p50",
    "s2t/entropy_p80",
    "s2t/entropy_p99",
    "s2t/logit_grad_sq_share_estimate",
]
# The tiny model spreads probabilities over ~50 tokens; this threshold makes candidates common enough to test.
TEST_PROB_THRESHOLD = 0.05


def run(trainer_class, config_class, tmp_path, **overrides):
    trainer = tiny_trainer(trainer_class, tiny_config(config_class, tmp_path, **overrides))
    trainer.train()
    return trainer


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_mask_off_trains_exactly_like_grpo(tmp_path, loss_type):
    common = {"loss_type": loss_type, "epsilon_high": 0.28, "gradient_accumulation_steps": 2}
    grpo = run(GRPOTrainer, GRPOConfig, tmp_path / "grpo", **common)
    stapo = run(STAPOTrainer, STAPOConfig, tmp_path / "stapo", use_s2t_mask=False, **common)
    assert train_losses(stapo) == train_losses(grpo)
    grpo_parameters = parameters(grpo)
    for name, value in parameters(stapo).items():
        assert torch.equal(value, grpo_parameters[name]), name
    assert not any(key.startswith("s2t/") for entry in stapo.state.log_history for key in entry)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_mask_on_with_nothing_to_mask_trains_exactly_like_grpo(tmp_path, loss_type):
    common = {"loss_type": loss_type, "epsilon_high": 0.28, "gradient_accumulation_steps": 2}
    grpo = run(GRPOTrainer, GRPOConfig, tmp_path / "grpo", **common)
    stapo = run(STAPOTrainer, STAPOConfig, tmp_path / "stapo", prob_threshold=1e-30, **common)
    assert [e["s2t/num_candidates"] for e in stapo.state.log_history if "loss" in e] == [0, 0]
    assert train_losses(stapo) == train_losses(grpo)
    grpo_parameters = parameters(grpo)
    for name, value in parameters(stapo).items():
        assert torch.equal(value, grpo_parameters[name]), name


def dropout_model(kind):
    """(model, peft_config) with dropout that is live in training: LoRA dropout, or attention dropout."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    if kind == "lora":
        lora = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
        return model, lora
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model, None


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize(
    ("where", "source"),
    [("recorded", "generation"), ("pass", "generation"), ("pass", "loss")],
    ids=["recorded-while-generating", "statistics-pass", "loss-source-pass"],
)
def test_a_run_that_silences_nothing_is_bit_identical_to_grpo_with_dropout(tmp_path, monkeypatch, kind, where, source):
    common = {"max_steps": 3, "epsilon_high": 0.28, "temperature": 1.0}
    model, lora = dropout_model(kind)
    grpo = tiny_trainer(
        GRPOTrainer, tiny_config(GRPOConfig, tmp_path / "grpo", **common), model=model, peft_config=lora
    )
    grpo.train()

    if where == "pass":  # the no-grad statistics pass runs at every generation
        monkeypatch.setattr(STAPOTrainer, "generation_stats_blocker", lambda self: "this test runs the pass")
    passes = []
    original = TokenStatistics.compute
    monkeypatch.setattr(TokenStatistics, "compute", lambda self, batch: passes.append(1) or original(self, batch))
    model, lora = dropout_model(kind)
    config = tiny_config(STAPOConfig, tmp_path / "stapo", prob_threshold=1e-30, token_stats_source=source, **common)
    stapo = tiny_trainer(STAPOTrainer, config, model=model, peft_config=lora)
    stapo.train()

    assert len(passes) == (3 if where == "pass" else 0)
    assert [e["s2t/num_silenced"] for e in stapo.state.log_history if "loss" in e] == [0, 0, 0]
    assert train_losses(stapo) == train_losses(grpo)
    assert [e["grad_norm"] for e in stapo.state.log_history if "loss" in e] == [
        e["grad_norm"] for e in grpo.state.log_history if "loss" in e
    ]
    grpo_parameters = parameters(grpo)
    for name, value in parameters(stapo).items():
        assert torch.equal(value, grpo_parameters[name]), name


def test_the_statistics_pass_draws_no_random_numbers_and_restores_every_modules_mode(tmp_path):
    model, lora = dropout_model("lora")
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path), model=model, peft_config=lora)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    trainer.model.get_base_model().model.layers[0].eval()  # a mixed state, to be left as found
    modes = {name: module.training for name, module in trainer.model.named_modules()}
    output = trainer._generate_and_score_completions(batch)
    state = torch.get_rng_state()
    first = trainer.token_stats.compute(output)
    assert torch.equal(torch.get_rng_state(), state)
    assert {name: module.training for name, module in trainer.model.named_modules()} == modes
    second = trainer.token_stats.compute(output)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # dropout off: deterministic


def assert_trains_and_logs(trainer, before):
    after = parameters(trainer)
    changed = {name: not torch.equal(before[name], after[name]) for name in before}
    unchanged = [name for name, did_change in changed.items() if not did_change]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged
    for entry in logged:
        for metric in S2T_METRICS:
            assert metric in entry, metric
        assert 0.0 <= entry["s2t/silenced_fraction"] <= 1.0
        assert math.isfinite(entry["s2t/entropy_p50"])
    assert sum(entry["s2t/num_silenced"] for entry in logged) > 0


def test_full_model_trains_and_logs_s2t_metrics(tmp_path):
    trainer = tiny_trainer(
        STAPOTrainer, tiny_config(STAPOConfig, tmp_path, max_steps=3, prob_threshold=TEST_PROB_THRESHOLD)
    )
    before = parameters(trainer, trainable=True)
    trainer.train()
    assert_trains_and_logs(trainer, before)


def test_lora_adapter_trains_and_logs_s2t_metrics(tmp_path):
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    config = tiny_config(STAPOConfig, tmp_path, max_steps=3, prob_threshold=TEST_PROB_THRESHOLD)
    trainer = tiny_trainer(STAPOTrainer, config, peft_config=lora)
    trainable = parameters(trainer, trainable=True)
    frozen = parameters(trainer, trainable=False)
    assert trainable and all("lora_" in name for name in trainable)
    trainer.train()
    assert_trains_and_logs(trainer, trainable)
    for name, value in trainer.model.named_parameters():
        if name in frozen:
            assert torch.equal(value, frozen[name]), name


def test_gradient_accumulation_with_two_iterations_reuses_trls_old_logprob_pass(tmp_path, monkeypatch):
    config = tiny_config(
        STAPOConfig,
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        prob_threshold=TEST_PROB_THRESHOLD,
    )
    trainer = tiny_trainer(STAPOTrainer, config)
    extra_passes = []
    original = trainer.token_stats.compute
    monkeypatch.setattr(trainer.token_stats, "compute", lambda batch: extra_passes.append(1) or original(batch))
    before = parameters(trainer)
    trainer.train()
    assert extra_passes == []  # num_iterations=2 makes TRL compute old log-probs; S2T takes p and H from that pass
    assert_trains_and_logs(trainer, before)


class RecordingSTAPOTrainer(STAPOTrainer):
    """Records, for every loss computation, the applied mask and the loss-time p and H of the same forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        log_probs, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if torch.is_grad_enabled() and self.model.training:
            self._loss_time_stats = (log_probs.detach(), entropies.detach())
        return log_probs, entropies, aux

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss_log_probs, loss_entropies = self._loss_time_stats
        self.records.append(
            (
                inputs[SILENCED_KEY],
                inputs["advantages"],
                inputs["completion_mask"],
                loss_log_probs,
                loss_entropies,
                inputs[LOG_PROBS_KEY],
                inputs[ENTROPIES_KEY],
            )
        )
        return loss


def masks_from_loss_time_statistics(trainer):
    """Recompute each optimizer step's S2T mask from the p and H of the loss forward itself."""
    accumulation = trainer.args.gradient_accumulation_steps
    steps = [trainer.records[i : i + accumulation] for i in range(0, len(trainer.records), accumulation)]
    for step in steps:
        applied = torch.cat([record[0] for record in step])
        recomputed, _ = spurious_token_mask(
            torch.cat([record[3] for record in step]),
            torch.cat([record[4] for record in step]),
            torch.cat([record[1] for record in step]),
            torch.cat([record[2] for record in step]),
            prob_threshold=trainer.args.prob_threshold,
            entropy_quantile=trainer.args.entropy_quantile,
        )
        yield step, applied, recomputed


def test_generation_statistics_equal_loss_time_statistics_on_policy(tmp_path):
    # steps_per_generation == gradient_accumulation_steps and num_iterations == 1: one generation per optimizer step.
    config = tiny_config(
        STAPOConfig,
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        prob_threshold=TEST_PROB_THRESHOLD,
        token_stats_source="generation",
    )
    trainer = tiny_trainer(RecordingSTAPOTrainer, config)
    trainer.train()
    masked = 0
    for step, applied, recomputed in masks_from_loss_time_statistics(trainer):
        for record in step:
            completion = record[2].bool()
            assert torch.allclose(record[5][completion], record[3][completion], atol=1e-5)
            assert torch.allclose(record[6][completion], record[4][completion], atol=1e-5)
        assert torch.equal(applied, recomputed)
        masked += int(applied.sum())
    assert masked > 0


def test_loss_source_follows_the_policy_across_optimizer_steps(tmp_path):
    # Two optimizer steps per generation: the second step's loss-time policy has moved on since generation.
    config = tiny_config(
        STAPOConfig,
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=4,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        prob_threshold=TEST_PROB_THRESHOLD,
        token_stats_source="loss",
    )
    trainer = tiny_trainer(RecordingSTAPOTrainer, config)
    trainer.train()
    masked = 0
    for _, applied, recomputed in masks_from_loss_time_statistics(trainer):
        assert torch.equal(applied, recomputed)
        masked += int(applied.sum())
    assert masked > 0


@pytest.mark.parametrize("backend", ["torch", "liger"])
def test_direct_backends_agree_with_the_models_own_fused_head(tmp_path, backend):
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    head_trainer = tiny_trainer(
        STAPOTrainer, tiny_config(STAPOConfig, tmp_path, token_stats_backend="trl_fused_head"), model=model
    )
    direct = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, token_stats_backend=backend), model=model)
    assert (head_trainer.token_stats.backend, direct.token_stats.backend) == ("trl_fused_head", backend)
    head_trainer.model.train()
    batch = head_trainer._generate_and_score_completions([{"prompt": f"{i}+1="} for i in range(8)])
    completion = batch["completion_mask"].bool()
    assert completion.sum() > 0
    want_log_probs, want_entropies = head_trainer.token_stats.compute(batch)
    got_log_probs, got_entropies = direct.token_stats.compute(batch)
    assert torch.allclose(got_log_probs[completion], want_log_probs[completion], atol=1e-5)
    assert torch.allclose(got_entropies[completion], want_entropies[completion], atol=1e-5)
    assert torch.all(got_log_probs[~completion] == 0)


def test_models_with_logit_soft_capping_use_the_models_own_head(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    model.config.final_logit_softcapping = 30.0
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path), model=model)
    assert trainer.token_stats.backend == "trl_fused_head"
    with pytest.raises(ValueError, match="final_logit_softcapping.*Use token_stats_backend='trl_fused_head'"):
        tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, token_stats_backend="torch"), model=model)


def test_sharded_training_uses_the_models_own_head_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr("stapo_trl.core.token_stats.statistics.sharding", lambda fsdp: "DeepSpeed ZeRO-3")
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path))
    assert trainer.token_stats.backend == "trl_fused_head"


def test_a_grpo_config_is_converted_keeping_its_values(tmp_path, caplog):
    config = tiny_config(GRPOConfig, tmp_path, loss_type="bnpo")
    with caplog.at_level(logging.WARNING, logger="stapo_trl.core.trainer"):
        trainer = tiny_trainer(STAPOTrainer, config)
    assert isinstance(trainer.args, STAPOConfig)
    assert trainer.args.use_s2t_mask and trainer.args.prob_threshold == 0.002
    assert trainer.args.loss_type == "bnpo"
    assert trainer.args.epsilon_high is None and trainer.epsilon_high == trainer.args.epsilon
    assert trainer.args.steps_per_generation == config.steps_per_generation
    assert "converted to a STAPOConfig" in caplog.text


def test_model_card_cites_stapo(tmp_path):
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path))
    trainer.create_model_card(model_name="tiny-stapo")
    card = (tmp_path / "README.md").read_text()
    assert "STAPO" in card
    assert "2602.15620" in card
    assert "@article{liu2026stapo" in card
    assert "Shiqi Liu" in card
