"""Every row of a DAPO-Math-17K file is checked, not just the first: a row in the wrong shape is named by its number
and the shape it should have, before a model loads."""

import json

import pytest

from stapo_trl.data import load_dapo_math
from stapo_trl.data.sources import DatasetSchemaError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_number_among_text_prompts_is_named_by_its_row(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(5)]
    path = write_jsonl(tmp_path / "numbers.jsonl", [*rows, {"prompt": 7, "solution": "8"}])
    with pytest.raises(DatasetSchemaError, match=r"row 5 \(counting from 0\): prompt is an int \(7\)"):
        load_dapo_math(path)


def test_sharegpt_messages_are_named_with_how_to_convert_them(tmp_path):
    rows = [
        {"prompt": [{"from": "human", "value": f"What is {i} + 1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(8)
    ]
    with pytest.raises(
        DatasetSchemaError, match=r"ShareGPT's \{from, value\} keys. Convert them to \{role, content\}"
    ):
        load_dapo_math(write_jsonl(tmp_path / "sharegpt.jsonl", rows))


def test_a_verl_row_whose_message_content_is_not_text_is_named(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(3)
    ]
    rows[2]["prompt"][0]["content"] = ["a", "list"]
    with pytest.raises(DatasetSchemaError, match=r"row 2 \(counting from 0\): the user message's content is a list"):
        load_dapo_math(write_jsonl(tmp_path / "content.jsonl", rows))


def test_well_formed_rows_still_load(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(4)]
    dataset = load_dapo_math(write_jsonl(tmp_path / "good.jsonl", rows))
    assert len(dataset) == 4 and dataset[3]["answer"] == "4"
