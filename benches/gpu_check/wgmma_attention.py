"""Kernel-level harness for the Hopper attention forward (`kernels/src/flash_attention/wgmma/`),
on the GPU machine without Rust: builds variants with nvcc for sm_90a (registers and spills from
ptxas), checks output and log-sum-exp against an f64 reference with the DEVELOPERS.md error rule
(ragged lengths, causal offsets, GQA, rows that see no key, large logits; outputs poisoned with
NaN first), and times each variant next to SDPA's FlashAttention-2 backend in the same process.

    python3 benches/gpu_check/wgmma_forward.py [check|bench|all] [variant filter, e.g. d128bc128]

VARIANTS=128x2,64x2 picks (keys per tile, warpgroups); EXTRA='#define X 1;...' prepends defines;
DIAG=1 prints where a failing case is wrong. Kiln itself compiles the same sources through
CubeCL's NVRTC (`wgmma/mod.rs`); this harness exists to iterate on the kernel in seconds."""
import os, subprocess, sys, math, time
import torch, cupy as cp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "kernels", "src", "flash_attention", "wgmma")
WRAP = r'''
extern "C" __global__ void __launch_bounds__(THREADS, 1) fa_fwd(const u16* q, const u16* k, const u16* v, u16* out, float* lse,
    u32 q_heads, u32 group, u32 q_len, u32 kv_len, u32 qb, u32 qh, u32 qs, u32 kb, u32 kh, u32 ks, u32 vb, u32 vh, u32 vs, float scale_log2) {
    Info p = {q_heads, group, q_len, kv_len, qb, qh, qs, kb, kh, ks, vb, vh, vs, scale_log2};
    attention_forward(q, k, v, out, lse, p);
}
extern "C" __global__ void shared_bytes(u32* o) { o[0] = KILN_SHARED_BYTES; }
'''
_cache = {}
def build(d, bc, wg, causal, f16):
    key = (d, bc, wg, causal, f16)
    if key in _cache: return _cache[key]
    name = f"fa_d{d}_bc{bc}_wg{wg}_c{int(causal)}_{'f16' if f16 else 'bf16'}"
    cu = os.path.join("/tmp", name + ".cu")
    defs = os.environ.get("EXTRA", "").replace(";", "\n") + "\n" + f'#define KILN_D {d}\n#define KILN_BC {bc}\n#define KILN_WG {wg}\n#define KILN_CAUSAL {int(causal)}\n#define KILN_F16 {int(f16)}\n#define KILN_WGMMA_TYPE "{"f16" if f16 else "bf16"}"\n#define KILN_EMPTY_LSE 1e30f\n'
    open(cu, "w").write(defs + open(os.path.join(SRC, "wgmma.cuh")).read() + open(os.path.join(SRC, "forward.cu")).read() + WRAP)
    cubin = cu.replace(".cu", ".cubin")
    r = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-I", SRC, cu, "-o", cubin], capture_output=True, text=True)
    info = [l for l in (r.stdout + r.stderr).splitlines() if "fa_fwd" in l or "registers" in l or "spill" in l or "error" in l.lower() or "warn" in l.lower()]
    print(f"build {name}: rc {r.returncode}; " + " | ".join(x.strip() for x in info[-4:]), flush=True)
    if r.returncode != 0:
        print(r.stderr[-3000:]); _cache[key] = None; return None
    mod = cp.RawModule(path=cubin)
    fn = mod.get_function("fa_fwd")
    sb = cp.zeros(1, dtype=cp.uint32); mod.get_function("shared_bytes")((1,), (1,), (sb,)); smem = int(sb.get()[0])
    fn.max_dynamic_shared_size_bytes = smem
    _cache[key] = (fn, smem, wg)
    return _cache[key]

def launch(kern, q, k, v, causal, scale, out=None, lse=None):
    fn, smem, wg = kern
    b, hq, sq, d = q.shape; hk, skv = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty(b, hq, sq, d, device="cuda", dtype=q.dtype)
        lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    rows = 64 * wg
    grid = ((sq + rows - 1) // rows, hq, b)
    a = lambda t: cp.from_dlpack(t.detach())
    u = cp.uint32
    fn(grid, (128 * wg,), (a(q), a(k), a(v), a(out), a(lse), u(hq), u(hq // hk), u(sq), u(skv),
        u(q.stride(0)), u(q.stride(1)), u(q.stride(2)), u(k.stride(0)), u(k.stride(1)), u(k.stride(2)),
        u(v.stride(0)), u(v.stride(1)), u(v.stride(2)), cp.float32(scale * 1.4426950408889634)), shared_mem=smem)
    return out, lse

def reference(q, k, v, causal, scale):
    b, hq, sq, d = q.shape; hk, skv = k.shape[1], k.shape[2]
    g = hq // hk
    kf = k.double().repeat_interleave(g, 1); vf = v.double().repeat_interleave(g, 1)
    s = q.double() @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(sq, device="cuda")[:, None]; j = torch.arange(skv, device="cuda")[None, :]
        s = s.masked_fill(j > i + skv - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = p @ vf
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, 1e30), lse)
    return o, lse

def same_precision(q, k, v, causal, scale):
    """Naive path in the input dtype (the error rule's yardstick)."""
    b, hq, sq, d = q.shape; g = hq // k.shape[1]
    kk = k.repeat_interleave(g, 1); vv = v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        skv = k.shape[2]
        i = torch.arange(sq, device="cuda")[:, None]; j = torch.arange(skv, device="cuda")[None, :]
        s = s.masked_fill(j > i + skv - sq, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    return p @ vv

def check(filter_):
    cases = [(1, 2, 2, 128, 128, False), (2, 4, 2, 1000, 1000, True), (1, 8, 1, 17, 257, True), (1, 4, 4, 300, 129, False),
             (2, 8, 2, 200, 65, True), (1, 2, 1, 1, 1000, True), (1, 2, 2, 65, 63, False), (1, 4, 1, 513, 2049, True)]
    ok = True
    for d in (64, 128):
        for f16 in (False, True):
            dt = torch.float16 if f16 else torch.bfloat16
            for (b, hq, hk, sq, skv, causal) in cases:
                for (bc, wg) in variants(d):
                    if filter_ and filter_ not in f"d{d}bc{bc}wg{wg}": continue
                    kern = build(d, bc, wg, causal, f16)
                    if kern is None: ok = False; continue
                    torch.manual_seed(sq * 7 + skv)
                    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
                    k = torch.randn(b, hk, skv, d, device="cuda", dtype=dt)
                    v = torch.randn(b, hk, skv, d, device="cuda", dtype=dt)
                    if sq == 1000: q = q * 4  # large logits
                    scale = 1 / math.sqrt(d)
                    out = torch.full((b, hq, sq, d), float("nan"), device="cuda", dtype=dt)
                    lse = torch.full((b, hq, sq), float("nan"), device="cuda")
                    launch(kern, q, k, v, causal, scale, out, lse); torch.cuda.synchronize()
                    ro, rl = reference(q, k, v, causal, scale)
                    naive = (same_precision(q, k, v, causal, scale).double() - ro).abs().max().item()
                    err = (out.double() - ro).abs().max().item()
                    lerr = ((lse.double() - rl).abs() / rl.abs().clamp(min=1)).max().item()
                    tol = 2 * naive + (2e-3 if f16 else 1.6e-2)
                    good = err <= tol and lerr < 1e-3 and not torch.isnan(out).any()
                    ok &= good
                    if not good and os.environ.get("DIAG"):
                        bad = ((out.double() - ro).abs() > tol) | torch.isnan(out)
                        idx = bad.nonzero()
                        rows = idx[:, 2].unique(); cols = idx[:, 3].unique()
                        print(f"   bad {idx.shape[0]} of {out.numel()}; heads {idx[:,1].unique().tolist()[:8]} rows {rows.tolist()[:24]} ... ({rows.numel()}) cols ({cols.numel()}) {cols.tolist()[:20]}; nan {torch.isnan(out).sum().item()}")
                    print(f"{'ok ' if good else 'BAD'} d{d} bc{bc} wg{wg} {'f16 ' if f16 else 'bf16'} b{b} hq{hq} hk{hk} sq{sq} skv{skv} causal={causal}: err {err:.2e} naive {naive:.2e} lse {lerr:.2e}", flush=True)
    print("CHECK", "PASS" if ok else "FAIL")

def variants(d):
    env = os.environ.get("VARIANTS")
    if env: return [tuple(map(int, x.split("x"))) for x in env.split(",")]
    return [(128, 2), (64, 2), (64, 3)] if d == 128 else [(128, 2), (64, 2), (128, 3)]

def ms(f, reps=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    best = []
    for _ in range(3):
        e0.record()
        for _ in range(reps): f()
        e1.record(); torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) / reps)
    return min(best)

def bench(filter_):
    for d in (128, 64):
        for seq in (4096, 16384):
            for causal in (False, True):
                b, h = 16384 // seq, 2048 // d
                q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                line = f"hd{d} s{seq} causal={causal!s:<5} fa2 {flops / t / 1e9:6.1f}"
                for (bc, wg) in variants(d):
                    if filter_ and filter_ not in f"d{d}bc{bc}wg{wg}": continue
                    kern = build(d, bc, wg, causal, False)
                    if kern is None: continue
                    out, lse = launch(kern, q, k, v, causal, 1 / math.sqrt(d))
                    t = ms(lambda: launch(kern, q, k, v, causal, 1 / math.sqrt(d), out, lse))
                    line += f" | bc{bc}wg{wg} {flops / t / 1e9:6.1f}"
                print(line, flush=True)

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
filt = sys.argv[2] if len(sys.argv) > 2 else ""
if mode in ("check", "all"): check(filt)
if mode in ("bench", "all"): bench(filt)
