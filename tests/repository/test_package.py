"""The package's import surface: pure functions without TRL, the trainer on first access."""

import subprocess
import sys


def test_the_pure_functions_import_without_trl():
    code = "import sys, stapo_trl; stapo_trl.spurious_token_mask; assert 'trl' not in sys.modules, 'trl imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_trainer_and_config_load_on_first_access():
    import stapo_trl
    from stapo_trl.core.config import STAPOConfig
    from stapo_trl.core.trainer import STAPOTrainer

    assert stapo_trl.STAPOConfig is STAPOConfig
    assert stapo_trl.STAPOTrainer is STAPOTrainer
    assert set(stapo_trl.__all__) >= {"STAPOConfig", "STAPOTrainer", "spurious_token_mask", "token_logprob_entropy"}


def test_rewards_import_without_trl_or_math_verify():
    """math-verify runs in child processes, so importing the rewards loads neither it nor sympy into the trainer."""
    code = (
        "import sys, stapo_trl.rewards as r; r.get_reward_func('dapo'); "
        "loaded = {'trl', 'math_verify', 'sympy'} & set(sys.modules); assert not loaded, loaded"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_wheel_ships_the_samples_the_math_verify_worker_and_the_console_script(tmp_path):
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(root)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("stapo_trl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    samples = {"dapo_math_17k", "aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"}
    assert {f"stapo_trl/data/samples/{name}.jsonl" for name in samples} <= names
    assert "stapo_trl/rewards/_math_verify_worker.py" in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "stapo-trl = stapo_trl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
