# A vLLM serving image with the Stepscale engine plugin: vLLM loads it through its
# `vllm.general_plugins` entry point, no vLLM source change. Only msgspec and pyzmq
# are added (vLLM already ships both).
#   docker build -f docker/vllm.Dockerfile --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0 \
#       -t ghcr.io/stepscale/vllm-openai-stepscale:v0.32.0 .
# Not built in CI (no container runtime there).
ARG VLLM_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /tmp/stepscale/
COPY engine_plugin /tmp/stepscale/engine_plugin
COPY operator /tmp/stepscale/operator
# No extras: the engine side needs only the base dependencies.
RUN pip install --no-cache-dir --no-deps /tmp/stepscale msgspec && rm -rf /tmp/stepscale
# One PUB port per data-parallel rank: base + rank (see README, "Engine plugin").
ENV STEPSCALE_FPM_PORT=20380
