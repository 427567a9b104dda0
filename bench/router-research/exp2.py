import json, numpy as np, re
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import GroupKFold
rows=[json.loads(l) for l in open('/work/shared/data/routing-dev.jsonl')]
P=[r['prompt'] for r in rows]; S=np.array([r['small_correct'] for r in rows],float); L=np.array([r['large_correct'] for r in rows],float)
G=np.array([r['source'] for r in rows])
def curve(score, s, l, order_seed=0):
    n=len(s); idx=np.argsort(-score, kind='stable')
    qs, ql = s.mean(), l.mean()
    # quality when top-k go to large
    gain = (l-s)[idx]
    cum = np.concatenate([[0],np.cumsum(gain)])
    q = (s.sum()+cum)/n
    pgr = (q-qs)/(ql-qs)
    shares=np.arange(n+1)/n
    return shares, pgr
def metrics(score,s,l):
    shares,pgr=curve(score,s,l)
    apgr=np.trapezoid(pgr,shares)
    at=lambda x: pgr[int(round(x*len(s)))]
    def cpt(t):
        k=np.argmax(pgr>=t); return shares[k]
    return dict(apgr=apgr,p20=at(.2),p50=at(.5),p80=at(.8),cpt50=cpt(.5),cpt80=cpt(.8))
def cv(featfn, model='lr', label='need', folds=7):
    scores=np.zeros(len(rows))
    gkf=GroupKFold(n_splits=folds); ms=[]
    for tr,te in gkf.split(P,groups=G):
        Xtr,Xte=featfn(tr,te)
        if label=='need': y=((S==0)&(L==1)).astype(int)
        elif label=='smallwrong': y=(S==0).astype(int)
        elif label=='benefit': y=L-S
        if model=='lr':
            m=LogisticRegression(C=1.0,max_iter=2000).fit(Xtr,y[tr]); scores[te]=m.predict_proba(Xte)[:,1] if label!='benefit' else m.decision_function(Xte)
        else:
            m=Ridge(alpha=1.0).fit(Xtr,y[tr]); scores[te]=m.predict(Xte)
        ms.append(metrics(scores[te],S[te],L[te]))
    pooled=metrics(scores,S,L)
    avg={k:round(float(np.mean([m[k] for m in ms])),3) for k in ms[0]}
    return 'avg',avg,'pooled apgr',round(float(pooled['apgr']),3)
def tfidf(tr,te):
    v=TfidfVectorizer(ngram_range=(1,2),min_df=2,sublinear_tf=True); Xtr=v.fit_transform([P[i] for i in tr]); return Xtr, v.transform([P[i] for i in te])
def length(tr,te):
    x=np.array([[np.log1p(len(p))] for p in P]); return x[tr],x[te]
if __name__=='__main__':
    print('length', cv(length))
    print('tfidf need', cv(tfidf))
    print('tfidf benefit ridge', cv(tfidf,model='ridge',label='benefit'))
    print('tfidf smallwrong', cv(tfidf,label='smallwrong'))
    print('length loso', cv(length,folds=28))
    print('tfidf loso', cv(tfidf,folds=28))
