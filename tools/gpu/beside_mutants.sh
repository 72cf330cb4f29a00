# The beside-copy GPU test against two mutants of the tree (source after tools/gpu/device_setup.sh and steps.sh):
#   bash tools/gpu/beside_mutants.sh
# `nofork`: the side stream no longer waits for the work queued before the call; `nojoin`: the serving stream no
# longer waits for the side copy after the call. The test must pass on the tree and fail on each mutant.
source tools/gpu/steps.sh
T=tests/gpu/test_flight_layer_gpu.py
step beside 90 python3 -m pytest $T -q -rfE -k large_inputs -p no:cacheprovider
for m in nofork nojoin; do
    rm -rf /tmp/$m; mkdir -p /tmp/$m; cp -r moereplay tests pyproject.toml /tmp/$m/
done
sed -i 's/        side.wait_event(fork)/        pass/' /tmp/nofork/moereplay/capture/flight_layer.py
sed -i 's/            torch.cuda.current_stream(call.ring.index).wait_event(joined)/            pass/' \
    /tmp/nojoin/moereplay/capture/flight_layer.py
for m in nofork nojoin; do
    n=$(diff -r moereplay /tmp/$m/moereplay | grep -c '^>')
    echo "=== mutant $m: $n line(s) changed" | tee -a "$OUT/all.log"
    (cd /tmp/$m && step mutant_$m 90 env PYTHONPATH=/tmp/$m:$PYTHONPATH python3 -m pytest $T -q -rfE -k large_inputs \
        -p no:cacheprovider)
done
