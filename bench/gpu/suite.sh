#!/usr/bin/env bash
# The GPU machine's benchmark runs, by name: one entry in place of a script per round of runs.
#
#     bash bench/gpu/suite.sh headline tests         # from a device call, the repository copy's root (carry .whl)
#     bash bench/gpu/suite.sh --list                 # the suites, and what each runs
#     bash bench/gpu/suite.sh --dry-run headline ab  # the commands each suite would run, nothing run
#
# Each suite writes under $OUT/<suite>/ (OUT: the device call's output folder; default runs/gpu): per process
# NAME.txt (its command, its output, "rc=N" last), its run.py folder NAME/ (results_<W>.json, .md, log) and
# NAME_trace.txt (bench/trace.py --gaps of its zerofit engines), and
# exit_codes.txt (every process's exit code and seconds; for bench/run.py, each engine's status and exit code
# too). At the end $OUT/summary.txt gathers them and $OUT/done is created; the exit status is 1 if any process
# failed. Most suites take longer than one device call (600 s): start them detached and poll from later calls
# on the same warm machine,
#
#     OUT=/tmp/suite COMMIT=abc1234 setsid bash bench/gpu/suite.sh headline tests </dev/null >/tmp/suite.log 2>&1 &
#     ls /tmp/suite/done && tar czf $OUT/suite.tgz -C /tmp suite          # a later call
#
# Settings (environment):
#   COMMIT       the commit id the results record (default: git rev-parse here, else "unknown")
#   ZF_PYTHON    the interpreter (default python3)
#   ZF_SETUP     auto (default): source bench/gpu/setup.sh when .whl/*.whl is here, else put src/ on PYTHONPATH
#                and use this Python's packages; 1: setup must succeed; 0: src/ on PYTHONPATH only
#   ESTIMATE     1 (default): headline's zerofit runs record `zerofit estimate`'s prediction first (--estimate)
#   HEADLINE_PEERS  the peers of headline's W1 and W2 at 24 GiB (default deepspeed,fsdp2; empty: none)
#   ZF_REPO, OLD_COMMIT, AB   ab: the older tree (its src/ and bench/), its commit id, which runs (default
#                w1_24 w1_clip1 w1_8 w2_24; also w1_ds w2_ds (the DeepSpeed-shaped loop), w2_trainer, w4, w3b_24)
#   DISK, DISK_PEERS, DS_TIMEOUT, NVME   disk: which runs, WORKLOAD:HOST_BUDGET pairs against DeepSpeed
#                ZeRO-Infinity (default W1:16GiB), DeepSpeed's seconds, the disk tier's folder (default /tmp/nv)
#   RANKS_DS     ranks: 1 (default) runs DeepSpeed on W5 too (RANKS_DS_ARGS, default --no-offload-param)
#   TESTS_ARGS   tests: more pytest arguments (e.g. -x)
#   LORA         lora: which runs (default w6a w6b; w6c: 70B QLoRA); LORA_STEPS (default 4)
#   ZF_TAR=1     tar $OUT into $OUT.tgz at the end
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2      # the repository root

SUITES=(headline ab dsloop trainer disk infer ranks lora userloop longctx serve nodes tests kernels convergence)
declare -A ABOUT=(
  [headline]="the README's figures: W1 at 24 GiB (plain, zerofit, DeepSpeed, FSDP2), W1 clipped at 1.0 (plain, zerofit), W1 at 8 GiB (plain, zerofit), W2 at 24 GiB (plain, zerofit, DeepSpeed, FSDP2)"
  [ab]="headline's workloads for zerofit at this tree and at an older one (ZF_REPO, OLD_COMMIT), one after the other, plain beside the new one"
  [dsloop]="the DeepSpeed-shaped loop (zerofit-ds, -dsw announced windows, -dsl the engine's loader) against train_batch: W1 (with plain and DeepSpeed), W2"
  [trainer]="W2 through zerofit.hf.Trainer (bench/trainer_bench.py), with train_batch in the same call"
  [disk]="the disk tier: W3a (7B, 32 GiB host), W3b (13B, 108 GiB host) at 24 and 8 GiB, then DISK_PEERS against DeepSpeed ZeRO-Infinity"
  [infer]="W4: offloaded generation of the 13B shape against accelerate (bench/infer.py), then with blocks on the disk"
  [ranks]="2 GPUs (the nvidia-h200-x2 kind): the NCCL rank tests, W2 on 1 and 2 GPUs, W5 zerofit, FSDP2 without offload, DeepSpeed"
  [lora]="W6: LoRA of the 13B shape over its frozen bf16 base (PEFT): W6a at 24 GiB (plain PEFT on the GPU, zerofit, DeepSpeed ZeRO-3 offload), W6b at 8 GiB (zerofit); needs peft (its wheel in .whl)"
  [userloop]="W7: the user's FSDP1-shaped loop on zerofit.fsdp (the window of its 4 micro-batches, and the default) against torch's FSDP1 with CPU offload, FSDP2 with CPUOffloadPolicy, plain and train_batch (W1, 4 micro-batches, clip 1.0); then the same loop through accelerate and Lightning Fabric, Fabric's own FSDPStrategy with CPU offload beside them"
  [longctx]="one long sequence per step at 24 GiB (docs/long-context.md): the Llama-3.1-8B shape in LoRA at 32k, 64k and 128k tokens, the 13B at 64k, each after zerofit estimate and beside PEFT in the GPU with no cap; the 8B in full fine-tuning at 32k (100 GiB host, the disk tier); the 8B LoRA at 256k with no cap"
  [serve]="zerofit serve (bench/serve.py) of the 13B shape at a 24 GiB cap, 1 and 16 concurrent requests, against the same server over accelerate's device_map offload"
  [nodes]="several hosts simulated on one (2 GPUs, the nvidia-h200-x2 kind): W2 on 2 nodes of 1 GPU (each node its own torchrun and host state) in the hybrid layout (gradients all-reduced across them) and the full one (each node half the host state, weights gathered across them: docs/ranks.md), against 1 node of 2 GPUs and 1 GPU"
  [kernels]="the fast kernels (docs/kernels.md): their GPU tests, then W6a (13B LoRA, 24 GiB) zerofit fast and exact against PEFT and PEFT + Liger-Kernel in the GPU, W1 (3B, 24 GiB) against plain and plain + Liger-Kernel, W6c8 (70B QLoRA cut to 8 blocks) against PEFT + bitsandbytes; with ZF_REPO and OLD_COMMIT, W1's exact path on that older tree too"
  [convergence]="the fast kernels' convergence check (bench/convergence.py): a 0.6 B Llama on the standard library's source, 300 steps, exact and fast over 3 seeds, all six at once on one GPU, then the summary"
  [tests]="pytest of the GPU tests: tests/gpu/ (test_gpu.py, test_small_gpu_floor.py), tests/unit/test_split_updates.py and every test that skips without CUDA (bench/gpu/gpu_tests.py)"
)

usage() {
  sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  list
}

list() {
  echo "suites:"
  local s
  for s in "${SUITES[@]}"; do printf '  %-9s %s\n' "$s" "${ABOUT[$s]}"; done
}

dry=0 names=()
for a in "$@"; do
  case "$a" in
    --list|-l) list; exit 0 ;;
    --help|-h) usage; exit 0 ;;
    --dry-run|-n) dry=1 ;;
    -*) echo "suite.sh: unknown option $a" >&2; exit 2 ;;
    *) [ -n "${ABOUT[$a]+x}" ] || { echo "suite.sh: no suite '$a'" >&2; list >&2; exit 2; }; names+=("$a") ;;
  esac
done
[ ${#names[@]} -gt 0 ] || { usage >&2; exit 2; }
export ZF_DRY=$dry

root=$(realpath -m "${OUT:-runs/gpu}")
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
ab_repo=${ZF_REPO:-}
unset ZF_REPO            # only ab's older runs use another tree (zf_run reads ZF_REPO)
NVME=${NVME:-/tmp/nv}
source bench/gpu/lib.sh
mkdir -p "$root"

# --------------------------------------------------------------------------- the machine

if [ "$dry" = 0 ]; then
  {
    echo "suite.sh ${names[*]}: commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC')"
    nproc; free -g | head -2; df -h /tmp | tail -1; nvidia-smi -L 2>&1 || echo "no nvidia-smi: no GPU"
  } > "$root/machine.txt"
  setup=${ZF_SETUP:-auto}
  if [ "$setup" = 1 ] || { [ "$setup" = auto ] && ls .whl/*.whl >/dev/null 2>&1; }; then
    source bench/gpu/setup.sh > "$root/setup.txt" 2>&1
    rc=$?
    echo "rc=$rc" >> "$root/setup.txt"
    if [ "$rc" != 0 ] && [ "$setup" = 1 ]; then
      echo "suite.sh: bench/gpu/setup.sh failed (rc=$rc), see $root/setup.txt" >&2; exit 1
    fi
  else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    echo "no setup (ZF_SETUP=$setup, .whl/*.whl: $(ls .whl/*.whl 2>/dev/null | wc -l)): this Python's packages," \
      "src/ on PYTHONPATH" > "$root/setup.txt"
  fi
  cat "$root/machine.txt"; tail -1 "$root/setup.txt"
fi

# --------------------------------------------------------------------------- the suites

zerofit_args() {   # the zerofit engine's arguments: "$@" plus --estimate when ESTIMATE=1
  local a="$*"
  [ "${ESTIMATE:-1}" = 1 ] && a="${a:+$a }--estimate"
  echo "$a"
}

suite_headline() {
  local peers=${HEADLINE_PEERS-deepspeed,fsdp2}
  zf_run w1_24 300 --workload W1 --engines "plain,zerofit${peers:+,$peers}" \
    --engine-args "zerofit=$(zerofit_args)" --steps 4 --fsdp2-steps 2 --cap 24GiB
  zf_trace w1_24
  zf_run w1_clip1 220 --workload W1 --engines plain,zerofit --engine-args 'plain=--clip 1.0' \
    --engine-args "zerofit=$(zerofit_args --clip 1.0)" --steps 5 --cap 24GiB
  zf_trace w1_clip1
  zf_run w1_8 220 --workload W1 --engines plain,zerofit --engine-args "zerofit=$(zerofit_args)" --steps 4 --cap 8GiB
  zf_trace w1_8
  zf_run w2_24 400 --workload W2 --engines "plain,zerofit${peers:+,$peers}" \
    --engine-args "zerofit=$(zerofit_args)" --steps 4 --fsdp2-steps 2 --cap 24GiB
  zf_trace w2_24
}

suite_ab() {
  if [ -z "$ab_repo" ] || [ ! -f "$ab_repo/bench/run.py" ]; then
    zf_skip ab "set ZF_REPO to the older tree, e.g. git archive OLD src bench | tar -x -C .whl/old_repo (carried)," \
      "and OLD_COMMIT to its id; ZF_REPO='$ab_repo' has no bench/run.py"
    return
  fi
  local old=${OLD_COMMIT:-old} run
  # the older tree's own scripts over its own src/ (engine_zerofit.py puts its repository's src/ first; the
  # Trainer's and generation's scripts get it on PYTHONPATH)
  local old_path="$ab_repo/src:${PYTHONPATH:-}"
  for run in ${AB:-w1_24 w1_clip1 w1_8 w2_24}; do
    local w=W1 cap=24GiB plain=(--engines plain,zerofit) zf=() t=220 steps=4 eng=zerofit
    case "$run" in
      w1_24) ;;
      w1_clip1) plain+=(--engine-args 'plain=--clip 1.0'); zf=(--engine-args 'zerofit=--clip 1.0'); steps=5 ;;
      w1_8) cap=8GiB ;;
      w2_24) w=W2; t=300 ;;
      w1_ds) eng=zerofit-ds; plain=(--engines zerofit-ds) ;;
      w2_ds) w=W2; t=300; eng=zerofit-ds; plain=(--engines zerofit-ds) ;;
      w2_trainer)
        zf_cmd w2_trainer_new 400 "$ZF_PYTHON" bench/trainer_bench.py --workload W2 --steps 5 --cap 24GiB \
          --out "$res/trainer_W2_new.json"
        PYTHONPATH=$old_path zf_cmd w2_trainer_old 400 "$ZF_PYTHON" "$ab_repo/bench/trainer_bench.py" \
          --workload W2 --steps 5 --cap 24GiB --out "$res/trainer_W2_old.json"
        continue ;;
      w4)
        zf_cmd w4_new 400 "$ZF_PYTHON" bench/infer.py --engines zerofit --caps 24GiB --batches 1,16 \
          --out "$res/w4_new" --commit "$commit" --timeout 250
        PYTHONPATH=$old_path zf_cmd w4_old 400 "$ZF_PYTHON" "$ab_repo/bench/infer.py" --engines zerofit \
          --caps 24GiB --batches 1,16 --out "$res/w4_old" --commit "$old" --timeout 250
        continue ;;
      w3b_24)
        fresh_nvme
        zf_run w3b_24_new 440 --workload W3 --engines zerofit \
          --engine-args "zerofit=--set max_host_memory=108GiB --nvme $NVME" --steps 3 --cap 24GiB
        zf_trace w3b_24_new
        fresh_nvme
        ZF_REPO=$ab_repo commit=$old zf_run w3b_24_old 440 --workload W3 --engines zerofit \
          --engine-args "zerofit=--set max_host_memory=108GiB --nvme $NVME" --steps 3 --cap 24GiB
        zf_trace w3b_24_old
        [ "$dry" = 1 ] || rm -rf "$NVME"
        continue ;;
      *) zf_skip "ab_$run" "no ab run '$run' (w1_24 w1_clip1 w1_8 w2_24 w1_ds w2_ds w2_trainer w4 w3b_24)"; continue ;;
    esac
    zf_run "${run}_new" $t --workload $w "${plain[@]}" "${zf[@]}" --steps $steps --cap $cap
    zf_trace "${run}_new"
    ZF_REPO=$ab_repo commit=$old zf_run "${run}_old" $t --workload $w --engines $eng "${zf[@]}" \
      --steps $steps --cap $cap
    zf_trace "${run}_old"
  done
}
suite_dsloop() {
  zf_run w1 240 --workload W1 --engines plain,zerofit,zerofit-ds,zerofit-dsw,zerofit-dsl,deepspeed --steps 4 \
    --cap 24GiB
  zf_trace w1 zerofit zerofit-ds
  zf_run w2 240 --workload W2 --engines zerofit,zerofit-ds,zerofit-dsw,zerofit-dsl --steps 4 --cap 24GiB
  zf_trace w2 zerofit zerofit-ds
}

suite_trainer() {
  zf_run w2 200 --workload W2 --engines zerofit --steps 5 --cap 24GiB
  zf_cmd trainer_w2 400 "$ZF_PYTHON" bench/trainer_bench.py --workload W2 --steps 5 --cap 24GiB \
    --out "$res/trainer_W2.json"
}

fresh_nvme() { [ "$dry" = 1 ] || { rm -rf "$NVME" && mkdir -p "$NVME/ds"; }; }

suite_disk() {
  [ "$dry" = 1 ] || df -h /tmp > "$res/df.txt"
  local run
  for run in ${DISK:-w3a w3b_24 w3b_8 peers}; do
    fresh_nvme
    case "$run" in
      w3a) zf_run w3a 400 --workload W2 --engines zerofit \
             --engine-args "zerofit=--set max_host_memory=32GiB --nvme $NVME --estimate" --steps 3 --cap 24GiB
           zf_trace w3a ;;
      w3b_24) zf_run w3b_24 440 --workload W3 --engines zerofit \
             --engine-args "zerofit=--set max_host_memory=108GiB --nvme $NVME --estimate" --steps 3 --cap 24GiB
           zf_trace w3b_24 ;;
      w3b_8) zf_run w3b_8 440 --workload W3-mb1 --engines zerofit \
             --engine-args "zerofit=--set max_host_memory=108GiB --nvme $NVME --estimate" --steps 3 --cap 8GiB
           zf_trace w3b_8 ;;
      peers) disk_peers ;;
      *) zf_skip "disk_$run" "no disk run '$run' (w3a w3b_24 w3b_8 peers)" ;;
    esac
  done
  [ "$dry" = 1 ] || { rm -rf "$NVME"; df -h /tmp >> "$res/df.txt"; }
}

disk_peers() {     # one engine at a time: the 64 GB disk cannot hold both engines' files
  local spec seen=" "
  for spec in ${DISK_PEERS:-W1:16GiB}; do
    local w=${spec%%:*} host=${spec#*:}
    if [[ "$seen" != *" $w "* ]]; then
      seen+="$w "
      fresh_nvme
      ( [ "$dry" = 1 ] || zf_aio > "$res/aio.txt" 2>&1
        zf_run "${w}_deepspeed" "${DS_TIMEOUT:-750}" --workload "$w" --engines deepspeed \
          --engine-args "deepspeed=--nvme $NVME/ds --warmup 0" --steps 1 --cap 24GiB )
      [ "$dry" = 1 ] || du -sh "$NVME" >> "$res/df.txt" 2>&1
    fi
    fresh_nvme
    zf_run "${w}_zerofit_$host" 500 --workload "$w" --engines zerofit \
      --engine-args "zerofit=--set max_host_memory=$host --nvme $NVME --estimate" --steps 3 --cap 24GiB
    zf_trace "${w}_zerofit_$host"
  done
}

suite_infer() {
  zf_cmd w4 900 "$ZF_PYTHON" bench/infer.py --caps 24GiB,8GiB --batches 1,16 --probe --accelerate-new-tokens 64 \
    --out "$res/w4" --commit "$commit" --timeout 250
  fresh_nvme
  zf_cmd w4_disk 300 "$ZF_PYTHON" bench/infer.py --engines zerofit --caps 8GiB --batches 1 --new-tokens 4 \
    --prefill-len 0 --max-host-memory 16GiB --nvme "$NVME" --out "$res/w4_disk" --commit "$commit" --timeout 200
  [ "$dry" = 1 ] || rm -rf "$NVME"
}

suite_ranks() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$dry" = 0 ] && [ "$n" -lt 2 ]; then
    zf_skip ranks "needs 2 GPUs (the nvidia-h200-x2 kind); nvidia-smi lists $n"
    return
  fi
  zf_tests rank_tests 400 tests/processes/test_ranks.py -k nccl
  zf_run w2_1gpu 200 --workload W2 --engines zerofit --steps 5 --cap 24GiB
  zf_run w2_2gpus 240 --workload W2 --engines zerofit --gpus 2 --steps 5 --cap 24GiB
  zf_trace w2_2gpus
  zf_run w5 300 --workload W5 --engines zerofit --gpus 2 --steps 4 --cap 24GiB
  zf_trace w5
  # the in-GPU ceiling on 2 GPUs: --cap applies to every engine of a run.py call, so FSDP2 gets its own
  zf_run w5_fsdp2 300 --workload W5 --engines fsdp2 --gpus 2 --fsdp2-steps 4 --cap none \
    --engine-args 'fsdp2=--no-offload'
  if [ "${RANKS_DS:-1}" = 1 ]; then     # the host's memory every 2 s beside it (MiB, free's Mem: line)
    local memlog=""
    if [ "$dry" = 0 ]; then
      (while true; do echo "$(date -u +%T) $(free -m | sed -n 2p)"; sleep 2; done) > "$res/w5_deepspeed_mem.log" 2>&1 &
      memlog=$!
    fi
    zf_run w5_deepspeed 560 --workload W5 --engines deepspeed --gpus 2 --steps 3 --cap 24GiB \
      --engine-args "deepspeed=${RANKS_DS_ARGS---no-offload-param}"
    [ -n "$memlog" ] && kill "$memlog"
    [ "$dry" = 1 ] || dmesg 2>&1 | tail -50 > "$res/w5_deepspeed_dmesg.txt"
  fi
}

suite_lora() {     # W6 (bench/WORKLOADS.md): about 15-25 min; run it detached, poll for $OUT/done
  if [ "$dry" = 0 ] && ! "$ZF_PYTHON" -c "import peft" >/dev/null 2>&1; then
    zf_skip lora "peft does not import here: put its wheel in .whl (pip download --no-deps peft==0.21.2 -d .whl;" \
      "pure Python) and carry .whl"
    return
  fi
  local run steps=${LORA_STEPS:-4}
  for run in ${LORA:-w6a w6b}; do
    case "$run" in
      # each engine its own timeout (below a device call's 600 s): plain ~1 min, zerofit a few, DeepSpeed's
      # ZeRO-3 moves the 26 GB base over PCIe per micro-batch pass
      w6a) zf_run w6a 360 --workload W6a --engines plain,zerofit,deepspeed --steps "$steps" --cap 24GiB \
             --engine-timeout plain=300 --engine-timeout deepspeed=540
           zf_trace w6a ;;
      w6b) zf_run w6b 360 --workload W6b --engines zerofit --steps "$steps" --cap 8GiB
           zf_trace w6b ;;
      # W6c: 70B QLoRA; needs bitsandbytes (its wheel in .whl: pip download --no-deps bitsandbytes -d .whl, 43 MB).
      # zerofit quantizes the base on the GPU as it builds it; plain is PEFT over bitsandbytes' Linear4bit in the GPU
      w6c) if [ "$dry" = 0 ] && ! "$ZF_PYTHON" -c "import bitsandbytes" >/dev/null 2>&1; then
             zf_skip lora_w6c "bitsandbytes does not import here: put its wheel in .whl and carry it"
           else
             zf_run w6c 580 --workload W6c --engines zerofit,plain --steps "$steps" --cap 24GiB \
               --engine-timeout zerofit=560 --engine-timeout plain=400
             zf_trace w6c
           fi ;;
      *) zf_skip "lora_$run" "no lora run '$run' (w6a w6b w6c)" ;;
    esac
  done
}

suite_userloop() {     # W7 (bench/WORKLOADS.md): FSDP1 with CPU offload is slow: one timed step
  zf_run w7 580 --workload W1 --engines plain,zerofit,zerofit-fsdp1-w4,zerofit-fsdp1,fsdp1,fsdp2 --steps 3 \
    --fsdp2-steps 2 --cap 24GiB --engine-args 'plain=--clip 1.0' --engine-args 'zerofit=--clip 1.0' \
    --engine-timeout fsdp1=300 --engine-timeout fsdp2=300
  zf_trace w7 zerofit-fsdp1-w4 zerofit-fsdp1
  zf_run w7_loops 580 --workload W1 --engines zerofit-accelerate-w4,zerofit-fabric-w4,fsdp1-fabric --steps 3 \
    --cap 24GiB --engine-timeout fsdp1-fabric=300
  zf_trace w7_loops zerofit-accelerate-w4 zerofit-fabric-w4
}

suite_longctx() {     # each 8B step at 128k is ~70 s on an H100: the runs take longer than a device call
  local seq steps
  for seq in 32768 65536 131072; do
    steps=3; [ "$seq" = 131072 ] && steps=2
    zf_run "l8_$((seq / 1024))k" 580 --workload L8 --seq "$seq" --engines zerofit,plain --steps "$steps" \
      --cap 24GiB --engine-args zerofit=--estimate --engine-timeout zerofit=540 --engine-timeout plain=240
  done
  zf_run l13_64k 580 --workload L13 --seq 65536 --engines zerofit,plain --steps 2 --cap 24GiB \
    --engine-args zerofit=--estimate --engine-timeout zerofit=540 --engine-timeout plain=240
  fresh_nvme
  zf_run l8full_32k 580 --workload L8-full --seq 32768 --engines zerofit --steps 2 --cap 24GiB \
    --engine-args "zerofit=--estimate --set max_host_memory=100GiB --nvme $NVME" --engine-timeout zerofit=580
  [ "$dry" = 1 ] || rm -rf "$NVME"
  zf_run l8_256k 900 --workload L8 --seq 262144 --engines zerofit --steps 2 --cap none --engine-timeout zerofit=900
}

suite_serve() {
  zf_cmd serve_13b 900 "$ZF_PYTHON" bench/serve.py --shape llama-2-13b --max-gpu-memory 24GiB --concurrency 1,16 \
    --out "$res/serve_13b.json"
  zf_cmd serve_13b_accelerate 900 "$ZF_PYTHON" bench/serve.py --shape llama-2-13b --max-gpu-memory 24GiB \
    --peer accelerate --concurrency 1,16 --out "$res/serve_13b_accelerate.json"
}

suite_nodes() {       # both layouts across simulated nodes on one host (docs/ranks.md)
  zf_run nodes_2x1 580 --workload W2 --engines zerofit --steps 4 --cap 24GiB --gpus 1 --nnodes 2
  zf_trace nodes_2x1
  zf_run nodes_2x1_full 580 --workload W2 --engines zerofit --steps 4 --cap 24GiB --gpus 1 --nnodes 2 \
    --engine-args 'zerofit=--set nodes_layout=full'
  zf_trace nodes_2x1_full
  zf_run nodes_1x2 580 --workload W2 --engines zerofit --steps 4 --cap 24GiB --gpus 2
  zf_run nodes_1x1 580 --workload W2 --engines zerofit --steps 4 --cap 24GiB
}

suite_kernels() {    # about 10 min on an H100; run it detached. KERNEL_RUNS: which (default w6a w1 w6c8 w1_old)
  [ "${KERNEL_TESTS:-1}" = 0 ] || zf_tests kernel_tests 600 tests/gpu/test_gpu_kernels.py
  local run
  for run in ${KERNEL_RUNS:-w6a w1 w6c8 w1_old}; do
    case "$run" in
      w6a) zf_run w6a_k 400 --workload W6a --engines zerofit-fast,plain,plain-liger,zerofit-exact --steps 4 \
             --cap 24GiB --engine-timeout plain=240 --engine-timeout plain-liger=240
           zf_trace w6a_k zerofit-fast zerofit-exact ;;
      w1) zf_run w1_k 300 --workload W1 --engines zerofit-fast,plain,plain-liger,zerofit-exact --steps 4 --cap 24GiB
          zf_trace w1_k zerofit-fast zerofit-exact ;;
      # zerofit's fast kernels and both in-GPU peers (without, with Liger-Kernel) in one call, exact path apart
      peers) zf_run w6a_peers 400 --workload W6a --engines zerofit-fast,plain,plain-liger --steps 4 --cap 24GiB \
               --engine-timeout plain=240 --engine-timeout plain-liger=240
             zf_trace w6a_peers zerofit-fast
             zf_run w1_peers 300 --workload W1 --engines zerofit-fast,plain,plain-liger --steps 4 --cap 24GiB
             zf_trace w1_peers zerofit-fast ;;
      # the peers with Liger-Kernel's kernels beside zerofit's fast ones
      liger) zf_run w6a_liger 400 --workload W6a --engines zerofit-fast,plain-liger --steps 4 --cap 24GiB \
               --engine-timeout plain-liger=240
             zf_run w1_liger 300 --workload W1 --engines zerofit-fast,plain-liger --steps 4 --cap 24GiB ;;
      w6c8) zf_run w6c8_k 300 --workload W6c8 --engines zerofit-fast,plain,zerofit-exact --steps 4 --cap 24GiB ;;
      # the exact path against an older tree's engine (which had no other): ZF_REPO, OLD_COMMIT
      w1_old) if [ -n "$ab_repo" ]; then
                ZF_REPO=$ab_repo commit=${OLD_COMMIT:-old} zf_run w1_old 300 --workload W1 --engines zerofit \
                  --steps 4 --cap 24GiB
              fi ;;
      *) zf_skip "kernels_$run" "no kernels run '$run' (w6a w1 peers liger w6c8 w1_old)" ;;
    esac
  done
}

suite_convergence() {
  local k s pids=()
  for k in exact fast; do
    for s in 1 2 3; do
      if [ "$dry" = 1 ]; then echo "  conv_${k}_$s: bench/convergence.py run --kernels $k --seed $s"; continue; fi
      "$ZF_PYTHON" bench/convergence.py run --kernels "$k" --seed "$s" --seq 512 --out "$res/conv_${k}_$s.json" \
        > "$res/conv_${k}_$s.txt" 2>&1 &
      pids+=($!)
    done
  done
  local p rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "conv_runs rc=$rc" >> "$res/exit_codes.txt"
  zf_cmd conv_summary 60 "$ZF_PYTHON" bench/convergence.py summary "$res"/conv_*.json --json "$res/summary.json"
}

suite_tests() {
  local whole=(tests/gpu/test_gpu.py tests/gpu/test_small_gpu_floor.py tests/unit/test_split_updates.py) ex=() f
  for f in "${whole[@]}"; do ex+=(--exclude "$f"); done
  local more
  mapfile -t more < <("$ZF_PYTHON" bench/gpu/gpu_tests.py "${ex[@]}")
  printf '%s\n' "${whole[@]}" "${more[@]}" > "$res/selected.txt"
  # shellcheck disable=SC2086
  zf_tests gpu_tests 1500 ${TESTS_ARGS:-} "${whole[@]}" "${more[@]}"
}

# --------------------------------------------------------------------------- run them

for s in "${names[@]}"; do
  res=$root/$s
  mkdir -p "$res"
  : > "$res/exit_codes.txt"
  echo "== $s: ${ABOUT[$s]}"
  "suite_$s"
  [ "$dry" = 1 ] || touch "$res/done"
done

[ "$dry" = 1 ] && exit 0
{
  echo "suite.sh ${names[*]}: commit $commit, ended $(date -u '+%Y-%m-%d %H:%M UTC')"
  for s in "${names[@]}"; do echo "== $s"; cat "$root/$s/exit_codes.txt"; done
} > "$root/summary.txt"
cat "$root/summary.txt"
[ "${ZF_TAR:-0}" = 1 ] && tar czf "$root.tgz" -C "$root" .
touch "$root/done"
! grep -E -q 'rc=[^0]|exit -?[1-9]|status (error|OOM|timeout)' "$root"/*/exit_codes.txt
