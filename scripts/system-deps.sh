#!/usr/bin/env bash
# System packages the tests need: ffmpeg (audio decoding) and espeak-ng (real speech for Whisper tests).
set -euo pipefail
missing=()
command -v ffmpeg >/dev/null 2>&1 || missing+=(ffmpeg)
command -v espeak-ng >/dev/null 2>&1 || missing+=(espeak-ng)
# OpenBLAS: the mlx[cpu] wheel bundles a slow reference BLAS; the MLX engine preloads a system OpenBLAS
ls /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || [ "$(uname -m)" != x86_64 ] || missing+=(libopenblas0-pthread)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
