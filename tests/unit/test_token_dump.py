"""The silenced-token dump: the p-H histogram, the sampling, the records, the caps, resume, and the trainer option."""

import json
import math

import pytest
import torch
from tiny import build_char_tokenizer, tiny_config, tiny_trainer, tools

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.token_rules import StepTokens
from stapo_trl.diagnostics import token_dump
from stapo_trl.diagnostics.token_dump import (
    SilencedTokenDumpCallback,
    TokenDumpArguments,
    sample_positions,
    token_density,
    token_records,
)
from stapo_trl.file_and_metric_names import SILENCED_TOKENS_FILE, SILENCED_TOKENS_STATS_FILE

LN10 = math.log(10)


# ------------------------------------------------------------------------------------------- the histogram
def test_token_density_bins_by_log10_p_and_entropy_and_clamps_to_the_edges():
    # Bins: log10 p over [-10, 0] in 40 (0.25 decades), H over [0, 12] in 48 (0.25 nats).
    log_probs = torch.log(torch.tensor([[0.5, 0.001, 1e-12, 0.5, 0.5]], dtype=torch.float64))
    entropies = torch.tensor([[0.1, 5.0, 0.3, 20.0, float("nan")]])
    mask = torch.tensor([[True, True, True, True, True]])
    counts = token_density(log_probs, entropies, mask)
    assert counts.shape == (40, 48) and counts.dtype == torch.int64
    # log10 0.5 = -0.301 -> floor(9.699 / 10 * 40) = 38; H 0.1 -> 0.
    # log10 0.001 = -3 -> floor(7 / 10 * 40) = 28; H 5.0 -> 20.
    # 1e-12 is below the range -> bin 0; H 0.3 -> 1. H 20 is above the range -> bin 47. NaN is not counted.
    expected = {(38, 0): 1, (28, 20): 1, (0, 1): 1, (38, 47): 1}
    assert {tuple(index): int(counts[tuple(index)]) for index in counts.nonzero().tolist()} == expected


def test_token_density_counts_only_the_tokens_in_the_mask():
    log_probs = torch.log(torch.full((2, 3), 0.5))
    counts = token_density(log_probs, torch.ones(2, 3), torch.tensor([[True, False, True], [False, False, True]]))
    assert int(counts.sum()) == 3


# ------------------------------------------------------------------------------------------- the sampling
def test_sample_positions_keeps_every_position_under_the_limit_in_row_major_order():
    silenced = torch.tensor([[False, True, False], [True, False, True]])
    positions = sample_positions(silenced, 10, torch.Generator().manual_seed(0))
    assert positions.tolist() == [[0, 1], [1, 0], [1, 2]]


def test_sample_positions_draws_distinct_silenced_positions_reproducibly():
    silenced = torch.zeros(4, 10, dtype=torch.bool)
    silenced[:, ::2] = True  # 20 silenced positions
    first = sample_positions(silenced, 5, torch.Generator().manual_seed(3))
    again = sample_positions(silenced, 5, torch.Generator().manual_seed(3))
    assert first.tolist() == again.tolist()
    assert len({tuple(position) for position in first.tolist()}) == 5
    assert all(bool(silenced[row, column]) for row, column in first.tolist())


# ------------------------------------------------------------------------------------------- the records
def step_tokens(text_rows, silenced_positions, advantages, lengths=None):
    """StepTokens for rows of text under the character tokenizer; p = 0.01 and H = 0.5 at silenced positions."""
    tokenizer = build_char_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(list(text)) for text in text_rows]
    width = max(len(row) for row in ids)
    completion_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    loss_mask = torch.tensor([[column < len(row) for column in range(width)] for row in ids])
    silenced = torch.zeros_like(loss_mask)
    for row, column in silenced_positions:
        silenced[row, column] = True
    log_probs = torch.where(silenced, math.log(0.01), math.log(0.9)).float()
    entropies = torch.where(silenced, 0.5, 2.0).float()
    tokens = StepTokens(
        log_probs, entropies, torch.tensor(advantages), loss_mask, completion_ids=completion_ids, silenced=silenced
    )
    return tokenizer, tokens


def test_token_records_hold_the_token_its_context_p_h_and_the_advantage():
    tokenizer, tokens = step_tokens(["abcdefgh", "xyz"], [(0, 3)], [0.75, -1.0])
    (record,) = token_records(tokens, torch.tensor([[0, 3]]), tokenizer, step=7, process_index=0, context_tokens=2)
    assert record["token"] == "d" and record["token_id"] == tokens.completion_ids[0, 3]
    assert record["context_before"] == "bc" and record["context_after"] == "ef"
    assert record["step"] == 7 and record["sample_id"] == "7-0-0" and record["position"] == 3
    assert record["p"] == pytest.approx(0.01) and record["log_prob"] == pytest.approx(math.log(0.01))
    assert record["entropy"] == pytest.approx(0.5) and record["advantage"] == pytest.approx(0.75)


def test_token_records_stop_the_context_at_padding_and_read_per_token_advantages():
    tokenizer, tokens = step_tokens(["abcdefgh", "xyz"], [(1, 1)], [[0.0] * 8, [0.1, 0.2, 0.3] + [0.0] * 5])
    (record,) = token_records(tokens, torch.tensor([[1, 1]]), tokenizer, step=1, process_index=2, context_tokens=20)
    assert (record["context_before"], record["token"], record["context_after"]) == ("x", "y", "z")
    assert record["advantage"] == pytest.approx(0.2) and record["sample_id"] == "1-2-1"


# ------------------------------------------------------------------------------------------- the caps
def dump_for(directory, tokens_per_step=2, max_tokens=3):
    caps = {"dump_tokens_per_step": tokens_per_step, "dump_max_tokens": max_tokens, "dump_context_tokens": 2}
    dump = SilencedTokenDumpCallback(TokenDumpArguments(dump_silenced_tokens=True, **caps))
    dump.start(directory, build_char_tokenizer(), seed=0, probability_bound=0.05)
    return dump


STEP_SILENCED = {1: [(0, 0), (0, 2), (0, 4), (1, 1), (1, 3)], 2: [(0, 1), (0, 5), (1, 0), (1, 2)], 3: [(0, 6)]}


def record_steps(dump, steps):
    entries = []
    for step in steps:
        _, tokens = step_tokens(["abcdefgh", "ijklmnop"], STEP_SILENCED[step], [1.0, 0.5])
        entries.append(dump.record_step(step, tokens))
    return entries


def test_the_dump_writes_at_most_the_per_step_and_total_caps_and_counts_the_rest(tmp_path):
    dump = dump_for(tmp_path)
    entries = record_steps(dump, [1, 2, 3])
    # Step 1: 5 silenced, cap 2. Step 2: 4 silenced, 1 left of the total 3. Step 3: the total is spent.
    assert entries == [
        {"step": 1, "silenced": 5, "written": 2, "dropped": 3},
        {"step": 2, "silenced": 4, "written": 1, "dropped": 3},
        {"step": 3, "silenced": 1, "written": 0, "dropped": 1},
    ]
    records = [json.loads(line) for line in (tmp_path / SILENCED_TOKENS_FILE).read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 1, 2]
    for record in records:
        assert (0 if record["sample_id"].endswith("-0") else 1, record["position"]) in STEP_SILENCED[record["step"]]
    stats = json.loads((tmp_path / SILENCED_TOKENS_STATS_FILE).read_text())
    assert (stats["silenced"], stats["written"], stats["dropped"]) == (10, 3, 7)
    assert stats["probability_bound"] == 0.05 and stats["tokens_per_step"] == 2 and stats["max_tokens"] == 3
    # Every loss token of the 3 steps is in the density, all of them with a positive advantage.
    assert sum(map(sum, stats["density"]["positive_advantage"])) == 3 * 16
    assert sum(map(sum, stats["density"]["other"])) == 0


def test_a_resumed_dump_matches_an_uninterrupted_one(tmp_path):
    straight = dump_for(tmp_path / "straight", max_tokens=10)
    record_steps(straight, [1, 2, 3])

    interrupted = dump_for(tmp_path / "resumed", max_tokens=10)
    record_steps(interrupted, [1])
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    interrupted.save_state(checkpoint)
    record_steps(interrupted, [2])  # written after the checkpoint, then the run is killed
    resumed = dump_for(tmp_path / "resumed", max_tokens=10)
    assert resumed.load_state(checkpoint)
    record_steps(resumed, [2, 3])

    for name in (SILENCED_TOKENS_FILE, SILENCED_TOKENS_STATS_FILE):
        assert (tmp_path / "resumed" / name).read_text() == (tmp_path / "straight" / name).read_text(), name


def test_a_checkpoint_without_dump_state_is_reported(tmp_path):
    assert not dump_for(tmp_path).load_state(tmp_path)


# ------------------------------------------------------------------------------------------- in the trainer
S2T_EVERYWHERE = {"prob_threshold": 0.2, "temperature": 1.0}


def test_the_trainer_dumps_the_tokens_s2t_silenced(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, max_steps=3, **S2T_EVERYWHERE)
    trainer = tiny_trainer(STAPOTrainer, config, callbacks=tools(dump_silenced_tokens=True, dump_tokens_per_step=4))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    stats = json.loads((tmp_path / SILENCED_TOKENS_STATS_FILE).read_text())
    records = [json.loads(line) for line in (tmp_path / SILENCED_TOKENS_FILE).read_text().splitlines()]

    assert [entry["silenced"] for entry in stats["steps"]] == [entry["s2t/num_silenced"] for entry in steps]
    assert [entry["written"] for entry in stats["steps"]] == [entry["token_dump/written"] for entry in steps]
    assert [entry["dropped"] for entry in stats["steps"]] == [entry["token_dump/dropped"] for entry in steps]
    assert len(records) == stats["written"] > 0
    # The density holds every completion token of every step: 8 completions per step.
    density_total = sum(map(sum, stats["density"]["positive_advantage"])) + sum(map(sum, stats["density"]["other"]))
    assert density_total == sum(round(8 * entry["completions/mean_length"]) for entry in steps)
    tau_h = {entry["step"]: entry["s2t/entropy_threshold"] for entry in steps}
    for record in records:  # each dumped token meets the S2T rule of its step
        assert record["p"] < 0.2 and record["advantage"] > 0 and record["entropy"] < tau_h[record["step"]] + 1e-6
        assert record["token"] == trainer.processing_class.decode([record["token_id"]])


def test_the_dump_is_off_by_default_and_computes_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the dump ran while off")

    monkeypatch.setattr(token_dump, "token_density", fail)
    monkeypatch.setattr(token_dump.SilencedTokenDumpCallback, "record_step", fail)
    trainer = tiny_trainer(
        STAPOTrainer, tiny_config(STAPOConfig, tmp_path, max_steps=1, **S2T_EVERYWHERE), callbacks=tools()
    )
    trainer.train()
    assert not any(isinstance(c, token_dump.SilencedTokenDumpCallback) for c in trainer.callback_handler.callbacks)
    assert not (tmp_path / SILENCED_TOKENS_FILE).exists() and not (tmp_path / SILENCED_TOKENS_STATS_FILE).exists()
    assert not any(key.startswith("token_dump/") for entry in trainer.state.log_history for key in entry)


def test_the_dump_survives_checkpoint_and_resume_in_the_trainer(tmp_path):
    values = {"max_steps": 2, "save_strategy": "steps", "save_steps": 1}
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"

    def run(directory):
        config = tiny_config(STAPOConfig, directory, **values, **S2T_EVERYWHERE)
        return tiny_trainer(STAPOTrainer, config, callbacks=tools(dump_silenced_tokens=True))

    straight = run(straight_dir)
    straight.train()
    killed = run(resumed_dir)
    killed.train()  # as if killed after step 2: its checkpoint-1 is resumed below, over the files step 2 wrote
    assert (resumed_dir / "checkpoint-1" / SILENCED_TOKENS_STATS_FILE).is_file()
    resumed = run(resumed_dir)
    resumed.train(resume_from_checkpoint=str(resumed_dir / "checkpoint-1"))
    straight_steps = [
        json.loads(line)["step"] for line in (straight_dir / SILENCED_TOKENS_FILE).read_text().splitlines()
    ]
    again = [json.loads(line)["step"] for line in (resumed_dir / SILENCED_TOKENS_FILE).read_text().splitlines()]
    assert again == straight_steps and straight_steps.count(2) > 0  # step 2 is written once, not twice
    stats = json.loads((resumed_dir / SILENCED_TOKENS_STATS_FILE).read_text())
    assert [entry["step"] for entry in stats["steps"]] == [1, 2]


def test_a_run_without_token_rules_writes_no_dump(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, max_steps=1, use_s2t_mask=False)
    with pytest.warns(UserWarning, match="nothing to record"):
        trainer = tiny_trainer(STAPOTrainer, config, callbacks=tools(dump_silenced_tokens=True))
    trainer.train()
    assert not (tmp_path / SILENCED_TOKENS_FILE).exists()
