#!/usr/bin/env bash
# Launch spider_titan training with torchrun, on one node or several (README: "Parallelism and multi-node training").
#
#   scripts/run_train.sh --job.config_file train_configs/debug_model.toml [--section.key value ...]
#
# Environment (defaults in brackets):
#   NGPU           processes on this node: its GPUs, or CPU processes [all visible GPUs, else 1]
#   NNODES         nodes taking part [1]
#   NODE_RANK      this node's index, 0..NNODES-1; node 0 hosts the rendezvous store [0]
#   RDZV_ENDPOINT  host:port of node 0, reachable from every node (needed when NNODES > 1)
#   RDZV_ID        a name shared by the nodes of one job [spider_titan]
#   CONFIG_FILE    used when no --job.config_file argument is given [train_configs/debug_model.toml]
#   PYTHON         the interpreter with torch and spider_titan installed [python]
#   MAX_RESTARTS   times torchrun restarts the job after a worker fails (a lost node, a killed
#                  process); each restart resumes from the newest complete checkpoint and retrains
#                  the steps since it [3 with NNODES > 1, else 0: on one node a failure is mostly a
#                  bug that a restart repeats]
#
# One node and no RDZV_ENDPOINT: torchrun --standalone. Otherwise a c10d rendezvous at
# RDZV_ENDPOINT. The trainer picks NCCL when CUDA is available and gloo on CPU.
#
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (unless set): each restart gets a store of its own rather than
# the rendezvous's, whose keys from the workers before would make the restarted ones hang or fail to
# connect (pytorch/pytorch#135712, #167288; the trainer works around it too, for a bare torchrun).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

refuse() { echo "run_train.sh: $1" >&2; exit 2; }
whole() { [[ "$2" =~ ^[0-9]+$ ]] && (( $2 >= $3 )) || refuse "$1=$2 is not a whole number >= $3 (e.g. $1=$4)"; }

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV_ID=${RDZV_ID:-spider_titan}
whole NNODES "$NNODES" 1 2
whole NODE_RANK "$NODE_RANK" 0 0
(( NODE_RANK < NNODES )) || refuse "NODE_RANK=$NODE_RANK is outside 0..$((NNODES - 1)) (NNODES=$NNODES)"
if [[ -n "${RDZV_ENDPOINT:-}" && ! "$RDZV_ENDPOINT" =~ ^[^:]+:[0-9]+$ ]]; then
    refuse "RDZV_ENDPOINT=$RDZV_ENDPOINT is not host:port (e.g. RDZV_ENDPOINT=10.0.0.1:29500)"
fi
if [[ -n "${NGPU:-}" ]]; then
    whole NGPU "$NGPU" 1 8
else
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi

args=("$@")
if [[ " ${args[*]-} " != *" --job.config_file"* ]]; then
    args=(--job.config_file "${CONFIG_FILE:-train_configs/debug_model.toml}" "${args[@]}")
fi

if [[ "$NNODES" == 1 && -z "${RDZV_ENDPOINT:-}" ]]; then
    launch=(--standalone --nnodes 1)
else
    [[ -n "${RDZV_ENDPOINT:-}" ]] || refuse "NNODES=$NNODES needs RDZV_ENDPOINT=host:port of node 0"
    is_host=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)
    launch=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID"
            --rdzv-conf "is_host=$is_host")
fi

if [[ "$NNODES" == 1 ]]; then MAX_RESTARTS=${MAX_RESTARTS:-0}; else MAX_RESTARTS=${MAX_RESTARTS:-3}; fi
whole MAX_RESTARTS "$MAX_RESTARTS" 0 3

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "$PYTHON" -m torch.distributed.run "${launch[@]}" --nproc-per-node "$NGPU" --max-restarts "$MAX_RESTARTS" \
    -m spider_titan.train "${args[@]}"
