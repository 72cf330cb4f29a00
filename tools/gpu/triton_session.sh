# One device call for the Triton half of the served-model proof (issues 13/18): carry [".kernelpack", ".servepack"],
#   bash tools/gpu/triton_session.sh
# A 2-layer Qwen3-MoE with bf16 experts (UnquantizedFusedMoEMethod → TRITON backend → TritonExperts →
# invoke_fused_moe_triton_kernel → fused_moe_kernel), then the 2-layer GPTQ int4 one served with
# `--quantization moe_wna16` (MoeWNA16Method → fused_experts → invoke_fused_moe_wna16_triton_kernel →
# fused_moe_kernel_gptq_awq for batches of more than 6 · 64 / 8 = 48 tokens, the CUDA moe_wna16_gemm below), each
# served eagerly with full capture (two calls per shape): the backend log lines, info, ls, what the kernel calls
# were, and the replay fidelity of every captured call. The bf16 half runs first and is complete before the int4
# one starts, so a call cut at its limit still brings it back. Step limits shrink to what is left of ~585 s.
# Logged to $OUT/all.log; summaries, replay reports and server log tails come back (captures only under 15 MB).
# Env: HALVES (default "bf16 wna16"), MODEL_ARGS (more generator options, e.g. "--hidden 512 --intermediate 256
# --experts 16" for a capture small enough to come back), BUDGET (seconds the script may take, default 585).
source tools/gpu/device_setup.sh >> "$OUT/all.log" 2>&1 || { tail -20 "$OUT/all.log"; exit 1; }
source tools/gpu/steps.sh
W=/tmp/serve; mkdir -p $W
limit() {  # $1 seconds, or what is left of the call (at least 1: `timeout 0` would mean no limit)
    local left=$((${BUDGET:-585} - SECONDS))
    [ $left -lt 1 ] && left=1
    [ $left -lt $1 ] && echo $left || echo $1
}
cat > $W/kernels.py <<'PY'
# What a capture's Triton launches were (and, for fused_experts parents, which route their batch took).
import sys
from collections import Counter
from moereplay.format import CaptureReader
launches, routes = Counter(), Counter()
with CaptureReader(sys.argv[1]) as reader:
    calls = list(reader.calls())
children = Counter(call.parent for call in calls if call.parent is not None)
keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
for call in calls:
    args = call.args
    if call.op.startswith("fused_moe_kernel"):
        config = args.get("config") or {}
        gemm = "gemm1" if args.get("top_k", 1) > 1 or args.get("mul_routed_weight") is False else "gemm2"
        blocks = "naive" if args.get("sorted_token_ids") is None else "aligned"
        launches[(call.op, gemm, blocks, tuple(config.get(key) for key in keys))] += 1
    elif call.op == "fused_experts":  # should_moe_wna16_use_cuda: M * top_k / experts <= 6 -> moe_wna16_gemm
        shapes = [getattr(args.get(name), "shape", None) for name in ("hidden_states", "topk_ids", "w1")]
        if None in shapes:
            routes[("unknown", "shapes not recorded")] += 1
            continue
        (m, _), (_, top_k), experts = shapes[0], shapes[1], shapes[2][0]
        route = "cuda moe_wna16_gemm" if m * top_k / experts <= 6 else "triton gptq_awq"
        routes[(route, "with kernel records" if children[call.index] else "no kernel record")] += 1
print(f"kernel calls: {sum(launches.values())}; (op, gemm, blocks, config BM/BN/BK/GM/warps/stages): count")
for key, count in sorted(launches.items(), key=str):
    print(f"  {key}: {count}")
if routes:
    print(f"fused_experts parents by predicted route: {dict(routes)}")
print(f"layers: {sorted({str(call.context.get('layer_name')) for call in calls})}; "
      f"parents: {sum(1 for call in calls if call.parent is not None)} of {len(calls)} calls have one")
PY
half() {  # $1: name, $2: the op to replay
    local F
    F=$(find $W/$1/captures -name '*.zst' -printf '%s %p\n' 2>/dev/null | sort -rn | head -1 | cut -d' ' -f2)
    cp $W/$1/summary.json "$OUT/$1-summary.json" 2>/dev/null
    tail -c 150000 $W/$1/server.log > "$OUT/$1-server.log" 2>/dev/null
    echo "=== $1 backend lines" >> "$OUT/all.log"
    grep -ohE "Using [^ ]+ Unquantized MoE backend[^\"]*|Using '[A-Z_]+' WNA16 MoE backend|Using MoEPrepareAndFinalize[A-Za-z]*|Using default MoE config[^\"]*|Using configuration from [^ ]+ for MoE layer|Falling back to Moe WNA16 kernels|quantization=[A-Za-z0-9_-]+" \
        $W/$1/server.log 2>/dev/null | cut -c1-260 | sort | uniq -c >> "$OUT/all.log"
    [ -z "$F" ] && { echo "=== $1: no capture file" | tee -a "$OUT/all.log"; return; }
    echo "=== $1 capture: $F ($(stat -c %s "$F") bytes)" | tee -a "$OUT/all.log"
    step info_$1 $(limit 30) python3 -m moereplay info "$F"
    step ls_$1 $(limit 30) bash -c "python3 -m moereplay ls '$F' | head -40"
    step kernels_$1 $(limit 60) python3 $W/kernels.py "$F"
    step run_$1 $(limit 150) python3 -m moereplay run "$F" --op $2 --backend pack:$MOEREPLAY_PACK \
        --json-out $W/run-$1.json
    [ -f $W/run-$1.json ] && { fidelity $W/run-$1.json "$2 calls"; cp $W/run-$1.json "$OUT/run-$1.json"; }
    [ $(stat -c %s "$F") -lt 16000000 ] && cp "$F" "$OUT/$1-capture.zst"
}
if [[ " ${HALVES:-bf16 wna16} " == *" bf16 "* ]]; then
step model_bf16 $(limit 90) python3 tools/models/make_moe_gptq.py $W/qwen-bf16 --layers ${LAYERS:-2} --unquantized $MODEL_ARGS
step bf16_eager $(limit 220) python3 tools/gpu/serve_gpu.py --model $W/qwen-bf16 --mode eager --out $W/bf16 \
    --env MOEREPLAY_PER_SHAPE=2 --env MOEREPLAY_QUEUE_BYTES=6G
half bf16 fused_moe_kernel
fi
if [[ " ${HALVES:-bf16 wna16} " == *" wna16 "* ]]; then
step model_gptq $(limit 60) python3 tools/models/make_moe_gptq.py $W/qwen-gptq --layers ${LAYERS:-2} $MODEL_ARGS
step wna16_eager $(limit 220) python3 tools/gpu/serve_gpu.py --model $W/qwen-gptq --mode eager --out $W/wna16 \
    --env MOEREPLAY_PER_SHAPE=2 --env MOEREPLAY_QUEUE_BYTES=6G --serve-arg=--quantization=moe_wna16
half wna16 fused_moe_kernel_gptq_awq
fi
grep -E "^=== |^ +[0-9]+ (Using|quantization|Falling)|fidelity|serve_gpu|layers:|kernel calls|  \('fused|parents|plugin:" \
    "$OUT/all.log" | cut -c1-300 | tail -70
