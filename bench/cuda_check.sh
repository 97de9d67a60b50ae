#!/usr/bin/env bash
# gracelm on a CUDA machine: the parity tests (model, paged attention, sampler) with the device set to cuda,
# then a short serve benchmark against `gracelm serve --device cuda`, and a summary. Run from the repository
# root; exits non-zero if a step failed.
#
#   bash bench/cuda_check.sh wheels    # HERE, with PyPI: the packages the GPU machine lacks, into .whl/
#   bash bench/cuda_check.sh           # THERE, on the GPU machine (the device tool: carry .whl)
#
# Python and torch: the GPU machine's own (its image's python3 with a CUDA torch: 2.11+cu130 when last
# seen, not the 2.13 CPU wheel of scripts/bootstrap.sh). That machine reaches no package registry, and a CUDA
# torch wheel (~1 GB) is far over what may travel to it (64 MiB), so nothing is installed but the few pure or
# small packages gracelm needs beyond its image (WHEELS), downloaded here for its Python 3.12 and installed
# there into /tmp/site, ahead of nothing: PYTHONPATH holds the checkout, then them.
#
# The model: the default model's GGUF (98 MB) cannot travel either. The serve benchmark runs a model of its
# exact shape (SmolLM2-135M: 30 layers, 576 wide, 9 heads over 3 KV heads, vocabulary 49,152, tied
# embeddings) with random weights, made there by tests/tiny_models.py, its small tokenizer given a
# placeholder token for every id above its own (so that every sampled id decodes to text and streams): the
# speed is the default model's, the text is noise (every request generates exactly --max-tokens tokens).
set -uo pipefail
cd "$(dirname "$0")/.."

# The packages gracelm and bench/serve.py import that the GPU machine's image lacks, at this checkout's
# versions (read from the local venv, or $PYTHON).
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api uvicorn
        msgspec pyzmq setproctitle llguidance gguf)

if [ "${1:-}" = wheels ]; then
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    rm -rf .whl && mkdir .whl
    for name in "${WHEELS[@]}"; do
        version=$("${PYTHON:-.venv/bin/python}" -c "import importlib.metadata as m; print(m.version('$name'))") || exit 1
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 \
            -d .whl "$name==$version" || exit 1
    done
    du -sh .whl
    exit 0
fi

OUT=${OUT:-$(mktemp -d)}
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "cuda_check: no wheels in .whl (run 'bash bench/cuda_check.sh wheels' where PyPI is reachable)"; exit 1; }
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 GRACELM_CACHE_DIR=/tmp/gracelm-cache
summary "$(python3 -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                          f"{torch.cuda.get_device_name(0)}")')"
status=0

# 1. The parity and sampler tests, on the GPU.
GRACELM_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_model_parity.py \
    tests/test_sampler.py 2>&1 | tee "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}
summary "parity and sampler tests on cuda: $(tail -1 "$OUT/tests.log") (exit $test_rc)"
[ "$test_rc" = 0 ] || status=1

# 2. A serve benchmark: gracelm serve --device cuda, the default model's shape, random weights.
model=/tmp/gracelm-smollm2-shape
python3 - "$model" <<'EOF' || exit 1
import sys
from transformers import AutoTokenizer
from tests.tiny_models import make_tiny_model
vocab = 49152
directory = make_tiny_model(sys.argv[1], "llama", vocab_size=vocab, hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                            rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
tokenizer = AutoTokenizer.from_pretrained(directory)
tokenizer.add_tokens([f"<x{i}>" for i in range(len(tokenizer), vocab)])
tokenizer.save_pretrained(directory)
EOF
port=18731
python3 -m gracelm.cli.main serve "$model" --device cuda --dtype bfloat16 --port "$port" \
    --stats-interval 0 > "$OUT/serve.log" 2>&1 &
server=$!
ready() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/ready', timeout=2)" 2>/dev/null; }
for _ in $(seq 300); do
    ready && break
    kill -0 "$server" 2>/dev/null || break
    sleep 1
done
if ready; then
    grep -m1 "engine core ready" "$OUT/serve.log" | sed 's/^/  /'
    python3 bench/serve.py run --base-url "http://127.0.0.1:$port" --endpoint completions --ignore-eos \
        --concurrency 1 8 32 --num-prompts 32 --max-tokens 64 --out "$OUT/serve.json" 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    summary "serve benchmark (gracelm serve --device cuda --dtype bfloat16, SmolLM2-135M shape):"
    summary "$(sed -n '/ conc /,$p' "$OUT/bench.log")"
else
    summary "gracelm serve --device cuda did not become ready; the end of its log:"
    tail -30 "$OUT/serve.log" | tee -a "$OUT/summary.txt"
    status=1
fi
kill "$server" 2>/dev/null && wait "$server"
summary "cuda_check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
