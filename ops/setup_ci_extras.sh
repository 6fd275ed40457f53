#!/usr/bin/env bash
# System packages the ops tests need, on `make test`'s path only: an SSH server and rsync for `ray up` with Ray's
# local provider (tests/ops/test_ray_up.py); Debian's redis-server (built with TLS) for
# tests/deployments/test_redis_security.py. Idempotent; Debian/Ubuntu. As root (CI) it installs what is
# missing; otherwise, or without apt-get, it installs nothing, says so and exits 0: those tests then skip and
# name what they lack. The ray up test starts sshd on 127.0.0.1:22 when none listens (root only), with a
# throwaway key, and cleans up after itself.
set -euo pipefail
need=()
for pkg in openssh-server openssh-client rsync redis-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    if ((${#need[@]})); then
        echo "ops extras: not installing ${need[*]} (needs root and apt-get): the ray up tests will skip"
    else
        echo "ops extras: openssh-server, rsync present (not root: the ray up tests need a running sshd)"
    fi
    exit 0
fi
if ((${#need[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The package's postinst may not create host keys or the privilege-separation dir inside containers.
ssh-keygen -A >/dev/null
mkdir -p /run/sshd
echo "ops extras: openssh-server, rsync, redis-server ready"
