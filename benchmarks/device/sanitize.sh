# The sanitizer's shard K/N on the device machine, its summary and each tool's log written into $OUT as
# they run, so that a call cut by its limit still brings back what ran:
#   bash .devsite/gpu.sh bash benchmarks/device/sanitize.sh 2/3 SECONDS [--jobs 0] [--tools initcheck] [--match Attn]
# Give SECONDS some 20 s under the call's limit (the reply's limit_s can be less than asked: the device
# time left). On 2026-12-06 a call cut at 209 s had kept its logs under /tmp and piped its summary into
# `tail`: it brought back nothing. On an H100 a shard's plain run takes ~40 s and its four tools, three
# processes each, 110-200 s (`--jobs 0` skips the plain run where an earlier command ran it).
source benchmarks/device/common.sh
part=${1:?K/N}; limit=${2:-240}; shift 2
dir="$OUT/sanitize-${part/\//of}"
mkdir -p "$dir"
# (_summary.log sorts before the tools' logs: a reply brings back a limited number of files)
timeout "$limit" python3 -m benchmarks.sanitize --shard "$part" --concurrent --tool-parts 3 --logdir "$dir" "$@" 2>&1 |
  grep -vE "Warning|warner" | tee "$dir/_summary.log" | grep -vE "^    " | tail -16
grep -h "Uninitialized\|Host Frame:.*py:" "$dir"/sanitize-*.log 2>/dev/null | sort | uniq -c | sort -rn | head -6
