#!/usr/bin/env bash
# Serve one model over a Ray cluster of Atlas nodes from the head node: the Ascend environment, a wait until
# the cluster has N nodes with their NPUs, then `ascend-dsv4 serve --distributed-executor-backend ray`.
set -euo pipefail
SCRIPT_NAME=serve_multinode.sh
# shellcheck source-path=SCRIPTDIR source=lib/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch_common.sh"

NODES=""
MODEL=""
TP=""
DP=""
EP=0
RAY_ADDR=""
WAIT_TIMEOUT=600
SERVE_HOST=127.0.0.1
SERVE_PORT=8000
EXTRA=()

usage() {
    cat <<'EOF_HELP'
Usage: scripts/serve_multinode.sh --platform a2|a3 --nodes N --model DIR [options] [-- extra serve options]

On the head node, after scripts/ray_head.sh here and scripts/ray_worker.sh on the other N-1 nodes: waits
until the Ray cluster has N live nodes with all their NPUs, then runs
  ascend-dsv4 serve --model DIR --device npu --distributed-executor-backend ray
      --tensor-parallel-size T --data-parallel-size D [--enable-expert-parallel] --host H --port P ...
One OpenAI endpoint serves the whole cluster. T x D must not exceed N x NPUs per node.

  --nodes N                      nodes the cluster must have before serving
  --model DIR                    model folder; every node must read it at the same path
  --tensor-parallel-size T       default: 8 (TP inside a node, over HCCS; DeepSeek-V4's 8 output groups
                                 allow at most TP 8)
  --data-parallel-size D         default: N x NPUs per node / T (attention replicas); passed on when > 1
  --enable-expert-parallel       MoE experts spread over all T x D ranks (DeepSeek layouts)
  --ray-address ADDR:PORT        the cluster (default: this node's IP:6379)
  --wait-timeout S               seconds to wait for the nodes (default 600)
  --host ADDR / --port N         where the OpenAI server listens (default 127.0.0.1:8000)
EOF_HELP
    common_env_help
}

while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --nodes) need_value "$@"; need_int "$1" "$2"; NODES=$2; shift 2 ;;
        --model) need_value "$@"; MODEL=$2; shift 2 ;;
        --tensor-parallel-size | --tp) need_value "$@"; need_int "$1" "$2"; TP=$2; shift 2 ;;
        --data-parallel-size | --dp) need_value "$@"; need_int "$1" "$2"; DP=$2; shift 2 ;;
        --enable-expert-parallel) EP=1; shift ;;
        --ray-address) need_value "$@"; RAY_ADDR=$2; shift 2 ;;
        --wait-timeout) need_value "$@"; need_int "$1" "$2"; WAIT_TIMEOUT=$2; shift 2 ;;
        --host) need_value "$@"; SERVE_HOST=$2; shift 2 ;;
        --port) need_value "$@"; need_int "$1" "$2"; SERVE_PORT=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *)
            parse_common_env_opt "$@"
            ((CONSUMED)) || die "unknown option '$1' (extra serve options go after --; see --help)"
            shift "$CONSUMED" ;;
    esac
done
[[ -n $PLATFORM ]] || die "--platform a2|a3 is required (see --help)"
[[ -n $NODES && $NODES -ge 1 ]] || die "--nodes N (>= 1) is required (see --help)"
[[ -n $MODEL ]] || die "--model DIR is required (see --help)"
((DRY_RUN)) || [[ -d $MODEL ]] || die "--model $MODEL is not a folder on this node (every node needs it at this path)"
check_platform
NPUS=$(npus_per_node)
TOTAL=$((NODES * NPUS))
[[ -n $TP ]] || TP=$((NPUS < 8 ? NPUS : 8))
((TP >= 1)) || die "--tensor-parallel-size must be >= 1"
[[ -n $DP ]] || DP=$((TOTAL / TP))
((DP >= 1)) || die "--tensor-parallel-size $TP is larger than the cluster's $TOTAL NPUs"
((TP * DP <= TOTAL)) || die "TP $TP x DP $DP = $((TP * DP)) ranks, but $NODES node(s) x $NPUS NPUs = $TOTAL"
((TP * DP == TOTAL)) || log "warning: TP $TP x DP $DP = $((TP * DP)) ranks leave $((TOTAL - TP * DP)) of $TOTAL NPUs idle"

apply_ascend_env
[[ -n $RAY_ADDR ]] || RAY_ADDR="$HOST_IP:6379"
set_var_detected RAY_ADDRESS "$RAY_ADDR" "the Ray cluster started by ray_head.sh; the Ray executor connects to it"
ray_wait --address "$RAY_ADDR" --nodes "$NODES" --npus-per-node "$NPUS" --timeout "$WAIT_TIMEOUT"
CMD=("$ASCEND_DSV4" serve --model "$MODEL" --device npu --distributed-executor-backend ray
    --tensor-parallel-size "$TP")
((DP > 1)) && CMD+=(--data-parallel-size "$DP")
((EP)) && CMD+=(--enable-expert-parallel)
CMD+=(--host "$SERVE_HOST" --port "$SERVE_PORT")
run_exec "${CMD[@]}" "${EXTRA[@]}"
