"""The ISA matrix's arms: every matmul build this CPU can run, for each engine source tree.

An arm is one engine process: a source tree, an instruction-set cap on the C matmul kernels
(`SERVEFLEET_MATMUL_ISA`; "native" is the default build, AVX-512 where the CPU has it), a
matmul dtype (bfloat16 only where the CPU multiplies it natively) and, for a tree that has
the batch-invariant mode, float32 arms with it off beside the default (what invariance
costs). A tree that does not know the cap or the dtype flag gets only its default for them,
so an older commit runs what it can. Only flags the tree's engine lists in its `--help` are passed.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from servefleet.api.engine_flags import flag
from servefleet.bench.source_trees import CURRENT, ISA_ENV_NAME, SourceTree
from servefleet.engine.cpu_isa import native_bf16

ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma")
NATIVE = "native"
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"


class Arm(BaseModel):
    model_config = ConfigDict(frozen=True)

    tree: str  # SourceTree.label
    isa: str  # SERVEFLEET_MATMUL_ISA value; "native": unset
    isa_label: str  # what "native" is on this CPU
    matmul_dtype: str
    batch_invariant: str = "default"  # "off": the engine's --batch-invariant off

    @property
    def name(self) -> str:
        suffix = "" if self.batch_invariant == "default" else f"/invariant-{self.batch_invariant}"
        return f"{self.tree}/{self.isa_label}/{self.matmul_dtype}{suffix}"

    @property
    def slug(self) -> str:
        return self.name.replace("/", "-").replace("+", "")


def native_label(flags: set[str]) -> str:
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "plain"


def machine_isas(flags: set[str], with_plain: bool) -> list[tuple[str, str]]:
    """(cap, label) pairs of the builds this CPU runs, default first, no duplicate builds."""
    isas = [(NATIVE, native_label(flags))]
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        isas.append(("avx2", "avx2"))
    if with_plain and isas[0][1] != "plain":
        isas.append(("plain", "plain"))
    return isas


def machine_dtypes(flags: set[str]) -> list[str]:
    """bfloat16 arms only where the CPU has it in hardware (else oneDNN emulates it)."""
    return [BFLOAT16, FLOAT32] if native_bf16(flags) else [FLOAT32]


def plan_arms(trees: list[SourceTree], flags: set[str], with_plain: bool) -> list[Arm]:
    """Every (tree, isa, dtype) the tree understands; the first arm is the current default."""
    arms = []
    for tree in trees:
        isas = machine_isas(flags, with_plain) if tree.isa_env else machine_isas(flags, False)[:1]
        dtypes = machine_dtypes(flags)
        if not tree.understands(flag("matmul_dtype"), BFLOAT16):
            dtypes = [FLOAT32]
        built = [
            Arm(tree=tree.label, isa=isa, isa_label=label, matmul_dtype=dtype)
            for isa, label in isas
            for dtype in dtypes
        ]
        if tree.understands(flag("batch_invariant"), "off"):
            built += [
                a.model_copy(update={"batch_invariant": "off"})
                for a in built
                if a.matmul_dtype == FLOAT32
            ]
        arms += built
    return arms


def select_arms(arms: list[Arm], names: str | None) -> list[Arm]:
    """Keep the arms named (comma-separated; "default" names `default_arm`)."""
    if not names:
        return arms
    wanted = {default_arm(arms).name if n == "default" else n for n in names.split(",")}
    chosen = [a for a in arms if a.name in wanted]
    missing = wanted - {a.name for a in chosen}
    if missing:
        known = ", ".join(a.name for a in arms)
        raise ValueError(f"unknown arms {sorted(missing)}; this machine has: {known}")
    return chosen


HIDE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"


def engine_args(
    tree: SourceTree, arm: Arm, served: str, threads: int, parallel: int, kv_cache_dtype: str
) -> tuple[list[str], dict[str, str], list[str]]:
    """(extra engine args, extra env, dropped flags) for one arm; flags the tree's engine
    does not list (or whose value it does not accept) are dropped and reported."""
    wanted = [
        ("--served-model-name", served),
        ("--threads", str(threads)),
        ("--max-num-seqs", str(parallel)),
        ("--kv-cache-dtype", kv_cache_dtype),
        (flag("matmul_dtype"), arm.matmul_dtype),
    ]
    if arm.batch_invariant != "default":
        wanted.append((flag("batch_invariant"), arm.batch_invariant))
    args: list[str] = []
    dropped: list[str] = []
    for name, value in wanted:
        if tree.understands(name, value):
            args += [name, value]
        else:
            dropped.append(f"{name} {value}")
    # A CPU benchmark also on a machine with a GPU, where an engine's `--device auto` (and an
    # older engine's default) would pick CUDA: no engine of any tree sees a GPU.
    env = {HIDE_GPUS_ENV: ""} if arm.isa == NATIVE else {HIDE_GPUS_ENV: "", ISA_ENV_NAME: arm.isa}
    return args, env, dropped


def default_arm(arms: list[Arm]) -> Arm:
    """The reference of every ratio: this checkout's native build in its fastest dtype."""
    current = [a for a in arms if a.tree == CURRENT and a.isa == NATIVE]
    return (current or arms)[0]
