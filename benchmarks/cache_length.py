"""Decode time per token against the static cache's length: `compile_lm` and eager `generate`.

    python benchmarks/cache_length.py --prompt 64 --cache 2048
    python benchmarks/cache_length.py --prompt 1024 --cache 1064

A tiny Llama (hidden 512, 4 layers, 8 / 4 heads, MLP 1376, vocab 1000, seeded random weights x 2); `generate` of 1
and of 33 tokens, the difference / 32 per token; one thread, CPU time of this process, routes in turn each round.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--cache", type=int, default=2048, help="compile_lm's max_cache_len")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=33, help="tokens of the longer generate")
    args = parser.parse_args(argv)

    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()  # PyPI's torchvision (a CUDA build) is imported by transformers
    import torch
    import transformers

    import fx_rewrites

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=max(8192, args.cache),
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # logits far from ties
    ids = torch.randint(0, 1000, (1, args.prompt))
    lm = fx_rewrites.compile_lm(model, max_cache_len=args.cache, batch_size=1)
    routes = {
        "eager": lambda n: model.generate(ids, max_new_tokens=n, do_sample=False),
        "iree": lambda n: lm.generate(ids, max_new_tokens=n),
    }
    for round_ in range(args.rounds):
        for name, generate in routes.items():
            with torch.no_grad():
                start = time.process_time()
                one = generate(1)
                mid = time.process_time()
                many = generate(args.new)
                end = time.process_time()
            per_token = ((end - mid) - (mid - start)) / (args.new - 1) * 1e3
            print(
                f"round {round_} {name:5s} prompt {args.prompt} cache {args.cache}: "
                f"prefill {(mid - start) * 1e3:.0f} ms, "
                f"decode {per_token:.2f} ms a token ({one.shape[1]} -> {many.shape[1]} tokens)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
