"""Treadle trainer: optimises the policy with TorchTitan components (FSDP2 under torchrun),
computes the loss from packed tensors only, checkpoints and publishes weights.

Today: the service shell (config, control plane with GetStatus and Stop, lifecycle).
Training lands with the end-to-end async RL issue.
"""
