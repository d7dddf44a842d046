"""Which services exist and how to start them, discovered through entry points.

Each service distribution registers a ``ServiceSpec`` under the entry-point group
``treadle.services`` (e.g. ``trainer = "treadle.trainer.spec:SPEC"``). The chassis never
imports a service package by name, so the dependency direction stays
``services <- {env_runner, orchestrator, inference, trainer}``, and a machine that
installs only the env runner knows only the env runner.

A spec module must stay light: config classes and names only, no torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from google.protobuf.descriptor import ServiceDescriptor

from treadle.services.errors import ConfigError, ServiceUnavailableError
from treadle.services.sections import SHARED_SECTIONS, GrpcSection, ServiceConfig

ENTRY_POINT_GROUP = "treadle.services"

# every service of DESIGN.md, and the distribution that provides it
KNOWN_SERVICES = {
    "inference": "treadle-inference",
    "trainer": "treadle-trainer",
    "orchestrator": "treadle-orchestrator",
    "env_runner": "treadle-env-runner",
}
LAUNCHER_SECTION = "launcher"


@dataclass(frozen=True)
class ServiceSpec:
    """How the chassis runs one service."""

    name: str  # also its config section, e.g. "trainer"
    summary: str  # one line for --help and tables
    config_cls: type[ServiceConfig]  # the service's one config class
    module: str  # `python -m <module>` runs the service
    control: ServiceDescriptor  # its gRPC control service (health is reported per service too)
    stub: type[Any]  # generated stub class of `control`

    def grpc_section(self, config: ServiceConfig) -> GrpcSection:
        section = getattr(config, self.name)
        grpc: GrpcSection = section.grpc
        return grpc


def installed_services() -> dict[str, ServiceSpec]:
    """Installed services by name, in DESIGN order (inference first, env runners last)."""
    found: dict[str, ServiceSpec] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        spec = ep.load()
        if not isinstance(spec, ServiceSpec) or spec.name != ep.name:
            raise ServiceUnavailableError(
                f"entry point {ep.value} ({ep.name}) is not a ServiceSpec named {ep.name!r}"
            )
        found[ep.name] = spec
    order = list(KNOWN_SERVICES)
    return dict(
        sorted(found.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    )


def get_service(name: str) -> ServiceSpec:
    """The installed service ``name``, or an error that says what to install."""
    services = installed_services()
    if name in services:
        return services[name]
    if name in KNOWN_SERVICES:
        raise ServiceUnavailableError(
            f"service {name!r} is not installed: `pip install {KNOWN_SERVICES[name]}` "
            "(or `make setup` in a source checkout)"
        )
    raise ConfigError(f"unknown service {name!r}; services are: {', '.join(KNOWN_SERVICES)}")


EVAL_SECTION = "eval"
SFT_DATA_SECTION = "sft_data"


def known_sections() -> set[str]:
    """Every top-level section a run file may contain ([eval] is read by `treadle eval`,
    [sft_data] by `treadle sft-data` and `treadle sft`)."""
    return {*SHARED_SECTIONS, LAUNCHER_SECTION, EVAL_SECTION, SFT_DATA_SECTION, *KNOWN_SERVICES}
