"""Trainer checkpoints: ``torch.distributed.checkpoint`` to a local folder, published to
the object store, and restored from the newest complete one.

Layout (local ``<checkpoint_dir>/step<N:06d>/`` and store ``checkpoints/trainer/step<N:06d>/``)::

    .metadata, __<rank>_0.distcp      DCP: {"model": weights, "optimizer": flat optimizer state,
                                            "lr_scheduler": {"last_epoch"}, "train_state": {"step"}}
    rng/rank<r>.pt                    torch CPU (+ CUDA) and Python RNG states of rank r
    MANIFEST.json                     written last by publish_dir; metadata: step, policy_version,
                                      world_size, family, base_model, format "torch-dcp/1"

A folder without MANIFEST.json is an unfinished publication and is skipped on restore.
Under torchrun every rank uploads the files it wrote (``__<r>_*.distcp``, ``rng/rank<r>.pt``;
rank 0 the rest), so nodes need no shared filesystem; rank 0 writes the manifest once
every rank's upload is done. On restore each node's local rank 0 downloads the whole
checkpoint; DCP reshards it to the job's world size (a checkpoint of 2 ranks resumes on
1 and the reverse); a rank without an RNG file of its own keeps its seeded RNG state.
Not here: when to checkpoint (the service), purging batches (the service).
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from treadle.proto.v1 import common_pb2
from treadle.services.errors import IntegrityError, ObjectNotFoundError
from treadle.services.objectstore import (
    MANIFEST_MEDIA_TYPE,
    MANIFEST_NAME,
    Manifest,
    ManifestEntry,
    ObjectStore,
)
from treadle.trainer.distributed import Topology, all_gather_json, barrier
from treadle.trainer.errors import CheckpointError

log = logging.getLogger(__name__)

STORE_PREFIX = "checkpoints/trainer"
FORMAT = "torch-dcp/1"
_STEP_DIR = re.compile(rf"^{STORE_PREFIX}/step(\d{{6,}})/")
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng/rank(\d+)\.pt)$")


def step_dir_name(step: int) -> str:
    return f"step{step:06d}"


def store_prefix(step: int) -> str:
    return f"{STORE_PREFIX}/{step_dir_name(step)}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_local(folder: Path, state: dict[str, Any], topology: Topology) -> None:
    """Write ``state`` with DCP (every rank) and this rank's RNG states into ``folder``."""
    if topology.local_rank == 0 and folder.exists():  # one per node (a shared one: harmless)
        shutil.rmtree(folder, ignore_errors=True)
    barrier(topology)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, checkpoint_id=str(folder))
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), folder / "rng" / f"rank{topology.rank}.pt")
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot write checkpoint {folder}: {e}") from None
    barrier(topology)


def load_local(folder: Path, state: dict[str, Any], topology: Topology) -> None:
    """Fill ``state`` in place from the DCP checkpoint in ``folder``; restore RNG states."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=str(folder))
        rng_path = folder / "rng" / f"rank{topology.rank}.pt"
        if rng_path.is_file():
            set_rng_state(torch.load(rng_path, weights_only=True))
        else:  # written by fewer ranks than this job has
            log.info("[startup] %s has no RNG state of rank %d: it keeps its seeded one",
                     folder, topology.rank)  # fmt: skip
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"cannot load checkpoint {folder}: {e}") from None


def owner(rel: str) -> int:
    """The rank that wrote (and uploads) checkpoint file ``rel``."""
    m = _RANK_FILE.match(rel)
    return int(m.group(1) or m.group(2)) if m else 0


def publish(
    store: ObjectStore,
    folder: Path,
    step: int,
    metadata: Mapping[str, Any],
    topology: Topology | None = None,
) -> common_pb2.ObjectRef | None:
    """Upload ``folder`` under ``checkpoints/trainer/step<N>`` (manifest last). Every rank
    calls it and uploads its own files; rank 0 returns the manifest's ref."""
    topology = topology or Topology()
    prefix = store_prefix(step)
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    mine = []
    for rel, path in files.items():
        if owner(rel) == topology.rank:
            ref = store.put_file(f"{prefix}/{rel}", path)
            mine.append([rel, ref.sha256, ref.size_bytes])
    everyone = all_gather_json(mine, topology)  # waits for every rank's uploads
    if not topology.is_main:
        return None
    entries = sorted(
        (ManifestEntry(rel, sha, int(n)) for part in everyone for rel, sha, n in part),
        key=lambda e: e.path,
    )
    manifest = Manifest(prefix, tuple(entries), {"step": step, "format": FORMAT, **metadata},
                        time.time())  # fmt: skip
    return store.put_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.to_json(), MANIFEST_MEDIA_TYPE)


def published_steps(store: ObjectStore) -> list[int]:
    """Steps with any object under ``checkpoints/trainer/``, newest first."""
    steps = set()
    for obj in store.list(STORE_PREFIX + "/"):
        m = _STEP_DIR.match(obj.key)
        if m:
            steps.add(int(m.group(1)))
    return sorted(steps, reverse=True)


def fetch_newest(
    store: ObjectStore, dest_root: Path, folder_name: str = "restore-{}"
) -> tuple[int, Path] | None:
    """Download the newest complete checkpoint into ``dest_root/restore-step<N>``
    (``folder_name`` formatted with ``step<N>``).

    Checkpoints without a manifest (publication did not finish) or whose files fail
    their sha256 are skipped with a warning, falling back to older ones."""
    for step in published_steps(store):
        prefix = store_prefix(step)
        dest = dest_root / folder_name.format(step_dir_name(step))
        try:
            store.read_manifest(prefix)
            if dest.exists():
                shutil.rmtree(dest)
            store.fetch_dir(prefix, dest)
        except ObjectNotFoundError:
            log.warning(
                "[startup] checkpoint %s has no %s (its publication did not finish); "
                "falling back to an older one", prefix, MANIFEST_NAME,
            )  # fmt: skip
            continue
        except IntegrityError as e:
            log.warning("[startup] checkpoint %s is corrupt (%s); falling back", prefix, e)
            continue
        return step, dest
    return None


def prune_local(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` local step folders (and restore copies)."""
    if not root.is_dir():
        return
    for pattern in ("step*", "restore-step*"):
        dirs = sorted(p for p in root.glob(pattern) if p.is_dir())
        for old in dirs[: max(0, len(dirs) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
