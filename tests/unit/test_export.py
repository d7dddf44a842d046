"""`treadle export`: a run's published policy of one step as a model folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.services.cli import main
from treadle.services.errors import ConfigError, IntegrityError, TreadleError
from treadle.services.export import export_run_policy, policy_prefix, published_versions
from treadle.services.objectstore import LocalObjectStore


def publish(store: LocalObjectStore, version: int, fmt: str = "hf-safetensors") -> None:
    """What the trainer publishes each step, in miniature (the weights name the version)."""
    files = {
        "config.json": json.dumps({"model_type": "qwen3"}).encode(),
        "model.safetensors": f"weights of step {version}".encode(),
    }
    store.publish_dir(policy_prefix(version), files, metadata={"format": fmt})


@pytest.fixture
def run(tmp_path: Path) -> tuple[LocalObjectStore, Path]:
    """A run folder (outputs/r) whose store holds versions 1-3 and 5, and its base model."""
    store = LocalObjectStore(tmp_path / "outputs" / "r" / "store")
    for v in (1, 2, 3, 5):
        publish(store, v)
    store.put_bytes(f"{policy_prefix(6)}/model.safetensors", b"half")  # publication unfinished
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / "model.safetensors").write_text("the base's weights: never copied")
    return store, base


def test_a_step_is_exported_with_the_bases_tokenizer_files(
    run: tuple[LocalObjectStore, Path], tmp_path: Path
) -> None:
    store, base = run
    assert published_versions(store) == [1, 2, 3, 5]  # v6 has no manifest yet
    version, fmt = export_run_policy(store, 2, base, tmp_path / "m2")
    assert (version, fmt) == (2, "hf-safetensors")
    got = {p.name: p.read_text() for p in (tmp_path / "m2").iterdir()}
    assert got == {
        "config.json": '{"model_type": "qwen3"}',
        "model.safetensors": "weights of step 2",
        "tokenizer.json": "{}",
        "chat_template.jinja": "{{ messages }}",
    }
    newest, _ = export_run_policy(store, None, base, tmp_path / "newest")
    assert newest == 5
    assert (tmp_path / "newest" / "model.safetensors").read_text() == "weights of step 5"


def test_missing_versions_and_occupied_folders_are_refused_naming_what_exists(
    run: tuple[LocalObjectStore, Path], tmp_path: Path
) -> None:
    store, base = run
    with pytest.raises(TreadleError, match=r"version 4 is not in .*published: 1-3, 5$"):
        export_run_policy(store, 4, base, tmp_path / "m")
    with pytest.raises(TreadleError, match="version 6 is not in"):  # unfinished publication
        export_run_policy(store, 6, base, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_run_policy(store, 1, base, occupied)
    assert (occupied / "keep.txt").read_text() == "mine"
    with pytest.raises(TreadleError, match="holds no published policy"):
        export_run_policy(LocalObjectStore(tmp_path / "empty"), None, base, tmp_path / "m")


def test_a_tampered_weights_file_is_never_exported(
    run: tuple[LocalObjectStore, Path], tmp_path: Path
) -> None:
    store, base = run
    (store.root / policy_prefix(3) / "model.safetensors").write_bytes(b"weights of step 9")
    with pytest.raises(IntegrityError):
        export_run_policy(store, 3, base, tmp_path / "m3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "outputs"]  # no half folder


def test_the_cli_exports_the_configured_runs_step(
    run: tuple[LocalObjectStore, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, base = run
    out = tmp_path / "m3"
    flags = ["--run.output_dir", str(tmp_path / "outputs"), "--run.name", "r"]
    code = main(["export", "--out", str(out), "--step", "3", *flags,
                 "--trainer.model", str(base)])  # fmt: skip
    assert code == 0
    assert "policy version 3 of run r exported to" in capsys.readouterr().out
    assert (out / "model.safetensors").read_text() == "weights of step 3"
    assert (out / "tokenizer.json").exists()

    assert main(["export", "--out", str(tmp_path / "d"), *flags, "--dry-run"]) == 0
    assert "policy versions 1-3, 5 published" in capsys.readouterr().out
    assert not (tmp_path / "d").exists()

    assert main(["export", "--out", str(tmp_path / "x"), *flags[:2], "--run.name", "other"]) == 2
    assert "is not a run's store" in capsys.readouterr().err
    assert main(["export", "--out", str(tmp_path / "x"), "--step", "0", *flags]) == 2
    assert "--step must be 1 or more" in capsys.readouterr().err
