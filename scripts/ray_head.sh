#!/usr/bin/env bash
# Start the Ray head on one Atlas node: the Ascend environment first (Ray's workers inherit it), then
# `ray start --head` with this node's NPUs as the "NPU" resource, then a check that the node is in the
# cluster with the expected number of NPUs.
set -euo pipefail
SCRIPT_NAME=ray_head.sh
# shellcheck source-path=SCRIPTDIR source=lib/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch_common.sh"

PORT=6379
DASHBOARD_PORT=8265
JOIN_TIMEOUT=120
RESTART=0

usage() {
    cat <<'EOF_HELP'
Usage: scripts/ray_head.sh --platform a2|a3 [--nic NAME] [--ip ADDR] [options]

On the head node: applies the Ascend environment, runs `ray start --head`, then waits until this node is
alive in the cluster with all its NPUs. Run scripts/ray_worker.sh on every other node, then
scripts/serve_multinode.sh here.

  --port N                Ray GCS port (default 6379); workers join with --head ADDR:N
  --dashboard-port N      Ray dashboard port (default 8265)
  --restart               `ray stop --force` first (needed after changing any environment variable)
  --join-timeout S        seconds to wait for the node to show up with its NPUs (default 120)
EOF_HELP
    common_env_help
}

while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --port) need_value "$@"; need_int "$1" "$2"; PORT=$2; shift 2 ;;
        --dashboard-port) need_value "$@"; need_int "$1" "$2"; DASHBOARD_PORT=$2; shift 2 ;;
        --join-timeout) need_value "$@"; need_int "$1" "$2"; JOIN_TIMEOUT=$2; shift 2 ;;
        --restart) RESTART=1; shift ;;
        *)
            parse_common_env_opt "$@"
            ((CONSUMED)) || die "unknown option '$1' (see --help)"
            shift "$CONSUMED" ;;
    esac
done
[[ -n $PLATFORM ]] || die "--platform a2|a3 is required (see --help)"

apply_ascend_env
NPUS=$(npus_per_node)
((RESTART)) && run "$RAY" stop --force
run "$RAY" start --head --port="$PORT" --node-ip-address="$HOST_IP" --dashboard-port="$DASHBOARD_PORT" \
    --resources "{\"NPU\": $NPUS}"
ray_wait --address "$HOST_IP:$PORT" --node-ip "$HOST_IP" --npus-per-node "$NPUS" --timeout "$JOIN_TIMEOUT"
done_msg "head is up: join workers with scripts/ray_worker.sh --platform $PLATFORM --head $HOST_IP:$PORT"
