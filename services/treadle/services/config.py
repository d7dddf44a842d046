"""Configuration loading: defaults < TOML files < env vars < CLI flags.

A run is described by TOML files whose top-level tables are *sections*: shared ones
(``[run]``, ``[nats]``, ``[object_store]``, ``[telemetry]``, ``[log]``) and one per
service (``[trainer]``, ``[orchestrator]``, ...). Each service validates the shared
sections plus its own against its one pydantic config class (``extra="forbid"``);
sections of other services are left to them. The command line reads::

    treadle serve trainer @ base.toml run.toml --trainer.optim.lr 1e-5 --dry-run

Env vars ``TREADLE_<SECTION>__<KEY>[__<SUBKEY>...]`` (``__`` separates levels) are read
here and nowhere else. Every value remembers where it came from, so an unknown key or a
bad value produces one error naming the key and its file, env var or flag.

This module owns the mechanics; the shared section models live in ``sections.py``.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, SecretStr, ValidationError

from treadle.services.errors import ConfigError
from treadle.services.redact import MASK, is_secret_key, redact, redact_urls

M = TypeVar("M", bound=BaseModel)

ENV_PREFIX = "TREADLE_"
ENV_LEVEL_SEP = "__"
DEFAULTS_LABEL = "defaults"


@dataclass
class ConfigSources:
    """Where a config comes from, as parsed from a command line."""

    files: list[Path] = field(default_factory=list)
    # (dotted key, raw value, label) in command-line order
    overrides: list[tuple[str, str, str]] = field(default_factory=list)
    dry_run: bool = False

    def to_argv(self) -> list[str]:
        """The command-line form of these sources (for handing them to a child process)."""
        argv: list[str] = []
        if self.files:
            argv += ["@", *map(str, self.files)]
        for key, raw, _ in self.overrides:
            argv += [f"--{key}", raw]
        if self.dry_run:
            argv.append("--dry-run")
        return argv


def split_argv(argv: Sequence[str]) -> ConfigSources:
    """Parse ``@ a.toml b.toml``, ``@a.toml``, ``--a.b value``, ``--a.b=value``, ``--dry-run``.

    A flag without a value (followed by another flag or the end) means ``true``.
    """
    sources = ConfigSources()
    i = 0
    reading_files = False
    while i < len(argv):
        tok = argv[i]
        if tok == "@":
            reading_files = True
        elif tok.startswith("@"):
            sources.files.append(Path(tok[1:]))
            reading_files = True
        elif tok == "--dry-run":
            sources.dry_run = True
            reading_files = False
        elif tok.startswith("--"):
            reading_files = False
            body = tok[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@":
                key, raw = body, argv[i + 1]
                i += 1
            else:
                key, raw = body, "true"
            if not key or any(not part for part in key.split(".")):
                raise ConfigError(f"malformed flag {tok!r}: expected --section.key VALUE")
            sources.overrides.append((key, raw, f"flag --{key}"))
        elif reading_files:
            sources.files.append(Path(tok))
        else:
            raise ConfigError(
                f"unexpected argument {tok!r}: config files follow '@' (e.g. `@ run.toml`), "
                "settings are flags like `--trainer.optim.lr 1e-5`"
            )
        i += 1
    return sources


def parse_value(raw: str) -> Any:
    """Interpret a string from an env var or flag as a TOML value when it is one.

    ``1e-5`` -> float, ``true`` -> bool, ``[1, 2]`` -> list, ``{a = 1}`` -> dict; anything
    else (including TOML dates) stays a string.
    """
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, bool | int | float | str | list | dict):
        return value
    return raw


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    doc: dict[str, Any] = {}
    node = doc
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return doc


def _deep_merge(
    base: dict[str, Any], update: Mapping[str, Any], label: str, prefix: str = ""
) -> None:
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        current = base.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            _deep_merge(current, value, label, dotted + ".")
        elif isinstance(value, Mapping) and current is not None:
            raise ConfigError(
                f"{label}: cannot set keys under {dotted!r} because {dotted!r} is not a table"
            )
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value


@dataclass
class RawConfig:
    """Merged, unvalidated config data and the source of every leaf."""

    data: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)

    def add(self, update: Mapping[str, Any], label: str) -> None:
        _deep_merge(self.data, update, label)
        for dotted in _flatten(update):
            self.provenance[dotted] = label

    def source_of(self, dotted: str) -> str:
        """The file/env var/flag that set ``dotted`` (or an ancestor or descendant of it)."""
        probe = dotted
        while probe:
            if probe in self.provenance:
                return self.provenance[probe]
            probe = probe.rpartition(".")[0]
        for key, label in self.provenance.items():
            if key.startswith(dotted + "."):
                return label
        return DEFAULTS_LABEL


def read_toml(path: Path) -> dict[str, Any]:
    """Read one TOML file, turning every failure into a ConfigError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """Config overrides from ``TREADLE_<SECTION>__<KEY>`` env vars (the only env reader)."""
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or ENV_LEVEL_SEP not in name:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split(ENV_LEVEL_SEP)
        if any(not p for p in parts):
            raise ConfigError(f"env {name}: malformed name, expected TREADLE_<SECTION>__<KEY>")
        out.append((".".join(parts), environ[name], f"env {name}"))
    return out


def gather(sources: ConfigSources, environ: Mapping[str, str] | None = None) -> RawConfig:
    """Merge TOML files, env vars and flags in precedence order (defaults stay in models)."""
    raw = RawConfig()
    for path in sources.files:
        raw.add(read_toml(path), str(path))
    env = os.environ if environ is None else environ
    for dotted, value, label in [*env_overrides(env), *sources.overrides]:
        raw.add(_nest(dotted, parse_value(value)), label)
    return raw


def _model_at(cls: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The nested model class reached by following ``loc`` from ``cls`` (if any)."""
    current: Any = cls
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        fld = current.model_fields.get(str(part))
        if fld is None:
            return None
        current = fld.annotation
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _describe(cls: type[BaseModel], raw: RawConfig, err: Mapping[str, Any]) -> str:
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc)
    where = raw.source_of(dotted)
    if err["type"] == "extra_forbidden":
        parent = _model_at(cls, loc[:-1])
        hint = ""
        if parent is not None:
            close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1)
            hint = (
                f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?"
                if close
                else (f"; known keys here: {', '.join(parent.model_fields)}")
            )
        return f"{dotted}: unknown key (set in {where}){hint}"
    msg = err["msg"]
    if "input" in err and err["type"] != "missing" and not is_secret_key(dotted):
        shown = err["input"]
        if not isinstance(shown, dict | list):
            msg += f"; got {redact(repr(shown))}"
    return f"{dotted or '<top level>'}: {msg} (set in {where})"


def validate(cls: type[M], raw: RawConfig, known_sections: Iterable[str] = ()) -> M:
    """Validate merged data against ``cls``; sections of other services are dropped."""
    known = set(known_sections)
    data = {}
    problems = []
    for key, value in raw.data.items():
        if key in cls.model_fields:
            data[key] = value
        elif key not in known:
            close = difflib.get_close_matches(key, [*cls.model_fields, *known], n=1)
            hint = f"; did you mean [{close[0]}]?" if close else ""
            problems.append(f"{key}: unknown section (set in {raw.source_of(key)}){hint}")
    try:
        model = cls.model_validate(data)
    except ValidationError as e:
        problems += [_describe(cls, raw, err) for err in e.errors()]
        model = None
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        raise ConfigError(f"invalid configuration ({len(problems)} {noun}):\n{lines}")
    assert model is not None
    return model


def load_config(
    cls: type[M],
    argv: Sequence[str] | ConfigSources = (),
    *,
    environ: Mapping[str, str] | None = None,
    known_sections: Iterable[str] = (),
) -> M:
    """Build ``cls`` from defaults < TOML files < env vars < flags (see module docstring)."""
    sources = argv if isinstance(argv, ConfigSources) else split_argv(argv)
    return validate(cls, gather(sources, environ), known_sections)


def _plain(value: Any, reveal_secrets: bool) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value() if reveal_secrets else MASK
    if isinstance(value, str) and not reveal_secrets and "://" in value:
        return redact_urls(value)  # e.g. nats.url with a password
    if isinstance(value, BaseModel):
        return {
            k: _plain(getattr(value, k), reveal_secrets)
            for k in type(value).model_fields
            if getattr(value, k) is not None
        }
    if isinstance(value, dict):
        return {k: _plain(v, reveal_secrets) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v, reveal_secrets) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def to_toml(
    model: BaseModel, *, reveal_secrets: bool = False, only: Sequence[str] | None = None
) -> str:
    """The resolved config as TOML (None values omitted, secrets and URL passwords masked
    unless asked).

    ``only`` restricts the output to the named top-level sections.
    """
    doc = _plain(model, reveal_secrets)
    if only is not None:
        doc = {k: v for k, v in doc.items() if k in only}
    return tomli_w.dumps(doc)
