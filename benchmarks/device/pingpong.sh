# Pipeline 3 (kernels/attention.py: the two consumer warpgroups in ping-pong) on the device, beside
# pipeline 2, the manifest's default; on branch attn-pingpong until it has run there:
#   bash .devsite/gpu.sh bash benchmarks/device/pingpong.sh
# 1. each variant returns and agrees with SDPA (a hang reads TIMEOUT), 2. synccheck and racecheck of
# one call (the named barriers), 3. the four bf16 rows, pipeline 2 against 3 at two tile widths.
source benchmarks/device/common.sh
t0=$SECONDS
timeout 170 python3 -m benchmarks.attention_probe --pipelines 3 --dims 64,128 --timeout 40 --jobs 16 2>&1 |
  tee "$OUT/probe.log" | grep -vE "^\[" | tail -12
one='{"pipeline": 3, "causal": true, "seq": 2048, "dim": 128, "backward": false}'
for tool in synccheck racecheck; do
  TILEOPS_ATTENTION_CUDA=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 99 \
    python3 -m benchmarks.attention_probe --one "$one" 2>&1 | tail -4 | tee -a "$OUT/sanitizer.log"
done
echo "probe and sanitizer: $((SECONDS - t0)) s"
timeout 330 python3 -m benchmarks.attention --no-compile --dtypes bf16 --jobs 16 \
  --configs 128x128x2x256x2,128x128x2x256x3,128x176x2x256x3 2>&1 | tee "$OUT/pingpong.log" | grep -vE "^\[" | tail -12
echo "all: $((SECONDS - t0)) s"
