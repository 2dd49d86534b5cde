"""Distribution tiles per data-tiled matmul shape, as an IREE tuning spec (`--iree-codegen-tuning-spec-path`).

IREE 3.13's llvm-cpu target sizes a data-tiled matmul's (`linalg.mmt4d`) workgroups by one budget for every shape
(`--iree-llvmcpu-matmul-tile-bytes`, 256 KiB): on AVX2 a linear of 128 rows and a 4 MiB weight gets workgroups of
2 x 4 tiles of 8x8, so each of its 8 row groups streams the whole packed weight from L3 (docs/iree-3.13-findings.md,
"The float32 matmul on a real AVX2 CPU"). A larger budget for all shapes slows the convolutions' and ViT's products.
A tuning spec sets a lowering config on the `mmt4d`s whose operand types it names, and only on those:

    spec(tiles)        # the transform library's text
    spec_flag(tiles)   # `--iree-codegen-tuning-spec-path=...`, the file written by `materialize` before a compile

`Mmt4dTiles` is one shape's entry (the packed operand types as IREE's dump prints them, and the distribution);
`targets.CpuIsa.mmt4d_tiles` lists the entries measurement kept for an ISA (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

#: the flag that hands iree-compile a tuning spec (a transform library with a `__kernel_config` entry point)
FLAG = "--iree-codegen-tuning-spec-path"


@attrs.frozen
class Mmt4dTiles:
    """One `linalg.mmt4d` shape and the workgroup tiles it gets.

    - `lhs`, `rhs`: the packed operands' tensor types without `tensor<>` (`16x1024x8x1xf32`: 16 tiles of 8 rows,
      K 1024, 8x1 inner tiles), as `--iree-hal-dump-executable-configurations-to` prints them.
    - `distribution`: the workgroup's tiles over (M, N) in outer tiles; K and the inner tiles stay whole.
    - `vector`: the vector level's tile (outer M, outer N, M0, N0): (1, 1, 8, 8) is IREE's own on AVX2 float32, one
      8x8 tile in 8 accumulators; (1, 3, 4, 8) a 4x24 tile in 12.
    """

    lhs: str
    rhs: str
    distribution: tuple[int, int]
    vector: tuple[int, int, int, int] = (1, 1, 8, 8)

    def matcher(self, name: str) -> str:
        """A `transform.named_sequence` matching this shape's `mmt4d` and yielding its compilation info."""
        m, n = self.distribution
        vm, vn, m0, n0 = self.vector
        return f"""  transform.named_sequence @{name}(%op: !transform.any_op {{transform.readonly}})
      -> (!transform.any_op, !transform.any_param) {{
    transform.match.operation_name %op ["linalg.mmt4d"] : !transform.any_op
    %lhs = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %lhs = tensor<{self.lhs}> : !transform.any_value
    %rhs = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %rhs = tensor<{self.rhs}> : !transform.any_value
    %c = transform.param.constant #iree_codegen.compilation_info<
        lowering_config = #iree_cpu.lowering_config<distribution = [{m}, {n}, 0, 0, 0, 0],
          vector_common_parallel = [{vm}, {vn}, 0, {m0}, {n0}, 0], vector_reduction = [0, 0, 1, 0, 0, 1]>,
        translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<Mmt4dTilingExpert>>>
        -> !transform.any_param
    transform.yield %op, %c : !transform.any_op, !transform.any_param
  }}
"""


def spec(tiles: Sequence[Mmt4dTiles]) -> str:
    """The tuning spec (a transform library) giving each of `tiles`' shapes its distribution; other ops keep
    IREE's own configuration."""
    names = [f"@match_mmt4d_{i}" for i in range(len(tiles))]
    cases = ", ".join(f"{name} -> @apply" for name in names)
    return (
        "module attributes {transform.with_named_sequence, iree_codegen.tuning_spec_with_default_entrypoint} {\n"
        "  transform.named_sequence @apply(%op: !transform.any_op {transform.readonly},\n"
        "                                  %c: !transform.any_param {transform.readonly}) {\n"
        '    transform.annotate %op "compilation_info" = %c : !transform.any_op, !transform.any_param\n'
        "    transform.yield\n"
        "  }\n"
        + "".join(t.matcher(name[1:]) for t, name in zip(tiles, names, strict=True))
        + "  transform.named_sequence @__kernel_config(%v: !transform.any_op {transform.consumed})\n"
        "      -> !transform.any_op\n"
        "      attributes {iree_codegen.tuning_spec_entrypoint} {\n"
        f"    %r = transform.foreach_match in %v {cases} : (!transform.any_op) -> !transform.any_op\n"
        "    transform.yield %r : !transform.any_op\n"
        "  }\n"
        "}\n"
    )


#: spec path -> its text, for `materialize`
_TEXTS: dict[str, str] = {}


def spec_flag(tiles: Sequence[Mmt4dTiles], directory: str | os.PathLike[str] | None = None) -> str:
    """`--iree-codegen-tuning-spec-path=PATH` for `tiles`' spec, in a file named by its content (under `directory`,
    default the temporary directory): the same tiles give the same flag, so compile caches keyed by the flags stay
    valid. The file is written here (so tools that run iree-compile with the target's flags themselves find it) and
    again by `materialize` where it has gone since (`invoke.run_iree_compile` calls it)."""
    text = spec(tiles)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = str(Path(directory or tempfile.gettempdir()) / f"fx-rewrites-tuning-{digest}.mlir")
    _TEXTS[path] = text
    flag = f"{FLAG}={path}"
    with contextlib.suppress(OSError):  # a directory not writable now: the compile's `materialize` says so
        materialize([flag])
    return flag


def materialize(flags: Sequence[str]) -> None:
    """Write the spec file of each `spec_flag` flag in `flags` that is not there (or holds other text); a tuning
    spec path this module did not make is left to iree-compile."""
    for flag in flags:
        if not flag.startswith(f"{FLAG}="):
            continue
        path = Path(flag.split("=", 1)[1])
        text = _TEXTS.get(str(path))
        if text is None or (path.exists() and path.read_text() == text):
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
