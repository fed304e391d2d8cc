"""The model card: built with `huggingface_hub`'s `ModelCardData` and `ModelCard` by the Hub's conventions (metadata
that parses, a license, `pipeline_tag`, no local path), keeping TRL's training procedure and citations and adding the
STAPO sections (method and thresholds, statistics and trends, evaluation, recipe, citation) under one heading;
rewritten in place; and `push_to_hub` uploading it with the weights, against an intercepted `HfApi` (the real Hub is
unreachable here)."""

import json
import math
import shutil
from pathlib import Path

import pytest
from huggingface_hub import HfApi, RepoUrl
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.card.model_card import (
    CardFacts,
    ModelCardCallback,
    build_model_card,
    card_sections,
    check_model_card,
    method_section,
    refresh_model_card,
    statistics_section,
)
from stapo_trl.core.paper import STAPO_CITATION
from stapo_trl.diagnostics.run_record import RunRecord, build_run_record
from stapo_trl.file_and_metric_names import RECIPE_FILE

TINY = {"prob_threshold": 0.2, "temperature": 1.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny STAPO run of 2 steps whose card has been written once."""
    output_dir = tmp_path_factory.mktemp("card-run")
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, output_dir, **TINY), callbacks=[ModelCardCallback()])
    trainer.train()
    trainer.create_model_card(model_name="tiny-stapo")
    return trainer, output_dir


def test_the_trainers_own_card_cites_stapo_and_names_its_rules_thresholds(tmp_path):
    """Without the whole card's callback (a library run), the card the trainer writes is TRL's, tagged, citing STAPO,
    with a section that names the token rules and their thresholds."""
    trainer = tiny_trainer(STAPOTrainer, tiny_config(STAPOConfig, tmp_path, **TINY))
    trainer.create_model_card(model_name="tiny-stapo")
    card = (tmp_path / "README.md").read_text()
    assert "- stapo" in card and STAPO_CITATION.splitlines()[0] in card
    rules = card.split("## Token rules", 1)[1]
    assert "S2T on: prob_threshold 0.2, entropy_quantile 0.8" in rules


def card_of(trainer, output_dir) -> str:
    trainer.create_model_card(model_name="tiny-stapo")
    return (output_dir / "README.md").read_text()


def test_the_card_keeps_trls_training_procedure_versions_and_citations_and_adds_stapos(trained):
    trainer, output_dir = trained
    card = card_of(trainer, output_dir)
    for trl_part in ("## Quick start", "from transformers import pipeline", "### Framework versions", "- TRL: 1.16"):
        assert trl_part in card, trl_part
    assert "- stapo-trl: 0.1.0" in card
    assert "Cite STAPO as:" in card and STAPO_CITATION in card and "Cite TRL as:" in card
    assert "https://arxiv.org/abs/2602.15620" in card
    # Level-2 sections in order; every STAPO subsection is a level 3 under "STAPO training details".
    headings = list(card_sections(card.split("---", 2)[2]))
    assert headings == [
        "## Quick start",
        "## Training procedure",
        "## STAPO training details",
        "## Citations",
    ]
    details = card_sections(card)["## STAPO training details"]
    assert [line for line in details.splitlines() if line.startswith("#")] == [
        "## STAPO training details",
        "### Token-rule statistics and trends",
        "### Recipe",
    ]


def test_the_card_metadata_follows_the_hubs_conventions_and_has_no_local_path(trained):
    from huggingface_hub import ModelCard

    trainer, output_dir = trained
    card_of(trainer, output_dir)
    data = ModelCard.load(output_dir / "README.md").data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"trl", "grpo", "stapo", "generated_from_trainer"} <= set(data["tags"])
    assert "licence" not in data  # TRL's template writes `licence: license`, which the Hub does not read
    assert "base_model" not in data  # the tiny model is built in code: no Hub base to name
    problems = check_model_card(output_dir / "README.md")
    assert problems == ["no license in the metadata"], problems  # nothing else, and no absolute path
    assert str(output_dir) not in (output_dir / "README.md").read_text()


def test_check_model_card_finds_what_the_hub_would_refuse_or_a_reader_could_not_use(tmp_path):
    card = tmp_path / "README.md"
    card.write_text(
        "---\nbase_model: /tmp/models/base\nlicence: license\nlibrary_name: peft\ntags:\n- trl\n---\n\n"
        'model = "/home/me/run"\n'
    )
    problems = check_model_card(card)
    assert "no license in the metadata" in problems and "no pipeline_tag in the metadata" in problems
    assert (
        "base_model '/tmp/models/base' is not a Hub repo id (Repo id must be in the form 'repo_name' or "
        in " ".join(problems)
    )
    assert "absolute local path '/home/me/run'" in problems
    assert any("'licence'" in problem for problem in problems)
    card.write_text("---\nlicense: [unclosed\n---\n")
    assert check_model_card(card)[0].startswith("the metadata cannot be parsed")


def test_the_card_names_the_method_and_its_thresholds(trained):
    card = card_of(*trained)
    assert "Trained with **STAPO**" in card
    assert "| `prob_threshold` (tau_p: candidates have p below) | 0.2 |" in card
    assert "| `entropy_quantile` (q: tau_h is this quantile of the candidates' entropies) | 0.8 |" in card
    assert (
        "| `loss_type` (loss aggregation) | dapo |" in card
        and "| `epsilon_high` (clip epsilon (high)) | 0.28 |" in card
    )


def test_the_card_summarizes_the_final_s2t_statistics_from_the_log(trained):
    trainer, output_dir = trained
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    silenced = sum(int(entry["s2t/num_silenced"]) for entry in steps)
    candidates = sum(int(entry["s2t/num_candidates"]) for entry in steps)
    fraction = sum(entry["s2t/silenced_fraction"] for entry in steps) / len(steps)
    card = card_of(trainer, output_dir)
    assert f"S2T silenced {silenced} tokens of {candidates} candidates; mean silenced fraction {fraction:.4%}" in card
    # The trends: the same sentences as the end-of-run summary and `stapo-trl report`
    # (tests/unit/test_run_record_agrees.py).
    assert "- mean token entropy (nats) " in card and "(first quarter of steps) ->" in card


def eval_summary(label="tiny-stapo"):
    score = {"avg_at_k": 12.5, "samples_per_problem": 4, "partial": False, "complete": True}
    return {
        "model": {"label": label, "size": None, "method": "stapo"},
        "settings": [
            {"name": "justrl", "label": "T=0.7, top-p=0.9", "benchmarks": {"math500": score}, "average": 12.5}
        ],
    }


def test_the_card_includes_the_eval_table_only_when_an_eval_summary_exists(trained):
    trainer, output_dir = trained
    assert "### Evaluation" not in card_of(trainer, output_dir)
    (output_dir / "eval").mkdir()
    (output_dir / "eval" / "summary.json").write_text(json.dumps(eval_summary()))
    try:
        card = card_of(trainer, output_dir)
    finally:
        shutil.rmtree(output_dir / "eval")
    assert "### Evaluation" in card and "`stapo-trl eval` (eval/summary.json; avg@k in %)" in card
    assert card.index("### Evaluation") > card.index("## STAPO training details")
    assert "| tiny-stapo | T=0.7, top-p=0.9 | – | – | – | 12.50 | – | – |" in card


def test_the_card_embeds_the_recipe_or_else_the_values_that_differ_from_the_defaults(trained):
    trainer, output_dir = trained
    card = card_of(trainer, output_dir)
    recipe = card.split("### Recipe", 1)[1]
    assert "Trained from Python" in recipe and "prob_threshold: 0.2" in recipe and "max_steps: 2" in recipe
    assert "adam_beta1" not in recipe and "entropy_quantile" not in recipe  # defaults are left out
    (output_dir / RECIPE_FILE).write_text("# stapo-trl train --config my.yaml\nmethod: stapo\nmax_steps: 2\n")
    try:
        recipe = card_of(trainer, output_dir).split("### Recipe", 1)[1]
    finally:
        (output_dir / RECIPE_FILE).unlink()
    assert "The recipe this model was trained with:" in recipe
    assert "```yaml\n# stapo-trl train --config my.yaml\nmethod: stapo\nmax_steps: 2\n```" in recipe


def test_a_saved_run_card_is_refreshed_from_disk_after_an_evaluation(trained, tmp_path):
    trainer, output_dir = trained
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    trainer.args.output_dir, original = str(saved), trainer.args.output_dir
    try:
        trainer.create_model_card(model_name="tiny-stapo")
        trainer.save_state()
    finally:
        trainer.args.output_dir = original
    before = (saved / "README.md").read_text()
    (saved / "eval").mkdir()
    (saved / "eval" / "summary.json").write_text(json.dumps(eval_summary()))
    after = refresh_model_card(saved).read_text()
    assert "### Evaluation" not in before and "### Evaluation" in after
    # Everything but the STAPO section is kept: metadata, quick start, TRL's training procedure and citations.
    kept = ("## Quick start", "## Training procedure", "## Citations")
    assert [card_sections(after)[heading] for heading in kept] == [card_sections(before)[heading] for heading in kept]
    assert after.split("---", 2)[1] == before.split("---", 2)[1]
    assert after.count("## STAPO training details") == 1 and "S2T silenced" in after
    with pytest.raises(FileNotFoundError, match="has no README.md or training_args.bin"):
        refresh_model_card(tmp_path / "empty")


def test_writing_the_card_again_gives_the_same_card(trained):
    first = card_of(*trained)
    assert card_of(*trained) == first
    assert first.count("## STAPO training details") == 1 and first.count("## Citations") == 1


def test_the_card_describes_stare_and_plain_grpo_runs(tmp_path):
    stare = STAPOConfig(output_dir=str(tmp_path), use_cpu=True, use_s2t_mask=False, use_stare=True, stare_variant="C2")
    text = "\n".join(method_section(stare))
    assert "Trained with **STARE**" in text and "| `stare_negative_weight` (M (start, C2)) | 0.9 |" in text
    assert "prob_threshold" not in text
    history = [{"step": 1, "loss": 0.0, "entropy": 0.5, "stare/gate_on": 1.0, "stare/positive_weight": 1.1}]
    history[0]["stare/negative_weight"] = 0.9
    record = build_run_record(history)
    assert "- STARE gate on in 100% of logged steps; final W 1.1, M 0.9." in statistics_section(stare, record)

    grpo = STAPOConfig(output_dir=str(tmp_path), use_cpu=True, use_s2t_mask=False)
    assert "Trained with **GRPO**" in "\n".join(method_section(grpo))
    assert "- No token rule was on in this run." in statistics_section(grpo, record)
    no_candidates = [{"step": 1, "loss": 0.0, "s2t/silenced_fraction": 0.0, "s2t/entropy_threshold": math.nan}]
    assert "- tau_h: no step had a candidate token" in "\n".join(
        statistics_section(STAPOConfig(output_dir=str(tmp_path), use_cpu=True), build_run_record(no_candidates))
    )


def test_push_to_hub_uploads_the_card_and_weights_through_an_intercepted_hfapi(tmp_path, monkeypatch):
    """Not the real Hub: `HfApi.create_repo` and `HfApi.upload_folder` are replaced by functions that record the
    repo id and copy the uploaded folder into a local directory, as the Hub would store it."""
    hub = tmp_path / "hub"
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        calls.append(("upload_folder", repo_id))
        ignored = shutil.ignore_patterns(*(ignore_patterns or []))
        shutil.copytree(folder_path, hub / repo_id, ignore=ignored, dirs_exist_ok=True)
        return f"https://huggingface.co/{repo_id}/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    config = tiny_config(
        STAPOConfig, tmp_path / "run", push_to_hub=True, hub_model_id="my-org/tiny-stapo", max_steps=1, **TINY
    )
    trainer = tiny_trainer(STAPOTrainer, config, callbacks=[ModelCardCallback()])
    trainer.train()
    trainer.push_to_hub()

    assert calls == [("create_repo", "my-org/tiny-stapo"), ("upload_folder", "my-org/tiny-stapo")]
    uploaded = hub / "my-org" / "tiny-stapo"
    assert (uploaded / "model.safetensors").is_file() and (uploaded / "config.json").is_file()
    card = (uploaded / "README.md").read_text()
    assert "# Model Card for tiny-stapo" in card and 'model="my-org/tiny-stapo"' in card  # the quick start
    assert "`my-org/tiny-stapo` is the Hub repository this card belongs to" in card
    assert "Trained with **STAPO**" in card and "S2T silenced" in card
    assert STAPO_CITATION in card
    assert not list(Path(uploaded).glob("checkpoint-*"))


def test_an_adapter_trained_on_a_gguf_file_is_evaluated_on_those_weights(tmp_path):
    """`stapo-trl eval --model RUN` takes an adapter's base from the GGUF file its run recorded, when that file is a
    quantization of the base `adapter_config.json` names; otherwise from `adapter_config.json`."""
    from stapo_trl.evaluation.models import trained_on_gguf
    from stapo_trl.gguf import SMOLLM2_GGUF, hub_source

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_summary.json").write_text(json.dumps({"model_source": SMOLLM2_GGUF}))
    assert trained_on_gguf(run, hub_source(SMOLLM2_GGUF)) == SMOLLM2_GGUF
    assert trained_on_gguf(run, "Qwen/Qwen3-8B-Base") is None  # another base: the adapter's own record wins
    (run / "run_summary.json").write_text(json.dumps({"model_source": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert trained_on_gguf(run, "HuggingFaceTB/SmolLM2-135M-Instruct") is None  # not a GGUF: nothing to replace
    assert trained_on_gguf(tmp_path / "no-summary", "HuggingFaceTB/SmolLM2-135M-Instruct") is None


# --- results in the metadata (model-index) -------------------------------------------------------------------------

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "model-card.md"
EXAMPLE_MARKERS = ("<!-- model-card-example:start -->", "<!-- model-card-example:end -->")


def benchmark_score(avg_at_k, k, partial=False):
    return {"avg_at_k": avg_at_k, "samples_per_problem": k, "partial": partial, "complete": True}


def whole_benchmark_summary():
    """A `stapo-trl eval` summary as the harness writes it: MATH-500 from its Hub dataset, whole, and AIME24 from the
    problems shipped with stapo-trl. The avg@k values are illustrative (a whole benchmark needs the Hub, which this
    project's machines cannot reach); everything the card does with them is the code's."""
    return {
        "model": {"label": "quickstart-smollm2-135m-cpu", "size": None, "method": "stapo"},
        "datasets": {
            "math500": {"source": "HuggingFaceH4/MATH-500", "split": "test", "hub": True},
            "aime24": {"source": "sample", "split": "train", "hub": False},
        },
        "max_new_tokens": 1024,
        "settings": [
            {
                "name": "justrl",
                "label": "T=0.7, top-p=0.9",
                "temperature": 0.7,
                "top_p": 0.9,
                "benchmarks": {"math500": benchmark_score(9.3, 4), "aime24": benchmark_score(0.0, 32, partial=True)},
                "average": 4.65,
            }
        ],
    }


def quickstart_card(output_dir: Path, with_eval_summary: bool = True):
    """The card of the README's CPU quickstart run (seed 0: held-out greedy accuracy 22/64 before training, 43/64
    after), built by `build_model_card`; with `whole_benchmark_summary` (made-up avg@k, for the tests only) in its
    ``eval/`` directory when ``with_eval_summary``."""
    from stapo_trl.gguf import SMOLLM2_GGUF

    if with_eval_summary:
        (output_dir / "eval").mkdir(parents=True, exist_ok=True)
        (output_dir / "eval" / "summary.json").write_text(json.dumps(whole_benchmark_summary()))
    record = RunRecord(
        accuracy_before={"accuracy": 22 / 64, "standard_error": 0.0594, "correct": 22, "total": 64},
        accuracy_after={"accuracy": 43 / 64, "standard_error": 0.0587, "correct": 43, "total": 64},
    )
    facts = CardFacts(
        model_name="quickstart-smollm2-135m-cpu",
        location="outputs/quickstart-smollm2-135m-cpu",
        adapter=True,
        adapter_type="LORA",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        tags=["trl", "grpo", "stapo"],
        gguf_source=SMOLLM2_GGUF,
        dataset_description="arithmetic word problems generated by stapo-trl (`stapo_trl.data.arithmetic`)",
        dataset_reference="arithmetic",
        license="apache-2.0",
    )
    config = STAPOConfig(output_dir=str(output_dir), use_cpu=True)
    return build_model_card(config, record, output_dir, facts, trl_card_text="")


def test_results_are_model_index_metadata_that_huggingface_hub_reads_back(tmp_path):
    from huggingface_hub import EvalResult, ModelCard

    quickstart_card(tmp_path).save(tmp_path / "README.md")
    card = ModelCard.load(
        tmp_path / "README.md"
    )  # huggingface_hub's own parsing: it refuses a model-index it cannot read
    assert card.data.model_name == "quickstart-smollm2-135m-cpu"
    assert card.data.eval_results == [
        EvalResult(
            task_type="text-generation",
            task_name="Text Generation",
            dataset_type="arithmetic",
            dataset_name="arithmetic word problems generated by stapo-trl (`stapo_trl.data.arithmetic`): 64 problems "
            "held out from training",
            metric_type="accuracy",
            metric_name="held-out greedy accuracy",
            metric_value=0.6719,
            metric_config="greedy",
        ),
        EvalResult(
            task_type="text-generation",
            task_name="Text Generation",
            dataset_type="HuggingFaceH4/MATH-500",
            dataset_name="MATH-500",
            dataset_split="test",
            metric_type="avg@4",
            metric_name="avg@4 (%)",
            metric_value=9.3,
            metric_config="T=0.7, top-p=0.9",
            metric_args={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 1024},
        ),
    ]
    assert check_model_card(tmp_path / "README.md") == []
    evaluation = card_sections(str(card))["## STAPO training details"].split("### Evaluation", 1)[1]
    assert "holds 2 of these results" in evaluation
    assert "- AIME 2024 (T=0.7, top-p=0.9) in eval/summary.json: measured on the few problems shipped" in evaluation


def test_a_card_without_results_has_no_model_index(trained):
    trainer, output_dir = trained
    card = card_of(trainer, output_dir)
    assert "model-index" not in card and "model_name: tiny-stapo" in card


def test_check_model_card_refuses_a_model_index_the_hub_could_not_read(tmp_path):
    card = tmp_path / "README.md"
    card.write_text(
        "---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- trl\n"
        "model-index:\n- name: m\n  results:\n  - task:\n      type: text-generation\n    dataset:\n"
        "      type: HuggingFaceH4/MATH-500\n      name: MATH-500\n    metrics:\n    - type: avg@4\n---\n"
    )  # a metric without its value
    (problem,) = check_model_card(card)
    assert problem.startswith("the metadata cannot be parsed: Invalid `model_index` in metadata cannot be parsed")


@pytest.mark.parametrize(
    ("repo_id", "accepted"),
    [("gpt2", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org--x/model", False), ("org/mo..del", False)],
)
def test_repo_ids_are_checked_by_the_hubs_own_rules(tmp_path, repo_id, accepted):
    card = tmp_path / "README.md"
    card.write_text(
        f"---\nbase_model: {repo_id}\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\n"
        "tags:\n- trl\n---\n"
    )
    problems = check_model_card(card)
    assert problems == [] if accepted else problems[0].startswith(f"base_model {repo_id!r} is not a Hub repo id")


def example_block(card) -> str:
    """What docs/model-card.md shows of ``card``: its metadata and its Evaluation subsection."""
    text = str(card)
    metadata = text.split("---", 2)[1].strip()
    evaluation = "### Evaluation" + card_sections(text)["## STAPO training details"].split("### Evaluation", 1)[1]
    evaluation = evaluation.split("\n### ", 1)[0].rstrip()
    return f"```yaml\n---\n{metadata}\n---\n```\n\n```markdown\n{evaluation}\n```"


def test_the_docs_show_the_card_the_code_writes(tmp_path):
    """docs/model-card.md holds the quickstart run's card's metadata and Evaluation subsection as the code writes
    them: measured results only, so without the tests' made-up avg@k."""
    expected = example_block(quickstart_card(tmp_path, with_eval_summary=False))
    page = DOCS_PAGE.read_text()
    start, end = (page.index(marker) for marker in EXAMPLE_MARKERS)
    shown = page[start + len(EXAMPLE_MARKERS[0]) : end].strip()
    assert shown == expected, f"docs/model-card.md should hold, between {EXAMPLE_MARKERS}:\n{expected}"
