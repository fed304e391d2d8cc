"""What `stapo-trl train` checks about the policy model before it loads the weights: that it can be found (a Hub id
missing from an offline cache is named), that every weight shard its index lists is on disk, that it is a decoder-only
model that generates text (not a reward model or an encoder-decoder), and that its tokenizer has a chat template for
the conversational prompts. Each one otherwise fails minutes later, deep inside transformers or TRL."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from ..model_paths import looks_like_path
from .recipe import RecipeError

SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
NOT_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMaskedLM",
    "Model",
)
"""Architecture name endings of checkpoints without a language-modeling head that generates: reward models
(sequence classification), taggers, extractive QA, fill-mask models (ForMaskedLM) and bare encoders or decoders."""


def offline_miss(name: str, error: OSError) -> RecipeError:
    """The error for a model that is neither a local directory nor loadable from the Hub or its cache."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return RecipeError(
        f"model_name_or_path {name!r} could not be loaded: it is not a local directory, and neither the Hugging Face "
        f"Hub nor the local Hub cache had it ({first_line}). To train offline, download it where the Hub is "
        f"reachable (`huggingface-cli download {name}`) and bring that cache along (HF_HOME), or pass the directory "
        "that save_pretrained wrote."
    )


def check_shards(model_path: str) -> None:
    """Refuse a local checkpoint whose shard index lists weight files that are missing, or that cannot be read."""
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
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise RecipeError(
                f"{directory} is missing {len(missing)} of the weight shards its {index_name} lists ({shown}). The "
                "copy is incomplete: copy the checkpoint again."
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
        reward = any(head.endswith("ForSequenceClassification") for head in heads)
        raise RecipeError(
            f"{name} is a {', '.join(heads)} checkpoint, which has no language-modeling head to generate with."
            + (
                " It looks like a reward model: pass it in reward_funcs (as a path), not as the policy."
                if reward
                else " Pass a causal language model (an ...ForCausalLM checkpoint)."
            )
        )


def check_chat_template(tokenizer, name: str) -> None:
    """Refuse a tokenizer without a chat template: the training prompts are chat messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError(
            f"The tokenizer of {name} has no chat template, and the training prompts are chat messages (a system and "
            "a user turn) that it must render. Use an instruct or chat model, or a tokenizer that defines "
            "chat_template (tokenizer_config.json)."
        )


def load_checked_tokenizer_and_config(model_path: str, name: str, *, revision, trust_remote_code: bool):
    """The tokenizer and config of the policy, after every check above; Hub and cache misses are named."""
    check_shards(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as error:
        if looks_like_path(name):
            raise
        raise offline_miss(name, error) from None
    check_architecture(config, name)
    check_chat_template(tokenizer, name)
    return tokenizer, config
