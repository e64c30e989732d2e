#!/usr/bin/env bash
# Hunts flaky tests: runs one integration test binary's tests (a module, a name filter) many
# times under CPU load, and reports each failure with its seed and its log.
#
#   hack/flake-hunt.sh [-n RUNS] [-l LOAD] [-t it|lab] FILTER [FILTER...]
#     -n RUNS   how many times to run the filtered tests (default 20)
#     -l LOAD   busy processes beside them (default: the number of CPUs, so the tests get about
#               half the machine, as on a loaded CI runner); 0 runs them on a quiet machine
#     -t TEST   the integration test binary: it (default) or lab
#     FILTER    libtest filters, e.g. `dra_shares` (a module) or `controller::preemption`
#
# Each run gets its own seed in GPUPLANE_TEST_SEED (tests that draw random choices read it and
# print it), and its whole output goes to target/flake-hunt/<time>/run-<n>.log. A failure is
# reported as `run 7 (GPUPLANE_TEST_SEED=...): FAILED <test names>` with its log; re-run one with
#   GPUPLANE_TEST_SEED=<seed> cargo test --profile ci --features gpuplane/crashpoints,gpuplane/demo \
#     --test it -- --exact <test name>
# Exits 1 when any run failed, so it can gate a change that claims to fix a race.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=20
load="$(nproc)"
test_bin=it
while getopts "n:l:t:h" opt; do
  case "$opt" in
    n) runs="$OPTARG" ;;
    l) load="$OPTARG" ;;
    t) test_bin="$OPTARG" ;;
    *) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if (($# == 0)); then
  echo "hack/flake-hunt.sh: name the tests to hunt (a module or a name filter); -h for help" >&2
  exit 2
fi
case "$test_bin" in
  it | lab) ;;
  *) echo "hack/flake-hunt.sh: -t must be it or lab, not $test_bin" >&2; exit 2 ;;
esac
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "hack/flake-hunt.sh: -n must be a positive count" >&2; exit 2; }
[[ "$load" =~ ^[0-9]+$ ]] || { echo "hack/flake-hunt.sh: -l must be a count" >&2; exit 2; }

features="gpuplane/crashpoints,gpuplane/demo"
target_dir="${CARGO_TARGET_DIR:-target}"
# Built once, with the profile and features hack/test.sh uses; the path is cargo's own report.
exe="$(cargo test --profile ci --features "$features" --test "$test_bin" --no-run \
  --message-format=json-render-diagnostics |
  grep '"reason":"compiler-artifact"' | grep '"kind":\["test"\]' | grep "\"name\":\"$test_bin\"" |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)"
if [[ -z "$exe" || ! -x "$exe" ]]; then
  echo "hack/flake-hunt.sh: cargo reported no executable for --test $test_bin" >&2
  exit 1
fi

out="$target_dir/flake-hunt/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"

load_pids=()
stop_load() {
  if ((${#load_pids[@]})); then
    kill "${load_pids[@]}" 2>/dev/null || true
    wait "${load_pids[@]}" 2>/dev/null || true
  fi
}
trap stop_load EXIT
for ((i = 0; i < load; i++)); do
  # A busy loop in a shell of its own: load on a CPU, no memory, no files.
  bash -c 'while :; do :; done' &
  load_pids+=("$!")
done

echo "== $runs run(s) of --test $test_bin -- $* beside $load busy process(es); logs in $out"
base_seed="$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')"
failed_runs=0
for ((run = 1; run <= runs; run++)); do
  seed=$((base_seed + run))
  log="$out/run-$run.log"
  # The test binary runs from the package root, as `cargo test` runs it.
  if GPUPLANE_TEST_SEED="$seed" RUST_BACKTRACE=1 "$exe" "$@" >"$log" 2>&1; then
    passed="$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' "$log" | tail -1)"
    if [[ "${passed:-0}" == 0 ]]; then
      echo "hack/flake-hunt.sh: the filter $* matched no test" >&2
      exit 2
    fi
    echo "run $run (GPUPLANE_TEST_SEED=$seed): ok, $passed passed"
  else
    failed_runs=$((failed_runs + 1))
    names="$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$log" | tr '\n' ' ')"
    echo "run $run (GPUPLANE_TEST_SEED=$seed): FAILED ${names:-(the binary failed; see the log)}"
    echo "  log: $log"
  fi
done
echo "== $failed_runs of $runs run(s) failed"
((failed_runs == 0))
