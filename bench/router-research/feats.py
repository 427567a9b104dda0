import sys
exec(open('exp2.py').read().split("if __name__")[0])
import re
from sklearn.ensemble import HistGradientBoostingClassifier
def split(p):
    m=re.split(r'\n[A-D]\. ',p)
    q=m[0]; opts=[re.sub(r'\nAnswer:.*','',o,flags=re.S) for o in m[1:]]
    return q,opts
def hand(p):
    q,o=split(p)
    ol=[len(x) for x in o] or [0]
    num=lambda s: bool(re.fullmatch(r'[\s\$\-\d\.,/%^()a-zA-Z=+*]{0,12}',s)) and bool(re.search(r'\d',s))
    f=[np.log1p(len(q)), np.log1p(np.mean(ol)), np.std(ol)/(np.mean(ol)+1), len(o),
       np.mean([num(x) for x in o]) if o else 0,
       sum(c.isdigit() for c in q)/(len(q)+1),
       len(re.findall(r'[=+\^*/<>]|sqrt|\\frac',q))/(len(q)+1)*10,
       bool(re.search(r'\b(NOT|EXCEPT|LEAST|FALSE)\b',q)),
       p.startswith('Statement 1'),
       bool(re.search(r'[Ww]hich of the following',q)),
       bool(re.search(r'\b(def|return|int|printf|for|while)\b|[{};]',q)),
       q.count('\n'), bool(re.search(r'\?\s*$',q.strip())),
       bool(re.search(r'\b(all of the above|none of the above|both)\b',' '.join(o),re.I)),
       sum(w[0].isupper() for w in q.split()[1:] if w)/(len(q.split())+1),
       bool(re.search(r'\b(I+|IV)\.|\bI and II\b',p)),
       bool(re.search(r'_{2,}',q)),
      ]
    return [float(x) for x in f]
H=np.array([hand(p) for p in P])
from sklearn.preprocessing import StandardScaler
def handf(tr,te):
    s=StandardScaler().fit(H[tr]); return s.transform(H[tr]),s.transform(H[te])
print('hand lr need', cv(handf))
print('hand lr smallwrong', cv(handf,label='smallwrong'))
def gb(featfn,label='need',folds=7):
    scores=np.zeros(len(rows)); ms=[]
    y=((S==0)&(L==1)).astype(int) if label=='need' else (S==0).astype(int)
    for tr,te in GroupKFold(n_splits=folds).split(P,groups=G):
        Xtr,Xte=featfn(tr,te)
        m=HistGradientBoostingClassifier(max_depth=3,learning_rate=0.05,max_iter=200,l2_regularization=1.0).fit(Xtr,y[tr])
        scores[te]=m.predict_proba(Xte)[:,1]; ms.append(metrics(scores[te],S[te],L[te]))
    return {k:round(float(np.mean([m[k] for m in ms])),3) for k in ms[0]}, round(float(metrics(scores,S,L)['apgr']),3)
print('hand gb need', gb(handf))
