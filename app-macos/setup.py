"""py2app packaging of the exo menu-bar app (``exo menubar``) as exo.app. See README.md here.

python setup.py py2app -A   # alias build: a small .app that runs this checkout's venv in place
python setup.py py2app      # standalone: the interpreter, exo, MLX and the UI inside the .app
"""

from importlib.metadata import version

from setuptools import setup

EXO_VERSION = version("exo")

OPTIONS = {
    "argv_emulation": False,
    # Whole packages, not zipped: MLX loads its Metal library (mlx.metallib) from its package directory,
    # exo its bundled demo model and model cards; the daemon the app starts imports all of them.
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

setup(name="exo-menubar", version=EXO_VERSION, app=["exo_menubar_app.py"], options={"py2app": OPTIONS})
