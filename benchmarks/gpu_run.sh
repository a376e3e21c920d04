#!/usr/bin/env bash
# One call on the 2x H200 machine: install, then the steps named on the command line, each under
# its own time limit, logs and JSON under $OUT. The machine is bare every call (GPU.md): pydantic
# and rich come as wheels carried in .whl/, the native proxy is rebuilt from source.
#
#   bash benchmarks/gpu_run.sh tests            # pytest -m "gpu or multi_gpu" (megakernel)
#   bash benchmarks/gpu_run.sh bench SHAPES...  # bench_tp.py on the given per-rank shapes
#   bash benchmarks/gpu_run.sh net              # benchmarks/gpu_check_net.py (the network path)
#   bash benchmarks/gpu_run.sh programs         # tests/gpu_programs.py (traced Programs, every GPU)
#   bash benchmarks/gpu_run.sh attention        # bench_attention.py tile, then ring (2 GPUs)
#   bash benchmarks/gpu_run.sh moe              # bench_moe.py (baseline + mgraph, 2 GPUs)
#   bash benchmarks/gpu_run.sh calibrate        # calibrate.py: the hardware profile JSON
#   bash benchmarks/gpu_run.sh proxy [ARGS]     # bench_proxy.py, 1 and 4 copy streams (ARGS override)
#   bash benchmarks/gpu_run.sh layer [ARGS]     # bench_layer.py on every GPU of the machine
#   bash benchmarks/gpu_run.sh mega [ARGS]      # bench_attention.py tile mega (one GPU)
#   bash benchmarks/gpu_run.sh gemm [ARGS]      # bench_gemm_tasks.py: GEMM task tiles (one GPU)
#   bash benchmarks/gpu_run.sh bodies [ARGS]    # bench_bodies.py: memory-bound bodies alone
# On a 1-GPU machine "tests" runs the single-GPU tests (multi_gpu ones skip themselves) and
# "attention" the tile part only.
# The GPU tests need about 400 s for all 24 (TEST_LIMIT); pytest arguments after "tests" select;
# PYTEST_X= (empty) runs past the first failure.
set -u
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/mgraph_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
step=${1:-tests}
shift || true
case "$step" in
tests)
    timeout "${TEST_LIMIT:-300}" python3 -m pytest -q ${PYTEST_X--x} -m "gpu or multi_gpu" \
        tests/test_megakernel_gpu.py "$@" 2>&1 | tee "$OUT/tests.log" | tail -25
    ;;
bench)
    timeout "${BENCH_LIMIT:-400}" torchrun --nproc_per_node=2 benchmarks/bench_tp.py \
        --out "$OUT" --shapes "$@" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -60
    ;;
net)
    timeout "${NET_LIMIT:-300}" python3 benchmarks/gpu_check_net.py "$@" 2>&1 | tee "$OUT/net.log" | tail -40
    ;;
programs)
    timeout "${PROGRAMS_LIMIT:-420}" torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" \
        tests/gpu_programs.py 2>&1 \
        | tee "$OUT/programs.log" | grep -E '^\{|gpu_programs:' | cut -c1-200
    ;;
attention)
    timeout "${TILE_LIMIT:-150}" python3 benchmarks/bench_attention.py tile --out "$OUT" "$@" 2>&1 \
        | tee "$OUT/attn_tile.log" | grep -E '^tile|error' | cut -c1-300
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || exit 0
    timeout "${RING_LIMIT:-300}" torchrun --nproc_per_node=2 benchmarks/bench_attention.py ring \
        --out "$OUT" 2>&1 | tee "$OUT/attn_ring.log" | grep -v '^{' | tail -20
    ;;
moe)
    timeout "${MOE_LIMIT:-200}" torchrun --nproc_per_node=2 benchmarks/bench_moe.py --out "$OUT" "$@" \
        2>&1 | tee "$OUT/moe.log" | grep -v '^{' | tail -12
    ;;
calibrate)
    timeout "${CALIBRATE_LIMIT:-200}" torchrun --nproc_per_node=2 benchmarks/calibrate.py \
        --out "$OUT/h200.json" 2>&1 | tee "$OUT/calibrate.log" | tail -14
    ;;
proxy)
    timeout "${PROXY_LIMIT:-120}" python3 benchmarks/bench_proxy.py --out "$OUT/bench_proxy" \
        --streams 1 4 "$@" 2>&1 | tee "$OUT/proxy.log" | tail -30
    ;;
layer)
    # SM clock and power every 100 ms beside the run: back-to-back launches of a kernel that
    # keeps every tensor core busy may run at a lower clock than launches from an idle GPU
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
        -lms 100 >"$OUT/clocks.csv" 2>/dev/null &
    smi=$!
    timeout "${LAYER_LIMIT:-400}" torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" \
        benchmarks/bench_layer.py --out "$OUT" "$@" 2>&1 | tee "$OUT/layer.log" | grep -v '^{' | tail -30
    kill "$smi" 2>/dev/null
    ;;
gemm)
    timeout "${GEMM_LIMIT:-300}" python3 benchmarks/bench_gemm_tasks.py --out "$OUT" "$@" 2>&1 \
        | tee "$OUT/gemm_tasks.log" | grep -v '^{' | cut -c1-400 | tail -40
    ;;
bodies)
    timeout "${BODIES_LIMIT:-200}" python3 benchmarks/bench_bodies.py --out "$OUT" "$@" 2>&1 \
        | tee "$OUT/bodies.log" | grep -v '^{' | cut -c1-300 | tail -30
    ;;
mega)
    timeout "${MEGA_LIMIT:-200}" python3 benchmarks/bench_attention.py tile mega --out "$OUT" "$@" \
        2>&1 | tee "$OUT/attn_mega.log" | grep -v '^{' | tail -30
    ;;
*)
    echo "unknown step $step: tests, bench, net, programs, attention, moe, calibrate, proxy, layer, mega, gemm, bodies" >&2
    exit 2
    ;;
esac
