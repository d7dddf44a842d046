"""Opening the chat renderer a service renders with, and saying which one and why.

Every service that renders conversations (env runners, ``treadle eval``, the SFT feed)
opens ``treadle_native.Renderer`` here, so the choice is made one way: ``"auto"`` (the
default) uses a family port only for a chat template it is proven equal to and the
generic renderer otherwise; naming a port that does not match the model's template is
a configuration error unless ``force`` is set, which is logged as a warning. The
choice is logged once at startup with its reason.

``treadle_native`` is imported late: only the packages that render install it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from treadle.services.errors import ConfigError

log = logging.getLogger(__name__)


def open_renderer(renderer: str, tokenizer: Path | str, *, force: bool = False, what: str) -> Any:
    """A ``treadle_native.Renderer`` for the model at ``tokenizer`` (a folder or a
    tokenizer.json); ``what`` names the setting in errors (e.g. ``env_runner.renderer``)."""
    import treadle_native

    try:
        r = treadle_native.Renderer(renderer, str(tokenizer), force=force)
    except treadle_native.TreadleNativeError as e:
        raise ConfigError(f"{what} = {renderer!r} for {tokenizer}: {e}") from None
    if force and r.selection.startswith("FORCED"):
        log.warning("[startup] renderer %s: %s", r.family, r.selection)
    else:
        log.info("[startup] renderer %s: %s", r.family, r.selection)
    return r
