#!/usr/bin/env bash
# bench-io.sh - our I/O engine against dd, on one file system, in one run.
#
#   scripts/bench-io.sh [DIR] [SIZE_MiB]      (defaults: ./out/bench-io 2048)
#   env: BENCH_IO=path/to/bench_io (default: build/tools/bench_io, then PATH)
#        REPEATS=3  BS_MIB=4  QD=16
#
# dd is the reference everyone has: O_DIRECT, bs=4M, one request at a time.
#   write: dd if=<random file already in page cache> oflag=direct conv=fsync
#          (random, not /dev/zero: some storage special-cases zeros; the
#          source is cached so reading it costs nothing; fsync counted)
#   read:  dd iflag=direct of=/dev/null
# bench_io writes (O_TRUNC, fsync counted, like dd) and reads (O_DIRECT) the
# same amount with BS_MIB x QD in flight, on io_uring and on the thread pool.
# Every number is the median of REPEATS runs; dd and bench_io alternate. Files are removed at the end.
set -euo pipefail

DIR=${1:-./out/bench-io}
SIZE_MIB=${2:-2048}
REPEATS=${REPEATS:-3}
BS_MIB=${BS_MIB:-4}
QD=${QD:-16}
here=$(cd "$(dirname "$0")/.." && pwd)
BENCH=${BENCH_IO:-}
if [[ -z $BENCH ]]; then
  if [[ -x $here/build/tools/bench_io ]]; then BENCH=$here/build/tools/bench_io
  else BENCH=$(command -v bench_io || true); fi
fi
[[ -n $BENCH && -x $BENCH ]] || { echo "bench-io.sh: bench_io not found; set BENCH_IO=" >&2; exit 2; }
(( SIZE_MIB % BS_MIB == 0 )) || { echo "bench-io.sh: SIZE_MiB must be a multiple of BS_MIB" >&2; exit 2; }

mkdir -p "$DIR"
src=$DIR/src.rand
dd_file=$DIR/dd.dat
ours=$DIR/bench_io.dat
cleanup() { rm -f "$src" "$dd_file" "$ours"; }
trap cleanup EXIT

need=$(( SIZE_MIB * 3 / 1024 + 1 ))
avail=$(df -Pk "$DIR" | awk 'NR==2 {print int($4 / 1048576)}')
(( avail > need )) || { echo "bench-io.sh: $DIR has ${avail} GiB free, needs ~${need}" >&2; exit 2; }

bytes=$(( SIZE_MIB * 1048576 ))
count=$(( SIZE_MIB / BS_MIB ))

# GB/s (1e9 bytes/s) of one command.
timed() {
  local t0 t1
  t0=$(date +%s.%N)
  "$@"
  t1=$(date +%s.%N)
  awk -v b="$bytes" -v a="$t0" -v z="$t1" 'BEGIN { printf "%.3f\n", b / (z - a) / 1e9 }'
}
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "preparing ${SIZE_MIB} MiB of random data in page cache..." >&2
head -c "$bytes" /dev/urandom > "$src"
sync "$src"   # no dirty pages left to be flushed during the timed runs
cat "$src" > /dev/null

# Repeats interleave dd and bench_io so that drift in a shared disk's speed
# hits both sides alike.
field() { # json backend key
  grep "\"backend\":\"$2\"" <<<"$1" | sed -n "s/.*\"$3\":\([0-9.]*\).*/\1/p"
}
ddw=() ddr=() uw=() ur=() tw=() tr=()
for (( i = 0; i < REPEATS; i++ )); do
  ddw+=( "$(timed dd if="$src" of="$dd_file" bs=${BS_MIB}M count=$count oflag=direct conv=fsync status=none)" )
  ddr+=( "$(timed dd if="$dd_file" of=/dev/null bs=${BS_MIB}M count=$count iflag=direct status=none)" )
  rm -f "$dd_file"
  json=$("$BENCH" --file "$ours" --size "${SIZE_MIB}M" --bs "${BS_MIB}M" --qd "$QD" \
          --repeats 1 --backend both --json | grep '^{')
  uw+=( "$(field "$json" io_uring write_gbps)" ) ur+=( "$(field "$json" io_uring read_gbps)" )
  tw+=( "$(field "$json" threads write_gbps)" ) tr+=( "$(field "$json" threads read_gbps)" )
done
dw=$(median "${ddw[@]}") dr=$(median "${ddr[@]}")
muw=$(median "${uw[@]}") mur=$(median "${ur[@]}") mtw=$(median "${tw[@]}") mtr=$(median "${tr[@]}")
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }'; }

cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
echo
echo "machine: ${cpu:-unknown CPU}, $(nproc) cores, kernel $(uname -r)"
df -hT "$DIR" | sed 's/^/  /'
echo "size ${SIZE_MIB} MiB, ${BS_MIB} MiB requests; dd QD1, bench_io QD${QD}; median of ${REPEATS}; GB/s = 1e9 B/s"
echo "runs (GB/s)  dd: write ${ddw[*]} read ${ddr[*]}"
echo "       io_uring: write ${uw[*]} read ${ur[*]}"
echo "        threads: write ${tw[*]} read ${tr[*]}"
echo
printf '%-12s %10s %10s %10s %12s %12s\n' op dd io_uring threads uring/dd threads/dd
printf '%-12s %10s %10s %10s %12s %12s\n' write+fsync "$dw" "$muw" "$mtw" "$(ratio "$muw" "$dw")" "$(ratio "$mtw" "$dw")"
printf '%-12s %10s %10s %10s %12s %12s\n' read "$dr" "$mur" "$mtr" "$(ratio "$mur" "$dr")" "$(ratio "$mtr" "$dr")"
