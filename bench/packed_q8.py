"""8-bit-activation matvecs over rows packed 16 at a time (qmatmul.pack_q8) against the row-by-row 8-bit kernel and
the fp32-activation kernel, at SmolLM2-135M's shapes, in one process (issue 16).

    python bench/packed_q8.py [--threads 1] [--copies 60]

Each shape is held as --copies distinct random matrices (3 for the LM head), multiplied in turn, so the weights come
from memory as in decoding; a figure is µs per matrix (the mean over 5 passes) and GB/s of the weights read. Also
the same matrix again and again ("cache"). Prints only (no record).
"""

from __future__ import annotations

import argparse
import time

import torch

from attnlab.kernels.cpu import qmatmul
from attnlab.model.qlinear import encode

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 49152)]  # (k, n)


def seconds(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--copies", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not qmatmul.available():
        raise SystemExit("the C kernels do not build here")
    print(f"{args.threads} thread(s); packed rows multiplied by AVX-512 VNNI: {qmatmul.packed_fast()}")
    for k, n in SHAPES:
        w, x = torch.randn(n, k), torch.randn(1, k)
        for fmt in ("q4_1", "q8_0"):
            copies = [encode(w, fmt) for _ in range(args.copies if n < 10_000 else 3)]
            packs = [qmatmul.pack_q8(fmt, c, k) for c in copies]
            cells = []
            for name, tensors, options in [
                ("fp32 activations", copies, {"gemm": False}),
                ("8-bit, rows", copies, {"gemm": False, "activations": "q8"}),
                ("8-bit, packed", packs, {"activations": "q8", "packed": True}),
            ]:

                def call(c, o=options, f=fmt, v=x):
                    return qmatmul.matmul(f, c, v, None, **o)

                one = seconds(lambda t=tensors, call=call: call(t[0]), 20)
                each = seconds(lambda t=tensors, call=call: [call(c) for c in t], 5)
                each /= len(tensors)
                gbs = copies[0].numel() / each / 1e9
                cells.append(f"{name}: cache {one * 1e6:.0f} µs, memory {each * 1e6:.0f} µs ({gbs:.1f} GB/s)")
            print(f"{k} -> {n} {fmt}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
