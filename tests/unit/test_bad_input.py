"""Bad input gets a clear error, never a traceback or a silent wrong value (design
invariant 6): task files, metrics.jsonl, object-store refs and symlinks, rollout requests,
the rollout sanity checks, nats.url and run.output_dir."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from treadle.env_runner.service import request_problem
from treadle.orchestrator.samples import InvalidRollout, checked_samples
from treadle.orchestrator.tasks import load_tasks
from treadle.proto.v1 import common_pb2, metrics_pb2, rollout_pb2
from treadle.services.bus import Bus
from treadle.services.cli import main as cli
from treadle.services.codecs import to_token_array
from treadle.services.config import load_config
from treadle.services.errors import (
    BusUnavailableError,
    ConfigError,
    IntegrityError,
    StoreUnavailableError,
)
from treadle.services.objectstore import LocalObjectStore
from treadle.services.progress import Progress
from treadle.services.sections import NatsSection, ServiceConfig, nats_address


def test_load_tasks_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_tasks(tmp_path)


def test_load_tasks_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_tasks(path)


def test_load_tasks_deeply_nested_json_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_tasks(path)


def test_progress_writes_non_finite_metrics_as_null(tmp_path: Path) -> None:
    progress = Progress(tmp_path / "metrics.jsonl", "rl", None)
    progress.record(metrics_pb2.MetricsReport(
        service="trainer", step=1, values={"loss": math.nan, "grad_norm": math.inf, "lr": 0.5}
    ))  # fmt: skip
    progress.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert row["loss"] is None
    assert row["grad_norm"] is None
    assert row["lr"] == 0.5


def test_local_store_refuses_symlinks_out_of_its_root(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    secret = tmp_path / "secret"
    secret.write_text("do not read")
    (store.root / "claims").mkdir()
    (store.root / "claims" / "link").symlink_to(secret)
    (store.root / "dir").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="symlink"):
        store.get_bytes("claims/link")
    with pytest.raises(ValueError, match="symlink"):
        store.get_bytes("dir/secret")
    with pytest.raises(ValueError, match="symlink"):
        store.put_bytes("dir/planted", b"x")
    assert not (tmp_path / "planted").exists()


def test_local_store_lists_no_symlink(tmp_path: Path) -> None:
    """A symlink planted in the store is not an object: list() neither shows it nor
    reports the size of what it points to (nor descends a linked folder)."""
    store = LocalObjectStore(tmp_path / "store")
    (tmp_path / "secret").write_text("x" * 1234)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text("y")
    store.put_bytes("ckpt/a", b"ok")
    (store.root / "ckpt" / "link").symlink_to(tmp_path / "secret")
    (store.root / "ckpt" / "dir").symlink_to(tmp_path / "outside")
    assert [(o.key, o.size_bytes) for o in store.list()] == [("ckpt/a", 2)]
    assert [o.key for o in store.list("ckpt/")] == ["ckpt/a"]
    assert store.list("ckpt/dir/") == store.list("ckpt/link/") == []  # named, still not walked


def test_local_store_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailableError, match="is a file"):
        LocalObjectStore(tmp_path / "file" / "store")


def test_local_store_refuses_a_ref_without_sha256(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    ref = store.put_bytes("a/b", b"payload")
    unchecked = common_pb2.ObjectRef(uri=ref.uri, size_bytes=ref.size_bytes)
    with pytest.raises(IntegrityError, match="no valid sha256"):
        store.get_bytes(unchecked)
    with pytest.raises(IntegrityError, match="no valid sha256"):
        store.get_file(unchecked, tmp_path / "out")
    assert store.get_bytes(ref) == b"payload"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", math.nan, "temperature"),
        ("temperature", -1.0, "temperature"),
        ("top_p", math.inf, "top_p"),
        ("top_p", 2.0, "top_p"),
        ("top_k", -3, "top_k"),
        ("max_tokens", -1, "max_tokens"),
    ],
)
def test_request_problem_names_the_bad_sampling_field(
    field: str, value: float, message: str
) -> None:
    req = rollout_pb2.RolloutRequested(rollout_id="r", env="e")
    setattr(req.sampling, field, value)
    assert message in request_problem(req)


def test_request_problem_accepts_defaults() -> None:
    assert request_problem(rollout_pb2.RolloutRequested(rollout_id="r", env="e")) == ""


def _rollout(ids: list[int], versions: int = 0, mask: int = 1) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(rollout_id="r", reward=1.0)
    n = r.nodes.add(node_id=0, parent_id=-1)
    k = len(ids)
    n.token_ids.CopyFrom(to_token_array(np.array(ids, np.int64).astype(np.int32)))
    n.sampled_mask.CopyFrom(to_token_array(np.full(k, mask, np.uint8)))
    n.logprobs.CopyFrom(to_token_array(np.full(k, -1.0, np.float32)))
    n.policy_versions.CopyFrom(to_token_array(np.full(k, versions, np.int32)))
    return r


def test_checked_samples_refuses_forged_rollouts() -> None:
    ok = checked_samples(_rollout([1, 2]), max_policy_version=0, vocab_size=10)
    assert [s.num_tokens for s in ok] == [2]
    for bad, match in [
        (_rollout([-5, 1]), "outside the vocabulary"),
        (_rollout([2_000_000_000]), "outside the vocabulary"),
        (_rollout([1], versions=7), "policy versions"),
        (_rollout([1], mask=3), "sampled_mask"),
    ]:
        with pytest.raises(InvalidRollout, match=match):
            checked_samples(bad, max_policy_version=0, vocab_size=10)
    nan_reward = _rollout([1])
    nan_reward.reward = math.nan
    with pytest.raises(InvalidRollout, match="reward"):
        checked_samples(nan_reward, max_policy_version=0, vocab_size=10)
    short = _rollout([1, 2])
    short.nodes[0].logprobs.CopyFrom(to_token_array(np.zeros(1, np.float32)))
    with pytest.raises(InvalidRollout, match="expected 2 elements"):
        checked_samples(short, max_policy_version=0, vocab_size=None)


BAD_NATS_URLS = [
    ("nats://127.0.0.1:99999", "port"),
    ("nats://127.0.0.1:abc", "port"),
    ("nats://127.0.0.1:0", "port"),
    ("nats://127.0.0.1:-1", "port"),
    ("foo:bar", "port"),
    ("nats://[::1", "not a URL"),
    ("nats://:4222", "no host"),
    ("http://127.0.0.1:4222", "scheme"),
    ("nats://a:4222,nats://b:4222", "one server URL"),
    ("nats://127.0.0.1:4222 ", "whitespace"),
    ("", "no host"),
]


@pytest.mark.parametrize(("url", "why"), BAD_NATS_URLS)
def test_nats_url_malformed_is_one_config_problem_naming_it(url: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(ServiceConfig, ["--nats.url", url])
    problems = str(e.value).splitlines()[1:]
    assert len(problems) == 1
    assert problems[0].startswith("  - nats.url: ")
    assert why in problems[0]
    assert repr(url) in problems[0]
    assert "(set in flag --nats.url)" in problems[0]


def test_nats_url_malformed_hides_its_password() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(ServiceConfig, ["--nats.url", "nats://me:Sup3rSecret@host:99999"])
    assert "Sup3rSecret" not in str(e.value)
    assert "nats.url" in str(e.value)


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("nats://127.0.0.1:4222", ("127.0.0.1", 4222)),
        ("127.0.0.1:4223", ("127.0.0.1", 4223)),
        ("nats://localhost", ("localhost", 4222)),
        ("localhost", ("localhost", 4222)),
        ("tls://me:pw@nats.example.com:7422", ("nats.example.com", 7422)),
        ("nats://token@[::1]:4222", ("::1", 4222)),
        ("ws://127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("wss://nats.example.com", ("nats.example.com", 443)),
    ],
)
def test_nats_url_forms_of_one_server_are_accepted(url: str, address: tuple[str, int]) -> None:
    assert load_config(ServiceConfig, ["--nats.url", url]).nats.url == url
    assert nats_address(url) == address


def test_service_startup_with_a_bad_nats_url_is_a_config_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from treadle.orchestrator.__main__ import main as orchestrator

    assert orchestrator(["--nats.url", "nats://127.0.0.1:99999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treadle orchestrator: invalid configuration (1 problem)")
    assert "nats.url" in err
    assert "'nats://127.0.0.1:99999'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--dry-run"], ["--check"]])
def test_stack_with_a_bad_nats_url_is_a_config_error(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["stack", *args, "--nats.url", "nats://127.0.0.1:abc"]) == 2
    err = capsys.readouterr().err
    assert "nats.url" in err
    assert "'nats://127.0.0.1:abc'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--dry-run"], ["--check"]])
@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_stack_output_dir_under_a_file_is_a_config_error(
    tmp_path: Path, args: list[str], under: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    output_dir = tmp_path / under
    assert cli(["stack", *args, "--run.output_dir", str(output_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treadle: configuration error: run.output_dir")
    assert str(output_dir) in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("nats://127.0.0.1", ("127.0.0.1", 4222)),
        ("localhost", ("localhost", 4222)),
        ("nats://me:pw@[::1]:4333", ("::1", 4333)),
        ("wss://nats.example.com", ("nats.example.com", 443)),
    ],
)
def test_bus_connect_probes_the_host_and_port_of_any_valid_url(
    url: str, address: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL without a port (the scheme's default is meant) or with an IPv6 host reaches
    the "nothing listens there" check with the right address instead of crashing on its
    parsing (the probe is recorded, nothing is dialled)."""
    probed: list[tuple[str, int]] = []

    def probe(host: str, port: int, timeout_s: float) -> bool:
        probed.append((host, port))
        return False

    monkeypatch.setattr("treadle.services.bus.is_listening", probe)
    with pytest.raises(BusUnavailableError, match="cannot reach NATS"):
        asyncio.run(Bus.connect(NatsSection(url=url), "run"))
    assert probed == [address]
