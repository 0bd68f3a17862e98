# The proxy-operator worker: python worker.py as a console script.
# Proxies never run in this image; providers start them elsewhere (Squid Pods
# from ubuntu/squid, Compute Engine VMs, or Squid processes on the host).
#   docker build -t proxy-operator-worker:0.1.0 .
FROM python:3.11-slim AS worker

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# The application's locked dependencies first, each file checked against its
# hash (requirements/app.txt, `make lock`), in a layer of their own that a
# change to the code leaves cached. The project then goes in on top with
# nothing more resolved, by the locked setuptools: run from this checkout in
# /app (an application, not a wheel of top-level modules in site-packages),
# beside the scrapers' client whose username grammar it imports.
COPY requirements/app.txt requirements/
RUN pip install --require-hashes -r requirements/app.txt
COPY pyproject.toml README.md ./
COPY clients/python/ clients/python/
COPY squid/ squid/
COPY providers/ providers/
COPY activities/ activities/
COPY workflows/ workflows/
COPY startup/ startup/
COPY gateway/ gateway/
COPY worker.py contract.py cli.py ./
# PYTHONDONTWRITEBYTECODE stops some pips writing bytecode too (23.2 writes
# none, 26.3 does), and the workflow sandbox re-imports the workflow modules
# for every new workflow run: without .pyc files each run compiles them again
# (a seventh of a busy worker's CPU while a 1,000-member pool starts;
# docs/benchmarks.md). Compiled here, once, whatever pip the image has: the
# checkout in /app, which is where the code runs from.
RUN pip install --no-deps --no-build-isolation -e ./clients/python -e . \
    && python -m compileall -q /app \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin worker

# Numeric, so Kubernetes can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001
# /metrics and /healthz listen on 127.0.0.1:9464 unless --metrics-address or
# PROXY_OPERATOR_METRICS_ADDRESS says otherwise (the manifests and
# docker-compose.yml set 0.0.0.0:9464 for their probes and Prometheus).
EXPOSE 9464
CMD ["proxy-operator-worker", "--providers-config", "/etc/proxy-operator/providers.yaml"]

# For docker-compose.yml: the same worker with Squid installed, so the local
# provider can run proxies inside the container (as the unprivileged user).
FROM worker AS worker-local
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends squid \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o 10001 -g 10001 /app/.data
USER 10001:10001

# proxy-operator-gateway: one Squid and the router behind it over a pool's
# members, with the worker's code for its config and Temporal connection.
#   docker build --target gateway -t proxy-operator-gateway:0.1.0 .
FROM worker AS gateway
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends squid \
    && rm -rf /var/lib/apt/lists/*
USER 10001:10001
# The metrics listener is 127.0.0.1:9465 unless PROXY_OPERATOR_GATEWAY_METRICS_ADDRESS
# (or --metrics-address) says otherwise, as the manifests do.
EXPOSE 8888 9465
CMD ["proxy-operator-gateway", "--providers-config", "/etc/proxy-operator/providers.yaml"]
