"""Entry point: ``python -m treadle.env_runner @ run.toml [--env_runner.key VALUE ...]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.env_runner.service import build
    from treadle.env_runner.spec import SPEC
    from treadle.services.host import serve

    return serve(SPEC, build, argv)


if __name__ == "__main__":
    sys.exit(main())
