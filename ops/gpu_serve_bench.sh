#!/usr/bin/env bash
# The Serve pipeline on a GPU machine with no Ray, Redis or package index: unpack what `python -m ops.gpu_bundle`
# built (the Python site folder and Debian's redis-server), check every import, then run ops.gpu_serve_bench
# (or the module BENCH_MODULE names, e.g. ops.gpu_demo_serve).
#
#   ops/gpu_serve_bench.sh [--carry DIR] [the module's arguments]     (DIR default: .carry)
set -euo pipefail
CARRY=.carry
if [[ "${1:-}" == "--carry" ]]; then CARRY=$2; shift 2; fi
PY=${PYTHON:-python3}
TAG=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SITE=/tmp/specserve-site
# NVLink multicast stays off on shared hosts (the device notes say why); Ray workers inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
if [[ ! -d $SITE/ray ]]; then
  mkdir -p $SITE && tar xJf "$CARRY/gpu-site-$TAG.tar.xz" -C $SITE
fi
chmod +x $SITE/ray/core/src/ray/gcs/gcs_server $SITE/ray/core/src/ray/raylet/raylet
# Unpacked once a machine: a later call on the same warm machine needs no carried bundle.
if [[ ! -x /tmp/specserve-redis/usr/bin/redis-check-rdb ]]; then
  mkdir -p /tmp/specserve-redis
  for f in "$CARRY"/debs/*.deb; do dpkg -x "$f" /tmp/specserve-redis; done
fi
# Debian's redis-check-rdb is the redis-server binary; started under that name, it serves.
ln -sf redis-check-rdb /tmp/specserve-redis/usr/bin/redis-server
export LD_LIBRARY_PATH=/tmp/specserve-redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SPECSERVE_REDIS_SERVER=/tmp/specserve-redis/usr/bin/redis-server
# $CARRY/overlay (optional): packages that replace the site folder's (a quick fix without repacking it)
export PYTHONPATH=$(readlink -f "$CARRY")/overlay:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "unpacked in $(( $(date +%s) - t0 )) s"
$SPECSERVE_REDIS_SERVER --version || echo "redis-server does not start here"
$PY -c 'import ray, ray.serve, fastapi, uvicorn, redis, openai, opentelemetry.sdk, pydantic
import deployments.app, deployments.drafter_replica, pipeline.synthetic
print("imports ok: ray", ray.__version__, "pydantic", pydantic.__version__)'
exec $PY -m "${BENCH_MODULE:-ops.gpu_serve_bench}" "$@"
