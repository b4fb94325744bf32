set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv
timeout 200 python3 -m pytest -m gpu -q -x tests/primitives/test_swiglu_fused.py tests/primitives/test_moe_fused_recompute.py tests/primitives/test_mla.py tests/primitives/test_moe_permute_fused.py 2>&1 | tail -15 > $OUT/gpu-tests.log; cat $OUT/gpu-tests.log
cd benchmarks && timeout 150 torchrun --nproc_per_node 2 probe_fused_recompute.py > $OUT/probe_fused_recompute.jsonl 2>$OUT/probe.err; cat $OUT/probe_fused_recompute.jsonl; tail -5 $OUT/probe.err; cd ..
mkdir -p $OUT/results && timeout 330 torchrun --nproc_per_node 2 benchmarks/bench_moe_dispatch.py --rounds 3 --out $OUT/results > $OUT/bench.log 2>&1; tail -30 $OUT/bench.log
rm -f $OUT/results/*trace*.json; ls -la $OUT/results
