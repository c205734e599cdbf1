#!/usr/bin/env python3
"""Reference ("golden") test cases for metrale, made with transformers 5.17.0, and the bundled default model.

Run it where torch and transformers 5.17.0 are installed (the GPU machine; see tools/goldens/README.md and
tools/device/goldens.sh). Everything runs on the CPU in fp32, single-threaded, so the output is deterministic
given the seeds below.

    python3 make_goldens.py --out tests/goldens --default-model models/default

For every case in CASES:

1. Build the config dict into a transformers config (`AutoConfig.for_model`), then, after
   `torch.manual_seed(seed)`, the model with `AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")`
   in fp32.
2. Re-initialise every *parameter* from a `torch.Generator` seeded with `seed` (in `named_parameters()` order):
   the final `model.norm.weight` ~ N(final_norm_mean, final_norm_std); other norm weights (1-D, name containing
   "norm") ~ N(1, 0.1); the token embedding ~ N(0, std_embed); an untied `lm_head.weight` ~ N(0, std_lm_head); MoE
   router `mlp.gate.weight` ~ N(0, std_router); every other weight (attention projections, MLP, 3-D experts)
   ~ N(0, std_linear). Hybrid models (qwen3_next, qwen3_5_text, qwen3_5_moe_text, qwen4_exp_text): their zero-centred norms scale by
   (1 + w), so those weights get the same *scale* (w ~ N(mean - 1, std)); the GDN output norm
   `linear_attn.norm.weight` is a plain weight ~ N(1, 0.1); `linear_attn.A_log` ~ U(-4, 0.5) (decay rates
   exp(A_log) from 0.02 to 1.6: some heads remember for tens of tokens, others for a few), `linear_attn.dt_bias`
   ~ N(0, 0.3), `linear_attn.conv1d.weight` ~ N(0, std_conv), the shared-expert gate ~ N(0, std_router).
   qwen4_exp: the PLE tables ~ N(0, std_ple_table), the PLE conv ~ N(0, std_conv), the hyper-connection weights
   ~ N(0, std_linear) (their grouped norms are zero-centred norms); with `eos_positions` the input ids at those
   positions are set to the PLE EOS (the first eos_token_id), and the PLE buffers are checked against the formulas
   of qwen.md §7.2 before anything runs.
   Values: INIT, with TIED_INIT on top for tied-embedding models (see the comment there), HYBRID_INIT for GDN.
   Larger-than-default weights make the logits far from uniform, so greedy argmax margins are mostly clear (they
   are recorded, see below). case.json's "init" holds the values used.
3. Round every parameter to bf16 values (`p.copy_(p.to(bfloat16).to(float32))`), parameters only: buffers such as
   the rotary `inv_freq` stay exact fp32 (shared/arch/qwen.md §10.1); the script checks `inv_freq` against the fp32
   formula `1 / theta^(arange(0, d, 2) / d)`.
4. Math is fp32 (`torch.set_default_dtype(float32)`, TF32 off, `set_float32_matmul_precision("highest")`),
   eager attention, `model.eval()`, `torch.no_grad()`.
5. Input ids: `torch.randint(2, vocab, (num_tokens,))` from a generator seeded with `seed + 1` (0 = bos and
   1 = eos never occur in the inputs).
6. Reference logits: one full forward (`use_cache=False`) of `input_ids` -> `logits.npy`, shape [T, vocab],
   `<f4`, C order.
7. Acceptance ("a case is kept only when transformers' own token-by-token decoding agrees with its full forward to
   about 1e-6", qwen.md §9.2; hybrid cases allow `max_rel_l2` 5e-5 since the recurrent and chunked GDN kernels of
   the two paths differ by order 1e-5): the same ids fed one token at a time through the model's own `DynamicCache`
   (first call `use_cache=True, past_key_values=None`, then the returned cache); the per-step logits are stacked
   and compared with the full forward: `incremental_rel_l2 = ||inc - full|| / ||full||` (float64 norms). Above
   `--max-rel-l2` (default 2e-6) the seed is rejected. Seeds `seed + 1000 k`, k < SEED_TRIES, are tried in order;
   the first that passes and whose greedy continuation (step 9) is clear and varied (every step's top-2 margin
   >= MIN_GREEDY_MARGIN, at least max(3, N/4) distinct tokens) is kept; if none is, the passing seed with clear
   margins and the most distinct tokens. If no seed passes, the case fails (non-zero exit at the end; the
   optional case `qwen3_sliding` is skipped instead). A chunked variant (prefill 16 tokens, then chunks of 5) is
   recorded as `chunked_rel_l2` for information.
8. Model files: a bf16 deep copy saved with `save_pretrained(safe_serialization=True)` -> `model/config.json`,
   `model/model.safetensors` (exact: values are bf16-representable), `model/generation_config.json` (bos 0, eos 1).
   The file's keys are checked (tied models have no `lm_head.weight`; MoE experts are stored per expert:
   `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`). For `layout: fused` the safetensors file is
   rewritten with `model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and
   `model.layers.{i}.mlp.experts.down_proj [E, H, I]` instead of the per-expert keys.
   The saved directory is reloaded with `from_pretrained(dtype=float32, attn_implementation="eager")` and its full
   forward compared with the original (`reload_rel_l2`, must be <= 1e-6; missing/unexpected keys fail the case).
9. Greedy: `model.generate(prompt, max_new_tokens=N, do_sample=False, use_cache=True)` with EOS stopping disabled
   (`eos_token_id=None` both in the passed GenerationConfig and in `model.generation_config`), so exactly N new
   tokens come out; the C++ test must likewise ignore EOS. The script checks every new token is the argmax of
   transformers' raw step logits (`output_logits=True`) and records the top-1 minus top-2 logit margin of each
   step (`greedy_margins`), so a test can tell near-ties; `greedy.full_forward_agrees` says whether a full forward
   over prompt+output has the same argmaxes.

case.json: {name, model_type, description, seed, num_tokens, transformers_version, torch_version,
incremental_rel_l2, chunked_rel_l2, reload_rel_l2, greedy {prompt_ids, output_ids, max_new_tokens,
full_forward_agrees}, greedy_margins, transformers_bf16_rel_l2 (transformers' own bf16 inference of the saved model
against the fp32 logits: the yardstick for bf16 engines), logits_min_margin (smallest top-2 margin over the rows of logits.npy),
layout, layer_types, mlp_kinds, attn_implementation, experts_implementation, ignore_eos, init}.

The default model (`--default-model DIR`): a random-weight Qwen3ForCausalLM over the real Qwen3 vocabulary
(vocab 151936, hidden 32, 2 layers, 2 heads, 1 KV head, head_dim 16, intermediate 64, tied embeddings,
rope_theta 1e6, max_position_embeddings 40960, bos 151643, eos 151645; generation_config eos [151645, 151643]),
saved bf16 with save_pretrained, made the same way (steps 1-4 with TIED_INIT, 8) with seed DEFAULT_SEED. The
tokenizer files beside it are not written here (scripts/install-deps.sh copies them).
"""

import argparse
import copy
import json
import os
import shutil
import sys
import traceback

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

EXPECTED_TRANSFORMERS = "5.17.0"
MAX_REL_L2 = 2e-6
MAX_RELOAD_REL_L2 = 1e-6
DEFAULT_SEED = 7001

SEED_TRIES = 6
MIN_GREEDY_MARGIN = 0.02  # fp32 engines differ from transformers by ~1e-5; bf16 tests read greedy_margins

# Weight init (step 2 of the docstring). Untied models: the lm_head sets the logit scale.
INIT = {"std_linear": 0.08, "std_embed": 0.4, "std_lm_head": 0.3, "std_router": 0.3, "norm_mean": 1.0,
        "norm_std": 0.1, "final_norm_mean": 1.0, "final_norm_std": 0.1}
# Tied models: logits = g * norm(h) . E, and h holds the input token's own embedding e_x, which biases token x to
# predict itself by about sqrt(H) * std_embed / rms(h) logit standard deviations; greedy decoding then repeats
# one token. A small embedding (0.04; the layers' residual adds have rms ~0.6) keeps that bias small, and a
# final-norm gain g of ~10 restores the logit scale (logit std ~3).
TIED_INIT = {"std_embed": 0.04, "final_norm_mean": 10.0, "final_norm_std": 1.0}
# Gated DeltaNet parameters (hybrid models): the short conv sees raw projections of order one.
HYBRID_INIT = {"std_conv": 0.3, "a_log_low": -4.0, "a_log_high": 0.5, "dt_bias_std": 0.3}
# qwen4_exp: the PLE table rows (the n-gram embeddings) ~ N(0, std_ple_table), the PLE conv ~ N(0, std_conv); the
# hyper-connection mixing weights are linear weights (std_linear), their grouped norms zero-centred like the others.
QWEN4_INIT = {"std_ple_table": 0.5}

# Text models whose RMSNorms are zero-centred (scale 1 + w), with their GDN layers.
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text")
# qwen4_exp: hyper-connection streams instead of layer norms, QSA attention layers, PLE tables (qwen.md §7).
QWEN4_TYPES = ("qwen4_exp_text",)
# Fallback classes for the text model types of the composite models, if the Auto mappings lack them.
TEXT_CLASSES = {
    "qwen3_5_text": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen4_exp_text": ("transformers.models.qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM"),
}

_QWEN3_BASE = dict(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=1024,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
    tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, use_sliding_window=False,
)

_MOE_BASE = dict(
    model_type="qwen3_moe", vocab_size=448, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, num_experts=8,
    num_experts_per_tok=2, output_router_logits=False,
)


_HYBRID_COMMON = dict(
    vocab_size=256, hidden_size=64, max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_act="silu",
    attention_bias=False, bos_token_id=0, eos_token_id=1, linear_conv_kernel_dim=4,
)

# qwen3_next: GDN layers 0, 2 and gated attention layers 1, 3 (full_attention_interval 2); MoE + shared expert on
# layers 0, 1, 3 and a dense MLP on layer 2 (mlp_only_layers). No partial_rotary_factor: the injected 0.25 applies.
_QWEN3_NEXT = dict(
    _HYBRID_COMMON, model_type="qwen3_next", num_hidden_layers=4, full_attention_interval=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
    intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
    tie_word_embeddings=False, output_router_logits=False,
)

# qwen3_5 text: explicit layer_types (GDN, attention, GDN, GDN, attention), dense MLPs, partial_rotary_factor 0.5
# given inside rope_parameters (rotary 32 of head_dim 64), mrope_section summing to rotary_dim / 2.
_QWEN3_5 = dict(
    _HYBRID_COMMON, model_type="qwen3_5_text", num_hidden_layers=5,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [6, 5, 5], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    intermediate_size=128, tie_word_embeddings=True,
)

# qwen3_5_moe text: GDN, attention, GDN, attention (full_attention_interval 2); MoE + shared expert on every layer
# (always renormalised), head_dim 128 with the default rotary 0.25 (32), dk = dv = 128.
_QWEN3_5_MOE = dict(
    _HYBRID_COMMON, model_type="qwen3_5_moe_text", num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [6, 5, 5],
                     "mrope_interleaved": True},
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    tie_word_embeddings=False, output_router_logits=False,
)


# qwen4_exp text (Qwen4ExpForCausalLM): GDN+PLE, QSA, GDN+PLE, QSA. QSA with 8 index heads (no top-k ties at the
# cut-off, qwen.md §10.2) of d_idx 32 >= rotary 16 (head_dim 32, partial_rotary_factor 0.5), c 4 and budget 16
# (block_topk 4: dense up to 19 visible keys, sparse for 86% of 140 positions); PLE 3-grams, 4 heads per order
# (NH 8 x d_head 8), base 1009, tables of R_pad = 8192 rows saved in 3 row shards (2731, 2731, 2730);
# GDN dk = dv = 64 (the CUDA chunked kernel's sizes); MoE 4 experts top-2 + shared expert; 4 streams, rank 16.
_QWEN4_EXP = dict(
    _HYBRID_COMMON, model_type="qwen4_exp_text", num_hidden_layers=4,
    # full_attention: the name every version of the config accepts (rewritten to its QSA kind).
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    norm_topk_prob=True, tie_word_embeddings=False, output_router_logits=False,
    hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 3], ple_embed_dim=64, ple_conv_kernel_size=4, ngram_size=3,
    heads_per_ngram=4, ngram_vocab_size_base=1009, make_ngram_vocab_size_divisible_by=128, seed=1234,
    split_ngram_parts=3, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=16,
    indexer_compress_ratio=4, output_gate_type="sigmoid",
)


def _cfg(base, **over):
    d = copy.deepcopy(base)
    d.update(over)
    return d


CASES = [
    dict(name="qwen3_tied", init=TIED_INIT, seed=101, num_tokens=40, prompt_len=12, max_new_tokens=16,
         description="qwen3, tied embeddings, GQA 4 heads / 2 KV heads, head_dim 16, rope_theta 1e6, 2 layers.",
         config=_cfg(_QWEN3_BASE, num_hidden_layers=2)),
    dict(name="qwen3_untied", seed=202, num_tokens=40, prompt_len=12, max_new_tokens=16,
         description="qwen3, untied lm_head, 4 heads / 1 KV head (MQA-like GQA), head_dim 32 (q_proj out 128 > "
                     "hidden 64), rope_theta 1e4, 2 layers.",
         config=_cfg(_QWEN3_BASE, tie_word_embeddings=False, num_key_value_heads=1, head_dim=32, vocab_size=384,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    dict(name="qwen3_long", init=TIED_INIT, seed=303, num_tokens=130, prompt_len=100, max_new_tokens=32,
         description="qwen3, tied, 4 heads / 2 KV heads, head_dim 16, 130 tokens (over 8 KV blocks of 16); greedy "
                     "prompt of 100 tokens plus 32 new tokens.",
         config=_cfg(_QWEN3_BASE, num_hidden_layers=2)),
    dict(name="qwen3_moe", seed=404, num_tokens=40, prompt_len=12, max_new_tokens=16,
         description="qwen3_moe, 3 layers with mlp_only_layers=[1] (layers 0 and 2 MoE, layer 1 dense MLP of "
                     "intermediate_size 128), 8 experts top-2 of moe_intermediate_size 32, norm_topk_prob=True, "
                     "head_dim 32 given explicitly in config.json (hidden 64 / 4 heads would be 16), untied, "
                     "experts stored per expert as saved by transformers 5.17.",
         config=_cfg(_MOE_BASE, head_dim=32, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)),
    dict(name="qwen3_moe_fused", init=TIED_INIT, seed=505, num_tokens=40, prompt_len=12, max_new_tokens=16, layout="fused",
         description="qwen3_moe, 2 layers, all MoE (decoder_sparse_step=1), 8 experts top-2, norm_topk_prob=False, "
                     "tied embeddings, head_dim = hidden/heads = 16 (no head_dim in config), experts stored fused: "
                     "mlp.experts.gate_up_proj [E, 2I, H] (gate rows then up rows) and mlp.experts.down_proj "
                     "[E, H, I].",
         config=_cfg(_MOE_BASE, num_hidden_layers=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                     tie_word_embeddings=True)),
    dict(name="qwen3_sliding", init=TIED_INIT, seed=606, num_tokens=40, prompt_len=10, max_new_tokens=20, optional=True,
         description="qwen3, use_sliding_window=True, sliding_window=8, max_window_layers=1, 3 layers: layer 0 "
                     "full_attention, layers 1-2 sliding_attention (layer_types derived by the config: sliding iff "
                     "i >= max_window_layers). Eager sliding mask: query i sees keys j with i-8 < j <= i, i.e. 8 "
                     "keys including itself (see sliding_window_keys_seen).",
         config=_cfg(_QWEN3_BASE, num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                     max_window_layers=1)),
    dict(name="qwen3_next", seed=707, num_tokens=140, prompt_len=100, max_new_tokens=32, max_rel_l2=5e-5,
         init=HYBRID_INIT,
         description="qwen3_next, 4 layers: Gated DeltaNet (layers 0, 2; Hk 1, Hv 2, dk = dv = 64, conv 4, grouped "
                     "in_proj_qkvz / in_proj_ba) and gated attention (layers 1, 3; 2 heads / 1 KV head, head_dim 64, "
                     "injected partial_rotary_factor 0.25); MoE 4 experts top-2 + sigmoid-gated shared expert on "
                     "layers 0, 1, 3, dense MLP on layer 2 (mlp_only_layers); 140 tokens (three GDN chunks of 64).",
         config=_QWEN3_NEXT),
    dict(name="qwen3_5", init=dict(TIED_INIT, **HYBRID_INIT), seed=808, num_tokens=140, prompt_len=100,
         max_new_tokens=32, max_rel_l2=5e-5,
         description="qwen3_5 text (Qwen3_5ForCausalLM), 5 layers from layer_types: GDN, attention, GDN, GDN, "
                     "attention; split in_proj_qkv / z / b / a, Hk 2, Hv 4, dk = dv = 64; gated attention 4 heads / 2 "
                     "KV heads, head_dim 64, partial_rotary_factor 0.5; dense MLPs; tied embeddings; 140 tokens.",
         config=_QWEN3_5),
    dict(name="qwen3_5_moe", seed=909, num_tokens=140, prompt_len=100, max_new_tokens=32, max_rel_l2=5e-5,
         init=HYBRID_INIT, layout="fused",
         description="qwen3_5_moe text (Qwen3_5MoeForCausalLM), 4 layers: GDN (Hk 1, Hv 2, dk = dv = 128) and gated "
                     "attention (2 heads / 1 KV head, head_dim 128, rotary 0.25) alternating; MoE 8 experts top-2 "
                     "(always renormalised) + shared expert on every layer, experts stored fused "
                     "(gate_up_proj [E, 2I, H], down_proj [E, H, I]); 140 tokens.",
         config=_QWEN3_5_MOE),
    dict(name="qwen4_exp", seed=1111, num_tokens=140, prompt_len=100, max_new_tokens=32, max_rel_l2=5e-5,
         init=HYBRID_INIT, eos_positions=[20, 21, 57],
         description="qwen4_exp text (Qwen4ExpForCausalLM), 4 layers: GDN with PLE (layers 0, 2; 1-based "
                     "ple_layer_ids [1, 3]), QSA gated attention (layers 1, 3; 8 index heads x 32, c 4, budget 16: "
                     "sparse for 86% of positions); 4 hyper-connection streams (rank 16), final mixer, no norms; "
                     "PLE 3-grams x 4 heads of 8, tables of 8192 rows in 3 row shards; MoE 4 experts top-2 + shared "
                     "expert; sigmoid GDN output gate; the PLE EOS (1) at positions 20, 21 and 57.",
         config=_QWEN4_EXP),
    dict(name="qwen4_exp_dense_start", seed=1212, num_tokens=96, prompt_len=64, max_new_tokens=24, max_rel_l2=5e-5,
         init=HYBRID_INIT, eos_positions=[5],
         description="qwen4_exp text, 3 layers from full_attention_interval 3 (GDN, GDN, QSA; the config derives the "
                     "kinds), PLE on layer 2 only (ple_layer_ids [2]: PLE layer index 0 on a later layer), silu output "
                     "gate (output_gate_type unset: hidden_act), 2 streams, the PLE table as 1 shard "
                     "(split_ngram_parts 1), budget 32 with c 4 (dense up to 35 keys).",
         config=_cfg(_QWEN4_EXP, num_hidden_layers=3, layer_types=None, full_attention_interval=3,
                     ple_layer_ids=[2], output_gate_type=None, hc_count=2, split_ngram_parts=1, indexer_budget=32)),
]


class CaseFailure(Exception):
    pass


def log(*a):
    print(*a, flush=True)


def setup_torch():
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _text_classes(model_type):
    import importlib
    module_name, config_name, model_name = TEXT_CLASSES[model_type]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, model_name)


def make_config(model_type, **d):
    try:
        return AutoConfig.for_model(model_type, **d)
    except (KeyError, ValueError):
        if model_type not in TEXT_CLASSES:
            raise
        return _text_classes(model_type)[0](**d)


def causal_lm_from_config(cfg, **kw):
    try:
        return AutoModelForCausalLM.from_config(cfg, **kw)
    except (KeyError, ValueError):
        if cfg.model_type not in TEXT_CLASSES:
            raise
        return _text_classes(cfg.model_type)[1]._from_config(cfg, **kw)


def causal_lm_from_pretrained(model_dir, **kw):
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    except (KeyError, ValueError):
        with open(os.path.join(model_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type not in TEXT_CLASSES:
            raise
        return _text_classes(model_type)[1].from_pretrained(model_dir, **kw)


def build_model(cfg_dict, seed):
    d = copy.deepcopy(cfg_dict)
    model_type = d.pop("model_type")
    cfg = make_config(model_type, **d)
    torch.manual_seed(seed)
    model = causal_lm_from_config(cfg, attn_implementation="eager")
    model = model.to(torch.float32)
    model.eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, (n, p.dtype)
    return model


@torch.no_grad()
def init_weights(model, seed, init=None):
    init = init or INIT
    g = torch.Generator().manual_seed(seed)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied != bool(model.config.tie_word_embeddings):
        raise CaseFailure(f"tie_word_embeddings={model.config.tie_word_embeddings} but lm_head tied={tied}")
    emb = model.get_input_embeddings().weight
    init = dict(HYBRID_INIT, **QWEN4_INIT, **init)  # GDN / PLE parameters exist only in hybrid models
    # Zero-centred norms (hybrid models) scale by 1 + w: shift their means so the scale is the same.
    offset = 1.0 if model.config.model_type in HYBRID_TYPES else 0.0
    for n, p in model.named_parameters():
        if n in ("model.norm.weight", "model.language_model.norm.weight"):
            v = init["final_norm_mean"] - offset + init["final_norm_std"] * torch.randn(p.shape, generator=g)
        elif n.endswith("linear_attn.norm.weight"):
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)  # gated RMSNorm: a plain weight
        elif n.endswith("linear_attn.A_log"):
            v = init["a_log_low"] + (init["a_log_high"] - init["a_log_low"]) * torch.rand(p.shape, generator=g)
        elif n.endswith("linear_attn.dt_bias"):
            v = init["dt_bias_std"] * torch.randn(p.shape, generator=g)
        elif n.endswith("linear_attn.conv1d.weight") or n.endswith("ple.conv1d.weight"):
            v = init["std_conv"] * torch.randn(p.shape, generator=g)
        elif n.endswith("ple_embedding.ngram_embedding.weight"):
            v = init["std_ple_table"] * torch.randn(p.shape, generator=g)
        elif p.dim() == 1:
            if "norm" not in n:
                raise CaseFailure(f"unexpected 1-D parameter {n}")
            v = init["norm_mean"] - offset + init["norm_std"] * torch.randn(p.shape, generator=g)
        elif p is emb:
            v = init["std_embed"] * torch.randn(p.shape, generator=g)
        elif n == "lm_head.weight":
            v = init["std_lm_head"] * torch.randn(p.shape, generator=g)
        elif n.endswith("mlp.gate.weight") or n.endswith("mlp.shared_expert_gate.weight"):
            v = init["std_router"] * torch.randn(p.shape, generator=g)
        else:
            v = init["std_linear"] * torch.randn(p.shape, generator=g)
        p.copy_(v)
        # bf16-representable values; parameters only, never buffers (qwen.md §10.1)
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return tied


def rotary_dim(cfg, head_dim):
    """qwen3/qwen3_moe rotate the whole head; the hybrids rotate int(head_dim * partial_rotary_factor) channels
    (the config injects 0.25 into rope_parameters when absent)."""
    if cfg.model_type not in HYBRID_TYPES:
        return head_dim
    factor = cfg.rope_parameters.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    if factor is None and cfg.model_type in QWEN4_TYPES:
        factor = 1.0  # qwen4_exp injects no 0.25 (qwen.md §2.1)
    if factor is None:
        raise CaseFailure(f"{cfg.model_type}: no partial_rotary_factor in rope_parameters {cfg.rope_parameters}")
    return int(head_dim * factor)


def check_inv_freq(model):
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    dim = rotary_dim(cfg, head_dim)
    want = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    n = 0
    for name, b in model.named_buffers():
        if name.endswith("inv_freq"):
            n += 1
            if b.dtype != torch.float32 or not torch.equal(b, want):
                raise CaseFailure(f"{name} is not the exact fp32 formula: {b[:4].tolist()} vs {want[:4].tolist()}")
    if n == 0:
        raise CaseFailure("no inv_freq buffer found")
    return head_dim


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@torch.no_grad()
def full_logits(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


@torch.no_grad()
def incremental_logits(model, ids, first=1, step=1):
    rows, pkv, t = [], None, 0
    while t < len(ids):
        n = first if t == 0 else step
        out = model(torch.tensor([ids[t:t + n]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        rows.append(out.logits[0].float().numpy())
        t += n
    return np.concatenate(rows, axis=0)


def top2_margin(row):
    s = np.sort(np.asarray(row, dtype=np.float64))
    return float(s[-1] - s[-2])


@torch.no_grad()
def greedy(model, prompt, n):
    saved = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = None
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0, bos_token_id=0,
                          num_beams=1, use_cache=True, output_logits=True, return_dict_in_generate=True)
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    model.generation_config = saved
    new = out.sequences[0, len(prompt):].tolist()
    if len(new) != n:
        raise CaseFailure(f"generate returned {len(new)} new tokens, expected {n}")
    margins = []
    for i, lg in enumerate(out.logits):
        row = lg[0].float().numpy()
        if int(np.argmax(row)) != new[i]:
            raise CaseFailure(f"greedy step {i}: token {new[i]} is not the argmax {int(np.argmax(row))} of the raw logits")
        margins.append(top2_margin(row))
    full = full_logits(model, prompt + new)
    agrees = [int(np.argmax(full[len(prompt) - 1 + i])) for i in range(n)] == new
    return new, margins, agrees


def save_bf16(model, out_dir, generation_config=None):
    m = copy.deepcopy(model).to(torch.bfloat16)
    if generation_config is not None:
        m.generation_config = generation_config
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    m.save_pretrained(out_dir, safe_serialization=True)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("dtype") != "bfloat16":
        log(f"  note: config.json dtype was {cfg.get('dtype')!r}; set to 'bfloat16'")
        cfg["dtype"] = "bfloat16"
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
    files = sorted(os.listdir(out_dir))
    for want in ("config.json", "model.safetensors", "generation_config.json"):
        if want not in files:
            raise CaseFailure(f"{out_dir}: save_pretrained wrote {files}, no {want}")
    extra = [f for f in files if f not in ("config.json", "model.safetensors", "generation_config.json")]
    if extra:
        raise CaseFailure(f"{out_dir}: unexpected files {extra}")
    return cfg


def st_keys(path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def key_prefix(keys):
    """Where the text model's modules are: "model." (ForCausalLM) or "model.language_model."."""
    for prefix in ("model.language_model.", "model."):
        if prefix + "embed_tokens.weight" in keys:
            return prefix
    raise CaseFailure(f"no embed_tokens.weight among the file keys {sorted(keys)[:6]}")


def qwen4_attention_layers(cfg):
    """Per layer: True for the (QSA) attention layers of a qwen4_exp config, from the layer kinds the config
    derived (`layers_block_type` where the config has it, else `layer_types`)."""
    types = list(getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers:
        raise CaseFailure(f"qwen4_exp: layer kinds {types} for {cfg.num_hidden_layers} layers")
    return [t != "linear_attention" for t in types]


def qwen4_expected_keys(model, keys, root):
    """The keys a qwen4_exp checkpoint must hold (qwen.md §4.6), with the PLE tables as row shards."""
    cfg = model.config
    hc = ("hc_norm", "input_mix_weight_down", "input_mix_weight_up")
    want = {root + "embed_tokens.weight"} | {root + f"hyper_connection_mixer.{w}.weight" for w in hc}
    attention = qwen4_attention_layers(cfg)
    ple_ids = list(cfg.ple_layer_ids or [])
    for i in range(cfg.num_hidden_layers):
        p = f"{root}layers.{i}."
        for site in ("attn_hyper_connection", "mlp_hyper_connection"):
            want |= {p + f"{site}.{w}.weight" for w in hc + ("block_inject_weight",)}
        if attention[i]:
            want |= {p + f"self_attn.{w}.weight" for w in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
            want |= {p + f"self_attn.indexer.{w}.weight" for w in ("index_qk_proj", "q_layernorm", "k_layernorm")}
        else:
            a = p + "linear_attn."
            want |= {a + f"in_proj_{w}.weight" for w in ("qkv", "z", "b", "a")}
            want |= {a + "conv1d.weight", a + "dt_bias", a + "A_log", a + "norm.weight", a + "out_proj.weight"}
        if i + 1 in ple_ids:
            e = p + "ple."
            want |= {e + f"{w}.weight" for w in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv",
                                                 "conv1d")}
            want |= {e + f"ple_embedding.{b}" for b in ("layer_multipliers", "ngram_heads_vocab_sizes",
                                                        "ngram_heads_offsets")}
            table = model.get_submodule(f"model.layers.{i}.ple.ple_embedding.ngram_embedding").weight
            rows, parts = table.shape[0], cfg.split_ngram_parts
            chunk = -(-rows // parts)
            shards = -(-rows // chunk)
            for s_ in range(shards):
                name = e + f"ple_embedding.ngram_embedding.shard_{s_}.weight"
                want.add(name)
                expect_rows = min(chunk, rows - s_ * chunk)
                if name in keys and keys[name][1][0] != expect_rows:
                    raise CaseFailure(f"{name} has {keys[name][1][0]} rows, torch.chunk gives {expect_rows}")
    return want


def check_keys(model, keys, tied, layout):
    """The file holds exactly the expected keys; returns the per-layer FFN kinds ("dense" / "moe")."""
    cfg = model.config
    L = cfg.num_hidden_layers
    # The PLE hash buffers are int64 (qwen.md §4.6); everything else bf16.
    bad_dtype = [k for k, (dt, _) in keys.items()
                 if dt not in ("BF16", "bfloat16") and not (k.endswith(("layer_multipliers", "ngram_heads_vocab_sizes",
                                                                        "ngram_heads_offsets")) and dt in ("I64", "int64"))]
    if bad_dtype:
        raise CaseFailure(f"non-bf16 tensors in file: {bad_dtype[:5]}")
    if tied == ("lm_head.weight" in keys):
        raise CaseFailure(f"tied={tied} but lm_head.weight in file = {'lm_head.weight' in keys}")
    root = key_prefix(keys)
    if cfg.model_type in QWEN4_TYPES:
        want = qwen4_expected_keys(model, keys, root)
        kinds = []
        for i in range(cfg.num_hidden_layers):
            p = f"{root}layers.{i}."
            kinds.append("moe")
            want |= {p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"}
            want |= {p + f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")}
            if layout == "fused":
                want |= {p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"}
            else:
                for e in range(cfg.num_experts):
                    want |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
        if not tied:
            want.add("lm_head.weight")
        if set(keys) != want:
            raise CaseFailure(f"file keys differ: missing {sorted(want - set(keys))[:6]}, "
                              f"unexpected {sorted(set(keys) - want)[:6]}")
        return kinds
    want = {root + "embed_tokens.weight", root + "norm.weight"}
    hybrid = cfg.model_type in HYBRID_TYPES
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    kinds = []
    for i in range(L):
        p = f"{root}layers.{i}."
        want |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if hybrid and layer_types[i] == "linear_attention":
            a = p + "linear_attn."
            if cfg.model_type == "qwen3_next":
                want |= {a + "in_proj_qkvz.weight", a + "in_proj_ba.weight"}
            else:
                want |= {a + f"in_proj_{w}.weight" for w in ("qkv", "z", "b", "a")}
            want |= {a + "conv1d.weight", a + "dt_bias", a + "A_log", a + "norm.weight", a + "out_proj.weight"}
        else:
            want |= {p + f"self_attn.{w}.weight" for w in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        if p + "mlp.gate.weight" in keys:
            kinds.append("moe")
            want.add(p + "mlp.gate.weight")
            E = cfg.num_experts
            if layout == "fused":
                want |= {p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"}
            else:
                for e in range(E):
                    want |= {p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")}
            if hybrid:
                want |= {p + f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")}
                want.add(p + "mlp.shared_expert_gate.weight")
        else:
            kinds.append("dense")
            want |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
    if not tied:
        want.add("lm_head.weight")
    if set(keys) != want:
        raise CaseFailure(f"file keys differ: missing {sorted(want - set(keys))[:6]}, "
                          f"unexpected {sorted(set(keys) - want)[:6]}")
    return kinds


def fuse_experts(st_path, num_layers, E):
    from safetensors import safe_open
    from safetensors.torch import save_file
    tensors, meta = {}, None
    with safe_open(st_path, framework="pt") as f:
        meta = f.metadata()
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    root = key_prefix(tensors)
    for i in range(num_layers):
        p = f"{root}layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue
        gu, dn = [], []
        for e in range(E):
            g = tensors.pop(p + f"{e}.gate_proj.weight")
            u = tensors.pop(p + f"{e}.up_proj.weight")
            d = tensors.pop(p + f"{e}.down_proj.weight")
            gu.append(torch.cat([g, u], dim=0))
            dn.append(d)
        tensors[p + "gate_up_proj"] = torch.stack(gu).contiguous()  # [E, 2I, H]
        tensors[p + "down_proj"] = torch.stack(dn).contiguous()  # [E, H, I]
    save_file(tensors, st_path, metadata=meta or {"format": "pt"})


@torch.no_grad()
def reload_check(model_dir, ids, ref_logits):
    res = causal_lm_from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                    output_loading_info=True)
    m, info = res
    m.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                             "error_msgs")}
    if problems:
        raise CaseFailure(f"reload of {model_dir}: {problems}")
    return rel_l2(full_logits(m, ids), ref_logits)


def bf16_check(model_dir, ids, ref_logits):
    """How far transformers' own bf16 inference (from_pretrained in bf16, which keeps inv_freq fp32)
    lands from the fp32 reference: the yardstick for engines that compute in bf16 (the GPU tests)."""
    m = causal_lm_from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        out = m(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    return rel_l2(out, ref_logits)


def experts_impl(model):
    return getattr(model.config, "_experts_implementation", None)


def ple_eos(cfg):
    eos = cfg.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else eos


def _splitmix64(v):
    m = (1 << 64) - 1
    z = (v + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def check_ple_buffers(model):
    """The PLE buffers transformers built equal the formulas of qwen.md §7.2 (a, b), which the engine checks a
    checkpoint's stored buffers against."""
    cfg = model.config
    heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    half = max(1, ((2 ** 63 - 1) // max(cfg.vocab_size, 1)) // 2)
    primes, n = [], cfg.ngram_vocab_size_base
    for L, layer_id in enumerate(sorted(set(cfg.ple_layer_ids or []))):
        emb = model.get_submodule(f"model.layers.{layer_id - 1}.ple.ple_embedding")
        mult = [2 * (_splitmix64((cfg.seed + 10007 * L + 0x9E3779B97F4A7C15 * (i + 1)) % 2 ** 64) % half) + 1
                for i in range(cfg.ngram_size)]
        while len(primes) < (L + 1) * heads:
            if _is_prime(n):
                primes.append(n)
            n += 1
        sizes = primes[L * heads:(L + 1) * heads]
        offsets = [sum(sizes[:h]) for h in range(heads)]
        for name, want in (("layer_multipliers", mult), ("ngram_heads_vocab_sizes", sizes),
                           ("ngram_heads_offsets", offsets)):
            got = getattr(emb, name).tolist()
            if got != want:
                raise CaseFailure(f"layer {layer_id - 1} {name} {got} differs from qwen.md §7.2's {want}")
        rows = emb.ngram_embedding.weight.shape[0]
        pad = cfg.make_ngram_vocab_size_divisible_by
        if rows != -(-sum(sizes) // pad) * pad:
            raise CaseFailure(f"layer {layer_id - 1}: PLE table of {rows} rows, expected R_pad of {sum(sizes)}")


def qsa_sparse_fraction(cfg, num_tokens):
    """Fraction of query positions whose visible keys exceed budget + c - 1 (QSA selects sparsely there)."""
    dense = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    return max(0, num_tokens - dense) / num_tokens


def try_seed(case, seed, max_rel):
    """Builds the case's model for one seed and runs the checks; returns a dict (model, ids, ref, ...)."""
    name = case["name"]
    init = dict(INIT, **case.get("init", {}))
    model = build_model(case["config"], seed)
    tied = init_weights(model, seed, init)
    check_inv_freq(model)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(2, V, (case["num_tokens"],), generator=g).tolist()
    for pos in case.get("eos_positions", []):  # the PLE EOS inside the prompt (its n-gram history restarts)
        ids[pos] = ple_eos(model.config)
    if model.config.model_type in QWEN4_TYPES:
        check_ple_buffers(model)
    ref = full_logits(model, ids)
    r_inc = rel_l2(incremental_logits(model, ids), ref)
    r_chunk = rel_l2(incremental_logits(model, ids, first=16, step=5), ref)
    prompt = ids[:case["prompt_len"]]
    new, margins, agrees = greedy(model, prompt, case["max_new_tokens"])
    distinct = len(set(new))
    ok = r_inc <= max_rel
    good = ok and min(margins) >= MIN_GREEDY_MARGIN and distinct >= max(3, len(new) // 4)
    log(f"[{name}] seed {seed}: incremental_rel_l2 {r_inc:.3e}, chunked_rel_l2 {r_chunk:.3e}, logit std "
        f"{ref.std():.3f}, greedy min margin {min(margins):.4f}, {distinct} distinct of {len(new)}: {new}"
        + ("" if ok else f"  REJECTED (incremental_rel_l2 > {max_rel:.1e})")
        + ("" if good or not ok else "  (passes; greedy not preferred)"))
    if ok and r_chunk > max_rel:
        log(f"[{name}] WARNING: chunked_rel_l2 {r_chunk:.3e} > {max_rel:.1e} (recorded, not fatal)")
    return dict(seed=seed, model=model, tied=tied, ids=ids, ref=ref, r_inc=r_inc, r_chunk=r_chunk, prompt=prompt,
                new=new, margins=margins, agrees=agrees, ok=ok, good=good, init=init)


def make_case(case, out_root, max_rel):
    """Seeds case.seed + 1000 k, k < SEED_TRIES: the first one that passes the incremental check (hard) and has a
    clear, varied greedy continuation (min margin >= MIN_GREEDY_MARGIN, >= max(3, N/4) distinct tokens) is kept;
    if none is preferred, the passing seed with clear margins and the most distinct tokens."""
    name = case["name"]
    passing = []
    for k in range(SEED_TRIES):
        r = try_seed(case, case["seed"] + 1000 * k, case.get("max_rel_l2", max_rel))
        if r["good"]:
            passing = [r]
            break
        if r["ok"]:
            passing.append(r)
    if not passing:
        raise CaseFailure(f"{name}: no seed passed the incremental check (max {case.get('max_rel_l2', max_rel):.1e})")
    r = max(passing, key=lambda x: (min(x["margins"]) >= MIN_GREEDY_MARGIN, len(set(x["new"])), min(x["margins"])))
    model, tied, ids, ref, seed = r["model"], r["tied"], r["ids"], r["ref"], r["seed"]
    r_inc, r_chunk, prompt, new, margins, agrees = (r["r_inc"], r["r_chunk"], r["prompt"], r["new"], r["margins"],
                                                     r["agrees"])
    cfg = model.config
    log(f"[{name}] kept seed {seed}")

    case_dir = os.path.join(out_root, name)
    if os.path.exists(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)
    model_dir = os.path.join(case_dir, "model")
    save_bf16(model, model_dir)
    st = os.path.join(model_dir, "model.safetensors")
    saved_keys = st_keys(st)
    saved_layout = "fused" if any(k.endswith("mlp.experts.gate_up_proj") for k in saved_keys) else "per_expert"
    kinds = check_keys(model, saved_keys, tied, saved_layout)
    layout = case.get("layout", "per_expert")
    if layout == "fused" and saved_layout == "per_expert":
        fuse_experts(st, cfg.num_hidden_layers, cfg.num_experts)
        check_keys(model, st_keys(st), tied, "fused")
    elif layout != saved_layout:
        raise CaseFailure(f"{name}: save_pretrained wrote {saved_layout} experts, the case asks for {layout}")
    keys_now = st_keys(st)
    log(f"[{name}] file keys ({len(keys_now)}): " + ", ".join(
        f"{k} {list(v[1])}" for k, v in sorted(keys_now.items()) if ".layers.0." in k or ".layers." not in k))
    r_reload = reload_check(model_dir, ids, ref)
    log(f"[{name}] reload_rel_l2 {r_reload:.3e}")
    r_bf16 = bf16_check(model_dir, ids, ref)
    log(f"[{name}] transformers bf16 vs fp32: rel_l2 {r_bf16:.3e}")
    if r_reload > MAX_RELOAD_REL_L2:
        raise CaseFailure(f"{name}: reloaded model differs: reload_rel_l2 {r_reload:.3e}")

    # sliding window: how many keys the last query of a sliding layer attends to (eager weights)
    extra = {}
    lt = list(getattr(cfg, "layer_types", None) or [])
    if "sliding_attention" in lt:
        with torch.no_grad():
            att = model(torch.tensor([ids]), use_cache=False, output_attentions=True).attentions
        seen = {}
        for i, t in enumerate(lt):
            row = att[i][0, 0, -1]
            seen[f"layer{i}:{t}"] = int((row > 0).sum())
        extra["sliding_window_keys_seen"] = seen
        log(f"[{name}] keys seen by the last query: {seen}")

    np.save(os.path.join(case_dir, "logits.npy"), np.ascontiguousarray(ref.astype("<f4")))
    with open(os.path.join(case_dir, "input_ids.json"), "w") as f:
        json.dump(ids, f)
        f.write("\n")

    log(f"[{name}] greedy {new}; min margin {min(margins):.4f}; full forward agrees {agrees}")

    info = {
        "name": name,
        "model_type": cfg.model_type,
        "description": case["description"],
        "seed": seed,
        "num_tokens": len(ids),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "incremental_rel_l2": r_inc,
        "chunked_rel_l2": r_chunk,
        "chunked_split": {"first": 16, "step": 5},
        "reload_rel_l2": r_reload,
        "transformers_bf16_rel_l2": r_bf16,
        "greedy": {"prompt_ids": prompt, "output_ids": new, "max_new_tokens": case["max_new_tokens"],
                   "full_forward_agrees": agrees},
        "greedy_margins": margins,
        "logits_min_margin": min(top2_margin(r) for r in ref),
        "logits_shape": list(ref.shape),
        "layout": layout,
        "layer_types": lt or None,
        "mlp_kinds": kinds,
        "head_dim": check_inv_freq(model),
        "attn_implementation": cfg._attn_implementation,
        "experts_implementation": experts_impl(model),
        "ignore_eos": True,
        "init": r["init"],
        "generator": "tools/goldens/make_goldens.py",
    }
    if cfg.model_type in QWEN4_TYPES:
        info["qsa_sparse_fraction"] = qsa_sparse_fraction(cfg, len(ids))
        info["eos_positions"] = case.get("eos_positions", [])
        info["ple_layer_ids"] = list(cfg.ple_layer_ids or [])
        info["ple_table_shards"] = sum(1 for k in keys_now if ".ngram_embedding.shard_" in k)
        if info["qsa_sparse_fraction"] < 0.5:
            raise CaseFailure(f"{name}: QSA selects sparsely at only {info['qsa_sparse_fraction']:.0%} of positions")
    info.update(extra)
    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return info


def make_default_model(out_dir):
    cfg = dict(model_type="qwen3", vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
               max_position_embeddings=40960, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
               tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, use_sliding_window=False)
    model = build_model(cfg, DEFAULT_SEED)
    tied = init_weights(model, DEFAULT_SEED, dict(INIT, **TIED_INIT))
    assert tied
    check_inv_freq(model)
    gen = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643)
    os.makedirs(out_dir, exist_ok=True)
    tmp = out_dir.rstrip("/") + ".tmp"
    save_bf16(model, tmp, generation_config=gen)
    check_keys(model, st_keys(os.path.join(tmp, "model.safetensors")), True, "per_expert")
    ids = [151643, 9707, 11, 1879, 0, 13, 151645, 198]
    ref = full_logits(model, ids)
    r = reload_check(tmp, ids, ref)
    inc = rel_l2(incremental_logits(model, ids), ref)
    new, margins, _ = greedy(model, ids, 16)
    log(f"[default] reload_rel_l2 {r:.3e}, incremental_rel_l2 {inc:.3e}, logit std {ref.std():.3f}; greedy after "
        f"{ids}: {new} (min margin {min(margins):.4f})")
    if r > MAX_RELOAD_REL_L2:
        raise CaseFailure(f"default model reload differs: {r:.3e}")
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.move(os.path.join(tmp, f), os.path.join(out_dir, f))
    shutil.rmtree(tmp)
    size = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    log(f"[default] wrote {out_dir}: model.safetensors {size / 1e6:.2f} MB, seed {DEFAULT_SEED}")
    with open(os.path.join(out_dir, "generation_config.json")) as f:
        log(f"[default] generation_config.json: {json.load(f)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/goldens", help="where the case directories go")
    ap.add_argument("--default-model", default=None, help="also write the bundled default model into this dir")
    ap.add_argument("--only", nargs="*", default=None, help="case names to make (default: all)")
    ap.add_argument("--max-rel-l2", type=float, default=MAX_REL_L2)
    ap.add_argument("--allow-other-version", action="store_true")
    args = ap.parse_args()

    log(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    if transformers.__version__ != EXPECTED_TRANSFORMERS and not args.allow_other_version:
        sys.exit(f"error: transformers {transformers.__version__} found, the goldens need {EXPECTED_TRANSFORMERS}")
    setup_torch()
    os.makedirs(args.out, exist_ok=True)
    failures, summary = [], []
    for case in CASES:
        if args.only and case["name"] not in args.only:
            continue
        try:
            info = make_case(case, args.out, args.max_rel_l2)
            summary.append(info)
        except Exception as e:  # noqa: BLE001 - report every case, fail at the end
            if not isinstance(e, CaseFailure):
                traceback.print_exc()
                e = CaseFailure(f"{type(e).__name__}: {e}")
            if case.get("optional"):
                log(f"[{case['name']}] SKIPPED (optional case): {e}")
                d = os.path.join(args.out, case["name"])
                if os.path.exists(d):
                    shutil.rmtree(d)
            else:
                log(f"[{case['name']}] FAILED: {e}")
                failures.append(f"{case['name']}: {e}")
    # glm5_next: the text stack plus an untied lm_head (glm5_goldens.py says why and how).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import glm5_goldens
    env = dict(rel_l2=rel_l2, top2_margin=top2_margin, log=log, CaseFailure=CaseFailure, SEED_TRIES=SEED_TRIES,
               MIN_GREEDY_MARGIN=MIN_GREEDY_MARGIN, MAX_RELOAD_REL_L2=MAX_RELOAD_REL_L2,
               transformers_version=transformers.__version__, torch_version=torch.__version__)
    for case in glm5_goldens.GLM5_CASES:
        if args.only and case["name"] not in args.only:
            continue
        try:
            summary.append(glm5_goldens.make_glm5_case(case, args.out, env))
        except Exception as e:  # noqa: BLE001 - report every case, fail at the end
            traceback.print_exc()
            log(f"[{case['name']}] FAILED: {e}")
            failures.append(f"{case['name']}: {e}")
    if args.default_model:
        try:
            make_default_model(args.default_model)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"default model: {type(e).__name__}: {e}")
    log("\nsummary:")
    for s in summary:
        log(f"  {s['name']:16s} seed {s['seed']:5d} T {s['num_tokens']:4d} inc {s['incremental_rel_l2']:.2e} "
            f"chunked {s['chunked_rel_l2']:.2e} reload {s['reload_rel_l2']:.1e} "
            f"min greedy margin {min(s['greedy_margins']):.4f} full-agrees {s['greedy']['full_forward_agrees']}")
    if failures:
        log("\nFAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
