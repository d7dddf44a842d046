"""A published policy as a loadable model folder: the trainer's final export and
``treadle export`` (any step of a run, e.g. a checkpoint to start another run from).

The trainer publishes every step's weights to the run's object store as
``policies/v<N:06d>`` (weights, config.json, probe; with LoRA the PEFT adapter). A folder
made here is that directory, every file sha256-verified, plus the starting model's
tokenizer files, so vLLM, transformers and ``treadle`` load it as they load the base.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from treadle.services.errors import ConfigError, TreadleError
from treadle.services.objectstore import MANIFEST_NAME, Manifest, ObjectStore

POLICY_PREFIX = "policies"
EXPORTED_FROM_BASE = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
_POLICY_KEY = re.compile(rf"^{POLICY_PREFIX}/v(\d{{6,}})/{re.escape(MANIFEST_NAME)}$")


def policy_prefix(policy_version: int) -> str:
    return f"{POLICY_PREFIX}/v{policy_version:06d}"


def export_model(store: ObjectStore, weights: Any, base: Path | None, dest: Path) -> Manifest:
    """Write the published directory ``weights`` (a manifest ref or a prefix) to ``dest``
    with ``base``'s tokenizer files; ``dest`` is replaced only once the folder is whole.
    Returns the directory's manifest."""
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        manifest = store.fetch_dir(weights, staging)  # sha256-verified
        if base is not None:
            for name in EXPORTED_FROM_BASE:
                if (base / name).is_file() and not (staging / name).exists():
                    shutil.copy(base / name, staging / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return manifest


def published_versions(store: ObjectStore) -> list[int]:
    """Policy versions whose publication finished (their manifest is stored), ascending."""
    found = (_POLICY_KEY.match(o.key) for o in store.list(f"{POLICY_PREFIX}/"))
    return sorted(int(m.group(1)) for m in found if m)


def step_spans(versions: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive versions
    for v in versions:
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def export_run_policy(
    store: ObjectStore, version: int | None, base: Path | None, dest: Path
) -> tuple[int, str]:
    """Export policy ``version`` (None: the newest) of the run whose store is ``store``;
    returns (the version, its weights format). Errors name what the store holds."""
    versions = published_versions(store)
    if not versions:
        raise TreadleError(
            f"{store.uri(POLICY_PREFIX)} holds no published policy: name the run (run.name, "
            "run.output_dir or object_store) whose trainer published some"
        )
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise TreadleError(
            f"policy version {version} is not in {store.uri(POLICY_PREFIX)}; published: "
            f"{step_spans(versions)}"
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"--out {dest} exists and is not an empty folder: name a new one")
    manifest = export_model(store, policy_prefix(version), base, dest)
    return version, str(manifest.metadata.get("format", ""))


def main(argv: list[str], version: int | None, out: Path) -> int:
    """`treadle export`: policy ``version`` of the configured run as a model folder."""
    from treadle.services.config import gather, split_argv, validate
    from treadle.services.objectstore import open_store
    from treadle.services.registry import known_sections
    from treadle.services.sections import ServiceConfig

    if version is not None and version < 1:
        raise ConfigError(
            f"--step must be 1 or more (policy version 1 is the first step's), got {version}"
        )
    sources = split_argv(argv)
    raw = gather(sources)
    cfg = validate(ServiceConfig, raw, known_sections())
    run_dir = cfg.run.run_dir
    local_root = cfg.object_store.root or run_dir / "store"
    if cfg.object_store.backend == "local" and not local_root.is_dir():
        raise ConfigError(
            f"{local_root} is not a run's store: name the run (run.name, or the run's own "
            "config file)"
        )
    store = open_store(cfg.object_store, cfg.run.name, run_dir)
    model = raw.data.get("trainer", {}).get("model")
    base = Path(model) if model else None
    if sources.dry_run:
        versions = published_versions(store)
        print(f"run {cfg.run.name}: policy versions {step_spans(versions) or 'none'} published in "
              f"{store.uri(POLICY_PREFIX)}; nothing written (--dry-run)")  # fmt: skip
        return 0
    version, fmt = export_run_policy(store, version, base, out)
    what = "LoRA adapter (PEFT: load it on its base model)" if "lora" in fmt else "model"
    print(f"policy version {version} of run {cfg.run.name} exported to {out} as a {what}"
          + ("" if base else "; no trainer.model named, so no tokenizer files were copied"))  # fmt: skip
    return 0
