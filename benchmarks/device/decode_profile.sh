# Where the float8 paged decode's time goes (issue 37: 55% of its bytes' copy where bf16 reaches 93-100%):
#   bash .devsite/gpu.sh bash benchmarks/device/decode_profile.sh
# Nsight Compute on one call of the tensor-core partial at 64 x 4096 (bf16 q, GQA 32/8, D 128, block size
# 16), the float8 cache and the bf16 one side by side (--clock-control none, as the device notes ask):
# throughput, occupancy, warp stalls, memory; summarised into $OUT/ncu-<cache>.txt.
source benchmarks/device/common.sh
t0=$SECONDS
cat > /tmp/one_decode.py <<'PY'
import sys
import torch
from benchmarks.decode import _paged
from tileops.attention import PagedAttnDecodeFwdOp
fp8 = sys.argv[1] == "fp8"
dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
s = _paged(64, 4096, 16, dt, g)
extra = {"k_scale": torch.tensor([0.02], device="cuda"), "v_scale": torch.tensor([0.5], device="cuda")} if fp8 else {}
op = PagedAttnDecodeFwdOp(32, 8, 128, cache_dtype=dt if fp8 else None)
for _ in range(3):
    op(**s, **extra)
torch.cuda.synchronize()
op.check()
PY
for c in ${CACHES:-fp8 bf16}; do
  timeout 200 ncu --clock-control none --kernel-name regex:partial --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section InstructionStats --import-source yes --section SourceCounters \
    -o /tmp/dec-$c -f env PYTHONPATH="$PWD:$PYTHONPATH" python3 /tmp/one_decode.py $c 2>&1 | tail -3
  ncu --import /tmp/dec-$c.ncu-rep --page details > "$OUT/ncu-$c.txt" 2>&1 && cp /tmp/dec-$c.ncu-rep "$OUT/"
  ncu --import /tmp/dec-$c.ncu-rep --page raw > "$OUT/raw-$c.txt" 2>&1
  echo "== $c"
  grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_warp_active.pct" "$OUT/raw-$c.txt" | sort -k3 -n -r | head -8
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Static Shared|Waves Per SM|Stall|Issued Ipc|No Eligible|Block Limit|Executed Instructions " "$OUT/ncu-$c.txt" | head -40
done
echo "all: $((SECONDS - t0)) s"
