#!/usr/bin/env bash
# The fine-tuning job of bench/finetune.py on the GPU machine, in two parts (each under a device call's 10 minutes):
#   bash bench/finetune_run.sh part1 W2 /tmp/ft $OUT   # model directory + text; run A (4 steps, export);
#                                                      # run B (2 steps, checkpoint at step 2)
#   bash bench/finetune_run.sh part2 W2 /tmp/ft $OUT   # page cache dropped; run B resumed to step 4 (export);
#                                                      # compare A and B: losses and exported weights bitwise
# The schedule is constant (config.json from bench/finetune.py), so a run of 2 steps then a resume to 4 does
# the same steps as run A. Every run is `zerofit train` as a user types it; exit codes are printed.
set -u
part=$1 w=$2 dir=$3 out=$4
args=(--model "$dir/model" --data "$dir/data" --config "$dir/config.json" --max-gpu-memory 24GiB --seq-len 2048
      --eval-size 4 --eval-windows 4 --no-progress --deterministic)
zf() { python3 -m zerofit.cli "$@"; }
if [ "$part" = part1 ]; then
  nproc; free -g | head -2; df -h "$(dirname "$dir")" | tail -1
  [ -n "${SKIP_DOCTOR:-}" ] || { zf doctor --disk "$(dirname "$dir")" --json > "$out/doctor.json"; echo "doctor rc=$?"; }
  python3 bench/finetune.py prepare --workload "$w" --dir "$dir" --data-bytes 3000000 2>/dev/null | tail -1 \
    | tee "$out/prepare.json"
  zf train "${args[@]}" --output "$dir/A" --steps 4 --no-save-at-end > "$out/A.log" 2>&1; echo "run A rc=$?"
  zf train "${args[@]}" --output "$dir/B" --steps 2 --no-export > "$out/B.log" 2>&1; echo "run B rc=$?"
  du -sh "$dir"/model "$dir"/A/model "$dir"/B/checkpoints/*; df -h "$(dirname "$dir")" | tail -1
  grep -h -E "saved|checkpoint_seconds" "$out/B.log" "$dir/B/metrics.jsonl" | tail -3
else
  sync; echo 3 > /proc/sys/vm/drop_caches
  zf train "${args[@]}" --output "$dir/B" --steps 4 --resume --no-save-at-end > "$out/C.log" 2>&1; echo "run C rc=$?"
  python3 bench/finetune.py compare --straight "$dir/A" --resumed "$dir/B" --model "$dir/model" \
    --data "$dir/data" --json "$out/compare.json" 2>/dev/null | tail -20; echo "compare rc=$?"
  cp "$dir/A/metrics.jsonl" "$out/A_metrics.jsonl"; cp "$dir/B/metrics.jsonl" "$out/B_metrics.jsonl"
fi
for f in "$out"/*.log; do echo "== $f"; grep -v -E "^\s*$" "$f" | tail -14; done
