"""Counts the docs quote agree with the code, the test suite and the benchmark JSON they describe, wherever that is
cheap to check: test counts per file, the bad-input table's rows and totals, configurations, methods, recipes and the
dump's caps."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RECORDS = DOCS / "records"
RELIABILITY = (DOCS / "reliability.md").read_text()


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = re.search(r"^## ", text[start + len(heading) :], flags=re.MULTILINE)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


SUMMARY = section(RELIABILITY, "## Summary")
QUOTED_FILE_COUNTS = {
    path: int(count)  # tests/<group>/test_x.py; TRL's own tests/test_grpo_trainer.py, in the same table, has no group
    for path, count in re.findall(r"`tests/(\w+/test_\w+\.py)` \((\d+)(?: tests)?\)", SUMMARY)
}


def load_test_module(path: str) -> ModuleType:
    """A test file of another group, by its path under tests/: pytest puts only the directory of each collected file on
    sys.path, so `pytest tests/repository` alone could not import it by name."""
    spec = importlib.util.spec_from_file_location(f"doc_counts_{Path(path).stem}", REPO / "tests" / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def collected() -> Counter:
    """How many tests pytest collects in each file the reliability summary quotes a count for, in both tiers (``-m ""``
    selects every test, slow ones included)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", ""]
        + [f"tests/{path}" for path in QUOTED_FILE_COUNTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return Counter(line.split("::")[0].removeprefix("tests/") for line in result.stdout.splitlines() if "::" in line)


def test_the_reliability_summary_quotes_each_files_test_count(collected):
    assert len(QUOTED_FILE_COUNTS) >= 10
    wrong = {
        name: (quoted, collected[name]) for name, quoted in QUOTED_FILE_COUNTS.items() if collected[name] != quoted
    }
    assert not wrong, f"quoted vs collected: {wrong}"


def test_the_reliability_totals_add_up(collected):
    total, terms = re.search(r"Totals: (\d+) tests in the files above \(([\d + ]+)\)", SUMMARY).groups()
    assert int(total) == sum(int(term) for term in terms.split("+")) == sum(collected.values())
    drift = int(re.search(r"`tests/repository/test_trl_drift.py` \((\d+) tests\)", RELIABILITY).group(1))
    assert drift == collected["repository/test_trl_drift.py"]


def test_the_bad_input_table_matches_the_cases_of_the_test():
    bad_input = load_test_module("unit/test_bad_input.py")
    cases = bad_input.CASES

    table = (RECORDS / "bad-input.md").read_text()
    rows = re.findall(r"^\| ([a-zA-Z ]+?) \| (\d+) \| ([^|]+) \|", table, flags=re.MULTILINE)
    by_category = Counter(case.category for case in cases)
    quoted = {name: int(count) for name, count, _ in rows if name != "category"}
    assert quoted == dict(by_category), (quoted, dict(by_category))
    kinds = {
        bad_input.Exits: "exits",
        bad_input.Raises: "raises",
        bad_input.Succeeds: "succeed",
        bad_input.Returns: "return",
    }
    outcomes = Counter(kinds[type(case.expect)] for case in cases)
    total = re.search(r"\| \*\*total\*\* \| \*\*(\d+)\*\* \| ([^|]+) \|", table)
    assert int(total.group(1)) == len(cases)
    stated = {word.rstrip("s"): int(number) for number, word in re.findall(r"(\d+) (\w+)", total.group(2))}
    assert stated == {kind.rstrip("s"): count for kind, count in outcomes.items()}
    in_process = re.search(r"holds one table of (\d+) bad inputs", table).group(1)
    command_line = re.search(r"The (\d+) cases that go through the command line", table).group(1)
    assert int(in_process) == len(cases)
    assert int(command_line) == outcomes["exits"] + outcomes["succeed"]


def test_configurations_quoted_match_the_distributed_benchmark_json():
    cases = json.loads((DOCS / "benchmarks" / "distributed_equivalence.json").read_text())["cases"]
    table = (RECORDS / "two-processes-against-one.md").read_text()
    table_rows = re.findall(r"^\| (\w+:\w+:\d) \|", table, flags=re.MULTILINE)
    assert sorted(table_rows) == sorted(cases)
    assert f"Figures for the {len(cases)} configurations" in table
    benchmarks = (DOCS / "benchmarks.md").read_text()
    assert f"Over {len(cases)} configurations" in benchmarks


def test_every_method_is_in_the_training_docs_method_table():
    from stapo_trl.methods import METHOD_NAMES, method_preset

    training = (DOCS / "training.md").read_text()
    rows = re.findall(r"^\| ([\w-]+) \| .* \| `method: ([\w-]+)`", training, flags=re.MULTILINE)
    assert sorted(name for _, name in rows) == sorted(METHOD_NAMES)
    assert all(method_preset(name).title == title for title, name in rows)
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"All {words[len(METHOD_NAMES)]} methods" in training


def test_every_recipe_the_docs_name_exists():
    pattern = re.compile(r"recipes/dapo_math_17k/<model>/<method>\.yaml`[^\n]*")
    for page in (REPO / "README.md", DOCS / "data.md"):
        text = page.read_text()
        for line in pattern.findall(text):
            methods = re.findall(r"`([\w-]+)`", line.split("<method>.yaml`", 1)[1])
            methods = [name for name in methods if not name.startswith("qwen3")]
            assert methods, (page.name, line)
            for model in ("qwen3-1.7b-base", "qwen3-8b-base", "qwen3-14b-base"):
                for method in methods:
                    if method in ("boxed", "dapo"):  # the table's other columns
                        continue
                    assert (REPO / "recipes" / "dapo_math_17k" / model / f"{method}.yaml").is_file(), (page, method)
        for path in re.findall(r"`(recipes/[\w./-]+\.yaml)`", text):
            assert (REPO / path).is_file(), (page.name, path)


def test_the_dump_caps_the_docs_quote_are_the_settings_defaults():
    from stapo_trl.diagnostics.token_dump import TokenDumpArguments

    fields = TokenDumpArguments.__dataclass_fields__
    text = (DOCS / "diagnostics.md").read_text()
    for name in ("dump_tokens_per_step", "dump_max_tokens", "dump_context_tokens"):
        quoted = re.search(rf"`{name}` \((\d+)\)", text)
        assert quoted is not None, name
        assert int(quoted.group(1)) == fields[name].default, name


def test_the_counterfactual_result_recomputes_from_its_records_and_the_docs_quote_it():
    from stapo_trl.research.counterfactual.summary import summarize

    result = json.loads((DOCS / "benchmarks" / "counterfactual_2e-3.json").read_text())
    assert summarize(result["records"]) == result["summary"]
    primary = result["summary"]["first_plan_primary"]
    assert primary["comparison"] == "s2t - lowest_p_outside_s2t"
    quoted = f"−{-primary['mean']:.4f} [−{-primary['low']:.4f}, −{-primary['high']:.4f}]"
    assert primary["high"] < 0 and quoted == "−0.0063 [−0.0092, −0.0034]"
    seeds = primary["seed_level"]
    assert (seeds["n"], f"{seeds['mean']:.4f}", f"{seeds['low']:.4f}", f"{seeds['high']:+.4f}") == (
        4,
        "-0.0066",
        "-0.0137",
        "+0.0006",
    )
    benchmarks = (DOCS / "studies.md").read_text()
    record = (RECORDS / "counterfactual-updates.md").read_text()
    assert f"−0.0063 [−0.0092, −0.0034] over the {primary['n']} generations" in benchmarks
    assert f"−0.0066 nats/token [−0.0137, +0.0006] over the {seeds['n']} seed means" in benchmarks
    assert "**−0.0066 nats per token, with a 95% t-interval over the four seed means" in record
    assert "**−0.0063 nats per token, 95% interval [−0.0092, −0.0034]**" in record
    assert f"over the {primary['n']} generations" in record
    assert result["summary"]["reproduction_max_abs_difference"] == 0.0


def test_the_eight_seed_counterfactual_holds_every_arm_of_every_run_and_recomputes_from_its_records():
    from stapo_trl.research.counterfactual.arms import ARMS
    from stapo_trl.research.counterfactual.summary import summarize

    result = json.loads((DOCS / "benchmarks" / "counterfactual_2e-3_eight_seeds.json").read_text())
    records = result["records"]
    assert result["seeds"] == list(range(8)) and result["seeds_missing"] == []
    by_state = Counter((record["run"], record["generation"]) for record in records)
    assert len({run for run, _ in by_state}) == 8 and len(by_state) == 80
    arms_by_state = {state: {r["arm"] for r in records if (r["run"], r["generation"]) == state} for state in by_state}
    assert all(arms == set(ARMS) for arms in arms_by_state.values())
    assert {"p_only", "low_p_high_h", "s2t_as_many_as_low_p_high_h"} <= set(ARMS)
    # Which code replayed each record: b9f9bb9, the commit that adds the second plan to the record, unchanged.
    assert {record["replayed_with"]["commit"] for record in records} == {"b9f9bb9b82d6b5cccb7472d60d043ada26707c73"}
    assert not any(record["replayed_with"]["uncommitted_changes"] for record in records)
    assert summarize(records) == result["summary"]
    summary = result["summary"]
    assert summary["reproduction_max_abs_difference"] == 0.0
    primary = summary["primary"]
    assert primary["comparison"] == "s2t_as_many_as_low_p_high_h - low_p_high_h"
    seeds = primary["seed_level"]
    quoted = f"{seeds['mean']:.4f} [{seeds['low']:.4f}, {seeds['high']:+.5f}]".replace("-", "−")
    assert seeds["n"] == 8 and seeds["low"] < 0 < seeds["high"] and quoted == "−0.0012 [−0.0024, +0.00004]"
    for page in ((DOCS / "studies.md").read_text(), (RECORDS / "counterfactual-updates.md").read_text()):
        assert f"{quoted} over the 8 seed means" in " ".join(page.replace("**", "").split())
    readings = bench_counterfactual().plan_readings(records)
    assert {key: result[key] for key in readings} == readings
    record = " ".join((RECORDS / "counterfactual-updates.md").read_text().split())
    matching = readings["count_matching"]["s2t_as_many_as_low_p_high_h"]
    assert f"in {matching['steps_with_fewer']} of the {matching['steps']} steps with `low_p_high_h` tokens" in record
    assert f"({matching['tokens']} tokens against {matching['matched_arm_tokens']} in all)" in record
    assert f"in {matching['generations_with_none']} generations S2T had none" in record
    assert all(
        readings["count_matching"][arm]["steps_with_fewer"] == 0 for arm in ("random_positive", "lowest_p_outside_s2t")
    )
    where_second = readings["primary_where_the_second_arm_silenced"]
    seeds = where_second["seed_level"]
    quoted = f"{seeds['mean']:.4f} [{seeds['low']:.4f}, {seeds['high']:+.4f}]".replace("-", "−")
    assert f"Over the {where_second['n']}, the difference is {quoted}" in record and seeds["n"] == 8


def bench_counterfactual() -> ModuleType:
    """benchmarks/bench_counterfactual.py, which imports its neighbours provenance.py and resumable_runs.py."""
    saved_path = list(sys.path)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_counterfactual", REPO / "benchmarks" / "bench_counterfactual.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved_path
    return module


def test_count_matching_counts_the_steps_where_a_count_matched_arm_had_fewer_tokens_to_draw():
    # Generation 0: low_p_high_h silences 2 then 1; its partner, short of S2T tokens in the first step, 1 then 1.
    # Generation 1: low_p_high_h silences 3 in its second step, the partner none. Generation 2: neither silences.
    silenced = {0: ([2, 1], [1, 1]), 1: ([0, 3], [0, 0]), 2: ([0, 0], [0, 0])}
    records = [
        {"run": "r", "generation": generation, "arm": arm, "silenced_per_step": steps}
        for generation, pair in silenced.items()
        for arm, steps in zip(("low_p_high_h", "s2t_as_many_as_low_p_high_h"), pair, strict=True)
    ]
    matching = bench_counterfactual().count_matching(records, "s2t_as_many_as_low_p_high_h", "low_p_high_h")
    assert matching == {
        "steps": 3,
        "steps_with_fewer": 2,
        "tokens": 2,
        "matched_arm_tokens": 6,
        "generations_with_none": 1,
    }
