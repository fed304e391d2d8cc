"""The pieces of the CPU quickstart: arithmetic problems, GGUF references, greedy accuracy, metrics, plots, summary."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from safetensors.torch import save_file
from tiny import build_char_tokenizer, build_tiny_qwen3

from stapo_trl.cli.train import MetricsFileCallback, StepSummaryProgressCallback, console_summary, step_summary
from stapo_trl.data import ROW_FEATURES
from stapo_trl.data.arithmetic import WORKED_EXAMPLES, arithmetic_problems, load_arithmetic
from stapo_trl.data.selection import drop_long_prompts, random_subset, split_heldout
from stapo_trl.diagnostics.report import read_metrics
from stapo_trl.diagnostics.report_figures import plot_training_curves, training_curve_panels
from stapo_trl.diagnostics.run_record import build_run_record
from stapo_trl.diagnostics.token_dump import read_dump
from stapo_trl.evaluation import GreedyAccuracy, greedy_accuracy
from stapo_trl.evaluation.greedy import MIN_SHARED_PREFIX_TOKENS, prompt_prefix_cache, shared_prefix_length
from stapo_trl.gguf import (
    SMOLLM2_GGUF,
    converted_checkpoint_dir,
    gguf_checkpoint,
    is_gguf_reference,
    resolve_gguf,
)
from stapo_trl.rewards import get_reward_func

# --- arithmetic word problems --------------------------------------------------------------------------------------


def solve(question: str) -> int:
    """An independent solver for the story templates, from their wording."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if "gets" in question and "more" in question:
        return numbers[0] + numbers[1]
    if "gave away" in question:
        return numbers[0] - numbers[1]
    if "boxes with" in question:
        return numbers[0] * numbers[1]
    raise AssertionError(question)


def test_every_generated_answer_is_right():
    for question, answer in arithmetic_problems(300, seed=3):
        assert answer == solve(question) and answer >= 0, question


def test_problems_are_reproducible_distinct_and_held_out_ones_never_appear_in_training():
    train = arithmetic_problems(400, seed=0)
    assert train == arithmetic_problems(400, seed=0)
    assert len({question for question, _ in train}) == 400
    heldout = {question for question, _ in arithmetic_problems(100, seed=0, split="heldout")}
    other_seed = {question for question, _ in arithmetic_problems(400, seed=1)}
    assert not heldout & {question for question, _ in train}
    assert not heldout & other_seed
    assert arithmetic_problems(50, seed=1) != arithmetic_problems(50, seed=0)


def test_arithmetic_rows_have_the_dapo_schema_and_score_with_the_dapo_reward():
    rows = load_arithmetic(4, prompt_style="dapo", system_prompt="Be brief.")
    assert rows.features == ROW_FEATURES
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert rows[0]["prompt"][1]["content"].endswith('Remember to put your answer on its own line after "Answer:".')
    reward = get_reward_func("dapo")
    completions = [f"Some work.\nAnswer: {answer}" for answer in rows["answer"]]
    assert reward(completions, solution=rows["solution"]) == [1.0] * 4
    assert reward(["Answer: -1"], solution=rows["solution"][:1]) == [-1.0]


def test_worked_examples_come_before_the_bare_problem_as_chat_turns_in_the_style_of_the_reward():
    rows = load_arithmetic(3, prompt_style="dapo", system_prompt="Be brief.", num_fewshot=2)
    prompt = rows[0]["prompt"]
    assert [message["role"] for message in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert prompt[1]["content"] == WORKED_EXAMPLES[0][0] and prompt[2]["content"] == "3 + 2 = 5\nAnswer: 5"
    assert prompt[-1]["content"] == rows[0]["problem"]  # no DAPO wrapper: the examples show the format
    reward = get_reward_func("dapo")
    assert reward([prompt[2]["content"], prompt[4]["content"]], solution=["5", "12"]) == [1.0, 1.0]

    boxed = load_arithmetic(1, prompt_style="boxed", num_fewshot=1)[0]["prompt"]
    assert [message["role"] for message in boxed] == ["user", "assistant", "user"]
    assert get_reward_func("boxed")([boxed[1]["content"]], solution=["5"]) == [1.0]


def test_worked_examples_are_right_and_never_a_training_or_held_out_problem():
    for question, solution, answer in WORKED_EXAMPLES:
        assert solve(question) == answer and solution.endswith(f"= {answer}")
    generated = {
        question
        for seed in range(3)
        for split in ("train", "heldout")
        for question, _ in arithmetic_problems(300, seed=seed, split=split)
    }
    assert not generated & {question for question, _, _ in WORKED_EXAMPLES}


def test_arithmetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Unknown arithmetic split"):
        arithmetic_problems(3, split="test")
    with pytest.raises(ValueError, match="at least 1"):
        arithmetic_problems(0)
    with pytest.raises(ValueError, match="Unknown prompt_style"):
        load_arithmetic(3, prompt_style="latex")
    with pytest.raises(ValueError, match="num_fewshot must be between 0 and 3"):
        load_arithmetic(3, num_fewshot=4)


# --- choosing rows -------------------------------------------------------------------------------------------------


def test_held_out_rows_are_disjoint_from_training_rows():
    rows = load_arithmetic(20)
    train, heldout = split_heldout(rows, 5, seed=0)
    assert (len(train), len(heldout)) == (15, 5)
    assert not set(train["id"]) & set(heldout["id"])
    with pytest.raises(ValueError, match="nothing would be left to train on"):
        split_heldout(rows, 20, seed=0)
    assert len(random_subset(rows, 7, seed=0)) == 7
    assert len(random_subset(rows, 50, seed=0)) == 20


def test_overlong_prompts_are_dropped_and_dropping_all_is_an_error():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    rows = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "a" * n}] for n in (5, 10, 20)], "solution": ["1", "2", "3"]}
    )
    assert drop_long_prompts(rows, tokenizer, 10)["solution"] == ["1", "2"]
    with pytest.raises(ValueError, match="shortest has 5 tokens"):
        drop_long_prompts(rows, tokenizer, 4)


# --- GGUF references -----------------------------------------------------------------------------------------------


def test_gguf_references_resolve_paths_and_files_inside_installed_packages(tmp_path):
    assert is_gguf_reference(SMOLLM2_GGUF) and not is_gguf_reference("Qwen/Qwen3-8B-Base")
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    assert resolve_gguf(local) == local.resolve()
    with pytest.raises(FileNotFoundError, match="holds no 'missing.gguf'"):
        resolve_gguf("pytest/missing.gguf")
    with pytest.raises(FileNotFoundError, match="neither a file nor a file inside an installed package"):
        resolve_gguf("no_such_package_here/model.gguf")


def test_a_converted_gguf_checkpoint_is_reused_without_converting_again(tmp_path, monkeypatch):
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    # A finished conversion is recognized by its config.json and a weight file that opens, in the cache directory
    # for that file.
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: pytest.fail("converted"))
    done = converted_checkpoint_dir(local.resolve(), cache)
    assert done.parent == cache / "gguf" and done.name.startswith("model-")
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    save_file({"weight": torch.zeros(2)}, str(done / "model.safetensors"))
    assert gguf_checkpoint(local, cache_dir=cache) == done


# --- greedy accuracy -----------------------------------------------------------------------------------------------


def test_greedy_accuracy_counts_positive_scores_and_extracted_answers():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    model = build_tiny_qwen3(tokenizer)
    rows = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(5)], "solution": ["a", "b", "c", "d", "e"]}
    )
    calls = []

    def scripted_reward(completions, solution, log_extra=None, **kwargs):
        calls.append(list(completions))
        if log_extra is not None:
            log_extra("scripted/extracted", ["x", None, "y", None, None])
        return [1.0, -1.0, -1.0, None, 1.0]

    model.train()
    result = greedy_accuracy(model, tokenizer, rows, scripted_reward, max_new_tokens=3, batch_size=2)
    assert model.training, "the model's mode is restored"
    assert (result.correct, result.total, result.answered) == (2, 5, 2)
    assert result.accuracy == 0.4 and result.format_rate == 0.4
    assert result.standard_error == pytest.approx((0.4 * 0.6 / 5) ** 0.5)
    assert len(calls[0]) == 5 and all(isinstance(text, str) for text in calls[0])
    assert greedy_accuracy(model, tokenizer, rows, scripted_reward, max_new_tokens=3).completions == result.completions


def test_the_shared_prefix_stops_at_the_first_difference_and_leaves_every_row_a_token():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]) == 3
    assert shared_prefix_length([[1, 2], [1, 2, 3]]) == 1
    assert shared_prefix_length([[5], [5]]) == 0
    assert shared_prefix_length([[7, 1], [8, 1]]) == 0


SHARED_INSTRUCTION = "Add the two numbers and reply with the sum only. "


def test_prompts_decoded_after_a_shared_prefix_score_every_token_as_each_prompt_alone():
    """The prefix runs once; each row is [prefix][padding][remainder]. Every row's scores at every generated step
    match those of its prompt generated alone, without padding."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, seed=4).eval()
    prompts = [SHARED_INSTRUCTION + question for question in ("3+4=", "12+30=", "7+1000=")]
    token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    inputs = prompt_prefix_cache(model, token_ids, tokenizer.pad_token_id, "cpu")
    shared = shared_prefix_length(token_ids)
    assert shared == len(SHARED_INSTRUCTION) >= MIN_SHARED_PREFIX_TOKENS
    assert inputs["attention_mask"][:, shared:].tolist() == [[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [1] * 7]
    options = {"do_sample": False, "max_new_tokens": 4, "output_scores": True, "return_dict_in_generate": True}
    options["pad_token_id"] = tokenizer.pad_token_id
    together = model.generate(**inputs, **options)
    for row, ids in enumerate(token_ids):
        alone = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), **options)
        generated = alone.sequences[0, len(ids) :]  # a row alone stops at its EOS; in the batch it is padded after
        start = inputs["input_ids"].shape[1]
        assert together.sequences[row, start : start + len(generated)].tolist() == generated.tolist()
        assert len(alone.scores) == len(generated) >= 1
        for step_together, step_alone in zip(together.scores, alone.scores, strict=False):
            assert torch.allclose(step_together[row], step_alone[0], atol=1e-5)


def test_greedy_accuracy_gives_the_same_completions_with_and_without_the_shared_prefix():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    model = build_tiny_qwen3(tokenizer, seed=6)
    rows = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{SHARED_INSTRUCTION}{i * 37}+{i}="}] for i in range(6)],
            "solution": [str(i * 38) for i in range(6)],
        }
    )
    reward = get_reward_func("dapo")
    whole = greedy_accuracy(model, tokenizer, rows, reward, max_new_tokens=6, share_prompt_prefix=False)
    shared = greedy_accuracy(model, tokenizer, rows, reward, max_new_tokens=6, batch_size=4)
    assert shared.completions == whole.completions and len(set(whole.completions)) > 1


def test_a_batch_without_a_long_shared_prefix_runs_whole():
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer)
    token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Add: 1+2=", "Add: 3+4=")]
    assert prompt_prefix_cache(model, token_ids, tokenizer.pad_token_id, "cpu") is None
    assert prompt_prefix_cache(model, token_ids[:1], tokenizer.pad_token_id, "cpu") is None


def test_greedy_accuracy_without_log_extra_has_no_format_rate():
    assert GreedyAccuracy(correct=1, total=4).format_rate is None
    assert str(GreedyAccuracy(correct=1, total=4, answered=2)) == "0.250 ± 0.217 (1/4), answer format 0.50"


# --- metrics, the per-step line, plots and the summary -------------------------------------------------------------


def test_the_metrics_file_starts_over_on_a_fresh_run_and_appends_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"old": 1}\n')
    callback = MetricsFileCallback(path)
    args = SimpleNamespace(output_dir=str(tmp_path))
    fresh = SimpleNamespace(is_world_process_zero=True, global_step=0, epoch=0.0)
    callback.on_train_begin(args, fresh, None)
    callback.on_log(args, SimpleNamespace(is_world_process_zero=True, global_step=1, epoch=0.1), None, logs={"a": 1.0})
    callback.on_log(args, SimpleNamespace(is_world_process_zero=False, global_step=1, epoch=0.1), None, logs={"a": 9})
    callback.on_log(
        args, SimpleNamespace(is_world_process_zero=True, global_step=2, epoch=0.2), None, logs={"b": float("nan")}
    )
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r.get("a"), r.get("b")) for r in records] == [(1, 1.0, None), (2, None, None)]
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True, global_step=2, epoch=0.2), None)
    assert len(path.read_text().splitlines()) == 2


def test_the_step_line_shows_reward_entropy_mask_and_length():
    logs = {
        "reward": -0.25,
        "entropy": 0.4123,
        "s2t/silenced_fraction": 0.0123,
        "s2t/num_silenced": 7.0,
        "s2t/entropy_threshold": 0.31,
        "completions/mean_length": 33.4,
        "loss": 0.01,
    }
    assert step_summary(logs, 3, 20) == (
        "step 3/20 | reward -0.250 | entropy 0.412 | silenced 1.230% (7 tok) | tau_h 0.310 | len 33 | loss +0.0100"
    )
    assert step_summary({"reward": 1.0, "s2t/entropy_threshold": float("nan")}, 1, 2) == "step 1/2 | reward +1.000"


def test_the_progress_callback_writes_one_line_per_step(capsys):
    callback = StepSummaryProgressCallback()
    written = []
    callback.training_bar = SimpleNamespace(write=written.append)
    state = SimpleNamespace(is_world_process_zero=True, global_step=4, max_steps=8)
    callback.on_log(None, state, None, logs={"reward": 0.5})
    callback.on_log(None, state, None, logs={"train_runtime": 80.0})
    assert written == ["step 4/8 | reward +0.500", "trained 4 steps in 80 s (20.0 s/step)"]


def test_training_curves_render_headless_and_note_missing_metrics(tmp_path):
    records = [
        {"step": 1, "reward": -0.5, "entropy": 0.4},
        {"step": 2, "reward": 0.0, "entropy": 0.35},
    ]
    path = plot_training_curves(records, tmp_path / "curves.png", label="grpo, seed 0", title="grpo on SmolLM2")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reward, entropy, grad_norm, masked = training_curve_panels(records, label="grpo, seed 0")
    assert reward.series[0].values == [-0.5, 0.0] and entropy.series[0].values == [0.4, 0.35]
    assert reward.series[0].label == "grpo, seed 0"  # the legend names the run
    with pytest.raises(TypeError):  # no generic default such as "run": every caller names its run
        training_curve_panels(records)
    assert grad_norm.notes == ["not logged by this run"]
    assert (entropy.y_floor, masked.y_floor) == (0.0, 0.0)
    assert masked.series == [] and masked.notes == ["not logged by this run"]
    silenced = training_curve_panels(
        [{"step": 1, "s2t/silenced_fraction": 0.0}, {"step": 2, "s2t/silenced_fraction": 0.004}], "stapo, seed 0"
    )
    assert silenced[3].series[0].values == [0.0, 0.4]  # percent
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(records[0]) + "\n" + json.dumps({"step": 2, "train_runtime": 3.0}) + "\n")
    assert read_metrics(metrics) == records[:1]


def test_the_summary_compares_the_first_and_last_quarter_of_rewards():
    records = [
        {"reward": r, "s2t/silenced_fraction": 0.01, "s2t/num_silenced": 2.0} for r in (-1, -1, 0, 0, 0, 0, 1, 1)
    ]
    record = build_run_record(records)
    assert (record.reward_first, record.reward_last) == (-1.0, 1.0)
    s2t = record.token_rules["s2t"]
    assert s2t["silenced_tokens"] == 16 and s2t["silenced_fraction"] == pytest.approx(0.01)
    empty = build_run_record([])
    assert (empty.trends, empty.token_rules, empty.reward_first, empty.accuracy_before) == ({}, {}, None, None)


def test_the_console_summary_counts_silenced_of_candidates_and_shows_three_tokens_in_context(tmp_path):
    records = [
        {"step": n, "s2t/silenced_fraction": f, "s2t/num_silenced": m, "s2t/num_candidates": c}
        for n, f, m, c in ((1, 0.002, 2, 3), (2, 0.0, 0, 1), (3, 0.001, 1, 2))
    ]
    dump = tmp_path / "silenced_tokens.jsonl"
    dump.write_text(
        "".join(
            json.dumps(
                {
                    "step": n,
                    "token": t,
                    "context_before": "so 3 + 2 = 5.",
                    "context_after": "Answer: 5",
                    "p": 0.001,
                    "entropy": 0.2,
                    "advantage": 0.75,
                }
            )
            + "\n"
            for n, t in ((1, " "), (1, " ("), (3, "\n"), (3, "x"))
        )
        + '{"step": 3, "tok'  # a last line cut off mid-write, as a killed run leaves it
    )
    silenced_tokens, _ = read_dump(tmp_path)
    record = build_run_record(
        records, silenced_tokens=silenced_tokens, method="stapo", model="m", seconds_total=1.0, seconds_training=1.0
    )
    lines = console_summary(record)
    assert "  S2T silenced:             3 of 6 candidate tokens, in 2 of 3 steps (0.100% of loss tokens)" in lines
    examples = lines[
        lines.index("  silenced tokens in context ([[token]]; p and H under the training temperature):") + 1 :
    ][:3]
    assert examples == [  # the first, middle and last of the four records
        "    step 1, p 0.001, H 0.20, A +0.75: …so 3 + 2 = 5.[[␣]]Answer: 5…",
        "    step 3, p 0.001, H 0.20, A +0.75: …so 3 + 2 = 5.[[↵]]Answer: 5…",
        "    step 3, p 0.001, H 0.20, A +0.75: …so 3 + 2 = 5.[[x]]Answer: 5…",
    ]


def test_a_stare_run_reports_its_gate_and_weights():
    records = [
        {"reward": 0.0, "stare/gate_on": gate, "stare/positive_weight": w, "stare/negative_weight": 2.0 - w}
        for gate, w in ((0.0, 1.1), (1.0, 1.11), (1.0, 1.12), (1.0, 1.13))
    ]
    stare = build_run_record(records).token_rules["stare"]
    assert stare["gate_on_fraction"] == 0.75
    assert (stare["final_positive_weight"], stare["final_negative_weight"]) == pytest.approx((1.13, 0.87))
    assert set(build_run_record(records).token_rules) == {"stare"}
    line = step_summary({"reward": 0.5, "stare/gate_on": 1.0, "stare/positive_weight": 1.13}, 2, 4)
    assert line == "step 2/4 | reward +0.500 | stare on W 1.130"
