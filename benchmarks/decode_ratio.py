"""Decode tokens/s of saved `compile_lm` modules interleaved round by round, each with both greedy loops (issue 33).

    python benchmarks/quantized.py --schemes float32,int4_g32 --routes compile_lm --saved DIR --rounds 0  # compile
    python benchmarks/decode_ratio.py DIR/160m_float32_host_48.vmfb DIR/160m_int4_g32_host_48.vmfb --rounds 8

`benchmarks/quantized.py` measures one scheme after the other, so a change of the other core's load between them
moves the int4 / float32 ratio. Here every round runs every module and loop in turn (the order rotating round by
round): a generate of 1 new token and of `--new`, one thread, CPU time of this process (`time.process_time`),
decode tokens/s = (new - 1) / (time(new) - time(1)); per round, each module's ratio to the first module's (the
float32 route) in the same loop. Loops: `numpy` (`app/lm/greedy.py`: argmax off the mapped logits) and `torch`
(each step through `Decoding.next_tokens`, as before it). The prompt is `quantized.py`'s (16 tokens, seed 1); the
tokens of the two loops are compared (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_isa import cpu_model  # benchmarks/cpu_isa.py: the CPU line every table names
from generate import load  # benchmarks/generate.py: the load average

LOOPS = ("numpy", "torch")


def generator(lm: Any, loop: str) -> Any:
    """`lm.generate(ids, max_new_tokens=n)`'s new tokens, its greedy steps in numpy or (`torch`) in torch."""
    from fx_rewrites.app.lm import greedy

    def run(ids: torch.Tensor, n: int) -> torch.Tensor:
        plain = greedy.plain
        if loop == "torch":
            greedy.plain = lambda decoding: None
        try:
            return lm.generate(ids, max_new_tokens=n)[:, ids.shape[1] :]
        finally:
            greedy.plain = plain

    return run


def rates(gens: dict[tuple[str, str], Any], prompt: torch.Tensor, new: int, rounds: int) -> dict[Any, list[float]]:
    """Each generator's decode tokens/s per round, the generators' order rotated each round."""
    names = list(gens)
    out: dict[Any, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            times = []
            for n in (1, new):
                start = time.process_time()
                gens[name](prompt, n)
                times.append(time.process_time() - start)
            out[name].append((new - 1) / (times[1] - times[0]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vmfb", type=Path, nargs="+", help="saved compile_lm modules; the first is the reference")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    import fx_rewrites

    torch.set_num_threads(1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    modules = {path.stem: fx_rewrites.load(path) for path in args.vmfb}
    gens = {(name, loop): generator(lm, loop) for name, lm in modules.items() for loop in LOOPS}
    same = {name: torch.equal(*(gens[name, loop](prompt, args.new) for loop in LOOPS)) for name in modules}  # warm-up
    print(f"# prompt {args.prompt}, {args.new} new tokens, 1 thread, CPU time; {cpu_model()}; load {load()}")
    got = rates(gens, prompt, args.new, args.rounds)
    first = args.vmfb[0].stem
    print("| module | loop | decode tok/s per round | median | x the first module, per round | median | tokens equal |")
    print("|---|---|---|---:|---|---:|---|")
    for (name, loop), values in got.items():
        ratios = [v / f for v, f in zip(values, got[first, loop])]
        print(
            f"| {name} | {loop} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.2f} | "
            f"{' / '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} | "
            f"{'yes' if same[name] else 'NO'} |"
        )
    print(f"# end: load {load()}")


if __name__ == "__main__":
    main()
