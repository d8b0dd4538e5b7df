# personaplex-serve: one replica (docs/DEPLOYMENT.md, "The container image").
#
#   docker build -t personaplex-serve .
#   docker run --gpus all -p 8000:8000 -e PERSONAPLEX_API_KEYS=KEY \
#       -e PERSONAPLEX_CHECKPOINT=nvidia/personaplex-7b-v1 -e HF_TOKEN \
#       -v hf-cache:/cache/huggingface -v compile-cache:/cache/personaplex personaplex-serve
#
# BASE_IMAGE must be Debian or Ubuntu (python3 3.10 or later with venv, or apt to install it).
# The default is NVIDIA's CUDA base image: torch's CUDA wheels bring their own CUDA libraries,
# so the image needs only the host's driver, which the NVIDIA container toolkit mounts.  The
# tests build on a base made from Debian's packages (tests/test_container.py).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE_IMAGE} AS base
# The system packages the server needs: python3 (+ venv), libopus for /api/chat's Opus off the
# interpreter lock, curl for the health check, the CA store.  Installed only where the base
# lacks them.
RUN if ! command -v python3 >/dev/null || ! python3 -c "import ensurepip, venv" 2>/dev/null \
        || ! command -v curl >/dev/null || ! ldconfig -p | grep -q libopus.so.0 \
        || [ ! -f /etc/ssl/certs/ca-certificates.crt ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv libopus0 curl ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi
# Certificates of a proxy that inspects TLS, where the build or the server's downloads pass one:
# PEM files named *.crt in certs/ of the build context (none in the repository) join the
# system's store, which pip and the Hugging Face downloads are pointed at.
COPY certs/ /usr/local/share/ca-certificates/personaplex/
RUN if ls /usr/local/share/ca-certificates/personaplex/*.crt >/dev/null 2>&1; then update-ca-certificates; fi
# A non-root user; its caches on volumes: the Hugging Face cache (checkpoints) and the
# compile caches (Inductor, Triton), so that a new container reuses what an earlier one did.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin personaplex \
    && mkdir -p /opt/personaplex /cache/huggingface /cache/personaplex \
    && chown -R personaplex /opt/personaplex /cache
ENV VIRTUAL_ENV=/opt/personaplex/venv \
    PATH=/opt/personaplex/venv/bin:$PATH \
    HF_HOME=/cache/huggingface \
    PERSONAPLEX_CACHE_DIR=/cache/personaplex \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PYTHONUNBUFFERED=1
USER personaplex
WORKDIR /opt/personaplex

# The virtualenv is built in a stage of its own, so that the wheels and sources it is built
# from stay out of the image (a CUDA torch wheel is gigabytes).
FROM base AS build
# TORCH: the torch requirement ("torch==2.11.0": PyPI's Linux wheel, built for CUDA).  A wheel
# placed in wheels/ of the build context that meets it is taken first (the tests bring a CPU
# one).  TORCH_INDEX_URL: an index to take it from instead (https://download.pytorch.org/whl/cu130).
ARG TORCH="torch==2.11.0"
ARG TORCH_INDEX_URL=""
# torch first, alone: the largest step, and the one that changes least.
COPY --chown=personaplex wheels/ /opt/personaplex/wheels/
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --find-links /opt/personaplex/wheels \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
COPY --chown=personaplex pyproject.toml README.md /opt/personaplex/src/
COPY --chown=personaplex engines /opt/personaplex/src/engines
COPY --chown=personaplex orchestrator /opt/personaplex/src/orchestrator
RUN pip install --no-cache-dir /opt/personaplex/src

FROM base
# How the image runs, said before its large layer: each instruction after it would copy it
# again on a storage driver without layers (vfs, as in the tests).
# personaplex-serve is hypercorn's command line for orchestrator:app with a master that hands
# each connection to the least busy worker, replaces a worker that dies, and ends a start-up
# that cannot succeed with one line and exit status 3 (`hypercorn orchestrator:app` runs the
# same server).  Listen on every address of the container; with a bind beyond loopback the
# server requires API keys (PERSONAPLEX_API_KEYS or PERSONAPLEX_API_KEYS_FILE) unless
# PERSONAPLEX_AUTH=off says otherwise.  `docker run IMAGE --help` lists every setting.
EXPOSE 8000
# /health on the default port (a container given another --bind needs its own check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s CMD curl -sf http://127.0.0.1:8000/health || exit 1
# SIGTERM: the listeners close, every session ends with "shutdown" and the engines stop;
# --graceful-timeout bounds that (the orchestrator's grace period must be longer).
STOPSIGNAL SIGTERM
ENTRYPOINT ["personaplex-serve"]
CMD ["--bind", "0.0.0.0:8000", "--workers", "4", "--graceful-timeout", "20"]
COPY --from=build /opt/personaplex/venv /opt/personaplex/venv
