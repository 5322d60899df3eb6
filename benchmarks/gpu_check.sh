#!/usr/bin/env bash
# The GPU path for real, on a machine with a CUDA GPU; run from the repository root:
#
#     bash benchmarks/gpu_check.sh [CONVERTED_FOLDER]
#
# 1. The Triton 2-bit base kernel, compiled (not interpreted), against the dequantized reference on every
#    shape the CPU tests use, and timed against torch's dense fp16 GEMM of the same matrix.
# 2. With a converted folder (fitted tree statistics included; `splitspec convert` makes one), the
#    speculative engine on the GPU: benchmarks/e2e.py --device cuda, which writes the same e2e fields.
# Results go to $OUT (or benchmarks/results). Needs torch with CUDA, triton, and this package's
# dependencies importable by `python3` (pip install -e . where the registries are reachable).
set -euo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}"
python3 - "$OUT" <<'EOF'
import json, sys, time
import torch
from splitspec.gpu_actor.kernels import base_matmul
from test_gpu_actor_kernels import check_all_shapes  # the CPU tests' shapes and reference

assert torch.cuda.is_available(), "no CUDA device"
check_all_shapes(base_matmul, "cuda", every_n=True)
rows, d_in = 5120, 5120
codes = torch.randint(-(2**31), 2**31 - 1, (rows, d_in // 32, 2), dtype=torch.int32, device="cuda")
scale = torch.rand(rows, d_in // 128, device="cuda").half()
levels = torch.tensor([-1.5, -0.45, 0.45, 1.5], device="cuda")
dense = torch.randn(rows, d_in, device="cuda").half()
out = {}
for n in (1, 4, 16, 64):
    x = torch.randn(n, d_in, device="cuda")
    for name, fn in (("triton_ms", lambda: base_matmul(codes, scale, levels, x)), ("fp16_gemm_ms", lambda: x.half() @ dense.T)):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        out.setdefault(str(n), {})[name] = (time.perf_counter() - t0) / 50 * 1e3
print(json.dumps(out, indent=1))
json.dump({"device": torch.cuda.get_device_name(), "base_kernel": out}, open(f"{sys.argv[1]}/gpu_kernel.json", "w"), indent=1)
EOF
if [ $# -ge 1 ]; then
    python3 benchmarks/e2e.py "$1" --device cuda --out "$OUT/e2e_gpu.json"
fi
