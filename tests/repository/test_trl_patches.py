"""Every assignment to a global of a TRL, vLLM or transformers module is in `stapo_trl/trl_boundary/patches.py`, where
each says what it replaces and why. Elsewhere in the package, no code assigns (plainly, augmented, or with
``setattr``) an attribute of such a module, or of a name an import bound to one of their modules or objects."""

from __future__ import annotations

import ast
from pathlib import Path

import stapo_trl
from stapo_trl.trl_boundary import patches

PACKAGE = Path(stapo_trl.__file__).parent
PATCHES_MODULE = Path(patches.__file__)
PATCHED_PACKAGES = ("trl", "vllm", "transformers")


def imported_names(tree: ast.AST) -> dict[str, str]:
    """The names an import binds, anywhere in the module (function-level imports included), to a module or object of
    `PATCHED_PACKAGES`, with what each is bound to."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PATCHED_PACKAGES:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] in PATCHED_PACKAGES
        ):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _stored_attributes(node: ast.AST) -> list[ast.Attribute]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [
        target
        for each in targets
        for target in ast.walk(each)
        if isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)
    ]


def patches_in(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` assigns an attribute of a module or object of `PATCHED_PACKAGES` (reached through a name an
    import bound), as ``file:line what``."""
    tree = ast.parse(source)
    bound = imported_names(tree)
    found = []
    for node in ast.walk(tree):
        for target in _stored_attributes(node):
            if _root_name(target) in bound:
                found.append((node.lineno, ast.unparse(target)))
        is_setattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
        if is_setattr and node.args and _root_name(node.args[0]) in bound:
            found.append((node.lineno, f"setattr({ast.unparse(node.args[0])}, ...)"))
    return [f"{filename}:{line} {what}" for line, what in sorted(found)]


def test_no_trl_or_vllm_global_is_assigned_outside_the_patches_module():
    found = [
        patch
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PATCHES_MODULE
        for patch in patches_in(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    ]
    assert found == [], "module globals of TRL, vLLM or transformers assigned outside patches.py: " + ", ".join(found)


def test_the_patches_module_holds_the_known_patches():
    """The scan sees the patches where they are: the fused head's two names, TRL's ``LLM`` and ``VLLMGeneration``."""
    found = " ".join(patches_in(PATCHES_MODULE.read_text(encoding="utf-8")))
    for name in (
        "trl_trainer_utils._ChunkedLogProbFunction",
        "trl_trainer_utils._use_triton",
        "trl_vllm_generation.LLM",
        "trl_grpo_trainer.VLLMGeneration",
    ):
        assert name in found, (name, found)


def test_the_scan_finds_each_kind_of_patch():
    """The scan is not vacuous: plain, tuple, augmented and ``setattr`` assignments are found, through ``import ... as``,
    ``from ... import`` (of a module or a class) and function-level imports; assignments to the package's own objects
    are not."""
    source = (
        "import trl.trainer.utils as u\n"
        "import vllm\n"
        "from trl.generation import vllm_generation\n"
        "from trl import GRPOTrainer\n"
        "import torch\n"
        "u._use_triton = lambda device: True\n"
        "vllm.envs.VLLM_CPU_KVCACHE_SPACE, x = 4, 1\n"
        "vllm_generation.LLM += 1\n"
        "setattr(GRPOTrainer, '_name', 'x')\n"
        "def later(model):\n"
        "    import trl.trainer.grpo_trainer as g\n"
        "    g.VLLMGeneration = object\n"
        "    model.generate = None\n"
        "    torch.manual_seed(0)\n"
        "    own = object()\n"
        "    own.attribute = 1\n"
    )
    assert patches_in(source) == [
        "<source>:6 u._use_triton",
        "<source>:7 vllm.envs.VLLM_CPU_KVCACHE_SPACE",
        "<source>:8 vllm_generation.LLM",
        "<source>:9 setattr(GRPOTrainer, ...)",
        "<source>:12 g.VLLMGeneration",
    ]
