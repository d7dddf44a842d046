"""Entry point: ``python -m treadle.orchestrator @ run.toml [--orchestrator.key VALUE ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.orchestrator.service import build
    from treadle.orchestrator.spec import SPEC
    from treadle.services.host import serve

    return serve(SPEC, build, argv)


if __name__ == "__main__":
    sys.exit(main())
