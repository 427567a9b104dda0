exec(open('single.py').read().split("print('tfidf+hand'")[0])
def j3(C, extra=None, ng=(1,2), md=3, wh=0.3, char=False, wc=1.0):
    def f(tr,te):
        v=TfidfVectorizer(ngram_range=ng,min_df=md,sublinear_tf=True)
        Xtr=[v.fit_transform([P[i] for i in tr])]; Xte=[v.transform([P[i] for i in te])]
        if char:
            cv_=TfidfVectorizer(analyzer='char_wb',ngram_range=(3,5),min_df=5,sublinear_tf=True,max_features=30000)
            Xtr.append(cv_.fit_transform([P[i] for i in tr])*wc); Xte.append(cv_.transform([P[i] for i in te])*wc)
        s=StandardScaler().fit(H[tr]); Xtr.append(csr_matrix(s.transform(H[tr])*wh)); Xte.append(csr_matrix(s.transform(H[te])*wh))
        if extra is not None: Xtr.append(csr_matrix(extra[tr])); Xte.append(csr_matrix(extra[te]))
        A=hstack(Xtr).tocsr(); Bt=hstack(Xte).tocsr()
        pl=LogisticRegression(C=C,max_iter=3000).fit(A,L[tr]).predict_proba(Bt)[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(A,S[tr]).predict_proba(Bt)[:,1]
        return pl-ps
    return f
print('w12 md3', m(j3(1)))
print('w12 md3 +char', m(j3(1,char=True)))
print('w12 md3 +char .5', m(j3(1,char=True,wc=0.5)))
print('w13 md3', m(j3(1,ng=(1,3))))
print('w12 md3 wh=1', m(j3(1,wh=1.0)))
