"""HF transformers' prefill and greedy decode at the shapes of kiln's `decode_bench` example, for
the same GPU call: a randomly initialized bf16 model (sdpa attention), prefill of CONTEXT tokens,
then NEW greedy tokens at batch 1 with the KV cache, each token read back (`.item()`), as
generation does. Also the peak memory while decoding. `bitnet-2b` runs BitNet b1.58 2B's shape
twice: float bf16 linears, then transformers' packed `BitLinear`s (2-bit weights unpacked on each
forward, int8 activations) as its BitNet checkpoints load.

Usage: python3 decode.py [qwen2.5-0.5b|llama3.2-1b|bitnet-2b] [CONTEXT] [NEW]
"""
import sys
import time

import torch
import transformers

SHAPES = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                                         tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "llama3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                        tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "bitnet-2b": ("BitNetConfig", dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30,
                                       num_attention_heads=20, num_key_value_heads=5, rope_theta=500000.0, hidden_act="relu2",
                                       tie_word_embeddings=True, rms_norm_eps=1e-5)),
}


def pack_linears(model):
    """transformers' packed BitLinear layers in place of the float ones, random codes, unit scales."""
    from transformers import BitNetQuantConfig
    from transformers.integrations.bitnet import replace_with_bitnet_linear
    model = replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"], quantization_config=BitNetQuantConfig())
    for m in model.modules():
        if type(m).__name__ == "BitLinear":
            rows, k = m.weight.shape
            codes = torch.randint(0, 3, (4, rows, k), device="cuda", dtype=torch.uint8)
            m.weight = codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)
            m.weight_scale = torch.ones(1, device="cuda", dtype=torch.bfloat16)
    return model


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    cls, kwargs = SHAPES[name]
    config = getattr(transformers, cls)(**kwargs, max_position_embeddings=context + new)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).cuda().eval()
    run(model, name, context, new)
    if name == "bitnet-2b":
        try:
            run(pack_linears(model), name + " packed BitLinear", context, new)
        except Exception as e:  # the peer's own failure is reported, not fatal to the call
            print(f"transformers {name} packed BitLinear: failed: {e!r}")


def run(model, name, context, new):
    prompt = torch.tensor([[(i * 7919 + 13) % model.config.vocab_size for i in range(context)]], device="cuda")
    for round in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            start = time.perf_counter()
            out = model(prompt, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.item()
            prefill = time.perf_counter() - start
            cache = out.past_key_values
            start = time.perf_counter()
            for _ in range(new):
                out = model(token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                token.item()
            decode = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 1e9
        print(f"transformers {transformers.__version__} {name} round {round}: prefill {context} tokens {prefill * 1e3:.2f} ms "
              f"({context / prefill:.0f} tokens/s); decode {new} tokens {decode * 1e3:.2f} ms ({new / decode:.1f} tokens/s, "
              f"{decode * 1e6 / new:.0f} us/token); peak memory {peak:.3f} GB")


if __name__ == "__main__":
    main()
