"""Data loaders: DAPO-Math-17K and the six benchmarks, read from the samples shipped in the repo through the same
`load_dataset` code path the Hub uses."""

import json

import pytest
from datasets import Dataset, load_dataset
from trl.data_utils import is_conversational

from stapo_trl.data import (
    BENCHMARKS,
    BOXED_INSTRUCTION,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    ROW_FEATURES,
    DatasetSchemaError,
    benchmark_answer,
    benchmark_spec,
    dedupe_by_problem,
    extract_problem,
    load_benchmark,
    load_dapo_math,
    sample_path,
)
from stapo_trl.data import sources as sources_module

SAMPLE_ROWS = [json.loads(line) for line in sample_path("dapo_math_17k").read_text().splitlines()]
UNIQUE_SAMPLE_PROBLEMS = len({row["prompt"][0]["content"] for row in SAMPLE_ROWS})


def _open_r1_rows():
    """The shipped sample converted to open-r1/DAPO-Math-17k-Processed's schema, as its create_dataset.py does."""
    return [
        {
            "prompt": row["prompt"][0]["content"],
            "solution": row["reward_model"]["ground_truth"],
            "data_source": row["data_source"],
            "source_prompt": row["prompt"],
            "ability": row["ability"],
            "reward_model": row["reward_model"],
            "extra_info": row["extra_info"],
        }
        for row in SAMPLE_ROWS
    ]


class TestDapoMath:
    def test_the_shipped_sample_has_duplicates_and_is_deduplicated_by_problem(self):
        assert len(SAMPLE_ROWS) > UNIQUE_SAMPLE_PROBLEMS
        dataset, report = load_dapo_math("sample", return_report=True)
        assert (report.rows_before, report.rows_after) == (len(SAMPLE_ROWS), UNIQUE_SAMPLE_PROBLEMS)
        assert report.duplicate_rows == len(SAMPLE_ROWS) - UNIQUE_SAMPLE_PROBLEMS
        assert str(report).startswith(f"{len(SAMPLE_ROWS)} rows -> {UNIQUE_SAMPLE_PROBLEMS} unique problems")
        assert len(dataset) == UNIQUE_SAMPLE_PROBLEMS
        assert len(set(dataset["problem"])) == len(dataset)

    def test_rows_are_trl_ready(self):
        dataset = load_dapo_math("sample")
        assert dataset.features == ROW_FEATURES
        row = dataset[0]
        assert is_conversational(row)
        assert row["prompt"][-1]["role"] == "user"
        assert row["solution"] == row["answer"] == SAMPLE_ROWS[0]["reward_model"]["ground_truth"]
        assert row["id"] == SAMPLE_ROWS[0]["extra_info"]["index"]
        assert row["data_source"] == "math_dapo"

    def test_dapo_style_keeps_the_dataset_instruction_as_is(self):
        dataset = load_dapo_math("sample", prompt_style="dapo")
        originals = {row["prompt"][0]["content"] for row in SAMPLE_ROWS}
        assert {row["prompt"][0]["content"] for row in dataset} == originals

    def test_boxed_style_uses_the_bare_problem_and_the_boxed_instruction(self):
        dataset = load_dapo_math("sample", prompt_style="boxed")
        row = dataset[0]
        assert (
            row["problem"]
            == "A baker makes 12 muffins per tray and fills 7 trays. How many muffins does the baker make?"
        )
        assert row["prompt"] == [{"role": "user", "content": row["problem"] + "\n\n" + BOXED_INSTRUCTION}]
        assert not any("Answer:" in r["prompt"][0]["content"] for r in dataset)

    def test_a_system_prompt_goes_first(self):
        row = load_dapo_math("sample", prompt_style="boxed", system_prompt="Be brief.")[0]
        assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
        assert row["prompt"][1]["role"] == "user"

    def test_dedupe_can_be_turned_off(self):
        dataset, report = load_dapo_math("sample", dedupe=False, return_report=True)
        assert len(dataset) == len(SAMPLE_ROWS) == report.rows_after

    @pytest.mark.parametrize("file_format", ["parquet", "jsonl", "saved_dataset", "data_dir"])
    def test_local_files_in_the_verl_schema(self, tmp_path, file_format):
        raw = load_dataset("json", data_files=str(sample_path("dapo_math_17k")), split="train")
        if file_format == "parquet":
            source = tmp_path / "dapo.parquet"
            raw.to_parquet(source)
        elif file_format == "jsonl":
            source = tmp_path / "dapo.jsonl"
            raw.to_json(source, lines=True, force_ascii=False)
        elif file_format == "saved_dataset":
            source = tmp_path / "saved"
            raw.save_to_disk(source)
        else:
            source = tmp_path / "data_dir"
            source.mkdir()
            raw.to_parquet(source / "train-00000-of-00001.parquet")
        dataset = load_dapo_math(str(source))
        assert len(dataset) == UNIQUE_SAMPLE_PROBLEMS
        assert dataset.to_list() == load_dapo_math("sample").to_list()

    def test_local_files_in_the_open_r1_schema(self, tmp_path):
        source = tmp_path / "processed.parquet"
        Dataset.from_list(_open_r1_rows()).to_parquet(source)
        dataset = load_dapo_math(source, prompt_style="boxed")
        reference = load_dapo_math("sample", prompt_style="boxed")
        assert dataset.to_list() == reference.to_list()

    def test_hub_ids_go_to_load_dataset_with_the_right_config(self, monkeypatch):
        calls = []

        def fake_load_dataset(path, name=None, split=None, **kwargs):
            calls.append((path, name, split))
            return Dataset.from_list(SAMPLE_ROWS if path.startswith("Byted") else _open_r1_rows())

        monkeypatch.setattr(sources_module, "load_dataset", fake_load_dataset)
        load_dapo_math()
        load_dapo_math("open-r1/DAPO-Math-17k-Processed")
        load_dapo_math("open-r1/DAPO-Math-17k-Processed", config_name="en")
        assert calls == [
            ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
            ("open-r1/DAPO-Math-17k-Processed", "all", "train"),
            ("open-r1/DAPO-Math-17k-Processed", "en", "train"),
        ]

    def test_conflicting_answers_and_missing_answers_are_counted(self):
        rows = [
            {"problem": "What is 1+1?", "answer": "2"},
            {"problem": "What is  1+1? ", "answer": "3"},
            {"problem": "What is 2+2?", "answer": None},
            {"problem": "What is 3+3?", "answer": "6"},
        ]
        dataset, report = dedupe_by_problem(Dataset.from_list(rows))
        assert dataset["answer"] == ["2", "6"]
        assert (report.rows_before, report.rows_after, report.rows_without_answer) == (4, 2, 1)
        assert report.conflicting_problems == 1
        assert report.duplicate_rows == 1
        assert "1 problems had conflicting gold answers" in str(report)

    def test_a_wrong_schema_names_the_dataset_the_expected_and_the_found_fields(self, tmp_path):
        source = tmp_path / "wrong.jsonl"
        source.write_text(json.dumps({"question": "1+1?", "final": "2"}) + "\n")
        with pytest.raises(DatasetSchemaError) as error:
            load_dapo_math(source)
        message = str(error.value)
        assert "wrong.jsonl" in message
        assert "reward_model.ground_truth" in message and "solution" in message
        assert "['question', 'final']" in message

    def test_a_missing_local_file_is_a_clear_error(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="no such file"):
            load_dapo_math(str(tmp_path / "absent.parquet"))

    def test_an_unknown_prompt_style_is_rejected(self):
        with pytest.raises(ValueError, match="prompt_style"):
            load_dapo_math("sample", prompt_style="chat")

    def test_extract_problem_undoes_the_dapo_wrapper(self):
        assert extract_problem(f"{DAPO_PREFIX}What is 2+2?{DAPO_SUFFIX}") == "What is 2+2?"
        assert extract_problem("  What is 2+2?  ") == "What is 2+2?"


class TestBenchmarks:
    def test_the_six_benchmarks_and_their_hub_ids(self):
        assert {name: spec.hub_id for name, spec in BENCHMARKS.items()} == {
            "aime24": "HuggingFaceH4/aime_2024",
            "aime25": "math-ai/aime25",
            "amc23": "math-ai/amc23",
            "math500": "HuggingFaceH4/MATH-500",
            "minerva": "math-ai/minervamath",
            "olympiadbench": "math-ai/olympiadbench",
        }
        assert [BENCHMARKS[name].samples_per_problem for name in BENCHMARKS] == [32, 32, 32, 4, 4, 4]

    @pytest.mark.parametrize("name", list(BENCHMARKS))
    def test_each_sample_loads_as_trl_ready_rows(self, name):
        dataset = load_benchmark(name, "sample")
        assert dataset.features == ROW_FEATURES
        assert len(dataset) >= 3
        for row in dataset:
            assert row["problem"] and row["answer"] and row["solution"] == row["answer"]
            assert row["data_source"] == name
            assert row["prompt"] == [{"role": "user", "content": row["problem"] + "\n\n" + BOXED_INSTRUCTION}]
        assert len(set(dataset["id"])) == len(dataset)

    def test_answers_and_ids_are_normalized(self):
        assert load_benchmark("amc23", "sample")["answer"] == ["39", "40", "60", "0.875"]
        assert load_benchmark("aime24", "sample")["answer"] == ["333", "403", "22"]
        assert load_benchmark("olympiadbench", "sample")["answer"][:2] == ["3,4", "513"]
        assert load_benchmark("minerva", "sample")["id"] == ["minerva-0", "minerva-1", "minerva-2"]
        assert load_benchmark("math500", "sample")["id"][0] == "test/algebra/sample-1.json"

    def test_olympiadbench_context_is_prepended(self):
        row = load_benchmark("olympiadbench", "sample")[3]
        assert row["problem"].startswith("In this problem, a lattice point")
        assert row["problem"].endswith("How many lattice points lie on the circle $x^2 + y^2 = 25$?")

    def test_the_dapo_prompt_style_also_works_for_evaluation(self):
        row = load_benchmark("aime25", "sample", prompt_style="dapo", system_prompt="Think.")[0]
        assert row["prompt"][0] == {"role": "system", "content": "Think."}
        assert row["prompt"][1]["content"] == f"{DAPO_PREFIX}{row['problem']}{DAPO_SUFFIX}"

    @pytest.mark.parametrize(
        ("alias", "name"), [("AIME2024", "aime24"), ("math-500", "math500"), ("olympiad", "olympiadbench")]
    )
    def test_aliases(self, alias, name):
        assert benchmark_spec(alias).name == name

    def test_an_unknown_benchmark_lists_the_known_ones(self):
        with pytest.raises(ValueError, match="aime24.*olympiadbench"):
            load_benchmark("gsm8k")

    def test_hub_loading_uses_each_benchmark_split(self, monkeypatch):
        calls = []

        def fake_load_dataset(path, name=None, split=None, **kwargs):
            calls.append((path, split))
            spec = next(spec for spec in BENCHMARKS.values() if spec.hub_id == path)
            return load_dataset("json", data_files={split: str(sample_path(spec.name))}, split=split)

        monkeypatch.setattr(sources_module, "load_dataset", fake_load_dataset)
        for name in BENCHMARKS:
            assert len(load_benchmark(name)) >= 3
        assert calls == [(spec.hub_id, spec.split) for spec in BENCHMARKS.values()]

    def test_a_local_path_overrides_the_hub(self, tmp_path):
        source = tmp_path / "my_aime.parquet"
        load_dataset("json", data_files=str(sample_path("aime24")), split="train").to_parquet(source)
        assert load_benchmark("aime24", source)["answer"] == load_benchmark("aime24", "sample")["answer"]

    def test_a_wrong_schema_names_the_dataset_the_expected_and_the_found_fields(self, tmp_path):
        source = tmp_path / "bad.jsonl"
        source.write_text(json.dumps({"problem": "1+1?", "label": "2"}) + "\n")
        with pytest.raises(
            DatasetSchemaError,
            match=r"MATH-500 source .*bad.jsonl.* no answer field.*\['answer'\].*\['problem', 'label'\]",
        ):
            load_benchmark("math500", source)

    def test_a_row_without_an_answer_is_an_error(self, tmp_path):
        source = tmp_path / "holes.jsonl"
        source.write_text(json.dumps({"question": "1+1?", "answer": ""}) + "\n")
        with pytest.raises(DatasetSchemaError, match="row 0 has no usable answer"):
            load_benchmark("minerva", source)

    @pytest.mark.parametrize(
        ("raw", "answer"),
        [
            ("033", "33"),
            (27.0, "27"),
            (0.875, "0.875"),
            (["$2^{1009}$"], "2^{1009}"),
            (["$3$", "$4$"], "3, 4"),
            ("-0", "0"),
        ],
    )
    def test_benchmark_answer(self, raw, answer):
        assert benchmark_answer(raw) == answer
