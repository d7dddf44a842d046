"""Model families the trainer can train, registered by name in this one place.

    config.json ──resolve_family──▶ ModelFamily ──model_spec(hf, attention)──▶ TorchTitan ModelSpec
                                                   (model config, parallelize_fn, state-dict adapter)

Adding a family: a folder ``models/<name>/`` with ``__init__.py`` (``FAMILY``) and
``model.py`` (HF config -> TorchTitan model config), then one line in ``FAMILIES``.
"""

from __future__ import annotations

from treadle.trainer.errors import ModelFolderError
from treadle.trainer.models import llama3, qwen3
from treadle.trainer.models.family import ModelFamily
from treadle.trainer.models.hf import CONFIG_NAME, HFModelConfig

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (qwen3.FAMILY, llama3.FAMILY)}


def resolve_family(hf: HFModelConfig, requested: str = "auto") -> ModelFamily:
    """The family named by ``requested``, or (``auto``) the one whose architectures or
    model_type match ``hf``; ModelFolderError when none or the named one does not match."""
    if requested != "auto":
        if requested not in FAMILIES:
            raise ModelFolderError(
                f"trainer.family {requested!r} is unknown; families: {', '.join(FAMILIES)}"
            )
        family = FAMILIES[requested]
        if hf.model_type and hf.model_type not in family.model_types:
            raise ModelFolderError(
                f"trainer.family {requested!r} does not match {hf.folder / CONFIG_NAME} "
                f"(model_type {hf.model_type!r})"
            )
        return family
    for family in FAMILIES.values():
        if set(hf.architectures) & set(family.architectures):
            return family
    for family in FAMILIES.values():
        if hf.model_type in family.model_types:
            return family
    raise ModelFolderError(
        f"{hf.folder / CONFIG_NAME}: architectures {hf.architectures} / model_type "
        f"{hf.model_type!r} match no trainer family ({', '.join(FAMILIES)})"
    )


__all__ = ["FAMILIES", "HFModelConfig", "ModelFamily", "resolve_family"]
