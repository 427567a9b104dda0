"""Stratified 5-fold CV of verifier variants; held-out (pooled out-of-fold) recall at precision."""
import sys, time, json, os
import numpy as np
from sklearn.model_selection import StratifiedKFold
from sklearn.linear_model import LogisticRegression
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.preprocessing import StandardScaler
from sklearn.pipeline import make_pipeline

SEED = int(os.environ.get('SEED', '0'))
import os
d = np.load('/tmp/vr/cache.npz')
y = d['y'].astype(int); F = d['F']; U = d['U']; V = d['V']; SU = d['SU']; SV = d['SV']; E = d['E']
names = list(d['names'])
n = len(y)
import os, collections
GMODE = os.environ.get('GROUPED', '1')   # 0 random pairs, 1 question components, topic: k-means topic clusters
GROUPED = GMODE != '0'
# groups: connected components of the question graph (pairs sharing a normalised text), so that no
# question text is in both a training and a held-out pair (QQP reuses questions; dup rate 0.69 vs 0.31).
_P = [json.loads(l) for l in open('/work/shared/data/qqp-dev.jsonl') if l.strip()]
_norm = lambda t: ' '.join(t.lower().split())
_par = {}
def _f(x):
    while _par.setdefault(x, x) != x: _par[x] = _par[_par[x]]; x = _par[x]
    return x
for p in _P: _par[_f(_norm(p['a']))] = _f(_norm(p['b']))
_ids = {}
groups = np.array([_ids.setdefault(_f(_norm(p['a'])), len(_ids)) for p in _P])
if GMODE == 'topic':
    # 100 k-means clusters of the pair midpoint direction; a question component takes the cluster of its
    # first pair, so whole topics (and all repeats of a question) are held out together.
    from sklearn.cluster import KMeans
    _d = np.load('/tmp/vr/cache.npz'); _M = _d['U'] + _d['V']; _M /= np.linalg.norm(_M, axis=1, keepdims=True)
    _cl = KMeans(100, n_init=3, random_state=0).fit_predict(_M)
    _first = {}
    groups = np.array([_first.setdefault(g, c) for g, c in zip(groups, _cl)])
from sklearn.model_selection import StratifiedGroupKFold
def splits(k, idx, seed):
    if GROUPED:
        return list(StratifiedGroupKFold(k, shuffle=True, random_state=seed).split(idx, y[idx], groups[idx]))
    return list(StratifiedKFold(k, shuffle=True, random_state=seed).split(idx, y[idx]))
outer = splits(5, np.arange(n), SEED)
TAG = {'0': 'r', '1': 'g', 'topic': 't'}[GMODE]

def r_at_p(s, yy, p):
    o = np.argsort(-s, kind='stable'); ys = yy[o]; ss = s[o]
    tp = np.cumsum(ys); k = np.arange(1, len(ys) + 1)
    last = np.r_[ss[1:] != ss[:-1], True]          # only cut between distinct scores
    prec = tp / k; rec = tp / yy.sum()
    ok = last & (prec >= p)
    return rec[ok].max() if ok.any() else 0.0

def report(name, oof, secs):
    res = {p: r_at_p(oof, y, p) for p in (0.80, 0.90, 0.95)}
    o = np.argsort(-oof, kind='stable'); tp = np.cumsum(y[o]); k = int(np.ceil(0.30 * y.sum()))
    p_at_r = tp[np.searchsorted(tp, k)] / (np.searchsorted(tp, k) + 1)
    from sklearn.metrics import average_precision_score
    ap = average_precision_score(y, oof)
    folds = [r_at_p(oof[te], y[te], 0.90) for _, te in outer]
    line = (f"| {name} | {res[0.80]:.3f} | {res[0.90]:.3f} | {res[0.95]:.3f} | "
            f"{np.mean(folds):.3f} ± {np.std(folds):.3f} ({min(folds):.3f}-{max(folds):.3f}) | {p_at_r:.3f} | {ap:.3f} | {secs:.0f}s |")
    print(line, flush=True)
    with open(f'/tmp/vr/results_{TAG}.md', 'a') as f: f.write(line + '\n')
    np.save(f'/tmp/vr/oof_{TAG}_{name.replace(" ", "_").replace("/", "-")}.npy', oof)

# ---- base learners: fit(Xtr, ytr) -> predict(Xte) ----
def gbm(Xtr, ytr, Xte):
    # fixed defaults mirroring the Rust trainer: 200 trees, depth 3, lr 0.1, l2 1, min_leaf 20
    m = HistGradientBoostingClassifier(max_iter=200, max_depth=3, learning_rate=0.1, l2_regularization=1.0,
                                       min_samples_leaf=20, max_bins=64, early_stopping=False, random_state=SEED)
    return m.fit(Xtr, ytr).predict_proba(Xte)[:, 1]

def gbm_big(Xtr, ytr, Xte):
    # larger, early-stopped on an inner 10% split (no peeking at the held-out fold)
    m = HistGradientBoostingClassifier(max_iter=2000, max_depth=None, max_leaf_nodes=15, learning_rate=0.03,
                                       l2_regularization=1.0, min_samples_leaf=40, early_stopping=True,
                                       validation_fraction=0.1, n_iter_no_change=50, random_state=SEED)
    return m.fit(Xtr, ytr).predict_proba(Xte)[:, 1]

CS = [1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 1.0]

def mlp(Xtr, ytr, Xte, seeds=(0, 1, 2)):
    out = 0
    for s in seeds:
        m = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(256,), alpha=1e-2, batch_size=256,
                          learning_rate_init=1e-3, early_stopping=True, validation_fraction=0.1,
                          n_iter_no_change=10, max_iter=200, random_state=s))
        out = out + m.fit(Xtr, ytr).predict_proba(Xte)[:, 1]
    return out / len(seeds)

def cv(name, X, learner):
    t = time.time(); oof = np.zeros(n)
    for tr, te in outer:
        oof[te] = learner(X[tr], y[tr], X[te])
    report(name, oof, time.time() - t); return oof

def logit(p):
    p = np.clip(p, 1e-6, 1 - 1e-6); return np.log(p / (1 - p))

PV = np.concatenate([U * V, np.abs(U - V)], 1)           # 768
SPV = np.concatenate([SU * SV, np.abs(SU - SV)], 1)
FE = np.concatenate([F, E], 1)


def choose_C(Xtr, ytr, TR):
    inner = splits(3, TR, SEED + 1)
    best = None
    for C in CS:
        ll = 0.0
        for a, b in inner:
            m = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
            p = np.clip(m.fit(Xtr[a], ytr[a]).predict_proba(Xtr[b])[:, 1], 1e-6, 1 - 1e-6)
            ll -= np.mean(ytr[b] * np.log(p) + (1 - ytr[b]) * np.log(1 - p))
        if best is None or ll < best[0]: best = (ll, C)
    return best[1]

def make_base(kind, Xb_tr, ytr, tr):
    """Returns fit(Xa, ya) -> model with predict_proba; hyper-parameters fixed or chosen on the
    outer training fold only."""
    if kind == 'lr':
        C = choose_C(Xb_tr, ytr, tr)
        return (lambda Xa, ya: make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=3000)).fit(Xa, ya)), C
    if kind == 'mlp':
        class Avg:
            def fit(self, Xa, ya):
                self.ms = [make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(256,), alpha=1e-2,
                           batch_size=256, learning_rate_init=1e-3, early_stopping=True, validation_fraction=0.1,
                           n_iter_no_change=10, max_iter=200, random_state=s)).fit(Xa, ya) for s in (0, 1, 2)]
                return self
            def predict_proba(self, Xb):
                return np.mean([m.predict_proba(Xb) for m in self.ms], 0)
        return (lambda Xa, ya: Avg().fit(Xa, ya)), 'mlp'
    raise ValueError(kind)

def cv_multi(name, Xtab, bases, learner=gbm, k_inner=5):
    """bases: list of (label, X, kind). Stacked properly: inner OOF scores on the training fold feed the
    trees; held-out rows get the base fit on the whole training fold. Xtab=None: average of base logits."""
    t = time.time(); oof = np.zeros(n); oof_b = np.zeros((len(bases), n)); chosen = []
    for fi, (tr, te) in enumerate(outer):
        cols_tr, cols_te = [], []
        for j, (lab, Xb, kind) in enumerate(bases):
            key = f'/tmp/vr/base_{TAG}{SEED}_{lab}_{fi}.npz'
            if os.path.exists(key):
                z = np.load(key); s_tr, s_te = z['s_tr'], z['s_te']
            else:
                fit, hp = make_base(kind, Xb[tr], y[tr], tr); chosen.append((lab, hp))
                s_tr = np.zeros(len(tr))
                for a, b in splits(k_inner, tr, SEED + 2):
                    s_tr[b] = fit(Xb[tr[a]], y[tr[a]]).predict_proba(Xb[tr[b]])[:, 1]
                s_te = fit(Xb[tr], y[tr]).predict_proba(Xb[te])[:, 1]
                np.savez(key, s_tr=s_tr, s_te=s_te)
            oof_b[j, te] = s_te
            cols_tr.append(logit(s_tr)); cols_te.append(logit(s_te))
        if Xtab is None:
            oof[te] = np.mean(cols_te, 0)
        else:
            oof[te] = learner(np.column_stack([Xtab[tr]] + cols_tr), y[tr], np.column_stack([Xtab[te]] + cols_te))
    print('  hyper-parameters', chosen, flush=True)
    for j, (lab, _, _) in enumerate(bases):
        report(f'{name} [base {lab} alone]', oof_b[j], 0)
    if Xtab is not None or len(bases) > 1:
        report(name, oof, time.time() - t)
    return oof

d2 = np.load('/tmp/vr/cache2.npz')
def pv(k):
    a, b = d2[k][:, 0], d2[k][:, 1]; return np.concatenate([a * b, np.abs(a - b)], 1)
def sym3(k):
    a, b = d2[k][:, 0], d2[k][:, 1]; return np.concatenate([a + b, np.abs(a - b), a * b], 1)
CNT = d2['cnt']
def bil(k=48):
    Z = np.concatenate([U, V]); mu = Z.mean(0); _, _, Vt = np.linalg.svd(Z - mu, full_matrices=False)
    pa, pb = (U - mu) @ Vt[:k].T, (V - mu) @ Vt[:k].T
    iu = np.triu_indices(k)
    return (pa[:, :, None] * pb[:, None, :] + pb[:, :, None] * pa[:, None, :])[:, iu[0], iu[1]]
if __name__ == '__main__':
    which = sys.argv[1:]
    for w in which:
        print('#', w, flush=True)
        exec(open(f'/tmp/vr/v_{w}.py').read())
