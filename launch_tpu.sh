#!/usr/bin/env bash
# Launch a sweet_jax training run on a Cloud TPU VM (single host or pod slice) via queued resources:
#   create (queued resource) -> wait until ACTIVE -> install the package on every worker ->
#   start the train command on all workers, detached (it survives the ssh session) -> wait for it ->
#   copy the logs back (also when the run fails or this script is interrupted) -> delete.
#
# Usage:
#   bash launch_tpu.sh [options] -- python -m sweet_jax.train --config configs/critic.py:llama3_8b \
#       --workdir gs://BUCKET/runs/critic --config.model.path=gs://... [...]
#
# Options (each also read from the environment variable in brackets):
#   --project P          GCP project                                   [PROJECT or CLOUDSDK_CORE_PROJECT]
#   --zone Z             zone, e.g. us-east5-b                         [ZONE]
#   --accelerator-type A e.g. v6e-8, v5p-8, v4-8, v5litepod-16         [ACCELERATOR_TYPE, default v6e-8]
#   --runtime-version R  TPU VM image, e.g. v2-alpha-tpuv6e            [RUNTIME_VERSION, default by type]
#   --bucket gs://B      where logs are copied (and checkpoints live)  [BUCKET]
#   --name N             queued-resource / TPU VM name                 [TPU_NAME, default sweet-jax-$USER]
#   --repo URL|DIR       what to pip install on the workers            [SWEET_JAX_REPO, default: this checkout, copied with scp]
#   --spot               use spot capacity                             [SPOT=1]
#   --keep               do not delete the TPU VM at the end           [KEEP=1]
#   --dry-run            print the gcloud commands instead of running them
#   -h | --help
set -euo pipefail

# The comment block at the top of this file, without the '# ' (and nothing after it).
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }

PROJECT="${PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}"
ZONE="${ZONE:-}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v6e-8}"
RUNTIME_VERSION="${RUNTIME_VERSION:-}"
BUCKET="${BUCKET:-}"
TPU_NAME="${TPU_NAME:-sweet-jax-${USER:-user}}"
SWEET_JAX_REPO="${SWEET_JAX_REPO:-}"
SPOT="${SPOT:-0}"
KEEP="${KEEP:-0}"
DRY_RUN=0
POLL_SECONDS="${POLL_SECONDS:-30}"
TRAIN_CMD=()

die() { echo "launch_tpu.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --project) PROJECT="${2:?--project needs a value}"; shift 2 ;;
    --zone) ZONE="${2:?--zone needs a value}"; shift 2 ;;
    --accelerator-type) ACCELERATOR_TYPE="${2:?--accelerator-type needs a value}"; shift 2 ;;
    --runtime-version) RUNTIME_VERSION="${2:?--runtime-version needs a value}"; shift 2 ;;
    --bucket) BUCKET="${2:?--bucket needs a value}"; shift 2 ;;
    --name) TPU_NAME="${2:?--name needs a value}"; shift 2 ;;
    --repo) SWEET_JAX_REPO="${2:?--repo needs a value}"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --keep) KEEP=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; TRAIN_CMD=("$@"); break ;;
    *) die "unknown option '$1' (see --help; put the train command after --)" ;;
  esac
done

[[ -n "$PROJECT" ]] || die "no project: pass --project P or set PROJECT"
[[ -n "$ZONE" ]] || die "no zone: pass --zone Z or set ZONE"
[[ -n "$BUCKET" ]] || die "no bucket: pass --bucket gs://B or set BUCKET (logs are copied there)"
[[ "$BUCKET" == gs://* ]] || die "--bucket must start with gs:// (got '$BUCKET')"
BUCKET="${BUCKET%/}"
if [[ ${#TRAIN_CMD[@]} -eq 0 ]]; then
  TRAIN_CMD=(python -m sweet_jax.train --config configs/critic.py:llama3_8b --workdir "$BUCKET/runs/$TPU_NAME")
fi

if [[ -z "$RUNTIME_VERSION" ]]; then
  case "$ACCELERATOR_TYPE" in
    v6e-*) RUNTIME_VERSION="v2-alpha-tpuv6e" ;;
    v5p-*) RUNTIME_VERSION="v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) RUNTIME_VERSION="v2-alpha-tpuv5-lite" ;;
    v4-*) RUNTIME_VERSION="tpu-ubuntu2204-base" ;;
    *) die "no default runtime version for '$ACCELERATOR_TYPE': pass --runtime-version" ;;
  esac
fi

GCLOUD=(gcloud --project="$PROJECT")
TPU_FLAGS=(--zone="$ZONE")
LOG_DIR="logs/$TPU_NAME"
REMOTE_LOG="/tmp/sweet_jax_train.log"
REMOTE_RC="/tmp/sweet_jax_train.rc"   # the train command's exit status, written when it ends
STARTED=0

# Print a command (shell-quoted); run it unless --dry-run.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ "$DRY_RUN" -eq 0 ]]; then "$@"; fi
}

ssh_all() {
  run "${GCLOUD[@]}" compute tpus tpu-vm ssh "$TPU_NAME" "${TPU_FLAGS[@]}" --worker=all --command="$1"
}

# Every worker's log to the bucket, and worker 0's here.
copy_logs() {
  ssh_all "gsutil cp $REMOTE_LOG $BUCKET/$LOG_DIR/worker-\$(hostname).log" || true
  run mkdir -p "$LOG_DIR"
  run "${GCLOUD[@]}" compute tpus tpu-vm scp "$TPU_NAME:$REMOTE_LOG" "$LOG_DIR/worker0.log" "${TPU_FLAGS[@]}" \
    --worker=0 || true
  echo "logs: $LOG_DIR/ and $BUCKET/$LOG_DIR/"
}

# On every way out (the run's end, its failure, Ctrl-C here): the logs first, then the VM.
cleanup() {
  if [[ "$STARTED" -eq 1 ]]; then copy_logs; fi
  if [[ "$KEEP" -eq 1 ]]; then
    echo "--keep: leaving $TPU_NAME running; delete it with:" >&2
    echo "  gcloud --project=$PROJECT compute tpus queued-resources delete $TPU_NAME --zone=$ZONE --force --quiet" >&2
    return
  fi
  run "${GCLOUD[@]}" compute tpus queued-resources delete "$TPU_NAME" "${TPU_FLAGS[@]}" --force --quiet || true
}

# 1. Create the TPU VM through a queued resource (waits for capacity instead of failing).
CREATE=("${GCLOUD[@]}" compute tpus queued-resources create "$TPU_NAME" "${TPU_FLAGS[@]}"
  --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION")
if [[ "$SPOT" -eq 1 ]]; then CREATE+=(--spot); fi
run "${CREATE[@]}"
trap cleanup EXIT

# 2. Wait until the queued resource is ACTIVE.
DESCRIBE=("${GCLOUD[@]}" compute tpus queued-resources describe "$TPU_NAME" "${TPU_FLAGS[@]}" --format='value(state.state)')
if [[ "$DRY_RUN" -eq 1 ]]; then
  run "${DESCRIBE[@]}"
else
  while true; do
    state="$("${DESCRIBE[@]}")"
    echo "queued resource $TPU_NAME: $state"
    case "$state" in
      ACTIVE) break ;;
      FAILED|SUSPENDED) die "queued resource $TPU_NAME is $state; see: gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE" ;;
    esac
    sleep "$POLL_SECONDS"
  done
fi

# 3. Install the package on every worker (the checkout without runs, logs, virtualenvs and caches).
if [[ -z "$SWEET_JAX_REPO" || -d "$SWEET_JAX_REPO" ]]; then
  SRC="${SWEET_JAX_REPO:-$(cd "$(dirname "$0")" && pwd)}"
  run tar -C "$SRC" --exclude=.git --exclude='*.egg-info' --exclude=./runs --exclude=./logs --exclude='.venv' \
    --exclude='venv' --exclude='.ci-venv' --exclude='.ci-demo' --exclude='__pycache__' --exclude='.pytest_cache' \
    -czf /tmp/sweet_jax_src.tgz .
  run "${GCLOUD[@]}" compute tpus tpu-vm scp /tmp/sweet_jax_src.tgz "$TPU_NAME":/tmp/sweet_jax_src.tgz "${TPU_FLAGS[@]}" --worker=all
  ssh_all "mkdir -p ~/sweet_jax && tar -C ~/sweet_jax -xzf /tmp/sweet_jax_src.tgz && cd ~/sweet_jax && python3 -m pip install -q -e '.[tpu]'"
else
  ssh_all "git clone -q $SWEET_JAX_REPO ~/sweet_jax && cd ~/sweet_jax && python3 -m pip install -q -e '.[tpu]'"
fi

# 4. Start the train command on all workers at once (jax.distributed finds its peers on TPU VMs), detached
# with setsid + nohup: a dropped ssh connection does not end the run. Its exit status goes to REMOTE_RC.
printf -v TRAIN_STR ' %q' "${TRAIN_CMD[@]}"
printf -v DETACHED '%q' "cd ~/sweet_jax && ${TRAIN_STR# } > $REMOTE_LOG 2>&1; echo \$? > $REMOTE_RC"
STARTED=1
ssh_all "rm -f $REMOTE_RC $REMOTE_LOG && setsid nohup bash -c $DETACHED > /dev/null 2>&1 < /dev/null &"

# 5. Wait until every worker's run has ended; the exit status of worker 0's is this script's.
WAIT=("${GCLOUD[@]}" compute tpus tpu-vm ssh "$TPU_NAME" "${TPU_FLAGS[@]}" --worker=all --command="test -f $REMOTE_RC")
RC=("${GCLOUD[@]}" compute tpus tpu-vm ssh "$TPU_NAME" "${TPU_FLAGS[@]}" --worker=0 --command="cat $REMOTE_RC")
if [[ "$DRY_RUN" -eq 1 ]]; then
  run "${WAIT[@]}"
  run "${RC[@]}"
  status=0
else
  until "${WAIT[@]}" > /dev/null 2>&1; do sleep "$POLL_SECONDS"; done
  status="$("${RC[@]}" 2> /dev/null || echo 1)"
fi
echo "train command ended with exit status $status"
# 6. Logs and deletion: the EXIT trap (cleanup), unless --keep. The script's exit status is the run's.
[[ "$status" == 0 ]] || exit "$status"
