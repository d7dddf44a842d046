"""Keeping secrets out of text: URLs with passwords, secret flags, known secret values.

Everything that writes text a person or a log pipeline reads passes through here: log
records (``RedactFilter``, installed by ``logs.setup_logging``), ``--dry-run`` and the
saved config (``config.to_toml``), the supervisor's "start:" lines, the launcher's
startup table. A value becomes known to the filter with ``register_secret`` (the service
host registers every ``SecretStr`` of its config and the password of ``nats.url``).

Not here: handing secrets to children (the launcher puts them in the environment).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from pydantic import BaseModel, SecretStr

MASK = "**********"
_MIN_SECRET_LEN = 6  # shorter values would mask ordinary words
_URL_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s:/@]*)(?P<pw>:[^\s/@]*)?@"
)
# words of a key's last part that make it a secret; "token" only as the last word (a gate
# token, not a tokenizer path or max_tokens, which stay visible in logs and argv)
_SECRET_KEY = re.compile(
    r"(?:^|_)(?:secret|password|passwd|credentials?)(?:_|$)|(?:^|_)token(?:_file)?$|private_key|api_key",
    re.I,
)

_known: set[str] = set()


def redact_urls(text: str) -> str:
    """``scheme://user:pw@host`` -> ``scheme://user:***@host``; a lone ``scheme://tok@``
    (NATS token auth) -> ``scheme://***@``."""

    def sub(m: re.Match[str]) -> str:
        if m.group("pw") is not None:
            return f"{m.group('scheme')}{m.group('user')}:{MASK}@"
        return f"{m.group('scheme')}{MASK}@" if m.group("user") else m.group(0)

    return _URL_USERINFO.sub(sub, text)


def url_password(url: str) -> str | None:
    """The password (or token) a URL carries in its userinfo, if any."""
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
    except ValueError:
        return None
    if parts.password:
        return parts.password
    if parts.username and "@" in parts.netloc and ":" not in parts.netloc.split("@")[0]:
        return parts.username
    return None


def register_secret(value: str | SecretStr | None) -> None:
    """Mask ``value`` wherever it appears in text this process logs from now on."""
    raw = value.get_secret_value() if isinstance(value, SecretStr) else value
    if raw and len(raw) >= _MIN_SECRET_LEN:
        _known.add(raw)


def register_config_secrets(model: BaseModel) -> None:
    """Register every SecretStr of a config and the password of every URL in it."""
    for value in _walk(model):
        if isinstance(value, SecretStr):
            register_secret(value)
        elif isinstance(value, str) and "://" in value:
            register_secret(url_password(value))


def _walk(value: object) -> Iterable[object]:
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name))
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _walk(v)
    else:
        yield value


def redact(text: str) -> str:
    """``text`` with URL passwords and every registered secret masked."""
    out = redact_urls(text)
    for secret in sorted(_known, key=len, reverse=True):
        if secret in out:
            out = out.replace(secret, MASK)
    return out


def is_secret_key(dotted: str) -> bool:
    """Whether a config key names a secret by its last part (``object_store.secret_key``)."""
    return bool(_SECRET_KEY.search(dotted.rsplit(".", 1)[-1]))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line fit for a log: the value after a secret flag and URL passwords masked."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        if arg.startswith("--") and is_secret_key(arg[2:].split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + MASK)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact(arg))
    return out


class RedactFilter(logging.Filter):
    """Rewrites each record's message with ``redact`` (and drops its args)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            return True
        clean = redact(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            formatter = logging.Formatter()
            record.exc_text = redact(formatter.formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True
