# The operator image the Helm chart runs (`stepscale operator`).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/stepscale/stepscale-operator:0.1.0 .
# Not built in CI (no container runtime there); the chart tests render it by name only.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine_plugin engine_plugin
COPY operator operator
# gcc only to build the native ingest extension (setup.py), then removed.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir '.[operator]' \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* /src
WORKDIR /
# The chart's securityContext runs as this non-root user.
USER 65532:65532
ENTRYPOINT ["stepscale"]
CMD ["operator"]
