"""Imported at start-up by the Python processes the tests start (tests/conftest.py puts this folder on their
PYTHONPATH): daemons, runners, pipeline stages, the CLI. It hides torch from them, as a user's install of exo
has none: torch is only in the dev extra, to train the fixture checkpoints here. transformers imports torch
whenever it can find it, so every such process paid ~2.5 s of CPU importing it for nothing (tests that start
a few daemons and their runners took seconds longer each on a 2-core machine), and its code ran against a
transformers that saw a torch no user's would.

It shadows any other ``sitecustomize`` (none in a venv of python.org's or pyenv's Python; Debian's only
installs apport's exception hook, where apport is installed).
"""

import sys

sys.modules.setdefault("torch", None)  # `import torch` raises ImportError; importlib.util.find_spec() is None
