"""The policy model is checked before its weights load: a reward model or an encoder-decoder given as the policy, a
checkpoint with a missing shard, a tokenizer without a chat template, and a Hub id absent offline are each refused with
what to do, where they used to crash deep inside transformers or TRL."""

import json

import pytest
from tiny import build_char_tokenizer, build_tiny_qwen3, save_tiny_chat_model

from stapo_trl.cli import main
from stapo_trl.cli.recipe import RecipeError
from stapo_trl.cli.train import load_checked_tokenizer_and_config


def check(path, name=None):
    return load_checked_tokenizer_and_config(str(path), name or str(path), revision=None, trust_remote_code=False)


def test_a_well_formed_chat_model_passes(tmp_path):
    tokenizer, config = check(save_tiny_chat_model(tmp_path / "model"))
    assert tokenizer.chat_template and config.model_type == "qwen3"


def test_a_reward_model_given_as_the_policy_is_named(tmp_path):
    directory = save_tiny_chat_model(tmp_path / "reward")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError, match="Qwen3ForSequenceClassification checkpoint.*looks like a reward model"):
        check(directory)


def test_an_encoder_decoder_is_named(tmp_path):
    from transformers import T5Config

    directory = tmp_path / "t5"
    T5Config(d_model=8, d_ff=8, num_layers=1, num_heads=1, vocab_size=64).save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)
    with pytest.raises(RecipeError, match=r"is an encoder-decoder model \(t5\)"):
        check(directory)


def test_a_missing_shard_is_named(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    directory = tmp_path / "sharded"
    build_tiny_qwen3(tokenizer).save_pretrained(directory, max_shard_size="20KB")
    tokenizer.save_pretrained(directory)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(RecipeError, match=rf"is missing 1 of the weight shards .*\({shards[-1].name}\)"):
        check(directory)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    directory = tmp_path / "base"
    tokenizer = build_char_tokenizer()
    build_tiny_qwen3(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with pytest.raises(RecipeError, match="has no chat template"):
        check(directory)


def test_a_hub_id_missing_offline_is_named_with_how_to_get_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError, match=r"'nobody-here/absent-model' could not be loaded.*huggingface-cli download"):
        check("nobody-here/absent-model")


def test_the_command_exits_2_before_loading_a_reward_model(tmp_path, capsys):
    directory = save_tiny_chat_model(tmp_path / "reward")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (directory / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {directory}\nuse_cpu: true\nbf16: false\ndataset_name: sample\n")
    code = main(["train", "--config", str(recipe), "--output_dir", str(tmp_path / "run")])
    assert code == 2
    assert "looks like a reward model" in capsys.readouterr().err
