"""Entry point: ``python -m treadle.inference @ run.toml [--inference.key VALUE ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.inference.service import build
    from treadle.inference.spec import SPEC
    from treadle.services.host import serve

    return serve(SPEC, build, argv)


if __name__ == "__main__":
    sys.exit(main())
