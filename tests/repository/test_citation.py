"""CITATION.cff, the README's BibTeX and the trainer's model-card citation describe the same package and paper."""

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CITATION_CFF = ROOT / "CITATION.cff"
README = ROOT / "README.md"
PYPROJECT = ROOT / "pyproject.toml"
CI_RUN = ROOT / ".ci" / "run"


def cff():
    return yaml.safe_load(CITATION_CFF.read_text())


def pyproject_project():
    text = PYPROJECT.read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)["project"]
    # Python 3.10 has no tomllib: read name and version from the [project] table's own lines.
    table = re.search(r"^\[project\]\n(.*?)(?=^\[)", text, flags=re.DOTALL | re.MULTILINE).group(1)
    return dict(re.findall(r'^(name|version)\s*=\s*"([^"]*)"', table, flags=re.MULTILINE))


def readme_bibtex():
    match = re.search(r"^## Citation\n.*?```bibtex\n(.*?)```", README.read_text(), flags=re.DOTALL | re.MULTILINE)
    assert match, "README.md needs a ```bibtex block under its '## Citation' heading"
    return match.group(1).rstrip("\n")


def bibtex_fields(entry):
    """`key = {value}`, `key = {{value}}` or `key = 1234` per line, as a dict of plain strings."""
    fields = {}
    for key, value in re.findall(r"^\s*(\w+)\s*=\s*(\{\{.*\}\}|\{.*\}|\d+)\s*,?\s*$", entry, flags=re.MULTILINE):
        while value.startswith("{") and value.endswith("}"):
            value = value[1:-1]
        fields[key.lower()] = value
    return fields


def test_cff_describes_this_package_and_version():
    software, project = cff(), pyproject_project()
    assert software["title"] == project["name"], (
        f"CITATION.cff title is {software['title']!r}; set it to pyproject's [project].name {project['name']!r}"
    )
    assert str(software["version"]) == project["version"], (
        f"CITATION.cff version is {software['version']!r}; set it to pyproject's [project].version "
        f"{project['version']!r} (bump both together)"
    )


def test_readme_bibtex_matches_cff_preferred_citation():
    paper = cff()["preferred-citation"]
    bib = bibtex_fields(readme_bibtex())
    fix = "; make README.md's '## Citation' BibTeX and CITATION.cff's preferred-citation agree"
    assert bib["title"] == paper["title"], f"title: README {bib['title']!r} vs CITATION.cff {paper['title']!r}{fix}"
    cff_authors = " and ".join(f"{a['given-names']} {a['family-names']}" for a in paper["authors"])
    assert bib["author"] == cff_authors, (
        f"authors (in order): README {bib['author']!r} vs CITATION.cff {cff_authors!r}{fix}"
    )
    assert bib["year"] == str(paper["year"]), f"year: README {bib['year']!r} vs CITATION.cff {paper['year']!r}{fix}"
    (arxiv_id,) = [i["value"] for i in paper["identifiers"] if i["type"] == "other"]
    assert arxiv_id in bib["eprint"], (
        f"eprint: README {bib['eprint']!r} lacks CITATION.cff's arXiv id {arxiv_id!r}{fix}"
    )
    assert bib["doi"] == paper["doi"], f"doi: README {bib['doi']!r} vs CITATION.cff {paper['doi']!r}{fix}"
    assert bib["url"] == paper["url"], f"url: README {bib['url']!r} vs CITATION.cff {paper['url']!r}{fix}"


def test_trainer_model_card_citation_is_the_readme_bibtex():
    from stapo_trl.core.trainer import STAPO_CITATION

    trainer_lines = [line.strip() for line in STAPO_CITATION.strip().splitlines()]
    readme_lines = [line.strip() for line in readme_bibtex().strip().splitlines()]
    assert trainer_lines == readme_lines, (
        "stapo_trl.core.trainer.STAPO_CITATION differs from README.md's '## Citation' BibTeX; "
        "copy one into the other (indentation aside they must be identical)"
    )


def test_ci_validates_citation_cff():
    script = CI_RUN.read_text()
    assert re.search(r'cffconvert"?\s+--validate\s+-i\s+CITATION\.cff', script), (
        ".ci/run must validate CITATION.cff with `cffconvert --validate -i CITATION.cff` (in its own venv)"
    )
