#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ (cargo-fuzz, libFuzzer) for a bounded time, one at a time.
#   ./hack/fuzz.sh                 each target for FUZZ_SECONDS (default 60)
#   ./hack/fuzz.sh checkpoint ...  only these targets
# Installs the nightly toolchain and cargo-fuzz when missing. The committed corpus in
# fuzz/corpus/<target>/ seeds each run but is not written to: new inputs go to
# fuzz/target/corpus/<target>/ (ignored by git), crashes to fuzz/artifacts/<target>/.
# A crash fails the script; add the input to fuzz/corpus/<target>/ once fixed, so that
# tests/it/fuzz_corpus.rs replays it in every test run.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked

targets=("$@")
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

# Debug assertions on: an arithmetic overflow in a decoder is a finding too.
cargo +nightly fuzz build -a

mkdir -p fuzz/target/logs
for t in "${targets[@]}"; do
  scratch="fuzz/target/corpus/$t"
  log="fuzz/target/logs/$t.log"
  mkdir -p "$scratch"
  echo "== fuzz $t (${seconds}s)"
  # -timeout: one input taking seconds is a denial of service, not a slow machine.
  rc=0
  cargo +nightly fuzz run -a "$t" "$scratch" "fuzz/corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"$log" 2>&1 || rc=$?
  grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$log" || true
  if ((rc != 0)); then
    tail -n 40 "$log" >&2
    echo "hack/fuzz.sh: $t failed (exit $rc); the input is in fuzz/artifacts/$t/, the log in $log" >&2
    exit 1
  fi
done
echo "hack/fuzz.sh: ${#targets[@]} targets ran ${seconds}s each without a failure"
