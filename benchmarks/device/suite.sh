# One part of the CUDA suite on the device machine, its log in $OUT, each test's outcome by name as it
# ends (-v: a run cut by its limit still names what failed before; -q's dots name nothing):
#   bash .devsite/gpu.sh bash benchmarks/device/suite.sh K/N SECONDS
# Measured on an H100 (2026-12-05): at -n 15 the two halves (`1/2`, `2/2`, given 450 s each) took 415
# and 402 s, some 180 kernels compiled there among them; the long tail is the generated AttnFwdOp
# gqa-4x512-causal tests (300-362 s), the docs' HF page and the patched HF models.
# Every kernel a test still compiles there (one not in the carried index) is named, after its test, in
# $OUT/suite-built/compiled-KofN.log (TILEOPS_COMPILE_LOG, tests/conftest.py), and the index entries
# themselves are packed into $OUT/suite-built/new-kernels-KofN.tar.xz, for the next
# `benchmarks.device_cache --merge`; neither is written when empty.
source benchmarks/device/common.sh
part=${1:?K/N}; limit=${2:-400}
rm -rf /tmp/compiles
TILEOPS_COMPILE_LOG=/tmp/compiles timeout "$limit" python3 -m pytest -m cuda tests -n 15 --shard "$part" -p no:cacheprovider -v -rfE \
  --durations=10 2>&1 | grep -vE "Warning|warner" | tee "$OUT/suite-${part/\//of}.log" |
  grep -E "FAILED|ERROR|passed|failed" | tail -40
# what was built here goes under $OUT/suite-built/, after the suite logs by name, and only when there is
# some: a reply brings back a limited number of files, and on 2026-12-06 three empty compile logs and three
# copies of one kernel pack came back in place of two of the three parts' logs
built="$OUT/suite-built"; mkdir -p "$built"
cat /tmp/compiles/*.log 2>/dev/null | sort > /tmp/compiled.log
echo "kernels compiled during the part: $(wc -l < /tmp/compiled.log)"
[[ -s /tmp/compiled.log ]] && cp /tmp/compiled.log "$built/compiled-${part/\//of}.log"
# the index entries built on this machine since the last part packed them (an earlier call on a warm
# machine included: the sanitizer's runs compile too), for `python -m benchmarks.device_cache --merge`
# to fold into the next pack
if [[ -f /tmp/kc/unpacked ]]; then
  (cd /tmp/kc && find kernels -type f -newer unpacked \( -name "*.json" -o -name "*.so" \)) > /tmp/new-kernels
  if [[ -s /tmp/new-kernels ]]; then
    XZ_OPT="-6 -T0" tar -cJf "$built/new-kernels-${part/\//of}.tar.xz" -C /tmp/kc -T /tmp/new-kernels
    touch /tmp/kc/unpacked  # the next part packs only what it builds
  fi
  echo "index entries built here: $(wc -l < /tmp/new-kernels) files"
fi
