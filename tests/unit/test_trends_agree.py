"""The end-of-run summary of `stapo-trl train`, the model card and `stapo-trl report` state the same trends, with
the same uncertainty, for the same run: one function (`stapo_trl.diagnostics.trends`) writes every such sentence."""

from __future__ import annotations

import re

import yaml
from tiny import save_tiny_chat_model

from stapo_trl.cli import main


def test_summary_card_and_report_state_the_same_trends(tmp_path, capsys):
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    output_dir = tmp_path / "run"
    recipe = {
        "model_name_or_path": str(model_dir),
        "dataset_name": "sample",
        "prompt_style": "boxed",
        "reward_funcs": ["boxed", "tiny.count_vowels_chat_reward"],
        "max_prompt_tokens": 700,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 5,
        "learning_rate": 0.05,
        "prob_threshold": 0.2,
        "logging_steps": 1,
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "output_dir": str(output_dir),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", "--config", str(path)]) == 0
    summary_text = capsys.readouterr().out
    sentences = re.findall(r"^  (mean (?:reward|token entropy).*)$", summary_text, flags=re.MULTILINE)
    assert len(sentences) == 2, summary_text
    assert all("per step over 5 steps: " in sentence for sentence in sentences)  # a slope with its standard error

    card = (output_dir / "README.md").read_text()
    assert main(["report", str(output_dir)]) == 0
    report_text = capsys.readouterr().out
    markdown = (output_dir / "report" / "report.md").read_text()
    for sentence in sentences:
        assert f"- {sentence}." in card, sentence
        assert f"- {sentence}" in markdown, sentence
        assert f"  {sentence}" in report_text, sentence
