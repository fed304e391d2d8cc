"""One entry to the CPU speed-ups (`stapo_trl.cpu.cpu_runtime`): `stapo-trl train` enters it, and a `STAPOTrainer`
built inside it in Python gets the CPU LM head and the frozen-layer replay, as the command line's trainer does."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl.generation.vllm_generation as trl_vllm_generation
import trl.trainer.grpo_trainer as trl_grpo_trainer
from peft import LoraConfig
from tiny import build_char_tokenizer, build_tiny_qwen3, tiny_config, tiny_trainer
from trl import GRPOConfig, GRPOTrainer

import stapo_trl
from stapo_trl import STAPOConfig, STAPOTrainer, cpu_runtime
from stapo_trl.cli import train as cli_train
from stapo_trl.cli.recipe import parse_train_args
from stapo_trl.cpu import runtime as runtime_module
from stapo_trl.cpu.colocated_vllm import VLLMOnCPUError
from stapo_trl.cpu.environment import CPU_ENVIRONMENT, SWITCH
from stapo_trl.cpu.frozen_layer_replay import FrozenPrefixReplay
from stapo_trl.cpu.kv_cache import InPlaceLayer
from stapo_trl.cpu.lm_head import is_cpu_lm_head_applied
from stapo_trl.cpu.runtime import active_cpu_runtime

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
LORA_ON_LAST_LAYER = LoraConfig(
    r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]
)


@pytest.fixture
def cpu_environment_in_effect(monkeypatch):
    for name, value in CPU_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("cpu_environment_in_effect")
@pytest.mark.parametrize("cpu_lm_head", ["true", "false"])
def test_stapo_trl_train_runs_inside_the_one_entry(monkeypatch, cpu_lm_head):
    """`run_training` enters `cpu_runtime` with the recipe's training arguments and its CPU options, and trains
    inside it; the CPU head is on there exactly as the recipe says, and off again afterwards."""
    entered, seen = [], {}
    real_cpu_runtime = runtime_module.cpu_runtime

    def spy(args, **options):
        entered.append((args, options))
        return real_cpu_runtime(args, **options)

    def train_and_summarize(request):
        seen["runtime"], seen["lm_head"] = active_cpu_runtime(), is_cpu_lm_head_applied()
        return "summary"

    monkeypatch.setattr(runtime_module, "cpu_runtime", spy)
    monkeypatch.setattr(cli_train, "train_and_summarize", train_and_summarize)
    request = parse_train_args(["--config", str(QUICKSTART), "--cpu_lm_head", cpu_lm_head])
    assert cli_train.run_training(request) == "summary"
    assert entered == [(request.training, {"lm_head": cpu_lm_head == "true", "replay_frozen_layers": True})]
    assert seen["runtime"] is not None and seen["runtime"].replay_frozen_layers
    assert seen["lm_head"] is (cpu_lm_head == "true") is seen["runtime"].lm_head
    assert active_cpu_runtime() is None and not is_cpu_lm_head_applied()


def test_the_command_line_imports_the_cpu_package_in_one_place():
    tree = ast.parse(Path(cli_train.__file__).read_text(encoding="utf-8"))
    imports = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").split(".")[0] == "cpu"
    ]
    assert imports == ["cpu.runtime"]


@pytest.mark.usefixtures("cpu_environment_in_effect")
def test_a_trainer_built_in_python_inside_the_entry_gets_the_cpu_head_and_the_replay(tmp_path, monkeypatch):
    """The library path: one `with` around building and training. Two GRPO steps (STAPO with the mask off) on the
    tiny model with LoRA on its last layer: every loss pass runs through the CPU head and replays the frozen layer, and
    every generation keeps its keys and values in the in-place cache."""
    config = tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False, learning_rate=5e-2)
    with cpu_runtime(config) as runtime:
        assert runtime.on_cpu and runtime.lm_head and is_cpu_lm_head_applied()
        assert runtime.colocated_vllm is None and runtime.environment_not_in_effect == {}
        trainer = tiny_trainer(
            STAPOTrainer,
            config,
            model=build_tiny_qwen3(build_char_tokenizer(), seed=3),
            peft_config=LORA_ON_LAST_LAYER,
        )
        assert runtime.replays == {}, "a trainer is attached when its training begins"
        updates = []
        original_update = InPlaceLayer.update
        monkeypatch.setattr(
            InPlaceLayer, "update", lambda self, *a, **k: updates.append(1) or original_update(self, *a, **k)
        )
        trainer.train()
        replay = runtime.replay_of(trainer)
        assert isinstance(replay, FrozenPrefixReplay)
        assert runtime.attach(trainer) is replay, "attached twice, it replayed twice"
        assert replay.replayed == 2 and replay.computed == 0 and replay.shared_prefills == 2
        assert updates, "generate() ran without the in-place cache"
    assert not is_cpu_lm_head_applied() and replay.restore_model is None, "the block ended, the replay is detached"


@pytest.mark.usefixtures("cpu_environment_in_effect")
def test_a_trl_trainer_is_attached_by_hand(tmp_path):
    with cpu_runtime(tiny_config(GRPOConfig, tmp_path)) as runtime:
        trainer = tiny_trainer(
            GRPOTrainer,
            tiny_config(GRPOConfig, tmp_path),
            model=build_tiny_qwen3(build_char_tokenizer()),
            peft_config=LORA_ON_LAST_LAYER,
        )
        assert runtime.replays == {}
        assert isinstance(runtime.attach(trainer), FrozenPrefixReplay)


@pytest.mark.usefixtures("cpu_environment_in_effect")
def test_the_options_turn_each_part_off(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path)
    with cpu_runtime(config, lm_head=False, replay_frozen_layers=False, inplace_kv_cache=False) as runtime:
        assert not runtime.lm_head and not is_cpu_lm_head_applied()
        trainer = tiny_trainer(STAPOTrainer, config, peft_config=LORA_ON_LAST_LAYER)
        assert runtime.attach(trainer) is None and runtime.replays == {}
        assert "generate" not in vars(trainer.model.get_base_model()), "nothing wraps generate()"


@pytest.mark.usefixtures("cpu_environment_in_effect")
def test_without_the_replay_the_in_place_cache_is_still_attached(tmp_path, monkeypatch):
    config = tiny_config(STAPOConfig, tmp_path)
    updates = []
    original_update = InPlaceLayer.update
    monkeypatch.setattr(
        InPlaceLayer, "update", lambda self, *a, **k: updates.append(1) or original_update(self, *a, **k)
    )
    with cpu_runtime(config, lm_head=False, replay_frozen_layers=False) as runtime:
        trainer = tiny_trainer(STAPOTrainer, config, peft_config=LORA_ON_LAST_LAYER)
        policy = trainer.model.get_base_model()
        assert runtime.attach(trainer) is None and list(runtime.replays.values()) == [None]
        with torch.no_grad():
            trainer.model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
        assert updates, "generate() ran without the in-place cache"
    assert "generate" not in vars(policy), "the block ended, generate() is the class's again"


def test_off_the_cpu_nothing_is_turned_on():
    args = SimpleNamespace(device=torch.device("cuda"), use_vllm=True, vllm_mode="colocate")
    with cpu_runtime(args) as runtime:
        assert not runtime.on_cpu and not runtime.lm_head and runtime.colocated_vllm is None
        assert not runtime.replay_frozen_layers and not runtime.inplace_kv_cache and not is_cpu_lm_head_applied()


def test_with_torch_loaded_the_environment_is_reported_not_set(monkeypatch, caplog):
    """Python users import torch before they have arguments: the entry names the missing variables and sets none."""
    monkeypatch.setattr(logging.getLogger("stapo_trl"), "propagate", True)  # `stapo-trl train` turns it off
    for name in (*CPU_ENVIRONMENT, "GOMP_SPINCOUNT", SWITCH):
        monkeypatch.delenv(name, raising=False)
    args = SimpleNamespace(device=torch.device("cpu"), use_vllm=False, vllm_mode="colocate")
    with caplog.at_level(logging.WARNING, logger="stapo_trl"), cpu_runtime(args, lm_head=False) as runtime:
        assert runtime.environment_not_in_effect == CPU_ENVIRONMENT
    assert "OMP_WAIT_POLICY=PASSIVE THP_MEM_ALLOC_ENABLE=1" in caplog.text and "set_cpu_environment()" in caplog.text
    assert not any(name in os.environ for name in CPU_ENVIRONMENT)
    monkeypatch.setenv(SWITCH, "0")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stapo_trl"), cpu_runtime(args, lm_head=False) as runtime:
        assert runtime.environment_not_in_effect == {}
    assert caplog.text == ""


def test_the_entry_is_the_packages_public_name():
    assert stapo_trl.cpu_runtime is runtime_module.cpu_runtime and "cpu_runtime" in stapo_trl.__all__


@pytest.mark.skipif(VLLM_INSTALLED, reason="checks the refusal where vLLM is missing")
def test_colocated_vllm_without_vllms_cpu_build_is_refused_on_entering(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(VLLMOnCPUError, match="needs vLLM's CPU build"), cpu_runtime(config):
        pass
    assert not is_cpu_lm_head_applied() and active_cpu_runtime() is None


@pytest.mark.vllm
@pytest.mark.skipif(
    not VLLM_INSTALLED, reason="vLLM is not installed; this test runs in the vLLM environment of .ci/run"
)
def test_colocated_vllm_is_on_while_the_trainer_is_built(tmp_path):
    config = tiny_config(STAPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate")
    with cpu_runtime(config) as runtime:
        assert runtime.colocated_vllm is not None
        assert trl_grpo_trainer.VLLMGeneration is not trl_vllm_generation.VLLMGeneration
    assert trl_grpo_trainer.VLLMGeneration is trl_vllm_generation.VLLMGeneration
