#!/usr/bin/env bash
# A scheduling change against the commit before it, in one call: tests/test_gpu.py, then W2 at 24 GiB (zerofit) with
# the working tree's src/, then with OLD_REPO's (the earlier commit's src/ and bench/, e.g. `git archive C src bench |
# tar -x -C .whl/old_repo`, carried: bench/engine_zerofit.py puts its own repository's src/ first), each followed by
# this tree's bench/trace.py --gaps. Detached:
#
#     OLD_REPO=.whl/old_repo setsid bash bench/gpu_ab.sh RESULTS COMMIT OLD_COMMIT </dev/null >/dev/null 2>&1 &
set -u
res=$1 commit=$2 old=$3
mkdir -p "$res"
source bench/gpu_setup.sh > "$res/setup.txt" 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py > "$res/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$res/gpu_tests.txt"
w2() {   # NAME COMMIT REPO
  python3 "$3/bench/run.py" --workload W2 --engines zerofit --steps 4 --cap 24GiB --timeout 150 --out "$res/$1" \
    --commit "$2" > "$res/$1.txt" 2>&1
  echo "rc=$?" >> "$res/$1.txt"
  python3 bench/trace.py "$res/$1/results_W2.json" --gaps >> "$res/$1.txt" 2>&1
}
w2 new "$commit" .
w2 old "$old" "$OLD_REPO"
touch "$res/done"
