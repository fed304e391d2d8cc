"""One word per concept (see `stapo_trl.file_and_metric_names`): tokens a rule removed are *silenced*, the S2T criterion is *spurious*,
the statistics backends do not take the library's name, and TRL's fused-head kernel has one backend name,
``trl_fused_head``. 0.1.0 was never released, so no retired spelling
survives anywhere, not even in a deprecation shim."""

import re
from pathlib import Path

import stapo_trl

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
    "a retired name of TRL's fused-head backend": r"""[`'"](model_head|trl_chunked)[`'"]""",
}


def retired_spellings(paths=SCANNED, root=ROOT) -> list[str]:
    found = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in RETIRED.items():
                if re.search(pattern, line):
                    found.append(f"{relative}:{number}: {what}: {line.strip()[:100]}")
    return found


def test_no_retired_word_appears_anywhere():
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


def test_the_scan_finds_the_retired_names_of_trls_fused_head_backend(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        'token_stats_backend="model_head"\n'
        "| `trl_chunked` (`ChunkedLogProbFunction`) | 6.63 s |\n"
        '{"method": "trl_chunked"}\n'
        "model_head_pass=self.per_token_logps_and_entropies, backend: trl_fused_head\n"
    )
    assert [line.split(": ")[1] for line in retired_spellings([doc], tmp_path)] == [
        "a retired name of TRL's fused-head backend"
    ] * 3
