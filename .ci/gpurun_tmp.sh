set -x
nvidia-smi -L
timeout 100 tileops warmup --jobs 32 > $OUT/warm.log 2>&1
tail -1 $OUT/warm.log
timeout 40 python -m benchmarks.launch_cost > $OUT/launch_cost.log 2>&1
cat $OUT/launch_cost.log
timeout 80 python -m benchmarks.serving --host > $OUT/host.log 2>&1
tail -12 $OUT/host.log
timeout 270 python -m pytest -m cuda -q -p no:cacheprovider -rs > $OUT/test.log 2>&1
tail -15 $OUT/test.log
