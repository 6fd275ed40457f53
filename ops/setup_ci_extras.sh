#!/usr/bin/env bash
# System packages the ops tests need (tests/ops/test_ray_up.py): an SSH server and rsync for `ray up` with
# Ray's local provider; Debian's redis-server (built with TLS) for tests/deployments/test_redis_security.py.
# Idempotent; Debian/Ubuntu; run as root (CI runs as root). The test itself starts
# sshd on 127.0.0.1:22 when none listens, with a throwaway key, and cleans up after itself.
set -euo pipefail
need=()
for pkg in openssh-server openssh-client rsync redis-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The package's postinst may not create host keys or the privilege-separation dir inside containers.
ssh-keygen -A >/dev/null
mkdir -p /run/sshd
echo "ops extras: openssh-server, rsync, redis-server ready"
