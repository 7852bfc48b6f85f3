#!/usr/bin/env bash
# bench-storage.sh [DIR] [SIZE_MiB] - the cache's storage path in one run, on one file system:
#
#  1. dd with O_DIRECT (4 MiB, write with fsync, read) of SIZE_MiB: the reference;
#  2. cache write through the real writer (`dflash cache synth`: records, CRCs, io_uring,
#     O_DIRECT, shard rotation, fsync + index + rename): codec `stored` (the pipeline's own cost)
#     and `split-zstd` (what extraction will write);
#  3. cache read through the streaming reader (`dflash cache read`: io_uring, CRC checks,
#     decode into slots), in a shuffled epoch order;
#  4. the codecs (`bench_codec`): ratio and encode/decode GB/s per core on synthetic
#     hidden-state-like bf16 (cache/synth.h says how it is made), hidden 5120.
# The cache has the Qwen3.6-27B extraction shape: hidden 5120, 5 feature layers of 64,
# samples of 256..1024 tokens. Medians of REPEATS (default 3); dd and ours alternate.
# GB/s = 1e9 bytes/s of FILE bytes unless marked raw. Files are removed at the end.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/out/bench-storage}
SIZE_MIB=${2:-2048}
REPEATS=${REPEATS:-3}
BUILD=${DFLASH_BUILD_DIR:-$ROOT/build}
D=$BUILD/dflash
BC=$BUILD/tools/bench_codec
[ -x "$D" ] && [ -x "$BC" ] || { echo "bench-storage.sh: build first (cmake --build $BUILD)" >&2; exit 2; }
mkdir -p "$DIR"
src=$DIR/src.rand dd_file=$DIR/dd.dat
trap 'rm -rf "$src" "$dd_file" "$DIR"/cache-*' EXIT

bytes=$((SIZE_MIB * 1048576))
HID=5120 NL=5 TMIN=256 TMAX=1024
samples=$((bytes / ((TMIN + TMAX) / 2 * HID * 2 * NL) + 1))

gbps() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.3f", b / s / 1e9 }'; }
timed() { local t0 t1; t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N); gbps "$bytes" "$(awk -v a="$t0" -v z="$t1" 'BEGIN{print z-a}')"; }
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
jget() { sed -n "s/.*\"$2\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

echo "preparing ${SIZE_MIB} MiB of random data in page cache for dd..." >&2
head -c "$bytes" /dev/urandom >"$src"; sync "$src"; cat "$src" >/dev/null

ddw=() ddr=() sw=() sr=() zw=() zr=() zraw=() zratio=()
for ((i = 0; i < REPEATS; i++)); do
  ddw+=("$(timed dd if="$src" of="$dd_file" bs=4M count=$((SIZE_MIB / 4)) oflag=direct conv=fsync status=none)")
  ddr+=("$(timed dd if="$dd_file" of=/dev/null bs=4M iflag=direct status=none)")
  rm -f "$dd_file"
  for codec in stored split-zstd; do
    c=$DIR/cache-$codec
    rm -rf "$c"
    w=$("$D" cache synth --out "$c" --samples "$samples" --hidden $HID --target-layers 64 --layers $NL \
         --min-tokens $TMIN --max-tokens $TMAX --codec $codec --seed $((i + 1)) --json)
    r=$("$D" cache read "$c" --shuffle $i --json)
    wg=$(gbps "$(jget "$w" file_bytes)" "$(jget "$w" seconds)")
    if [ $codec = stored ]; then
      sw+=("$wg") sr+=("$(jget "$r" file_GBps)")
    else
      zw+=("$wg") zr+=("$(jget "$r" file_GBps)") zraw+=("$(jget "$r" raw_GBps)") zratio+=("$(jget "$w" ratio)")
    fi
    io=$(jget "$r" io)
    rm -rf "$c"
  done
done
Dw=$(median "${ddw[@]}") Dr=$(median "${ddr[@]}")
Sw=$(median "${sw[@]}") Sr=$(median "${sr[@]}")
Zw=$(median "${zw[@]}") Zr=$(median "${zr[@]}") Zraw=$(median "${zraw[@]}") Zq=$(median "${zratio[@]}")

echo
echo "== codecs (bench_codec: synthetic bf16, hidden $HID, 1 MiB blocks, one core)"
"$BC" --hidden $HID --repeats 5 || echo "(bench_codec failed)"

cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
echo
echo "== storage: ${cpu:-unknown CPU}, $(nproc) cores, kernel $(uname -r), io: ${io:-?}"
df -hT "$DIR" | sed 's/^/  /'
echo "size ~${SIZE_MIB} MiB per run ($samples samples x $NL layers x $HID, $TMIN..$TMAX tokens), median of $REPEATS"
echo "runs: dd w ${ddw[*]} r ${ddr[*]} | stored w ${sw[*]} r ${sr[*]} | split-zstd w ${zw[*]} r ${zr[*]}"
printf '%-34s %9s %9s %9s\n' "" "GB/s" "vs dd" ""
printf '%-34s %9s %9s\n' "dd O_DIRECT write+fsync" "$Dw" "1.00"
printf '%-34s %9s %9s\n' "cache write, stored (file bytes)" "$Sw" "$(ratio "$Sw" "$Dw")"
printf '%-34s %9s %9s   ratio %s; raw rate %s GB/s\n' "cache write, split-zstd (file)" "$Zw" "$(ratio "$Zw" "$Dw")" "$Zq" "$(awk -v a="$Zw" -v q="$Zq" 'BEGIN{printf "%.3f", a/q}')"
printf '%-34s %9s %9s\n' "dd O_DIRECT read" "$Dr" "1.00"
printf '%-34s %9s %9s\n' "cache read, stored (file bytes)" "$Sr" "$(ratio "$Sr" "$Dr")"
printf '%-34s %9s %9s   decoded (raw) %s GB/s\n' "cache read, split-zstd (file)" "$Zr" "$(ratio "$Zr" "$Dr")" "$Zraw"
