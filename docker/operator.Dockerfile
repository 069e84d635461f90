# The operator image the Helm chart runs (`stepscale operator`).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/stepscale/stepscale-operator:0.1.0 .
# Not built in CI (no container runtime there); the chart tests render it by name only.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine_plugin engine_plugin
COPY operator operator
RUN pip install --no-cache-dir '.[operator]' && rm -rf /src
WORKDIR /
# The chart's securityContext runs as this non-root user.
USER 65532:65532
ENTRYPOINT ["stepscale"]
CMD ["operator"]
