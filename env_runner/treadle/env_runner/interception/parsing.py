"""Request bodies as every dialect reads them: the JSON checks and the field validators.

A body is refused (``RequestError``) before any dialect looks at it when it is not UTF-8
JSON, nests deeper than ``MAX_BODY_DEPTH`` (measured without parsing or recursion) or
holds NaN/Infinity, which Python's parser would otherwise accept. The validators below
check one field each and name it (``param``) in the error; what a field means is the
dialect's business (openai_chat.py, openai_responses.py, anthropic.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

MAX_BODY_BYTES = 16 << 20
"""Largest request body read (413 above): ~4M tokens of text, beyond any model's context."""
MAX_BODY_DEPTH = 100
"""Deepest nesting of lists/objects in a body (treadle_native's json MAX_DEPTH)."""
MAX_ERROR_CHARS = 500
"""Error messages are one line of at most this many characters (they may quote input)."""


class RequestError(ValueError):
    """A request that cannot be served: HTTP ``status`` (400 unless said otherwise) with a
    one-line message, in the error shape of the request's dialect."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_request",
        status: int = 400,
    ):  # fmt: skip
        super().__init__(message)
        self.param = param
        """The body field at fault (OpenAI's error.param), when one is."""
        self.code = code
        """What went wrong, for metrics and OpenAI's error.code: invalid_json, too_deep,
        too_large, invalid_request, ..."""
        self.status = status


def one_line(message: str) -> str:
    """``message`` on one line of at most MAX_ERROR_CHARS characters."""
    message = " ".join(message.split())  # whatever an echoed value held
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return message


# -- the body as a whole --------------------------------------------------------------------
_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # a backslash and the byte it escapes
_STRING = re.compile(rb'"[^"]*"')  # a string literal, once escapes are gone
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """How deep lists and objects nest in the JSON text ``raw``, without parsing it (and
    without recursion): escapes are dropped, then string literals, and the running count
    of the brackets left is taken. Linear in ``len(raw)``; exact for valid JSON."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", raw)).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    # '[' and '{' have bit 1 set, ']' and '}' do not: +1 for an opening, -1 for a closing
    steps = (np.frombuffer(brackets, np.uint8) & 2).astype(np.int32) - 1
    return int(np.cumsum(steps, dtype=np.int32).max())


def _no_constant(name: str) -> Any:
    raise RequestError(
        f"the body is not JSON: {name} is not a JSON value (numbers must be finite)",
        code="invalid_json",
    )


def load_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, refused (RequestError) when it is not UTF-8 JSON,
    not an object, nests deeper than MAX_BODY_DEPTH, or holds NaN/Infinity; never a
    RecursionError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("the body is not UTF-8 text", code="invalid_json") from None
    depth = json_depth(raw)
    too_deep = RequestError(
        f"the body nests lists/objects {depth} deep; at most {MAX_BODY_DEPTH} are accepted",
        code="too_deep",
    )
    if depth > MAX_BODY_DEPTH:
        raise too_deep
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RequestError(f"the body is not JSON: {e}", code="invalid_json") from None
    except RecursionError:  # not reached: the depth check comes first
        raise too_deep from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


# -- fields ---------------------------------------------------------------------------------
def shown(value: Any) -> str:
    """A value quoted in an error message, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    """``body[key]``: None, or an integer (not a bool) in [lo, hi]; RequestError otherwise."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(f"{key} must be an integer {bound}, got {shown(v)}", param=key)
    return v


def number(
    body: dict[str, Any], key: str, lo: float, hi: float, *, lo_open: bool = False
) -> float | None:
    """``body[key]``: None, or a finite number in [lo, hi] (``(lo, hi]`` with ``lo_open``)."""
    v = body.get(key)
    if v is None:
        return None
    ok = (
        isinstance(v, int | float) and not isinstance(v, bool)
        and (isinstance(v, int) or math.isfinite(v))
        and (lo < v if lo_open else lo <= v) and v <= hi
    )  # fmt: skip
    if not ok:
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"{key} must be a finite number in {span}, got {shown(v)}", param=key)
    return float(v)


def boolean(body: dict[str, Any], key: str) -> bool:
    """``body[key]``: absent/None (False) or a boolean; RequestError otherwise."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean, got {shown(v)}", param=key)
    return bool(v)


def string(body: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    """``body[key]``: a string (None when absent and not ``required``)."""
    v = body.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise RequestError(f"{key} must be a string, got {shown(v)}", param=key)
    return v


def objects(value: Any, where: str) -> list[dict[str, Any]]:
    """``value``: a list of JSON objects (RequestError naming ``where`` otherwise)."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise RequestError(f"{where} must be a list of objects", param=where)
    return value


def text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str | None:
    """Message content as the renderer takes it: a string or None, a list of text parts
    (``{"type": <one of kinds>, "text": ...}`` or bare strings) joined; anything else
    (images, files, audio) is refused."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") in kinds:
                text = p.get("text")
                if text is not None and not isinstance(text, str):
                    raise RequestError(f"{where}[{i}].text must be a string")
                parts.append(text or "")
            else:
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"{where}[{i}]: only text parts are supported, got {kind!r}")
        return "".join(parts)
    raise RequestError(f"{where} must be a string, a list of text parts or null")


def arguments_json(args: Any, where: str) -> str:
    """A tool call's arguments as JSON text (what the session records): a string is kept
    as sent, an object is serialised."""
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    raise RequestError(f"{where} must be a JSON object or its text, got {shown(args)}")
