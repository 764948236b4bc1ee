"""transformers + bitsandbytes + PEFT's QLoRA training step at the shape of kiln's `qlora_step`
example (models/examples/qlora_step.rs), run in the same GPU call, with both processes' peak
device memory.

The peer: a randomly initialized bf16 Llama-3.2-1B-shaped model saved and loaded back in 4 bits
the way users load a checkpoint for QLoRA (`BitsAndBytesConfig`: NF4, double quantization, bf16
compute), PEFT LoRA r 16 alpha 32 on all linears (PEFT's default fp32 adapters, and bf16 ones as
kiln's with `--bf16-adapters`), sdpa attention, no gradient checkpointing (kiln has none), the
same token batch and loss as kiln's (f32 cross-entropy over every position), AdamW on the adapters,
the loss read back each step.

Peak memory is read the same way for both: `nvidia-smi`'s memory.used polled every 50 ms while the
process runs, less the reading before it started (it includes the CUDA context). The peer also
prints torch's own peak allocated and reserved bytes.

Usage: python3 qlora_step.py [KILN_BINARY] [--batch 4] [--seq 2048] [--steps 6]
       python3 qlora_step.py --peer [--bf16-adapters] ...   (the peer alone, in this process)
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
             tie_word_embeddings=True, rms_norm_eps=1e-5)


def used_mib():
    """Device 0's used memory in MiB, or 0 where nvidia-smi cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return 0


def run_with_peak(cmd, label):
    """Runs `cmd`, echoing its output; returns the peak device memory it added, in GB."""
    before = used_mib()
    peak = [before]
    done = threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], used_mib())
            time.sleep(0.05)

    thread = threading.Thread(target=poll)
    thread.start()
    result = subprocess.run(cmd)
    done.set()
    thread.join()
    gb = (peak[0] - before) * 2**20 / 1e9
    print(f"{label}: exit {result.returncode}, peak device memory (nvidia-smi) {gb:.2f} GB", flush=True)
    return gb


def peer(args):
    import torch
    import torch.nn.functional as F
    import transformers
    from peft import LoraConfig, get_peft_model

    bf = torch.bfloat16
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=args.seq)
    with tempfile.TemporaryDirectory() as folder:
        transformers.AutoModelForCausalLM.from_config(config, dtype=bf).save_pretrained(folder)
        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                                bnb_4bit_compute_dtype=bf)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=bf, device_map={"": 0},
                                                                  attn_implementation="sdpa")
    model.config.use_cache = False
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora, autocast_adapter_dtype=not args.bf16_adapters)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    kind = "bf16" if args.bf16_adapters else "fp32 (PEFT's default)"
    print(f"peer: {sum(p.numel() for p in trainable)} trainable parameters, {kind} adapters, batch {args.batch} x {args.seq}")
    optim = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    vocab = SHAPE["vocab_size"]
    ids = torch.tensor([(i * 7919 + 13) % vocab for i in range(args.batch * (args.seq + 1))], device="cuda").view(args.batch, -1)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()
        seconds = time.perf_counter() - start
        if step >= args.warmup:
            print(f"step {step - args.warmup}: {seconds * 1e3:.2f} ms, loss {value:.4f}")
            times.append(seconds)
    median = statistics.median(times)
    print(f"peer qlora_step ({kind} adapters) median {median * 1e3:.2f} ms, {args.batch * args.seq / median:.0f} tokens/s; "
          f"torch peak allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, reserved {torch.cuda.max_memory_reserved() / 1e9:.2f} GB",
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kiln", nargs="?", help="kiln's qlora_step binary")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--bf16-adapters", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.peer:
        return peer(args)
    shape = ["--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.kiln:
        run_with_peak([args.kiln, "--device", "cuda", *shape], "kiln")
    for extra in ([], ["--bf16-adapters"]):
        run_with_peak([sys.executable, os.path.abspath(__file__), "--peer", *extra, *shape], "peer" + (" bf16 adapters" if extra else ""))


if __name__ == "__main__":
    main()
