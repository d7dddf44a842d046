"""Config loading: precedence, provenance in errors, flags, env vars, dry-run output."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field, SecretStr

from treadle.services.config import load_config, parse_value, split_argv, to_toml
from treadle.services.errors import ConfigError
from treadle.services.sections import ServiceConfig, StrictModel


class OptimSection(StrictModel):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])
    """Adam betas."""


class DemoSection(StrictModel):
    optim: OptimSection = Field(default_factory=OptimSection)
    steps: int = 10
    token: SecretStr | None = None


class DemoConfig(ServiceConfig):
    demo: DemoSection = Field(default_factory=DemoSection)


KNOWN = {"demo", "other"}


def load(argv: list[str], env: dict[str, str] | None = None) -> DemoConfig:
    return load_config(DemoConfig, argv, environ=env or {}, known_sections=KNOWN)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_config_defaults_without_sources() -> None:
    cfg = load([])
    assert cfg.demo.optim.lr == 1e-3
    assert cfg.run.name == "treadle"
    assert cfg.nats.url is None


def test_config_precedence_files_then_env_then_flags(tmp_path: Path) -> None:
    a = write(tmp_path, "a.toml", "[demo]\nsteps = 1\n[demo.optim]\nlr = 0.1\n")
    b = write(tmp_path, "b.toml", "[demo.optim]\nlr = 0.2\n")
    assert load(["@", str(a), str(b)]).demo.optim.lr == 0.2  # later file wins
    assert load(["@", str(a), str(b)]).demo.steps == 1  # merged, not replaced
    env = {"TREADLE_DEMO__OPTIM__LR": "0.3"}
    assert load(["@", str(a), str(b)], env).demo.optim.lr == 0.3  # env beats files
    assert load(["@", str(a), "--demo.optim.lr", "0.4"], env).demo.optim.lr == 0.4  # flags beat env


def test_config_flag_forms(tmp_path: Path) -> None:
    cfg = load(
        [f"@{write(tmp_path, 'a.toml', '')}", "--demo.steps=7", "--demo.optim.betas", "[0.5, 0.6]"]
    )
    assert cfg.demo.steps == 7
    assert cfg.demo.optim.betas == [0.5, 0.6]
    sources = split_argv(["@", "x.toml", "--nats.url", "nats://h:1", "--dry-run"])
    assert sources.files == [Path("x.toml")]
    assert sources.dry_run
    assert sources.overrides[0][:2] == ("nats.url", "nats://h:1")


def test_config_valueless_flag_means_true() -> None:
    assert split_argv(["--object_store.secure"]).overrides[0][1] == "true"


def test_config_parse_value_keeps_non_toml_strings() -> None:
    assert parse_value("1e-5") == 1e-5
    assert parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2]
    assert parse_value("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert parse_value("2024-01-01") == "2024-01-01"  # TOML date stays text


def test_config_unknown_key_names_key_file_and_suggestion(tmp_path: Path) -> None:
    f = write(tmp_path, "run.toml", "[demo.optim]\nlrr = 0.1\n")
    with pytest.raises(ConfigError) as e:
        load(["@", str(f)])
    msg = str(e.value)
    assert "demo.optim.lrr: unknown key" in msg
    assert str(f) in msg
    assert "did you mean 'demo.optim.lr'" in msg


def test_config_unknown_section_is_an_error(tmp_path: Path) -> None:
    f = write(tmp_path, "run.toml", "[dmeo]\nsteps = 3\n")
    with pytest.raises(
        ConfigError, match=r"dmeo: unknown section \(set in .*run.toml\); did you mean \[demo\]"
    ):
        load(["@", str(f)])


def test_config_other_services_sections_are_left_to_them(tmp_path: Path) -> None:
    f = write(tmp_path, "run.toml", "[other]\nwhatever = 1\n[demo]\nsteps = 2\n")
    assert load(["@", str(f)]).demo.steps == 2


def test_config_bad_value_names_env_var_and_value() -> None:
    with pytest.raises(ConfigError) as e:
        load([], {"TREADLE_DEMO__STEPS": "many"})
    assert "demo.steps" in str(e.value)
    assert "env TREADLE_DEMO__STEPS" in str(e.value)
    assert "'many'" in str(e.value)


def test_config_reports_every_problem_at_once(tmp_path: Path) -> None:
    f = write(tmp_path, "run.toml", "[demo]\nsteps = 'x'\nnope = 1\n")
    with pytest.raises(ConfigError, match=r"2 problems"):
        load(["@", str(f)])


def test_config_malformed_toml_names_file(tmp_path: Path) -> None:
    f = write(tmp_path, "broken.toml", "[demo\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"broken.toml: malformed TOML"):
        load(["@", str(f)])


def test_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.toml"):
        load(["@", str(tmp_path / "nope.toml")])


def test_config_stray_argument_is_explained() -> None:
    with pytest.raises(ConfigError, match=r"config files follow '@'"):
        load(["run.toml"])


def test_config_flag_into_scalar_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"flag --demo.steps.x: cannot set keys under 'demo.steps'"
    ):
        load(["--demo.steps", "3", "--demo.steps.x", "1"])


def test_config_s3_backend_requires_credentials() -> None:
    with pytest.raises(
        ConfigError,
        match=r"object_store.endpoint, object_store.access_key, object_store.secret_key",
    ):
        load(["--object_store.backend", "s3"])


def test_config_run_name_must_be_a_subject_token() -> None:
    with pytest.raises(ConfigError, match=r"run.name 'my run' must be"):
        load(["--run.name", "my run"])


def test_config_dry_run_toml_masks_secrets_and_round_trips(tmp_path: Path) -> None:
    cfg = load(["--demo.token", "s3cr3t", "--demo.steps", "5"])
    text = to_toml(cfg)
    assert "s3cr3t" not in text
    assert "**********" in text
    revealed = write(tmp_path, "resolved.toml", to_toml(cfg, reveal_secrets=True))
    again = load(["@", str(revealed)])
    assert again == cfg
