"""Drift guards: one test per private TRL API that STAPOTrainer relies on.

A TRL upgrade that changes one of these must fail here, loudly and by name, before it silently changes training.
"""

import inspect
import re

import pytest
import torch
import trl
from packaging.version import Version
from tiny import tiny_config, tiny_trainer
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from stapo_trl import STAPOConfig, STAPOTrainer


def test_trl_version_is_the_tested_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17"), (
        f"stapo-trl is tested with trl 1.16.x, found {trl.__version__}: rerun this suite before widening the pin."
    )


def test_our_loss_type_choices_are_exactly_trls():
    from stapo_trl.core.config import LOSS_TYPES

    source = inspect.getsource(GRPOTrainer._compute_loss)
    named = set(re.findall(r'self\.loss_type == "(\w+)"', source))
    for group in re.findall(r"self\.loss_type in \[([^\]]+)\]", source):
        named |= set(re.findall(r'"(\w+)"', group))
    assert named == set(LOSS_TYPES)


def test_compute_loss_uses_one_mask_from_completion_and_tool_masks():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]' in source
    for aggregation in (
        "(per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",  # grpo
        "(per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)",  # bnpo
        'inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',  # dapo, cispo, vespo
        "normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation",
    ):
        assert aggregation in source, aggregation


def test_every_per_token_loss_is_linear_in_a_sign_gated_advantage():
    # Token-rule weights ride on [B, T] advantages. That scales each token's policy term, clip included, only while
    # every loss multiplies the advantage and reads it otherwise through its sign alone.
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert "if advantages.dim() == 1:\n            advantages = advantages.unsqueeze(1)" in source
    for term in (
        "per_token_loss = -clamped_ratios * advantages * per_token_logps",  # cispo
        "per_token_loss1 = coef_1 * advantages",  # grpo, bnpo, dr_grpo, dapo, luspo
        "per_token_loss2 = coef_2 * advantages",
        "temperatures = torch.where(advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg)",
        "per_token_loss = -soft_coef_1 * advantages",  # sapo
        "per_token_loss = -phi_seq * advantages * per_token_logps",  # vespo
    ):
        assert term in source, term
    assert "is_nonneg_adv = advantages >= 0" in inspect.getsource(GRPOTrainer.get_gamma_weights)
    assert "is_pos_adv = advantages >= 0" in inspect.getsource(GRPOTrainer.get_off_policy_mask)


def test_checkpoint_hooks_we_extend_exist():
    from transformers import Trainer

    assert list(inspect.signature(Trainer._save_optimizer_and_scheduler).parameters) == ["self", "output_dir"]
    assert list(inspect.signature(Trainer._load_optimizer_and_scheduler).parameters) == ["self", "checkpoint"]
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in inspect.getsource(Trainer)
    assert list(inspect.signature(Trainer.train).parameters)[:2] == ["self", "resume_from_checkpoint"]


def test_trainer_state_json_is_the_last_file_a_checkpoint_save_writes():
    """`stapo_trl.core.resume` treats a checkpoint without trainer_state.json as interrupted; STAPO's own state is
    written by `_save_optimizer_and_scheduler`, which must run before it."""
    from transformers import Trainer
    from transformers.trainer import TRAINER_STATE_NAME

    from stapo_trl.core.names import TRAINER_STATE_FILE

    assert TRAINER_STATE_NAME == TRAINER_STATE_FILE
    source = inspect.getsource(Trainer._save_checkpoint)
    optimizer = source.index("self._save_optimizer_and_scheduler(output_dir)")
    state = source.index("self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))")
    assert optimizer < state
    assert source.index("self.save_model(output_dir") < state
    assert source.index("self._save_rng_state(output_dir)") < state


def test_the_model_card_hooks_we_extend_exist():
    """STAPOTrainer.create_model_card calls TRL's, then rebuilds the card keeping the template's "## Training
    procedure" (tracker links, framework versions) and "## Citations" sections as TRL rendered them; TRL writes the
    card when it saves a checkpoint, and transformers on push_to_hub."""
    from importlib import resources

    from transformers import Trainer

    from stapo_trl.card.model_card import TRL_CITATIONS_HEADING, TRL_TRAINING_HEADING

    parameters = list(inspect.signature(GRPOTrainer.create_model_card).parameters)
    assert parameters == ["self", "model_name", "dataset_name", "tags"]
    template = resources.files("trl").joinpath("templates/lm_model_card.md").read_text()
    assert TRL_CITATIONS_HEADING in template and TRL_TRAINING_HEADING in template
    assert (
        template.index(TRL_TRAINING_HEADING)
        < template.index("### Framework versions")
        < template.index(TRL_CITATIONS_HEADING)
    )
    assert "self.create_model_card(" in inspect.getsource(GRPOTrainer._save_checkpoint)
    assert "self.create_model_card(" in inspect.getsource(Trainer.push_to_hub)
    assert "upload_folder(" in inspect.getsource(Trainer.push_to_hub)


def test_generation_counts_loss_tokens_with_the_same_mask():
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask" in source
    assert "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()" in source
    assert "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(" in source


def test_prepare_inputs_buffers_micro_batches_by_step():
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in source
    assert "shuffle_sequence_dict(generation_batch)" in source
    assert "split_tensor_dict(generation_batch, self.args.steps_per_generation)" in source


def test_shuffle_and_split_carry_extra_keys():
    batch = {
        "completion_ids": torch.arange(8).view(4, 2),
        "stapo_log_probs": torch.arange(8.0).view(4, 2),
        "stapo_tool_mask_before_rules": None,
        "num_items_in_batch": torch.tensor(8),
    }
    shuffled = shuffle_sequence_dict(batch)
    assert torch.equal(shuffled["stapo_log_probs"], shuffled["completion_ids"].float())
    chunks = split_tensor_dict(shuffled, 2)
    assert [chunk["stapo_log_probs"].shape[0] for chunk in chunks] == [2, 2]
    assert all(chunk["stapo_tool_mask_before_rules"] is None for chunk in chunks)
    assert all(chunk["num_items_in_batch"] is batch["num_items_in_batch"] for chunk in chunks)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    config = tiny_config(STAPOConfig, tmp_path_factory.mktemp("drift"), prob_threshold=0.05)
    return tiny_trainer(STAPOTrainer, config)


def test_trainer_state_we_read_exists(trainer):
    for attribute in ("_step", "_buffered_inputs", "temperature", "_is_vlm", "_metrics", "accelerator"):
        assert hasattr(trainer, attribute), attribute
    assert isinstance(trainer._metrics["train"], dict)


def test_generation_output_has_the_keys_we_fold_into(trainer):
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": f"{i}+1="} for i in range(8)])
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"):
        assert key in output, key
    assert output["num_items_in_batch"].dim() == 0
    assert output["advantages"].shape == output["completion_ids"].shape[:1]


def test_log_averages_metric_lists_and_skips_nan(trainer):
    trainer.model.train()
    trainer._metrics["train"].clear()
    trainer._metrics["train"]["s2t/entropy_threshold"].extend([1.0, float("nan"), 3.0])
    trainer.log({})
    assert trainer.state.log_history[-1]["s2t/entropy_threshold"] == 2.0


def test_generation_runs_through_generate_single_turn_and_the_models_generate():
    """`STAPOTrainer._generate_single_turn` hooks the LM head around TRL's call of `unwrapped_model.generate`; the
    recording is exact only if TRL 1.16 still samples the whole batch in one `generate()` call there."""
    parameters = list(inspect.signature(GRPOTrainer._generate_single_turn).parameters)
    assert parameters[:2] == ["self", "prompt_ids"], (
        f"trl {trl.__version__}: GRPOTrainer._generate_single_turn changed its signature; check the "
        "generation-statistics seam in stapo_trl/core/trainer.py"
    )
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert source.count("unwrapped_model.generate(") == 1, (
        f"trl {trl.__version__}: _generate_single_turn no longer makes one generate() call; the recorder of p and H "
        "while sampling assumes it does"
    )
    assert "self._generate_single_turn(" in inspect.getsource(GRPOTrainer._generate)


def test_the_reference_pass_is_the_ref_model_or_the_policy_with_adapters_off_or_ref():
    """`STAPOTrainer._is_reference_forward` recognizes TRL's reference log-prob pass by its model: `self.ref_model`, or
    the policy inside `use_adapter(model, "ref" or None)` (a "ref" adapter, or every adapter disabled)."""
    from trl.trainer import utils as trl_utils

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "self._get_per_token_logps_and_entropies(\n                        self.ref_model," in source
    assert 'use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)' in source
    adapter_source = inspect.getsource(trl_utils.use_adapter)
    assert "model.disable_adapter()" in adapter_source and "model.set_adapter(adapter_name)" in adapter_source
