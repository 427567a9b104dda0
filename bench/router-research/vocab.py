exec(open('single.py').read().split("print('tfidf+hand'")[0])
def joint2(M, C, md=2, ng=(1,2), wh=0.3):
    def f(tr,te):
        v=TfidfVectorizer(ngram_range=ng,min_df=md,sublinear_tf=True)
        Xtr=v.fit_transform([P[i] for i in tr]); Xte=v.transform([P[i] for i in te])
        s=StandardScaler().fit(H[tr])
        A=hstack([Xtr, csr_matrix(s.transform(H[tr])*wh), csr_matrix(M[tr])]).tocsr(); Bt=hstack([Xte, csr_matrix(s.transform(H[te])*wh), csr_matrix(M[te])]).tocsr()
        pl=LogisticRegression(C=C,max_iter=3000).fit(A,L[tr]).predict_proba(Bt)[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(A,S[tr]).predict_proba(Bt)[:,1]
        return pl-ps
    return f
for md,ng in [(2,(1,1)),(3,(1,2)),(5,(1,2))]:
    v=TfidfVectorizer(ngram_range=ng,min_df=md).fit(P); print(md,ng,len(v.vocabulary_), m(joint2(Tn,1,md,ng)))
