"""Microsoft BitNet's GPU W2A8 GEMV (`gpu/bitnet_kernels` of microsoft/BitNet: its
`ladder_int8xint2_kernel`, weights in its 16 × 32 interleaved 2-bit layout, int8 activations
already quantized) at its own shapes, next to torch's bf16 GEMV: device time per product by CUDA
events (`gemm.gpu_seconds`), exactness checked against an integer product. kiln's GEMV runs at the
same shapes in the same device call (`kiln-gpu-check ternary-gemv`), so the layouts are compared
by measurement.

Their sources are not part of kiln: BITNET_GPU names a checkout's `gpu/` folder carried to the
GPU machine. The script builds `libbitnet.so` there with nvcc (their `compile.sh`, targeting the
local GPU) and packs weights with their `pack_weight.py`.

Usage on the GPU machine: BITNET_GPU=path/to/BitNet/gpu python3 bitnet_gpu.py"""
import ctypes, os, subprocess, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import gpu_seconds  # noqa: E402

# (n, k): weight [n, k]; the shapes their kernel is instantiated for (BitNet b1.58 2B and 3B).
SHAPES = [(2560, 2560), (3840, 2560), (13824, 2560), (2560, 6912), (3200, 3200), (4800, 3200), (3200, 10240), (20480, 3200)]
HBM = 3.35e12


def build(root):
    """Their kernel library, compiled for this GPU's compute capability."""
    src = os.path.join(root, "bitnet_kernels")
    major, minor = torch.cuda.get_device_capability()
    cmd = ["nvcc", "-std=c++17", "-O3", "-Xcudafe", "--diag_suppress=177", "--compiler-options", "-fPIC", "--shared", "bitnet_kernels.cu", "-lcuda",
           f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}", "-o", "libbitnet.so"]
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"peer bitnet-gpu: nvcc failed: {r.stderr[-2000:]}")
    lib = ctypes.CDLL(os.path.join(src, "libbitnet.so"))
    lib.bitlinear_int8xint2.restype = None
    return lib


def main():
    root = os.environ["BITNET_GPU"]
    lib = build(root)
    sys.path.insert(0, root)
    from pack_weight import convert_weight_int8_to_int2  # their packing

    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        w = torch.randint(-1, 2, (n, k), dtype=torch.int8, device="cuda", generator=gen)
        packed = convert_weight_int8_to_int2(w.cpu()).to("cuda")
        x = torch.randint(-128, 128, (1, k), dtype=torch.int8, device="cuda", generator=gen)
        s = torch.ones(1, dtype=torch.bfloat16, device="cuda")
        ws = torch.ones(6, dtype=torch.bfloat16, device="cuda")
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, packed, out, s, ws)]

        def call():
            lib.bitlinear_int8xint2(*ptrs, ctypes.c_int(1), ctypes.c_int(n), ctypes.c_int(k), stream)

        call()
        torch.cuda.synchronize()
        # |Σ| ≤ 128 k < 2^24: exact in f32, then one rounding to bf16 (their scales are 1 here).
        exact = torch.equal(out, (x.float() @ w.float().t()).to(torch.bfloat16))
        t = gpu_seconds(call, calls=200)
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        tb = gpu_seconds(lambda: xb @ wb.t(), calls=200)
        packed_bytes = n * k / 4 + k + 2 * n
        print(f"peer bitnet-gpu gemv n{n:<6} k{k:<6} {'exact' if exact else 'WRONG'}: kernel {t * 1e6:6.1f} us ({packed_bytes / t / 1e9:5.0f} GB/s, "
              f"{100 * packed_bytes / t / HBM:3.0f}% of HBM) | torch bf16 {tb * 1e6:6.1f} us ({tb / t:.2f}x)", flush=True)
        del w, packed, x, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
