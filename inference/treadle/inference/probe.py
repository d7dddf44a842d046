"""What a published policy promises, and the check that the engine keeps the promise.

The trainer publishes policy version N as a directory (``policies/v{N:06d}``) whose
manifest metadata reads::

    {"policy_version": N, "format": "hf-safetensors" (or "peft-lora", an adapter),
     "probe": {"token_ids": [t0, t1, ...],     # [num_probe_tokens]
               "logprobs": [l1, l2, ...]}}      # [num_probe_tokens - 1], float32 reference:
                                                # l_i = log p(t_i | t_0..t_{i-1}) under the new weights

After loading, the service asks vLLM for the prompt logprobs of ``token_ids`` and
accepts the weights when the mean absolute difference to ``logprobs`` is within the
tolerance. The mean (not the max) because low-precision serving moves a few tokens by
much more than the rest, while weights that did not load (a stale layer, a broken tie)
move almost every token.

Not here: fetching the directory (``ObjectStore.fetch_dir`` verifies every sha256) or
talking to vLLM (``engine.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.inference.errors import ManifestError

POLICY_FORMAT = "hf-safetensors"  # full weights: model.safetensors + config.json
LORA_FORMAT = (
    "peft-lora"  # a PEFT adapter on the base: adapter_config.json + adapter_model.safetensors
)
POLICY_FORMATS = (POLICY_FORMAT, LORA_FORMAT)


@dataclass(frozen=True)
class Probe:
    """A token sequence and its reference logprobs under one policy's weights."""

    token_ids: tuple[int, ...]  # [num_probe_tokens]
    logprobs: tuple[float, ...]  # [num_probe_tokens - 1]


@dataclass(frozen=True)
class PublishedPolicy:
    """The metadata of one published policy directory, validated."""

    policy_version: int
    probe: Probe
    format: str = POLICY_FORMAT  # one of POLICY_FORMATS
    base_model: str = ""  # the model a LoRA adapter applies to, as the trainer names it


def read_policy_metadata(
    metadata: Mapping[str, Any], where: str, *, expected_version: int | None = None
) -> PublishedPolicy:
    """Validate a policy manifest's metadata; ManifestError naming ``where`` otherwise."""
    version = metadata.get("policy_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ManifestError(
            f"{where}: metadata.policy_version must be an integer >= 0, got {version!r}"
        )
    if expected_version is not None and version != expected_version:
        raise ManifestError(
            f"{where}: the manifest is policy version {version}, but it was announced as "
            f"version {expected_version}"
        )
    fmt = metadata.get("format")
    if fmt not in POLICY_FORMATS:
        raise ManifestError(
            f"{where}: metadata.format is {fmt!r}; supported: {', '.join(POLICY_FORMATS)}"
        )
    probe = metadata.get("probe")
    if not isinstance(probe, Mapping):
        raise ManifestError(
            f"{where}: metadata.probe is missing: the trainer must publish probe.token_ids and "
            "probe.logprobs so that the served weights can be verified"
        )
    ids, logprobs = probe.get("token_ids"), probe.get("logprobs")
    if (
        not isinstance(ids, list)
        or len(ids) < 2
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise ManifestError(f"{where}: probe.token_ids must be a list of >= 2 token ids >= 0")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids) - 1:
        raise ManifestError(
            f"{where}: probe.logprobs must hold len(token_ids) - 1 = {len(ids) - 1} numbers, got "
            f"{len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__}"
        )
    if not all(isinstance(x, int | float) and math.isfinite(x) and x <= 0 for x in logprobs):
        raise ManifestError(f"{where}: probe.logprobs must be finite numbers <= 0")
    base_model = metadata.get("base_model", "")
    if not isinstance(base_model, str):
        raise ManifestError(f"{where}: metadata.base_model must be a string, got {base_model!r}")
    probe_ = Probe(tuple(ids), tuple(float(x) for x in logprobs))
    return PublishedPolicy(version, probe_, fmt, base_model)


@dataclass(frozen=True)
class ProbeCheck:
    """Served vs published probe logprobs."""

    mean_abs_diff: float  # nats, over the probe's num_probe_tokens - 1 positions
    max_abs_diff: float  # nats
    tolerance: float  # accepted mean_abs_diff

    @property
    def ok(self) -> bool:
        return self.mean_abs_diff <= self.tolerance

    def describe(self) -> str:
        return (
            f"mean |served - published| logprob {self.mean_abs_diff:.3g} (max {self.max_abs_diff:.3g}), "
            f"tolerance {self.tolerance:.3g}"
        )


def compare(served: Sequence[float], probe: Probe, tolerance: float) -> ProbeCheck:
    """Compare served logprobs of ``probe.token_ids`` with the published ones."""
    if len(served) != len(probe.logprobs):
        raise ValueError(f"{len(served)} served logprobs for {len(probe.logprobs)} published ones")
    diffs = [abs(a - b) for a, b in zip(served, probe.logprobs, strict=True)]
    if not all(math.isfinite(d) for d in diffs):
        return ProbeCheck(math.inf, math.inf, tolerance)
    return ProbeCheck(sum(diffs) / len(diffs), max(diffs), tolerance)
