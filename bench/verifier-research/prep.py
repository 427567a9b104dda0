"""Load dumps into /tmp/vr/cache.npz: y, F15, U, V (transformer), SU, SV (static), and extra
lexical / token-alignment features computed at request time from the two texts."""
import json, re, math, time
import numpy as np
from collections import Counter

t0 = time.time()
P = '/work/shared/data/qqp-dev.jsonl'
pairs = [json.loads(l) for l in open(P) if l.strip()]
n = len(pairs)
y = np.array([p['duplicate'] for p in pairs], dtype=np.int8)
feats = [json.loads(l) for l in open('/tmp/vr/features.jsonl')]
F = np.array([f['features'] for f in feats], dtype=np.float32)
assert (np.array([f['duplicate'] for f in feats]) == y).all()
X = np.fromfile('/tmp/vr/vectors.f32', dtype='<f4').reshape(n, 2, 384)
S = np.fromfile('/tmp/vr/vectors.static.f32', dtype='<f4').reshape(n, 2, -1)
U, V = X[:, 0], X[:, 1]
cos = (U * V).sum(1)
print('max |cos - F[:,0]|', np.abs(cos - F[:, 0]).max())

ids = [json.loads(l) for l in open('/tmp/vr/vectors.ids.jsonl')]
lens = np.array([len(i) for i in ids])
off = np.concatenate([[0], np.cumsum(lens)])
T = np.fromfile('/tmp/vr/vectors.tok.f16', dtype='<f2').reshape(-1, 384)
assert T.shape[0] == off[-1]

# Document frequencies over all dev texts (label-free; in production: over the cache's corpus).
def words(t):
    return [w.lower() for w in re.split(r"[^\w']+", t) if w]
texts = [t for p in pairs for t in (p['a'], p['b'])]
W = [words(t) for t in texts]
ndoc = len(texts)
wdf = Counter(w for ws in W for w in set(ws))
tdf = Counter(i for seq in ids for i in set(seq))
widf = lambda w: math.log((ndoc + 1) / (wdf.get(w, 0) + 1))
tidf = lambda i: math.log((ndoc + 1) / (tdf.get(i, 0) + 1))
STOP = set("the a an of to in is are what how why which who i you my do does can for and or on with be it that this".split())

names = []
rows = []
for k in range(n):
    wa, wb = set(W[2 * k]), set(W[2 * k + 1])
    ia = np.array([widf(w) for w in wa]); ib = np.array([widf(w) for w in wb])
    ua = [widf(w) for w in wa - wb]; ub = [widf(w) for w in wb - wa]
    tot = ia.sum() + ib.sum() + 1e-9
    inter = sum(widf(w) for w in wa & wb)
    unm = sum(ua) + sum(ub)
    f = [
        unm / tot,                                     # idf-weighted share of unmatched words
        2 * inter / tot,                               # idf-weighted dice
        max(ua + [0.0]), max(ub + [0.0]),
        max(max(ua + [0.0]), max(ub + [0.0])),         # rarest unmatched word
        min(max(ua + [0.0]), max(ub + [0.0])),         # both sides have a rare unmatched word
        sum(ua), sum(ub), unm,
        len([x for x in ua + ub if x > 5.0]),          # count of rare unmatched words
    ]
    # contextual token alignment, idf weighted (BERTScore-like)
    ta = T[off[2 * k]:off[2 * k + 1]].astype(np.float32)
    tb = T[off[2 * k + 1]:off[2 * k + 2]].astype(np.float32)
    sa = np.array([tidf(i) for i in ids[2 * k]]); sb = np.array([tidf(i) for i in ids[2 * k + 1]])
    if len(ta) and len(tb):
        M = ta @ tb.T
        ba, bb = M.max(1), M.max(0)
        Pr = (ba * sa).sum() / sa.sum(); Rc = (bb * sb).sum() / sb.sum()
        allb = np.concatenate([ba, bb]); alls = np.concatenate([sa, sb])
        hi = alls > np.median(alls)
        f += [
            Pr, Rc, 2 * Pr * Rc / (Pr + Rc + 1e-9), min(Pr, Rc),
            allb[hi].min() if hi.any() else allb.min(),       # weakest match among rare tokens
            (alls * (allb < 0.5)).sum() / alls.sum(),          # idf mass of poorly matched tokens
            (alls * (allb < 0.7)).sum() / alls.sum(),
            max(alls[allb < 0.5], default=0.0),                # rarest poorly matched token
            np.sort(allb)[1] if len(allb) > 1 else allb[0],    # second weakest
            (allb < 0.6).mean(),
        ]
    else:
        f += [0.0] * 10
    # SIF-like idf-weighted static sentence cosine needs token vectors of the static table:
    rows.append(f)
names = ['w_unm_share', 'w_idf_dice', 'w_max_unm_a', 'w_max_unm_b', 'w_max_unm', 'w_min_of_max_unm',
         'w_sum_unm_a', 'w_sum_unm_b', 'w_sum_unm', 'w_n_rare_unm',
         'c_bs_p', 'c_bs_r', 'c_bs_f', 'c_bs_min', 'c_weak_rare', 'c_idf_lt05', 'c_idf_lt07',
         'c_max_idf_lt05', 'c_second_weak', 'c_frac_lt06']
E = np.array(rows, dtype=np.float32)

# idf-weighted static sentence vectors (static table rows summed with idf weights)
raw = open('/work/main/models/all-MiniLM-L6-v2/static.bin', 'rb').read()
vocab, dim = np.frombuffer(raw[12:20], dtype='<u4')
tab = np.frombuffer(raw[20:], dtype='<f4').reshape(vocab, dim)
# note: static tokenizer = same wordpiece vocab, no truncation; ids here are truncated at 254,
# irrelevant for questions.
def sif(seq):
    if not seq: return np.zeros(dim, np.float32)
    w = np.array([tidf(i) for i in seq], np.float32)
    v = (tab[seq] * w[:, None]).sum(0); return v / (np.linalg.norm(v) + 1e-9)
SIa = np.stack([sif(ids[2 * k]) for k in range(n)]); SIb = np.stack([sif(ids[2 * k + 1]) for k in range(n)])
E = np.concatenate([E, (SIa * SIb).sum(1, keepdims=True)], 1); names.append('s_idf_cos')
np.savez('/tmp/vr/cache.npz', y=y, F=F, U=U, V=V, SU=S[:, 0], SV=S[:, 1], E=E, names=np.array(names),
         SIa=SIa, SIb=SIb)
print('done', E.shape, f'{time.time()-t0:.0f}s')
