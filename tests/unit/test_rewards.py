"""Rewards: the DAPO and JustRL exact-match rules, math-verify, and the registry, as a table of hand-checked cases.

Each row gives a completion, a gold answer and the score of each rule. The exact-match columns follow the published
rules literally (Minerva normalization, fixed windows), quirks included; the math_verify column records what
math-verify 0.9 concludes, so a change in either shows up here.
"""

import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest

from stapo_trl.rewards import (
    REWARD_REGISTRY,
    MathVerifyReward,
    available_rewards,
    boxed_reward,
    dapo_reward,
    get_reward_func,
    last_answer_line,
    last_boxed_content,
    math_verify_reward,
    normalize_final_answer,
)

FILLER = " and that settles it." * 9  # 189 characters: pushes an answer out of both windows
HUGE = "Let us think about this carefully. " * 30_000  # about 1 MB of text before the answer
S = None  # a score of None: TRL skips the sample for that reward

# (case id, completion, gold answer, dapo, boxed, math_verify)
CASES = [
    ("answer-line-integer", "7 * 6 = 42\nAnswer: 42", "42", 1, -1, 1),
    ("boxed-integer", r"Thus the answer is \boxed{42}.", "42", -1, 1, 1),
    ("both-formats", "\\boxed{42}\nAnswer: 42", "42", 1, 1, 1),
    ("wrong-answer", "\\boxed{43}\nAnswer: 43", "42", -1, -1, 0),
    ("no-answer", "I am not sure how to finish this.", "42", -1, -1, 0),
    ("empty-completion", "", "42", -1, -1, 0),
    ("comma-thousands", "Answer: 1,000", "1000", 1, -1, 1),
    ("comma-thousands-boxed", r"\boxed{12,345}", "12345", -1, 1, 1),
    ("space-thousands", "Answer: 1 000", "1000", 1, -1, 1),
    ("comma-in-gold", r"\boxed{1000}", "1,000", -1, 1, 1),
    ("negative", "Answer: -5", "-5", 1, -1, 1),
    ("negative-boxed", r"\boxed{-5}", "-5", -1, 1, 1),
    ("negative-with-comma-kept-by-dapo", "Answer: -1,234", "-1234", -1, -1, 1),
    ("wrong-sign", r"Answer: 5 so \boxed{5}", "-5", -1, -1, 0),
    ("frac-exact", r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", -1, 1, 1),
    ("dfrac-vs-frac", r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", -1, -1, 1),
    ("slash-vs-frac", r"\boxed{1/2}", r"\frac{1}{2}", -1, -1, 1),
    ("decimal-vs-frac", r"\boxed{0.5}", r"\frac{1}{2}", -1, -1, 1),
    ("short-frac-expanded-by-dapo", r"Answer: \frac12", r"\frac{1}{2}", 1, -1, 0),
    ("sqrt-equivalent", r"\boxed{2\sqrt{2}}", r"\sqrt{8}", -1, -1, 1),
    ("dollar-wrapped-answer", r"Answer: $\frac{3}{4}$", r"\frac{3}{4}", 1, -1, 1),
    ("dollar-wrapped-box", r"so $\boxed{7}$", "7", -1, 1, 1),
    ("dollar-wrapped-gold", r"Answer: $2^{1009}$", "$2^{1009}$", 1, -1, 1),
    ("bare-power-gold-read-whole", r"\boxed{2^{1009}}", "2^{1009}", -1, 1, 1),
    ("bare-power-gold-is-not-its-base", r"\boxed{2}", "2^{1009}", -1, -1, 0),
    ("trailing-period-kept-by-dapo", "Answer: 42.", "42", -1, -1, 1),
    ("trailing-period-inside-math", "Answer: $42.$", "42", 1, -1, 1),
    ("trailing-period-after-box", r"\boxed{42}.", "42", -1, 1, 1),
    ("unit-word", "Answer: 30 degrees", "30", 1, -1, 1),
    ("unit-circ", r"\boxed{30^\circ}", "30", -1, 1, 1),
    ("unit-text-cm", r"Answer: 12 \text{ cm}", "12", 1, -1, 1),
    ("escaped-dollar-sign", r"Answer: \$30", "30", 1, -1, 0),
    ("equation-rhs", "Answer: x = 5", "5", 1, -1, 1),
    ("text-in-box", r"\boxed{\text{5}}", "5", -1, 1, 1),
    ("several-boxes-last-wins", r"First \boxed{1}, then \boxed{42}", "42", -1, 1, 0),
    ("several-boxes-last-is-wrong", r"First \boxed{42}, then \boxed{1}", "42", -1, -1, 0),
    ("nested-braces", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", -1, 1, 1),
    ("unbalanced-open-brace", r"\boxed{\frac{1}{2}", r"\frac{1}{2}", -1, -1, 1),
    ("extra-closing-brace", r"\boxed{42}}", "42", -1, 1, 1),
    ("interval", r"\boxed{(2,3)}", "(2,3)", -1, 1, 1),
    ("answer-not-on-last-line", "Answer: 42\nI double-checked this.", "42", 1, -1, 1),
    ("several-answer-lines-last-wins", "Answer: 41\nWait, that is off by one.\nAnswer: 42", "42", 1, -1, 1),
    ("several-answer-lines-last-is-wrong", "Answer: 42\nWait, that is off by one.\nAnswer: 41", "42", -1, -1, 0),
    ("lowercase-answer", "answer: 42", "42", 1, -1, 1),
    ("markdown-bold-answer", "**Answer:** 42", "42", -1, -1, 1),
    ("answer-outside-dapo-window", "Answer: 42\n" + "x" * 400, "42", -1, -1, 1),
    ("box-outside-boxed-window", r"\boxed{42}" + FILLER, "42", -1, -1, 1),
    ("huge-completion", HUGE + "\\boxed{42}\nAnswer: 42", "42", 1, 1, 1),
    ("conversational", [{"role": "assistant", "content": r"\boxed{42}"}], "42", -1, 1, 1),
    (
        "conversational-tool-turns",
        [
            {"role": "assistant", "content": "Let me call the calculator."},
            {"role": "tool", "content": "Answer: 41"},
            {"role": "assistant", "content": "Answer: 42"},
        ],
        "42",
        1,
        -1,
        1,
    ),
    ("content-blocks", [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{42}"}]}], "42", -1, 1, 1),
    ("content-none", [{"role": "assistant", "content": None}], "42", -1, -1, 0),
    ("content-int", [{"role": "assistant", "content": 42}], "42", -1, -1, 1),
    ("float-gold", r"\boxed{27}", 27.0, -1, 1, 1),
    ("list-gold", r"\boxed{3,4}", ["3", "4"], -1, 1, 1),
    ("gold-missing", r"\boxed{42}", None, S, S, S),
    ("gold-unparsable", r"\boxed{42}", r"\text{}", S, S, S),
    ("gold-not-math", r"\boxed{42}", "???", -1, -1, 0),
]

RULES = {"dapo": dapo_reward, "boxed": boxed_reward, "math_verify": math_verify_reward}
IDS = [case[0] for case in CASES]


def _expected(case, rule):
    value = case[3 + list(RULES).index(rule)]
    return None if value is None else float(value)


def test_the_table_has_at_least_40_cases():
    assert len(CASES) >= 40
    assert len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dapo_rule(case):
    assert dapo_reward([case[1]], solution=[case[2]]) == [_expected(case, "dapo")]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_boxed_rule(case):
    assert boxed_reward([case[1]], solution=[case[2]]) == [_expected(case, "boxed")]


def test_math_verify_rule_on_the_whole_table():
    scores = math_verify_reward([case[1] for case in CASES], solution=[case[2] for case in CASES])
    expected = [_expected(case, "math_verify") for case in CASES]
    mismatches = [(case[0], got, want) for case, got, want in zip(CASES, scores, expected, strict=True) if got != want]
    assert not mismatches


@pytest.mark.parametrize("rule", list(RULES))
def test_worker_threads_give_the_same_scores_as_the_main_thread(rule):
    reward = RULES[rule]
    completions = [case[1] for case in CASES]
    golds = [case[2] for case in CASES]
    in_main_thread = reward(completions, solution=golds)
    chunks = [(completions[i : i + 7], golds[i : i + 7]) for i in range(0, len(CASES), 7)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        parts = list(pool.map(lambda chunk: reward(chunk[0], solution=chunk[1]), chunks))
    assert [score for part in parts for score in part] == in_main_thread


class TestExtraction:
    def test_last_answer_line_takes_the_last_match_to_end_of_line(self):
        assert last_answer_line("Answer: 1\nANSWER :  2 apples\nok") == "2 apples"
        assert last_answer_line("no final line") is None

    def test_last_boxed_content_balances_braces(self):
        assert last_boxed_content(r"\boxed{a} and \boxed{\frac{1}{\sqrt{2}}} end") == r"\frac{1}{\sqrt{2}}"
        assert last_boxed_content(r"\boxed{1} and \boxed{2") is None
        assert last_boxed_content("nothing boxed") is None

    @pytest.mark.parametrize(
        ("raw", "normalized"),
        [
            ("1,000", "1000"),
            ("-1,000", "-1,000"),
            (" x = 5 ", "5"),
            (r"$\frac{1}{2}$", r"\frac{1}{2}"),
            (r"\frac12", r"\frac{1}{2}"),
            (r"\sqrt3", r"\sqrt{3}"),
            (r"\text{(B)}", "(B)"),
            (r"\boxed{7}", "7"),
            (r"45^\circ", "45"),
            ("5 dollars", "5"),
            ("42.", "42."),
            ("an apple", "apple"),
        ],
    )
    def test_minerva_normalization(self, raw, normalized):
        assert normalize_final_answer(raw) == normalized


class TestBadInput:
    @pytest.mark.parametrize("rule", list(RULES))
    def test_a_length_mismatch_is_an_error(self, rule):
        with pytest.raises(ValueError, match="2 completions but 1 gold answers"):
            RULES[rule](["a", "b"], solution=["1"])

    @pytest.mark.parametrize("rule", list(RULES))
    def test_a_missing_solution_column_is_an_error_that_names_the_column(self, rule):
        with pytest.raises(ValueError, match="`solution` column"):
            RULES[rule](["Answer: 1"])

    @pytest.mark.parametrize("rule", list(RULES))
    def test_a_single_string_is_not_mistaken_for_a_list_of_gold_answers(self, rule):
        with pytest.raises(TypeError, match="one gold answer per completion"):
            RULES[rule](["Answer: 4"], solution="4")

    def test_any_sized_sequence_of_gold_answers_works(self):
        assert dapo_reward(("Answer: 4", "Answer: 5"), solution=("4", "4")) == [1.0, -1.0]

    def test_the_exact_rules_grade_a_huge_completion_in_constant_time(self):
        import time

        text = "x" * 50_000_000 + "\nAnswer: 42"
        start = time.perf_counter()
        assert dapo_reward([text], solution=["42"]) == [1.0]
        assert boxed_reward([text], solution=["42"]) == [-1.0]
        assert time.perf_counter() - start < 1.0


@pytest.fixture
def stand_in_worker(tmp_path, monkeypatch):
    """Replace the math-verify child process with a script of the test's choosing, in a fresh pool closed after."""
    from stapo_trl.rewards import math_verify as module

    def install(source: str) -> None:
        script = tmp_path / "stand_in_worker.py"
        script.write_text(source)
        monkeypatch.setattr(module, "_WORKER_SCRIPT", script)
        monkeypatch.setattr(module, "_pool", None)

    yield install
    module._close_shared_pool()


class TestMathVerifyBounds:
    def test_a_pathological_answer_returns_within_the_bound(self):
        import time

        reward = MathVerifyReward(timeout_seconds=1.0)
        reward(["\\boxed{1}"], solution=["1"])  # start the worker outside the timed region
        start = time.perf_counter()
        scores = reward([r"\boxed{9^{9^{9^{9}}}}"] * 2, solution=["3", "3"])
        elapsed = time.perf_counter() - start
        assert scores == [0.0, 0.0]
        assert elapsed < 2 * reward.hard_timeout_seconds

    def test_the_pathological_answer_also_returns_in_a_worker_thread(self):
        reward = MathVerifyReward(timeout_seconds=1.0)
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(reward, [r"\boxed{9^{9^{9^{9}}}}"], solution=["3"]) for _ in range(2)]
            assert [future.result(timeout=4 * reward.hard_timeout_seconds) for future in futures] == [[0.0], [0.0]]

    def test_a_hung_worker_is_killed_and_replaced(self, stand_in_worker):
        """A worker that ignores its own alarm (say, stuck in C code) is killed at the hard deadline."""
        import time

        stand_in_worker(
            "import json, signal, sys, time\n"
            "signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "print(json.dumps({'ready': True}), flush=True)\n"
            "for line in sys.stdin:\n"
            "    time.sleep(3600)\n"
        )
        reward = MathVerifyReward(timeout_seconds=0.5)
        start = time.perf_counter()
        verdicts = reward.judge(["\\boxed{1}", "\\boxed{2}"], solution=["1", "2"])
        elapsed = time.perf_counter() - start
        assert [(v.verdict, v.stage) for v in verdicts] == [("timeout", "worker"), ("timeout", "worker")]
        assert elapsed < 2 * reward.hard_timeout_seconds + 5

    def test_errors_are_reported_not_scored_zero(self, stand_in_worker):
        from stapo_trl.rewards.math_verify import MathVerifyError

        stand_in_worker(
            "import json, sys\n"
            "print(json.dumps({'ready': True}), flush=True)\n"
            "for line in sys.stdin:\n"
            "    print(json.dumps({'verdict': 'error', 'stage': 'verify', 'detail': 'RecursionError: boom'}), flush=True)\n"
        )
        metrics = {}
        assert MathVerifyReward()(["x"], solution=["1"], log_metric=metrics.__setitem__) == [None]
        assert metrics["math_verify/error_fraction"] == 1.0
        with pytest.raises(MathVerifyError, match="RecursionError: boom"):
            MathVerifyReward(on_error="raise")(["x"], solution=["1"])

    def test_trainer_hooks_receive_metrics_and_extracted_answers(self):
        metrics, extra = {}, {}
        scores = math_verify_reward(
            [r"\boxed{\dfrac{1}{2}}", "nothing"],
            solution=[r"\frac{1}{2}", "3"],
            log_metric=metrics.__setitem__,
            log_extra=extra.__setitem__,
        )
        assert scores == [1.0, 0.0]
        assert metrics == {"math_verify/timeout_fraction": 0.0, "math_verify/error_fraction": 0.0}
        assert extra["math_verify_reward/extracted"][0] == r"\frac{1}{2}"
        assert extra["math_verify_reward/extracted"][1] is None

    def test_bad_options_are_rejected(self):
        with pytest.raises(ValueError, match="timeout_seconds must be positive"):
            MathVerifyReward(timeout_seconds=0)
        with pytest.raises(ValueError, match="on_error"):
            MathVerifyReward(on_error="ignore")


class TestRegistry:
    def test_the_issue_rewards_are_registered_with_readable_names(self):
        assert set(available_rewards()) >= {"dapo", "boxed", "math_verify", "think_format", "soft_overlong_punishment"}
        assert get_reward_func("dapo").__name__ == "dapo_reward"
        assert get_reward_func("boxed").__name__ == "boxed_reward"
        assert get_reward_func("math_verify").__name__ == "math_verify_reward"
        assert get_reward_func("think_format").__name__ == "think_format_reward"
        overlong = get_reward_func("soft_overlong_punishment", max_completion_len=10, soft_punish_cache=5)
        assert overlong.__name__ == "soft_overlong_punishment_reward"

    def test_trl_logs_each_reward_under_its_name(self):
        from trl.trainer.utils import get_callable_name

        for name in ("dapo", "boxed", "math_verify", "think_format"):
            assert get_callable_name(get_reward_func(name)) == get_reward_func(name).__name__

    def test_the_rewards_pickle_for_trl_async_rollout_workers(self):
        for name in ("dapo", "boxed", "math_verify", "think_format"):
            reward = get_reward_func(name)
            assert pickle.loads(pickle.dumps(reward)).__name__ == reward.__name__

    def test_trl_rewards_are_reused_not_rewritten(self):
        from trl.rewards import think_format_reward
        from trl.rewards.other_rewards import _SoftOverlongPunishment

        assert get_reward_func("think_format").reward is think_format_reward
        overlong = get_reward_func("soft_overlong_punishment", max_completion_len=10, soft_punish_cache=5)
        assert isinstance(overlong, _SoftOverlongPunishment)
        assert overlong(completion_ids=[[0] * 4, [0] * 8, [0] * 11]) == [0.0, -0.6, -1.0]

    def test_think_format_accepts_plain_and_conversational_completions(self):
        reward = get_reward_func("think_format")
        assert reward(["<think>a</think>b", [{"role": "assistant", "content": "no tags"}]]) == [1.0, 0.0]

    def test_math_verify_options_build_a_new_reward(self):
        reward = get_reward_func("math_verify", timeout_seconds=2)
        assert isinstance(reward, MathVerifyReward) and reward.timeout_seconds == 2.0

    def test_dotted_paths_load_user_rewards(self):
        assert get_reward_func("stapo_trl.rewards.exact_match.dapo_reward") is dapo_reward
        assert get_reward_func("stapo_trl.rewards.exact_match:boxed_reward") is boxed_reward
        built = get_reward_func("stapo_trl.rewards.MathVerifyReward", timeout_seconds=3)
        assert built.timeout_seconds == 3.0

    def test_unknown_names_list_the_registered_rewards(self):
        with pytest.raises(ValueError, match="Registered rewards: boxed, dapo, math_verify"):
            get_reward_func("acuracy")
        with pytest.raises(ValueError, match="has no attribute"):
            get_reward_func("stapo_trl.rewards.no_such_reward")
        with pytest.raises(ValueError, match="Cannot import module"):
            get_reward_func("no_such_package.reward")

    def test_options_a_reward_does_not_take_are_an_error(self):
        with pytest.raises(TypeError, match="takes no options"):
            get_reward_func("dapo", window=100)
        with pytest.raises(TypeError, match="Bad options for reward 'soft_overlong_punishment'"):
            get_reward_func("soft_overlong_punishment")

    def test_registry_names_are_unique(self):
        from stapo_trl.rewards import register_reward

        with pytest.raises(ValueError, match="already registered"):
            register_reward("dapo")(dapo_reward)
        assert "dapo" in REWARD_REGISTRY
