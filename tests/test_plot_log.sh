#!/usr/bin/env bash
# test_plot_log.sh SRCDIR WORKDIR - scripts/plot_train_log.py on synthetic train logs: a log
# with a malformed line and a line missing tau_hat plots (exit 0, a non-trivial PNG or SVG),
# the built-in SVG renderer works without matplotlib, and empty / invalid logs and bad usage
# give the documented exit codes (0 ok, 1 bad input, 2 usage). Exits 77 without python3.
set -u
SRC=$1 W=$2
command -v python3 >/dev/null 2>&1 || { echo "SKIP: python3 not found"; exit 77; }
PLOT=$SRC/scripts/plot_train_log.py
rm -rf "$W" && mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# run CODE PATTERN cmd...: exit code must be CODE, stdout+stderr must match PATTERN
run() {
  local want=$1 pat=$2; shift 2
  "$@" >"$W/out" 2>&1
  local got=$?
  [ "$got" = "$want" ] || { fail "exit $got (want $want): $*"; sed 's/^/    /' "$W/out" | head -20 >&2; return; }
  [ -z "$pat" ] || grep -Eq -- "$pat" "$W/out" || { fail "output of '$*' lacks /$pat/"; sed 's/^/    /' "$W/out" | head -20 >&2; }
}

# check_image FILE: exists, > 1 KB; an SVG must hold <svg and parse as XML, a PNG its signature
check_image() {
  local f=$1 size
  [ -f "$f" ] || { fail "no output $f"; return; }
  size=$(wc -c <"$f")
  [ "$size" -gt 1024 ] || fail "$f is only $size bytes"
  case $f in
    *.svg)
      grep -q "<svg" "$f" || fail "$f lacks <svg"
      python3 -c 'import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])' "$f" ||
        fail "$f is not well-formed XML" ;;
    *.png)
      [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = "211PNG" ] || fail "$f is not a PNG" ;;
  esac
}

# A synthetic log like train.c's log_step writes: 40 steps, eval every 10, extra fields later,
# line 6 malformed (cut short), step 30 without tau_hat, step 35 with a C-printf "nan" loss.
mkdir -p "$W/run"
python3 - "$W/run/log.jsonl" <<'EOF'
import json, math, sys
with open(sys.argv[1], "w") as f:
    for i in range(1, 41):
        s = i * 5
        r = {"step": s, "epoch": s // 100, "loss": 6 * math.exp(-s / 60) + 2, "lr": 3e-4 * min(1, s / 50),
             "grad_norm": 1.5 + 0.1 * math.sin(s), "tau_hat": 1 + 2 * (1 - math.exp(-s / 80)),
             "tokens": s * 4096, "tokens_per_s": 330000 + 1000 * math.sin(s), "step_s": 0.0121,
             "acc": [round(0.8 * (1 - math.exp(-s / 70)) * 0.85 ** k, 4) for k in range(15)]}
        if s % 50 == 0:
            r["eval_loss"], r["eval_tau_hat"] = r["loss"] + 0.1, r["tau_hat"] - 0.1
        if s > 100:
            r["mfu"], r["mem_gib"] = 0.31, 40.0
        if s == 30:
            del r["tau_hat"]
        line = json.dumps(r)
        if s == 35:
            line = line.replace('"loss": %s' % json.dumps(r["loss"]), '"loss": nan')
        f.write(line + "\n")
        if s == 25:
            f.write('{"step": 27, "loss": 4.1, "acc": [0.1,\n')
EOF
[ "$(sed -n 6p "$W/run/log.jsonl" | head -c 12)" = '{"step": 27,' ] || fail "synthetic log: line 6 is not the malformed one"

# 1. default output next to the log: a PNG with matplotlib, else log.svg with a clear note
run 0 "line 6|:6:" python3 "$PLOT" "$W/run/log.jsonl" --title "synthetic run"
if [ -f "$W/run/log.png" ]; then
  check_image "$W/run/log.png"
else
  grep -q "matplotlib was not found" "$W/out" || fail "no PNG and no 'matplotlib was not found' note"
  grep -q "log.svg" "$W/out" || fail "the note does not name the SVG path"
  check_image "$W/run/log.svg"
fi

# 2. the built-in SVG renderer, whether or not matplotlib is installed
run 0 "wrote .*forced.svg" env DFLASH_PLOT_NO_MPL=1 python3 "$PLOT" "$W/run/log.jsonl" --out "$W/forced.png"
check_image "$W/forced.svg"
for want in loss tau_hat "acc\[k\]" "k=15" throughput step_s lr grad_norm mfu mem_gib; do
  grep -q "$want" "$W/forced.svg" || fail "forced.svg lacks '$want'"
done

# 3. the run directory as the argument, a single point, a record with only a step
run 0 "" env DFLASH_PLOT_NO_MPL=1 python3 "$PLOT" "$W/run" --out "$W/dir.svg"
check_image "$W/dir.svg"
echo '{"step":1,"loss":9.5,"acc":[0.1,0.05]}' >"$W/one.jsonl"
run 0 "" env DFLASH_PLOT_NO_MPL=1 python3 "$PLOT" "$W/one.jsonl" --out "$W/one.svg"
check_image "$W/one.svg"
printf '\n{"step":3}\n\n' >"$W/bare.jsonl"
run 0 "" env DFLASH_PLOT_NO_MPL=1 python3 "$PLOT" "$W/bare.jsonl" --out "$W/bare.svg"
check_image "$W/bare.svg"

# 4. bad input: exit 1 with a clear error
: >"$W/empty.jsonl"
run 1 "empty" python3 "$PLOT" "$W/empty.jsonl"
printf '\n  \n' >"$W/blank.jsonl"
run 1 "empty" python3 "$PLOT" "$W/blank.jsonl"
printf 'not json\n[1,2]\n{"loss":1.0}\n' >"$W/junk.jsonl"
run 1 "no valid log records" python3 "$PLOT" "$W/junk.jsonl"
grep -q "junk.jsonl:3" "$W/out" || fail "no warning naming line 3 of junk.jsonl"
run 1 "cannot read" python3 "$PLOT" "$W/missing.jsonl"
{ [ -e "$W/log.png" ] || [ -e "$W/log.svg" ]; } && fail "an image was written for a bad log"

# 5. bad usage: exit 2
run 2 "usage" python3 "$PLOT"
run 2 "usage" python3 "$PLOT" "$W/run/log.jsonl" --no-such-flag
run 2 "extension" python3 "$PLOT" "$W/run/log.jsonl" --out "$W/x.jpg"

if [ "$fails" -ne 0 ]; then
  echo "test_plot_log: $fails failure(s)"
  exit 1
fi
echo "test_plot_log: all passed"
