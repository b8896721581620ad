# Helpers of the detached bench/gpu_*.sh scripts; source it after setting `res` (the results folder) and `commit`.
#
#   zf_run NAME TIMEOUT ARGS...       python3 bench/run.py ARGS --timeout TIMEOUT --out $res/NAME --commit $commit;
#                                     its output in $res/NAME.txt, ending with rc=N. ZF_REPO (default: this tree)
#                                     runs another tree's bench/run.py (an earlier commit's src/ and bench/).
#   zf_trace NAME                     bench/trace.py --gaps on $res/NAME's result, appended to $res/NAME.txt
#   zf_tests NAME TIMEOUT FILES...    pytest on FILES; its output in $res/NAME.txt, ending with rc=N
zf_run() {
  local name=$1 timeout=$2; shift 2
  python3 "${ZF_REPO:-.}/bench/run.py" "$@" --timeout "$timeout" --out "$res/$name" --commit "$commit" \
    > "$res/$name.txt" 2>&1
  echo "rc=$?" >> "$res/$name.txt"
}
zf_trace() {
  local f
  for f in "$res/$1"/results_*.json; do
    python3 bench/trace.py "$f" --gaps >> "$res/$1.txt" 2>&1
  done
}
zf_tests() {
  local name=$1 timeout=$2; shift 2
  timeout "$timeout" python3 -m pytest -q -p no:cacheprovider "$@" > "$res/$name.txt" 2>&1
  echo "rc=$?" >> "$res/$name.txt"
}
