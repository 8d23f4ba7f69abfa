"""Throughput of the KV quantization codecs (attnlab.quant) against a plain fp32 memory copy, CPU.

    python bench/quant_codec.py [--values 16777216] [--width 128] [--rounds 5] [--threads N] [--no-record]

One random fp32 tensor of `values` values, shaped (values / width, width) like a (tokens, head_dim) slice of a KV
cache, is quantized and dequantized by every codec: ggml's q8_0 and q4_0, NF4 (blocks of 32) and KIVI at 4 and 2
bits (groups of 32; "values" per token, "keys" per channel). Figures are GB/s of fp32 data (4 bytes per value:
read by quantize, written by dequantize, which also allocates its output), medians over rounds; every round times
each codec and the reference, a copy into a preallocated tensor (`dst.copy_(src)`), in rotated order, and
ratios are against the copy's median in the same run. A copy into a fresh tensor (`src.clone()`) is shown too:
at this size faulting in a new 64 MB output costs more than the copy, and every dequantize pays it. Rows "(C)":
the C quantizer a quantized cache writes with (attnlab.kernels.cpu, the same bytes, one thread); its decode
happens inside the attention kernel, so it has no dequantize row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OtherLoad, append_rows, environment, median, print_table, row, spread, time_once  # noqa: E402

from attnlab import quant  # noqa: E402
from attnlab.kernels import cpu as cpu_kernels  # noqa: E402

CODECS = {  # name -> (quantize, dequantize given the width, bytes per value)
    **{
        fmt: (
            lambda x, f=fmt: quant.quantize(x, f),
            lambda q, n, f=fmt: quant.dequantize(q, f),
            quant.bytes_per_value(fmt),
        )
        for fmt in quant.FORMATS
    },
    **{
        f"kivi{bits} {kind}": (
            lambda x, b=bits, k=kind: quant.quantize_kivi(x, b, 32, per_channel=k == "keys"),
            lambda q, n, b=bits, k=kind: quant.dequantize_kivi(q, b, 32, k == "keys", n),
            quant.kivi_bytes_per_value(bits, 32),
        )
        for bits in (4, 2)
        for kind in ("values", "keys")
    },
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=1 << 24, help="fp32 values in the tensor (default 16M)")
    parser.add_argument("--width", type=int, default=128, help="last dimension (a multiple of 32)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-record", action="store_true", help="do not append to bench/results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.values // args.width // 32 * 32  # whole KIVI key groups
    x = torch.randn(tokens, args.width, generator=torch.Generator().manual_seed(0))  # (T, width)
    dst = torch.empty_like(x)
    gigabytes = x.numel() * 4 / 1e9
    env = environment()
    print(f"quant_codec: {x.numel():,} fp32 values ({tuple(x.shape)}), CPU, {torch.get_num_threads()} threads")

    codes = {name: quantize(x) for name, (quantize, _, _) in CODECS.items()}  # warm-up round, and the codes
    error = {}
    for name, (_, dequantize, _) in CODECS.items():
        x_hat = dequantize(codes[name], args.width)
        error[name] = ((x_hat - x).square().mean() / x.square().mean()).sqrt().item()
    tasks = {"copy": lambda: dst.copy_(x), "clone": lambda: x.clone()}
    c_formats = quant.FORMATS if cpu_kernels.available() else ()
    for fmt in c_formats:
        tasks[f"{fmt} (C) quantize"] = lambda f=fmt: cpu_kernels.quantize(f, x)
    for name, (quantize, dequantize, _) in CODECS.items():
        tasks[f"{name} quantize"] = lambda f=quantize: f(x)
        tasks[f"{name} dequantize"] = lambda f=dequantize, q=codes[name]: f(q, args.width)
    names = list(tasks)
    seconds = {name: [] for name in names}
    load = OtherLoad()
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate which goes first
            seconds[name].append(time_once(tasks[name]))
    other = load.fraction()
    gbps = {name: gigabytes / median(s) for name, s in seconds.items()}

    config = {"values": x.numel(), "shape": list(x.shape), "codecs": list(CODECS), "kivi_group": 32}
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    table = [
        ["fp32 copy (dst.copy_)", "4", f"{gbps['copy']:.2f}", "1.000", "", "", ""],
        ["fp32 clone (fresh dst)", "4", f"{gbps['clone']:.2f}", f"{gbps['clone'] / gbps['copy']:.3f}", "", "", ""],
    ]
    records = []
    for name, (_, _, bytes_per_value) in CODECS.items():
        q_gbps, dq_gbps = gbps[f"{name} quantize"], gbps[f"{name} dequantize"]
        figures = {
            "codec": name,
            **config,
            "bytes_per_value": bytes_per_value,
            "relative_rms_error": error[name],
            "quantize_seconds": seconds[f"{name} quantize"],
            "dequantize_seconds": seconds[f"{name} dequantize"],
            "copy_seconds": seconds["copy"],
            "clone_gbps": gbps["clone"],
            "quantize_gbps": q_gbps,
            "dequantize_gbps": dq_gbps,
            "copy_gbps": gbps["copy"],
            "quantize_vs_copy": q_gbps / gbps["copy"],
            "dequantize_vs_copy": dq_gbps / gbps["copy"],
            "spread": max(spread(seconds[f"{name} quantize"]), spread(seconds[f"{name} dequantize"])),
            "rounds": args.rounds,
            "other_load": other,
        }
        records.append(row("quant_codec", config_hash, env, **figures))
        table.append(
            [
                name,
                f"{bytes_per_value:.4g}",
                f"{q_gbps:.2f}",
                f"{q_gbps / gbps['copy']:.3f}",
                f"{dq_gbps:.2f}",
                f"{dq_gbps / gbps['copy']:.3f}",
                f"{error[name]:.4f}",
            ]
        )
    for fmt in c_formats:
        q_gbps = gbps[f"{fmt} (C) quantize"]
        figures = {"codec": f"{fmt} (C)", **config, "bytes_per_value": quant.bytes_per_value(fmt),
                   "quantize_seconds": seconds[f"{fmt} (C) quantize"], "copy_seconds": seconds["copy"],
                   "quantize_gbps": q_gbps, "copy_gbps": gbps["copy"], "quantize_vs_copy": q_gbps / gbps["copy"],
                   "rounds": args.rounds, "other_load": other}  # fmt: skip
        records.append(row("quant_codec", config_hash, env, **figures))
        table.append([f"{fmt} (C)", f"{quant.bytes_per_value(fmt):.4g}", f"{q_gbps:.2f}",
                      f"{q_gbps / gbps['copy']:.3f}", "-", "-", f"{error[fmt]:.4f}"])  # fmt: skip
    headers = ["codec", "bytes/value", "quantize GB/s", "x copy", "dequantize GB/s", "x copy", "rel. RMS error"]
    print_table(headers, table)
    if other is not None and other > 0.1:
        print(f"\nWARNING: other processes used {other:.0%} of the machine's CPU during the run")
    if not args.no_record:
        print(f"recorded {len(records)} rows in {append_rows('quant_codec', records)}")


if __name__ == "__main__":
    main()
