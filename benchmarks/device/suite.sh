# One part of the CUDA suite on the device machine, its log in $OUT, each test's outcome by name as it
# ends (-v: a run cut by its limit still names what failed before; -q's dots name nothing):
#   bash .devsite/gpu.sh bash benchmarks/device/suite.sh K/N SECONDS
# Measured on an H100 (2026-12-05): at -n 15 the two halves (`1/2`, `2/2`, given 450 s each) took 415
# and 402 s, some 180 kernels compiled there among them; the long tail is the generated AttnFwdOp
# gqa-4x512-causal tests (300-362 s), the docs' HF page and the patched HF models.
# Every kernel a test still compiles there (one not in the carried index) is named, after its test, in
# $OUT/compiled-KofN.log (TILEOPS_COMPILE_LOG, tests/conftest.py), and the index entries themselves are
# packed into $OUT/new-kernels-KofN.tar.xz, for the next `benchmarks.device_cache --merge`.
source benchmarks/device/common.sh
part=${1:?K/N}; limit=${2:-400}
rm -rf /tmp/compiles
TILEOPS_COMPILE_LOG=/tmp/compiles timeout "$limit" python3 -m pytest -m cuda tests -n 15 --shard "$part" -p no:cacheprovider -v -rfE \
  --durations=10 2>&1 | grep -vE "Warning|warner" | tee "$OUT/suite-${part/\//of}.log" |
  grep -E "FAILED|ERROR|passed|failed" | tail -40
cat /tmp/compiles/*.log 2>/dev/null | sort > "$OUT/compiled-${part/\//of}.log"
echo "kernels compiled during the part: $(wc -l < "$OUT/compiled-${part/\//of}.log")"
# the index entries built on this machine so far (both parts, where one machine ran both), for
# `python -m benchmarks.device_cache --merge` to fold into the next pack
if [[ -f /tmp/kc/unpacked ]]; then
  (cd /tmp/kc && find kernels -type f -newer unpacked \( -name "*.json" -o -name "*.so" \)) > /tmp/new-kernels
  XZ_OPT="-6 -T0" tar -cJf "$OUT/new-kernels-${part/\//of}.tar.xz" -C /tmp/kc -T /tmp/new-kernels
  echo "index entries built here: $(wc -l < /tmp/new-kernels) files, $OUT/new-kernels-${part/\//of}.tar.xz"
fi
