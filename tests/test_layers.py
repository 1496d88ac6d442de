"""The layer contract of trace_core holds (pyproject's ``[tool.importlinter]``).

Base values -> storage -> ownership protocol -> dag -> dispatcher -> api, the
worker and the author API never reach the control plane, trace_core never
imports the profiles, and no import cycle anywhere: imports inside functions
and under ``TYPE_CHECKING`` count. ``./dev lint`` runs the same check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
