"""Import lines the deployment code holds: exports load no torch, and the lifecycle controller and the
provisioners do not import the deployment that uses them (no lifecycle <-> provisioner cycle)."""
from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_export_and_advisory_import_no_torch():
    mods = _modules_after("import coral.cli, coral.runtime.deploy.export, coral.runtime.deploy.advisory")
    assert "coral.runtime.deploy.export" in mods
    assert "torch" not in mods


def test_lifecycle_and_provisioner_do_not_import_the_deployment():
    mods = _modules_after("import coral.runtime.deploy.lifecycle, coral.runtime.deploy.provisioner")
    assert "coral.runtime.deploy.provisioner" in mods
    assert "coral.runtime.deploy.deployment" not in mods
    mods = _modules_after("from coral.runtime.deploy.deployment import Deployment")
    assert {"coral.runtime.deploy.lifecycle", "coral.runtime.deploy.provisioner"} <= mods
