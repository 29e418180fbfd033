"""The masked attention of a pi0 step on each SDPA backend: the expert (51 tokens x 8 heads folded over one KV
head, 611 keys, batch 1 and 8) and the backbone prefix (560 x 8 over 560), bool and additive masks, timed as 20
back-to-back calls in one CUDA graph. Run on a GPU: ``python benchmarks/robot_attention_probe.py``."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"


def t(fn):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 20 * 1000


for name, (B, L, S) in {"expert": (1, 408, 611), "expert_b8": (8, 408, 611), "backbone": (1, 4480, 560)}.items():
    q = torch.randn(B, 1, L, 256, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 1, S, 256, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    m = torch.ones(B, 1, L, S, dtype=torch.bool, device=dev)
    m[..., -40:] = False
    add = torch.zeros(B, 1, L, S, dtype=torch.bfloat16, device=dev).masked_fill(~m, float("-inf"))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m)
    for bk in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        for mname, mask in (("bool", m), ("additive", add)):
            try:
                with sdpa_kernel([bk]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    us = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # noqa: B023 (called at once)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"{name:10} {bk.name:20} {mname:8} {us:8.1f} us  rel {err:.1e}")
            except Exception as e:
                print(f"{name:10} {bk.name:20} {mname:8} failed {type(e).__name__}: {str(e)[:60]}")
