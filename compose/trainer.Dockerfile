# The trainer's image: treadle-proto, -services, -native, -trainer with torch 2.13 and
# TorchTitan. Two variants of torch:
#   docker build -f compose/trainer.Dockerfile --build-arg VARIANT=cpu  -t treadle/trainer:dev-cpu .
#   docker build -f compose/trainer.Dockerfile --build-arg VARIANT=cuda -t treadle/trainer:dev-cuda .
# cpu: torch's CPU build from PyTorch's index; cuda: torch from PyPI (the CUDA build,
# its CUDA libraries as wheels; the host needs the NVIDIA driver and container toolkit).
ARG VARIANT=cpu

# treadle_native is on no registry: build its wheel (Rust >= 1.85, CPython 3.11)
FROM rust:1-slim-bookworm AS wheels
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /build && /build/bin/pip install --no-cache-dir "maturin>=1.9.4,<2"
WORKDIR /src
COPY native native
COPY proto proto
COPY services services
COPY trainer trainer
RUN cd native && /build/bin/maturin build --release --interpreter python3 --out /wheels \
 && cd .. && /build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels \
      ./proto ./services ./trainer

FROM python:3.11-slim-bookworm
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# where the CPU variant gets torch's CPU build: PyTorch's index, a mirror, and/or a
# directory of wheels (TORCH_FIND_LINKS, e.g. bind-mounted with podman build -v)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
RUN case "$VARIANT" in \
      cpu) pip install --no-cache-dir "torch==${TORCH_VERSION}" \
             --index-url "$TORCH_INDEX_URL" ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} ;; \
      cuda) pip install --no-cache-dir "torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin treadle \
 && mkdir -p /creds /data /var/lib/treadle/outputs \
 && chown -R treadle:treadle /creds /data /var/lib/treadle
USER treadle
WORKDIR /var/lib/treadle
ENTRYPOINT ["treadle"]
CMD ["serve", "trainer"]
