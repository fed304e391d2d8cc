"""The plugin loads through verl's own entry-point discovery, and with ``loss_mode`` left at verl's default verl's
loss is bit-identical to verl without the plugin.

Each side runs in a fresh process, since ``import verl`` loads the ``verl.plugins`` entry points once:
``VERL_USE_EXTERNAL_PLUGINS=none`` is verl without the plugin, the default (``auto``) verl with it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="needs verl 0.9.1: run in the verl environment of docs/verl.md")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent

DEFAULT_LOSS = """
import json, sys, torch
import verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.workers.config.actor import ActorConfig
from verl_loss_calls import verl_loss

generator = torch.Generator().manual_seed(0)
log_probs = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 7
entropies = torch.rand(3, 4, generator=generator, dtype=torch.float64)
mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
default_mode = ActorConfig.__dataclass_fields__["policy_loss"].default_factory().loss_mode
results = {"default_mode": default_mode, "registered": sorted(POLICY_LOSS_REGISTRY), "plugin": "stapo_trl.verl.losses" in sys.modules}
for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"):
    losses, gradient, _ = verl_loss(log_probs, entropies, [1.0, -0.5, 2.0], mask, default_mode, agg, micro_batch_size=1)
    torch.save({"losses": losses, "gradient": gradient}, f"{sys.argv[1]}/{agg}.pt")
print(json.dumps(results))
"""


def run_verl(tmp_path, plugins: str):
    out = tmp_path / plugins
    out.mkdir()
    environment = {
        **os.environ,
        "VERL_USE_EXTERNAL_PLUGINS": plugins,
        "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path]),
    }
    completed = subprocess.run(
        [sys.executable, "-c", DEFAULT_LOSS, str(out)], env=environment, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1]), out


def test_the_default_loss_mode_is_bit_identical_with_and_without_the_plugin(tmp_path):
    without, without_dir = run_verl(tmp_path, "none")
    with_plugin, with_dir = run_verl(tmp_path, "auto")
    assert without["default_mode"] == with_plugin["default_mode"] == "vanilla"
    assert not without["plugin"] and with_plugin["plugin"]
    assert {"stapo", "stare", "stare_c2"}.isdisjoint(without["registered"])
    assert set(with_plugin["registered"]) == set(without["registered"]) | {"stapo", "stare", "stare_c2"}
    for result in sorted(with_dir.glob("*.pt")):
        plain, plugged = torch.load(without_dir / result.name), torch.load(result)
        assert all(torch.equal(a, b) for a, b in zip(plain["losses"], plugged["losses"], strict=True)), result.name
        assert torch.equal(plain["gradient"], plugged["gradient"]), result.name
    assert len(list(with_dir.glob("*.pt"))) == 5
