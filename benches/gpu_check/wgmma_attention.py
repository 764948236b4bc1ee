"""Kernel-level harness for the Hopper attention kernels (`kernels/src/flash_attention/wgmma/`),
on the GPU machine without Rust: builds them with nvcc for sm_90a (registers and spills from
ptxas), checks them against an f64 reference with the DEVELOPERS.md error rule (ragged lengths,
causal offsets, GQA, rows that see no key, large logits; outputs poisoned with NaN first), and
times them next to SDPA's FlashAttention-2 backend in the same process.

    python3 benches/gpu_check/wgmma_attention.py [check|bench|all|bwd-check|bwd-bench|bwd] [filter, e.g. d128bc128]

The forward modes take a variant filter; the backward modes (`bwd` = both) a head-dim filter
(`d128`).

VARIANTS=128x2,64x2 picks (keys per tile, warpgroups); EXTRA='#define X 1;...' prepends defines;
DIAG=1 prints where a failing case is wrong. Kiln itself compiles the same sources through
CubeCL's NVRTC (`wgmma/mod.rs`); this harness exists to iterate on the kernel in seconds."""
import os, subprocess, sys, math, time
import torch, cupy as cp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "kernels", "src", "flash_attention", "wgmma")
HOPPER = os.path.join(HERE, "..", "..", "kernels", "src", "hopper")
WRAP = r'''
extern "C" __global__ void __launch_bounds__(THREADS, 1) fa_fwd(const u16* q, const u16* k, const u16* v, u16* out, float* lse,
    u32 q_heads, u32 group, u32 q_len, u32 kv_len, u32 qb, u32 qh, u32 qs, u32 kb, u32 kh, u32 ks, u32 vb, u32 vh, u32 vs, float scale_log2) {
    Info p = {q_heads, group, q_len, kv_len, qb, qh, qs, kb, kh, ks, vb, vh, vs, scale_log2};
    attention_forward(q, k, v, out, lse, p);
}
extern "C" __global__ void shared_bytes(u32* o) { o[0] = KILN_SHARED_BYTES; }
'''
_cache = {}
def compile_kernel(name, source, wrapper, entry, defines):
    """nvcc-builds `source` (after the defines, the Hopper header, `wgmma.cuh` and `common.cuh`) with `wrapper`;
    returns (function, shared bytes) or None."""
    if name in _cache: return _cache[name]
    cu = os.path.join("/tmp", name + ".cu")
    defs = os.environ.get("EXTRA", "").replace(";", "\n") + "\n" + "".join(f"#define {k} {v}\n" for k, v in defines.items())
    sources = [os.path.join(HOPPER, "common.cuh"), os.path.join(HOPPER, "wgmma.cuh")] + [os.path.join(SRC, f) for f in ("common.cuh", source)]
    parts = [defs] + [open(f).read() for f in sources] + [wrapper]
    open(cu, "w").write("\n".join(parts))
    cubin = cu.replace(".cu", ".cubin")
    r = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-I", SRC, cu, "-o", cubin], capture_output=True, text=True)
    info = [l for l in (r.stdout + r.stderr).splitlines() if "registers" in l or "spill" in l or "error" in l.lower() or "warn" in l.lower() or "wgmma" in l.lower()]
    print(f"build {name}: rc {r.returncode}; " + " | ".join(x.strip() for x in info[-4:]), flush=True)
    if r.returncode != 0:
        print(r.stderr[-3000:]); _cache[name] = None; return None
    mod = cp.RawModule(path=cubin)
    fn = mod.get_function(entry)
    sb = cp.zeros(1, dtype=cp.uint32); mod.get_function("shared_bytes")((1,), (1,), (sb,)); smem = int(sb.get()[0])
    fn.max_dynamic_shared_size_bytes = smem
    _cache[name] = (fn, smem)
    return _cache[name]

def element_defines(d, causal, f16):
    return {"KILN_D": d, "KILN_CAUSAL": int(causal), "KILN_F16": int(f16), "KILN_WGMMA_TYPE": '"f16"' if f16 else '"bf16"'}

def build(d, bc, wg, causal, f16):
    name = f"fa_d{d}_bc{bc}_wg{wg}_c{int(causal)}_{'f16' if f16 else 'bf16'}"
    defines = dict(element_defines(d, causal, f16), KILN_BC=bc, KILN_WG=wg, KILN_EMPTY_LSE="1e30f")
    built = compile_kernel(name, "forward.cu", WRAP, "fa_fwd", defines)
    return None if built is None else built + (wg,)

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

BWD_WRAP = r'''
extern "C" __global__ void __launch_bounds__(THREADS, 1) fa_bwd(const u16* q, const u16* k, const u16* v, const u16* d_out, const float* lse,
    const float* delta, float* dq, u16* dk, u16* dv, u32 q_heads, u32 group, u32 q_len, u32 kv_len, u32 qb, u32 qh, u32 qs, u32 kb, u32 kh, u32 ks,
    u32 vb, u32 vh, u32 vs, u32 ob, u32 oh, u32 os, float scale, float scale_log2) {
    BackwardInfo p = {q_heads, group, q_len, kv_len, qb, qh, qs, kb, kh, ks, vb, vh, vs, ob, oh, os, scale, scale_log2};
    attention_backward(q, k, v, d_out, lse, delta, dq, dk, dv, p);
}
extern "C" __global__ void shared_bytes(u32* o) { o[0] = KILN_SHARED_BYTES; }
'''

def build_backward(d, causal, f16):
    name = f"fa_bwd_d{d}_c{int(causal)}_{'f16' if f16 else 'bf16'}_{abs(hash(os.environ.get('EXTRA', ''))) % 10**6}"
    return compile_kernel(name, "backward.cu", BWD_WRAP, "fa_bwd", element_defines(d, causal, f16))

def launch_backward(kern, q, k, v, d_out, lse, delta, scale, dq, dk, dv):
    fn, smem = kern
    b, hq, sq, d = q.shape; hk, skv = k.shape[1], k.shape[2]
    a = lambda t: cp.from_dlpack(t.detach())
    u = cp.uint32
    strides = lambda t: [u(t.stride(0)), u(t.stride(1)), u(t.stride(2))]
    fn(((skv + 127) // 128, hk, b), (256,), tuple([a(x) for x in (q, k, v, d_out, lse, delta, dq, dk, dv)] + [u(hq), u(hq // hk), u(sq), u(skv)]
        + strides(q) + strides(k) + strides(v) + strides(d_out) + [cp.float32(scale), cp.float32(scale * 1.4426950408889634)]), shared_mem=smem)

def attention_graph(q, k, v, causal, scale):
    """softmax(scale·q·kᵀ, masked)·v in the inputs' dtype, softmax in f32 (the naive path), and its lse."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, 1); vv = v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        sq, skv = q.shape[2], k.shape[2]
        i = torch.arange(sq, device="cuda")[:, None]; j = torch.arange(skv, device="cuda")[None, :]
        s = s.masked_fill(j > i + skv - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p.to(q.dtype) @ vv, lse

def gradients(q, k, v, d_out, causal, scale, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_graph(*leaves, causal, scale)
    out.backward(d_out.to(dtype))
    return out.detach(), lse.detach(), [t.grad for t in leaves]

def backward_check(filter_):
    cases = [(1, 2, 2, 128, 128, False), (2, 4, 2, 1000, 1000, True), (1, 8, 1, 17, 257, True), (1, 4, 4, 300, 129, False),
             (2, 8, 2, 200, 65, True), (1, 2, 1, 1, 1000, True), (1, 2, 2, 65, 63, False), (1, 4, 1, 513, 2049, True),
             (1, 2, 2, 257, 257, True), (1, 2, 1, 1000, 200, True)]
    if os.environ.get("CASES"): cases = [cases[int(i)] for i in os.environ["CASES"].split(",")]
    ok = True
    for d in (128, 64):
        if filter_ and filter_ != f"d{d}": continue
        for f16 in (False, True) if os.environ.get("DTYPES") != "bf16" else (False,):
            dt = torch.float16 if f16 else torch.bfloat16
            for (b, hq, hk, sq, skv, causal) in cases:
                kern = build_backward(d, causal, f16)
                if kern is None: ok = False; continue
                torch.manual_seed(sq * 7 + skv)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt) for h, n in ((hq, sq), (hk, skv), (hk, skv)))
                if sq == 1000: q = q * 4  # large logits
                d_out = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
                scale = 1 / math.sqrt(d)
                out64, lse64, grads64 = gradients(q, k, v, d_out, causal, scale, torch.float64)
                _, _, grads_n = gradients(q, k, v, d_out, causal, scale, dt)
                # Inputs as kiln passes them: an accurate forward's output (rounded to the dtype) and
                # lse (empty rows: 1e30), D from them. (D from the naive path's output carried its
                # f16-rounded logits into dQ: 2.6e-2 off at hd64 f16 with large logits.)
                lse = torch.where(torch.isinf(lse64), torch.full_like(lse64, 1e30), lse64).float().contiguous()
                delta = (d_out.float() * out64.to(dt).float()).sum(-1).contiguous()
                dq = torch.zeros(b, hq, sq, d, device="cuda", dtype=torch.float32)
                dk = torch.full((b, hk, skv, d), float("nan"), device="cuda", dtype=dt)
                dv = torch.full((b, hk, skv, d), float("nan"), device="cuda", dtype=dt)
                launch_backward(kern, q, k, v, d_out, lse, delta, scale, dq, dk, dv); torch.cuda.synchronize()
                line, good = "", True
                for name, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64, grads_n):
                    err = (got.double() - ref).abs().max().item()
                    base = (naive.double() - ref).abs().max().item()
                    tol = 2 * base + (2 ** -10 if f16 else 2 ** -7) * ref.abs().max().item()
                    fine = err <= tol and not torch.isnan(got).any()
                    good &= fine
                    line += f" {name} {err:.2e}/{tol:.2e}{'' if fine else '!'}"
                    if not fine and os.environ.get("DIAG"):
                        line += f" (nan {torch.isnan(got).sum().item()}/{got.numel()}, got {got.flatten()[:3].tolist()} ref {ref.flatten()[:3].tolist()})"
                ok &= good
                print(f"{'ok ' if good else 'BAD'} bwd d{d} {'f16 ' if f16 else 'bf16'} b{b} hq{hq} hk{hk} sq{sq} skv{skv} causal={causal}:{line}", flush=True)
    print("BWD CHECK", "PASS" if ok else "FAIL")

def backward_bench(filter_):
    for d in (128, 64):
        if filter_ and filter_ != f"d{d}": continue
        for seq in (4096, 8192, 16384):
            for causal in (False, True):
                b, h = 16384 // seq, 2048 // d
                q, k, v, d_out = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 10 * b * h * seq * seq * d * (0.5 if causal else 1.0)  # 2.5 forwards
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    fwd = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    both = ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal), (qg, kg, vg), d_out))
                fa2 = flops / (both - fwd) / 1e9
                kern = build_backward(d, causal, False)
                if kern is None: continue
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
                delta = (d_out.float() * out.float()).sum(-1)
                dq = torch.zeros(b, h, seq, d, device="cuda"); dk = torch.empty_like(k); dv = torch.empty_like(v)
                scale = 1 / math.sqrt(d)
                t = ms(lambda: launch_backward(kern, q, k, v, d_out, lse, delta, scale, dq, dk, dv))
                print(f"bwd hd{d} s{seq} causal={causal!s:<5} fa2 {fa2:6.1f} | kiln {flops / t / 1e9:6.1f} TF/s ({t:.3f} ms)", flush=True)

mode = sys.argv[1] if len(sys.argv) > 1 else "all"
filt = sys.argv[2] if len(sys.argv) > 2 else ""
if mode in ("check", "all"): check(filt)
if mode in ("bench", "all"): bench(filt)
if mode in ("bwd-check", "bwd"): backward_check(filt)
if mode in ("bwd-bench", "bwd"): backward_bench(filt)
