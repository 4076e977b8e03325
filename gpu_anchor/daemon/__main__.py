"""``python -m gpu_anchor.daemon --device cuda:0 [--socket PATH]``: the torch-free daemon process."""
from __future__ import annotations

import argparse
import logging
import sys

from gpu_anchor.paths import default_socket, normalize_device

from .server import run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu-anchor daemon", description=__doc__)
    p.add_argument("--device", required=True, help="cpu or cuda:N")
    p.add_argument("--socket", help="socket path (default: per-user directory)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s gpu-anchor-daemon[%(process)d] %(levelname)s %(message)s")
    device = normalize_device(args.device)
    try:
        run(device, args.socket or default_socket(device))
    except (RuntimeError, PermissionError, ImportError, ValueError) as e:
        print(f"gpu-anchor daemon: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
