# Where the attention forward's time goes, for the rows that lose most to cuDNN (short causal
# sequences: 0.36x at 16 x 1024 on the H100, 0.79x since the fixes this found, 2026-12-05):
#   bash .devsite/gpu.sh bash benchmarks/device/attention_profile.sh
# 1. benchmarks.attention_cost: a block's fixed cost and its cost per K/V tile, fitted, for pipelines 2
#    and 4 (and 4 at 176-key tiles) beside cuDNN's; 2. Nsight Compute on one call of the default
#    schedule at 16 x 1024 causal (--clock-control none, as the device notes ask): throughput, occupancy,
#    warp stalls and memory, summarised into $OUT/ncu.txt. The kernels come in the carried index
#    (benchmarks.device_cache --attention-configs 128x128x2x256x2,128x128x2x256x4,128x176x2x256x4).
source benchmarks/device/common.sh
t0=$SECONDS
timeout 240 python3 -m benchmarks.attention_cost --configs 128x128x2x256x2,128x128x2x256x4,128x176x2x256x4 2>&1 |
  tee "$OUT/cost.log" | grep -vE "^\["
cat > /tmp/one_call.py <<'PY'
import torch
from tileops.attention import AttnFwdOp
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(16, 1024, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(16, 1024, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
op = AttnFwdOp(32, 8, 128, causal=True)
for _ in range(3):
    op(q, k, v)
torch.cuda.synchronize()
PY
timeout 200 ncu --clock-control none --kernel-name regex:attn_fwd --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  -o /tmp/attn16x1k -f python3 /tmp/one_call.py 2>&1 | tail -5
ncu --import /tmp/attn16x1k.ncu-rep --page details > "$OUT/ncu.txt" 2>&1 && cp /tmp/attn16x1k.ncu-rep "$OUT/"
grep -E "Duration|Throughput|Achieved Occupancy|Registers|Shared Memory Configuration|Waves Per SM|Stall|Issued Ipc|No Eligible|L2 Hit|Block Limit" "$OUT/ncu.txt" | head -40
echo "all: $((SECONDS - t0)) s"
