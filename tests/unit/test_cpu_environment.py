"""`stapo-trl train` sets torch's CPU environment variables before torch loads, and only where the user has not."""

import os
import subprocess
import sys
from pathlib import Path

from stapo_trl.cpu.environment import CPU_ENVIRONMENT, SWITCH, set_cpu_environment

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "smollm2-135m-cpu.yaml"


def test_the_defaults_are_set_when_nothing_is():
    environ = {}
    assert set_cpu_environment(environ, torch_loaded=False) == CPU_ENVIRONMENT
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "THP_MEM_ALLOC_ENABLE": "1"}


def test_the_users_values_and_the_switch_win():
    environ = {"OMP_WAIT_POLICY": "ACTIVE", "THP_MEM_ALLOC_ENABLE": "0"}
    assert set_cpu_environment(environ, torch_loaded=False) == {}
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE", "THP_MEM_ALLOC_ENABLE": "0"}
    environ = {"GOMP_SPINCOUNT": "1000"}
    assert set_cpu_environment(environ, torch_loaded=False) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert "OMP_WAIT_POLICY" not in environ
    environ = {SWITCH: "0"}
    assert set_cpu_environment(environ, torch_loaded=False) == {} and environ == {SWITCH: "0"}


def test_nothing_is_set_once_torch_is_loaded():
    environ = {}
    assert set_cpu_environment(environ, torch_loaded=True) == {} and environ == {}


def test_the_command_line_reaches_train_before_torch_is_imported():
    code = (
        "import sys, os\n"
        "import stapo_trl.cli as cli\n"
        "assert 'torch' not in sys.modules, 'importing the command line imported torch'\n"
        f"cli.main(['train', '--config', {str(QUICKSTART)!r}, '--dry_run'])\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('THP_MEM_ALLOC_ENABLE'))\n"
    )
    environment = {key: value for key, value in os.environ.items() if key not in CPU_ENVIRONMENT}
    environment.pop("GOMP_SPINCOUNT", None)
    environment.pop(SWITCH, None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "PASSIVE 1"
