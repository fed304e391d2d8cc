"""The STAPO part of a trained model's card: method and thresholds, final token-rule statistics, evaluation results,
the recipe, and the STAPO citation.

TRL writes the card (`create_model_card`, on every checkpoint save and on `push_to_hub`); `STAPOTrainer` then inserts
the sections built here before TRL's "Citations", keeping TRL's quick-start snippet and framework versions. The
sections sit between two HTML comments, so writing the card again replaces them instead of adding a second copy.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import yaml

from .diagnostics.report import series
from .names import EVAL_SUMMARY_FILE, RUN_SUMMARY_FILE, TRAINER_STATE_FILE
from .token_rules import get_token_rule

PAPER_TITLE = "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens"
PAPER_ID = "2602.15620"
PAPER_URL = f"https://arxiv.org/abs/{PAPER_ID}"
STAPO_CITATION = textwrap.dedent("""\
    @article{liu2026stapo,
        title        = {{STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens}},
        author       = {Shiqi Liu and Zeyu He and Guojian Zhan and Letian Tao and Zhilong Zheng and Jiang Wu and Yinuo Wang and Yang Guan and Kehua Sheng and Bo Zhang and Keqiang Li and Jingliang Duan and Shengbo Eben Li},
        year         = 2026,
        eprint       = {arXiv:2602.15620},
        doi          = {10.48550/arXiv.2602.15620},
        url          = {https://arxiv.org/abs/2602.15620},
    }""")

RECIPE_FILE = "recipe.yaml"
"""Written into the output dir by `stapo-trl train`: the recipe as given, headed by the command line."""
START_MARKER = "<!-- stapo-trl:start -->"
END_MARKER = "<!-- stapo-trl:end -->"
TRL_CITATIONS_HEADING = "## Citations"

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
SKIPPED_CONFIG_KEYS = {"output_dir", "logging_dir", "hub_token", "push_to_hub_token"}
FILLED_IN_POST_INIT = {
    "accelerator_config",
    "activation_checkpointing",
    "dataloader_pin_memory",
    "debug",
    "disable_tqdm",
    "pad_to_multiple_of",
}
"""Fields that `TrainingArguments.__post_init__` resolves from other fields or the machine, not the user's choices."""


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def method_section(config: Any) -> list[str]:
    """The method, with a link to the paper, and a table of the thresholds and loss settings that define it."""
    from .methods import describe_token_rule, infer_method, method_preset, method_title
    from .version import __version__

    method = infer_method(config)
    title = method_title(config)
    lines = [
        "## STAPO training details",
        "",
        f"Trained with **{title}** using [stapo-trl](https://pypi.org/project/stapo-trl/) {__version__} "
        f"(`STAPOTrainer`, a subclass of TRL's `GRPOTrainer`). STAPO is described in [{PAPER_TITLE}]({PAPER_URL}) "
        f"(arXiv {PAPER_ID}).",
        "",
        f"- Method: {title}: {method_preset(method).summary}.",
        f"- Token rules: {describe_token_rule(config)}.",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    rows = [row for name in config.active_token_rules for row in get_token_rule(name).card_settings(config)]
    if rows:
        rows.append(("token_stats_source", "policy that supplies p and H"))
    rows += SETTINGS
    if config.top_entropy_quantile < 1.0:
        rows.append(("top_entropy_quantile", "20-Entropy: share of highest-entropy tokens kept"))
    if config.delta is not None:
        rows.append(("delta", "dual-clip bound for negative advantages"))
    lines += [f"| `{key}` ({meaning}) | {_value(getattr(config, key))} |" for key, meaning in rows]
    return lines


def _logged(history: list[dict[str, Any]], key: str) -> list[float]:
    return series(history, key)[1]


def statistics_section(config: Any, history: list[dict[str, Any]]) -> list[str]:
    """The token rules' statistics over the logged steps: how much the mask silenced, tau_h, and entropy."""
    steps = [record for record in history if "loss" in record and "step" in record]
    lines = ["### Final token-rule statistics", ""]
    if not steps:
        return lines + ["No training steps were logged when this card was written."]
    entropy = _logged(steps, "entropy")
    if entropy:
        lines.append(
            f"- Mean token entropy: {entropy[0]:.3f} nats at the first logged step, {entropy[-1]:.3f} at the last "
            f"({len(steps)} logged steps, last step {steps[-1]['step']})."
        )
    rules = config.active_token_rules
    for name in rules:
        lines += get_token_rule(name).card_statistics(steps)
    if not rules:
        lines.append("- No token rule was on in this run.")
    return lines


def find_eval_summaries(output_dir: str | Path) -> list[Path]:
    """`stapo-trl eval` summaries in the output dir or one level below (e.g. ``output_dir/eval/summary.json``)."""
    output_dir = Path(output_dir)
    candidates = [output_dir / EVAL_SUMMARY_FILE, *sorted(output_dir.glob(f"*/{EVAL_SUMMARY_FILE}"))]
    found = []
    for path in candidates:
        if path.is_file():
            try:
                if "settings" in json.loads(path.read_text()):
                    found.append(path)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
    return found


def read_run_summary(output_dir: str | Path) -> dict[str, Any]:
    """The `run_summary.json` that `stapo-trl train` wrote in ``output_dir``, or ``{}`` for a run without one."""
    path = Path(output_dir) / RUN_SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def evaluation_section(output_dir: str | Path, run_summary: dict[str, Any]) -> list[str]:
    """The held-out accuracy of `stapo-trl train` (from its ``run_summary``) and the tables of any `stapo-trl eval`
    summaries in ``output_dir``; empty if none."""
    from .evaluation.table import markdown_table, summary_rows

    output_dir = Path(output_dir)
    lines: list[str] = []
    before, after = run_summary.get("accuracy_before"), run_summary.get("accuracy_after")
    if before and after:
        lines += [
            f"- Held-out greedy accuracy ({after['total']} problems): {before['accuracy']:.3f} before training, "
            f"{after['accuracy']:.3f} ± {after['standard_error']:.3f} after.",
            "",
        ]
    for path in find_eval_summaries(output_dir):
        summary = json.loads(path.read_text())
        lines += [
            f"`stapo-trl eval` ({path.relative_to(output_dir)}; avg@k in %):",
            "",
            markdown_table(summary_rows(summary)),
            "",
        ]
    while lines and not lines[-1]:
        lines.pop()
    return ["### Evaluation", "", *lines] if lines else []


def _is_empty(value: Any) -> bool:
    return value is None or value in ("", "none", [], {}, ["none"])


def _non_default_config(config: Any) -> dict[str, Any]:
    """The config's values that differ from its fields' defaults, without the ones `__post_init__` fills in.

    (Building a default config to compare with is not an option: creating training arguments resets accelerate's
    state in the middle of training.)
    """
    values = config.to_dict()
    changed = {}
    for name, spec in type(config).__dataclass_fields__.items():
        if name in SKIPPED_CONFIG_KEYS or name in FILLED_IN_POST_INIT or name not in values or not spec.init:
            continue
        default = spec.default_factory() if callable(spec.default_factory) else spec.default
        value = values[name]
        if value != default and not (_is_empty(value) and _is_empty(default)):
            changed[name] = value
    return changed


def recipe_section(config: Any, output_dir: str | Path) -> list[str]:
    """The recipe the run used (``recipe.yaml``), or the config values that differ from the defaults."""
    recipe = Path(output_dir) / RECIPE_FILE
    if recipe.is_file():
        text, intro = recipe.read_text().rstrip(), "The recipe this model was trained with:"
    else:
        text = yaml.safe_dump(_non_default_config(config), sort_keys=True).rstrip()
        intro = "Trained from Python; the `STAPOConfig` values that differ from its defaults:"
    return ["### Recipe", "", intro, "", "```yaml", text, "```"]


def stapo_card_sections(config: Any, history: list[dict[str, Any]], output_dir: str | Path) -> str:
    """The Markdown that `STAPOTrainer` inserts into TRL's model card, between the stapo-trl markers."""
    run_summary = read_run_summary(output_dir)
    parts = [
        method_section(config),
        base_model_section(run_summary),
        statistics_section(config, history),
        evaluation_section(output_dir, run_summary),
        recipe_section(config, output_dir),
    ]
    body = "\n\n".join("\n".join(part) for part in parts if part)
    return f"{START_MARKER}\n{body}\n{END_MARKER}\n"


TRL_NONE_BASE_MODEL = "fine-tuned version of [None](https://huggingface.co/None)"
TRL_NONE_PIPELINE_MODEL = 'pipeline("text-generation", model="None"'


def fill_trl_nones(card: str, base_model: str | None, model_location: str) -> str:
    """TRL's card without the "None" its template prints for what it does not know: the base model when that is a
    local directory ("fine-tuned version of [None](...)"), and the quick start's model when the run is not pushed to
    the Hub (``model="None"``), which becomes ``model_location``, the directory the model was saved to."""
    described = (
        f"fine-tuned version of the local model `{base_model}`"
        if base_model
        else "fine-tuned version of a local model"
    )
    card = card.replace(TRL_NONE_BASE_MODEL, described)
    return card.replace(TRL_NONE_PIPELINE_MODEL, f'pipeline("text-generation", model={json.dumps(model_location)}')


def base_model_section(run_summary: dict[str, Any]) -> list[str]:
    """Where the trained weights came from, when `stapo-trl train` (its ``run_summary``) loaded them from a local
    source other than the base model it names (a GGUF conversion in this machine's cache)."""
    base, source = run_summary.get("base_model"), run_summary.get("model_source")
    if not base or not source or source == base:
        return []
    return [
        "## Base model",
        "",
        f"`{base}`. The weights trained here were loaded from `{source}`"
        + (
            ", a dequantized GGUF quantization of it, so they differ slightly from the Hub weights."
            if source.lower().endswith(".gguf")
            else "."
        ),
    ]


def insert_sections(card: str, sections: str) -> str:
    """TRL's card with the stapo-trl sections before its "Citations" (replacing earlier ones), or appended."""
    if START_MARKER in card and END_MARKER in card:
        before, rest = card.split(START_MARKER, 1)
        after = rest.split(END_MARKER, 1)[1].lstrip("\n")
        return f"{before}{sections}\n{after}"
    if TRL_CITATIONS_HEADING in card:
        before, after = card.split(TRL_CITATIONS_HEADING, 1)
        return f"{before}{sections}\n{TRL_CITATIONS_HEADING}{after}"
    return f"{card.rstrip()}\n\n{sections}"


def write_card_sections(card: str | Path, config: Any, history: list[dict[str, Any]], output_dir: str | Path) -> Path:
    """Insert (or replace) the stapo-trl sections of the card file at ``card``."""
    card = Path(card)
    sections = stapo_card_sections(config, history, output_dir)
    card.write_text(insert_sections(card.read_text(encoding="utf-8"), sections), encoding="utf-8")
    return card


def refresh_model_card(output_dir: str | Path) -> Path:
    """Rewrite the STAPO sections of a saved run's card from the files in ``output_dir``: for example after
    `stapo-trl eval --output_dir OUTPUT_DIR/eval`, so that the card shows the new evaluation table before it is
    uploaded.

    Reads the card (``README.md``, written by `STAPOTrainer`), the config the trainer saved with the model
    (``training_args.bin``) and the log history (``trainer_state.json``, written by `stapo-trl train` and by
    ``trainer.save_state()``). TRL's parts of the card are kept as they are.
    """
    import torch

    output_dir = Path(output_dir)
    card, args, state = (output_dir / name for name in ("README.md", "training_args.bin", TRAINER_STATE_FILE))
    missing = [path.name for path in (card, args) if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{output_dir} has no {' or '.join(missing)}: refresh_model_card needs a directory written by "
            "STAPOTrainer.save_model() and create_model_card() (stapo-trl train writes both)."
        )
    config = torch.load(args, weights_only=False)
    history = json.loads(state.read_text()).get("log_history", []) if state.is_file() else []
    return write_card_sections(card, config, history, output_dir)
