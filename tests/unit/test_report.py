"""`stapo-trl report`: which log it reads, what it refuses, the numbers in its summary, and the figures it draws."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tiny import tiny_config, tiny_trainer, tools

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.cli import main
from stapo_trl.diagnostics.plotting import draw_line_panel
from stapo_trl.diagnostics.report import ReportError, find_log_source, load_run, rule_lines, write_report
from stapo_trl.diagnostics.report_figures import (
    FIGURES,
    density_panel,
    line_panel,
    masking_panels,
    token_bars,
    top_silenced_tokens,
)
from stapo_trl.diagnostics.run_record import trend_sentences, visible_token
from stapo_trl.diagnostics.token_dump import DENSITY_BINS
from stapo_trl.file_and_metric_names import SILENCED_TOKENS_FILE, SILENCED_TOKENS_STATS_FILE

PNG = b"\x89PNG\r\n\x1a\n"


def step(number, entropy, reward, silenced=None, num_silenced=0, candidates=0, tau_h=None):
    """One logged step as TRL writes it: with S2T on, a step without candidates logs ``tau_h`` as None."""
    record = {"step": number, "loss": 0.1, "entropy": entropy, "reward": reward}
    if silenced is not None:
        record.update(
            {"s2t/silenced_fraction": silenced, "s2t/num_silenced": num_silenced, "s2t/num_candidates": candidates}
        )
        record["s2t/entropy_threshold"] = tau_h
    return record


# Four steps: entropy 0.8, 0.7, 0.5, 0.4; silenced 0.1%, 0%, 0.2%, 0.1%; tau_h None at step 2, which had no candidates.
HISTORY = [
    step(1, 0.8, -1.0, 0.001, 1, 2, 0.6),
    step(2, 0.7, -0.5, 0.0, 0, 0),
    step(3, 0.5, 0.0, 0.002, 2, 3, 0.4),
    step(4, 0.4, 0.5, 0.001, 1, 1, 0.5),
    {"step": 4, "train_runtime": 10.0, "train_loss": 0.1},
]


def write_state(directory, history=HISTORY):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": history}))
    return directory


def write_dump(directory, tokens=(" the", " the", "7", "\n")):
    density = torch.zeros(DENSITY_BINS, dtype=torch.int64)
    density[36, 2] = 50  # p around 0.2, H around 0.6
    density[10, 1] = 3  # p around 1e-7, H around 0.4
    stats = {
        "tokens_per_step": 64,
        "max_tokens": 5000,
        "context_tokens": 20,
        "probability_bound": 0.002,
        "silenced": 6,
        "written": len(tokens),
        "dropped": 6 - len(tokens),
        "steps": [],
        "density": {
            "log10_p_range": [-10.0, 0.0],
            "entropy_range": [0.0, 12.0],
            "bins": list(DENSITY_BINS),
            "positive_advantage": density.tolist(),
            "other": torch.zeros(DENSITY_BINS, dtype=torch.int64).tolist(),
        },
    }
    (directory / SILENCED_TOKENS_STATS_FILE).write_text(json.dumps(stats))
    records = [
        {
            "step": 1,
            "sample_id": f"1-0-{index}",
            "position": 3,
            "token_id": index,
            "token": token,
            "context_before": "so ",
            "context_after": " answer",
            "log_prob": -16.1,
            "p": 1e-7,
            "entropy": 0.4,
            "advantage": 0.9,
        }
        for index, token in enumerate(tokens)
    ]
    (directory / SILENCED_TOKENS_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))


# ------------------------------------------------------------------------------------------- reading runs
def test_the_log_is_read_from_trainer_state_then_the_newest_checkpoint_then_metrics_jsonl(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step(1, 0.5, 0.0)) + "\n")
    assert find_log_source(tmp_path) == tmp_path / "metrics.jsonl"
    for number in (9, 10):
        write_state(tmp_path / f"checkpoint-{number}")
    assert find_log_source(tmp_path) == tmp_path / "checkpoint-10" / "trainer_state.json"  # 10 > 9, not "10" < "9"
    write_state(tmp_path)
    assert find_log_source(tmp_path) == tmp_path / "trainer_state.json"


def test_the_end_of_training_record_is_not_a_step(tmp_path):
    run = load_run(write_state(tmp_path / "run"))
    assert [record["step"] for record in run.history] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: None, "no such directory"),
        (lambda path: path.mkdir(), "no training log found"),
        (lambda path: write_state(path, history=[{"step": 0, "train_runtime": 1.0}]), "holds no training steps"),
    ],
    ids=["missing", "empty", "no-steps"],
)
def test_a_run_dir_without_the_needed_logs_gets_a_clear_message(tmp_path, make, message):
    make(tmp_path / "run")
    with pytest.raises(ReportError, match=message):
        load_run(tmp_path / "run")


# ------------------------------------------------------------------------------------------- the numbers
def test_the_record_of_a_run_is_built_from_its_log(tmp_path):
    record = load_run(write_state(tmp_path / "run")).record
    assert record.steps == 4
    entropy, reward = record.trends["entropy"], record.trends["reward"]
    assert entropy["first_quarter"] == 0.8 and entropy["last_quarter"] == 0.4  # quarter = 1 step
    assert reward["first_quarter"] == -1.0 and reward["last_quarter"] == 0.5
    s2t = record.token_rules["s2t"]
    assert s2t["silenced_fraction"] == pytest.approx((0.001 + 0.0 + 0.002 + 0.001) / 4)
    assert (s2t["silenced_tokens"], s2t["candidates"]) == (4, 6)
    assert s2t["threshold_median"] == pytest.approx(0.5)  # median of 0.6, 0.4, 0.5; step 2 had no candidates
    # Entropy 0.8, 0.7, 0.5, 0.4 at steps 1-4: slope -0.7 / 5 = -0.14, residual variance 0.002 / 2, s.e. sqrt(0.001 / 5).
    assert trend_sentences(record)[1] == (
        "mean token entropy (nats) 0.800 (first quarter of steps) -> 0.400 (last quarter); "
        "slope -0.1400 ± 0.0141 per step over 4 steps: falls"
    )


def test_a_trend_is_called_only_beyond_twice_its_standard_error():
    from stapo_trl.diagnostics.run_record import trend

    noisy = trend("entropy", [1, 2, 3, 4, 5, 6], [0.5, 0.6, 0.4, 0.55, 0.45, 0.52])
    assert noisy.verdict == "no trend beyond its step-to-step scatter"
    assert abs(noisy.slope) < 2 * noisy.slope_standard_error
    rising = trend("reward", [1, 2, 3, 4], [-1.0, -0.5, 0.0, 0.6])
    assert rising.verdict == "rises"
    assert trend("reward", [1, 2, 3], [-1.0, 0.0, 1.0]).verdict == "too few steps to tell"
    assert trend("reward", [], []) is None


def test_the_held_out_accuracy_comes_from_the_logs_evaluation_records_which_are_not_steps(tmp_path):
    heldout = {"eval_heldout_accuracy_standard_error": 0.1, "eval_heldout_total": 16, "eval_heldout_format_rate": 0.5}
    history = [
        {"step": 0, "eval_heldout_accuracy": 0.25, **heldout},
        *HISTORY[:-1],
        {"step": 4, "eval_heldout_accuracy": 0.5, **heldout},
        HISTORY[-1],
    ]
    run = load_run(write_state(tmp_path / "run", history=history))
    assert [record["step"] for record in run.history] == [1, 2, 3, 4]  # read_history: training steps only
    assert run.record.accuracy_before["accuracy"] == 0.25 and run.record.accuracy_after["accuracy"] == 0.5
    markdown = write_report([tmp_path / "run"], tmp_path / "out").markdown.read_text()
    assert "| 0.250 ± 0.100 → 0.500 ± 0.100 |" in markdown


def test_a_rule_in_shadow_is_summarized_as_computed_not_applied(tmp_path):
    shadow = [
        {key.replace("s2t/", "shadow/s2t/"): value for key, value in record.items()}
        for record in HISTORY
        if "train_runtime" not in record
    ]
    record = load_run(write_state(tmp_path / "grpo", history=shadow)).record
    assert rule_lines(record) == [
        "in shadow (computed, not applied): S2T silenced: 4 of 6 candidate tokens, in 3 of 4 steps (0.100% of loss "
        "tokens)"
    ]
    assert record.token_rules == {}  # nothing was silenced: the rule was not applied


def test_the_top_silenced_tokens_are_counted_from_the_dump_and_shown_with_visible_whitespace(tmp_path):
    directory = write_state(tmp_path / "run")
    write_dump(directory)
    run = load_run(directory)
    assert top_silenced_tokens(run) == [(" the", 2), ("7", 1), ("\n", 1)]
    assert [visible_token(text) for text, _ in top_silenced_tokens(run)] == ["␣the", "7", "↵"]
    assert run.record.dump["written"] == 4 and run.record.dump["dropped"] == 2


# ------------------------------------------------------------------------------------------- the figures' data
# Three cases for every figure: a run with silenced tokens, a run with none, and several runs overlaid.
NOTHING_SILENCED = [step(n, 0.5, -1.0, 0.0, 0, candidates) for n, candidates in ((1, 0), (2, 1), (3, 0))]


def test_masking_of_a_run_with_silenced_tokens(tmp_path):
    fraction, threshold = masking_panels([load_run(write_state(tmp_path / "stapo"))])
    (line,) = fraction.series
    assert line.label == "stapo: 4 of 6 candidates silenced"
    assert line.steps == [1, 2, 3, 4] and line.values == pytest.approx([0.1, 0.0, 0.2, 0.1])  # percent
    assert fraction.y_floor == 0.0 and fraction.notes == []
    (tau_h,) = threshold.series
    assert tau_h.values == [0.6, None, 0.4, 0.5]  # the line breaks at step 2 ...
    assert tau_h.undefined_steps == [2]  # ... which is marked as a step without candidates
    assert threshold.undefined_label == "no candidates, so no tau_h" and threshold.notes == []


def test_masking_of_a_run_that_silenced_nothing_says_why_and_never_goes_below_zero(tmp_path):
    fraction, threshold = masking_panels([load_run(write_state(tmp_path / "quiet", history=NOTHING_SILENCED))])
    assert fraction.series[0].values == [0.0, 0.0, 0.0]
    assert fraction.series[0].label == "quiet: 0 of 1 candidates silenced"
    assert fraction.notes == ["quiet: 0% at every step"]  # a line on the x axis is easy to miss
    assert threshold.series[0].undefined_steps == [1, 2, 3]
    assert threshold.notes == ["no candidates, so no tau_h at every logged step"]  # not "not logged"

    plt = pytest.importorskip("matplotlib.pyplot")
    figure, axes = plt.subplots(1, 2)
    for axis, panel in zip(axes, (fraction, threshold), strict=True):
        draw_line_panel(axis, panel)
        bottom, top = axis.get_ylim()
        assert bottom == 0.0 and top > 0.0  # all-zero data would otherwise autoscale to [-0.055, 0.055]
    plt.close(figure)


def test_masking_of_runs_overlaid_has_one_line_per_run_and_a_note_for_a_run_without_s2t(tmp_path):
    runs = [
        load_run(write_state(tmp_path / "stapo")),
        load_run(write_state(tmp_path / "quiet", history=NOTHING_SILENCED)),
        load_run(write_state(tmp_path / "grpo", history=[step(1, 0.9, -1.0), step(2, 0.6, 0.0)])),
    ]
    fraction, threshold = masking_panels(runs)
    assert [line.label for line in fraction.series] == [
        "stapo: 4 of 6 candidates silenced",
        "quiet: 0 of 1 candidates silenced",
    ]
    assert [line.label for line in threshold.series] == ["stapo", "quiet"]
    without_s2t = "grpo: no token rule silenced tokens (none was on)"
    assert fraction.notes == ["quiet: 0% at every step", without_s2t]
    assert threshold.notes == [without_s2t]
    entropy = line_panel(runs, "entropy", "entropy", y_floor=0.0)
    assert [line.values for line in entropy.series] == [[0.8, 0.7, 0.5, 0.4], [0.5, 0.5, 0.5], [0.9, 0.6]]


def test_top_silenced_tokens_of_a_run_with_silenced_tokens_a_run_without_and_a_run_without_a_dump(tmp_path):
    stapo = write_state(tmp_path / "stapo")
    write_dump(stapo)
    bars = token_bars(load_run(stapo))
    assert (bars.tokens, bars.counts, bars.note) == (["␣the", "7", "↵"], [2, 1, 1], None)
    assert bars.title == "stapo\n4 dumped of 6 silenced"
    bars = token_bars(load_run(stapo), limit=2)
    assert (bars.tokens, bars.counts) == (["␣the", "7"], [2, 1])
    assert bars.title == "stapo\n4 dumped of 6 silenced\n2 of 3 distinct tokens, most frequent first"

    once_each = write_state(tmp_path / "once")
    write_dump(once_each, tokens=(" x", "7", "\n"))
    table = token_bars(load_run(once_each))
    assert (table.tokens, table.counts) == ([], [])  # bars of equal length would say nothing: a table instead
    assert table.rows == [
        ("1", "…so [␣x] answer…", "1e-07", "0.40", "+0.90"),
        ("1", "…so [7] answer…", "1e-07", "0.40", "+0.90"),
        ("1", "…so [↵] answer…", "1e-07", "0.40", "+0.90"),
    ]
    assert table.title.endswith("3 distinct tokens, each silenced 1 time")

    quiet = write_state(tmp_path / "quiet", history=NOTHING_SILENCED)
    write_dump(quiet, tokens=())
    stats = json.loads((quiet / SILENCED_TOKENS_STATS_FILE).read_text())
    stats["silenced"], stats["dropped"] = 0, 0
    (quiet / SILENCED_TOKENS_STATS_FILE).write_text(json.dumps(stats))
    bars = token_bars(load_run(quiet))
    assert (bars.tokens, bars.counts) == ([], [])
    assert bars.note == "no token was silenced in 3 steps, 1 candidates"

    bars = token_bars(load_run(write_state(tmp_path / "plain")))
    assert bars.note == "no token dump: train with dump_silenced_tokens: true"


def test_density_draws_the_masked_region_from_the_median_tau_h_and_the_dumped_tokens(tmp_path):
    stapo = write_state(tmp_path / "stapo")
    write_dump(stapo)
    panel = density_panel(load_run(stapo))
    assert panel.num_tokens == 53 and panel.extent == (-10.0, 0.0, 0.0, 12.0)
    assert panel.silenced_box == pytest.approx((math.log10(0.002), 0.5))  # median of 0.6, 0.4, 0.5
    assert panel.silenced == [(-7.0, 0.4)] * 4

    quiet = write_state(tmp_path / "quiet", history=NOTHING_SILENCED)
    write_dump(quiet, tokens=())
    panel = density_panel(load_run(quiet))
    assert panel.silenced_box is None and panel.threshold_only == pytest.approx(math.log10(0.002))
    assert panel.silenced == []
    assert density_panel(load_run(write_state(tmp_path / "plain"))).counts is None


# ------------------------------------------------------------------------------------------- the report
def test_a_report_compares_runs_and_draws_every_figure(tmp_path):
    with_dump = write_state(tmp_path / "stapo")
    write_dump(with_dump)
    without_dump = write_state(tmp_path / "grpo", history=[step(1, 0.9, -1.0), step(2, 0.6, 0.0)])
    report = write_report([with_dump, without_dump], tmp_path / "report")

    assert set(report.figures) == set(FIGURES)
    for path in report.figures.values():
        assert path.read_bytes()[:8] == PNG, path
    markdown = report.markdown.read_text()
    assert "| stapo | 4 | -1.000 → +0.500 | 0.800 → 0.400 | 0.1000% | 4 | 6 | 0.500 | – | – | – | 4 / 6 |" in markdown
    assert "| grpo | 2 | -1.000 → +0.000 | 0.900 → 0.600 | – | – | – | – | – | – | – | – |" in markdown
    assert "- S2T silenced: 4 of 6 candidate tokens, in 3 of 4 steps (0.100% of loss tokens)" in markdown
    assert "grpo: no token rule silenced tokens in the log (none was on)" in markdown
    assert "`…so [[␣the]] answer…`" in markdown  # a silenced token in its context, whitespace made visible
    for name in FIGURES.values():
        assert f"]({name})" in markdown


def test_without_any_dump_the_report_says_how_to_get_the_token_figures(tmp_path):
    report = write_report([write_state(tmp_path / "run")], tmp_path / "out", html=True)
    assert "token_density" not in report.figures and "top_silenced_tokens" not in report.figures
    assert "dump_silenced_tokens: true" in report.markdown.read_text()
    html = report.html.read_text()
    assert html.count("data:image/png;base64,") == 4  # entropy, reward, masking, optimization, inlined
    assert "<pre>" not in html and "<table>" in html and "<td>run</td>" in html  # rendered, not Markdown source
    assert "<h2>Mean token entropy</h2>" in html and "<blockquote>" in html


def test_labels_must_match_the_runs(tmp_path):
    with pytest.raises(ReportError, match="2 labels for 1 run"):
        write_report([write_state(tmp_path / "run")], tmp_path / "out", labels=["a", "b"])


# ------------------------------------------------------------------------------------------- the command
def test_the_command_prints_the_trend_and_the_mask_and_writes_into_the_run_dir(tmp_path, capsys):
    directory = write_state(tmp_path / "run")
    assert main(["report", str(directory)]) == 0
    printed = capsys.readouterr().out
    assert "run: 4 steps" in printed
    assert "  mean token entropy (nats) 0.800 (first quarter of steps) -> 0.400 (last quarter); slope" in printed
    assert "  S2T silenced: 4 of 6 candidate tokens, in 3 of 4 steps (0.100% of loss tokens)" in printed
    assert (directory / "report" / "report.md").is_file()


def test_the_command_reports_a_bad_run_dir_without_a_traceback(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("stapo-trl report: error:") and "Traceback" not in error


def test_the_report_renders_headless_even_when_an_interactive_backend_is_configured(tmp_path):
    directory = write_state(tmp_path / "run")
    write_dump(directory)
    env = {key: value for key, value in os.environ.items() if key != "DISPLAY"}
    env["MPLBACKEND"] = "TkAgg"
    result = subprocess.run(
        [sys.executable, "-m", "stapo_trl", "report", str(directory), "--output_dir", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "token_density.png").read_bytes()[:8] == PNG


def test_a_real_training_run_with_the_dump_reports_end_to_end(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path / "run", max_steps=2, prob_threshold=0.2, temperature=1.0)
    trainer = tiny_trainer(STAPOTrainer, config, callbacks=tools(dump_silenced_tokens=True))
    trainer.train()
    trainer.save_state()
    report = write_report([tmp_path / "run"], tmp_path / "report")
    (run,) = report.runs
    masked = [entry["s2t/num_silenced"] for entry in trainer.state.log_history if "loss" in entry]
    assert run.record.token_rules["s2t"]["silenced_tokens"] == sum(masked) and run.record.dump["silenced"] == sum(
        masked
    )
    assert set(report.figures) == set(FIGURES)
