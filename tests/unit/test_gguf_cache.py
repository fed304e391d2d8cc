"""A damaged GGUF conversion in the cache is named and converted again, instead of failing to load with
`SafetensorError: incomplete metadata` and no word about the cache."""

import logging

import torch
from safetensors.torch import save_file

from stapo_trl import gguf


def fake_gguf(tmp_path):
    source = tmp_path / "tiny.Q4_1.gguf"
    source.write_bytes(b"GGUF-not-really")
    return source


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
    assert f"The cached conversion {target} is damaged" in caplog.text
    assert gguf.damaged_conversion(target) is None
