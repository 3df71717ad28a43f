#!/usr/bin/env bash
# Serve one model on one Atlas node: the Ascend environment, then
# `ascend-dsv4 serve --distributed-executor-backend mp` over the node's NPUs (no Ray).
set -euo pipefail
SCRIPT_NAME=serve_single_node.sh
# shellcheck source-path=SCRIPTDIR source=lib/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/launch_common.sh"

MODEL=""
TP=""
DP=""
EP=0
SERVE_HOST=127.0.0.1
SERVE_PORT=8000
EXTRA=()
MULTI_NODE=0

usage() {
    cat <<'EOF_HELP'
Usage: scripts/serve_single_node.sh --platform a2|a3 --model DIR [options] [-- extra serve options]

Applies the Ascend environment and runs
  ascend-dsv4 serve --model DIR --device npu --distributed-executor-backend mp
      --tensor-parallel-size T --data-parallel-size D [--enable-expert-parallel] --host H --port P ...
with one process per NPU. T x D must not exceed the node's NPUs (8 on A2, 16 on A3, or --devices).

  --model DIR                    model folder
  --tensor-parallel-size T       default: min(8, NPUs of the node / D) (DeepSeek-V4's 8 output groups
                                 allow at most TP 8)
  --data-parallel-size D         default: NPUs of the node / T (attention replicas); passed on when > 1
  --enable-expert-parallel       MoE experts spread over all T x D ranks
  --host ADDR / --port N         where the OpenAI server listens (default 127.0.0.1:8000)
The network variables (HCCL_IF_IP, *_SOCKET_IFNAME) are set only when --nic is given.
EOF_HELP
    common_env_help
}

while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --model) need_value "$@"; MODEL=$2; shift 2 ;;
        --tensor-parallel-size | --tp) need_value "$@"; need_int "$1" "$2"; TP=$2; shift 2 ;;
        --data-parallel-size | --dp) need_value "$@"; need_int "$1" "$2"; DP=$2; shift 2 ;;
        --enable-expert-parallel) EP=1; shift ;;
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
[[ -n $MODEL ]] || die "--model DIR is required (see --help)"
((DRY_RUN)) || [[ -d $MODEL ]] || die "--model $MODEL is not a folder"
check_platform
NPUS=$(npus_per_node)
if [[ -z $TP ]]; then
    TP=$((NPUS / ${DP:-1}))
    ((TP <= 8)) || TP=8
fi
((TP >= 1)) || die "--tensor-parallel-size must be >= 1"
((TP <= NPUS)) || die "TP $TP needs $TP NPUs, the node has $NPUS"
[[ -n $DP ]] || DP=$((NPUS / TP))
((DP >= 1)) || die "--data-parallel-size must be >= 1"
((TP >= 1 && TP * DP <= NPUS)) || die "TP ${TP} x DP $DP needs $((TP * DP)) NPUs, the node has $NPUS"
((TP * DP == NPUS)) || log "warning: TP $TP x DP $DP = $((TP * DP)) ranks leave $((NPUS - TP * DP)) of $NPUS NPUs idle"

apply_ascend_env
CMD=("$ASCEND_DSV4" serve --model "$MODEL" --device npu --distributed-executor-backend mp
    --tensor-parallel-size "$TP")
((DP > 1)) && CMD+=(--data-parallel-size "$DP")
((EP)) && CMD+=(--enable-expert-parallel)
CMD+=(--host "$SERVE_HOST" --port "$SERVE_PORT")
run_exec "${CMD[@]}" "${EXTRA[@]}"
