# syntax=docker/dockerfile:1
# The node agent. NVML comes from the host through the NVIDIA container runtime (NVIDIA_VISIBLE_DEVICES=all,
# NVIDIA_DRIVER_CAPABILITIES=utility); NIC counters from the host's /sys, mounted read-only.
# Build from the repository root:  docker build -f docker/agent.Dockerfile -t ridethrough-agent .

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
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
LABEL org.opencontainers.image.title="ridethrough-agent" \
      org.opencontainers.image.description="ridethrough node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 ridethrough \
 && useradd --system --uid 10001 --gid ridethrough --no-create-home ridethrough
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=utility
# Non-root by default. Route changes (reflex, reroute) need CAP_NET_ADMIN, which a non-root process gets only
# through file capabilities: the Helm chart runs the agent as uid 0 with NET_ADMIN alone when that is wanted.
USER 10001:10001
# 9464 /metrics; 7447/udp the probe responder.
EXPOSE 9464 7447/udp
ENTRYPOINT ["ridethrough"]
CMD ["agent"]
