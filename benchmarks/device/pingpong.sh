# Pipelines 3 and 4 (kernels/attention.py: the two consumer warpgroups in ping-pong, and 4 with each
# tile's softmax under the previous tile's P V) on the device, beside pipeline 2, the manifest's
# default, before either is chosen anywhere:
#   bash .devsite/gpu.sh bash benchmarks/device/pingpong.sh
# 1. each variant returns and agrees with SDPA (a hang reads TIMEOUT), 2. synccheck and racecheck of
# one pipeline-4 call (the named barriers, the tiles released after the waits), 3. the four
# bf16 rows, pipeline 2 against 3 and 4 (4 also at tiles of 176 keys, FlashAttention-3's width there).
# The kernels come compiled in the carried index: python -m benchmarks.device_cache --attention-configs
# with the same --configs and --attention-dtypes bf16.
source benchmarks/device/common.sh
t0=$SECONDS
timeout 170 python3 -m benchmarks.attention_probe --pipelines 3,4 --dims 64,128 --timeout 40 --jobs 16 2>&1 |
  tee "$OUT/probe.log" | grep -vE "^\[" | tail -12
one='{"pipeline": 4, "causal": true, "seq": 2048, "dim": 128, "backward": false}'
for tool in synccheck racecheck; do
  TILEOPS_ATTENTION_CUDA=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 99 \
    python3 -m benchmarks.attention_probe --one "$one" 2>&1 | tail -4 | tee -a "$OUT/sanitizer.log"
done
echo "probe and sanitizer: $((SECONDS - t0)) s"
timeout 330 python3 -m benchmarks.attention --no-compile --dtypes bf16 --jobs 16 \
  --configs 128x128x2x256x2,128x128x2x256x3,128x128x2x256x4,128x176x2x256x4 2>&1 | tee "$OUT/pingpong.log" | grep -vE "^\[" | tail -12
echo "all: $((SECONDS - t0)) s"
