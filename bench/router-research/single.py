exec(open('ens.py').read().split("print('dense+hand")[0])
from scipy.sparse import hstack, csr_matrix
Tn=T/np.linalg.norm(T,axis=1,keepdims=True)
def joint(M, C, wt=1.0, wm=1.0, wh=0.3, lab='diff'):
    def f(tr,te):
        v=TfidfVectorizer(ngram_range=(1,2),min_df=2,sublinear_tf=True)
        Xtr=v.fit_transform([P[i] for i in tr]); Xte=v.transform([P[i] for i in te])
        s=StandardScaler().fit(H[tr])
        parts_tr=[Xtr*wt, csr_matrix(s.transform(H[tr])*wh)]; parts_te=[Xte*wt, csr_matrix(s.transform(H[te])*wh)]
        if M is not None: parts_tr.append(csr_matrix(M[tr]*wm)); parts_te.append(csr_matrix(M[te]*wm))
        A=hstack(parts_tr).tocsr(); Bt=hstack(parts_te).tocsr()
        pl=LogisticRegression(C=C,max_iter=3000).fit(A,L[tr]).predict_proba(Bt)[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(A,S[tr]).predict_proba(Bt)[:,1]
        return pl-ps
    return f
def m(f):
    # also cpt80
    subs=np.unique(G); res=[]
    for r in range(3):
        rng=np.random.default_rng(r); perm=rng.permutation(subs); fold={s:i%5 for i,s in enumerate(perm)}
        fo=np.array([fold[g] for g in G]); sc=np.zeros(len(P))
        for i in range(5):
            tr=np.where(fo!=i)[0]; te=np.where(fo==i)[0]; sc[te]=f(tr,te)
        res.append(metrics(sc,S,L))
    return {k:round(float(np.mean([x[k] for x in res])),3) for k in res[0]}
print('tfidf+hand', m(joint(None,1)))
print('tfidf+hand+static', m(joint(Tn,1)))
print('tfidf+hand+dense', m(joint(E,1)))
print('tfidf+hand+dense C.3', m(joint(E,0.3)))
