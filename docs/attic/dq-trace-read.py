# dq-trace-read.py - reads docs/attic/dq-trace.patch's records (session 14) and prints, for
# the dQ pass, per-item phase times (us), the context-tile cost per tile and CTA tails (one
# summary per layout: the last traced launch of each), and for the context dK/dV pass, per-CTA
# prologue / loop / epilogue, per-item loop time and the SM busy fraction (per traced launch).
# With 32-word records (dq-trace-tiles.patch) also the in-tile spans per context tile.
# Usage: python3 dq-trace-read.py [trace dir, default /tmp/tr] [16 | 32: words per record]
import glob, re, sys, array, statistics as st
DIR = sys.argv[1] if len(sys.argv) > 1 else '/tmp/tr'
WORDS = int(sys.argv[2]) if len(sys.argv) > 2 else 16
def load(f):
    a=array.array('I'); a.frombytes(open(f,'rb').read())
    return [a[i:i+WORDS] for i in range(0,len(a),WORDS)]
def cfg(f):
    return int(re.findall(r'_(\d+)_W',f)[0]), int(re.findall(r'_W(\d+)',f)[0])
out={}
for f in glob.glob(DIR + '/t_dq_*.bin'):
    n,W=cfg(f)
    recs=[r for r in load(f) if (r[10]|r[11])]
    mn=sum(r[1] for r in recs)/len(recs)
    key=(W,'3docs' if mn<20 else '1doc')
    out.setdefault(key,[]).append((n,recs))
def med(x): return st.median(x) if x else float('nan')
for key in sorted(out):
    n,recs=max(out[key])  # last launch of the config
    g0=[r[10]|(r[11]<<32) for r in recs]; g1=[r[12]|(r[13]<<32) for r in recs]
    T0=min(g0); T1=max(g1)
    cyc=sum(r[8] for r in recs); ns=sum(b-a for a,b in zip(g0,g1))
    ghz=cyc/ns
    print("== dq", key, "launch", n, "items", len(recs), "span us %.1f"%((T1-T0)/1e3), "clock GHz %.3f"%ghz)
    # phases (us)
    names=['first tile','ctx tiles','blk tile','dq store','fold','end']
    ph=[[] for _ in names]
    for r in recs:
        c=[0]+list(r[3:9])
        for i in range(6): ph[i].append((c[i+1]-c[i])/ghz/1e3)
    tot=[(r[8])/ghz/1e3 for r in recs]
    print("  item mean us %.2f ; phases mean:"%st.mean(tot), ", ".join("%s %.2f"%(nm,st.mean(p)) for nm,p in zip(names,ph)))
    # ctx tiles regression on ntc
    xs=[r[1] for r in recs]; ys=ph[1]
    mx=st.mean(xs); my=st.mean(ys)
    sl=sum((x-mx)*(y-my) for x,y in zip(xs,ys))/sum((x-mx)**2 for x in xs); ic=my-sl*mx
    print("  ctx tiles: us = %.3f + %.3f * ntc  (mean ntc %.2f)"%(ic,sl,mx))
    # early flag
    print("  early items: %d of %d"%(sum(1 for r in recs if r[14]), len(recs)))
    # per CTA tail
    per={}
    for r,a,b in zip(recs,g0,g1): per.setdefault(r[2],[]).append((a,b))
    ends=[max(b for a,b in v) for v in per.values()]; starts=[min(a for a,b in v) for v in per.values()]
    busy=sum(sum(b-a for a,b in v) for v in per.values())
    print("  CTAs %d; start spread us %.2f; end: min %.1f med %.1f max %.1f us after T0; busy/(span*CTAs) %.3f"%(len(per),(max(starts)-min(starts))/1e3,(min(ends)-T0)/1e3,(med(ends)-T0)/1e3,(T1-T0)/1e3,busy/((T1-T0)*len(per))))
    gaps=[]
    for v in per.values():
        v.sort()
        for (a,b),(c,d) in zip(v,v[1:]): gaps.append((c-b)/1e3)
    print("  gap between a CTA's items us: mean %.3f"%st.mean(gaps))
    # by ntc bucket
    buck={}
    for r,t in zip(recs,tot): buck.setdefault(min(r[1]//4*4,40),[]).append(t)
    if WORDS == 32:
        nt=sum(r[1] for r in recs)
        spans=['TMA wait','barrier','issue + S wait','softmax + dP wait','dS + dQ + wait']
        print("  per context tile us: " + ", ".join("%s %.3f"%(nm, sum(r[16+i] for r in recs)/max(1,nt)/ghz/1e3) for i,nm in enumerate(spans)))
    print("  item us by ntc bucket:", " ".join("%d:%.1f(%d)"%(k,st.mean(v),len(v)) for k,v in sorted(buck.items())))

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
