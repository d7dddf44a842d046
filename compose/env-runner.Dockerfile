# The env runner's image: treadle-proto, -services, -native, -env-runner and the docker CLI
# (the container runtime drives the engine that compose/compose.yaml gives it). Built from
# the repository root:  docker build -f compose/env-runner.Dockerfile .
# No torch, no vLLM: the env runner never imports them.

# treadle_native is on no registry: build its wheel (Rust >= 1.85, CPython 3.11).
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
 && cd .. && /build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./proto ./services ./env_runner

FROM docker:28-cli AS docker-cli

FROM python:3.11-slim-bookworm
COPY --from=docker-cli /usr/local/bin/docker /usr/local/bin/docker
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
WORKDIR /var/lib/treadle
ENTRYPOINT ["treadle"]
CMD ["serve", "env_runner"]
