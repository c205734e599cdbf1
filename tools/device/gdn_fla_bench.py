"""flash-linear-attention's Gated DeltaNet kernels on the shapes of bench/gdn_kernel_bench.cpp, timed
the same way (an L2 flush of 256 MB before every repetition, CUDA events around the call, median).

Usage: python3 gdn_fla_bench.py FLA_PARENT_DIR [--reps N] [--json FILE]
FLA_PARENT_DIR holds the `fla/` package (a copy of its source, never committed).
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

HK, HV, D = 16, 32, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("fla_parent")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, args.fla_parent)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    device = "cuda"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def timeit(fn):
        for _ in range(3):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(args.reps)]
        for i in range(args.reps):
            flush.zero_()
            starts[i].record()
            fn()
            stops[i].record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in zip(starts, stops))
        return ms[len(ms) // 2]

    def gates(batch, tokens):
        a = torch.randn(batch, tokens, HV, device=device)
        A_log = torch.randn(HV, device=device) * 0.5
        dt_bias = torch.randn(HV, device=device) * 0.5
        g = -A_log.exp() * F.softplus(a + dt_bias)
        beta = torch.randn(batch, tokens, HV, device=device).sigmoid()
        return g, beta

    results = []

    def add(name, fn):
        ms = timeit(fn)
        results.append({"name": name, "us": ms * 1e3})
        print(f"{name:34} {ms * 1e3:10.1f} us", flush=True)

    scale = D ** -0.5
    for batch in (1, 8, 32, 128):
        q = torch.randn(batch, 1, HK, D, dtype=torch.bfloat16, device=device)
        k = torch.randn(batch, 1, HK, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(batch, 1, HV, D, dtype=torch.bfloat16, device=device)
        g, beta = gates(batch, 1)
        h0 = torch.randn(batch, HV, D, D, device=device) * 0.05
        add(f"recurrent decode b{batch}", lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True))

    cases = [("8K", [8192]), ("32K", [32768]), ("8K as 4x2K", [2048] * 4), ("32K as 8x4K", [4096] * 8),
             ("8K mixed 16 seqs", [1024, 17, 900, 64, 1500, 333, 700, 120, 1000, 65, 400, 600, 250, 99, 500, 420])]
    for name, lens in cases:
        tokens = sum(lens)
        q = torch.randn(1, tokens, HK, D, dtype=torch.bfloat16, device=device)
        k = torch.randn(1, tokens, HK, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(1, tokens, HV, D, dtype=torch.bfloat16, device=device)
        g, beta = gates(1, tokens)
        h0 = torch.zeros(len(lens), HV, D, D, device=device)
        cu_cpu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.long)
        cu = cu_cpu.to(device) if len(lens) > 1 else None
        add(f"chunked prefill {name}", lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu if cu is not None else None))

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": "fla", "results": results}, f)


if __name__ == "__main__":
    main()
