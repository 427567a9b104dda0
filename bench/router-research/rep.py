exec(open('feats.py').read().split("print('hand lr need'")[0])
def rcv(fit_predict, R=6, k=5):
    subs=np.unique(G); per=[]; pooled=[]
    for r in range(R):
        rng=np.random.default_rng(r); perm=rng.permutation(subs); fold={s:i%k for i,s in enumerate(perm)}
        f=np.array([fold[g] for g in G]); scores=np.zeros(len(P))
        for i in range(k):
            tr=np.where(f!=i)[0]; te=np.where(f==i)[0]
            scores[te]=fit_predict(tr,te); per.append(metrics(scores[te],S[te],L[te])['apgr'])
        pooled.append(metrics(scores,S,L)['apgr'])
    return round(float(np.mean(per)),3), round(float(np.std(per)),3), round(float(np.mean(pooled)),3), round(float(np.std(pooled)),3)
def rand(tr,te): return np.random.default_rng(len(te)).random(len(te))
def lenf(tr,te): return np.array([len(P[i]) for i in te],float)
def gbh(tr,te,label='need'):
    y=((S==0)&(L==1)).astype(int)
    m=HistGradientBoostingClassifier(max_depth=3,learning_rate=0.05,max_iter=200,l2_regularization=1.0).fit(H[tr],y[tr]); return m.predict_proba(H[te])[:,1]
def lrh(tr,te):
    y=((S==0)&(L==1)).astype(int); s=StandardScaler().fit(H[tr])
    return LogisticRegression(max_iter=2000).fit(s.transform(H[tr]),y[tr]).predict_proba(s.transform(H[te]))[:,1]
def tf(tr,te):
    y=((S==0)&(L==1)).astype(int); v=TfidfVectorizer(ngram_range=(1,2),min_df=2,sublinear_tf=True)
    X=v.fit_transform([P[i] for i in tr]); return LogisticRegression(max_iter=2000).fit(X,y[tr]).predict_proba(v.transform([P[i] for i in te]))[:,1]
if __name__=='__main__':
    for n,f in [('random',rand),('length',lenf),('tfidf',tf),('hand lr',lrh),('hand gb',gbh)]:
        print(n, rcv(f))
