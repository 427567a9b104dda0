exec(open('single.py').read().split("print('tfidf+hand'")[0])
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer
def hjoint(M, C, nb=4096, std=False, wh=0.3, wm=1.0):
    def f(tr,te):
        hv=HashingVectorizer(n_features=nb,ngram_range=(1,2),alternate_sign=False,norm=None)
        Xa=hv.transform(P); 
        df=(Xa[tr]>0).sum(0).A1; idf=np.log((1+len(tr))/(1+df))+1
        X=Xa.copy().astype(float); X.data=1+np.log(X.data); X=X.multiply(idf).tocsr()
        from sklearn.preprocessing import normalize; X=normalize(X)
        s=StandardScaler().fit(H[tr]); Hs=s.transform(H)*wh
        A=hstack([X, csr_matrix(Hs), csr_matrix(M*wm)]).tocsr()
        if std:
            A=A.toarray(); sc=StandardScaler().fit(A[tr]); A=sc.transform(A)
        pl=LogisticRegression(C=C,max_iter=3000).fit(A[tr],L[tr]).predict_proba(A[te])[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(A[tr],S[tr]).predict_proba(A[te])[:,1]
        return pl-ps
    return f
print('hash4096 static', m(hjoint(Tn,1)))
print('hash16384 static', m(hjoint(Tn,1,nb=16384)))
print('hash4096 static std C.001', m(hjoint(Tn,0.001,std=True)))
print('hash4096 static std C.01', m(hjoint(Tn,0.01,std=True)))
