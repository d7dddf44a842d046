"""The object store contract, on both backends: a local directory and a real S3 server
(SeaweedFS, signatures checked)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from testkit.seaweed import SeaweedS3
from treadle.proto.v1 import common_pb2
from treadle.services.errors import IntegrityError, ObjectNotFoundError, StoreUnavailableError
from treadle.services.objectstore import (
    MANIFEST_NAME,
    LocalObjectStore,
    ObjectStore,
    S3ObjectStore,
    open_store,
)
from treadle.services.sections import ObjectStoreSection

pytestmark = pytest.mark.integration


def s3_section(server: SeaweedS3, **overrides: object) -> ObjectStoreSection:
    fields: dict[str, object] = {
        "backend": "s3",
        "endpoint": server.endpoint,
        "access_key": server.access_key,
        "secret_key": SecretStr(server.secret_key),
        "bucket": "treadle-tests",
    }
    fields.update(overrides)
    return ObjectStoreSection(**fields)  # type: ignore[arg-type]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(tmp_path / "store")
    else:
        server: SeaweedS3 = request.getfixturevalue("s3_server")
        # a fresh prefix per test keeps tests independent inside one bucket
        yield open_store(s3_section(server, prefix=f"t{time.monotonic_ns()}/"), "run", tmp_path)


def test_store_round_trip_with_integrity_data(store: ObjectStore) -> None:
    ref = store.put_bytes("a/b/c.bin", b"hello world", "application/octet-stream")
    assert ref.size_bytes == 11
    assert ref.sha256 == "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9"
    assert store.key_of(ref.uri) == "a/b/c.bin"
    assert store.get_bytes(ref) == b"hello world"
    assert store.get_bytes("a/b/c.bin") == b"hello world"
    assert store.exists("a/b/c.bin")
    assert not store.exists("a/b/missing")


def test_store_rejects_bytes_that_do_not_match_the_ref(store: ObjectStore) -> None:
    ref = store.put_bytes("x/obj", b"original")
    wrong_sha = common_pb2.ObjectRef()
    wrong_sha.CopyFrom(ref)
    wrong_sha.sha256 = "0" * 64
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_bytes(wrong_sha)
    store.put_bytes("x/obj", b"replaced")  # same size, other bytes
    with pytest.raises(IntegrityError, match="refusing to use it"):
        store.get_bytes(ref)


def test_store_missing_object(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError, match="object not found"):
        store.get_bytes("no/such/key")


def test_store_lists_by_prefix(store: ObjectStore) -> None:
    for key in ("p/2", "p/1", "q/1", "p/sub/3"):
        store.put_bytes(key, key.encode())
    assert [o.key for o in store.list("p/")] == ["p/1", "p/2", "p/sub/3"]
    assert [o.size_bytes for o in store.list("q/")] == [3]
    assert [o.key for o in store.list("p/s")] == ["p/sub/3"]  # a prefix ends mid-name
    assert [o.key for o in store.list("p/sub/")] == ["p/sub/3"]
    assert store.list("p/2/") == store.list("absent/") == store.list("absent/deeper/") == []
    store.delete("p/1")
    assert [o.key for o in store.list("p/")] == ["p/2", "p/sub/3"]


def test_store_streams_files(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(bytes(range(256)) * 12_000)  # ~3 MB, several chunks
    ref = store.put_file("files/big.bin", src)
    dest = store.get_file(ref, tmp_path / "out" / "big.bin")
    assert dest.read_bytes() == src.read_bytes()


def test_store_publish_dir_manifest_last_and_verified_fetch(
    store: ObjectStore, tmp_path: Path
) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"w" * 1000)
    ref = store.publish_dir(
        "policies/v3", {"model.safetensors": weights, "config.json": b"{}"}, {"policy_version": 3}
    )
    assert ref.uri.endswith(f"policies/v3/{MANIFEST_NAME}")
    manifest = store.read_manifest(ref)
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors"]
    assert manifest.metadata == {"policy_version": 3}
    out = tmp_path / "fetched"
    store.fetch_dir(ref, out)
    assert (out / "model.safetensors").read_bytes() == b"w" * 1000
    assert (out / "config.json").read_bytes() == b"{}"


def test_store_failed_publish_leaves_no_manifest(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        store.publish_dir(
            "policies/v4", {"a.bin": b"first file lands", "b.bin": tmp_path / "does-not-exist"}
        )
    with pytest.raises(ObjectNotFoundError, match="publication did not finish"):
        store.read_manifest("policies/v4")


def test_store_fetch_dir_refuses_a_corrupted_file(store: ObjectStore, tmp_path: Path) -> None:
    ref = store.publish_dir("ckpt/1", {"state.bin": b"good state"})
    store.put_bytes("ckpt/1/state.bin", b"evil state")
    out = tmp_path / "restore"
    with pytest.raises(IntegrityError):
        store.fetch_dir(ref, out)
    assert not (out / "state.bin").exists()
    assert not [p for p in out.rglob("*") if p.is_file()]  # no partial file left behind


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_store_rejects_unsafe_keys(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        store.put_bytes(key, b"x")


def test_s3_wrong_secret_is_rejected_by_the_server(s3_server: SeaweedS3, tmp_path: Path) -> None:
    cfg = s3_section(s3_server, secret_key=SecretStr("not-the-secret"))
    with pytest.raises(
        StoreUnavailableError, match=r"rejected .*SignatureDoesNotMatch.*secret_key"
    ):
        open_store(cfg, "run", tmp_path)


def test_s3_unknown_access_key_is_rejected(s3_server: SeaweedS3, tmp_path: Path) -> None:
    cfg = s3_section(s3_server, access_key="nobody")
    with pytest.raises(StoreUnavailableError, match=r"rejected .*access_key"):
        open_store(cfg, "run", tmp_path)


def test_s3_unreachable_endpoint_fails_fast(free_port: int, tmp_path: Path) -> None:
    cfg = ObjectStoreSection(
        backend="s3",
        endpoint=f"127.0.0.1:{free_port}",
        access_key="a",
        secret_key=SecretStr("b"),
        max_retries=0,
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"cannot reach S3 at 127.0.0.1:\d+"):
        open_store(cfg, "run", tmp_path)
    assert time.monotonic() - started < 10


def test_s3_missing_bucket_without_autocreate(s3_server: SeaweedS3, tmp_path: Path) -> None:
    cfg = s3_section(s3_server, bucket="never-created", create_bucket=False)
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        open_store(cfg, "run", tmp_path)


def test_s3_services_racing_to_create_the_bucket_all_start(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # services started together all see the bucket missing; the ones that lose the race to
    # create it get BucketAlreadyOwnedByYou from the server, which must not stop them
    bucket = f"race-{time.monotonic_ns()}"
    stores = [S3ObjectStore(s3_section(s3_server, bucket=bucket), f"svc{i}/") for i in range(3)]
    for s in stores:  # every one looked before any created it
        monkeypatch.setattr(s._client, "bucket_exists", lambda _b: False)
    for s in stores:
        s.check()
    for i, s in enumerate(stores):
        ref = s.put_bytes("k", f"from {i}".encode())
        assert s.get_bytes(ref) == f"from {i}".encode()


def test_s3_keys_are_scoped_by_run_prefix(s3_server: SeaweedS3, tmp_path: Path) -> None:
    a = open_store(s3_section(s3_server), "run-a", tmp_path)
    b = open_store(s3_section(s3_server), "run-b", tmp_path)
    assert isinstance(a, S3ObjectStore)
    ref = a.put_bytes("same/key", b"from a")
    assert ref.uri == "s3://treadle-tests/run-a/same/key"
    assert not b.exists("same/key")


def test_a_local_store_s_objects_are_its_writer_s_unless_shared_read(tmp_path: Path) -> None:
    """0600 by default; object_store.shared_read: 0644 (the platform's runs, whose env
    runner reads the trainer's manifests as another uid)."""
    for shared, mode in ((False, 0o600), (True, 0o644)):
        cfg = ObjectStoreSection(root=tmp_path / f"store-{shared}", shared_read=shared)
        store = open_store(cfg, "run", tmp_path)
        store.put_bytes("a/b", b"x")
        store.put_file("c", _file(tmp_path / "f", b"y"))
        for key in ("a/b", "c"):
            assert (tmp_path / f"store-{shared}" / key).stat().st_mode & 0o777 == mode, key


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
