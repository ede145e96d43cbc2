#!/usr/bin/env python3
"""The baseline a Python user has without a serving engine: Hugging Face transformers'
`generate` on a DeepSeek-V2-Lite-shaped model with random weights, on one GPU, in bf16.

The model is built from the same config as `deepseek-v3 serve --init random --config
examples/deepseek-v3/configs/deepseek-v2-lite.json` (nothing is downloaded: the weights are
transformers' own random initialisation, made on the GPU). For each batch size, every sequence
gets a random prompt of --prompt-tokens ids and exactly --output-tokens new tokens (greedy;
min_new_tokens = max_new_tokens, so the end-of-sentence token cannot stop it early).

Timing per batch size, after one warm-up generate:
  - ttft_ms: a generate of one new token (the prefill plus one sampling step), median of
    --repeats runs;
  - total_s: the full generate, median of --repeats runs;
  - tpot_ms: (total - ttft) / (output_tokens - 1), the time per output token after the first;
  - output_tokens_per_s: batch * output_tokens / total.
Prints one JSON line per batch size on stdout (progress goes to stderr).

    python3 scripts/gpu/anchors/hf_generate.py --batch-sizes 1,64 > hf.jsonl

Needs torch with CUDA and transformers 5.x (written against 5.17).
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO / "examples" / "deepseek-v3" / "configs" / "deepseek-v2-lite.json"

# Fields of the example's config.json that DeepseekV2Config takes as they are. The example's
# `scoring_func` ("softmax") and `moe_layer_freq` (1) are what DeepseekV2 always does, so they
# are checked rather than passed.
PASSED = [
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
    "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "topk_method",
    "n_group", "topk_group", "norm_topk_prob", "first_k_dense_replace", "kv_lora_rank",
    "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "attention_bias",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
]


def log(msg):
    print(f"[hf_generate] {msg}", file=sys.stderr, flush=True)


def hf_config(path):
    """The DeepseekV2Config of the example's config.json at `path`."""
    from transformers import DeepseekV2Config

    raw = json.loads(pathlib.Path(path).read_text())
    if raw.get("scoring_func", "softmax") != "softmax" or raw.get("moe_layer_freq", 1) != 1:
        sys.exit(f"{path}: DeepseekV2 supports scoring_func softmax and moe_layer_freq 1 only")
    kwargs = {k: raw[k] for k in PASSED if k in raw}
    cfg = DeepseekV2Config(**kwargs)
    cfg.use_cache = True
    return cfg


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def build_model(cfg, device):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    # Parameters are allocated and initialised (normal, std = initializer_range) on the GPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    log(
        f"built {type(model).__name__}: {count_parameters(model) / 1e9:.2f} B parameters in "
        f"{time.perf_counter() - start:.1f} s; attention {model.config._attn_implementation}, "
        f"experts {model.config._experts_implementation}"
    )
    return model


def timed_generate(model, input_ids, new_tokens, pad_id):
    import torch

    attention_mask = torch.ones_like(input_ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = out.shape[1] - input_ids.shape[1]
    if generated != new_tokens:
        sys.exit(f"generate made {generated} tokens, expected {new_tokens}")
    return elapsed


def run(args):
    import torch
    import transformers

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this baseline runs on one GPU")
    device = torch.device("cuda", 0)
    cfg = hf_config(args.config)
    model = build_model(cfg, device)
    pad_id = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 0
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    # Prompt ids from the same range as `deepseek-v3 bench-serve`.
    low, high = 10, 256

    for batch in args.batch_sizes:
        ids = torch.randint(low, high, (batch, args.prompt_tokens), generator=gen).to(device)
        log(f"batch {batch}: warm-up")
        timed_generate(model, ids, 2, pad_id)
        ttft = statistics.median(
            timed_generate(model, ids, 1, pad_id) for _ in range(args.repeats)
        )
        total = statistics.median(
            timed_generate(model, ids, args.output_tokens, pad_id) for _ in range(args.repeats)
        )
        tpot = (total - ttft) / max(args.output_tokens - 1, 1)
        line = {
            "engine": "hf-transformers",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device),
            "config": str(args.config),
            "dtype": "bfloat16",
            "attention": model.config._attn_implementation,
            "experts": model.config._experts_implementation,
            "batch_size": batch,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "repeats": args.repeats,
            "ttft_ms": ttft * 1e3,
            "total_s": total,
            "tpot_ms": tpot * 1e3,
            "output_tokens_per_s": batch * args.output_tokens / total,
            "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        }
        print(json.dumps(line), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the example's config.json")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes {args.batch_sizes!r} must be comma-separated integers")
    for name in ("prompt_tokens", "output_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes {args.batch_sizes} must all be at least 1")
    run(args)


if __name__ == "__main__":
    main()
