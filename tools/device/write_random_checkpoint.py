#!/usr/bin/env python3
"""Writes a checkpoint directory of random bf16 weights for a preset config (transformers' own names
and shapes for that architecture), in safetensors shards with an index: the input of the load-time
benchmark (tools/device/load_bench.sh). The values are random normals scaled by 0.02, generated on
the GPU when there is one; nothing of the model is built but its meta-device skeleton.

usage: write_random_checkpoint.py CONFIG.json OUT_DIR [--shard-gb 4]
"""
import argparse
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--shard-gb", type=float, default=4.0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shutil.copy(args.config, os.path.join(args.out, "config.json"))
    config = AutoConfig.from_pretrained(args.out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    shard, shard_bytes, shards, weight_map = {}, 0, [], {}
    total = 0
    begin = time.time()

    def flush():
        nonlocal shard, shard_bytes
        if not shard:
            return
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, os.path.join(args.out, name), metadata={"format": "pt"})
        for key in shard:
            weight_map[key] = name
        shards.append(name)
        shard, shard_bytes = {}, 0

    for key, tensor in model.state_dict().items():
        value = torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.float32)
        value = (value * 0.02).to(torch.bfloat16).cpu()
        shard[key] = value
        nbytes = value.numel() * value.element_size()
        shard_bytes += nbytes
        total += nbytes
        if shard_bytes >= args.shard_gb * 1e9:
            flush()
    flush()
    # Shards are named in order; rename to the hub's "-of-N" convention now that N is known.
    final = {}
    for i, name in enumerate(shards):
        new = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(os.path.join(args.out, name), os.path.join(args.out, new))
        final[name] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    print(f"wrote {total / 1e9:.2f} GB in {len(shards)} shards to {args.out} in {time.time() - begin:.1f} s")


if __name__ == "__main__":
    main()
