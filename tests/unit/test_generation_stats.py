"""p and H recorded while `generate()` samples: equal to the no-grad statistics pass, and used instead of it.

The recorder hooks the LM head, so it sees the policy's logits before any logits processor: the statistics stay those
of ``softmax(logits / T)`` whatever top-k, top-p, min-p or a repetition penalty did to the sampling.
"""

import pytest
import torch
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer, spurious_token_mask
from stapo_trl.core.names import ENTROPIES_KEY, LOG_PROBS_KEY, TOOL_MASK_BEFORE_RULES_KEY
from stapo_trl.core.token_stats import statistics as token_stats_module
from stapo_trl.core.token_stats.generation import GenerationStatsRecorder

PROB_THRESHOLD = 0.2  # the tiny model is far less confident than a real one, so this makes S2T fire


class GenerationCapturingTrainer(STAPOTrainer):
    """Keeps the output of every training generation, and counts STAPO's own statistics passes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations, self.origins, self.statistics_passes = [], [], 0
        compute = self.token_stats.compute

        def counted(batch):
            self.statistics_passes += 1
            return compute(batch)

        self.token_stats.compute = counted

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.generations.append(output)
            self.origins.append(self.token_stats.origin)
        return output


def train(tmp_path, **overrides):
    values = {"max_steps": 2, "prob_threshold": PROB_THRESHOLD, "temperature": 0.9}
    values.update(overrides)
    trainer = tiny_trainer(GenerationCapturingTrainer, tiny_config(STAPOConfig, tmp_path, **values))
    trainer.train()
    return trainer


def s2t_mask(batch, log_probs, entropies, args):
    loss_mask = batch["completion_mask"].bool()
    if batch.get(TOOL_MASK_BEFORE_RULES_KEY) is not None:
        loss_mask &= batch[TOOL_MASK_BEFORE_RULES_KEY].bool()
    mask, _ = spurious_token_mask(
        log_probs,
        entropies,
        batch["advantages"],
        loss_mask,
        prob_threshold=args.prob_threshold,
        entropy_quantile=args.entropy_quantile,
    )
    return mask


SAMPLERS = {
    "plain": {},
    "top_p": {"top_p": 0.8},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.5},
}


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_recorded_statistics_equal_the_no_grad_pass_and_give_the_same_mask(tmp_path, sampler):
    trainer = train(tmp_path, **SAMPLERS[sampler])
    assert trainer.origins == ["generate", "generate"]
    assert trainer.statistics_passes == 0  # no extra forward

    # The first generation came from the initial weights; a fresh trainer holds them still.
    batch = trainer.generations[0]
    values = {"prob_threshold": PROB_THRESHOLD, "temperature": 0.9, **SAMPLERS[sampler]}
    fresh = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path / "fresh", **values))
    log_probs, entropies = fresh.token_stats.compute(batch)
    completion = batch["completion_mask"].bool()
    assert torch.allclose(batch[LOG_PROBS_KEY][completion], log_probs[completion], atol=1e-5)
    assert torch.allclose(batch[ENTROPIES_KEY][completion], entropies[completion], atol=1e-5)
    assert torch.all(batch[LOG_PROBS_KEY][~completion] == 0) and torch.all(batch[ENTROPIES_KEY][~completion] == 0)
    recorded = s2t_mask(batch, batch[LOG_PROBS_KEY], batch[ENTROPIES_KEY], trainer.args)
    assert torch.equal(recorded, s2t_mask(batch, log_probs, entropies, trainer.args))
    assert recorded.any(), "the comparison should cover silenced tokens"


def test_the_statistics_pass_runs_when_recording_is_not_possible(tmp_path, monkeypatch):
    monkeypatch.setattr(GenerationCapturingTrainer, "generation_stats_blocker", lambda self: "a test says so")
    trainer = train(tmp_path)
    assert trainer.origins == ["statistics_pass", "statistics_pass"]
    assert trainer.statistics_passes == 2


def test_a_model_that_soft_caps_its_logits_is_not_recorded(tmp_path):
    from tiny import build_char_tokenizer, build_tiny_qwen3

    model = build_tiny_qwen3(build_char_tokenizer())
    model.config.final_logit_softcapping = 30.0
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path), model=model)
    assert trainer.generation_stats_blocker() == (
        "the model transforms its logits after the LM head (final_logit_softcapping)"
    )


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        ("use_vllm", True, "vLLM generates the completions"),
        ("rollout_func", lambda prompts, trainer: {}, "a rollout_func generates the completions"),
        ("tools", [print], "tool calls make several generate() calls per completion"),
        ("_is_vlm", True, "vision-language model"),
    ],
)
def test_each_generation_path_that_cannot_be_recorded_says_why(tmp_path, attribute, value, reason):
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path))
    assert trainer.generation_stats_blocker() is None
    setattr(trainer, attribute, value)
    assert trainer.generation_stats_blocker() == reason


def test_the_loss_source_recomputes_only_after_the_policy_moved(tmp_path):
    # One generation per optimizer step: the policy has not moved since sampling, so the recording serves.
    trainer = train(tmp_path / "aligned", token_stats_source="loss")
    assert (trainer.origins, trainer.statistics_passes) == (["generate", "generate"], 0)
    # Two optimizer steps per generation: TRL runs its old-log-prob pass, which serves the first step; the second
    # step's two micro-batches get a pass under the updated policy.
    trainer = train(
        tmp_path / "two-steps",
        per_device_train_batch_size=4,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        token_stats_source="loss",
    )
    assert (trainer.origins, trainer.statistics_passes) == (["trl_pass"], 2)


def test_the_recorder_keeps_one_vocabulary_row_per_sequence_at_a_time():
    torch.manual_seed(0)
    vocab, batch, steps = 11, 3, 4
    head = torch.nn.Linear(5, vocab)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = head

        def forward(self, input_ids):
            return self.lm_head(torch.randn(input_ids.size(0), 1, 5))

    model, recorder = Model(), GenerationStatsRecorder(temperature=0.7)
    tokens = torch.randint(vocab, (batch, steps))
    logits = []
    with recorder.attached(model, model.lm_head):
        handle = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[:, -1]))
        model(input_ids=torch.zeros(batch, 6, dtype=torch.long))  # the prompt
        for step in range(steps - 1):
            model(input_ids=tokens[:, step : step + 1])
            assert recorder._pending.shape == (batch, vocab)  # only the newest distribution is kept whole
            assert all(row.shape == (batch,) for row in recorder._log_probs + recorder._entropies)
        handle.remove()
    log_probs, entropies = recorder.finish(tokens)
    expected = torch.log_softmax(torch.stack(logits, 1) / 0.7, -1)
    assert torch.allclose(log_probs, expected.gather(-1, tokens.unsqueeze(-1))[..., 0])
    assert torch.allclose(entropies, -(expected.exp() * expected).sum(-1))
    assert not model._forward_pre_hooks and not head._forward_hooks  # detached afterwards


@pytest.mark.parametrize(
    ("generation_kwargs", "reason"),
    [
        ({"num_beams": 2}, "beam search (num_beams=2 in generation_kwargs)"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive search (penalty_alpha=0.6 in generation_kwargs)"),
        ({"prompt_lookup_num_tokens": 3}, "prompt-lookup decoding (prompt_lookup_num_tokens=3 in generation_kwargs)"),
    ],
)
def test_decoding_that_runs_the_head_off_one_row_per_token_is_not_recorded(tmp_path, generation_kwargs, reason):
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, generation_kwargs=generation_kwargs))
    assert trainer.generation_stats_blocker() == reason


def test_beam_search_trains_with_the_statistics_pass(tmp_path):
    """Beam search runs the LM head on num_beams rows per completion and reorders them at each step; TRL's own test
    suite (`test_train_with_generation_kwargs`, num_beams=2) crashed STAPO's recorder before it was refused."""
    trainer = train(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2})
    assert trainer.origins == ["statistics_pass", "statistics_pass"]
    assert trainer.statistics_passes == 2
    assert trainer.state.log_history[-1]["train_loss"] is not None


def test_the_recorder_gives_up_when_its_rows_are_not_one_per_completion():
    recorder = GenerationStatsRecorder(temperature=1.0)
    head = torch.nn.Linear(4, 6)
    model = torch.nn.Module()
    model.forward = lambda input_ids: head(torch.randn(input_ids.size(0), 1, 4))
    with recorder.attached(model, head):
        model(input_ids=torch.zeros(4, 1, dtype=torch.long))  # four rows: two completions with two beams each
        model(input_ids=torch.zeros(4, 1, dtype=torch.long))
    assert recorder.finish(torch.zeros(2, 2, dtype=torch.long)) is None


def test_the_policy_is_unwrapped_once_per_model_object_not_at_every_generation(tmp_path, monkeypatch):
    """Unwrapping (accelerate's, with its PEFT check) runs at the first look at a model object, and again only when
    the trainer holds another one: two training generations of one model reuse it, and are still recorded."""
    trainer = tiny_trainer(
        GenerationCapturingTrainer, tiny_config(STAPOConfig, tmp_path, max_steps=2, prob_threshold=PROB_THRESHOLD)
    )
    looked_at = []
    original = token_stats_module.is_peft_model
    monkeypatch.setattr(token_stats_module, "is_peft_model", lambda model: looked_at.append(model) or original(model))
    held = trainer.model
    trainer.train()
    assert trainer.origins == ["generate", "generate"]
    assert len(looked_at) == (0 if trainer.model is held else 1)
    base, _, lm_head = trainer.token_stats.policy_parts()
    assert lm_head is base.get_output_embeddings()
    looked = len(looked_at)
    trainer.model = torch.nn.Sequential(trainer.model)  # stands for a wrapper put around the model
    monkeypatch.setattr(trainer.accelerator, "unwrap_model", lambda model, **kwargs: model[0])
    assert trainer.token_stats.policy_parts()[0] is base
    assert len(looked_at) == looked + 1, "another model object: unwrapped afresh"
