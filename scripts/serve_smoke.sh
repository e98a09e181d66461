#!/usr/bin/env bash
# The README's `make run` on a fresh clone: the server on the built-in model comes up, answers a completion and a
# chat completion, and exits 0 on SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${SMOKE_PORT:-8765}"
url="http://127.0.0.1:${port}"
log="$(mktemp)"

make run ARGS="--port ${port}" >"$log" 2>&1 &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' EXIT

for _ in $(seq 900); do  # first start: install, model load and warm-up compiles
  curl -sf "${url}/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "serve_smoke: the server exited before it was healthy" >&2; exit 1; }
  sleep 1
done
curl -sf "${url}/health" >/dev/null || { cat "$log"; echo "serve_smoke: the server never became healthy" >&2; exit 1; }

post() { curl -sf "${url}$1" -H 'Content-Type: application/json' -d "$2"; echo; }
post /v1/completions '{"model": "jaxserve-builtin", "prompt": "The capital of France is", "max_tokens": 8}'
post /v1/chat/completions '{"model": "jaxserve-builtin", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'

# SIGTERM goes to the server itself, make's child: make then exits with the server's status.
kill -TERM "$(pgrep -P "$server" -f 'jaxserve serve')"
status=0
wait "$server" || status=$?
trap - EXIT
[ "$status" -eq 0 ] || { cat "$log"; echo "serve_smoke: the server exited with ${status} after SIGTERM" >&2; exit 1; }
echo "serve_smoke: ok"
