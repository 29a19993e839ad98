"""``python -m exo.runner ...``: see ``exo.runner.main``."""

import exo

exo.without_torch()

from exo.runner.main import main  # noqa: E402

main()
