"""TRL's own GRPO test file, run twice: as-is, and with STAPOTrainer/STAPOConfig under the names GRPOTrainer/GRPOConfig.

Checks the claim "code that runs GRPOTrainer runs STAPOTrainer with the class names changed" against
`tests/test_grpo_trainer.py` of the TRL release this package targets. Run by hand, not in CI: it needs TRL's test
files, which are not part of this repository, and it takes a while (every test twice, on CPU).

Get TRL's tests (the tag matching the installed TRL, or the newest commit whose test file imports only names the
installed TRL has):

    git clone https://github.com/huggingface/trl && git -C trl checkout v1.16.0

then:

    OMP_NUM_THREADS=1 python tests/conformance/trl_grpo_suite_swap.py --trl_tests trl/tests \
        --out docs/benchmarks/trl_grpo_suite_swap.json

`--trl_tests` is TRL's `tests` directory (or the repository root); the script reads `test_grpo_trainer.py`,
`testing_utils.py`, `conftest.py`, `__init__.py` and `testing_constants.py` from it and never modifies it. The
results in docs/benchmarks/trl_grpo_suite_swap.json come from commit f2cd57710ae3 (the TRL snapshot at hand had no
v1.16.0 tag); `--trl_ref` records such a choice in the JSON. The tool and environment tests skip unless `jmespath`
is importable (`pip install jmespath`, or put it on PYTHONPATH); Liger's kernels need a GPU (they fail in both runs
on CPU).

Results accumulate in `--work_dir` (default: a new temporary directory; the stand-ins are built once there). A run
with `-k EXPR` reruns only the matching tests and its outcomes replace the earlier ones in the report;
`--reuse_runs` rewrites the JSON from the results already there. Follow a run in `work_dir/run_<mode>/progress-*.jsonl`.

No network is used. Every Hub artefact the test file loads is replaced by a local stand-in built in code:

- models: tiny random-weight models with the configs of TRL's `scripts/generate_tiny_models` (same classes and sizes,
  bf16 weights), put into a private Hugging Face cache read with `HF_HUB_OFFLINE=1`, so every `from_pretrained`
  (including TRL's own, and `trust_remote_code`) resolves them by their Hub ids;
- tokenizers: byte-level BPE tokenizers (GPT-2 pre-tokenization, merges learned from the zen texts, so prompts are
  about as long in tokens as with the real tokenizers) that carry the family's special tokens and TRL's copy of the
  family's chat template. For the Qwen families the byte tokens, the special tokens and the multi-byte tokens that
  the tests hard-code (tool-call completions given as token ids) sit at their real Qwen ids, so those completions
  decode to the texts the tests state;
- processors of the vision-language models: the family's processor class around the stand-in tokenizer and a PIL
  image processor. The Qwen-VL processors also hold a video processor, which transformers builds only with
  torchvision installed: without it those tests fail in both runs, as they would with the real checkpoints.
  Gemma 4 (audio and video sub-processors) has no stand-in;
- datasets: `trl-internal-testing/zen`, `zen-image` and `zen-multi-image`, rebuilt from TRL's dataset scripts
  (random images), served by a patched `datasets.load_dataset` (with `streaming=True` support).

The two runs use copies of the test files in a work directory. The STAPO copy has its import line rewritten to
`from stapo_trl import STAPOConfig as GRPOConfig, STAPOTrainer as GRPOTrainer`; nothing else differs, so STAPO runs
with its own defaults (the S2T mask on, `epsilon_high=0.28`). The JSON lists each test's outcome in both runs, the
tests that pass with GRPO and fail with STAPO (with the end of the failure), and the tests that fail in both
(stand-in artefacts or environment limits, such as Liger's Triton kernels on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from provenance import provenance

TEST_FILE = "test_grpo_trainer.py"
HELPER_FILES = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
GRPO_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
STAPO_IMPORT = "from stapo_trl import STAPOConfig as GRPOConfig, STAPOTrainer as GRPOTrainer"
STAND_IN_VERSION = "4"
"""Bump when the stand-ins change, so a reused work directory rebuilds them."""
FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The snapshot hash under which the stand-ins sit in the private Hugging Face cache."""
OUTCOME_ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
DELIBERATE_REFUSALS = (
    "must be a multiple of gradient_accumulation_steps",
    "conflicts with top_entropy_quantile",
)
"""STAPOConfig's documented refusals (docs/reliability.md): a GRPO-pass/STAPO-fail test failing with one of these is
flagged ``deliberate_refusal`` in the JSON."""
HARNESS_NOTES = [
    "Hub models, tokenizers, processors and datasets are local stand-ins (see the script's docstring); no network.",
    "trl.import_utils.is_joblib_available is shimmed when missing: TRL's testing_utils imports it.",
    "Tests that use Liger (use_liger_kernel=True or a liger-kernel skip mark) run last in each run: on CPU Liger's "
    "Triton kernels fail, and use_liger_kernel=True patches transformers' model classes for the rest of the process.",
    "pytest runs one process per mode, -p no:cacheprovider, a per-test SIGALRM timeout, OMP_NUM_THREADS as given.",
]

# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------------


def gpt2_byte_chars() -> list[str]:
    """The 256 byte-level characters in GPT-2's (and Qwen's) token-id order: ids 0..255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    order, chars = list(printable), [chr(code) for code in printable]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            order.append(byte)
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_CHARS = gpt2_byte_chars()


def _byte_to_char() -> dict[int, str]:
    printable = [ord(c) for c in BYTE_CHARS if ord(c) < 256]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR = _byte_to_char()


def to_byte_level(text: str) -> str:
    return "".join(BYTE_TO_CHAR[byte] for byte in text.encode("utf-8"))


def _filler(index: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    word = ""
    while True:
        index, rest = divmod(index, len(letters))
        word = letters[rest] + word
        if index == 0:
            break
    return to_byte_level(" " + word)


# Multi-byte Qwen tokens that TRL's tests write as ids (tool-call completions); the texts follow the tests' comments.
QWEN_WORDS = {
    4913: '{"',
    606: "name",
    788: '":',
    330: ' "',
    64648: "multiply",
    22785: "_tool",
    497: '",',
    16370: "arguments",
    5212: ' {"',
    11248: "}}\n",
    1513: " don",
    944: "'t",
    1414: " know",
    894: " any",
    5392: " tool",
    17453: "Done",
    7692: "async",
    93054: "_multiply",
    35744: "increment",
    9520: "step",
    2765: " won",
    927: "sh",
    411: "out",
    1318: "text",
    6023: "hi",
    95642: '"}}\n',
    450: "de",
    13477: "crement",
    16252: " increment",
    14172: "tool",
    6659: "call",
    397: ">\n",
    522: "</",
    314: " {",
    293: " b",
}
QWEN_SPECIALS = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
}
QWEN3_SPECIALS = {
    **QWEN_SPECIALS,
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
}
# Qwen3.5's vocabulary (248k): the ids its tool test hard-codes.
QWEN3_5_WORDS = {
    1628: "function",
    13744: "=screen",
    30091: "shot",
    22076: "_tool",
    510: "</",
    1459: " don",
    914: "'t",
    1366: " know",
    866: " any",
    5224: " tool",
    16936: "Done",
}
QWEN3_5_SPECIALS = {
    248044: ("<|endoftext|>", True),
    248045: ("<|im_start|>", True),
    248046: ("<|im_end|>", True),
    248053: ("<|vision_start|>", True),
    248054: ("<|vision_end|>", True),
    248055: ("<|vision_pad|>", True),
    248056: ("<|image_pad|>", True),
    248057: ("<|video_pad|>", True),
    248058: ("<tool_call>", False),
    248059: ("</tool_call>", False),
    248066: ("<tool_response>", False),
    248067: ("</tool_response>", False),
    248068: ("<think>", False),
    248069: ("</think>", False),
}


def trl_chat_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


BPE_CORPUS_EXTRA = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "You are a helpful assistant.",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "system user assistant model tool",
    "# Tools You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within XML tags:",
    '{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}',
    '{"type": "function", "function": {"name": "multiply_tool", "description": "Multiplies two integers.",',
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."}}',
    "Done! I don't know any tool. I won't increment. The product of the two integers.",
]


def train_bpe_merges() -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from the zen texts and chat-template boilerplate, so that prompts tokenize to
    about as many tokens as with the real tokenizers (a byte-per-token tokenizer makes them 4x longer and every test
    slower, because TRL's fused LM head runs over the whole sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=1500, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = (ZEN_PROMPTS + ZEN_QUESTIONS + BPE_CORPUS_EXTRA) * 3
    backend.train_from_iterator(corpus, trainer=trainer)
    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in merges]


_MERGES: list[tuple[str, str]] | None = None


def build_tokenizer(
    vocab_size: int,
    specials: dict[int, tuple[str, bool]],
    *,
    chat_template: str | None,
    bos: str | None = None,
    eos: str | None = None,
    pad: str | None = None,
    unk: str | None = None,
    words: dict[int, str] | None = None,
    byte_offset: int = 0,
    extra_special_tokens: dict[str, str] | None = None,
    add_bos: bool = False,
):
    """A byte-level BPE tokenizer (GPT-2 pre-tokenization): the 256 byte tokens at ids ``byte_offset`` .. +255 in
    GPT-2 order, ``specials`` and ``words`` at the given ids, the merged tokens learned by `train_bpe_merges` at free
    ids, and a filler word at every other id below ``vocab_size``, so that any sampled id decodes to some text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    global _MERGES
    if _MERGES is None:
        _MERGES = train_bpe_merges()

    vocab: dict[str, int] = {}
    for index, char in enumerate(BYTE_CHARS):
        vocab[char] = byte_offset + index
    for token_id, text in (words or {}).items():
        key = to_byte_level(text)
        if key in vocab:
            raise ValueError(f"duplicate stand-in token {text!r}")
        vocab[key] = token_id
    for token_id, (content, _) in specials.items():
        vocab[content] = token_id
    if len(set(vocab.values())) != len(vocab):
        raise ValueError("two stand-in tokens share an id")
    taken = set(vocab.values())
    free = (token_id for token_id in range(vocab_size) if token_id not in taken)
    for left, right in _MERGES:
        if left + right not in vocab:
            vocab[left + right] = next(free)
    counter = 0
    for token_id in free:
        while _filler(counter) in vocab:
            counter += 1
        vocab[_filler(counter)] = token_id
        counter += 1

    backend = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    ordered = sorted(specials.items())
    backend.add_special_tokens(
        [AddedToken(content, special=True, normalized=False) for _, (content, special) in ordered if special]
    )
    backend.add_tokens(
        [AddedToken(content, special=False, normalized=False) for _, (content, special) in ordered if not special]
    )
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    kwargs = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    if extra_special_tokens:
        kwargs["extra_special_tokens"] = extra_special_tokens
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    for name, token in (extra_special_tokens or {}).items():
        if getattr(tokenizer, name, None) != token:
            setattr(tokenizer, name, token)
    for token in kwargs.values():
        if isinstance(token, str) and tokenizer.convert_tokens_to_ids(token) not in set(vocab.values()):
            raise ValueError(f"stand-in special token {token!r} has no id")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def qwen2_5_tokenizer(vocab_size: int = 151665):
    return build_tokenizer(
        vocab_size,
        QWEN_SPECIALS,
        words=QWEN_WORDS,
        chat_template=trl_chat_template("qwen2_5"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )


def qwen3_tokenizer(vocab_size: int = 151669, template: str = "qwen3"):
    return build_tokenizer(
        vocab_size,
        QWEN3_SPECIALS,
        words=QWEN_WORDS,
        chat_template=trl_chat_template(template),
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )


LLAMA3_SPECIALS = {
    128000: ("<|begin_of_text|>", True),
    128001: ("<|end_of_text|>", True),
    128002: ("<|reserved_special_token_0|>", True),
    128003: ("<|reserved_special_token_1|>", True),
    128004: ("<|finetune_right_pad_id|>", True),
    128005: ("<|reserved_special_token_2|>", True),
    128006: ("<|start_header_id|>", True),
    128007: ("<|end_header_id|>", True),
    128008: ("<|eom_id|>", True),
    128009: ("<|eot_id|>", True),
    128010: ("<|python_tag|>", True),
}


def llama3_2_tokenizer():
    return build_tokenizer(
        128256,
        LLAMA3_SPECIALS,
        chat_template=trl_chat_template("llama3_2"),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        add_bos=True,
    )


GEMMA_SPECIALS = {
    0: ("<pad>", True),
    1: ("<eos>", True),
    2: ("<bos>", True),
    3: ("<unk>", True),
    106: ("<start_of_turn>", True),
    107: ("<end_of_turn>", True),
}


def gemma_tokenizer(vocab_size: int = 256000, template: str = "gemma", specials=None, extra_special_tokens=None):
    return build_tokenizer(
        vocab_size,
        specials or GEMMA_SPECIALS,
        byte_offset=300,
        chat_template=trl_chat_template(template),
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        extra_special_tokens=extra_special_tokens,
    )


def cohere2_tokenizer():
    names = [
        "<PAD>",
        "<UNK>",
        "<BOS_TOKEN>",
        "<EOS_TOKEN>",
        "<|START_OF_TURN_TOKEN|>",
        "<|END_OF_TURN_TOKEN|>",
        "<|USER_TOKEN|>",
        "<|CHATBOT_TOKEN|>",
        "<|SYSTEM_TOKEN|>",
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "<|START_TOOL_RESULT|>",
        "<|END_TOOL_RESULT|>",
        "<|START_TEXT|>",
        "<|END_TEXT|>",
    ]
    return build_tokenizer(
        262144,
        {index: (name, True) for index, name in enumerate(names)},
        byte_offset=300,
        chat_template=trl_chat_template("cohere2"),
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
        pad="<PAD>",
        unk="<UNK>",
        add_bos=True,
    )


def glm4_moe_tokenizer():
    names = {
        151329: "<|endoftext|>",
        151330: "[MASK]",
        151331: "[gMASK]",
        151332: "[sMASK]",
        151333: "<sop>",
        151334: "<eop>",
        151335: "<|system|>",
        151336: "<|user|>",
        151337: "<|assistant|>",
        151338: "<|observation|>",
        151339: "<|begin_of_image|>",
        151340: "<|end_of_image|>",
        151350: "<think>",
        151351: "</think>",
        151352: "<tool_call>",
        151353: "</tool_call>",
        151354: "<tool_response>",
        151355: "</tool_response>",
        151356: "<arg_key>",
        151357: "</arg_key>",
        151358: "<arg_value>",
        151359: "</arg_value>",
        151360: "/nothink",
    }
    not_special = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
    not_special |= {"<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"}
    return build_tokenizer(
        151365,
        {index: (name, name not in not_special) for index, name in names.items()},
        chat_template=trl_chat_template("glm4moe"),
        eos="<|endoftext|>",
        pad="<|endoftext|>",
    )


def gpt_oss_tokenizer():
    names = {
        199998: "<|startoftext|>",
        199999: "<|endoftext|>",
        200002: "<|return|>",
        200003: "<|constrain|>",
        200005: "<|channel|>",
        200006: "<|start|>",
        200007: "<|end|>",
        200008: "<|message|>",
        200012: "<|call|>",
    }
    return build_tokenizer(
        201088,
        {index: (name, True) for index, name in names.items()},
        chat_template=trl_chat_template("gptoss"),
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
    )


def nemotron_tokenizer():
    names = {
        0: ("<unk>", True),
        1: ("<s>", True),
        2: ("</s>", True),
        10: ("<|im_start|>", True),
        11: ("<|im_end|>", True),
        12: ("<think>", False),
        13: ("</think>", False),
        14: ("<tool_call>", False),
        15: ("</tool_call>", False),
        16: ("<tool_response>", False),
        17: ("</tool_response>", False),
    }
    return build_tokenizer(
        131072,
        names,
        byte_offset=300,
        chat_template=trl_chat_template("nemotron_3_nano"),
        bos="<s>",
        eos="<|im_end|>",
        pad="</s>",
        unk="<unk>",
    )


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


def init_weights_tiny_model(model) -> None:
    """TRL's `scripts/generate_tiny_models/_common.py` initialization."""
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv1d):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def save_model(directory: Path, model, processing_class, generation: dict | None = None, keep_fp32: tuple = ()):
    """TRL's tiny-model recipe: initialize, cast to bf16 (a few parameters stay fp32 as upstream), save."""
    save_weights(directory, model, generation if model.can_generate() else None, keep_fp32)
    processing_class.save_pretrained(directory)


QWEN2_5_GENERATION = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}
QWEN3_GENERATION = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
}
SMALL = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


@dataclass(frozen=True)
class TextModel:
    """A text stand-in: a transformers model class, its config (``vocab_size`` defaults to the tokenizer's length),
    the tokenizer builder and the generation config, as in TRL's `scripts/generate_tiny_models`."""

    model_class: str
    tokenizer: Callable[[], Any]
    config: dict
    generation: dict | None = None
    keep_fp32: tuple = ()

    def __call__(self, directory: Path) -> None:
        import transformers

        model_class = getattr(transformers, self.model_class)
        tokenizer = self.tokenizer()
        config = model_class.config_class(**{"vocab_size": len(tokenizer), **self.config})
        save_model(directory, model_class(config), tokenizer, self.generation, self.keep_fp32)


REWARD = {
    "num_labels": 1,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 32,
}
"""The sequence-classification stand-ins' size."""
QWEN_SPECIAL_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}

make_qwen2_causal = TextModel(
    "Qwen2ForCausalLM", qwen2_5_tokenizer, {"intermediate_size": 32, **SMALL}, QWEN2_5_GENERATION
)
make_qwen2_reward = TextModel(
    "Qwen2ForSequenceClassification", qwen2_5_tokenizer, {"vocab_size": 152064, **REWARD, **QWEN_SPECIAL_IDS}
)
make_qwen3_causal = TextModel(
    "Qwen3ForCausalLM", qwen3_tokenizer, {"intermediate_size": 32, **SMALL}, QWEN3_GENERATION
)
make_qwen3_reward = TextModel(
    "Qwen3ForSequenceClassification", qwen3_tokenizer, {"vocab_size": 151936, **REWARD, **QWEN_SPECIAL_IDS}
)
make_qwen3_moe_causal = TextModel(
    "Qwen3MoeForCausalLM",
    qwen3_tokenizer,
    {
        "vocab_size": 151936,
        "intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 40960,
        "norm_topk_prob": True,
        "head_dim": 128,
        **QWEN_SPECIAL_IDS,
        **SMALL,
    },
    QWEN3_GENERATION,
)
make_llama_reward = TextModel(
    "LlamaForSequenceClassification",
    llama3_2_tokenizer,
    {
        "vocab_size": 128256,
        **REWARD,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "tie_word_embeddings": True,
    },
)
make_cohere2_causal = TextModel(
    "Cohere2ForCausalLM",
    cohere2_tokenizer,
    {
        "vocab_size": 262144,
        "intermediate_size": 32,
        "logit_scale": 1.0,
        "rope_theta": 50000,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "pad_token_id": 0,
        **SMALL,
    },
    {"bos_token_id": 2, "eos_token_id": 3},
)
make_glm4_moe_causal = TextModel(
    "Glm4MoeForCausalLM",
    glm4_moe_tokenizer,
    {
        "vocab_size": 151365,
        "intermediate_size": 32,
        "moe_intermediate_size": 32,
        "head_dim": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "attention_bias": True,
        "eos_token_id": [151329, 151336, 151338],
        "pad_token_id": 151329,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 1,
        **SMALL,
    },
    {"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329},
)
make_gpt_oss_causal = TextModel(
    "GptOssForCausalLM",
    gpt_oss_tokenizer,
    {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, **SMALL},
    {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999},
)
make_nemotron_h_causal = TextModel(
    "NemotronHForCausalLM",
    nemotron_tokenizer,
    {
        "vocab_size": 131072,
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "layers_block_type": ["mamba", "attention", "moe"],
        "mamba_num_heads": 8,
        "mamba_head_dim": 4,
        "mamba_n_groups": 1,
        "ssm_state_size": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "use_mamba_kernels": False,
        "bos_token_id": 1,
        "eos_token_id": 11,
        "pad_token_id": 0,
    },
    {"bos_token_id": 1, "eos_token_id": [2, 11], "pad_token_id": 0},
    keep_fp32=("A_log", ".D"),
)
make_gemma2_causal = TextModel(
    "Gemma2ForCausalLM",
    gemma_tokenizer,
    {"intermediate_size": 32, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, **SMALL},
    {"bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0, "cache_implementation": "hybrid"},
)


REMOTE_CONFIGURATION = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
"""
REMOTE_MODELING = """import torch.nn as nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig

    def __init__(self, config):
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = RemoteModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def make_remote_causal(directory: Path) -> None:
    """A Llama whose config and classes live in the repository (`trust_remote_code`), as TRL's tiny-Remote model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llama3_2_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), intermediate_size=32, **SMALL)
    save_model(directory, LlamaForCausalLM(config), tokenizer, {"bos_token_id": 128000, "eos_token_id": 128009})
    (directory / "configuration_remote.py").write_text(REMOTE_CONFIGURATION)
    (directory / "modeling_remote.py").write_text(REMOTE_MODELING)
    config_path = directory / "config.json"
    values = json.loads(config_path.read_text())
    values["model_type"] = "remote"
    values["architectures"] = ["RemoteForCausalLM"]
    values["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModel": "modeling_remote.RemoteModel",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    }
    config_path.write_text(json.dumps(values, indent=2))


def make_gemma3_vlm(directory: Path) -> None:
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    specials = {
        **{index: pair for index, pair in GEMMA_SPECIALS.items() if index < 4},
        105: ("<start_of_turn>", True),
        106: ("<end_of_turn>", True),
        255999: ("<start_of_image>", True),
        256000: ("<end_of_image>", True),
        262144: ("<image_soft_token>", True),
    }
    image_tokens = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tokenizer = gemma_tokenizer(262145, "gemma3", specials, image_tokens)
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=256,
    )
    config = transformers.Gemma3Config(
        text_config={**SMALL, "hidden_size": 16, "layer_types": None, "intermediate_size": 32, "vocab_size": 262208},
        vision_config={
            **SMALL,
            "hidden_size": 16,
            "embed_dim": 64,
            "intermediate_size": 32,
            "image_size": 224,
            "patch_size": 14,
            "vision_use_head": False,  # as in Gemma 3's SigLIP tower (an unused head would never train)
        },
        mm_tokens_per_image=256,
        boi_token_index=255999,
        eoi_token_index=256000,
        image_token_index=262144,
    )
    generation = {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "do_sample": True, "top_k": 64}
    save_model(
        directory, transformers.Gemma3ForConditionalGeneration(config), processor, {**generation, "top_p": 0.95}
    )


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def make_llava_next(directory: Path) -> None:
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = build_tokenizer(
        32001,
        {0: ("<unk>", True), 1: ("<s>", True), 2: ("</s>", True), 32000: ("<image>", True)},
        byte_offset=3,
        chat_template=trl_chat_template("llava_next"),
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        pad="<unk>",
        add_bos=True,
        extra_special_tokens={"image_token": "<image>"},
    )
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_mean=CLIP_MEAN, image_std=CLIP_STD
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=tokenizer.chat_template,
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    config = transformers.LlavaNextConfig(
        text_config={
            **SMALL,
            "model_type": "mistral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "vocab_size": 32064,
        },
        vision_config={
            "model_type": "clip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 16,
            "num_attention_heads": 4,
            "intermediate_size": 32,
            "image_size": 336,
            "patch_size": 14,
            "projection_dim": 16,
        },
        image_token_index=32000,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    save_model(
        directory,
        transformers.LlavaNextForConditionalGeneration(config),
        processor,
        {"bos_token_id": 1, "eos_token_id": 2},
    )


QWEN_VL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


def save_qwen_vl_processor(directory: Path, processor_class: str, tokenizer, image: dict, video_class: str) -> None:
    """Qwen-VL processors hold a video processor, which needs torchvision even to be constructed or saved, so the
    processor is written file by file (the layout `save_pretrained` produces). Loading it needs torchvision too, as
    loading the real checkpoints does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.save_pretrained(directory)
    values = Qwen2VLImageProcessorPil(**image).to_dict()
    values["image_processor_type"] = "Qwen2VLImageProcessor"
    values.pop("processor_class", None)
    (directory / "preprocessor_config.json").write_text(json.dumps(values, indent=2))
    video = {
        key: values[key] for key in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    }
    video.update({"video_processor_type": video_class, "do_resize": True, "do_rescale": True, "do_normalize": True})
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2))


def save_weights(directory: Path, model, generation: dict | None, keep_fp32: tuple = ()) -> None:
    import torch
    from transformers import GenerationConfig

    init_weights_tiny_model(model)
    model = model.to(dtype=torch.bfloat16)
    for name, parameter in model.named_parameters():
        if any(part in name for part in keep_fp32):
            parameter.data = parameter.data.float()
    model.save_pretrained(directory)
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(directory)


def make_qwen2_vl(directory: Path, version: str = "2") -> None:
    import transformers

    tokenizer = build_tokenizer(
        151665,
        QWEN_SPECIALS,
        words=QWEN_WORDS,
        chat_template=trl_chat_template("qwen2_5_vl"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        extra_special_tokens=QWEN_VL_TOKENS,
    )
    processor_class = "Qwen2_5_VLProcessor" if version == "2.5" else "Qwen2VLProcessor"
    image = {"min_pixels": 3136, "max_pixels": 12845056, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    save_qwen_vl_processor(directory, processor_class, tokenizer, image, "Qwen2VLVideoProcessor")
    rope = {"type": "default", "mrope_section": [1, 1], "rope_type": "default"}
    text_config = {**SMALL, "hidden_size": 16, "layer_types": None, "rope_scaling": dict(rope), "vocab_size": 151936}
    if version == "2.5":
        vision = {"hidden_size": 16, "num_heads": 4, "depth": 2, "fullatt_block_indexes": [1], "out_hidden_size": 16}
        config = transformers.Qwen2_5_VLConfig(text_config=text_config, vision_config=vision)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        vision = {"hidden_size": 16, "num_heads": 4, "embed_dim": 64, "depth": 2}
        config = transformers.Qwen2VLConfig(text_config=text_config, vision_config=vision)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    save_weights(directory, model, QWEN2_5_GENERATION)


def make_qwen3_5_vl(directory: Path, moe: bool = False) -> None:
    import transformers

    tokenizer = build_tokenizer(
        248320,
        QWEN3_5_SPECIALS,
        words=QWEN3_5_WORDS,
        chat_template=trl_chat_template("qwen3_6" if moe else "qwen3_5_nothink"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        extra_special_tokens=QWEN_VL_TOKENS,
    )
    image = {
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    save_qwen_vl_processor(directory, "Qwen3VLProcessor", tokenizer, image, "Qwen3VLVideoProcessor")
    text_config = {
        **SMALL,
        "hidden_size": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2,
        "vocab_size": 248320,
    }
    vision = {"hidden_size": 16, "depth": 2, "num_heads": 4, "intermediate_size": 32, "out_hidden_size": 16}
    generation = {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044}
    if moe:
        text_config.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        )
        config = transformers.Qwen3_5MoeConfig(text_config=text_config, vision_config=vision)
        save_weights(directory, transformers.Qwen3_5MoeForConditionalGeneration(config), generation)
    else:
        config = transformers.Qwen3_5Config(text_config=text_config, vision_config=vision)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
        save_weights(directory, model, None, keep_fp32=("linear_attn.A_log", "linear_attn.norm.weight"))


# ----------------------------------------------------------------------------------------------------------------------
# Stand-in registry, cache layout and datasets
# ----------------------------------------------------------------------------------------------------------------------

ORG = "trl-internal-testing"
STAND_INS = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": make_qwen2_causal,
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": make_qwen2_reward,
    f"{ORG}/tiny-Qwen3ForCausalLM": make_qwen3_causal,
    f"{ORG}/tiny-Qwen3ForSequenceClassification": make_qwen3_reward,
    f"{ORG}/tiny-Qwen3MoeForCausalLM": make_qwen3_moe_causal,
    f"{ORG}/tiny-LlamaForSequenceClassification-3.2": make_llama_reward,
    f"{ORG}/tiny-RemoteForCausalLM": make_remote_causal,
    f"{ORG}/tiny-Cohere2ForCausalLM": make_cohere2_causal,
    f"{ORG}/tiny-Glm4MoeForCausalLM": make_glm4_moe_causal,
    f"{ORG}/tiny-GptOssForCausalLM": make_gpt_oss_causal,
    f"{ORG}/tiny-NemotronHForCausalLM-nano": make_nemotron_h_causal,
    f"{ORG}/tiny-Gemma2ForCausalLM": make_gemma2_causal,
    f"{ORG}/tiny-Gemma3ForConditionalGeneration": make_gemma3_vlm,
    f"{ORG}/tiny-LlavaNextForConditionalGeneration": make_llava_next,
    f"{ORG}/tiny-Qwen2VLForConditionalGeneration": make_qwen2_vl,
    f"{ORG}/tiny-Qwen2_5_VLForConditionalGeneration": lambda directory: make_qwen2_vl(directory, "2.5"),
    f"{ORG}/tiny-Qwen3_5ForConditionalGeneration-NoThink": make_qwen3_5_vl,
    f"{ORG}/tiny-Qwen3_5MoeForConditionalGeneration-3.6": lambda directory: make_qwen3_5_vl(directory, moe=True),
}
"""Hub id -> builder. Of the ids the test file names, the missing ones are used only by tests that skip on CPU (vLLM,
accelerator-only) or are commented out, except tiny-Gemma4ForConditionalGeneration: its processor (with audio and
video sub-processors) needs torchvision, like the Qwen-VL ones, and has no stand-in."""

ZEN_PROMPTS = [
    "Beautiful is better than",
    "Explicit is",
    "Simple is better",
    "Complex",
    "Flat is better than",
    "Sparse is better",
    "Readability",
    "Special cases aren't special",
    "Although practicality beats",
    "Errors should never",
    "Unless explicitly",
    "In the face of ambiguity, refuse",
    "There should be one-- and preferably",
    "Although that way may not be obvious at first unless you're",
    "Now is",
    "Although never is often",
    "If the implementation is hard to explain,",
    "If the implementation is easy",
    "Namespaces are one honking great",
]
ZEN_QUESTIONS = [
    "What is better than ugly?",
    "What is better than implicit?",
    "What is better than complex?",
    "What is better than complicated?",
    "What is better than nested?",
    "What is better than dense?",
    "What counts?",
    "Are special cases enough to break the rules?",
    "What beats purity?",
    "What should never pass silently?",
    "When can errors pass silently?",
    "What should you do in the face of ambiguity?",
    "How many ways should there be to do it?",
    "For whom may the way not be obvious at first?",
    "What is better than never?",
    "Is never better than *right* now?",
    "What does it mean if the implementation is hard to explain?",
    "What does it mean if the implementation is easy to explain?",
    "Any great ideas?",
]
# zen-multi-image: where the images sit in each question (TRL's scripts/generate_zen_multi_image_dataset.py).
MULTI_IMAGE_LAYOUT = [
    "it",
    "ti",
    "iti",
    "iit",
    "it",
    "ti",
    "iti",
    "t",
    "tii",
    "iiti",
    "it",
    "ti",
    "itii",
    "t",
    "ti",
    None,
    "it",
    "ti",
    "t",
]


def build_datasets(root: Path) -> dict[str, str]:
    """TRL's zen datasets (train/test split 90/10, unshuffled), saved to disk; returns ``"repo|config" -> path``."""
    import numpy as np
    from datasets import Dataset, Features, Image, List, Value

    rng = np.random.default_rng(0)

    def split_and_save(dataset, key: str) -> str:
        path = root / key.replace("/", "--").replace("|", "--")
        dataset.train_test_split(test_size=0.1, shuffle=False).save_to_disk(str(path))
        return str(path)

    def random_image(height: int, width: int):
        return rng.uniform(0.0, 255.0, size=(height, width, 3)).astype(np.uint8)

    paths = {}
    paths["trl-internal-testing/zen|standard_prompt_only"] = split_and_save(
        Dataset.from_dict({"prompt": ZEN_PROMPTS}), "trl-internal-testing/zen|standard_prompt_only"
    )
    conversational = [[{"role": "user", "content": question}] for question in ZEN_QUESTIONS]
    paths["trl-internal-testing/zen|conversational_prompt_only"] = split_and_save(
        Dataset.from_dict({"prompt": conversational}), "trl-internal-testing/zen|conversational_prompt_only"
    )
    message = [{"content": Value("string"), "role": Value("string")}]
    images = [random_image(*rng.integers(32, 64, size=2)) for _ in ZEN_QUESTIONS]
    paths["trl-internal-testing/zen-image|conversational_prompt_only"] = split_and_save(
        Dataset.from_dict(
            {"prompt": conversational, "image": images}, features=Features(prompt=message, image=Image())
        ),
        "trl-internal-testing/zen-image|conversational_prompt_only",
    )
    prompts, image_lists = [], []
    for question, layout in zip(ZEN_QUESTIONS, MULTI_IMAGE_LAYOUT, strict=True):
        if layout is None:  # "Is<image> never better than *right* now?"
            content = [
                {"type": "text", "text": "Is"},
                {"type": "image", "text": None},
                {"type": "text", "text": " never better than *right* now?"},
            ]
        else:
            content = [
                {"type": "text", "text": question} if part == "t" else {"type": "image", "text": None}
                for part in layout
            ]
        prompts.append([{"role": "user", "content": content}])
        count = sum(part["type"] == "image" for part in content)
        image_lists.append([random_image(*rng.integers(32, 64, size=2)) for _ in range(count)])
    multi_message = List(
        {"content": List({"text": Value("string"), "type": Value("string")}), "role": Value("string")}
    )
    paths["trl-internal-testing/zen-multi-image|conversational_prompt_only"] = split_and_save(
        Dataset.from_dict(
            {"prompt": prompts, "images": image_lists}, features=Features(prompt=multi_message, images=List(Image()))
        ),
        "trl-internal-testing/zen-multi-image|conversational_prompt_only",
    )
    return paths


def build_stand_ins(work: Path, rebuild: bool = False) -> tuple[Path, dict]:
    """Build every stand-in into ``work/hf_cache/hub`` (Hugging Face cache layout) and ``work/datasets``."""
    import torch
    from transformers import set_seed

    hub = work / "hf_cache" / "hub"
    marker = work / "stand_ins.json"
    datasets_dir = work / "datasets"
    built = json.loads(marker.read_text()) if marker.exists() and not rebuild else {}
    if built.get("version") != STAND_IN_VERSION:
        built = {"version": STAND_IN_VERSION, "models": [], "datasets": {}}
    torch.set_num_threads(1)
    for repo_id, builder in STAND_INS.items():
        if repo_id in built["models"]:
            continue
        started = time.perf_counter()
        folder = hub / f"models--{repo_id.replace('/', '--')}"
        shutil.rmtree(folder, ignore_errors=True)
        snapshot = folder / "snapshots" / FAKE_COMMIT
        snapshot.mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(FAKE_COMMIT)
        set_seed(0)
        try:
            builder(snapshot)
        except Exception as error:  # a missing stand-in only fails the tests that load it
            shutil.rmtree(folder, ignore_errors=True)
            built.setdefault("failed", {})[repo_id] = f"{type(error).__name__}: {error}"
            print(f"[stand-in] {repo_id} FAILED: {type(error).__name__}: {error}", flush=True)
            continue
        built["models"].append(repo_id)
        built.get("failed", {}).pop(repo_id, None)
        marker.write_text(json.dumps(built, indent=2))
        print(f"[stand-in] {repo_id} ({time.perf_counter() - started:.1f} s)", flush=True)
    if not built["datasets"]:
        shutil.rmtree(datasets_dir, ignore_errors=True)
        datasets_dir.mkdir(parents=True)
        built["datasets"] = build_datasets(datasets_dir)
        marker.write_text(json.dumps(built, indent=2))
        print(f"[stand-in] datasets: {', '.join(built['datasets'])}", flush=True)
    return hub, built


# ----------------------------------------------------------------------------------------------------------------------
# The pytest runs
# ----------------------------------------------------------------------------------------------------------------------

PLUGIN = r'''"""Loaded with `-p _trl_swap_plugin` before TRL's conftest and test module: offline datasets, shims, timeout."""

import importlib
import importlib.util
import json
import os
import signal

import pytest

_import_utils = importlib.import_module("trl.import_utils")
if not hasattr(_import_utils, "is_joblib_available"):
    # TRL's testing_utils imports it; TRL releases after the BCO trainer's removal no longer define it.
    _import_utils.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None

import datasets

_LOCAL = json.loads(os.environ["TRL_SWAP_DATASETS"])
_original_load_dataset = datasets.load_dataset


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    key = f"{path}|{name}"
    if key not in _LOCAL:
        return _original_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    splits = datasets.load_from_disk(_LOCAL[key])
    if streaming:
        splits = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in splits.items()})
    return splits if split is None else splits[split]


datasets.load_dataset = load_dataset

def _uses_liger(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    marks = [str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")]
    return "liger" in item.name.lower() or params.get("use_liger_kernel") is True or any("liger" in m for m in marks)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    # Liger's kernels are Triton (GPU) code, and `use_liger_kernel=True` patches transformers' model classes for the
    # rest of the process; run those tests last so that on CPU their patches cannot break the other tests.
    items[:] = [item for item in items if not _uses_liger(item)] + [item for item in items if _uses_liger(item)]


_PROGRESS = os.environ.get("TRL_SWAP_PROGRESS")


def pytest_runtest_logreport(report):
    # One line per test phase as it ends, so that a long run can be followed (the junit file is written at the end).
    if _PROGRESS and (report.when == "call" or report.outcome != "passed"):
        line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                "duration_s": round(report.duration, 2)}
        if report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            line["error"] = f"{crash.path}:{crash.lineno}: {crash.message}" if crash else str(report.longrepr)[-500:]
        with open(_PROGRESS, "a") as file:
            file.write(json.dumps(line) + "\n")


_TIMEOUT = int(os.environ.get("TRL_SWAP_TEST_TIMEOUT", "0"))


class TestTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise TestTimeout(f"test exceeded {_TIMEOUT} s (trl_grpo_suite_swap per-test timeout)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if _TIMEOUT > 0:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(_TIMEOUT)
    try:
        yield
    finally:
        if _TIMEOUT > 0:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
'''

PYTEST_INI = """[pytest]
markers =
    slow: TRL's slow tests (accelerator-only here)
"""


def find_tests_dir(path: Path) -> Path:
    for candidate in (path, path / "tests"):
        if (candidate / TEST_FILE).is_file():
            return candidate
    raise SystemExit(f"--trl_tests: no {TEST_FILE} in {path} or {path / 'tests'}")


def prepare_run(work: Path, tests_dir: Path, mode: str, subset: bool) -> Path:
    """A fresh copy of the tests in ``work/run_<mode>``. A full run also drops the results of earlier runs; a subset
    run (``-k``) keeps them, and its results replace theirs test by test in the report."""
    run_dir = work / f"run_{mode}"
    if not subset:
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(run_dir / "tests", ignore_errors=True)
    (run_dir / "tests").mkdir(parents=True)
    for name in (TEST_FILE, *HELPER_FILES):
        if (tests_dir / name).is_file():
            shutil.copy2(tests_dir / name, run_dir / "tests" / name)
    if (tests_dir / "data").is_dir():
        shutil.copytree(tests_dir / "data", run_dir / "tests" / "data")
    if mode == "stapo":
        path = run_dir / "tests" / TEST_FILE
        source = path.read_text(encoding="utf-8")
        if source.count(GRPO_IMPORT) != 1:
            raise SystemExit(f"expected exactly one line {GRPO_IMPORT!r} in {TEST_FILE}")
        path.write_text(source.replace(GRPO_IMPORT, STAPO_IMPORT), encoding="utf-8")
    (run_dir / "pytest.ini").write_text(PYTEST_INI)
    return run_dir


def run_pytest(work: Path, run_dir: Path, hub: Path, dataset_paths: dict, args) -> tuple[Path, float, int]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    junit = run_dir / f"junit-{stamp}.xml"
    log = run_dir / f"pytest-{stamp}.log"
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_CACHE": str(hub),
            "HF_HOME": str(hub.parent),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TRL_SWAP_DATASETS": json.dumps(dataset_paths),
            "TRL_SWAP_TEST_TIMEOUT": str(args.test_timeout),
            "TRL_SWAP_PROGRESS": str(run_dir / f"progress-{stamp}.jsonl"),
            "PYTHONPATH": os.pathsep.join([str(work), str(run_dir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        f"tests/{TEST_FILE}",
        "-p",
        "no:cacheprovider",
        "-p",
        "_trl_swap_plugin",
        "-rA",
        "-q",
        "--tb=long",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    if args.k:
        command += ["-k", args.k]
    started = time.perf_counter()
    with open(log, "w") as output:
        returncode = subprocess.run(command, cwd=run_dir, env=env, stdout=output, stderr=subprocess.STDOUT).returncode
    return junit, time.perf_counter() - started, returncode


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:400]
    return ""


def parse_junit(junit: Path) -> dict[str, dict]:
    results = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        test_id = f"{classname.rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message, details = "passed", "", ""
        for child in case:
            if child.tag == "failure":
                outcome = "failed"
                if child.get("type") == "pytest.xpass" or (child.get("message") or "").startswith("[XPASS(strict)]"):
                    outcome = "xpassed"
            elif child.tag == "error":
                outcome = "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
            else:
                continue
            message = child.get("message") or child.text or ""
            details = child.text or ""
            break
        entry = {"outcome": outcome, "time_s": round(float(case.get("time") or 0.0), 2)}
        if outcome != "passed":
            entry["message"] = first_line(message)
        if outcome in ("failed", "error"):
            entry["_details"] = details
        results[test_id] = entry
    return results


def failure_tail(details: str, lines: int = 25) -> list[str]:
    return [line.rstrip() for line in details.splitlines() if line.strip()][-lines:]


def counts(results: dict[str, dict]) -> dict[str, int]:
    tally = dict.fromkeys(OUTCOME_ORDER, 0)
    for entry in results.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    tally["total"] = len(results)
    return tally


def trl_source(tests_dir: Path, given: str | None) -> dict:
    source = {"tests_dir": str(tests_dir)}
    if given:
        source["ref"] = given
    try:
        root = subprocess.run(
            ["git", "-C", str(tests_dir), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        source["commit"] = root.stdout.strip()
        described = subprocess.run(
            ["git", "-C", str(tests_dir), "describe", "--tags", "--always"], capture_output=True, text=True
        )
        source["describe"] = described.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    return source


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    names = ("trl", "stapo-trl", "transformers", "torch", "accelerate", "datasets", "peft", "liger-kernel")
    for name in (*names, "jmespath", "pillow", "torchvision", "vllm"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["pytest"] = metadata.version("pytest")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl_tests", required=True, type=Path, help="TRL's tests directory (or repository root).")
    parser.add_argument("--out", required=True, type=Path, help="Where to write the JSON results.")
    parser.add_argument("--trl_ref", default=None, help="The TRL tag or commit the tests come from, for the JSON.")
    parser.add_argument("--work_dir", type=Path, default=None, help="Keep stand-ins and runs here (reused).")
    parser.add_argument("--modes", default="grpo,stapo", help="Which runs: grpo, stapo or both (default).")
    parser.add_argument("-k", default=None, help="Only the tests matching this pytest -k expression.")
    parser.add_argument("--test_timeout", type=int, default=900, help="Per-test timeout in seconds (0: none).")
    parser.add_argument("--rebuild", action="store_true", help="Rebuild the stand-ins even if the work dir has them.")
    parser.add_argument(
        "--reuse_runs",
        action="store_true",
        help="Report from the junit files already in --work_dir, without rerunning.",
    )
    args = parser.parse_args()

    tests_dir = find_tests_dir(args.trl_tests.resolve())
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="trl_grpo_suite_swap_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "_trl_swap_plugin.py").write_text(PLUGIN)
    started = time.perf_counter()
    hub, built = build_stand_ins(work, rebuild=args.rebuild)
    dataset_paths = built["datasets"]
    build_seconds = time.perf_counter() - started

    runs = {}
    for mode in [mode.strip() for mode in args.modes.split(",") if mode.strip()]:
        run_dir = work / f"run_{mode}"
        info_path = run_dir / "run_info.json"
        if not args.reuse_runs:
            run_dir = prepare_run(work, tests_dir, mode, subset=bool(args.k))
            info = json.loads(info_path.read_text()) if info_path.exists() else []
            print(f"[run] {mode}: pytest in {run_dir}", flush=True)
            junit, seconds, returncode = run_pytest(work, run_dir, hub, dataset_paths, args)
            info.append({"junit": junit.name, "k": args.k, "wall_time_s": round(seconds, 1), "exit_code": returncode})
            info_path.write_text(json.dumps(info, indent=2))
        info = json.loads(info_path.read_text()) if info_path.exists() else []
        results = {}
        for junit in sorted(run_dir.glob("junit-*.xml")):  # later runs (subsets) replace earlier results
            results.update(parse_junit(junit))
        seconds = sum(entry["wall_time_s"] for entry in info)
        runs[mode] = {"results": results, "wall_time_s": round(seconds, 1), "pytest_invocations": info}
        print(f"[run] {mode}: {counts(results)} in {seconds:.0f} s", flush=True)

    report = {
        "provenance": provenance(),
        "what": "TRL's tests/test_grpo_trainer.py run as-is (grpo) and with STAPOTrainer/STAPOConfig imported under "
        "the names GRPOTrainer/GRPOConfig (stapo), on CPU, with local stand-ins for the Hub models and datasets.",
        "trl_tests": trl_source(tests_dir, args.trl_ref),
        "harness_notes": HARNESS_NOTES,
        "versions": versions(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "stand_ins": {
            "models": sorted(built["models"]),
            "failed_to_build": built.get("failed", {}),
            "datasets": sorted(dataset_paths),
        },
        "stand_in_build_s": round(build_seconds, 1),
        "report_command": " ".join([Path(sys.executable).name, *sys.argv]),
        "work_dir": str(work),
        "runs": {},
    }
    for mode, run in runs.items():
        report["runs"][mode] = {
            "counts": counts(run["results"]),
            "wall_time_s": run["wall_time_s"],
            "pytest_invocations": run["pytest_invocations"],
        }
    if "grpo" in runs and "stapo" in runs:
        grpo, stapo = runs["grpo"]["results"], runs["stapo"]["results"]
        tests = {}
        regressions, both_fail, stapo_only_pass, differing = [], [], [], []
        for test_id in sorted(set(grpo) | set(stapo)):
            left, right = grpo.get(test_id, {"outcome": "missing"}), stapo.get(test_id, {"outcome": "missing"})
            tests[test_id] = {
                "grpo": left["outcome"],
                "stapo": right["outcome"],
                **({"grpo_message": left["message"]} if left.get("message") else {}),
                **({"stapo_message": right["message"]} if right.get("message") else {}),
            }
            bad = ("failed", "error", "xpassed")
            if left["outcome"] == "passed" and right["outcome"] in bad:
                message = right.get("message", "")
                regressions.append(
                    {
                        "test": test_id,
                        "stapo_outcome": right["outcome"],
                        "deliberate_refusal": any(marker in message for marker in DELIBERATE_REFUSALS),
                        "message": message,
                        "traceback_tail": failure_tail(right.get("_details", "")),
                    }
                )
            elif left["outcome"] in bad and right["outcome"] in bad:
                both_fail.append(
                    {
                        "test": test_id,
                        "grpo_message": left.get("message", ""),
                        "stapo_message": right.get("message", ""),
                    }
                )
            elif left["outcome"] in bad and right["outcome"] == "passed":
                stapo_only_pass.append({"test": test_id, "grpo_message": left.get("message", "")})
            if left["outcome"] != right["outcome"]:
                differing.append(test_id)
        report["grpo_pass_stapo_fail"] = regressions
        report["fail_in_both"] = both_fail
        report["stapo_pass_grpo_fail"] = stapo_only_pass
        report["outcome_differs"] = differing
        report["tests"] = tests
    else:
        report["tests"] = {
            mode: {
                test_id: {key: value for key, value in entry.items() if key != "_details"}
                for test_id, entry in run["results"].items()
            }
            for mode, run in runs.items()
        }
    report["wall_time_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[done] {args.out} ({report['wall_time_s']:.0f} s); work dir {work}", flush=True)


if __name__ == "__main__":
    main()
