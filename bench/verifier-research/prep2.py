"""Extra request-time representations -> /tmp/vr/cache2.npz (all a<->b symmetric when combined)."""
import json, math, time
import numpy as np
from collections import Counter
t0 = time.time()
d = np.load('/tmp/vr/cache.npz'); n = len(d['y'])
ids = [json.loads(l) for l in open('/tmp/vr/vectors.ids.jsonl')]
lens = np.array([len(i) for i in ids]); off = np.concatenate([[0], np.cumsum(lens)])
T = np.fromfile('/tmp/vr/vectors.tok.f16', dtype='<f2').reshape(-1, 384)
ndoc = len(ids)
tdf = Counter(i for seq in ids for i in set(seq))
IDF = np.zeros(31000, np.float32)
for i in range(31000): IDF[i] = math.log((ndoc + 1) / (tdf.get(i, 0) + 1))
raw = open('/work/main/models/all-MiniLM-L6-v2/static.bin', 'rb').read()
vocab, dim = np.frombuffer(raw[12:20], dtype='<u4'); tab = np.frombuffer(raw[20:], dtype='<f4').reshape(vocab, dim)
def unit(v): return v / (np.linalg.norm(v) + 1e-9)
out = {k: np.zeros((n, 2, 384), np.float32) for k in ['idfpool', 'maxpool', 'unm_static', 'unm_ctx']}
cnt = np.zeros((n, 4), np.float32)
for k in range(n):
    sides = []
    for s in (0, 1):
        j = 2 * k + s
        sides.append((np.array(ids[j], dtype=np.int64), T[off[j]:off[j + 1]].astype(np.float32)))
    (ia, ta), (ib, tb) = sides
    M = ta @ tb.T if len(ta) and len(tb) else None
    for s, (ii, tt) in enumerate(sides):
        if len(tt) == 0: continue
        w = IDF[ii]
        out['idfpool'][k, s] = unit((tt * w[:, None]).sum(0))
        out['maxpool'][k, s] = unit(tt.max(0))
        other = set(sides[1 - s][0].tolist())
        m = np.array([i not in other for i in ii.tolist()])
        if m.any():
            out['unm_static'][k, s] = (tab[ii[m]] * w[m, None]).sum(0) / (w.sum() + 1e-9)
        cnt[k, s] = m.sum()
        if M is not None:
            best = M.max(1) if s == 0 else M.max(0)
            m2 = best < 0.6
            if m2.any():
                out['unm_ctx'][k, s] = (tt[m2] * w[m2, None]).sum(0) / (w.sum() + 1e-9)
            cnt[k, 2 + s] = m2.sum()
np.savez('/tmp/vr/cache2.npz', cnt=cnt, **out)
print('done', f'{time.time()-t0:.0f}s')
