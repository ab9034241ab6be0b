"""The Triton LoRA kernel (BGMV) against the PyTorch path, run by Triton's interpreter on CPU
tensors (`TRITON_INTERPRET=1`), as the attention kernel is tested (`test_kernels.py`).

Triton decides at import time whether its helpers are interpreted, and another test module
may already have imported it, so the cases run in a child process that runs this file as a
script and reports per case. What needs a GPU is only the compiled kernel itself (the same
source): `bench/servefleet/bench/lora_gpu_check.py` runs these cases on CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (weight dtype, activation dtype, rows): float32 end to end, bfloat16 weights under a
# float32 model (what the CPU engine holds), and a float16 model (a GPU's)
CASES = {
    "f32-weights-f32-x-9-rows": ("float32", "float32", 9),
    "bf16-weights-f32-x-40-rows": ("bfloat16", "float32", 40),
    "f16-weights-f16-x-7-rows": ("float16", "float16", 7),
}


def run_cases() -> dict[str, dict[str, object]]:
    """In the child process (TRITON_INTERPRET=1): every projection of every layer, random
    slots with rows on the base model between them, ranks 1-33, partial target sets."""
    import tempfile

    import torch

    from servefleet.engine.kernels.triton_lora import TRITON_LORA
    from servefleet.engine.lora.batch import PROJECTION_INDEX
    from tests.support.lora_kernels import ALL, TINY, fused_shapes, make_adapters, shuffled_step

    specs = [(8, ALL), (1, ("q_proj", "v_proj")), (33, ("gate_proj", "up_proj", "down_proj")),
             (4, ("k_proj", "o_proj")), (16, ("up_proj", "q_proj", "k_proj"))]  # fmt: skip
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as root:
        for case, (weights, activations, rows) in CASES.items():
            dtype = getattr(torch, activations)
            adapters = make_adapters(Path(root) / case, TINY, specs, getattr(torch, weights))
            batch, which = shuffled_step(adapters, rows, seed=rows)
            generator = torch.Generator().manual_seed(rows)
            worst, untouched, taken = 0.0, True, True
            for layer in range(TINY.num_layers):
                for name, (k, n) in fused_shapes(TINY).items():
                    x = torch.randn(rows, k, generator=generator).to(dtype)
                    base = torch.randn(rows, n, generator=generator).to(dtype)
                    want, got = base.clone(), base.clone()
                    batch.add(layer, name, x, want)
                    step = batch.kernel_step(rows)
                    index = PROJECTION_INDEX[name]
                    taken &= step is not None and TRITON_LORA.add(x, got, step, layer, index)
                    worst = max(worst, float((got.float() - want.float()).abs().max()))
                    base_rows = torch.tensor([w < 0 for w in which])
                    untouched &= bool(torch.equal(got[base_rows], base[base_rows]))
            results[case] = {"taken": taken, "max_error": worst, "base_rows_untouched": untouched}
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_the_triton_kernel_adds_what_pytorch_adds(
    results: dict[str, dict[str, object]], case: str
) -> None:
    result = results[case]
    assert result["taken"] is True  # the kernel ran (it did not decline the tensors)
    assert result["base_rows_untouched"] is True
    # float16 rounds the reference's intermediate products (PyTorch's path computes in the
    # model's dtype); the kernel sums in float32
    limit = 2e-2 if CASES[case][1] == "float16" else 1e-4
    assert float(str(result["max_error"])) <= limit


def test_the_triton_kernel_declines_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors without the interpreter it returns False: the PyTorch path runs."""
    import torch

    from servefleet.engine.kernels.lora_layout import LoraStep
    from servefleet.engine.kernels.triton_lora import TRITON_LORA

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    step = LoraStep(torch.zeros(2, dtype=torch.int32), torch.zeros(1, 2, 4, 19, dtype=torch.int64),
                    torch.float32, 4)  # fmt: skip
    assert not TRITON_LORA.add(torch.zeros(2, 8), torch.zeros(2, 8), step, 0, 0)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(run_cases()))
