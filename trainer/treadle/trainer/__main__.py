"""Entry point: ``python -m treadle.trainer @ run.toml [--trainer.key VALUE ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.services.host import serve
    from treadle.trainer.service import build
    from treadle.trainer.spec import SPEC

    return serve(SPEC, build, argv)


if __name__ == "__main__":
    sys.exit(main())
