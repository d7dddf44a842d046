"""The protobuf contracts: generated code is fresh, and the .proto files keep the rules
of DESIGN.md section 4 (documented fields, shapes on arrays, UNSPECIFIED = 0)."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from testkit.paths import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "proto"


def test_contracts_generated_code_matches_a_fresh_regeneration() -> None:
    proc = subprocess.run(
        [sys.executable, str(PROTO_ROOT / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("fds") / "v1.pb"
    sources = sorted(
        str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "treadle/proto/v1").glob("*.proto")
    )
    code = protoc.main(
        [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{importlib.resources.files('grpc_tools') / '_proto'}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            *sources,
        ]
    )
    assert code == 0
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(Path(out).read_bytes())
    return fds


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {
        tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
        for loc in file.source_code_info.location
    }


def _walk_messages(
    messages: list[descriptor_pb2.DescriptorProto], path: tuple[int, ...]
) -> list[tuple[descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
    out = []
    for i, msg in enumerate(messages):
        here = (*path, i)
        out.append((msg, here))
        out += _walk_messages(list(msg.nested_type), (*here, 3))  # 3 = DescriptorProto.nested_type
    return out


def test_contracts_every_field_is_documented(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> None:
    undocumented = []
    arrays_without_shape = []
    for file in descriptor_set.file:
        comments = _comments(file)
        for msg, path in _walk_messages(
            list(file.message_type), (4,)
        ):  # 4 = FileDescriptorProto.message_type
            if msg.options.map_entry:
                continue
            for j, fld in enumerate(msg.field):
                text = comments.get((*path, 2, j), "")  # 2 = DescriptorProto.field
                name = f"{file.name}:{msg.name}.{fld.name}"
                if fld.type == fld.TYPE_MESSAGE and fld.type_name.endswith(".TokenArray"):
                    if "[" not in text:
                        arrays_without_shape.append(name)
                elif not text and fld.type != fld.TYPE_MESSAGE:
                    undocumented.append(name)
    assert not undocumented, f"fields without a comment: {undocumented}"
    assert not arrays_without_shape, (
        f"TokenArray fields without a [shape] comment: {arrays_without_shape}"
    )


def test_contracts_enums_start_with_unspecified(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> None:
    enums = []
    for file in descriptor_set.file:
        enums += list(file.enum_type)
        for msg, _ in _walk_messages(list(file.message_type), (4,)):
            enums += list(msg.enum_type)
    bad = [
        e.name
        for e in enums
        if e.value[0].number != 0 or not e.value[0].name.endswith("_UNSPECIFIED")
    ]
    assert enums
    assert not bad, f"enums whose zero value is not *_UNSPECIFIED: {bad}"


def test_contracts_every_service_has_get_status(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> None:
    """Each service's control plane has GetStatus; HostedRuns (served beside a hosted
    trainer's and inference's control plane) and Platform (its ListRuns) are the others."""
    services = {s.name: s for f in descriptor_set.file for s in f.service}
    control = {"InferenceAdmin", "TrainerControl", "EnvRunnerControl", "OrchestratorControl"}
    assert set(services) == {*control, "HostedRuns", "Platform"}
    list_runs = next(m for m in services["Platform"].method if m.name == "ListRuns")
    assert list_runs.options.idempotency_level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS
    for svc in (services[name] for name in control):
        get_status = next(m for m in svc.method if m.name == "GetStatus")
        assert get_status.options.idempotency_level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS
