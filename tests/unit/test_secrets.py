"""Secrets never in clear: URL passwords and secret values are masked in logs, command
lines, --dry-run and config errors; secret flags reach children through the environment."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from treadle.services.config import gather, load_config, split_argv, to_toml
from treadle.services.errors import ConfigError
from treadle.services.launcher import child_sources
from treadle.services.logs import setup_logging
from treadle.services.nats_auth import permissions
from treadle.services.redact import (
    MASK,
    is_secret_key,
    redact_argv,
    redact_urls,
    register_secret,
    url_password,
)
from treadle.services.sections import ServiceConfig

SECRET = "s3cr3t-Value-xyz"


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_redact_urls_masks_passwords_and_tokens() -> None:
    assert redact_urls(f"nats://u:{SECRET}@h:4222") == f"nats://u:{MASK}@h:4222"
    assert redact_urls(f"see tls://{SECRET}@h:1 now") == f"see tls://{MASK}@h:1 now"
    assert redact_urls("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert url_password(f"nats://u:{SECRET}@h:4222") == SECRET
    assert url_password(f"nats://{SECRET}@h") == SECRET
    assert url_password("nats://h:4222") is None


def test_redact_argv_hides_secret_flags() -> None:
    argv = ["python", "-m", "x", "--object_store.secret_key", SECRET,
            f"--nats.token={SECRET}", "--nats.url", f"nats://a:{SECRET}@h"]  # fmt: skip
    shown = " ".join(redact_argv(argv))
    assert SECRET not in shown
    assert "--object_store.secret_key" in shown


def test_log_lines_mask_registered_secrets_and_url_passwords(
    tmp_path: Path, restore_root_logger: None
) -> None:
    register_secret(SECRET)
    log_file = tmp_path / "svc.log"
    setup_logging("svc", file=log_file)
    log = logging.getLogger("test.secrets")
    log.warning("connecting with key %s to %s", SECRET, "nats://u:pw123456@h:1")
    try:
        raise RuntimeError(f"boom {SECRET}")
    except RuntimeError:
        log.exception("failed")
    for h in logging.getLogger().handlers:
        h.flush()
    text = log_file.read_text()
    assert SECRET not in text
    assert "pw123456" not in text
    assert MASK in text
    assert log_file.stat().st_mode & 0o077 == 0  # owner only


def test_dry_run_toml_masks_url_passwords() -> None:
    cfg = load_config(
        ServiceConfig,
        ["--nats.url", f"nats://u:{SECRET}@h:4222", "--object_store.secret_key", SECRET],
        environ={},
    )
    text = to_toml(cfg)
    assert SECRET not in text
    assert f"nats://u:{MASK}@h:4222" in text
    assert SECRET in to_toml(cfg, reveal_secrets=True)


def test_config_error_never_echoes_a_secret_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(ServiceConfig, ["--object_store.secret_key", "[1, 2]"], environ={})
    assert "object_store.secret_key" in str(err.value)
    with pytest.raises(ConfigError) as err2:
        load_config(ServiceConfig, ["--nats.connect_timeout_s", f"nats://u:{SECRET}@h"], environ={})
    assert SECRET not in str(err2.value)


def test_child_sources_put_secret_flags_in_the_environment() -> None:
    sources = split_argv(["@", "run.toml", "--run.name", "r", "--object_store.secret_key", SECRET,
                          "--nats.url", f"nats://u:{SECRET}@h:4222"])  # fmt: skip
    argv, env = child_sources(sources)
    assert SECRET not in " ".join(argv)
    assert argv == ["@", "run.toml", "--run.name", "r"]
    assert env == {
        "TREADLE_OBJECT_STORE__SECRET_KEY": SECRET,
        "TREADLE_NATS__URL": f"nats://u:{SECRET}@h:4222",
    }
    # the child reads them back as the same settings
    raw = gather(split_argv(argv[2:]), environ=env)
    assert raw.data["object_store"]["secret_key"] == SECRET
    assert raw.data["nats"]["url"] == f"nats://u:{SECRET}@h:4222"


@pytest.mark.parametrize(
    ("key", "secret"),
    [("object_store.secret_key", True), ("nats.password", True), ("control.token", True),
     ("control.token_file", True), ("inference.gate_token", True), ("x.api_key", True),
     ("x.credentials", True), ("env_runner.tokenizer", False),
     ("orchestrator.sampling.max_tokens", False), ("x.max_total_tokens", False),
     ("x.pad_token_id", False)],
)  # fmt: skip
def test_secret_keys_by_their_words_not_substrings(key: str, secret: bool) -> None:
    # a tokenizer path or max_tokens is no secret: hiding it in the environment and masking
    # it in logs only hid what a run used
    assert is_secret_key(key) is secret


def test_child_sources_keep_a_tokenizer_path_on_the_command_line() -> None:
    argv, env = child_sources(
        split_argv(
            ["--env_runner.tokenizer", "/models/m", "--orchestrator.sampling.max_tokens", "8"]
        )
    )
    assert argv == [
        "--env_runner.tokenizer",
        "/models/m",
        "--orchestrator.sampling.max_tokens",
        "8",
    ]
    assert env == {}


def test_nats_permissions_only_the_trainer_publishes_policy_only_orchestrator_batches() -> None:
    policy = "treadle.r.policy.published"
    batches = "treadle.r.batches.*"
    for role in ("inference", "trainer", "orchestrator", "env_runner", "admin"):
        pub = permissions("r", role).publish
        assert (policy in pub) == (role == "trainer"), role
        assert (batches in pub) == (role == "orchestrator"), role
        assert not [p for p in pub if ".STREAM.DELETE." in p or p in (">", "$JS.API.>")], role
        assert not [s for s in permissions("r", role).subscribe if s in (">", "_INBOX.>")], role
