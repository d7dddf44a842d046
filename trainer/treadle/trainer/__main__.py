"""Entry point: ``python -m treadle.trainer @ run.toml [--trainer.key VALUE ...]``
(also ``treadle serve trainer``); ``--nproc-per-node N`` and friends start a torchrun job
(``launch.py``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.trainer.launch import main as launch_main

    return launch_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
