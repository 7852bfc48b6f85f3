#!/usr/bin/env bash
# test_track.sh SRC_DIR WORK_DIR - scripts/track.py against stub tensorboardX / wandb modules
# (python3 -S: the standard library and the stubs only, whatever else is installed): every
# numeric field under train/ or eval/ at its step, acc[k] per k, W&B's increasing steps, --follow
# through a resumed run's rewrite of the log until the export appears, clear errors.
set -uo pipefail
SRC=${1:?src dir}; W=${2:?work dir}
T="$SRC/scripts/track.py"
rm -rf "$W" && mkdir -p "$W/stubs/tensorboardX" "$W/stubs/wandb" "$W/run" || exit 1
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
cat >"$W/stubs/tensorboardX/__init__.py" <<'PY'
import os
class SummaryWriter:
    def __init__(self, logdir):
        self.f = open(os.path.join(logdir, "scalars.txt"), "a")
    def add_scalar(self, tag, value, step):
        self.f.write(f"{tag} {step} {value:.6g}\n")
        self.f.flush()  # the test watches the file while --follow runs
    def flush(self):
        self.f.flush()
    def close(self):
        self.f.close()
PY
cat >"$W/stubs/wandb/__init__.py" <<'PY'
import json, os
class _Run:
    def __init__(self, project, name):
        self.f = open(os.environ["WANDB_STUB_OUT"], "a")
        self.f.write(json.dumps({"project": project, "name": name}) + "\n")
    def log(self, d, step):
        self.f.write(json.dumps({"step": step, **d}) + "\n")
    def finish(self):
        self.f.close()
def init(project=None, name=None, config=None):
    return _Run(project, name)
PY
L1='{"step":5,"epoch":0,"loss":6.48,"lr":0.003,"tau_hat":1.0,"mem_gib":-1.000,"acc":[0.1,0.2]}'
L2='{"step":10,"epoch":0,"loss":6.16,"lr":0.0029,"tau_hat":1.01,"acc":[0.3,0.4]}'
E1='{"step":10,"eval_rows":4,"eval_loss":5.94,"eval_tau_hat":1.07,"eval_tau_walk":1.03,"eval_acc":[0.03,0.04]}'
L3='{"step":15,"epoch":0,"loss":5.90,"lr":0.0028,"tau_hat":1.02,"acc":[0.5,0.6]}'
printf '%s\n%s\n%s\nnot json\n\n%s\n' "$L1" "$L2" "$E1" "$L3" >"$W/run/log.jsonl"
py() { PYTHONPATH="$W/stubs" python3 -S "$T" "$@"; }

# TensorBoard: every field at its step, eval under eval/, acc per k
mkdir -p "$W/tb"
py "$W/run" --tensorboard "$W/tb" >"$W/out" 2>&1 || fail "--tensorboard: exit $?"
grep -q "4 records" "$W/out" || fail "--tensorboard: want '4 records' ($(cat "$W/out"))"
for want in "train/loss 5 6.48" "train/acc_2 10 0.4" "train/mem_gib 5 -1" "eval/tau_walk 10 1.03" \
            "eval/loss 10 5.94" "eval/acc_1 10 0.03" "train/loss 15 5.9"; do
  grep -qx "$want" "$W/tb/scalars.txt" || fail "--tensorboard: no '$want'"
done
grep -q "^train/step \|^eval/step " "$W/tb/scalars.txt" && fail "--tensorboard: the step logged as a value"

# W&B: steps only increase (the eval of step 10 after the train line of step 10 is kept)
WANDB_STUB_OUT="$W/wb.jsonl" py "$W/run/log.jsonl" --wandb proj --name r1 >"$W/out" 2>&1 || fail "--wandb: exit $?"
python3 - "$W/wb.jsonl" <<'PY' || fail "--wandb: wrong records"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
assert recs[0] == {"project": "proj", "name": "r1"}, recs[0]
steps = [r["step"] for r in recs[1:]]
assert steps == [5, 10, 10, 15], steps
assert recs[3]["eval/tau_walk"] == 1.03 and recs[2]["train/acc_1"] == 0.3, recs
PY

# --follow: lines appended later, a resumed run's rewrite (a new file from step 10 on), then
# the export ends it
printf '%s\n' "$L1" >"$W/run/log.jsonl"
rm -f "$W/tb/scalars.txt"
py "$W/run" --tensorboard "$W/tb" --follow >"$W/outf" 2>&1 &
pid=$!
# seen N PATTERN: wait (up to 20 s) until scalars.txt holds N lines matching PATTERN
seen() { local n; for _ in $(seq 1 80); do n=$(grep -c "$2" "$W/tb/scalars.txt" 2>/dev/null); [ "${n:-0}" -ge "$1" ] && return 0; sleep 0.25; done
         fail "--follow: never saw $1 x '$2'"; return 1; }
seen 1 '^train/loss 5 '
printf '%s\n%s\n' "$L2" "$L3" >>"$W/run/log.jsonl"
seen 1 '^train/loss 15 '
printf '%s\n%s\n' "$L1" "$L2" >"$W/run/log.tmp" && mv "$W/run/log.tmp" "$W/run/log.jsonl"
seen 2 '^train/loss 10 '
printf '%s' "${L3%\}}" >>"$W/run/log.jsonl"   # half a line: waits for its end
sleep 1.5
[ "$(grep -c '^train/loss 15 ' "$W/tb/scalars.txt")" = 1 ] || fail "--follow: half a line was logged"
printf '}\n' >>"$W/run/log.jsonl"
seen 2 '^train/loss 15 '
mkdir -p "$W/run/export" && : >"$W/run/export/model.safetensors"
for _ in $(seq 1 20); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
if kill -0 $pid 2>/dev/null; then fail "--follow did not stop when the export appeared"; kill $pid; fi
wait $pid || fail "--follow: exit $?"
[ "$(grep -c '^train/loss 15 ' "$W/tb/scalars.txt")" = 2 ] || fail "--follow: step 15 not logged twice (before and after the rewrite)"
[ "$(grep -c '^train/loss 5 ' "$W/tb/scalars.txt")" = 2 ] || fail "--follow: the rewritten log not read again"

# errors: no backend, both, a missing log, a backend not installed (no stub on the path)
PYTHONPATH="$W/stubs" python3 -S "$T" "$W/run" >/dev/null 2>&1; [ $? = 2 ] || fail "no backend: want exit 2"
py "$W/run" --tensorboard "$W/tb" --wandb p >/dev/null 2>&1; [ $? = 2 ] || fail "both backends: want exit 2"
py "$W/nope" --tensorboard "$W/tb" >"$W/out" 2>&1; [ $? = 1 ] && grep -q "no such file" "$W/out" || fail "missing log"
python3 -S "$T" "$W/run" --wandb p >"$W/out" 2>&1; [ $? = 1 ] && grep -q "pip install wandb" "$W/out" ||
  fail "wandb missing: want exit 1 naming the package ($(cat "$W/out"))"
[ $fails = 0 ] && echo "test_track: ok" || { echo "test_track: $fails failure(s)"; exit 1; }
