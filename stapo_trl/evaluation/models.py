"""Which weights, adapter and tokenizer an evaluation loads: a Hub id, a local checkpoint, a LoRA adapter directory
(with its base), or a `.gguf` file (converted once, as in training)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UsageError
from ..file_and_metric_names import RUN_SUMMARY_FILE
from ..gguf import ADAPTER_CONFIG, gguf_checkpoint, hub_source, is_gguf_reference, local_model_problem

_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z0-9])")


class ModelNotFoundError(UsageError, FileNotFoundError):
    """The model, adapter or base model named for an evaluation does not exist."""


@dataclass(frozen=True)
class ResolvedModel:
    """What to load: `weights` is the full model (the base when `adapter` is set), `tokenizer` where the tokenizer
    comes from (the adapter directory when training saved one there). `method` (from `run_summary.json`) and `size`
    (for example "1.7B", from the model's name) find the paper's row to compare with."""

    reference: str
    weights: str
    tokenizer: str
    adapter: str | None = None
    label: str = ""
    method: str | None = None
    size: str | None = None


def _resolve_weights(reference: str, what: str) -> str:
    """A local directory, a converted `.gguf` file, or a Hub id left for `from_pretrained` to fetch."""
    if is_gguf_reference(reference):
        return str(gguf_checkpoint(reference))
    problem = local_model_problem(reference)
    if problem == "file":
        raise ModelNotFoundError(f"The {what} {reference!r} is a file; pass the checkpoint directory that holds it.")
    if problem == "no_config":
        raise ModelNotFoundError(
            f"The {what} directory {str(Path(reference).expanduser())!r} holds no config.json: it is not a saved "
            "model. Pass the directory written by save_pretrained (or by `stapo-trl train`)."
        )
    if problem == "missing":
        raise ModelNotFoundError(
            f"The {what} path {reference!r} does not exist. Pass an existing checkpoint directory, a Hub id such as "
            "'Qwen/Qwen3-1.7B-Base', or a .gguf file."
        )
    path = Path(reference).expanduser()
    return str(path.resolve()) if path.exists() else reference


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def trained_on_gguf(run_dir: Path, recorded_base: str | None) -> str | None:
    """The GGUF file an adapter was trained on (``model_source`` in the run's ``run_summary.json``) when it is a
    quantization of the base the adapter records: the adapter is then evaluated on the weights it was trained on."""
    source = _read_json(run_dir / RUN_SUMMARY_FILE).get("model_source")
    if isinstance(source, str) and is_gguf_reference(source) and recorded_base in (source, hub_source(source)):
        return source
    return None


def parameter_size(*names: str | None) -> str | None:
    """The first "<number>B" size in the names, normalized ("qwen3-8b-base" gives "8B")."""
    for name in filter(None, names):
        if match := _SIZE.search(Path(str(name)).name) or _SIZE.search(str(name)):
            return f"{float(match.group(1)):g}B"
    return None


def resolve_model(
    model: str, *, adapter: str | None = None, base_model: str | None = None, label: str | None = None
) -> ResolvedModel:
    """Resolve the `model` and `adapter` (a LoRA directory for the base `model`) of an evaluation. `model` may itself
    be an adapter directory: its base is then `base_model`, else the GGUF file it was trained on (`trained_on_gguf`),
    else the base it records. Paths that do not exist are an error here; Hub ids are left to `from_pretrained`."""
    model = str(model)
    model_path = Path(model).expanduser()
    if adapter is None and model_path.is_dir() and (model_path / ADAPTER_CONFIG).is_file():
        adapter = model
        recorded_base = _read_json(model_path / ADAPTER_CONFIG).get("base_model_name_or_path")
        base_reference = base_model or trained_on_gguf(model_path, recorded_base) or recorded_base
        if not base_reference:
            raise ModelNotFoundError(
                f"The adapter {model!r} records no base_model_name_or_path; pass the base model with --base_model."
            )
    else:
        if base_model is not None and adapter is None:
            raise ValueError("base_model is only used with a LoRA adapter; pass --adapter or drop --base_model.")
        base_reference = model
    adapter_dir = Path(adapter).expanduser() if adapter is not None else None
    if adapter_dir is not None:
        if not adapter_dir.is_dir():
            raise ModelNotFoundError(f"The adapter directory {adapter!r} does not exist.")
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            raise ModelNotFoundError(
                f"{adapter!r} holds no {ADAPTER_CONFIG}, so it is not a PEFT adapter. Pass a full checkpoint as the "
                "model instead."
            )
    weights = _resolve_weights(base_reference, "base model" if adapter_dir is not None else "model")
    own_tokenizer = adapter_dir is not None and (adapter_dir / "tokenizer_config.json").is_file()
    tokenizer = str(adapter_dir.resolve()) if own_tokenizer else weights
    own_dir = adapter_dir if adapter_dir is not None else (model_path if model_path.is_dir() else None)
    summary = _read_json(own_dir / RUN_SUMMARY_FILE) if own_dir is not None else {}
    base_name = summary.get("model") or base_reference
    name = label or (own_dir.resolve().name if own_dir is not None else model.rstrip("/").split("/")[-1])
    if is_gguf_reference(name):
        name = name[: -len(".gguf")]
    adapter = str(adapter_dir.resolve()) if adapter_dir is not None else None
    return ResolvedModel(
        model, weights, tokenizer, adapter, name, summary.get("method"), parameter_size(base_name, model)
    )
