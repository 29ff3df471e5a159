#!/usr/bin/env python3
"""Import circles among the modules of one crate: python3 tools/import_cycles.py proxy-ebpf/src
(or proxy-user/src kpr). Follows `use` paths and inline crate::/super::/self:: paths, skips
#[cfg(test)] modules, and prints each strongly connected set with its edges (issue 44 §2)."""
import re,sys,os,glob
root=sys.argv[1]  # e.g. proxy-ebpf/src
crate_name=sys.argv[2] if len(sys.argv)>2 else None
def modpath(f):
    rel=os.path.relpath(f,root)[:-3].split('/')
    if rel[-1] in ('mod','lib','main'): rel=rel[:-1]
    return tuple(rel)
files=[f for f in glob.glob(root+'/**/*.rs',recursive=True)]
# A binary's main.rs beside lib.rs is another crate: nothing in the library can import it.
if os.path.exists(root+'/lib.rs'): files=[f for f in files if f!=root+'/main.rs']
mods={modpath(f):f for f in files}
def strip_tests(s):
    # drop #[cfg(test)] mod blocks (approx: from the attribute to the end of file if at col 0 'mod x {')
    m=re.search(r'^#\[cfg\(test\)\]\nmod \w+ \{',s,re.M)
    return s[:m.start()] if m else s
def resolve(cur, segs):
    # segs: path segments after use; returns module tuple that exists (longest prefix)
    if segs[0]=='crate' or (crate_name and segs[0]==crate_name): base=(); segs=segs[1:]
    elif segs[0]=='self': base=cur; segs=segs[1:]
    elif segs[0]=='super':
        base=cur
        while segs and segs[0]=='super': base=base[:-1]; segs=segs[1:]
    else:
        # could be a child module or external crate
        if cur+(segs[0],) in mods: base=cur
        else: return None
    best=None
    p=base
    if p in mods: best=p
    for s in segs:
        p=p+(s,)
        if p in mods: best=p
        else: break
    return best
def paths_in_use(body):
    out=[]
    def rec(prefix, s):
        parts=[];d=0;c=''
        for ch in s:
            if ch=='{': d+=1
            if ch=='}': d-=1
            if ch==',' and d==0: parts.append(c.strip()); c=''
            else: c+=ch
        if c.strip(): parts.append(c.strip())
        for p in parts:
            if '{' in p:
                h,r=p.split('{',1); r=r.rsplit('}',1)[0]
                rec(prefix+[x for x in h.rstrip(':').split('::') if x], r)
            else:
                out.append(prefix+[x.split(' as ')[0].strip() for x in p.split('::')])
    rec([], body)
    return out
edges={}
for m,f in mods.items():
    s=strip_tests(open(f).read())
    s=re.sub(r'//.*','',s)
    deps=set()
    for u in re.finditer(r'^\s*(?:pub(?:\([a-z]+\))? )?use\s+([^;]+);',s,re.M):
        for segs in paths_in_use(u.group(1).replace('\n',' ')):
            if segs==['']: continue
            r=resolve(m,segs)
            if r is not None and r!=m: deps.add(r)
    # Paths written inline (a `use` was read whole above: its `a::{b, c}` is not a use of `a`).
    inline=re.sub(r'^\s*(?:pub(?:\([a-z]+\))? )?use\s+[^;]+;','',s,flags=re.M)
    for u in re.finditer(r'(?<![\w:])((?:crate|super|self)(?:::\w+)+)',inline):
        r=resolve(m,u.group(1).split('::'))
        if r is not None and r!=m: deps.add(r)
    # `mod x;` in a parent is a declaration, not a use: it adds no edge.
    edges[m]=deps
# find cycles (SCCs)
idx={};low={};st=[];on=set();res=[];c=[0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in edges.get(v,()):
        if w not in idx: sc(w); low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v: break
        if len(comp)>1: res.append(comp)
for v in list(edges):
    if v not in idx: sc(v)
for comp in res:
    print('CYCLE:', sorted('::'.join(x) or 'crate' for x in comp))
    for a in comp:
        for b in edges[a]:
            if b in comp: print('   ', '::'.join(a) or 'crate','->','::'.join(b) or 'crate')
if not res: print('no cycles')
