"""One word per concept (see `stapo_trl.names`): tokens a rule removed are *silenced*, the S2T criterion is *spurious*,
and the statistics backends do not take the library's name. The retired spellings survive only in deprecation shims,
which keep old runs and configs readable."""

import re
import warnings
from pathlib import Path

import pytest
import torch

import stapo_trl
from stapo_trl.names import (
    RETIRED_METRICS,
    S2T_NUM_SILENCED,
    S2T_SILENCED_FRACTION,
    S2T_SILENCED_GRAD_SQ_SHARE,
    with_current_metric_names,
)
from stapo_trl.token_rules import spurious_token_mask

ROOT = Path(stapo_trl.__file__).parent.parent
SCANNED = [
    *sorted((ROOT / "stapo_trl").rglob("*.py")),
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "docs").rglob("*.json")),
    ROOT / "README.md",
    *sorted((ROOT / "notebooks").glob("*.ipynb")),
]
RETIRED = {
    "the word 'masked' for removed tokens": r"\b(un)?masked\b",
    "a retired metric or summary name": r"masked_(fraction|tokens|steps|grad_sq_share)|num_masked",
    "the backend name 'trl'": r"""(backend|method)["']?\s*[=:]\s*["']trl["']|`"?trl"?` backend|backend `"?trl"?`""",
}
SHIMS = {
    ("stapo_trl/names.py", "a retired metric or summary name"),
    ("stapo_trl/fused_stats/__init__.py", "the backend name 'trl'"),
    ("stapo_trl/config.py", "the backend name 'trl'"),
}
"""(file, retired spelling) pairs where a deprecation shim names the old spelling on purpose."""


def retired_spellings(paths=SCANNED, root=ROOT) -> list[str]:
    found = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in RETIRED.items():
                if re.search(pattern, line) and (relative, what) not in SHIMS:
                    found.append(f"{relative}:{number}: {what}: {line.strip()[:100]}")
    return found


def test_the_retired_words_appear_only_in_deprecation_shims():
    assert retired_spellings() == []


def test_the_scan_finds_each_retired_spelling(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "S2T masked 0.1% of loss tokens\n"
        "summary['masked_tokens']\n"
        'token_stats_backend="trl"\n'
        "the `trl` backend\n"
        "silenced tokens, completion_mask, masked_fill, trl_chunked, backend: model_head\n"
    )
    assert [line.split(": ")[1] for line in retired_spellings([doc], tmp_path)] == [
        "the word 'masked' for removed tokens",
        "a retired metric or summary name",
        "the backend name 'trl'",
        "the backend name 'trl'",
    ]


def test_a_log_with_the_retired_metric_names_reads_under_the_current_ones():
    old = [{"step": 1, "s2t/masked_fraction": 0.01, "s2t/num_masked": 3, "s2t/masked_grad_sq_share": 0.2, "loss": 0.5}]
    with pytest.warns(FutureWarning, match="retired metric names"):
        (record,) = with_current_metric_names(old, "old run")
    assert record == {
        "step": 1,
        S2T_SILENCED_FRACTION: 0.01,
        S2T_NUM_SILENCED: 3,
        S2T_SILENCED_GRAD_SQ_SHARE: 0.2,
        "loss": 0.5,
    }
    assert set(RETIRED_METRICS.values()) == {S2T_SILENCED_FRACTION, S2T_NUM_SILENCED, S2T_SILENCED_GRAD_SQ_SHARE}


def test_a_log_with_the_current_names_passes_without_a_warning():
    current = [{"step": 1, S2T_SILENCED_FRACTION: 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert with_current_metric_names(current) == current


def test_spurious_token_mask_statistics_still_answer_to_their_retired_key_with_a_warning():
    # Two candidates (p 0.001 < 0.002, A > 0) with entropies 0.1 and 0.5 put tau_h at 0.1 + 0.8 * 0.4 = 0.42: the
    # first is silenced and carries a share of the squared logit-gradient norm strictly between 0 and 1.
    log_probs = torch.log(torch.tensor([[0.001, 0.001, 0.9]]))
    entropies = torch.tensor([[0.1, 0.5, 1.0]])
    _, stats = spurious_token_mask(
        log_probs, entropies, torch.tensor([1.0]), torch.ones(1, 3), prob_threshold=0.002, entropy_quantile=0.8
    )
    assert stats["num_candidates"] == 2 and stats["num_spurious"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        current = stats["spurious_grad_sq_share"]
    assert 0.0 < current < 1.0
    with pytest.warns(FutureWarning, match="now called 'spurious_grad_sq_share'"):
        assert stats["masked_grad_sq_share"] == current
    with pytest.warns(FutureWarning):
        assert stats.get("masked_grad_sq_share") == current
    assert "masked_grad_sq_share" not in stats
    assert stats.get("no_such_statistic", "default") == "default"
    with pytest.raises(KeyError):
        stats["no_such_statistic"]
