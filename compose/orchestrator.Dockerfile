# The orchestrator's image: treadle-proto, -services, -native, -orchestrator. No torch, no
# vLLM. compose.yaml also runs the run's one-shots in it (credentials, streams).
#   docker build -f compose/orchestrator.Dockerfile -t treadle/orchestrator:dev .

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
COPY orchestrator orchestrator
RUN cd native && /build/bin/maturin build --release --interpreter python3 --out /wheels \
 && cd .. && /build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels \
      ./proto ./services ./orchestrator

FROM python:3.11-slim-bookworm
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin treadle \
 && mkdir -p /creds /data /var/lib/treadle/outputs \
 && chown -R treadle:treadle /creds /data /var/lib/treadle
USER treadle
WORKDIR /var/lib/treadle
ENTRYPOINT ["treadle"]
CMD ["serve", "orchestrator"]
