"""flash-linear-attention's KDA kernels on the shapes of bench/glm5_kernel_bench.cpp (64 heads of
128, bf16 q/k/v, fp32 state), timed the same way (an L2 flush of 256 MB before every repetition,
CUDA events around the call, median), with the same case names so that glm5_bench.sh can print them
side by side.

fla takes the per-channel log-decay g [B, T, H, K] in fp32; when its chunk_kda accepts the raw gate
(use_gate_in_kernel with A_log / dt_bias / lower_bound, safe_gate) that form is timed, as metrale
fuses the gate too; otherwise g is computed before the timed call (and the case name says
"(g given)"). beta is passed after its sigmoid in both.

Usage: python3 kda_fla_bench.py FLA_PARENT_DIR [--reps N] [--json FILE]
FLA_PARENT_DIR holds the `fla/` package (a copy of its source, never committed).
"""
import argparse
import inspect
import json
import sys

import torch

H, D = 64, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("fla_parent")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, args.fla_parent)
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    device = "cuda"
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    chunk_params = inspect.signature(chunk_kda).parameters
    gate_in_kernel = "use_gate_in_kernel" in chunk_params

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

    results = []

    def add(name, fn):
        ms = timeit(fn)
        results.append({"name": name, "us": ms * 1e3})
        print(f"{name:40} {ms * 1e3:10.1f} us", flush=True)

    def inputs(batch, tokens):
        q = torch.randn(batch, tokens, H, D, dtype=torch.bfloat16, device=device)
        k = torch.randn(batch, tokens, H, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(batch, tokens, H, D, dtype=torch.bfloat16, device=device)
        f = (torch.randn(batch, tokens, H, D, device=device) * 0.5).to(torch.bfloat16)
        A_log = torch.randn(H, device=device) * 0.1
        dt_bias = torch.randn(H * D, device=device) - 4.0
        beta = torch.randn(batch, tokens, H, device=device).to(torch.bfloat16).sigmoid()
        phi = f.float() + dt_bias.view(H, D)
        g = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * phi)  # the bounded gate, lambda = -5
        return q, k, v, f, A_log, dt_bias, beta, g

    scale = D ** -0.5
    for batch in (1, 8, 32, 128):
        q, k, v, f, A_log, dt_bias, beta, g = inputs(batch, 1)
        h0 = torch.randn(batch, H, D, D, device=device) * 0.05
        add(f"kda recurrent decode b{batch}", lambda: fused_recurrent_kda(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True))

    cases = [("8K", [8192]), ("32K", [32768]), ("8K as 4x2K", [2048] * 4),
             ("8K mixed 16 seqs", [1024, 17, 900, 64, 1500, 333, 700, 120, 1000, 65, 400, 600, 250, 99, 500, 420])]
    for label, lens in cases:
        tokens = sum(lens)
        q, k, v, f, A_log, dt_bias, beta, g = inputs(1, tokens)
        h0 = torch.zeros(len(lens), H, D, D, device=device)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long, device=device)
        common = dict(q=q, k=k, v=v, beta=beta, scale=scale, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu if len(lens) > 1 else None)
        if gate_in_kernel and "lower_bound" in chunk_params:
            # The bounded gate in the kernel (safe_gate: lambda * sigmoid(exp(A_log) (f + dt_bias)), the
            # form glm5_next uses) with fla's M = 16 tensor-core path.
            extra = dict(g=f, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
            if "safe_gate" in chunk_params:
                extra["safe_gate"] = True
            add(f"kda chunked prefill {label}", lambda: chunk_kda(**common, **extra))
        else:
            add(f"kda chunked prefill {label} (g given)", lambda: chunk_kda(g=g, **common))

    if args.json:
        with open(args.json, "w") as out:
            json.dump({"engine": "fla", "results": results}, out)


if __name__ == "__main__":
    main()
