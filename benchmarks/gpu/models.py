"""Models, a tokenizer and a task for the GPU check, all built in code: no Hub, no download.

The model shapes are Qwen3-0.6B's and Qwen3-1.7B's published configurations (their ``config.json``), with seeded random
weights; the CPU mode uses two toy shapes of the same architecture. The tokenizer is character-level, like the tests'
(`tests/tiny.py`), and is padded with filler tokens to the model's vocabulary, so that the LM head has Qwen3's
151,936 rows and sampling from a random model produces text (four-letter filler words) that rewards can score.
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass, field

QWEN3_COMMON = {
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "head_dim": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 28,
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    config: dict = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]


QWEN3_0_6B = ModelShape("Qwen3-0.6B", {**QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072})
QWEN3_1_7B = ModelShape("Qwen3-1.7B", {**QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144})
_TOY = {
    **QWEN3_COMMON,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TOY_SMALL = ModelShape("toy-2-layer", {**_TOY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2})

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n"]


def filler_word(index: int) -> str:
    """A four-letter lowercase word for filler token ``index`` (26**4 words, more than Qwen3's vocabulary)."""
    letters = []
    for _ in range(4):
        index, letter = divmod(index, 26)
        letters.append(string.ascii_lowercase[letter])
    return "".join(letters)


@functools.cache
def build_tokenizer(vocab_size: int):
    """A character-level tokenizer of exactly ``vocab_size`` tokens: pad, EOS, unknown, printable ASCII and a newline,
    then filler words. Text encodes to characters only; the fillers appear only when a model samples them. Built once
    per size (Qwen3's takes seconds) and shared by the sections."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for character in CHARACTERS:
        vocab[character] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} characters and special tokens.")
    filler = 0
    while len(vocab) < vocab_size:
        word = filler_word(filler)
        filler += 1
        if word not in vocab:
            vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


class ModelFactory:
    """Fresh copies of one seeded random model: every run of a comparison starts from the same weights."""

    def __init__(self, shape: ModelShape, tokenizer, *, device: str, dtype, seed: int = 0):
        import torch
        from transformers import Qwen3Config

        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.config = Qwen3Config(
            **{**shape.config, "vocab_size": len(tokenizer)},
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(seed)
        model = self._empty()
        self.weights = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}
        del model

    def _empty(self):
        import torch
        from transformers import Qwen3ForCausalLM

        with torch.device(self.device):
            model = Qwen3ForCausalLM(self.config)
        return model.to(self.dtype)

    def build(self, weights: dict | None = None):
        """A new model holding ``weights`` (by default the seeded ones), on the device, in the factory's dtype."""
        model = self._empty()
        model.load_state_dict(weights if weights is not None else self.weights)
        return model

    @property
    def num_parameters(self) -> int:
        return sum(value.numel() for name, value in self.weights.items() if name != "lm_head.weight")


_OPERATIONS = (
    ("gave away", "-", lambda a, b: a - b),
    ("boxes with", "*", lambda a, b: a * b),
    ("more", "+", lambda a, b: a + b),
)


def worked_solution(question: str, answer: int) -> str:
    """The one-line equation that answers an arithmetic problem of `stapo_trl.data.arithmetic`, checked against its
    answer: ``"3 + 2 = 5"``."""
    first, second = (int(number) for number in re.findall(r"\d+", question)[:2])
    symbol, apply = next((symbol, apply) for words, symbol, apply in _OPERATIONS if words in question)
    if apply(first, second) != answer:
        raise ValueError(f"could not read the equation of {question!r}")
    return f"{first} {symbol} {second} = {answer}"


def arithmetic_rows(num_problems: int, seed: int = 0) -> dict[str, list[str]]:
    """Plain-text prompts (the problem and a newline), gold answers, and the worked completion a supervised step
    trains on: the equation, then DAPO's ``Answer:`` line."""
    from stapo_trl.data.arithmetic import arithmetic_problems

    problems = arithmetic_problems(num_problems, seed=seed, split="train")
    return {
        "prompt": [f"{question}\n" for question, _ in problems],
        "solution": [str(answer) for _, answer in problems],
        "worked": [f"{worked_solution(question, answer)}\nAnswer: {answer}" for question, answer in problems],
    }


def vowel_share_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's letters that are vowels: a dense score with spread in every group, also for the
    filler words a random model samples (so that advantages, and so gradients, are never all zero)."""
    scores = []
    for text in completions:
        letters = [character for character in text.lower() if character.isalpha()]
        scores.append(sum(character in "aeiou" for character in letters) / len(letters) if letters else 0.0)
    return scores


def answer_distance_reward(completions, solution, **kwargs) -> list[float]:
    """-|last integer - gold| / 10, clipped to [-1, 0], and -1 without an integer: partial credit, so that groups of a
    barely trained model still differ."""
    scores = []
    for text, gold in zip(completions, solution, strict=True):
        found = re.findall(r"-?\d+", text)
        scores.append(-min(abs(int(found[-1]) - int(gold)), 10) / 10 if found else -1.0)
    return scores
