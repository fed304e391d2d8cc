"""The metric glossary of docs/diagnostics.md is each rule's own description of its metrics (`RuleMetric`: name,
unit, meaning, and the keys its run summary has in ``run_summary.json``): one table per rule with metrics, after a
``<!-- rule-metrics:<name> -->`` line. A rule that changes what it logs changes its table, or this test fails and
prints the table to paste."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stapo_trl.core.token_rules import RuleMetric, TokenRuleSpec, registered_rules

GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "diagnostics.md"


def metric_glossary(spec: TokenRuleSpec) -> str:
    """The Markdown table of a rule's metrics, one row per metric in the order the spec lists them."""
    lines = ["| metric | unit | meaning | in `run_summary.json` |", "|---|---|---|---|"]
    for metric in spec.metrics:
        summaries = ", ".join(f"`{key}` ({kind})" for key, kind in metric.summaries) or "–"
        lines.append(f"| `{spec.metric(metric.statistic)}` | {metric.unit} | {metric.meaning} | {summaries} |")
    return "\n".join(lines)


def documented_table(text: str, rule: str) -> str | None:
    """The table that follows ``<!-- rule-metrics:<rule> -->`` in ``text``, or None when there is no such marker."""
    match = re.search(rf"^<!-- rule-metrics:{re.escape(rule)} -->\n((?:\|.*\n?)+)", text, flags=re.MULTILINE)
    return match.group(1).rstrip("\n") if match else None


@pytest.mark.parametrize("spec", [spec for spec in registered_rules() if spec.metrics], ids=lambda spec: spec.name)
def test_the_docs_glossary_is_the_rules_description_of_its_metrics(spec):
    expected = metric_glossary(spec)
    found = documented_table(GLOSSARY.read_text(), spec.name)
    assert found == expected, f"docs/diagnostics.md should hold, after <!-- rule-metrics:{spec.name} -->:\n{expected}"


def test_a_stale_glossary_is_found():
    class Rule(TokenRuleSpec):
        name = "cap"
        metrics = (RuleMetric("num_dropped", "tokens dropped", "tokens", (("dropped", "sum"),)),)

    table = metric_glossary(Rule())
    assert table.splitlines()[-1] == "| `cap/num_dropped` | tokens | tokens dropped | `dropped` (sum) |"
    page = f"text\n\n<!-- rule-metrics:cap -->\n{table}\n\nmore text\n"
    assert documented_table(page, "cap") == table
    assert documented_table(page.replace("tokens dropped |", "tokens kept |"), "cap") != table
    assert documented_table(page, "other") is None
