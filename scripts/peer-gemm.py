#!/usr/bin/env python3
# cuBLAS (torch bf16 matmul) at the 8B shapes tc_probe times its tensor-core GEMMs at:
# the peer for kernels/examples/tc_probe's speed table, run on the same GPU in the same call.
import torch, sys
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
print("torch", torch.__version__, torch.cuda.get_device_name(0))
print(f"{'cuBLAS bf16':<16} {'n':>5} {'rows':>7} {'k':>7} {'us':>10} {'TFLOP/s':>9} {'W GB/s':>10}")
for rows, k in [(6144, 4096), (28672, 4096), (4096, 14336)]:
    for n in [1, 16, 64, 512]:
        x = torch.randn(n, k, device='cuda', dtype=torch.bfloat16)
        w = torch.randn(rows, k, device='cuda', dtype=torch.bfloat16) * 0.05
        for _ in range(3): y = x @ w.t()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10): y = x @ w.t()
            e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 10 * 1e-3)
        ts.sort(); t = ts[len(ts)//2]
        print(f"{'cuBLAS bf16':<16} {n:>5} {rows:>7} {k:>7} {t*1e6:>10.1f} {2*n*rows*k/t/1e12:>9.1f} {rows*k*2/t/1e9:>10.0f}")
