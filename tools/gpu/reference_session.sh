# One device call for what the session of 2026-12-04 (seventh) could not run: carry [".kernelpack"], then
#   bash tools/gpu/reference_session.sh
# The Marlin reference's packed-code kernel as committed (every format against the dense path and float64, its
# weights bit for bit through one-hot rows, a row's bits across calls and passes, the kernel ran), its time against
# the Marlin kernel at gpt-oss shapes with a profile (target ≤ 10×), the matmul_ogs references after the offline
# memory work, then the Marlin references against vLLM's kernel. Each step logs to $OUT/all.log (tools/gpu/steps.sh).
# First run 2026-12-05 (tenth session; RUNBOOK): all passed, the Marlin reference test cut by its old 220 s limit
# with no failure; the bench at 15.5–20.7× the kernel. Since then: activations staged K-major (two rows an 8-byte
# load), 4-bit codes read as words with a byte's two values in one 8-byte load, two syncs a call instead of seven;
# the bench also times other launch shapes of the kernel (ROWS_VARIANTS, WARPSxCOLUMNS[sSPLITS][t]: the
# products' device µs of each). Fourteenth session: 4 warps x 128 columns, <= 16 K splits committed (the first
# variant below is it). SKIP_OGS=1 leaves out the matmul_ogs references.
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
step marlin_rows 120 python3 -m pytest tests/gpu/test_marlin_rows_gpu.py -q -rfE
step reference_bench 150 python3 tools/bench/reference_bench.py --cases nvfp4-gemm1,nvfp4-gemm2,mxfp4-gemm1,mxfp4-gemm2 \
    --no-cpu --profile --rows-variants "${ROWS_VARIANTS:-4x128,4x128s8,4x128t,2x128,8x256,1x256}"
[ -n "${SKIP_OGS:-}" ] || step ogs_reference 60 python3 -m pytest tests/gpu/test_matmul_ogs_reference.py -q -rfE
step marlin_reference ${MARLIN_LIMIT:-360} python3 -m pytest tests/gpu/test_marlin_reference.py -q -x -rfE
grep -E "^=== |passed|failed|^(nvfp4|mxfp4)-|^case|marlin_rows [0-9]|cudaStreamSynchronize|syncs a call" "$OUT/all.log" | cut -c1-300 | tail -30
