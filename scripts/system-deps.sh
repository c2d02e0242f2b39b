#!/usr/bin/env bash
# System packages the tests need: ffmpeg (audio decoding), espeak-ng (real speech for Whisper tests), chromium; and the
# Codex CLI and Claude Code (npm, no root) for the Codex and Claude Code tests.
set -euo pipefail
missing=()
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # the dashboard's browser test (Playwright drives it)
# OpenBLAS: the mlx[cpu] wheel bundles a slow reference BLAS; the MLX engine preloads a system OpenBLAS
ls /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || [ "$(uname -m)" != x86_64 ] || missing+=(libopenblas0-pthread)

# Codex CLI (OpenAI's coding agent) for tests/test_codex_functional.py, pinned, from npm into the git-ignored
# .cache/npm (no root needed). Skipped when this version is there (an older copy is replaced) or, without one there, a
# codex is in PATH; without npm, or when npm fails, the test skips.
CODEX_VERSION=0.171.0
codex_prefix="$(cd "$(dirname "$0")/.." && pwd)/.cache/npm"
codex_package="$codex_prefix/lib/node_modules/@openai/codex/package.json"
if { [ -f "$codex_package" ] && grep -q "\"version\": \"$CODEX_VERSION\"" "$codex_package"; } || \
   { [ ! -f "$codex_package" ] && command -v codex >/dev/null 2>&1; }; then
  :
elif ! command -v npm >/dev/null 2>&1; then
  echo "system-deps: npm not found, Codex CLI not installed (tests/test_codex_functional.py will skip)" >&2
elif ! npm install --global --prefix "$codex_prefix" --no-audit --no-fund --loglevel=error \
      "@openai/codex@$CODEX_VERSION"; then
  echo "system-deps: npm could not install @openai/codex@$CODEX_VERSION (tests/test_codex_functional.py will skip)" >&2
fi
# Claude Code (Anthropic's coding agent) for tests/test_claude_code_functional.py, pinned, the same way; an older
# copy in .cache/npm is replaced (the test checks what this version sends: deferred tools, adaptive thinking)
CLAUDE_CODE_VERSION=2.1.332
claude_package="$codex_prefix/lib/node_modules/@anthropic-ai/claude-code/package.json"
if { [ -f "$claude_package" ] && grep -q "\"version\": \"$CLAUDE_CODE_VERSION\"" "$claude_package"; } || \
   { [ ! -f "$claude_package" ] && command -v claude >/dev/null 2>&1; }; then
  :
elif ! command -v npm >/dev/null 2>&1; then
  echo "system-deps: npm not found, Claude Code not installed (tests/test_claude_code_functional.py will skip)" >&2
elif ! npm install --global --prefix "$codex_prefix" --no-audit --no-fund --loglevel=error \
      "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"; then
  echo "system-deps: npm could not install @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
       "(tests/test_claude_code_functional.py will skip)" >&2
fi
# The openai npm package (the official Node SDK) for tests/test_client_matrix_functional.py, pinned, as a local
# package in the git-ignored .cache/npm-clients (no root needed); without npm, or when npm fails, the test skips
OPENAI_NODE_VERSION=7.57.0
clients_prefix="$(cd "$(dirname "$0")/.." && pwd)/.cache/npm-clients"
if [ -f "$clients_prefix/node_modules/openai/package.json" ] && \
   grep -q "\"version\": \"$OPENAI_NODE_VERSION\"" "$clients_prefix/node_modules/openai/package.json"; then
  :
elif ! command -v npm >/dev/null 2>&1; then
  echo "system-deps: npm not found, the openai npm package not installed (its client test will skip)" >&2
elif ! npm install --prefix "$clients_prefix" --no-audit --no-fund --loglevel=error "openai@$OPENAI_NODE_VERSION"; then
  echo "system-deps: npm could not install openai@$OPENAI_NODE_VERSION (its client test will skip)" >&2
fi
# The ollama JavaScript client (a library) for tests/test_ollama_functional.py, pinned, into the git-ignored
# .cache/npm-ollama; without npm, or when npm fails, that test skips
OLLAMA_JS_VERSION=0.6.4
ollama_js_prefix="$(cd "$(dirname "$0")/.." && pwd)/.cache/npm-ollama"
if [ -f "$ollama_js_prefix/node_modules/ollama/package.json" ]; then
  :
elif ! command -v npm >/dev/null 2>&1; then
  echo "system-deps: npm not found, the ollama JS client not installed (its test will skip)" >&2
elif ! npm install --prefix "$ollama_js_prefix" --no-audit --no-fund --loglevel=error "ollama@$OLLAMA_JS_VERSION"; then
  echo "system-deps: npm could not install ollama@$OLLAMA_JS_VERSION (its test will skip)" >&2
fi

[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
