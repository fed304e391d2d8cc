"""`stapo-trl counterfactual` end to end on the tiny model: a `stapo-trl train` run that saves its generations, then
the replays, the table, the summary and the figure, and a second command that finds everything done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from stapo_trl.cli import main
from stapo_trl.research.counterfactual.arms import ARMS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tiny_model_dir) -> Path:
    root = tmp_path_factory.mktemp("counterfactual")
    recipe = {
        "model_name_or_path": str(tiny_model_dir),
        "method": "grpo",
        "shadow_token_rules": ["s2t"],
        "prob_threshold": 0.05,
        "dataset_name": "arithmetic",
        "num_train_problems": 16,
        "num_fewshot": 1,
        "reward_funcs": ["tiny.count_vowels_chat_reward"],
        "heldout_problems": 0,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "steps_per_generation": 2,
        "gradient_accumulation_steps": 1,
        "max_completion_length": 8,
        "max_steps": 4,
        "learning_rate": 0.05,
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.1,
        "lora_target_modules": ["q_proj", "v_proj"],
        "generation_states_every": 1,
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1,
        "output_dir": str(root / "run"),
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", "--config", str(root / "recipe.yaml")]) == 0
    return root / "run"


def test_counterfactual_replays_every_generation_and_writes_its_outputs(saved_run, capsys):
    assert main(["counterfactual", str(saved_run), "--probe_problems", "3"]) == 0
    printed = capsys.readouterr().out
    output = saved_run / "counterfactual"
    records = [json.loads(line) for line in (output / "records.jsonl").read_text().splitlines()]
    assert sorted({(r["generation"], r["arm"]) for r in records}) == [
        (generation, arm) for generation in (0, 1) for arm in sorted(ARMS)
    ]
    assert len(ARMS) == 8 and {"p_only", "low_p_high_h", "s2t_as_many_as_low_p_high_h"} < set(ARMS)
    provenance = records[0]["replayed_with"]
    assert provenance["packages"]["torch"] == torch.__version__ and provenance["threads"] == torch.get_num_threads()
    nones = [r for r in records if r["arm"] == "none"]
    assert all(r["reproduction_max_abs_difference"] == [0.0, 0.0] for r in nones)
    summary = json.loads((output / "summary.json").read_text())
    assert summary["generations"] == 2
    assert summary["reproduction_max_abs_difference"] == 0.0
    assert summary["silenced_tokens"] == sum(sum(r["silenced_per_step"]) for r in records if r["arm"] == "s2t") > 0
    measured = [r for r in records if r["arm"] == "s2t" and not r["same_as_none"]]
    for record in measured:
        for point in ("first_step", "generation"):
            values = record["points"][point]
            assert values["kl_from_state"] >= 0 and values["update_norm"] > 0
    table = (output / "table.md").read_text()
    assert "| s2t - lowest_p_outside_s2t | generation |" in table and "| | seed |" in table
    assert summary["primary"]["comparison"] == "s2t_as_many_as_low_p_high_h - low_p_high_h"
    assert summary["primary"]["seed_level"]["runs"] in ([], [saved_run.name])
    assert "| s2t - lowest_p_outside_s2t |" in table and "After the generation's first optimizer step" in table
    assert "| none itself (not a difference) |" in table
    assert (output / "counterfactual.png").stat().st_size > 10_000
    assert "largest difference 0.0" in printed
    assert "beside none's own entropy_change over the same generations: mean" in printed

    # Run again: every generation and arm is in the records, so nothing is replayed and nothing is appended.
    assert main(["counterfactual", str(saved_run), "--probe_problems", "3"]) == 0
    assert (output / "records.jsonl").read_text().count("\n") == len(records)
