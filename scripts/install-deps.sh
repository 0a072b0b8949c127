#!/usr/bin/env bash
# install-deps.sh -- install what the demo and the tests use on a fresh
# machine: CRIU >= 4 (scripts/install-criu.sh), the pinned MinIO server, and
# Debian tools (iproute2 for network namespaces, openssh for the ssh form).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "install-deps: run as root (CRIU needs it)" >&2
	exit 1
fi
need=()
for tool in ip:iproute2 sshd:openssh-server ssh:openssh-client lz4:lz4 zstd:zstd; do
	command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || need+=("${tool##*:}")
done
if [ ${#need[@]} -gt 0 ]; then
	echo "install-deps: apt-get install ${need[*]}" >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
bash scripts/install-criu.sh >/dev/null
if [ -f scripts/install-minio.sh ]; then
	bash scripts/install-minio.sh >/dev/null
fi
echo "install-deps: ok" >&2
