"""`launcher.inference_replicas`: the wiring hands env runners every replica's URL and the
orchestrator every replica's control address, and the configs read them back as lists;
conflicting or malformed replica settings are one config error."""

from __future__ import annotations

import pytest

from treadle.env_runner.spec import SPEC as ENV_RUNNER
from treadle.orchestrator.spec import SPEC as ORCHESTRATOR
from treadle.services.config import split_argv
from treadle.services.errors import ConfigError
from treadle.services.host import load_service_config
from treadle.services.launcher import _wiring, resolve

URLS = ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
TARGETS = ["127.0.0.1:50101", "127.0.0.1:50102"]


def child_config(spec: object, ports: dict[str, object], *extra: str) -> object:
    cfg, _ = load_service_config(spec, [*extra, *_wiring(spec, "rl", ports)])  # type: ignore[arg-type]
    return cfg


def test_wiring_hands_every_replica_to_env_runners_and_the_orchestrator() -> None:
    ports = {"inference_urls": URLS, "inference_grpcs": TARGETS}
    runner = child_config(ENV_RUNNER, ports)
    assert runner.env_runner.replica_urls == URLS  # type: ignore[attr-defined]
    orch = child_config(ORCHESTRATOR, ports)
    assert orch.orchestrator.inference_grpc == TARGETS  # type: ignore[attr-defined]


def test_wiring_of_one_replica_is_the_single_url() -> None:
    ports = {"inference_urls": URLS[:1], "inference_grpcs": TARGETS[:1]}
    runner = child_config(ENV_RUNNER, ports)
    assert runner.env_runner.inference_url == URLS[0]  # type: ignore[attr-defined]
    assert runner.env_runner.inference_urls == []  # type: ignore[attr-defined]
    assert runner.env_runner.replica_urls == URLS[:1]  # type: ignore[attr-defined]
    orch = child_config(ORCHESTRATOR, ports)
    assert orch.orchestrator.inference_grpc == TARGETS[:1]  # type: ignore[attr-defined]
    # a string (the way a single replica was always given) is a list of one
    orch = child_config(ORCHESTRATOR, {}, "--orchestrator.inference_grpc", "inference:50061")
    assert orch.orchestrator.inference_grpc == ["inference:50061"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env_runner.inference_url", URLS[0], "--env_runner.inference_urls", f'["{URLS[1]}"]'],
         "not both"),
        (["--env_runner.inference_urls", f'["{URLS[0]}", "{URLS[0]}/"]'], "repeats"),
        (["--env_runner.inference_urls", '["127.0.0.1:8000"]'], "not an http"),
    ],
)  # fmt: skip
def test_env_runner_refuses_conflicting_replica_settings(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_service_config(ENV_RUNNER, argv)


def test_launcher_refuses_zero_replicas() -> None:
    with pytest.raises(ConfigError, match="inference_replicas"):
        resolve(split_argv(["--launcher.inference_replicas", "0"]))


def test_discovery_lists_only_what_was_set_and_builds_a_pool() -> None:
    from types import SimpleNamespace

    from treadle.env_runner.service import inference_generator
    from treadle.services.inference_pool import InferencePool

    cfg, _ = load_service_config(ENV_RUNNER, ["--env_runner.inference_discovery", "true"])
    section = cfg.env_runner  # type: ignore[attr-defined]
    assert section.replica_urls == []  # the default URL is not a replica with discovery
    pool = inference_generator(section, SimpleNamespace(bus=object(), store=None))  # type: ignore[arg-type]
    assert isinstance(pool, InferencePool)
    assert pool.replicas == []
    assert pool.discover is not None
    cfg, _ = load_service_config(ENV_RUNNER, ["--env_runner.inference_discovery", "true",
                                              "--env_runner.inference_url", URLS[0]])  # fmt: skip
    assert cfg.env_runner.replica_urls == URLS[:1]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs the service's NATS connection"):
        inference_generator(section, None)
