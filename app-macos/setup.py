"""py2app packaging of the exo menu-bar app (``exo menubar``) as exo.app. See README.md here.

python setup.py py2app -A   # alias build: a small .app that runs this checkout's venv in place
python setup.py py2app      # standalone: the interpreter, exo, MLX and the UI inside the .app

A standalone build bundles a staged copy of the exo package (``build/exo-package/exo``) with real files
where the installed one has symlinks: in an editable checkout ``exo/assets/model_cards`` links to the
repository's ``model_cards/``, outside the package, which a bundle must not depend on.
"""

import importlib.util
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
APP_SCRIPT = "exo_menubar_app.py"
STAGE = HERE / "build" / "exo-package"
ALIAS = any(arg in ("-A", "--alias") for arg in sys.argv[1:])
# What the daemon reads from its package at run time: a bundle without them starts, then fails.
REQUIRED_ASSETS = (
    "assets/model_cards/exo-demo.toml",
    "assets/models/exo-demo/config.json",
    "assets/dashboard/index.html",
)
EXO_VERSION = version("exo")


def stage_exo() -> Path:
    """Copy the installed exo package, symlinks followed, into STAGE, and put STAGE first on sys.path so
    that py2app (in this process) finds and copies the staged package."""
    spec = importlib.util.find_spec("exo")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("exo is not installed in this environment: pip install -e '.[menubar]' py2app")
    source = Path(next(iter(spec.submodule_search_locations)))
    shutil.rmtree(STAGE, ignore_errors=True)
    staged = Path(
        shutil.copytree(source, STAGE / "exo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    )
    missing = [asset for asset in REQUIRED_ASSETS if not (staged / asset).is_file()]
    if missing:
        raise SystemExit(f"the exo package at {source} lacks {missing}: build from a full checkout")
    sys.path.insert(0, str(STAGE))
    return staged


if not ALIAS:
    stage_exo()

OPTIONS = {
    "argv_emulation": False,
    # Whole packages, not zipped: MLX loads its Metal library (mlx.metallib) from its package directory,
    # exo its bundled demo model, model cards and dashboard; the daemon the app starts imports all of them.
    "packages": [
        "exo",
        "mlx",
        "mlx_lm",
        "transformers",
        "tokenizers",
        "safetensors",
        "grpc",
        "google.protobuf",
        "zeroconf",
        "aiohttp",
        "pystray",
        "PIL",
        "pyperclip",
    ],
    "plist": {
        "CFBundleName": "exo",
        "CFBundleDisplayName": "exo",
        "CFBundleIdentifier": "org.exo.menubar",
        "CFBundleShortVersionString": EXO_VERSION,
        "CFBundleVersion": EXO_VERSION,
        "LSUIElement": True,  # a menu-bar app: no Dock icon, no app menu
        "LSMinimumSystemVersion": "14.0",  # MLX needs macOS 14 or later
        "NSHighResolutionCapable": True,
        "NSHumanReadableCopyright": "Apache-2.0",
    },
}

setup(name="exo-menubar", version=EXO_VERSION, app=[APP_SCRIPT], options={"py2app": OPTIONS})
