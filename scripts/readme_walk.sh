#!/usr/bin/env bash
# The README's "Use it" block, every command in its order, as a new user runs it; fails at the first that fails.
#
#   scripts/readme_walk.sh [SRC] [WORKDIR]
#
# SRC: what `octavo export` reads (default: smollm2-135m-instruct, the embedded model; the test suite passes a
# tiny random HF checkpoint). WORKDIR: where out/, run.jsonl, the pictures and the Triton repository go (default:
# a new temporary folder). $OCTAVO is the command (default: .venv/bin/octavo), $PYTHON the interpreter used for
# the few checks the README leaves to the reader's eyes (default: .venv/bin/python). Servers get free ports
# instead of 8000/8001, and every wait is for a state (a log line, /health), bounded by $WALK_TIMEOUT seconds.
# `octavo build` needs TensorRT: on a machine without it the walk accepts its clear "no TensorRT" error.
set -euo pipefail

SRC="${1:-smollm2-135m-instruct}"
WORK="${2:-$(mktemp -d -t octavo-readme-walk-XXXXXX)}"
read -r -a OCTAVO <<< "${OCTAVO:-.venv/bin/octavo}"
PYTHON="${PYTHON:-.venv/bin/python}"
TIMEOUT="${WALK_TIMEOUT:-600}"
mkdir -p "$WORK"
cd "$WORK"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

step() { printf '\n$ octavo %s\n' "$*"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() {  # wait_for FILE TEXT PID: until FILE holds TEXT; fails if PID exits first or after $TIMEOUT s
    local deadline=$((SECONDS + TIMEOUT))
    until grep -q "$2" "$1" 2>/dev/null; do
        if ! kill -0 "$3" 2>/dev/null; then echo "walk: the process exited before '$2':"; cat "$1"; return 1; fi
        if ((SECONDS > deadline)); then echo "walk: no '$2' within $TIMEOUT s:"; cat "$1"; return 1; fi
        sleep 0.2
    done
}
wait_healthy() {  # wait_healthy URL PID LOG
    local deadline=$((SECONDS + TIMEOUT))
    until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' "$1" 2>/dev/null; do
        if ! kill -0 "$2" 2>/dev/null; then echo "walk: the server exited:"; cat "$3"; return 1; fi
        if ((SECONDS > deadline)); then echo "walk: $1 not healthy within $TIMEOUT s"; cat "$3"; return 1; fi
        sleep 0.2
    done
}
stop() {  # stop PID: SIGTERM, as Ctrl-C would; it must exit 0 within $TIMEOUT s
    kill -TERM "$1"
    local deadline=$((SECONDS + TIMEOUT))
    while kill -0 "$1" 2>/dev/null; do
        if ((SECONDS > deadline)); then echo "walk: process $1 ignored SIGTERM for $TIMEOUT s"; kill -KILL "$1"; return 1; fi
        sleep 0.2
    done
    wait "$1" || { echo "walk: process $1 exited with $?"; return 1; }
}

step export "$SRC" out/
"${OCTAVO[@]}" export "$SRC" out/ --force --no-progress

step generate out/ '"The capital of France is"' --max-tokens 32
"${OCTAVO[@]}" generate out/ "The capital of France is" --max-tokens 32 | tee generate.txt
test -s generate.txt

step chat out/
printf 'Hello!\n/help\n/reset\n/exit\n' | "${OCTAVO[@]}" chat out/ --max-tokens 16 | tee chat.txt
grep -q "assistant> " chat.txt && grep -q "conversation cleared" chat.txt

step serve out/ --port 8000 --served-model-name smol --trace-path run.jsonl
PORT=$(free_port)
"${OCTAVO[@]}" serve out/ --port "$PORT" --served-model-name smol --trace-path run.jsonl > serve.log 2>&1 &
SERVE=$!
PIDS+=("$SERVE")
wait_healthy "http://127.0.0.1:$PORT" "$SERVE" serve.log
"$PYTHON" - "$PORT" <<'EOF'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
models = [m["id"] for m in json.load(urllib.request.urlopen(base + "/models"))["data"]]
assert models == ["smol"], models
req = urllib.request.Request(base + "/completions", method="POST", headers={"Content-Type": "application/json"},
                             data=json.dumps({"model": "smol", "prompt": "Hello", "max_tokens": 4}).encode())
print("completion:", json.load(urllib.request.urlopen(req))["choices"][0]["text"])
EOF

step serve --port 8001 --kv-cache-dtype float16
PORT16=$(free_port)
if [ "$SRC" = smollm2-135m-instruct ]; then MODEL16=(); else MODEL16=(out/); fi  # the tiny walk: its own model
"${OCTAVO[@]}" serve "${MODEL16[@]}" --port "$PORT16" --kv-cache-dtype float16 > serve16.log 2>&1 &
SERVE16=$!
PIDS+=("$SERVE16")
wait_healthy "http://127.0.0.1:$PORT16" "$SERVE16" serve16.log
stop "$SERVE16"

step bench serve --base-url "http://127.0.0.1:8000" --workload seed10
"${OCTAVO[@]}" bench serve --base-url "http://127.0.0.1:$PORT" --workload seed10 | tee bench.txt
stop "$SERVE"  # drains and closes run.jsonl
test -s run.jsonl

step demo --block-size 256 --png timeline.png
if [ "$SRC" = smollm2-135m-instruct ]; then DEMO_MODEL=(); else DEMO_MODEL=(--model out/); fi
"${OCTAVO[@]}" demo "${DEMO_MODEL[@]}" --block-size 256 --png timeline.png --no-log > demo.txt
grep -q "What this run did" demo.txt && test -s timeline.png

step trace run.jsonl --png run.png --html run.html --x-axis time
"${OCTAVO[@]}" trace run.jsonl --png run.png --html run.html --x-axis time --no-log > trace.txt
test -s run.png && grep -q "data:image/png;base64," run.html

step triton out/ --repo-out triton_repo
HTTP=$(free_port); GRPC=$(free_port); METRICS=$(free_port)
"${OCTAVO[@]}" triton out/ --repo-out triton_repo --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
    > triton.log 2>&1 &
TRITON=$!
PIDS+=("$TRITON")
wait_for triton.log "tritonserver ready" "$TRITON"
"$PYTHON" - "$HTTP" <<'EOF'
import json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v2/models/octavo/generate", method="POST",
                             data=json.dumps({"text_input": "Hello", "max_tokens": 4}).encode())
print("triton:", json.load(urllib.request.urlopen(req))["text_output"])
EOF
stop "$TRITON"

step build out/ --target tensorrt --dtype fp16
if "${OCTAVO[@]}" build out/ --target tensorrt --dtype fp16 > build.log 2>&1; then
    cat build.log
elif grep -qi "tensorrt" build.log && ! grep -q "Traceback" build.log; then
    echo "(no TensorRT on this machine, as expected:) $(tail -1 build.log)"
else
    cat build.log
    exit 1
fi

printf '\nREADME walk: every "Use it" command ran (in %s)\n' "$WORK"
