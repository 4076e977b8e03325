"""``python -m gpu_anchor.serve MODEL_DIR ...`` = ``gpu-anchor serve MODEL_DIR ...``.

An entry point, not library code: it starts the supervisor (``gpu_anchor.launch.serve``),
the one import of ``launch`` the layering rules allow under serve/ (nothing imports this).
It ends through ``runtime.exit_path`` as the ``gpu-anchor`` command does (``cli.entry``)."""
import sys

from gpu_anchor import runtime
from gpu_anchor.launch.serve import cli

runtime.exit_path(lambda: sys.exit(cli()))
