# A fresh process on the device constructs each op with a schedule space and says what serves it
# (issue 38: "shipped for NVIDIA H200" on an H200, built-in elsewhere):
#   bash .devsite/gpu.sh bash benchmarks/device/show.sh
source benchmarks/device/common.sh
for op in AttnFwdOp AttnPrologueFwdOp RMSNormFwdOp RoPEFwdOp; do
  echo "== $op"; timeout 60 python3 -m tileops show "$op" --device cuda 2>&1 | grep -E "shipped|built-in|tuned" | head -12
done 2>&1 | tee "$OUT/show.log"
