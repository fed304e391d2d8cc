"""STAPOConfig: the paper's defaults, and validation messages that say what to change."""

import dataclasses

import pytest
from trl import GRPOConfig, TrlParser

from stapo_trl import STAPOConfig


def make_config(**overrides):
    values = {"output_dir": "unused", "report_to": "none", "use_cpu": True, "bf16": False}
    values.update(overrides)
    return STAPOConfig(**values)


def test_defaults_follow_the_paper():
    config = make_config()
    assert isinstance(config, GRPOConfig)
    assert config.use_s2t_mask is True
    assert config.prob_threshold == 0.002
    assert config.entropy_quantile == 0.8
    assert config.epsilon == 0.2 and config.epsilon_high == 0.28
    assert config.beta == 0.0
    assert config.loss_type == "dapo"
    assert config.token_stats_source == "generation"
    assert config.token_stats_backend == "auto"


def test_every_stapo_field_has_help():
    own_fields = {field.name for field in dataclasses.fields(STAPOConfig)} - {
        field.name for field in dataclasses.fields(GRPOConfig)
    }
    assert own_fields == {
        "use_s2t_mask",
        "prob_threshold",
        "entropy_quantile",
        "token_stats_source",
        "token_stats_backend",
    }
    for field in dataclasses.fields(STAPOConfig):
        if field.name in own_fields | {"epsilon_high", "beta", "loss_type"}:
            assert field.metadata.get("help"), field.name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prob_threshold": 0.0}, r"prob_threshold must be in \(0, 1\]"),
        ({"prob_threshold": 2.0}, r"prob_threshold must be in \(0, 1\]"),
        ({"entropy_quantile": 80.0}, r"entropy_quantile=0.8"),
        ({"entropy_quantile": -0.5}, r"entropy_quantile must be in \[0, 1\]"),
        ({"token_stats_source": "rollout"}, r"token_stats_source must be one of \('generation', 'loss'\)"),
        ({"token_stats_backend": "cuda"}, r"token_stats_backend must be one of"),
        ({"use_liger_kernel": True}, r"set use_liger_kernel=False and token_stats_backend='liger'"),
        ({"top_entropy_quantile": 0.2}, r"set top_entropy_quantile=1.0 for STAPO, or use_s2t_mask=False"),
        (
            {"gradient_accumulation_steps": 4, "steps_per_generation": 6},
            r"steps_per_generation \(6\) must be a multiple of gradient_accumulation_steps \(4\)",
        ),
        (
            {"gradient_accumulation_steps": 4, "steps_per_generation": 2},
            r"steps_per_generation \(2\) must be a multiple",
        ),
    ],
)
def test_bad_values_are_rejected_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_liger_backend_without_liger_names_the_install(monkeypatch):
    monkeypatch.setattr("stapo_trl.fused_stats.is_liger_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'stapo-trl\[liger\]'"):
        make_config(token_stats_backend="liger")


def test_twenty_entropy_runs_with_the_mask_off():
    config = make_config(use_s2t_mask=False, top_entropy_quantile=0.2)
    assert config.top_entropy_quantile == 0.2


def test_four_optimizer_steps_per_generation_is_accepted():
    config = make_config(gradient_accumulation_steps=2, steps_per_generation=8, num_iterations=2)
    assert config.steps_per_generation == 8


def test_trl_parser_reads_the_s2t_fields_from_the_command_line():
    parser = TrlParser(STAPOConfig)
    (config,) = parser.parse_args_and_config(
        [
            "--output_dir",
            "unused",
            "--report_to",
            "none",
            "--use_cpu",
            "--prob_threshold",
            "0.01",
            "--entropy_quantile",
            "0.75",
            "--token_stats_source",
            "loss",
            "--use_s2t_mask",
            "false",
        ]
    )
    assert config.prob_threshold == 0.01
    assert config.entropy_quantile == 0.75
    assert config.token_stats_source == "loss"
    assert config.use_s2t_mask is False


def test_trl_parser_reads_the_s2t_fields_from_yaml(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("output_dir: unused\nreport_to: none\nuse_cpu: true\nprob_threshold: 0.005\n")
    (config,) = TrlParser(STAPOConfig).parse_args_and_config(["--config", str(recipe)])
    assert config.prob_threshold == 0.005
