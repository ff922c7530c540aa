#!/usr/bin/env bash
# The release as a user would get it: `python -m build` makes the sdist and, from the sdist,
# the wheel (so a file missing from the sdist fails here too); the wheel is installed, not
# editable, into a fresh virtualenv, which then runs from a directory outside the clone:
# `switchyard-mw --version`, `check-config` on the example config, and the example gateway
# (a copy of examples/ only) answering its first chat request on the bundled mock provider.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
gateway=""
cleanup() {
  if [ -n "$gateway" ] && kill -0 "$gateway" 2>/dev/null; then kill -9 "$gateway"; fi
  rm -rf "$work"
}
trap cleanup EXIT
pip_q() { "$@" -q --disable-pip-version-check 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }

echo "== python -m build"
python3 -m venv "$work/build-venv"
pip_q "$work/build-venv/bin/python" -m pip install build
"$work/build-venv/bin/python" -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
version=$("$work/build-venv/bin/python" -c \
  'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$root/pyproject.toml")
wheel="$work/dist/switchyard_mw-$version-py3-none-any.whl"
sdist="$work/dist/switchyard_mw-$version.tar.gz"
ls "$wheel" "$sdist" >/dev/null
# What the package needs at run time is inside the wheel: its typing marker and the vendored
# Envoy protos (generated modules the ext_proc server imports).
"$work/build-venv/bin/python" - "$wheel" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for needed in (
    "switchyard_mw/py.typed",
    "switchyard_mw/testing/mock_provider.py",
    "switchyard_mw/_protos/envoy/service/ext_proc/v3/external_processor_pb2.py",
):
    assert needed in names, f"{needed} is not in the wheel"
assert not any(n.startswith(("tests/", "examples/", "bench/")) for n in names), "stray files"
EOF

echo "== pip install the wheel[example], not editable, in a fresh virtualenv"
python3 -m venv "$work/venv"
pip_q "$work/venv/bin/python" -m pip install "$wheel[example]"
cp -r "$root/examples" "$work/examples"
cd "$work"  # nothing of the clone is on the path from here on
"$work/venv/bin/python" - "$work/venv" <<'EOF'
import sys, switchyard_mw
assert switchyard_mw.__file__.startswith(sys.argv[1]), switchyard_mw.__file__
EOF
test "$("$work/venv/bin/switchyard-mw" --version)" = "switchyard-mw $version"
MOCK_KEY_A=a MOCK_KEY_B=b MOCK_JUDGE_KEY=j \
  "$work/venv/bin/switchyard-mw" check-config examples/switchyard.toml

echo "== the example gateway from the wheel: one chat request"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
mock_port=$(free_port)
PORT=$port SWITCHYARD_MOCK_PORT=$mock_port LOG_LEVEL=warning \
  "$work/venv/bin/python" examples/starlette_app.py >"$work/gateway.log" 2>&1 &
gateway=$!
for _ in $(seq 300); do
  if curl -s -o /dev/null "http://127.0.0.1:$port/switchyard/health"; then break; fi
  kill -0 "$gateway" 2>/dev/null || { cat "$work/gateway.log"; exit 1; }
  sleep 0.1
done
answer=$(curl -s -D - --max-time 30 "http://127.0.0.1:$port/v1/chat/completions" \
  -H 'content-type: application/json' -H 'authorization: Bearer anything' \
  -d '{"model": "gpt-5", "messages": [{"role": "user", "content": "Hello"}]}')
echo "$answer" | grep -qi '^x-switchyard-account: mock-a' || { echo "$answer"; cat "$work/gateway.log"; exit 1; }
echo "$answer" | grep -q 'Hello from the mock provider.' || { echo "$answer"; exit 1; }
kill -INT "$gateway"
wait "$gateway"  # a clean Ctrl-C exits 0 (set -e fails the script otherwise)
gateway=""
if grep -q Traceback "$work/gateway.log"; then cat "$work/gateway.log"; exit 1; fi
echo "wheel: switchyard-mw $version installed from $(basename "$wheel"); the example gateway answered"
