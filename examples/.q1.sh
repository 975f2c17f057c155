mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
for c in "torchao-int8-weight-only 1" "torchao-int8-weight-only 64" "none 1"; do set -- $c
  timeout 170 python3 examples/profile_decode.py --shape llama-3.1-8b --layers 4 --quantization $1 --batch $2 --new-tokens 32 --top 25 --log > $OUT/prof-$1-b$2.log 2>&1
  echo "== $1 b$2"; grep -E "piecewise compile|compile done|capture.*done|graph capture|accelerate_model:|^generate:" $OUT/prof-$1-b$2.log | cut -c1-200; sed -n '/by kind/,$p' $OUT/prof-$1-b$2.log
done
