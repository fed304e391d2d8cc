"""Counterfactual updates: saved generation states replay the recorded updates bit for bit, the arms differ only in
which tokens they silence, and each arm's selection and the summary's statistics, computed by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from peft import LoraConfig
from tiny import tiny_config, tiny_trainer, tools

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.names import SHADOW_SILENCED_KEY, SILENCED_KEY, TOOL_MASK_BEFORE_RULES_KEY
from stapo_trl.file_and_metric_names import REWARDS_KEY
from stapo_trl.research.counterfactual.arms import ArmSettings, StepTokens, lowest_p_outside, select_tokens
from stapo_trl.research.counterfactual.replay import replay_step, restore_start
from stapo_trl.research.counterfactual.study import CounterfactualOptions, arm_selections, reference_text, step_tokens
from stapo_trl.research.counterfactual.summary import (
    arm_values,
    comparison_cell,
    mean_interval,
    paired_differences,
    paired_differences_by_run,
    student_t_quantile,
    summarize,
    summary_table,
)
from stapo_trl.research.counterfactual.teacher_forced import kl_divergence, probe_sequences
from stapo_trl.research.generation_states import saved_generations

# --- the arms, by hand ------------------------------------------------------------------------------------------------
# Two responses of 4 tokens. Response 0 has a positive advantage, response 1 a negative one. In response 0, p is
# 0.001, 0.5, 0.0005, 0.001 and H is 0.1, 2.0, 0.4, 0.9: with prob_threshold 0.002 the candidates are tokens 0, 2 and
# 3 (H 0.1, 0.4, 0.9); tau_h, their 0.8-quantile, is 0.4 + 0.6 * 0.5 = 0.7, so S2T silences tokens 0 and 2.
TOKENS = StepTokens(
    log_probs=torch.log(torch.tensor([[0.001, 0.5, 0.0005, 0.001], [0.0001, 0.3, 0.2, 0.1]])),
    entropies=torch.tensor([[0.1, 2.0, 0.4, 0.9], [0.05, 1.0, 1.0, 1.0]]),
    advantages=torch.tensor([1.0, -1.0]),
    loss_mask=torch.ones(2, 4, dtype=torch.bool),
)
S2T = torch.tensor([[True, False, True, False], [False, False, False, False]])


def settings(seed=0):
    return ArmSettings(0.002, 0.8, S2T, torch.Generator().manual_seed(seed))


def test_the_s2t_arm_silences_what_the_mask_silences():
    assert torch.equal(select_tokens("s2t", TOKENS, settings()), S2T)


def test_none_silences_nothing_and_s2t_low_p_uses_a_hundredth_of_the_threshold():
    assert not select_tokens("none", TOKENS, settings()).any()
    # At 2e-5 no token of the positive response is a candidate (the 1e-4 token is in the negative response).
    assert not select_tokens("s2t_low_p", TOKENS, settings()).any()


def test_random_positive_draws_as_many_positive_tokens_as_s2t_silences():
    for seed in range(20):
        drawn = select_tokens("random_positive", TOKENS, settings(seed))
        assert int(drawn.sum()) == 2
        assert not drawn[1].any()  # the negative response is never drawn from


def test_lowest_p_outside_s2t_takes_the_least_likely_positive_tokens_s2t_keeps():
    chosen = select_tokens("lowest_p_outside_s2t", TOKENS, settings())
    # Outside S2T's tokens 0 and 2, the positive response keeps token 3 (p 0.001) and token 1 (p 0.5): both.
    assert chosen.tolist() == [[False, True, False, True], [False, False, False, False]]
    assert not (chosen & S2T).any()
    one = lowest_p_outside(TOKENS, S2T, 1)
    assert one.tolist() == [[False, False, False, True], [False, False, False, False]]


def test_p_only_silences_every_s2t_candidate_whatever_its_entropy():
    # The candidates of the positive response: tokens 0, 2 and 3 (p 0.001, 0.0005, 0.001); token 1 (p 0.5) is not.
    chosen = select_tokens("p_only", TOKENS, settings())
    assert chosen.tolist() == [[True, False, True, True], [False, False, False, False]]


def test_low_p_high_h_silences_the_candidates_s2t_keeps():
    # tau_h is 0.7: the candidate with H 0.9 is at or above it, so S2T keeps it and this arm silences it.
    chosen = select_tokens("low_p_high_h", TOKENS, settings())
    assert chosen.tolist() == [[False, False, False, True], [False, False, False, False]]
    assert not (chosen & S2T).any()


def test_s2t_as_many_as_low_p_high_h_draws_that_many_of_s2ts_tokens():
    drawn_tokens = set()
    for seed in range(20):
        drawn = select_tokens("s2t_as_many_as_low_p_high_h", TOKENS, settings(seed))
        assert int(drawn.sum()) == 1  # low_p_high_h silences one token
        assert not (drawn & ~S2T).any()  # only S2T's tokens (0 and 2) are drawn
        drawn_tokens.add(int(drawn[0].nonzero()[0]))
    assert drawn_tokens == {0, 2}


def test_the_arms_that_existed_before_keep_their_random_draws():
    # A random arm's draws are seeded by its position in ARMS: new arms go last, so the first study's records stay
    # reproducible.
    from stapo_trl.research.counterfactual.arms import ARMS

    assert list(ARMS)[:5] == ["none", "s2t", "s2t_low_p", "random_positive", "lowest_p_outside_s2t"]


def test_an_unknown_arm_is_refused_and_none_always_runs_first():
    with pytest.raises(ValueError, match="Unknown counterfactual arm 'spurious'"):
        select_tokens("spurious", TOKENS, settings())
    with pytest.raises(ValueError, match=r"Unknown arm\(s\) spurious; choose from none, s2t"):
        CounterfactualOptions(arms=("s2t", "spurious"))
    assert CounterfactualOptions(arms=("random_positive", "s2t")).arms == ("none", "s2t", "random_positive")


# --- the probe sets ---------------------------------------------------------------------------------------------------
def test_the_reference_response_of_an_arithmetic_problem_is_its_worked_solution():
    problem = "Jonas had 9 pencils and gave away 3. How many pencils does Jonas have left?"
    assert reference_text(problem, "6", "dapo") == "9 - 3 = 6\nAnswer: 6"
    assert reference_text(problem, "6", "boxed") == "9 - 3 = 6 The answer is \\boxed{6}."
    assert reference_text("What is the sum of the roots?", "7", "dapo") == "Answer: 7"


def test_probe_sequences_left_pad_prompts_and_right_pad_responses():
    sequences = probe_sequences([[5, 6, 7], [8]], [[1], [2, 3]], pad_token_id=0)
    assert sequences.input_ids.tolist() == [[5, 6, 7, 1, 0], [0, 0, 8, 2, 3]]
    assert sequences.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert sequences.response_mask.tolist() == [[True, False], [True, True]]


def test_kl_divergence_of_two_distributions():
    new = torch.log(torch.tensor([[0.5, 0.5], [1.0, 1e-30]]))
    old = torch.log(torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    expected = [0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), math.log(2)]
    assert kl_divergence(new, old).tolist() == pytest.approx(expected, abs=1e-6)


# --- the summary ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (4, 2.7764), (8, 2.3060), (24, 2.0639), (200, 1.9719)])
def test_student_t_quantile_matches_the_tables(df, expected):
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_mean_interval_is_the_t_interval():
    interval = mean_interval([1.0, 1.5, 2.0])
    half = 4.3027 * 0.5 / math.sqrt(3)
    assert (interval.mean, interval.low, interval.high) == pytest.approx((1.5, 1.5 - half, 1.5 + half), abs=1e-3)
    assert interval.reads() == "above 0"
    assert mean_interval([-1.0, 0.0, 1.0]).reads() == "includes 0"
    assert mean_interval([0.5]).reads() == "too few generations"


def record(generation, arm, silenced, entropy_change):
    points = {"generation": {"entropy_change": entropy_change}, "first_step": {"entropy_change": entropy_change}}
    return {"run": "r", "generation": generation, "arm": arm, "silenced_per_step": silenced, "points": points}


def test_paired_differences_count_only_generations_where_the_first_arm_silenced_a_token():
    records = [
        record(0, "s2t", [1, 0], -0.5),
        record(0, "none", [0, 0], -0.75),
        record(1, "s2t", [0, 0], -0.25),
        record(1, "none", [0, 0], -0.25),
        record(2, "s2t", [0, 3], 0.25),
        record(2, "none", [0, 0], 0.0),
    ]
    assert paired_differences(records, "s2t", "none", "generation", "entropy_change") == [0.25, 0.25]
    assert paired_differences(records, "s2t", "none", "first_step", "entropy_change") == [0.25]


def test_a_comparison_can_be_read_over_the_generations_where_its_second_arm_silenced_a_token():
    # Generation 1: low_p_high_h silenced 3 tokens, its count-matched partner none (S2T had none to draw).
    records = [
        record(0, "low_p_high_h", [2, 1], -0.5),
        record(0, "s2t_as_many_as_low_p_high_h", [1, 1], -0.25),
        record(1, "low_p_high_h", [0, 3], -0.75),
        record(1, "s2t_as_many_as_low_p_high_h", [0, 0], 0.0),
    ]
    pair = ("s2t_as_many_as_low_p_high_h", "low_p_high_h", "generation", "entropy_change")
    assert paired_differences(records, *pair) == [0.25]
    assert paired_differences_by_run(records, *pair, selected_by="low_p_high_h") == {"r": [0.25, 0.75]}
    assert comparison_cell(records, *pair, selected_by="low_p_high_h")["mean"] == 0.5


def test_the_none_arms_own_change_is_read_over_the_generations_where_s2t_silenced_a_token():
    records = [
        record(0, "s2t", [1, 0], -0.5),
        record(0, "none", [0, 0], -0.75),
        record(1, "s2t", [0, 0], -0.25),
        record(1, "none", [0, 0], -2.0),
        record(2, "s2t", [0, 3], 0.25),
        record(2, "none", [0, 0], -0.25),
    ]
    assert arm_values(records, "none", "s2t", "generation", "entropy_change") == [-0.75, -0.25]
    assert arm_values(records, "none", "s2t", "first_step", "entropy_change") == [-0.75]
    own = summarize(records)["none_over_the_same_generations"]["generation"]["entropy_change"]
    assert (own["n"], own["mean"]) == (2, -0.5)
    assert "| none itself (not a difference) | generation | -0.5 [" in summary_table(summarize(records))


def test_the_seed_level_interval_averages_each_run_first():
    # Run a: differences 0.25 and 0.75 (mean 0.5); run b: -0.25 (one generation); run c: 0.5 and 1.0 (mean 0.75).
    records = []
    for run, generation, difference in (("a", 0, 0.25), ("a", 1, 0.75), ("b", 0, -0.25), ("c", 0, 0.5), ("c", 1, 1.0)):
        records += [
            {**record(generation, "s2t", [1, 0], difference), "run": run},
            {**record(generation, "none", [0, 0], 0.0), "run": run},
        ]
    cell = summarize(records)["comparisons"]["s2t - none"]["generation"]["entropy_change"]
    assert (cell["n"], cell["mean"]) == (5, pytest.approx(0.45))
    seed_level = cell["seed_level"]
    assert seed_level["runs"] == ["a", "b", "c"]
    assert seed_level["values"] == [0.5, -0.25, 0.75]
    half = 4.3027 * statistics.stdev([0.5, -0.25, 0.75]) / math.sqrt(3)
    assert (seed_level["mean"], seed_level["low"], seed_level["high"]) == pytest.approx(
        (1 / 3, 1 / 3 - half, 1 / 3 + half), abs=1e-3
    )


def test_grad_norm_ratios_count_the_steps_in_which_the_arm_silenced_a_token():
    records = [
        {"run": "r", "generation": 0, "arm": "none", "silenced_per_step": [0, 0, 0], "grad_norms": [1.0, 2.0, 4.0]},
        {"run": "r", "generation": 0, "arm": "s2t", "silenced_per_step": [0, 3, 1], "grad_norms": [1.0, 1.0, 8.0]},
        {"run": "r", "generation": 1, "arm": "none", "silenced_per_step": [0], "grad_norms": [1.0]},
        {"run": "r", "generation": 1, "arm": "s2t", "silenced_per_step": [0], "grad_norms": [1.0]},
    ]
    ratios = summarize(records)["grad_norm_ratio_vs_none"]["s2t"]
    # Steps 1 and 2 of generation 0: ratios 0.5 and 2.0, geometric mean 1.
    assert ratios == {"steps": 2, "geometric_mean": pytest.approx(1.0), "median": 1.25, "min": 0.5, "max": 2.0}


def test_the_silenced_token_profile_is_the_median_of_the_steps_medians():
    profile = [{"log_prob_median": math.log(0.001), "entropy_median": 1.0}, {"log_prob_median": None}]
    records = [
        {"run": "r", "generation": 0, "arm": "s2t", "silenced_per_step": [2, 0], "silenced_profile": profile},
        {
            "run": "r",
            "generation": 1,
            "arm": "s2t",
            "silenced_per_step": [1],
            "silenced_profile": [{"log_prob_median": math.log(0.003), "entropy_median": 3.0}],
        },
    ]
    assert summarize(records)["silenced_token_profile"]["s2t"] == {
        "steps": 2,
        "median_p": pytest.approx(0.002),
        "median_entropy": 2.0,
    }


# --- replaying saved generations on the tiny model ----------------------------------------------------------------------
# Two optimizer steps per generation (the second off-policy), LoRA dropout on, so that a replay must restore each
# micro-batch's random state to draw the same dropout masks.
COMMON = {
    "prob_threshold": 0.05,  # the tiny model spreads its probabilities: candidates are common at this threshold
    "steps_per_generation": 2,
    "gradient_accumulation_steps": 1,
    "per_device_train_batch_size": 4,
    "max_steps": 4,
    "loss_type": "dapo",
}


def lora():
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def trained_with_states(tmp_path, **rules):
    trainer = tiny_trainer(
        STAPOTrainer,
        tiny_config(STAPOConfig, tmp_path / "run", **COMMON, **rules),
        peft_config=lora(),
        callbacks=tools(generation_states_every=1),
    )
    trainer.train()
    return trainer, saved_generations(tmp_path / "run")


def fresh_trainer(tmp_path, **rules):
    trainer = tiny_trainer(
        STAPOTrainer, tiny_config(STAPOConfig, tmp_path / "replay", **COMMON, **rules), peft_config=lora()
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=trainer.args.max_steps)
    return trainer


def replayed(trainer, generation, arm_masks):
    """Replay every step of ``generation`` with ``arm_masks[k]`` silenced; the trainable parameters after each step."""
    restore_start(trainer, generation.start())
    after = []
    for index in range(generation.optimizer_steps):
        replay_step(trainer, generation.step(index), arm_masks[index])
        model = trainer.accelerator.unwrap_model(trainer.model)
        after.append({name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad})
    return after


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """GRPO with S2T in shadow, states saved at every generation."""
    return trained_with_states(tmp_path_factory.mktemp("grpo"), use_s2t_mask=False, shadow_token_rules=["s2t"])


def test_saved_states_hold_every_generation_and_step(grpo_run):
    trainer, generations = grpo_run
    assert [g.generation for g in generations] == [0, 1]
    assert [g.first_global_step for g in generations] == [0, 2]
    step = generations[1].step(1)
    assert step.global_step == 3
    assert len(step.random_states) == 1  # one micro-batch per optimizer step
    rewards = step.batches[0][REWARDS_KEY]
    assert rewards.shape == (4, 1) and torch.isfinite(rewards).all()


def test_the_none_arm_reproduces_every_recorded_update_bit_for_bit(grpo_run, tmp_path):
    _, generations = grpo_run
    trainer = fresh_trainer(tmp_path, use_s2t_mask=False, shadow_token_rules=["s2t"])
    for generation in generations:
        steps = [generation.step(index) for index in range(generation.optimizer_steps)]
        nothing = [torch.zeros_like(step.batches[0]["completion_mask"], dtype=torch.bool) for step in steps]
        for after, step in zip(replayed(trainer, generation, nothing), steps, strict=True):
            assert after.keys() == step.trainable_after.keys()
            for name, value in step.trainable_after.items():
                assert torch.equal(after[name], value), (generation.generation, step.global_step, name)


def test_every_arm_starts_from_the_saved_state_however_many_arms_ran_before_it(grpo_run, tmp_path):
    """`run_generation` loads a generation's start once and restores it before each arm. Restoring must copy the
    optimizer's moments and step counts (torch's ``load_state_dict`` keeps the given tensors, which the next
    ``optimizer.step()`` updates in place): the none arm replayed after two other replays from the same loaded start
    still reproduces the recorded updates, and the loaded start is left as it was."""
    _, generations = grpo_run
    generation = generations[1]  # the first step of generation 0 starts from an empty optimizer state
    start = generation.start()
    assert start["optimizer"]["state"], "the optimizer state is empty: the test would show nothing"
    untouched = generation.start()
    trainer = fresh_trainer(tmp_path, use_s2t_mask=False, shadow_token_rules=["s2t"])
    steps = [generation.step(index) for index in range(generation.optimizer_steps)]
    nothing = [torch.zeros_like(step.batches[0]["completion_mask"], dtype=torch.bool) for step in steps]
    some = [mask.clone() for mask in nothing]
    some[0][0, 0] = True
    for masks in (some, nothing, nothing):
        restore_start(trainer, start)
        for step, mask in zip(steps, masks, strict=True):
            replay_step(trainer, step, mask)
    model = trainer.accelerator.unwrap_model(trainer.model)
    for name, value in steps[-1].trainable_after.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    for key, saved in untouched["optimizer"]["state"].items():
        for field, value in saved.items():
            assert torch.equal(start["optimizer"]["state"][key][field], value), (key, field)


def test_arms_that_start_from_the_none_arms_state_give_the_records_of_a_full_replay(grpo_run, tmp_path, monkeypatch):
    """`share_quiet_steps`: an arm quiet in a generation's first step starts from ``none``'s state after it and takes
    ``none``'s first-step readout; every number in its record is what replaying all its steps gives."""
    from stapo_trl.research.counterfactual import study

    _, generations = grpo_run
    generation = generations[1]
    steps = [generation.step(index) for index in range(generation.optimizer_steps)]
    quiet = torch.zeros_like(steps[0].batches[0]["completion_mask"], dtype=torch.bool)
    some = quiet.clone()
    some[0, :2] = some[2, 1] = True
    masks = {"none": [quiet, quiet], "s2t": [quiet, some], "random_positive": [some, quiet]}
    monkeypatch.setattr(study, "arm_selections", lambda *args: {arm: masks[arm] for arm in args[-1].arms})
    trainer = fresh_trainer(tmp_path, use_s2t_mask=False, shadow_token_rules=["s2t"])
    tokenizer = trainer.processing_class
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    probe = study.ProbeSet(prompts, probe_sequences(prompts, [[12, 13, 14], [15, 16]], tokenizer.pad_token_id))
    records = {}
    for share in (False, True):
        options = study.CounterfactualOptions(arms=tuple(masks), probe_problems=2, share_quiet_steps=share)
        records[share] = study.run_generation(trainer, generation, probe, options)
    assert [record["replayed_from_step"] for record in records[True]] == [0, 1, 0]
    assert [record["replayed_from_step"] for record in records[False]] == [0, 0, 0]
    for full, shared in zip(records[False], records[True], strict=True):
        for key in ("seconds", "replayed_from_step"):
            full.pop(key), shared.pop(key)
        assert shared == full, full["arm"]
    s2t = records[True][1]
    assert s2t["points"]["first_step"] == records[True][0]["points"]["first_step"]
    assert s2t["points"]["generation"] != records[True][0]["points"]["generation"]


def test_the_s2t_arm_selects_what_s2t_in_shadow_would_have_silenced(grpo_run):
    trainer, generations = grpo_run
    silenced_somewhere = False
    for generation in generations:
        steps = [generation.step(index) for index in range(generation.optimizer_steps)]
        selections = arm_selections(generation, steps, trainer.args, CounterfactualOptions())
        for step, s2t in zip(steps, selections["s2t"], strict=True):
            shadow = torch.cat([batch[SHADOW_SILENCED_KEY] for batch in step.batches])
            assert torch.equal(s2t, shadow)
            silenced_somewhere |= bool(s2t.any())
    assert silenced_somewhere, "the run silenced nothing in shadow: the test would show nothing"


def test_an_arm_changes_only_which_tokens_the_loss_keeps(grpo_run, tmp_path, monkeypatch):
    """The batches TRL's loss sees under two arms hold the same completions, advantages and statistics; only the
    keep-mask (``tool_mask``), the renormalised count and the silenced tokens differ."""
    _, generations = grpo_run
    trainer = fresh_trainer(tmp_path, use_s2t_mask=False, shadow_token_rules=["s2t"])
    seen = []
    original = STAPOTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        seen.append(dict(inputs))
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(STAPOTrainer, "compute_loss", recording)
    step = generations[0].step(0)
    silenced = torch.zeros_like(step.batches[0]["completion_mask"], dtype=torch.bool)
    silenced[0, 0] = silenced[1, 2] = True
    for mask in (torch.zeros_like(silenced), silenced):
        restore_start(trainer, generations[0].start())
        replay_step(trainer, step, mask)
    nothing, some = seen
    changed = {key for key in nothing if not _same(nothing[key], some[key])}
    assert changed == {"tool_mask", "num_items_in_batch", SILENCED_KEY}
    before = step.batches[0][TOOL_MASK_BEFORE_RULES_KEY]
    keep = (~silenced).float() if before is None else before * (~silenced).float()
    assert torch.equal(some["tool_mask"], keep)
    # One generation feeds two optimizer steps of one micro-batch: TRL's count is the generation's, and each silenced
    # token is subtracted steps_per_generation / gradient_accumulation_steps = 2 times, as in training.
    assert int(nothing["num_items_in_batch"] - some["num_items_in_batch"]) == 2 * 2


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_the_s2t_arm_reproduces_a_stapo_run_and_the_none_arm_does_not(tmp_path):
    """Replayed under the S2T arm, a run that trained with the mask applied gets its recorded updates back: the arms
    renormalise exactly as training does."""
    _, generations = trained_with_states(tmp_path)
    trainer = fresh_trainer(tmp_path)
    differs = False
    for generation in generations:
        steps = [generation.step(index) for index in range(generation.optimizer_steps)]
        s2t = [torch.cat([batch[SILENCED_KEY] for batch in step.batches]) for step in steps]
        for after, step in zip(replayed(trainer, generation, s2t), steps, strict=True):
            for name, value in step.trainable_after.items():
                assert torch.equal(after[name], value), (generation.generation, step.global_step, name)
        if any(mask.any() for mask in s2t):
            nothing = [torch.zeros_like(mask) for mask in s2t]
            last = replayed(trainer, generation, nothing)[-1]
            differs |= any(not torch.equal(last[n], v) for n, v in steps[-1].trainable_after.items())
    assert differs, "S2T silenced nothing in this run: the comparison with 'none' would show nothing"


def test_step_tokens_pool_the_micro_batches_of_a_step(grpo_run):
    _, generations = grpo_run
    step = generations[0].step(0)
    tokens = step_tokens(step.batches)
    assert tokens.log_probs.shape == step.batches[0]["completion_ids"].shape
    assert tokens.loss_mask.dtype == torch.bool


def test_saving_states_needs_a_token_rule_and_one_process(tmp_path):
    with pytest.raises(ValueError, match="no token rule is on or in shadow"):
        tiny_trainer(
            STAPOTrainer,
            tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False),
            callbacks=tools(generation_states_every=1),
        )
    with pytest.raises(ValueError, match="generation_states_every must be an integer >= 0"):
        tools(generation_states_every=-1)


def test_a_run_whose_rules_read_the_loss_policy_is_refused_when_a_generation_feeds_several_steps(tmp_path):
    from stapo_trl.research.counterfactual.study import CounterfactualError, check_statistics_source
    from stapo_trl.research.generation_states import SavedGeneration

    loss = tiny_config(STAPOConfig, tmp_path, token_stats_source="loss")
    generation = tiny_config(STAPOConfig, tmp_path)
    several = [SavedGeneration(tmp_path, 0, 0, 4)]
    with pytest.raises(CounterfactualError, match="token_stats_source: loss.*feed 4 optimizer steps"):
        check_statistics_source(loss, several)
    check_statistics_source(generation, several)  # the generating policy: the same saved state for every arm
    check_statistics_source(loss, [SavedGeneration(tmp_path, 0, 0, 1)])  # one step: the loss policy generated it


def test_a_run_without_saved_states_is_refused_before_anything_loads(tmp_path, capsys):
    from stapo_trl.cli import main

    (tmp_path / "recipe.yaml").write_text("# stapo-trl train --config r.yaml\nmethod: grpo\n")
    assert main(["counterfactual", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "holds no complete saved generation" in error and "generation_states_every: 1" in error


def test_a_generation_that_a_resumed_run_entered_midway_is_not_saved(tmp_path):
    """A run resumed inside a generation generates that generation's batches again: its saved steps would mix two
    generations, so the writer saves none of it and leaves it incomplete; the next generation is saved whole."""
    from stapo_trl.research.generation_states import GenerationStateWriter

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batch = {"completion_ids": torch.zeros(1, 2, dtype=torch.long)}
    first = GenerationStateWriter(tmp_path, every=1, optimizer_steps_per_generation=2)
    first.step_started(0, model, optimizer, scheduler, [batch])
    first.micro_batch_started()
    first.step_ended(model)  # the first process stops after step 0 of generation 0
    resumed = GenerationStateWriter(tmp_path, every=1, optimizer_steps_per_generation=2)
    for global_step in (1, 2, 3):
        resumed.step_started(global_step, model, optimizer, scheduler, [batch])
        resumed.micro_batch_started()
        resumed.step_ended(model)
    assert [g.generation for g in saved_generations(tmp_path)] == [1]
    assert not (tmp_path / "generation_states" / "generation-00000" / "step-1.pt").exists()


# --- skipping the frozen layers ----------------------------------------------------------------------------------------
def last_layer_lora():
    """LoRA on the tiny model's second layer only: its first layer is frozen, without dropout."""
    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        target_modules=["q_proj", "v_proj"],
        layers_to_transform=[1],
        task_type="CAUSAL_LM",
    )


def test_replays_that_skip_the_frozen_layers_still_reproduce_the_run_bit_for_bit(tmp_path):
    from stapo_trl.research.counterfactual.replay import record_frozen_inputs

    rules = {"use_s2t_mask": False, "shadow_token_rules": ["s2t"]}
    run = tiny_trainer(
        STAPOTrainer,
        tiny_config(STAPOConfig, tmp_path / "run", **COMMON, **rules),
        peft_config=last_layer_lora(),
        callbacks=tools(generation_states_every=1),
    )
    run.train()
    trainer = tiny_trainer(
        STAPOTrainer, tiny_config(STAPOConfig, tmp_path / "replay", **COMMON, **rules), peft_config=last_layer_lora()
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=trainer.args.max_steps)
    for generation in saved_generations(tmp_path / "run"):
        restore_start(trainer, generation.start())
        for index in range(generation.optimizer_steps):
            step = generation.step(index)
            frozen = record_frozen_inputs(trainer, step)
            assert frozen is not None and len(frozen) == len(step.batches)
            nothing = torch.zeros_like(step.batches[0]["completion_mask"], dtype=torch.bool)
            replay_step(trainer, step, nothing, frozen)
            model = trainer.accelerator.unwrap_model(trainer.model)
            for name, value in step.trainable_after.items():
                assert torch.equal(dict(model.named_parameters())[name], value), (step.global_step, name)


def test_a_readout_that_skips_the_frozen_layers_reads_what_a_full_one_reads(tmp_path):
    from stapo_trl.research.counterfactual.teacher_forced import FrozenInputs, read_policy

    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, **COMMON), peft_config=last_layer_lora())
    model = trainer.accelerator.unwrap_model(trainer.model)
    sequences = probe_sequences([[5, 6, 7, 8], [9, 10]] * 6, [[11, 12, 1], [13]] * 6, pad_token_id=0)
    full = read_policy(model, sequences, temperature=1.0, keep_distributions=True)
    frozen = FrozenInputs()
    recorded = read_policy(model, sequences, temperature=1.0, keep_distributions=True, frozen=frozen)
    assert frozen.recorded is not None and all(chunk is not None for chunk in frozen.recorded)
    replayed = read_policy(model, sequences, temperature=1.0, keep_distributions=True, frozen=frozen)
    for readout in (recorded, replayed):
        assert torch.equal(readout.log_probs, full.log_probs)
        assert torch.equal(readout.entropies, full.entropies)
        assert torch.equal(readout.log_distributions, full.log_distributions)
