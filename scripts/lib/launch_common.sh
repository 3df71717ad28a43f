# shellcheck shell=bash disable=SC2034  # globals here are read by the scripts that source this file
# Shared by the launch scripts in scripts/ (sourced, never run): command printing for --dry-run, logging,
# argument checks and the Ascend environment of one Atlas node (A2: 8 NPUs, A3: 16 NPUs).
#
# Every command a launch script runs goes through `run` / `set_var` / `source_file`: with DRY_RUN=1 they
# print the command (shell-quoted, one per line on stdout, so the output is itself a runnable script) and
# run nothing; otherwise they log the command on stderr and run it.

DRY_RUN=${DRY_RUN:-0}
TEMPLATE=0  # 1: set_var / source_file print their line on stdout (ascend_env.sh writes an env file)
PYTHON=${PYTHON:-python3}
RAY=${RAY:-ray}
ASCEND_DSV4=${ASCEND_DSV4:-ascend-dsv4}

log() { printf '[%s] %s\n' "${SCRIPT_NAME:-launch}" "$*" >&2; }
done_msg() { ((DRY_RUN)) || log "$*"; }
die() { log "error: $*"; exit 2; }

# quote_cmd ARG...: the arguments as one shell-quoted command line (single quotes where needed)
quote_cmd() {
    local words=() a q="'"
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            words+=("$a")
        elif [[ $a =~ ^[A-Za-z0-9_./:=,@%+-]*\$\{[A-Z_]+\}[A-Za-z0-9_./:=,@%+-]*$ ]]; then
            words+=("\"$a\"")  # a ${VAR} a dry run's printed script sets earlier: expanded when it runs
        else
            words+=("'${a//$q/$q\\$q$q}'")
        fi
    done
    printf '%s' "${words[*]}"
}

# run CMD ARG...: print (dry run) or log and execute one command
run() {
    if ((DRY_RUN)); then
        printf '%s\n' "$(quote_cmd "$@")"
    else
        log "+ $(quote_cmd "$@")"
        "$@"
    fi
}

# run_exec CMD ARG...: like run, but replaces this shell (the last command of a launcher)
run_exec() {
    if ((DRY_RUN)); then
        printf 'exec %s\n' "$(quote_cmd "$@")"
    else
        log "+ exec $(quote_cmd "$@")"
        exec "$@"
    fi
}

# set_var NAME VALUE WHY: export NAME=VALUE; the dry run prints the export with WHY as a comment
set_var() {
    local name=$1 value=$2 why=$3
    export "$name=$value"
    if ((DRY_RUN || TEMPLATE)); then
        printf 'export %s=%s  # %s\n' "$name" "$(quote_cmd "$value")" "$why"
    else
        log "export $name=$(quote_cmd "$value")"
    fi
}

# source_file FILE WHY: source a vendor environment script (CANN set_env.sh, a custom-op package's set_env.bash)
source_file() {
    local file=$1 why=$2
    if ((!DRY_RUN)); then
        [[ -r $file ]] || die "$file not found or not readable ($why); pass its path or install it"
    fi
    if ((DRY_RUN || TEMPLATE)); then
        printf 'source %s  # %s\n' "$(quote_cmd "$file")" "$why"
        return 0
    fi
    log "source $file"
    # vendor scripts read unset variables and may return non-zero: relax the strict mode around them
    set +eu
    # shellcheck disable=SC1090
    source "$file"
    set -eu
}

need_value() { [[ $# -ge 2 && -n $2 && $2 != --* ]] || die "$1 needs a value (see --help)"; }
need_int() { [[ $2 =~ ^[0-9]+$ ]] || die "$1 must be a non-negative integer, got '$2'"; }

# ---- the Ascend node environment ---------------------------------------------------------------------

# Defaults shared by the launchers; each can be overridden by an option (see common_env_help).
PLATFORM=""
NIC=""
HOST_IP=""
DEVICES=""
CANN_SET_ENV=/usr/local/Ascend/ascend-toolkit/set_env.sh
OPP_SET_ENV=""
HCCL_BUFFSIZE_MB=1024
HCCL_CONNECT_TIMEOUT_S=1200
HCCL_EXEC_TIMEOUT_S=204
OMP_THREADS=10
JEMALLOC=auto
MULTI_NODE=1

common_env_help() {
    cat <<'EOF'
Environment options (shared by every launcher):
  --platform a2|a3        Atlas 800 A2 (8 NPUs per node) or A3 (16 NPUs per node)  [required]
  --nic NAME              host NIC that carries HCCL bootstrap / gloo / Ray traffic (default: the NIC of the
                          default route)
  --ip ADDR               this node's IP on that NIC (default: the NIC's first IPv4 address)
  --devices LIST          NPUs this node uses, e.g. 0,1,2,3 (default: all: 0-7 on A2, 0-15 on A3)
  --cann-env FILE         CANN set_env.sh to source (default /usr/local/Ascend/ascend-toolkit/set_env.sh)
  --opp-env FILE          a custom-op package's set_env.bash to source (vllm-ascend / cann-recipes ops)
  --hccl-buffsize MB      HCCL_BUFFSIZE (default 1024)
  --hccl-connect-timeout S  HCCL_CONNECT_TIMEOUT (default 1200)
  --jemalloc auto|none|FILE  LD_PRELOAD jemalloc (default auto: the first libjemalloc.so.2 found)
  --dry-run               print every command (and export) this script would run, run nothing
  -h, --help              this help
EOF
}

# parse_common_env_opt OPT [VALUE]: consume one shared option; sets CONSUMED to the number of words used
# (0 = not a shared option). Called without $(...) so the assignments stay in this shell.
CONSUMED=0
parse_common_env_opt() {
    CONSUMED=2
    case $1 in
        --platform) need_value "$@"; PLATFORM=$2 ;;
        --nic) need_value "$@"; NIC=$2 ;;
        --ip) need_value "$@"; HOST_IP=$2 ;;
        --devices) need_value "$@"; DEVICES=$2 ;;
        --cann-env) need_value "$@"; CANN_SET_ENV=$2 ;;
        --opp-env) need_value "$@"; OPP_SET_ENV=$2 ;;
        --hccl-buffsize) need_value "$@"; need_int "$1" "$2"; HCCL_BUFFSIZE_MB=$2 ;;
        --hccl-connect-timeout) need_value "$@"; need_int "$1" "$2"; HCCL_CONNECT_TIMEOUT_S=$2 ;;
        --jemalloc) need_value "$@"; JEMALLOC=$2 ;;
        --dry-run) DRY_RUN=1; CONSUMED=1 ;;
        *) CONSUMED=0 ;;
    esac
}

# npus_per_node: 8 on A2, 16 on A3 (or the number of --devices)
npus_per_node() {
    if [[ -n $DEVICES ]]; then
        local IFS=,
        # shellcheck disable=SC2086
        set -- $DEVICES
        echo $#
    elif [[ $PLATFORM == a3 ]]; then echo 16
    else echo 8
    fi
}

check_platform() {
    [[ $PLATFORM == a2 || $PLATFORM == a3 ]] || die "--platform must be a2 (Atlas 800 A2, 8 NPUs) or a3 (Atlas 800 A3, 16 NPUs), got '${PLATFORM}'"
    if [[ -n $DEVICES ]]; then
        [[ $DEVICES =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--devices must be a comma-separated list of NPU ids, got '$DEVICES'"
        local max=$(($(npus_per_node_platform) - 1)) d IFS=,
        for d in $DEVICES; do
            ((10#$d <= max)) || die "--devices: NPU $d does not exist on $PLATFORM (ids 0-$max)"
        done
    fi
}

npus_per_node_platform() { if [[ $PLATFORM == a3 ]]; then echo 16; else echo 8; fi; }

default_devices() {
    local n i ids=""
    n=$(npus_per_node_platform)
    for ((i = 0; i < n; i++)); do ids+="${ids:+,}$i"; done
    echo "$ids"
}

# Shell text that prints the first IPv4 address of a NIC / the NIC of the default route (run in real mode,
# printed inside $(...) in a dry run so the printed script still works).
nic_ip_cmd() {
    local nic=$1
    [[ $nic == \$\{* ]] || nic=$(printf '%q' "$nic")
    printf "ip -o -4 addr show dev %s | awk '{split(\$4, a, \"/\"); print a[1]; exit}'" "$nic"
}
default_nic_cmd() { printf "ip -o -4 route show to default | awk '{print \$5; exit}'"; }

resolve_network() {
    if [[ -z $NIC ]]; then
        if ((DRY_RUN)); then NIC="\$($(default_nic_cmd))"; else
            NIC=$(bash -c "$(default_nic_cmd)") || true
            [[ -n $NIC ]] || die "no default route to take the NIC from: pass --nic NAME (see 'ip -br addr')"
        fi
    fi
    if [[ -z $HOST_IP ]]; then
        if ((DRY_RUN)); then HOST_IP="\$($(nic_ip_cmd "$NIC"))"; else
            HOST_IP=$(bash -c "$(nic_ip_cmd "$NIC")") || true
            [[ -n $HOST_IP ]] || die "NIC '$NIC' has no IPv4 address: pass --nic NAME of the cluster network or --ip ADDR"
        fi
    fi
}

# set_var for a value that may be a $(...) detection command or a ${VAR} reference in a dry run (printed
# unquoted inside double quotes, so the printed script evaluates it)
set_var_detected() {
    local name=$1 value=$2 why=$3
    if ((DRY_RUN || TEMPLATE)) && [[ $value == \$* ]]; then
        printf 'export %s="%s"  # %s\n' "$name" "$value" "$why"
    else
        set_var "$name" "$value" "$why"
    fi
}

find_jemalloc() {
    local f
    for f in /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
        /usr/lib64/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2 /usr/lib/libjemalloc.so.2; do
        [[ -e $f ]] && { echo "$f"; return 0; }
    done
    return 1
}

# apply_ascend_env: source CANN (+ custom ops), then export the variables the Ascend DeepSeek recipes set.
# Must run BEFORE `ray start`: Ray workers inherit the raylet's environment, and changing it needs a restart.
apply_ascend_env() {
    check_platform
    [[ -n $DEVICES ]] || DEVICES=$(default_devices)
    source_file "$CANN_SET_ENV" "CANN toolkit: ASCEND_HOME_PATH, ASCEND_OPP_PATH, LD_LIBRARY_PATH of the runtime and HCCL"
    if [[ -n $OPP_SET_ENV ]]; then
        source_file "$OPP_SET_ENV" "custom-op package (fused DeepSeek ops): adds it to ASCEND_CUSTOM_OPP_PATH"
    fi
    set_var ASCEND_RT_VISIBLE_DEVICES "$DEVICES" \
        "NPUs this node's ranks may use (logical ids, ascending)"
    if ((MULTI_NODE)); then
        set_var RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES 1 \
            "keep Ray from rewriting ASCEND_RT_VISIBLE_DEVICES per actor; each rank picks its NPU from the ids Ray assigns it"
    fi
    if ((MULTI_NODE)) || [[ -n $NIC ]]; then
        resolve_network
        set_var_detected HCCL_SOCKET_IFNAME "$NIC" "NIC of HCCL's host-side sockets"
        if [[ $NIC == \$\(* ]]; then  # dry run, NIC detected by the printed script: reuse its result
            # shellcheck disable=SC2016  # printed literally, expanded by the printed script
            NIC='${HCCL_SOCKET_IFNAME}'
            [[ $HOST_IP == \$\(* ]] && HOST_IP="\$($(nic_ip_cmd "$NIC"))"
        fi
        set_var_detected HCCL_IF_IP "$HOST_IP" \
            "host IP HCCL uses for its bootstrap socket (rank discovery); wrong or unset picks a random NIC and hangs"
        # shellcheck disable=SC2016  # printed literally, expanded by the printed script
        [[ $HOST_IP == \$\(* ]] && HOST_IP='${HCCL_IF_IP}'  # later commands reuse the detected address
        set_var_detected GLOO_SOCKET_IFNAME "$NIC" \
            "NIC of torch.distributed gloo (CPU groups for metadata); default may pick docker0/lo and hang"
        set_var_detected TP_SOCKET_IFNAME "$NIC" "NIC of torch's TensorPipe RPC (the vllm-ascend Ray recipe sets it)"
    fi
    set_var HCCL_CONNECT_TIMEOUT "$HCCL_CONNECT_TIMEOUT_S" \
        "seconds ranks wait for each other while HCCL links are built; nodes finish loading weights minutes apart"
    set_var HCCL_EXEC_TIMEOUT "$HCCL_EXEC_TIMEOUT_S" \
        "seconds a collective waits for its peers before failing (V4 recipes: 204) instead of hanging"
    set_var HCCL_BUFFSIZE "$HCCL_BUFFSIZE_MB" \
        "MB per communicator buffer; MoE dispatch/combine windows must fit (recipes: 1024-2560, default 200)"
    set_var HCCL_OP_EXPANSION_MODE AIV \
        "collectives orchestrated on the AI vector cores: lower latency for decode-sized messages"
    if [[ $PLATFORM == a2 ]] && ((MULTI_NODE)); then
        set_var HCCL_INTRA_PCIE_ENABLE 1 "A2 multi-node: HCCL traffic inside a box over PCIe/HCCS ..."
        set_var HCCL_INTRA_ROCE_ENABLE 0 "... not over RoCE, which then carries only the cross-node MoE traffic"
    fi
    set_var PYTORCH_NPU_ALLOC_CONF expandable_segments:True \
        "torch_npu caching allocator grows segments in place: less fragmentation, fewer OOMs at load / KV allocation"
    set_var TASK_QUEUE_ENABLE 1 "torch_npu launches kernels from a task-queue thread: less host overhead per op"
    set_var OMP_PROC_BIND false "do not pin every rank's OpenMP threads to the same cores"
    set_var OMP_NUM_THREADS "$OMP_THREADS" "OpenMP threads per rank; $(npus_per_node) ranks share this host's cores"
    local lib=""
    case $JEMALLOC in
        none) ;;
        auto)
            if ! lib=$(find_jemalloc); then
                log "libjemalloc.so.2 not found: LD_PRELOAD not set (apt install libjemalloc2 / yum install jemalloc)"
                ((DRY_RUN || TEMPLATE)) && echo "# LD_PRELOAD not set: libjemalloc.so.2 not found on this host (apt install libjemalloc2)"
            fi ;;
        *) lib=$JEMALLOC; ((DRY_RUN)) || [[ -e $lib ]] || die "--jemalloc $lib: no such file" ;;
    esac
    if [[ -n $lib ]]; then
        set_var LD_PRELOAD "$lib${LD_PRELOAD:+:$LD_PRELOAD}" \
            "jemalloc for host allocations: less fragmentation and lock contention with many threads"
    fi
}

# ray_wait ARGS...: the node / cluster check (python -m ascend_dsv4.entrypoints.ray_cluster wait ...)
ray_wait() { run "$PYTHON" -m ascend_dsv4.entrypoints.ray_cluster wait "$@"; }
