"""Treadle trainer: optimises the policy with TorchTitan components (FSDP2 under torchrun),
computes the loss from packed tensors only, checkpoints and publishes weights.

Modules: ``spec`` (config, light), ``service`` (bus loop, control plane), ``trainer``
(one step, checkpoints), ``policy`` (model build/load/save/logprobs), ``models/`` (one
folder per family), ``losses``, ``batch``, ``checkpoint``, ``recipe``, ``distributed``.
"""
