# The host table of an earlier tree and this one side by side in one device call (issue 35 item 5: the
# host table's rows within 5% of the tree the issue was filed against, on the device), each tree
# installed in turn, alternated ROUNDS times (default 2): the shared host's noise moved a bare `mul`
# from 7.9 to 12.0 us between two rounds on 2026-12-03, so each row is read as its ratio to the bare op
# timed in the same process, and across rounds. The earlier tree travels as a git archive:
#   git archive a305eac | xz -9 > .devsite/before.tar.xz    # a305eac: before issue 35's first commit
#   run carry [..., ".devsite/before.tar.xz"]:  bash .devsite/gpu.sh bash benchmarks/device/host_ab.sh 2
# BEFORE=FILE takes another archive as the earlier tree (e.g. main's, for a branch checked out here).
source benchmarks/device/common.sh
rounds=${1:-2}
here=$PWD
mkdir -p /tmp/before && tar -xJf "${BEFORE:-.devsite/before.tar.xz}" -C /tmp/before
for r in $(seq "$rounds"); do
  for tree in before after; do
    dir=$here; [[ $tree == before ]] && dir=/tmp/before
    echo "== round $r, $tree ($dir)"
    (cd "$dir" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/install.log 2>&1 &&
      timeout 150 python3 -m benchmarks.serving --host 2>&1 | grep -E "^\||Host time") ||
      { echo "($tree: install or run failed)"; tail -5 /tmp/install.log; }
  done
done 2>&1 | tee "$OUT/host-ab.log"
cd "$here" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
