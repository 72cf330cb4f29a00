# One device call for the Marlin half of the served-model proof (issue 13): carry [".kernelpack", ".servepack"], then
#   bash tools/gpu/marlin_session.sh
# A 2-layer Qwen3-MoE GPTQ int4 checkpoint (AutoGPTQMoEMethod → fused_marlin_moe) and a 2-layer gpt-oss served with
# `--moe-backend marlin`, both eager with full capture (two calls per shape): info, ls, and the replay fidelity of
# every captured moe_wna16_marlin_gemm call. Logged to $OUT/all.log; summaries and small captures come back.
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
W=/tmp/serve; mkdir -p $W
step model_qwen 90 python3 tools/models/make_moe_gptq.py $W/qwen-gptq --layers ${LAYERS:-2}
step model_oss 60 python3 tools/models/make_gpt_oss.py $W/gpt-oss-2l --layers 2
step qwen_eager 200 python3 tools/gpu/serve_gpu.py --model $W/qwen-gptq --mode eager --out $W/qwen --env MOEREPLAY_PER_SHAPE=2
step oss_marlin 170 python3 tools/gpu/serve_gpu.py --model $W/gpt-oss-2l --mode eager --out $W/ossm --env MOEREPLAY_PER_SHAPE=2 \
    --serve-arg=--moe-backend=marlin
for d in qwen ossm; do
    F=$(ls -S $W/$d/captures/*.zst 2>/dev/null | head -1)
    [ -z "$F" ] && continue
    step info_$d 30 python3 -m moereplay info "$F"
    step ls_$d 30 bash -c "python3 -m moereplay ls '$F' | head -24"
    step run_$d 120 python3 -m moereplay run "$F" --op moe_wna16_marlin_gemm --backend pack:$MOEREPLAY_PACK --json-out $W/run-$d.json
    fidelity $W/run-$d.json
    [ $(stat -c %s "$F") -lt 16000000 ] && cp "$F" "$OUT/$d-capture.zst"
    cp $W/$d/summary.json "$OUT/$d-summary.json" 2>/dev/null; tail -c 100000 $W/$d/server.log > "$OUT/$d-server.log"
done
grep -E "^=== |fidelity|serve_gpu|layers:|plugin:|MoE|Marlin|marlin" "$OUT/all.log" | cut -c1-300 | tail -50
