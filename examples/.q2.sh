mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_small_m_gemm.py -k int8 > $OUT/kernel.log 2>&1; tail -n 3 $OUT/kernel.log
export HF_ACCEL_TEST_REPORT=$OUT/fp32.jsonl
timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu_quantized.py -k "int8-weight-only and agree" > $OUT/qtest.log 2>&1; grep -E "PASSED|FAILED|passed|failed" $OUT/qtest.log | cut -c1-200; cut -c1-300 $OUT/fp32.jsonl
QUANT_TIMEOUT=270 QUANT_ANCHORS=eager bash examples/gpu_validation.sh quant torchao-int8-weight-only
