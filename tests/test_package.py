"""The package's import surface: pure functions without TRL, the trainer on first access."""

import subprocess
import sys


def test_the_pure_functions_import_without_trl():
    code = "import sys, stapo_trl; stapo_trl.spurious_token_mask; assert 'trl' not in sys.modules, 'trl imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_trainer_and_config_load_on_first_access():
    import stapo_trl
    from stapo_trl.config import STAPOConfig
    from stapo_trl.trainer import STAPOTrainer

    assert stapo_trl.STAPOConfig is STAPOConfig
    assert stapo_trl.STAPOTrainer is STAPOTrainer
    assert set(stapo_trl.__all__) >= {"STAPOConfig", "STAPOTrainer", "spurious_token_mask", "token_logprob_entropy"}
