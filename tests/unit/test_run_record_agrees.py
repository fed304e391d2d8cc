"""One record per run: `stapo-trl train` builds the run's facts once from its log (`stapo_trl.diagnostics.run_record`) and writes
them to run_summary.json, and the end-of-run summary, the model card and `stapo-trl report` render that record: on a
recorded tiny run they state the same trends, with the same uncertainty, and the same numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import pytest
import yaml
from tiny import save_tiny_chat_model

from stapo_trl.cli import main
from stapo_trl.diagnostics.report import load_run
from stapo_trl.diagnostics.run_record import read_run_record


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A 5-step STAPO run of `stapo-trl train` on a tiny model, with a held-out evaluation and the token dump: its
    output dir, what it printed, its card, and what `stapo-trl report` printed and wrote."""
    tmp_path = tmp_path_factory.mktemp("recorded")
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
        "heldout_problems": 2,
        "dump_silenced_tokens": True,
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
    printed = []
    for command in (["train", "--config", str(path)], ["report", str(output_dir)]):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main(command) == 0
        printed.append(out.getvalue())
    return {
        "output_dir": output_dir,
        "summary": printed[0],
        "card": (output_dir / "README.md").read_text(),
        "report": printed[1],
        "markdown": (output_dir / "report" / "report.md").read_text(),
    }


def test_summary_card_and_report_state_the_same_trends(recorded_run):
    output_dir, summary_text = recorded_run["output_dir"], recorded_run["summary"]
    sentences = re.findall(r"^  (mean (?:reward|token entropy).*)$", summary_text, flags=re.MULTILINE)
    assert len(sentences) == 2, summary_text
    assert all("per step over 5 steps: " in sentence for sentence in sentences)  # a slope with its standard error

    card = recorded_run["card"]
    report_text = recorded_run["report"]
    markdown = (output_dir / "report" / "report.md").read_text()
    for sentence in sentences:
        assert f"- {sentence}." in card, sentence
        assert f"- {sentence}" in markdown, sentence
        assert f"  {sentence}" in report_text, sentence


FROM_THE_LOG = (
    "steps",
    "logged_steps",
    "last_logged_step",
    "trends",
    "reward_first",
    "reward_last",
    "token_rules",
    "shadow_token_rules",
    "optimization",
    "accuracy_before",
    "accuracy_after",
    "dump",
    "silenced_examples",
)
"""The record's fields that come from the log and the dump, which the report rebuilds from the same files."""


def test_the_summary_card_and_report_render_the_record_the_run_wrote(recorded_run):
    output_dir = recorded_run["output_dir"]
    record = read_run_record(output_dir)
    s2t = record.token_rules["s2t"]
    assert record.steps == 5 and record.logged_steps == 5 and s2t["candidates"] > 0
    assert record.accuracy_before["total"] == record.accuracy_after["total"] == 2
    assert record.dump["silenced"] == s2t["silenced_tokens"]

    # The report reads the log and the dump that the record was built from, and builds the same record.
    rebuilt = load_run(output_dir).record
    assert {name: getattr(rebuilt, name) for name in FROM_THE_LOG} == {
        name: getattr(record, name) for name in FROM_THE_LOG
    }
    assert set(dataclasses.asdict(record)) >= set(FROM_THE_LOG)

    # The same numbers in the end-of-run summary, the card and the report.
    summary, card, report, markdown = (recorded_run[key] for key in ("summary", "card", "report", "markdown"))
    rule = (
        f"{s2t['silenced_tokens']} of {s2t['candidates']} candidate tokens, in {s2t['silenced_steps']} of 5 steps "
        f"({s2t['silenced_fraction']:.3%} of loss tokens)"
    )
    assert f"\n  S2T silenced:             {rule}\n" in summary
    assert f"\n  S2T silenced: {rule}\n" in report and f"\n- S2T silenced: {rule}\n" in markdown
    assert (
        f"- S2T silenced {s2t['silenced_tokens']} tokens of {s2t['candidates']} candidates; mean silenced fraction "
        f"{s2t['silenced_fraction']:.4%} of loss tokens, last step {s2t['last_silenced_fraction']:.4%}" in card
    )
    assert f"- tau_h: median {s2t['threshold_median']:.3f} nats, last {s2t['threshold_last']:.3f}." in card
    assert f" | {s2t['threshold_median']:.3f} | " in markdown
    assert f"Over {record.logged_steps} logged steps (the last is step {record.last_logged_step})" in card
    assert f"| run | {record.steps} | " in markdown
    assert f" | {s2t['silenced_fraction']:.4%} | {s2t['silenced_tokens']} | {s2t['candidates']} | " in markdown

    before, after = record.accuracy_before, record.accuracy_after
    assert (
        f"  held-out greedy accuracy: {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
        f"(± {after['standard_error']:.3f} standard error, 2 problems)" in summary
    )
    assert (
        f"Held-out greedy accuracy (2 problems): {before['accuracy']:.3f} ± {before['standard_error']:.3f} before "
        f"training, {after['accuracy']:.3f} ± {after['standard_error']:.3f} after" in card
    )
    heldout = f"{before['accuracy']:.3f} ± {before['standard_error']:.3f} → {after['accuracy']:.3f} ± {after['standard_error']:.3f}"
    assert f"  held-out greedy accuracy: {heldout}" in report and f" | {heldout} | " in markdown

    grad_norm = record.optimization["grad_norm"]
    assert f" | {grad_norm['median']:.3g} ({grad_norm['max']:.3g}) | " in markdown
    assert f" | {record.dump['written']} / {record.dump['silenced']} |" in markdown
    for example in record.silenced_examples:
        assert f"\n    {example}\n" in summary
