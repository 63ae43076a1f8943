# Sourced by the device call scripts beside it, on the GPU machine, from the project root (after
# `bash .devsite/gpu.sh`, which puts TileLang on the path and installs the project): the kernel index
# compiled here by `python -m benchmarks.device_cache` and carried as .devsite/kcache.tar.xz, unpacked
# once a machine, so that the suite compiles (almost) nothing there.
set -o pipefail
export TILEOPS_CACHE_DIR=/tmp/kc PYTHONUNBUFFERED=1
if [[ ! -d /tmp/kc/kernels && -f .devsite/kcache.tar.xz ]]; then
  mkdir -p /tmp/kc && tar -xJf .devsite/kcache.tar.xz -C /tmp/kc
  touch /tmp/kc/unpacked  # what is newer was compiled here (suite.sh packs it for the next index)
fi
echo "kernel index: $(ls /tmp/kc/kernels 2>/dev/null | wc -l) entries; $(nproc) cores"
