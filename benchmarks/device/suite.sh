# One part of the CUDA suite on the device machine, its log in $OUT, each test's outcome by name as it
# ends (-v: a run cut by its limit still names what failed before; -q's dots name nothing):
#   bash .devsite/gpu.sh bash benchmarks/device/suite.sh K/N SECONDS
# Measured on an H100 (2026-12-05): two parts of ~350 tests each need more than 390 s at -n 15 (the
# patched HF models and the whole-tensor write checks are the long tail), so three parts, each given 400 s.
source benchmarks/device/common.sh
part=${1:?K/N}; limit=${2:-400}
timeout "$limit" python3 -m pytest -m cuda tests -n 15 --shard "$part" -p no:cacheprovider -v -rfE \
  --durations=10 2>&1 | grep -vE "Warning|warner" | tee "$OUT/suite-${part/\//of}.log" |
  grep -E "FAILED|ERROR|passed|failed" | tail -40
