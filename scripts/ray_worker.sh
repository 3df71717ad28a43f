#!/usr/bin/env bash
# Join one Atlas node to a Ray cluster: the Ascend environment first (Ray's workers inherit it), then
# `ray start --address`, then a check that the node joined with the expected number of NPUs.
set -euo pipefail
SCRIPT_NAME=ray_worker.sh
# shellcheck source-path=SCRIPTDIR source=lib/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch_common.sh"

HEAD=""
JOIN_TIMEOUT=120
RESTART=0

usage() {
    cat <<'EOF_HELP'
Usage: scripts/ray_worker.sh --platform a2|a3 --head HEAD_IP[:PORT] [--nic NAME] [--ip ADDR] [options]

On every node but the head: applies the Ascend environment, runs `ray start --address HEAD`, then waits
until this node is alive in the cluster with all its NPUs.

  --head ADDR[:PORT]      the head node's address (port default 6379)
  --restart               `ray stop --force` first (needed after changing any environment variable)
  --join-timeout S        seconds to wait for the node to show up with its NPUs (default 120)
EOF_HELP
    common_env_help
}

while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --head) need_value "$@"; HEAD=$2; shift 2 ;;
        --join-timeout) need_value "$@"; need_int "$1" "$2"; JOIN_TIMEOUT=$2; shift 2 ;;
        --restart) RESTART=1; shift ;;
        *)
            parse_common_env_opt "$@"
            ((CONSUMED)) || die "unknown option '$1' (see --help)"
            shift "$CONSUMED" ;;
    esac
done
[[ -n $PLATFORM ]] || die "--platform a2|a3 is required (see --help)"
[[ -n $HEAD ]] || die "--head HEAD_IP[:PORT] is required: the address scripts/ray_head.sh printed"
[[ $HEAD == *:* ]] || HEAD="$HEAD:6379"

apply_ascend_env
NPUS=$(npus_per_node)
((RESTART)) && run "$RAY" stop --force
run "$RAY" start --address="$HEAD" --node-ip-address="$HOST_IP" --resources "{\"NPU\": $NPUS}"
ray_wait --address "$HEAD" --node-ip "$HOST_IP" --npus-per-node "$NPUS" --timeout "$JOIN_TIMEOUT"
done_msg "node $HOST_IP joined $HEAD with $NPUS NPUs"
