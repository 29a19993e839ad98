"""Regenerate constraints.txt: install exo with every extra the tests use into a fresh virtual
environment and pin what resolved (local version labels such as torch's +cpu dropped, so the pins hold
on every platform: `torch==2.13.0` admits 2.13.0+cpu).

    python scripts/freeze_constraints.py

Run it after changing pyproject.toml's dependencies, then run the test suite on the result.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = "dev,menubar,train"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        venv.create(tmp, with_pip=True)
        python = Path(tmp) / "bin" / "python"
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[{EXTRAS}]"], check=True)
        frozen = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout
    pins = [re.sub(r"\+[\w.]+$", "", line) for line in frozen.splitlines() if "==" in line]
    header = [
        f"# Versions the test suite is run against (a fresh install of .[{EXTRAS}] on {sys.platform}, "
        f"{datetime.date.today()}).",
        "# README's commands and .ci/run install with -c constraints.txt, so a later install resolves to these.",
        "# Regenerate after changing pyproject.toml: python scripts/freeze_constraints.py",
    ]
    (ROOT / "constraints.txt").write_text("\n".join(header + pins) + "\n")
    print(f"constraints.txt: {len(pins)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
