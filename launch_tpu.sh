#!/usr/bin/env bash
# Launch sage_jax on a Cloud TPU VM or pod slice: create it (or reuse it), install the repo and
# jax[tpu] on every worker, then start `python -m sage_jax.main` on all workers at once.
#
#   ./launch_tpu.sh --name=sage --zone=us-east5-a --accelerator-type=v5p-64 --project=my-proj \
#       --config=configs/qwen_math.py --workdir=gs://my-bucket/sage_qwen_math -- --config.rl.beta=0.02
#
# Flags (all also accept "--flag value"):
#   --name NAME               TPU VM / slice name (required)
#   --zone ZONE               e.g. us-east5-a (required)
#   --accelerator-type TYPE   e.g. v5p-8 (1 host), v5p-64 (8 hosts), v6e-8 (default v5p-8)
#   --project PROJECT         GCP project (default: gcloud's configured project)
#   --version VERSION         TPU VM software version (default by generation: v2-alpha-tpuv5 for
#                             v5p, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e for v6e, tpu-ubuntu2204-base)
#   --config PATH[:ARG]       sage_jax config file (default configs/qwen_math.py)
#   --workdir DIR             run directory; on a multi-host slice use gs:// (all hosts write checkpoints)
#   --spot                    create a Spot VM
#   --skip-install            reuse the previous install on the workers
#   --dry-run                 print every command instead of running it
#   -- ARGS...                passed through to sage_jax.main (e.g. --config.max_steps=10)
#
# Each worker runs the same command; sage_jax.distributed.maybe_initialize() sees
# SAGE_JAX_DISTRIBUTED=auto and calls jax.distributed.initialize(), which finds the other workers
# from the TPU metadata. The repo is copied from this checkout (tracked and untracked files, no .git
# or .venv), so what runs is what you have here.
set -euo pipefail

NAME="" ZONE="" PROJECT="" ACCEL="v5p-8" VERSION=""
CONFIG="configs/qwen_math.py" WORKDIR="" SPOT=0 SKIP_INSTALL=0 DRY_RUN=0
EXTRA=()
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REMOTE_DIR="sage_jax"          # relative to the remote home directory
TARBALL="/tmp/sage_jax_src.tgz"

die() { echo "launch_tpu.sh: $*" >&2; exit 2; }

while (($#)); do
  arg="$1"
  case "$arg" in
    --) shift; EXTRA=("$@"); break ;;
    --dry-run) DRY_RUN=1 ;;
    --spot) SPOT=1 ;;
    --skip-install) SKIP_INSTALL=1 ;;
    --name=*|--zone=*|--accelerator-type=*|--project=*|--version=*|--config=*|--workdir=*)
      key="${arg%%=*}"; val="${arg#*=}"; set -- "$key" "$val" "${@:2}"; continue ;;
    --name|--zone|--accelerator-type|--project|--version|--config|--workdir)
      if (($# < 2)) || [[ "$2" == --* ]]; then die "$arg needs a value"; fi
      case "$arg" in
        --name) NAME="$2" ;; --zone) ZONE="$2" ;; --accelerator-type) ACCEL="$2" ;;
        --project) PROJECT="$2" ;; --version) VERSION="$2" ;; --config) CONFIG="$2" ;;
        --workdir) WORKDIR="$2" ;;
      esac
      shift ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown argument '$arg' (sage_jax.main flags go after --)" ;;
  esac
  shift
done

[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ -n "$WORKDIR" ]] || die "--workdir is required (gs://BUCKET/DIR on a multi-host slice)"
[[ -f "$REPO_DIR/${CONFIG%%:*}" ]] || die "--config ${CONFIG%%:*} not found in $REPO_DIR"
if [[ -z "$VERSION" ]]; then
  case "$ACCEL" in
    v5p-*) VERSION="v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) VERSION="v2-alpha-tpuv5-lite" ;;
    v6e-*) VERSION="v2-alpha-tpuv6e" ;;
    *) VERSION="tpu-ubuntu2204-base" ;;
  esac
fi

# Prints one command, quoting only the words that need it (so the line can be pasted into a shell).
print_cmd() {
  local out="" w
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then out+="$w "; else out+="${w@Q} "; fi
  done
  echo "${out% }"
}

run() {
  if ((DRY_RUN)); then print_cmd "$@"; else "$@"; fi
}

GC=(gcloud compute tpus tpu-vm)
WHERE=("--zone=$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=("--project=$PROJECT")

# 1. Create the TPU, or reuse it when it exists.
CREATE=("${GC[@]}" create "$NAME" "${WHERE[@]}" "--accelerator-type=$ACCEL" "--version=$VERSION")
((SPOT)) && CREATE+=(--spot)
if ((DRY_RUN)); then
  print_cmd "${GC[@]}" describe "$NAME" "${WHERE[@]}" "--format=value(state)"
  echo "# only if describe fails (no such TPU):"
  print_cmd "${CREATE[@]}"
elif "${GC[@]}" describe "$NAME" "${WHERE[@]}" "--format=value(state)" >/dev/null 2>&1; then
  echo "reusing TPU $NAME in $ZONE" >&2
else
  "${CREATE[@]}"
fi

# 2. Copy this checkout to every worker and install it with jax[tpu] pinned to requirements.txt's jax.
JAX_VERSION="$(sed -n 's/^jax==\([0-9.]*\).*/\1/p' "$REPO_DIR/requirements.txt" | head -n 1)"
[[ -n "$JAX_VERSION" ]] || die "no 'jax==VERSION' line in requirements.txt"
INSTALL="set -e; mkdir -p ~/$REMOTE_DIR && tar xzf ~/$(basename "$TARBALL") -C ~/$REMOTE_DIR && cd ~/$REMOTE_DIR"
# The project needs Python >= 3.11; TPU VM images ship 3.10, so install 3.11 where it is missing.
INSTALL+=" && (command -v python3.11 >/dev/null || (sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv))"
INSTALL+=" && python3.11 -m venv .venv && .venv/bin/pip install -q --upgrade pip"
INSTALL+=" && .venv/bin/pip install -q -r requirements.txt 'jax[tpu]==$JAX_VERSION'"
INSTALL+=" && .venv/bin/pip install -q --no-deps -e ."
if ((!SKIP_INSTALL)); then
  run tar czf "$TARBALL" -C "$REPO_DIR" --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude=.pytest_cache .
  run "${GC[@]}" scp "$TARBALL" "$NAME:~/" "${WHERE[@]}" --worker=all
  run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all "--command=$INSTALL"
fi

# 3. Start the run on all workers (output of every worker streams here; Ctrl-C stops the ssh sessions).
MAIN="cd ~/$REMOTE_DIR && SAGE_JAX_DISTRIBUTED=auto .venv/bin/python -m sage_jax.main"
MAIN+=" --config=$(printf '%q' "$CONFIG") --workdir=$(printf '%q' "$WORKDIR")"
for a in "${EXTRA[@]+"${EXTRA[@]}"}"; do MAIN+=" $(printf '%q' "$a")"; done
run "${GC[@]}" ssh "$NAME" "${WHERE[@]}" --worker=all "--command=$MAIN"
