"""``python -m exo.runner ...``: see ``exo.runner.main``."""

from exo.runner.main import main

main()
