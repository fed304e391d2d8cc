"""STAPOConfig: the paper's defaults, and validation messages that say what to change."""

import dataclasses

import pytest
from trl import GRPOConfig, TrlParser

from stapo_trl import STAPOConfig, STAPOTrainer


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
        "use_stare",
        "stare_variant",
        "stare_top_surprisal_share",
        "stare_positive_weight",
        "stare_negative_weight",
        "stare_target_entropy",
        "stare_gate",
        "stare_adaptive",
        "stare_alpha",
        "stare_max_positive_weight",
        "stare_min_negative_weight",
        "stare_selection_pool",
        "token_rules",
        "token_rule_kwargs",
        "shadow_token_rules",
        "use_random_silencing",
    }
    for field in dataclasses.fields(STAPOConfig):
        if field.name in own_fields | {"epsilon_high", "beta", "loss_type"}:
            assert field.metadata.get("help"), field.name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"token_stats_source": "rollout"}, r"token_stats_source must be one of \('generation', 'loss'\)"),
        ({"token_stats_backend": "cuda"}, r"token_stats_backend must be one of"),
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
    """(The thresholds' range errors are checked on the pure function in test_token_rules.py and on the config and the
    command line in test_bad_input.py.)"""
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


STARE = {"use_s2t_mask": False, "use_stare": True}


def test_stare_defaults_follow_the_stare_paper():
    config = make_config(**STARE)
    assert config.stare_variant == "O1"
    assert config.stare_top_surprisal_share == 0.1
    assert (config.stare_positive_weight, config.stare_negative_weight) == (1.1, 0.9)
    assert config.stare_target_entropy == 0.3
    assert config.stare_gate == "entropy" and config.stare_adaptive is False
    assert (config.stare_alpha, config.stare_max_positive_weight, config.stare_min_negative_weight) == (0.01, 1.5, 0.5)
    assert config.stare_selection_pool == "micro_batch"
    assert config.active_token_rules == ["stare"]


def test_s2t_and_stare_compose_in_that_order():
    config = make_config(use_stare=True, stare_variant="c2")
    assert config.active_token_rules == ["s2t", "stare"]
    assert config.stare_variant == "C2"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stare_variant": "O2"}, r"stare_variant must be one of \('O1', 'C2'\)"),
        ({"stare_gate": "auto"}, r"stare_gate must be one of \('entropy', 'on', 'off'\)"),
        ({"stare_selection_pool": "global"}, r"stare_selection_pool must be one of"),
        ({"stare_top_surprisal_share": 10}, r"the paper's P = 10% is 0.1"),
        ({"stare_top_surprisal_share": 0.0}, r"must be in \(0, 1\]"),
        ({"stare_positive_weight": -1.1}, r"must be positive"),
        ({"stare_target_entropy": -0.3}, r"entropy in nats and must be >= 0"),
        ({"stare_alpha": -0.01, "stare_adaptive": True}, r"stare_alpha must be >= 0"),
        ({"stare_max_positive_weight": 0.9}, r"stare_max_positive_weight >= 1"),
        ({"stare_negative_weight": 0.95}, r"stare_negative_weight applies only to stare_variant='C2'"),
        ({"stare_alpha": 0.05}, r"stare_alpha applies only with stare_adaptive=True"),
        (
            {"stare_adaptive": True, "stare_positive_weight": 2.0},
            r"stare_positive_weight \(2.0\) must start inside its clamp \[1, stare_max_positive_weight=1.5\]",
        ),
        (
            {"stare_adaptive": True, "stare_variant": "C2", "stare_negative_weight": 0.4},
            r"stare_negative_weight \(0.4\) must start inside its clamp",
        ),
        ({"top_entropy_quantile": 0.2}, r"use_stare=True conflicts with top_entropy_quantile=0.2"),
        (
            {"gradient_accumulation_steps": 4, "steps_per_generation": 6},
            r"With token rules on \(stare\), steps_per_generation \(6\) must be a multiple",
        ),
    ],
)
def test_bad_stare_values_are_rejected_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**{**STARE, **overrides})


def test_stare_settings_without_use_stare_are_not_silently_ignored():
    with pytest.raises(ValueError, match=r"stare_variant, stare_positive_weight set, but use_stare=False"):
        make_config(stare_variant="C2", stare_positive_weight=1.2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"token_rules": ["s2t"]}, r"'s2t', a built-in rule: switch it on with use_s2t_mask=True"),
        ({"token_rules": ["nope"]}, r"'nope', which is not registered. Registered rules: .*s2t, stare"),
        (
            {"token_rule_kwargs": {"stare": {"variant": "C2"}}},
            r"arguments for stare, which neither token_rules nor shadow_token_rules lists",
        ),
        ({"token_rule_kwargs": "{not json"}, r"token_rule_kwargs is not valid JSON"),
        ({"token_rule_kwargs": {"x": 1}}, r"must map rule names to keyword dicts"),
    ],
)
def test_bad_token_rule_lists_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(**overrides)


def test_liger_backend_without_liger_names_the_install(monkeypatch):
    monkeypatch.setattr("stapo_trl.core.token_stats.liger_backend.is_liger_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[liger\]'"):
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
        ]
    )
    assert config.prob_threshold == 0.01
    assert config.entropy_quantile == 0.75
    assert config.token_stats_source == "loss"
    (switched_off,) = parser.parse_args_and_config(
        ["--output_dir", "unused", "--report_to", "none", "--use_cpu", "--use_s2t_mask", "false"]
    )
    assert switched_off.use_s2t_mask is False


def test_trl_parser_reads_the_s2t_fields_from_yaml(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("output_dir: unused\nreport_to: none\nuse_cpu: true\nprob_threshold: 0.005\n")
    (config,) = TrlParser(STAPOConfig).parse_args_and_config(["--config", str(recipe)])
    assert config.prob_threshold == 0.005


def test_trl_parser_reads_stare_and_custom_rule_fields(tmp_path, registered_rule):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "output_dir: unused\nreport_to: none\nuse_cpu: true\nuse_s2t_mask: false\nuse_stare: true\n"
        "stare_variant: C2\nstare_negative_weight: 0.95\nstare_selection_pool: optimizer_step\n"
        f"token_rules: [{registered_rule}]\n"
    )
    (config,) = TrlParser(STAPOConfig).parse_args_and_config(
        ["--config", str(recipe), "--token_rule_kwargs", f'{{"{registered_rule}": {{"scale": 0.5}}}}']
    )
    assert config.use_stare and config.stare_variant == "C2" and config.stare_negative_weight == 0.95
    assert config.stare_selection_pool == "optimizer_step"
    assert config.active_token_rules == ["stare", registered_rule]
    assert config.token_rule_kwargs == {registered_rule: {"scale": 0.5}}


@pytest.fixture
def registered_rule():
    from stapo_trl.core.token_rules import TOKEN_RULES, TokenRuleResult, register_token_rule

    @register_token_rule("config_test_rule")
    def rule(log_probs, entropies, advantages, loss_mask, scale=1.0):
        return TokenRuleResult()

    yield "config_test_rule"
    del TOKEN_RULES["config_test_rule"]


def test_the_silenced_token_dump_is_off_by_default_with_bounded_caps():
    from stapo_trl.diagnostics.token_dump import TokenDumpArguments

    dump = TokenDumpArguments()
    assert dump.dump_silenced_tokens is False
    assert (dump.dump_tokens_per_step, dump.dump_max_tokens, dump.dump_context_tokens) == (64, 5000, 20)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dump_max_tokens": 100}, "dump_max_tokens would be ignored: the token dump is off"),
        ({"dump_silenced_tokens": True, "dump_tokens_per_step": 0}, "dump_tokens_per_step must be an integer >= 1"),
        ({"dump_silenced_tokens": True, "dump_max_tokens": -1}, "dump_max_tokens must be an integer >= 0"),
        ({"dump_silenced_tokens": True, "dump_context_tokens": 2.5}, "dump_context_tokens must be an integer >= 0"),
    ],
    ids=["caps-without-dump", "zero-per-step", "negative-total", "fractional-context"],
)
def test_bad_dump_settings_are_refused(overrides, message):
    from stapo_trl.diagnostics.token_dump import TokenDumpArguments

    with pytest.raises(ValueError, match=message):
        TokenDumpArguments(**overrides)


def test_the_dump_in_a_run_without_token_rules_warns_that_it_records_nothing(tmp_path):
    from tiny import tiny_config, tiny_trainer, tools

    config = tiny_config(STAPOConfig, tmp_path, use_s2t_mask=False)
    with pytest.warns(UserWarning, match="The silenced-token dump has nothing to record in this run"):
        tiny_trainer(STAPOTrainer, config, callbacks=tools(dump_silenced_tokens=True))


def test_the_backend_is_called_trl_fused_head_not_trl():
    with pytest.raises(ValueError, match="token_stats_backend must be one of"):
        make_config(token_stats_backend="trl")


def test_rule_fields_come_from_their_mixins_and_the_tools_fields_stay_out_of_the_config():
    from stapo_trl.cli.recipe import tool_arguments
    from stapo_trl.core.token_rules.stare_rule import STAREConfigMixin

    stare = {field.name for field in dataclasses.fields(STAREConfigMixin)}
    assert len(stare) == 12 and "use_stare" in stare and all(name.startswith(("stare_", "use_")) for name in stare)
    assert not stare & set(STAPOConfig.__annotations__)
    assert issubclass(STAPOConfig, STAREConfigMixin) and stare <= {f.name for f in dataclasses.fields(STAPOConfig)}
    tools = {field.name for cls in tool_arguments() for field in dataclasses.fields(cls)}
    assert tools == {
        "dump_silenced_tokens",
        "dump_tokens_per_step",
        "dump_max_tokens",
        "dump_context_tokens",
        "gradient_probe_steps",
        "generation_states_every",
    }
    assert not tools & {field.name for field in dataclasses.fields(STAPOConfig)}


# Fields of GRPOConfig that STAPOConfig checks: TRL 1.16 accepts these values and fails later (in torch's sampler,
# transformers' generation, or by training the wrong way). If TRL starts rejecting one itself, drop our check.
CHECKED_TRL_FIELDS = [
    {"temperature": 0.0},
    {"max_completion_length": 0},
    {"learning_rate": -1.0},
    {"epsilon": -0.1},
    {"epsilon_high": -0.1},
    {"loss_type": "token_mean"},
    {"per_device_train_batch_size": 0},
    {"gradient_accumulation_steps": 0},
    {"num_iterations": 0},
    {"steps_per_generation": 0},
    {"generation_batch_size": 0},
]


@pytest.mark.parametrize("overrides", CHECKED_TRL_FIELDS, ids=lambda overrides: next(iter(overrides)))
def test_stapo_checks_only_trl_fields_that_trl_lets_through(overrides):
    base = {"output_dir": "unused", "report_to": "none", "use_cpu": True, "bf16": False}
    GRPOConfig(**base, **overrides)
    with pytest.raises(ValueError, match=next(iter(overrides))):
        make_config(**overrides)
