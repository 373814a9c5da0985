"""Everything installs under the one `deepinfer` namespace (setup.py maps each top-level folder to
`deepinfer.<folder>`), and the public API imports from it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_subpackages() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUBPACKAGES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no SUBPACKAGES")


def test_every_top_level_package_installs_under_deepinfer():
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "deepinfer"}
    assert set(_setup_subpackages()) == folders


def test_public_api_and_stage_modules_import_from_the_namespace(tmp_path):
    # NOTE: from a folder outside the checkout, so only the installed (editable) package can answer
    code = ("import deepinfer, importlib.util as u; from deepinfer import LLM, SamplingParams; "
            "assert u.find_spec('deepinfer.prefill_worker.__main__') and u.find_spec('deepinfer.kernels.registry'); "
            "print(SamplingParams.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deepinfer.engine.sampling.params"
