# kjit message-operator service: `kjit serve` as a non-root user, the store on a volume.
#
#   docker build -t kjit .                                  # base: the official python:3.11-slim
#   docker build --build-arg BASE=kjit-base:bookworm -t kjit .   # a Debian-like base: python3 >= 3.11, venv, useradd
#   docker run --init -p 127.0.0.1:8000:8000 -v kjit-store:/data kjit   # or: docker compose up
#
# Configuration is by KJIT_* environment variables (service/settings.py): KJIT_STORE (default here
# /data/store, on the volume), KJIT_PORT, KJIT_TOKEN, KJIT_DEFAULT_OPERATORS, KJIT_DEFAULT_N_TRAIN, ...
# Replicas: KJIT_SHARED_STORE=redis://host:6379/0 (the Redis client is in the image; service/README.md).
# Your own factors: mount a directory of plugin modules at /plugins (on the image's PYTHONPATH) and name
# them in KJIT_FACTORS, e.g. `-v ./plugins:/plugins:ro -e KJIT_FACTORS=user_factors` (docker-compose.yml);
# POST /v1/operators then trains their operators (README: "Your own factor, served").
# On first start the default operators are trained into the store (a few minutes at the default sizes);
# later starts load them (--init lets a stop signal interrupt that training).  Arguments replace the
# command: `docker run ... kjit demo`.  Builds and runs on the reference base are checked by
# scripts/docker-smoke (make docker-smoke).
#
# Two stages: the first builds a virtual environment in /opt/kjit (pip, build dependencies, caches stay
# there); the second copies only that environment onto a fresh base.  Nothing here needs BuildKit
# (no RUN --mount, no heredocs): the classic builder of Debian's docker.io builds it.

ARG BASE=python:3.11-slim

# ---------------------------------------------------------------------------- build
FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# `.docker-pi[p]` is optional pip configuration for this stage only (a pip.conf with a CA bundle and a
# constraints file, as scripts/docker-smoke provides behind a TLS-intercepting proxy).  The glob matches
# nothing in a plain checkout, and nothing of it reaches the final image.
COPY pyproject.toml README.md .docker-pi[p] /src/
# the dependencies first, in their own layer (rebuilt only when pyproject.toml changes)
RUN set -eu; \
    if [ -f /src/pip.conf ]; then export PIP_CONFIG_FILE=/src/pip.conf; fi; \
    python3 -m venv /opt/kjit; \
    /opt/kjit/bin/python -m pip install --upgrade pip; \
    python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['redis']))" \
        > /tmp/requirements.txt; \
    /opt/kjit/bin/python -m pip install -r /tmp/requirements.txt
COPY kjit /src/kjit
COPY service /src/service
# then kjit itself; the runtime needs neither the installers nor the libraries' own test suites
RUN set -eu; \
    if [ -f /src/pip.conf ]; then export PIP_CONFIG_FILE=/src/pip.conf; fi; \
    /opt/kjit/bin/python -m pip install --no-deps /src; \
    /opt/kjit/bin/python -m pip uninstall --yes pip setuptools wheel >/dev/null 2>&1 || true; \
    site=$(/opt/kjit/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    for pkg in numpy scipy sklearn; do find "$site/$pkg" -depth -type d -name tests -exec rm -rf {} +; done; \
    /opt/kjit/bin/kjit --help >/dev/null

# ---------------------------------------------------------------------------- runtime
FROM ${BASE}
RUN set -eu; \
    useradd --system --uid 10001 --user-group --home-dir /home/kjit --create-home --shell /usr/sbin/nologin kjit; \
    mkdir -p /data/store /plugins; \
    chown -R kjit:kjit /data
COPY --from=build /opt/kjit /opt/kjit
ENV PATH=/opt/kjit/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/plugins \
    KJIT_STORE=/data/store \
    KJIT_PORT=8000
USER kjit
WORKDIR /home/kjit
VOLUME ["/data"]
EXPOSE 8000
# liveness from inside the container (no curl in slim images); on first start the default operators are
# trained before the server listens, hence the long start period
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KJIT_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kjit"]
CMD ["serve", "--host", "0.0.0.0"]
