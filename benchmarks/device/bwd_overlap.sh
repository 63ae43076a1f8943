# The attention backward's overlap levels (kernels/attention_bwd.py, `overlap`: 1 the default, 2 the score
# products together, 3 dk/dv's dV product under ds) on the device, before either is made the default:
#   bash .devsite/gpu.sh bash benchmarks/device/bwd_overlap.sh
# 1. the four rows at head_dim 128 and HF Llama's head_dim-64 row, the levels side by side in one
# process; 2. the backward's CUDA tests (test_cuda_overlapped_steps_give_the_waited_steps_values among them);
# 3. racecheck and synccheck of the overlapped steps' test on one mask (the stages released after the waits).
# The kernels come compiled in the carried index (python -m benchmarks.device_cache, then the benchmark's
# configs' specs: benchmarks.attention_bwd.specs); what is missing compiles here at --jobs 16.
source benchmarks/device/common.sh
t0=$SECONDS
timeout 170 python3 -m benchmarks.attention_bwd --configs "default,overlap scores,overlap dv" --quick --jobs 16 2>&1 |
  grep -v Warning | tee "$OUT/bwd128.log" | tail -24
timeout 70 python3 -m benchmarks.attention_bwd --head-dim 64 --heads 16/4 --rows 4 --configs "default,overlap scores" \
  --quick --jobs 16 2>&1 | grep -v Warning | tee "$OUT/bwd64.log" | tail -10
echo "benchmarks: $((SECONDS - t0)) s"
timeout 300 python3 -m pytest -m cuda -q -n 8 -p no:cacheprovider -rfE tests/test_attention_bwd_kernels.py \
  tests/test_attn_bwd_cuda.py 2>&1 | grep -vE "Warning|warner" | tee "$OUT/tests.log" | tail -12
for tool in racecheck synccheck; do
  timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 99 python3 -m pytest -m cuda -q -n 0 \
    -p no:cacheprovider "tests/test_attention_bwd_kernels.py::test_cuda_overlapped_steps_give_the_waited_steps_values[sq>sk]" \
    2>&1 | tail -4 | tee -a "$OUT/sanitizer.log"
done
echo "in all: $((SECONDS - t0)) s"
