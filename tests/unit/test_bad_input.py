"""Bad input, one table: recipes, config values, dataset files, reward inputs, command lines and model paths.

Every case ends in one of three outcomes, and never in a traceback from inside TRL, transformers or torch, a hang, or a
silently wrong result:

- `Raises`: an exception of the given type, raised by stapo-trl itself, whose message matches;
- `Exits`: the command line returns the exit code with one `stapo-trl ...: error:` line that matches, and no traceback;
- `Returns`: a defined value (a reward's scores, or the gold answers a loader hands the rewards).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from forked_cli import ForkedCommandLines

import stapo_trl
from stapo_trl import STAPOConfig
from stapo_trl.cli import main
from stapo_trl.data import DatasetSchemaError, load_dapo_math
from stapo_trl.rewards import boxed_reward, dapo_reward, get_reward_func

CATEGORIES = (
    "recipe YAML",
    "eval config",
    "config values",
    "dataset schema",
    "reward inputs",
    "CLI arguments",
    "model paths",
    "output and resume",
    "Python API",
)
CASE_SECONDS = 60


def separate_process_environment() -> dict[str, str]:
    """The environment of a command line's own process: this one's, with one OpenMP thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


PACKAGE_DIR = Path(stapo_trl.__file__).resolve().parent


@dataclass
class Workspace:
    """Where a case writes its files: a fresh `tmp` holding an `empty_dir`, a `loose_file` and a `list_yaml`, and a
    tiny saved `model`."""

    tmp: Path
    model: Path
    capsys: pytest.CaptureFixture | None
    separate_process: bool = False
    """Run command lines as `python -m stapo_trl ...` in their own process instead of calling `main()`."""
    forked: ForkedCommandLines | None = None
    """With `separate_process`: fork that process from this server (torch, TRL and the rest imported once) instead
    of starting a fresh Python."""

    def write(self, files: dict[str, str | bytes]) -> None:
        """Create `files` (paths relative to `tmp`, text or bytes) before a case runs."""
        for name, content in files.items():
            path = self.tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)

    def fill(self, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        return value.format(
            tmp=self.tmp,
            model=self.model,
            empty_dir=self.tmp / "empty-dir",
            loose_file=self.tmp / "weights.bin",
            list_yaml=self.tmp / "list.yaml",
        )

    def cli(self, argv: list[str]) -> CliResult:
        if self.separate_process and self.forked is not None:
            result = self.forked.run([self.fill(token) for token in argv], timeout=CASE_SECONDS)
            return CliResult(result.returncode, result.stdout, result.stderr)
        if self.separate_process:
            result = subprocess.run(
                [sys.executable, "-m", "stapo_trl", *[self.fill(token) for token in argv]],
                capture_output=True,
                text=True,
                timeout=CASE_SECONDS,
                env=separate_process_environment(),
            )
            return CliResult(result.returncode, result.stdout, result.stderr)
        try:
            code = main([self.fill(token) for token in argv])
        except SystemExit as exit_info:
            code = exit_info.code
        captured = self.capsys.readouterr()
        return CliResult(code, captured.out, captured.err)


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


# --- the bad inputs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """`stapo-trl train --config recipe.yaml --dry_run [flags]`: a small valid recipe with `keys` added, or `text`."""

    keys: dict = field(default_factory=dict)
    text: str | None = None
    flags: tuple[str, ...] = ()

    def run(self, workspace: Workspace) -> CliResult:
        base = {
            "model_name_or_path": "tiny",
            "output_dir": str(workspace.tmp / "out"),
            "report_to": "none",
            "use_cpu": True,
            "bf16": False,
        }
        path = workspace.tmp / "recipe.yaml"
        path.write_text(self.text if self.text is not None else yaml.safe_dump({**base, **self.keys}))
        return workspace.cli(["train", "--config", str(path), "--dry_run", *self.flags])


@dataclass(frozen=True)
class TrainRun:
    """`stapo-trl train` for real on the tiny model and the shipped sample, with `keys` changed. Every case stops before
    the model is loaded."""

    keys: dict
    files: dict = field(default_factory=dict)

    def run(self, workspace: Workspace) -> CliResult:
        workspace.write(self.files)
        recipe = {
            "model_name_or_path": "{model}",
            "dataset_name": "sample",
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 4,
            "max_steps": 1,
            "use_cpu": True,
            "bf16": False,
            "report_to": "none",
            "save_strategy": "no",
            "disable_tqdm": True,
            "output_dir": "{tmp}/run",
            **self.keys,
        }
        path = workspace.tmp / "recipe.yaml"
        path.write_text(yaml.safe_dump({key: workspace.fill(value) for key, value in recipe.items()}))
        return workspace.cli(["train", "--config", str(path)])


@dataclass(frozen=True)
class Command:
    """A `stapo-trl` command line."""

    argv: tuple[str, ...]
    files: dict = field(default_factory=dict)

    def run(self, workspace: Workspace) -> CliResult:
        workspace.write(self.files)
        return workspace.cli(list(self.argv))


@dataclass(frozen=True)
class TrainerInit:
    """`STAPOTrainer(model, reward_funcs=..., args=..., train_dataset=...)` in Python, on the tiny model; returns the
    names of the reward functions the trainer ended up with."""

    reward_funcs: Any = dapo_reward
    columns: dict = field(default_factory=lambda: {"prompt": ["1+1?"] * 4, "solution": ["2"] * 4})
    config: dict = field(default_factory=dict)
    tools: dict = field(default_factory=dict)
    """Settings of the tools' callbacks (``gradient_probe_steps``, ``generation_states_every``)."""

    def run(self, workspace: Workspace) -> list[str]:
        from datasets import Dataset
        from tiny import tools

        from stapo_trl import STAPOTrainer

        config = STAPOConfig(
            output_dir=str(workspace.tmp / "api"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=4,
            report_to="none",
            use_cpu=True,
            bf16=False,
            **self.config,
        )
        trainer = STAPOTrainer(
            str(workspace.model),
            reward_funcs=self.reward_funcs,
            args=config,
            train_dataset=Dataset.from_dict(self.columns),
            callbacks=tools(**self.tools) if self.tools else None,
        )
        return [function.__name__ for function in trainer.reward_funcs]


@dataclass(frozen=True)
class Config:
    """`STAPOConfig(**values)` in Python."""

    values: dict

    def run(self, workspace: Workspace) -> STAPOConfig:
        return STAPOConfig(output_dir=str(workspace.tmp), report_to="none", use_cpu=True, bf16=False, **self.values)


@dataclass(frozen=True)
class DataFile:
    """`load_dapo_math(path, **options)` on a local file holding `text` (absent when `text` is None); returns the gold
    answers the rewards will grade."""

    name: str
    text: str | None
    options: dict = field(default_factory=dict)

    def run(self, workspace: Workspace) -> list:
        path = workspace.tmp / self.name
        if self.text is not None:
            path.write_text(self.text)
        return load_dapo_math(str(path), **self.options)["answer"]


NO_SOLUTION = object()


@dataclass(frozen=True)
class RewardCall:
    """`get_reward_func(reward, **options)(completions, solution=solution)`, as TRL calls a reward."""

    reward: str
    completions: Any
    solution: Any = NO_SOLUTION
    options: dict = field(default_factory=dict)

    def run(self, workspace: Workspace) -> list:
        reward = get_reward_func(self.reward, **self.options)
        if self.solution is NO_SOLUTION:
            return reward(self.completions)
        return reward(self.completions, solution=self.solution)


# --- the outcomes --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raises:
    error: type[BaseException]
    message: str

    def check(self, given, workspace: Workspace) -> None:
        with pytest.raises(self.error, match=self.message) as info:
            given.run(workspace)
        raised_in = Path(info.traceback[-1].path).resolve()
        assert PACKAGE_DIR in raised_in.parents, f"raised inside a dependency: {raised_in}"


@dataclass(frozen=True)
class Exits:
    code: int
    message: str

    def check(self, given, workspace: Workspace) -> None:
        result = given.run(workspace)
        assert result.code == self.code, result.err
        assert "Traceback" not in result.out + result.err
        error_lines = re.findall(r"^stapo-trl[\w ]*: error: .*$", result.err, flags=re.MULTILINE)
        assert len(error_lines) == 1, result.err
        assert re.search(self.message, result.err), result.err
        assert len(result.err.splitlines()) < 10, result.err


@dataclass(frozen=True)
class Succeeds:
    """The command line exits with 0, prints no traceback, and its output matches `message`."""

    message: str

    def check(self, given, workspace: Workspace) -> None:
        result = given.run(workspace)
        assert result.code == 0, result.err
        assert "Traceback" not in result.out + result.err
        assert re.search(self.message, result.out + result.err), result.out + result.err


@dataclass(frozen=True)
class Returns:
    value: list

    def check(self, given, workspace: Workspace) -> None:
        assert given.run(workspace) == self.value


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    given: Recipe | TrainRun | Command | Config | DataFile | RewardCall | TrainerInit
    expect: Raises | Exits | Succeeds | Returns


def jsonl(*rows: str) -> str:
    return "".join(row + "\n" for row in rows)


EVAL_YAML = "model: my-org/my-model\nbenchmark_source: sample\n"
"""The start of a valid `stapo-trl eval --config` file (the model is never loaded: each case stops while the file is
read); each eval config case adds its mistake after it."""
VERL_ROW_WITHOUT_ANSWER = '{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"style": "rule"}}'

CASES = [
    Case(
        "unknown key",
        "recipe YAML",
        Recipe({"learning_rte": 1e-6}),
        Exits(2, r"learning_rte: not a known key\. Did you mean 'learning_rate'\?"),
    ),
    Case(
        "key TRL 1.x removed",
        "recipe YAML",
        Recipe({"max_prompt_length": 1024}),
        Exits(2, r"max_prompt_length: TRL 1\.x removed it.*Use max_prompt_tokens"),
    ),
    Case(
        "malformed YAML",
        "recipe YAML",
        Recipe(text="learning_rate: [1\n"),
        Exits(2, r"recipe\.yaml is not valid YAML"),
    ),
    Case(
        "a list, not a mapping",
        "recipe YAML",
        Recipe(text="- learning_rate\n- 1e-6\n"),
        Exits(2, r"must hold a YAML mapping of keys to values, not a list"),
    ),
    Case(
        "recipe file missing",
        "recipe YAML",
        Command(("train", "--config", "{tmp}/missing.yaml", "--dry_run")),
        Exits(2, r"Recipe not found: .*missing\.yaml"),
    ),
    Case(
        "--config names a directory",
        "recipe YAML",
        Command(("train", "--config", "{tmp}", "--dry_run")),
        Exits(2, r"is a directory; --config takes one YAML recipe"),
    ),
    Case(
        "text where a number goes",
        "recipe YAML",
        Recipe({"learning_rate": "fast"}),
        Exits(2, r"learning_rate: wrong type \(got 'fast'; expected float\)"),
    ),
    Case(
        "a list where one value goes",
        "recipe YAML",
        Recipe({"num_generations": [4, 8]}),
        Exits(2, r"num_generations must be a single value"),
    ),
    Case(
        "S2T threshold under method grpo",
        "recipe YAML",
        Recipe({"method": "grpo", "prob_threshold": 0.01}),
        Exits(2, r"prob_threshold set, but use_s2t_mask=False, so they would be ignored"),
    ),
    Case(
        "misspelt reward name",
        "recipe YAML",
        Recipe({"reward_funcs": ["boxd"]}),
        Exits(2, r"Unknown reward 'boxd' in reward_funcs\. Registered rewards: boxed, dapo"),
    ),
    Case(
        "worked examples for a dataset that is not arithmetic",
        "recipe YAML",
        Recipe({"num_fewshot": 2}),
        Exits(2, r"num_fewshot works with dataset_name: arithmetic only"),
    ),
    Case(
        "more worked examples than there are",
        "recipe YAML",
        Recipe({"dataset_name": "arithmetic", "num_fewshot": 5}),
        Exits(2, r"num_fewshot must be between 0 and 3, got 5"),
    ),
    Case(
        "num_generations does not divide the batch",
        "recipe YAML",
        Recipe({"per_device_train_batch_size": 6, "num_generations": 4}),
        Exits(2, r"generation_batch_size \(6\) must be divisible by num_generations \(4\)"),
    ),
    Case(
        "eval: a key given twice",
        "eval config",
        Command(
            ("eval", "--config", "{tmp}/eval.yaml"),
            files={"eval.yaml": EVAL_YAML + "max_problems: 2\nmax_problems: 3\n"},
        ),
        Exits(2, r"eval\.yaml: the key 'max_problems' appears twice \(lines 3 and 4\).*Keep one"),
    ),
    Case(
        "eval: misspelt key",
        "eval config",
        Command(("eval", "--config", "{tmp}/eval.yaml"), files={"eval.yaml": EVAL_YAML + "max_problem: 2\n"}),
        Exits(2, r"max_problem: not a known key\. Did you mean 'max_problems'\?"),
    ),
    Case(
        "eval: YAML's no where a number goes",
        "eval config",
        Command(("eval", "--config", "{tmp}/eval.yaml"), files={"eval.yaml": EVAL_YAML + "temperature: no\n"}),
        Exits(2, r"temperature: a boolean where a number is needed; YAML reads an unquoted yes, no, .* \(got False"),
    ),
    Case(
        "eval: text where a number goes",
        "eval config",
        Command(("eval", "--config", "{tmp}/eval.yaml"), files={"eval.yaml": EVAL_YAML + "max_new_tokens: many\n"}),
        Exits(2, r"eval\.yaml: max_new_tokens: wrong type \(got 'many'; expected int\)"),
    ),
    Case(
        "eval: a list where one value goes",
        "eval config",
        Command(("eval", "--config", "{tmp}/eval.yaml"), files={"eval.yaml": EVAL_YAML + "seed: [1, 2]\n"}),
        Exits(2, r"eval\.yaml: seed must be a single value \(int\), not a list"),
    ),
    Case(
        "eval: config file missing",
        "eval config",
        Command(("eval", "--config", "{tmp}/missing.yaml")),
        Exits(2, r"Config file not found: .*missing\.yaml\. Pass the path of a YAML file"),
    ),
    Case(
        "eval: env that is not a mapping",
        "eval config",
        Command(("eval", "--config", "{tmp}/eval.yaml"), files={"eval.yaml": EVAL_YAML + "env: HF_HOME=/tmp\n"}),
        Exits(2, r"eval\.yaml: env must be a mapping of environment variables to values"),
    ),
    Case(
        "prob_threshold 0",
        "config values",
        Config({"prob_threshold": 0.0}),
        Raises(ValueError, r"prob_threshold must be in \(0, 1\], got 0\.0"),
    ),
    Case(
        "entropy_quantile as a percent",
        "config values",
        Config({"entropy_quantile": 80.0}),
        Raises(ValueError, r"entropy_quantile must be in \[0, 1\].*entropy_quantile=0\.8"),
    ),
    Case(
        "S2T key with S2T off",
        "config values",
        Config({"use_s2t_mask": False, "entropy_quantile": 0.5}),
        Raises(ValueError, r"entropy_quantile set, but use_s2t_mask=False, so they would be ignored"),
    ),
    Case(
        "STARE key with STARE off",
        "config values",
        Config({"stare_positive_weight": 1.2}),
        Raises(ValueError, r"stare_positive_weight set, but use_stare=False, so they would be ignored"),
    ),
    Case(
        "unknown STARE variant",
        "config values",
        Config({"use_s2t_mask": False, "use_stare": True, "stare_variant": "x3"}),
        Raises(ValueError, r"stare_variant must be one of \('O1', 'C2'\), got 'X3'"),
    ),
    Case(
        "unregistered token rule",
        "config values",
        Config({"token_rules": ["my_rule"]}),
        Raises(ValueError, r"token_rules lists 'my_rule', which is not registered"),
    ),
    Case(
        "token_rule_kwargs not JSON",
        "config values",
        Config({"token_rule_kwargs": "{my_rule: {alpha: 1}}"}),
        Raises(ValueError, r"token_rule_kwargs is not valid JSON"),
    ),
    Case(
        "temperature 0",
        "config values",
        Config({"temperature": 0.0}),
        Raises(ValueError, r"temperature must be > 0, got 0\.0"),
    ),
    Case(
        "max_completion_length 0",
        "config values",
        Config({"max_completion_length": 0}),
        Raises(ValueError, r"max_completion_length must be at least 1 token, got 0"),
    ),
    Case(
        "negative learning rate",
        "config values",
        Config({"learning_rate": -1e-6}),
        Raises(ValueError, r"learning_rate must be >= 0, got -1e-06"),
    ),
    Case(
        "negative clip epsilon",
        "config values",
        Config({"epsilon": -0.2}),
        Raises(ValueError, r"epsilon must be >= 0, got -0\.2"),
    ),
    Case(
        "learning rate as a string",
        "config values",
        Config({"learning_rate": "1e-6"}),
        Raises(ValueError, r"learning_rate must be a number, got the string '1e-6'"),
    ),
    Case(
        "file missing",
        "dataset schema",
        DataFile("missing.jsonl", None),
        Raises(FileNotFoundError, r"no such file or directory: .*missing\.jsonl"),
    ),
    Case(
        "empty file",
        "dataset schema",
        DataFile("empty.jsonl", ""),
        Raises(DatasetSchemaError, r"empty\.jsonl is empty"),
    ),
    Case(
        "no rows", "dataset schema", DataFile("rows.json", "[]"), Raises(DatasetSchemaError, r"rows\.json has no rows")
    ),
    Case(
        "not JSON",
        "dataset schema",
        DataFile("rows.jsonl", "{prompt: 1+1?\n"),
        Raises(DatasetSchemaError, r"cannot read .*rows\.jsonl as json"),
    ),
    Case(
        "no prompt column",
        "dataset schema",
        DataFile("rows.jsonl", '{"question": "1+1?", "answer": "2"}\n'),
        Raises(DatasetSchemaError, r"matches no known DAPO-Math-17K schema.*found fields \['question', 'answer'\]"),
    ),
    Case(
        "prompt of the wrong type",
        "dataset schema",
        DataFile("rows.jsonl", '{"prompt": 12, "solution": "2"}\n'),
        Raises(DatasetSchemaError, r"found fields \['prompt', 'solution'\] with prompt of type int"),
    ),
    Case(
        "no row has a gold answer",
        "dataset schema",
        DataFile("rows.jsonl", jsonl(VERL_ROW_WITHOUT_ANSWER, VERL_ROW_WITHOUT_ANSWER)),
        Raises(
            DatasetSchemaError,
            r"none of its 2 rows has both a problem and a gold answer \(2 rows have no reward_model\.ground_truth",
        ),
    ),
    Case(
        "numeric gold answers",
        "dataset schema",
        DataFile("rows.jsonl", jsonl('{"prompt": "1+1?", "solution": 2}', '{"prompt": "1/2?", "solution": 0.5}')),
        Returns(["2", "0.5"]),
    ),
    Case(
        "unknown prompt style",
        "dataset schema",
        DataFile("rows.jsonl", '{"prompt": "1+1?", "solution": "2"}\n', {"prompt_style": "latex"}),
        Raises(ValueError, r"Unknown prompt_style 'latex'"),
    ),
    Case(
        "training on a dataset file that is missing",
        "dataset schema",
        TrainRun({"dataset_name": "{tmp}/missing.jsonl"}),
        Exits(2, r"no such file or directory: .*missing\.jsonl"),
    ),
    Case(
        "one string instead of a list of completions",
        "reward inputs",
        RewardCall("boxed", r"\boxed{2}", ["2"]),
        Raises(TypeError, r"`completions` must be a list with one completion per sample, got str"),
    ),
    Case(
        "fewer gold answers than completions",
        "reward inputs",
        RewardCall("dapo", ["Answer: 2", "Answer: 3"], ["2"]),
        Raises(ValueError, r"got 2 completions but 1 gold answers"),
    ),
    Case(
        "no solution column",
        "reward inputs",
        RewardCall("boxed", [r"\boxed{2}"]),
        Raises(ValueError, r"needs the gold answers in a `solution` column"),
    ),
    Case(
        "unknown reward name",
        "reward inputs",
        RewardCall("boxd", [r"\boxed{2}"], ["2"]),
        Raises(ValueError, r"Unknown reward 'boxd'\. Registered rewards: boxed, dapo"),
    ),
    Case(
        "options for a reward without options",
        "reward inputs",
        RewardCall("boxed", [r"\boxed{2}"], ["2"], {"scale": 2}),
        Raises(TypeError, r"The 'boxed' reward takes no options, got \['scale'\]"),
    ),
    Case("empty completion", "reward inputs", RewardCall("boxed", ["", None], ["2", "2"]), Returns([-1.0, -1.0])),
    Case(
        "completion without a boxed answer",
        "reward inputs",
        RewardCall("boxed", ["The answer is 2."], ["2"]),
        Returns([-1.0]),
    ),
    Case(
        "NaN and missing gold answers",
        "reward inputs",
        RewardCall("dapo", ["Answer: 2", "Answer: 2"], [math.nan, None]),
        Returns([None, None]),
    ),
    Case(
        "training with a reward module that does not import",
        "reward inputs",
        TrainRun({"reward_funcs": ["no_such_module.reward"]}),
        Exits(2, r"reward_funcs: Cannot import module 'no_such_module'"),
    ),
    Case(
        "math_verify on a completion without an answer",
        "reward inputs",
        RewardCall("math_verify", ["I cannot say."], ["2"]),
        Returns([0.0]),
    ),
    Case(
        "unknown subcommand",
        "CLI arguments",
        Command(("evaluate",)),
        Exits(2, r"unknown command 'evaluate'; choose one of: train, eval, report"),
    ),
    Case(
        "misspelt flag",
        "CLI arguments",
        Recipe(flags=("--lerning_rate", "1e-5")),
        Exits(2, r"Unknown argument --lerning_rate\. Did you mean 'learning_rate'\?"),
    ),
    Case(
        "unknown --method",
        "CLI arguments",
        Recipe(flags=("--method", "ppo")),
        Exits(2, r"Unknown method 'ppo'\. Choose one of: stapo, grpo, 20-entropy, justrl, stare"),
    ),
    Case(
        "flag value of the wrong type",
        "CLI arguments",
        Recipe(flags=("--learning_rate", "fast")),
        Exits(2, r"train: error: argument --learning_rate/--learning-rate: invalid float value: 'fast'"),
    ),
    Case(
        "--config without a path",
        "CLI arguments",
        Command(("train", "--config")),
        Exits(2, r"--config needs the path of a YAML recipe"),
    ),
    Case(
        "eval: unknown flag",
        "CLI arguments",
        Command(("eval", "--model", "{model}", "--bogus", "1")),
        Exits(2, r"eval: error: Unknown arguments: --bogus 1"),
    ),
    Case(
        "eval: --config file holds a list",
        "CLI arguments",
        Command(("eval", "--config", "{list_yaml}")),
        Exits(2, r"eval: error: .*list\.yaml must hold a YAML mapping of keys to values, not a list"),
    ),
    Case(
        "eval: unknown benchmark",
        "CLI arguments",
        Command(("eval", "--model", "{model}", "--benchmarks", "aime99")),
        Exits(2, r"Unknown benchmark 'aime99'; choose one of \['aime24', 'aime25'"),
    ),
    Case(
        "eval: flag value of the wrong type",
        "CLI arguments",
        Command(("eval", "--model", "{model}", "--max_new_tokens", "many")),
        Exits(2, r"eval: error: argument --max_new_tokens/--max-new-tokens: invalid int value: 'many'"),
    ),
    Case(
        "report: run directory missing",
        "CLI arguments",
        Command(("report", "{tmp}/no-run")),
        Exits(2, r"report: error: .*no-run: no such directory"),
    ),
    Case(
        "report: directory without a training log",
        "CLI arguments",
        Command(("report", "{empty_dir}")),
        Exits(2, r"empty-dir: no training log found"),
    ),
    Case(
        "train: model path missing",
        "model paths",
        TrainRun({"model_name_or_path": "{tmp}/no-model"}),
        Exits(2, r"model_name_or_path '.*no-model' does not exist"),
    ),
    Case(
        "train: directory without config.json",
        "model paths",
        TrainRun({"model_name_or_path": "{empty_dir}"}),
        Exits(2, r"model_name_or_path '.*empty-dir' is not a saved model: it holds no config\.json"),
    ),
    Case(
        "train: a weights file, not a directory",
        "model paths",
        TrainRun({"model_name_or_path": "{loose_file}"}),
        Exits(2, r"model_name_or_path '.*weights\.bin' is not a saved model"),
    ),
    Case(
        "train: GGUF file missing",
        "model paths",
        TrainRun({"model_name_or_path": "{tmp}/model.gguf"}),
        Exits(2, r"GGUF file not found: '.*model\.gguf' is neither a file nor a file inside an installed package"),
    ),
    Case(
        "train: damaged GGUF file",
        "model paths",
        TrainRun({"model_name_or_path": "{tmp}/damaged.gguf"}),
        Exits(2, r".*damaged\.gguf is not a readable GGUF file \(.*\)\. A partial download .* download it again"),
    ),
    Case(
        "train: no model",
        "model paths",
        TrainRun({"model_name_or_path": None}),
        Exits(2, r"No model: set model_name_or_path"),
    ),
    Case(
        "eval: model path missing",
        "model paths",
        Command(("eval", "--model", "{tmp}/no-model", "--benchmark_source", "sample", "--output_dir", "{tmp}/eval")),
        Exits(2, r"The model path '.*no-model' does not exist"),
    ),
    Case(
        "eval: directory without config.json",
        "model paths",
        Command(("eval", "--model", "{empty_dir}", "--benchmark_source", "sample", "--output_dir", "{tmp}/eval")),
        Exits(2, r"The model directory '.*empty-dir' holds no config\.json"),
    ),
    Case(
        "eval: adapter directory missing",
        "model paths",
        Command(("eval", "--model", "{model}", "--adapter", "{tmp}/no-adapter", "--output_dir", "{tmp}/eval")),
        Exits(2, r"The adapter directory '.*no-adapter' does not exist"),
    ),
    Case(
        "a boxed prompt graded by the Answer: reward",
        "recipe YAML",
        Recipe({"prompt_style": "boxed", "reward_funcs": ["dapo"]}),
        Exits(
            2, r"prompt_style 'boxed' asks for the answer in \\boxed\{\}, but the reward 'dapo' grades an 'Answer:'"
        ),
    ),
    Case(
        "zero completions per device",
        "config values",
        Recipe({"per_device_train_batch_size": 0}),
        Exits(2, r"per_device_train_batch_size must be at least 1, got 0"),
    ),
    Case(
        "zero completions per device, in Python",
        "config values",
        Config({"per_device_train_batch_size": 0}),
        Raises(ValueError, r"per_device_train_batch_size must be at least 1, got 0"),
    ),
    Case(
        "every prompt empty",
        "dataset schema",
        DataFile("rows.jsonl", jsonl('{"prompt": "", "solution": "2"}', '{"prompt": "  ", "solution": "3"}')),
        Raises(DatasetSchemaError, r"none of its 2 rows has both a problem and a gold answer .*2 an empty prompt"),
    ),
    Case(
        "one prompt empty",
        "dataset schema",
        DataFile("rows.jsonl", jsonl('{"prompt": "", "solution": "2"}', '{"prompt": "1+2?", "solution": "3"}')),
        Returns(["3"]),
    ),
    Case(
        "train: vLLM asked for but not installed",
        "CLI arguments",
        TrainRun({"use_vllm": True}),
        Exits(2, r"use_vllm is true, but vLLM is not installed here.*set use_vllm: false"),
    ),
    Case(
        "dry run: vLLM asked for but not installed",
        "CLI arguments",
        Recipe({"use_vllm": True}),
        Succeeds(r"note: use_vllm is true, but vLLM is not installed here.*a real run on this machine would stop"),
    ),
    Case(
        "output_dir is a file",
        "output and resume",
        TrainRun({"output_dir": "{loose_file}"}),
        Exits(2, r"output_dir '.*weights\.bin' is a file, not a directory"),
    ),
    Case(
        "output_dir holds a finished run",
        "output and resume",
        TrainRun({}, files={"run/run_summary.json": "{}", "run/model.safetensors": b"weights"}),
        Exits(2, r"holds an earlier run \(run_summary\.json, model\.safetensors\).*--overwrite_output_dir true"),
    ),
    Case(
        "output_dir holds checkpoints of an unfinished run",
        "output and resume",
        TrainRun({}, files={"run/checkpoint-2/trainer_state.json": "{}"}),
        Exits(2, r"holds an earlier run \(checkpoint-2\).*Continue it with --resume_from_checkpoint last"),
    ),
    Case(
        "resume from a directory that does not exist",
        "output and resume",
        TrainRun({"resume_from_checkpoint": "{tmp}/run/checkpoint-9"}),
        Exits(2, r"resume_from_checkpoint='.*checkpoint-9' is not a directory"),
    ),
    Case(
        "resume from the last checkpoint when there is none",
        "output and resume",
        TrainRun({"resume_from_checkpoint": "last"}),
        Exits(2, r"resume_from_checkpoint='last', but .*run holds no complete checkpoint-N"),
    ),
    Case(
        "resume from a checkpoint with damaged weights",
        "output and resume",
        TrainRun(
            {"resume_from_checkpoint": "last"},
            files={"run/checkpoint-1/trainer_state.json": "{}", "run/checkpoint-1/model.safetensors": b"\x08garbage"},
        ),
        Exits(2, r"checkpoint-1/model\.safetensors cannot be read .*the checkpoint is damaged"),
    ),
    Case(
        "resume and overwrite together",
        "output and resume",
        TrainRun({"resume_from_checkpoint": "last", "overwrite_output_dir": True}),
        Exits(2, r"overwrite_output_dir would delete it first\. Set only one of them"),
    ),
    Case(
        "report: metrics.jsonl cut off mid-line",
        "output and resume",
        Command(
            ("report", "{tmp}/killed", "--output_dir", "{tmp}/report"),
            files={"killed/metrics.jsonl": '{"step": 1, "reward": 0.5, "entropy": 1.0}\n{"step": 2, "rew'},
        ),
        Succeeds(r"killed: 1 steps"),
    ),
    Case(
        "report: trainer_state.json damaged",
        "output and resume",
        Command(("report", "{tmp}/broken"), files={"broken/trainer_state.json": '{"log_history": [{"st'}),
        Exits(2, r"trainer_state\.json cannot be read .*the file is damaged"),
    ),
    Case(
        "reward functions imported from stapo_trl.rewards",
        "Python API",
        TrainerInit(reward_funcs=[dapo_reward, boxed_reward]),
        Returns(["dapo_reward", "boxed_reward"]),
    ),
    Case(
        "the gradient probe's callback in a run without a token rule",
        "Python API",
        TrainerInit(config={"use_s2t_mask": False}, tools={"gradient_probe_steps": 1}),
        Raises(ValueError, r"gradient_probe_steps measures .* Not with: no token rule is on or in shadow"),
    ),
    Case(
        "the saved generation states' callback in a run without a token rule",
        "Python API",
        TrainerInit(config={"use_s2t_mask": False}, tools={"generation_states_every": 1}),
        Raises(ValueError, r"generation_states_every saves the per-token p and H .* no token rule is on or in shadow"),
    ),
    Case(
        "a dataset without a prompt column",
        "Python API",
        TrainerInit(columns={"question": ["1+1?"] * 4, "solution": ["2"] * 4}),
        Raises(ValueError, r"train_dataset has no 'prompt' column \(its columns: question, solution\)"),
    ),
    Case(
        "impossible generation batch, in Python",
        "Python API",
        Config({"generation_batch_size": 0}),
        Raises(ValueError, r"generation_batch_size must be at least 1, got 0"),
    ),
]


def prepare(tmp_path: Path) -> Path:
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    (tmp_path / "list.yaml").write_text("- model\n")
    (tmp_path / "damaged.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return tmp_path


@pytest.fixture
def workspace(tmp_path, tiny_model_dir, capsys) -> Workspace:
    return Workspace(tmp=prepare(tmp_path), model=tiny_model_dir, capsys=capsys)


@contextmanager
def time_limit(seconds: int):
    def expire(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_table_has_at_least_45_cases_over_all_categories():
    assert len(CASES) >= 45
    per_category = Counter(case.category for case in CASES)
    assert set(per_category) == set(CATEGORIES)
    assert min(per_category.values()) >= 5
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.category}: {case.id}")
def test_bad_input_gives_a_clear_error_or_a_defined_result(case, workspace):
    with time_limit(CASE_SECONDS):
        case.expect.check(case.given, workspace)


COMMAND_LINE_CASES = [
    case
    for case in CASES
    if isinstance(case.given, (Recipe, Command, TrainRun)) and isinstance(case.expect, (Exits, Succeeds))
]


def test_at_least_45_cases_go_through_the_command_line():
    assert len(COMMAND_LINE_CASES) >= 45


def subcommand(case: Case) -> str:
    if not isinstance(case.given, Command):
        return "train"
    return case.given.argv[0] if case.given.argv[0] in ("train", "eval", "report") else "not a subcommand"


def in_own_process_by_default(cases: list[Case]) -> list[Case]:
    """The first case of each subcommand: these run in a fresh process in the default tier. Each such process imports
    torch and TRL (5 to 12 s of CPU time), while the default tier already runs every case through `main()` (the test
    above)."""
    first: dict[str, Case] = {}
    for case in cases:
        first.setdefault(subcommand(case), case)
    return list(first.values())


OWN_PROCESS_BY_DEFAULT = in_own_process_by_default(COMMAND_LINE_CASES)


def test_the_default_tier_runs_a_case_of_each_subcommand_in_its_own_process():
    assert sorted(subcommand(case) for case in OWN_PROCESS_BY_DEFAULT) == [
        "eval",
        "not a subcommand",
        "report",
        "train",
    ]
    assert all(isinstance(case.expect, Exits) for case in OWN_PROCESS_BY_DEFAULT)


@pytest.mark.parametrize("case", OWN_PROCESS_BY_DEFAULT, ids=lambda case: f"{case.category}: {case.id}")
def test_a_case_of_each_subcommand_in_a_fresh_process(case, tmp_path, tiny_model_dir):
    """The same outcome from `python -m stapo_trl ...` as a fresh process: its real exit code and its real stderr,
    with the logging, warnings (those printed while torch, TRL and the rest import too) and exception hooks a user's
    shell sees."""
    case.expect.check(
        case.given, Workspace(tmp=prepare(tmp_path), model=tiny_model_dir, capsys=None, separate_process=True)
    )


@pytest.fixture(scope="module")
def forked_command_lines():
    server = ForkedCommandLines("stapo_trl", env=separate_process_environment())
    yield server
    server.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", COMMAND_LINE_CASES, ids=lambda case: f"{case.category}: {case.id}")
def test_each_command_line_case_in_its_own_process(case, tmp_path, tiny_model_dir, forked_command_lines):
    """The same outcome from `python -m stapo_trl ...` as a process of its own: its real exit code, stdout and stderr,
    with the logging and exception hooks a user's shell sees. The process is forked from one that has already
    imported torch, TRL and the rest (`forked_cli.py`), which saves each case those imports; what they print while
    importing only a fresh process shows (the test above)."""
    workspace = Workspace(
        tmp=prepare(tmp_path), model=tiny_model_dir, capsys=None, separate_process=True, forked=forked_command_lines
    )
    case.expect.check(case.given, workspace)
