"""``python -m gpu_anchor.serve MODEL_DIR ...`` = ``gpu-anchor serve MODEL_DIR ...``."""
import sys

from .cli import cli

sys.exit(cli())
