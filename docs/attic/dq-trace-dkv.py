# dq-trace-dkv.py - reads docs/attic/dq-trace.patch's records (session 14):
# the context dK/dV pass: per-CTA prologue / loop / epilogue, per-item loop time and SM busy fraction, per traced launch.
# Usage: python3 dq-trace-dkv.py [trace dir, default /tmp/tr]
import glob, re, sys, array, statistics as st
DIR = sys.argv[1] if len(sys.argv) > 1 else '/tmp/tr'
def load(f):
    a=array.array('I'); a.frombytes(open(f,'rb').read())
    return [a[i:i+16] for i in range(0,len(a),16)]
def cfg(f):
    return int(re.findall(r'_(\d+)_W',f)[0]), int(re.findall(r'_W(\d+)',f)[0])
fs=sorted(glob.glob(DIR + '/t_dkv_*.bin'), key=lambda f:cfg(f))
for f in fs:
    n,W=cfg(f)
    recs=load(f)
    g0=[r[10]|(r[11]<<32) for r in recs]; g1=[r[12]|(r[13]<<32) for r in recs]
    T0=min(g0); T1=max(g1)
    tot_items=sum((r[1]-(r[14]&255)+1)//2 for r in recs)
    cyc=sum(r[6] for r in recs); ns=sum(b-a for a,b in zip(g0,g1)); ghz=cyc/ns
    pro=[r[3]/ghz/1e3 for r in recs]; loop=[(r[4]-r[3])/ghz/1e3 for r in recs]; ep=[(r[6]-r[4])/ghz/1e3 for r in recs]
    dur=[(b-a)/1e3 for a,b in zip(g0,g1)]
    # SM utilisation: 1 CTA per SM; 132 SMs
    busy=sum(dur)*1e3
    starts=sorted((a-T0)/1e3 for a in g0)
    nits=[(r[1]-(r[14]&255)+1)//2 for r in recs]
    per_item=sum(loop)/max(1,sum(nits))
    print("dkv #%d W%d span %.1f us, CTAs %d, items %d, CTA us mean %.1f max %.1f; prologue %.2f loop %.1f epilogue %.2f; loop us/item %.3f; busy/(span*132) %.3f; last start %.1f"%(n,W,(T1-T0)/1e3,len(recs),sum(nits),st.mean(dur),max(dur),st.mean(pro),st.mean(loop),st.mean(ep),per_item,busy/((T1-T0)*132),starts[-1]))
