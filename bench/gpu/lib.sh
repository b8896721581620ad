# Helpers of bench/gpu/suite.sh. Source it after setting `res` (the suite's folder, absolute) and `commit`.
#
#   zf_run NAME TIMEOUT ARGS...      $ZF_PYTHON bench/run.py ARGS --timeout TIMEOUT --out $res/NAME --commit $commit
#                                    (TIMEOUT: seconds per engine, run.py's own --timeout). ZF_REPO (default: this
#                                    tree) runs another tree's bench/run.py: an earlier commit's src/ and bench/.
#                                    After it, each engine's status and exit code from the results JSON.
#   zf_trace NAME [ENGINE...]        bench/trace.py --gaps on $res/NAME's results (default engine zerofit), into
#                                    $res/NAME_trace.txt
#   zf_tests NAME TIMEOUT ARGS...    pytest ARGS under `timeout TIMEOUT`
#   zf_cmd NAME TIMEOUT CMD...       any command under `timeout TIMEOUT`
#   zf_skip NAME WHY...              a step that could not run (recorded as rc=2)
#   zf_job_start BODY                a detached job (the *_job.sh scripts): BODY's runs under setsid from /tmp/run;
#                                    the scripts' own `run` verb runs their runs inside one, so one job can chain
#                                    several scripts' runs: zf_job_start 'bash bench/gpu/grpo_job.sh run; ...'
#   zf_job_main RUNS VERB [SECONDS]  a *_job.sh script's verbs over its RUNS: start (zf_job_start), run (inside a
#                                    job already started), poll (zf_job_poll)
#   zf_job_poll SECONDS              a detached job's poll (the *_job.sh scripts): wait up to SECONDS for /tmp/run_out/done
#                                    to say "all", show where it stands, pack /tmp/run_out into $OUT/all.tgz
#
# Each writes its output to $res/NAME.txt, ending with "rc=N", and appends "NAME rc=N (S s)" to
# $res/exit_codes.txt. ZF_DRY=1: each writes its command there instead of running it (rc=dry).

ZF_PYTHON=${ZF_PYTHON:-python3}

_zf_record() {     # NAME RC START
  local took=$(( $(date +%s) - $3 ))
  echo "rc=$2" >> "$res/$1.txt"
  printf '%-28s rc=%s (%s s)\n' "$1" "$2" "$took" >> "$res/exit_codes.txt"
}

_zf_shown() {      # ARGS... as a shell line (arguments with spaces or quotes in single quotes)
  local a q="'" out=""
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=" $a"; else out+=" '${a//$q/$q\\$q$q}'"; fi
  done
  echo "${out# }"
}

_zf_exec() {       # NAME CMD...: run (or, with ZF_DRY=1, show) CMD with its output in $res/NAME.txt
  local name=$1 start line; shift
  start=$(date +%s) line=$(_zf_shown "$@")
  printf '$ %s\n' "$line" > "$res/$name.txt"
  if [ "${ZF_DRY:-0}" = 1 ]; then
    echo "  $name: $line"
    _zf_record "$name" dry "$start"
    return 0
  fi
  echo "$(date -u +%H:%M:%S) $name: $line"
  "$@" >> "$res/$name.txt" 2>&1
  _zf_record "$name" $? "$start"
}

zf_run() {
  local name=$1 timeout=$2; shift 2
  _zf_exec "$name" "$ZF_PYTHON" "${ZF_REPO:-.}/bench/run.py" "$@" --timeout "$timeout" --out "$res/$name" \
    --commit "$commit"
  [ "${ZF_DRY:-0}" = 1 ] && return 0
  local f
  for f in "$res/$name"/results_*.json; do
    [ -f "$f" ] || continue
    "$ZF_PYTHON" - "$f" "$name" >> "$res/exit_codes.txt" 2>&1 <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc.get("results", []):
    print(f"  {sys.argv[2]}/{r.get('engine')}: status {r.get('status')}, exit {r.get('returncode')}"
          + (f", {r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else "")
          + (f": {r['error'][:160]}" if r.get("status") != "ok" and r.get("error") else ""))
PY
  done
}

zf_trace() {
  local name=$1 f e; shift
  [ "${ZF_DRY:-0}" = 1 ] && return 0
  for f in "$res/$name"/results_*.json; do
    [ -f "$f" ] || continue
    for e in "${@:-zerofit}"; do
      echo "== bench/trace.py $f --engine $e --gaps" >> "$res/${name}_trace.txt"
      "$ZF_PYTHON" bench/trace.py "$f" --engine "$e" --gaps >> "$res/${name}_trace.txt" 2>&1 \
        || echo "  $name trace ($e): rc=$?" >> "$res/exit_codes.txt"
    done
  done
}

zf_tests() {
  local name=$1 timeout=$2; shift 2
  _zf_exec "$name" timeout "$timeout" "$ZF_PYTHON" -m pytest -rfEs -p no:cacheprovider "$@"   # -q from pyproject.toml
}

zf_cmd() {
  local name=$1 timeout=$2; shift 2
  _zf_exec "$name" timeout "$timeout" "$@"
}

zf_skip() {
  local name=$1; shift
  echo "not run: $*" > "$res/$name.txt"
  echo "  $name: not run: $*"
  _zf_record "$name" 2 "$(date +%s)"
}

zf_aio() {         # libaio for DeepSpeed's async_io op (ZeRO-Infinity), unpacked from .whl/aio/*.deb
  if ! ls .whl/aio/*.deb >/dev/null 2>&1; then
    echo "zf_aio: no .whl/aio/*.deb (bench/gpu/peer-wheels.sh fetches them): DeepSpeed's NVMe offload will not build"
    return 0
  fi
  mkdir -p /tmp/aio && for f in .whl/aio/*.deb; do dpkg -x "$f" /tmp/aio; done
  local lib=/tmp/aio/usr/lib/x86_64-linux-gnu
  export CPATH=/tmp/aio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
         CFLAGS=-I/tmp/aio/usr/include LDFLAGS=-L$lib
}

zf_job_start() {   # BODY: a detached job's runs (bash, single-quoted by the caller), run under setsid from a copy of
  # the tree in /tmp/run (a device call lays the tree anew), with $o (/tmp/run_out), $commit (COMMIT), `stamp NAME RC`
  # (a line in $o/done) and `bench NAME ARGS...` (bench/run.py into $o/NAME, its log $o/NAME.log) defined; the wheels
  # installed in /tmp/site first. zf_job_poll reads what it writes.
  rm -rf /tmp/run /tmp/run_out && cp -r . /tmp/run && mkdir -p /tmp/run_out
  cd /tmp/run || return 1
  setsid bash -c "
    export PYTHONPATH=/tmp/site:/tmp/run/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    o=/tmp/run_out commit=${COMMIT:-unknown}
    stamp() { echo \"\$1 rc=\$2 \$(date -u +%H:%M:%S)\" >> \$o/done; }
    bench() { local name=\$1; shift; python3 bench/run.py --commit \$commit --out \$o/\$name \"\$@\" > \$o/\$name.log 2>&1
      stamp \$name \$?; }
    export o commit; export -f stamp bench
    echo \$commit > \$o/commit
    $1
    echo all >> \$o/done
  " > /dev/null 2>&1 < /dev/null &
  echo started
}

zf_job_main() {    # RUNS VERB [SECONDS]
  case "$2" in
  start) zf_job_start "$1";;
  run) eval "$1";;  # inside a job zf_job_start started ($o, stamp and bench defined)
  poll) zf_job_poll "${3:-500}";;
  *) echo "usage: $0 start|run|poll [SECONDS]" >&2; return 2;;
  esac
}

zf_job_poll() {
  local end=$((SECONDS + ${1:-500}))
  while [ $SECONDS -lt $end ] && ! grep -q '^all' /tmp/run_out/done 2>/dev/null; do sleep 5; done
  cat /tmp/run_out/done 2>/dev/null; cat /tmp/run_out/*/exit_codes.txt 2>/dev/null; tail -n 4 /tmp/run_out/*.log
  free -g | head -2; df -h /tmp | tail -1; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  (cd /tmp/run_out && tar czf "$OUT/all.tgz" --exclude='*.prof' .)
}
