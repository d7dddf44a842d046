"""How much of a run the object store keeps: old policies and checkpoints are deleted as
training goes on, when the run asks for it (``trainer.keep_policies``,
``trainer.keep_checkpoints``; 0, the default, keeps everything).

    after a checkpoint ─▶ checkpoints/trainer/step<N>: the newest ``keep_checkpoints``
                          complete ones stay (an unfinished newer one does not count)
    after a policy     ─▶ policies/v<N>: the newest ``keep_policies`` stay, and each one
                          whose step still has a checkpoint in the store (a resume
                          republishes it; ``treadle export --step`` of that step needs it)

A directory goes manifest first (``ObjectStore.delete_dir``), so a reader sees it either
published and whole or not published; ``treadle export`` then lists what is left.
Rank 0 prunes; a store that fails meanwhile leaves the rest for the next step.

Not here: when to prune (the service), local checkpoint folders (``checkpoint.prune_local``).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

from treadle.services.errors import StoreUnavailableError
from treadle.services.export import POLICY_PREFIX, policy_prefix, step_spans
from treadle.services.objectstore import MANIFEST_NAME, ObjectInfo, ObjectStore
from treadle.trainer import checkpoint

log = logging.getLogger(__name__)

_POLICY_DIR = re.compile(rf"^{POLICY_PREFIX}/v(\d{{6,}})/")
_CHECKPOINT_DIR = re.compile(rf"^{checkpoint.STORE_PREFIX}/step(\d{{6,}})/")


def _by_step(objects: list[ObjectInfo], pattern: re.Pattern[str]) -> dict[int, list[ObjectInfo]]:
    """The objects of each step directory that ``pattern`` names."""
    out: dict[int, list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        if m := pattern.match(obj.key):
            out[int(m.group(1))].append(obj)
    return out


def _complete(objects: list[ObjectInfo]) -> bool:
    return any(o.key.endswith("/" + MANIFEST_NAME) for o in objects)


def _prune_checkpoints(store: ObjectStore, steps: dict[int, list[ObjectInfo]],
                       keep: int) -> list[int]:  # fmt: skip
    """Delete all but the newest ``keep`` complete checkpoints of ``steps`` (and unfinished
    ones older than those); returns the steps deleted. ``keep`` 0: nothing."""
    if keep <= 0:
        return []
    complete = sorted((s for s, objs in steps.items() if _complete(objs)), reverse=True)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    gone = sorted(s for s in steps if s < oldest_kept)
    for step in gone:
        store.delete_dir(checkpoint.store_prefix(step), steps[step])
    return gone


def _prune_policies(store: ObjectStore, newest: int, keep: int,
                    checkpointed: set[int]) -> list[int]:  # fmt: skip
    """Delete the policy versions older than the newest ``keep`` (counted back from
    ``newest``) that are not in ``checkpointed``; returns the versions deleted. ``keep``
    0: nothing."""
    if keep <= 0:
        return []
    versions = _by_step(store.list(POLICY_PREFIX + "/"), _POLICY_DIR)
    gone = sorted(v for v in versions if v <= newest - keep and v not in checkpointed)
    for version in gone:
        store.delete_dir(policy_prefix(version), versions[version])
    return gone


def prune(store: ObjectStore, newest_policy: int, keep_policies: int,
          keep_checkpoints: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """Checkpoints first (a deleted one no longer keeps its policy), then policies;
    (checkpoint steps, policy versions) deleted. The store is listed once per kind. A
    store outage is logged, not raised: what is left is deleted after a later step."""
    if keep_policies <= 0 and keep_checkpoints <= 0:
        return [], []
    try:
        checkpoints = _by_step(store.list(checkpoint.STORE_PREFIX + "/"), _CHECKPOINT_DIR)
        steps = _prune_checkpoints(store, checkpoints, keep_checkpoints)
        versions = _prune_policies(store, newest_policy, keep_policies,
                                   set(checkpoints) - set(steps))  # fmt: skip
    except StoreUnavailableError as e:
        log.warning("could not delete old policies or checkpoints (retried after the next "
                    "step): %s", e)  # fmt: skip
        return [], []
    if steps:
        log.info("deleted checkpoints of steps %s (trainer.keep_checkpoints = %d)",
                 step_spans(steps), keep_checkpoints)  # fmt: skip
    if versions:
        log.info("deleted policy versions %s (trainer.keep_policies = %d)", step_spans(versions),
                 keep_policies)  # fmt: skip
    return steps, versions
