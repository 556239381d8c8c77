# syntax=docker/dockerfile:1
# The server components: gateway, controller, dashboard, `store init`, and ridethrough-leader.
# Build from the repository root:  docker build -f docker/server.Dockerfile -t ridethrough-server .

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
# Only what the package is built from (docker/server.Dockerfile.dockerignore keeps the rest out).
COPY pyproject.toml README.md ./
COPY ridethrough ridethrough
COPY collector collector
COPY exporters exporters
COPY detectors detectors
COPY actuators actuators
COPY dashboards dashboards
COPY lab lab
RUN /opt/venv/bin/pip install . \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="ridethrough-server" \
      org.opencontainers.image.description="ridethrough gateway, controller and dashboard" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 docker/leader_elect.py /usr/local/bin/ridethrough-leader
RUN groupadd --system --gid 10001 ridethrough \
 && useradd --system --uid 10001 --gid ridethrough --home-dir /var/lib/ridethrough --create-home ridethrough \
 && mkdir -p /var/spool/ridethrough \
 && chown ridethrough:ridethrough /var/spool/ridethrough
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /var/lib/ridethrough
USER 10001:10001
# 4317 OTLP/gRPC (gateway), 9090 gateway /metrics, 9091 controller /metrics, 8050 dashboard.
EXPOSE 4317 9090 9091 8050
ENTRYPOINT ["ridethrough"]
CMD ["--help"]
