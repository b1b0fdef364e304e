#!/usr/bin/env bash
# System packages the multi-node tests use (tests/multinode): sshd and pdsh for the pdsh/ssh path,
# iproute2 (ip netns) and util-linux (unshare) for simulated hosts in network namespaces.
# Needs root (Debian/Ubuntu). Without them those tests skip and say which tool is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends openssh-server openssh-client pdsh iproute2 util-linux
