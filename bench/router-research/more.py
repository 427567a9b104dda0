exec(open('rep.py').read().split("if __name__")[0])
from scipy.sparse import hstack, csr_matrix
y=((S==0)&(L==1)).astype(int)
def tfC(C,label=y,ng=(1,2)):
    def f(tr,te):
        v=TfidfVectorizer(ngram_range=ng,min_df=2,sublinear_tf=True)
        X=v.fit_transform([P[i] for i in tr]); return LogisticRegression(C=C,max_iter=3000).fit(X,label[tr]).predict_proba(v.transform([P[i] for i in te]))[:,1]
    return f
for C in [0.1,0.3,1,3]:
    print('tfidf C',C, rcv(tfC(C),R=3))
print('tfidf smallwrong C1', rcv(tfC(1,(S==0).astype(int)),R=3))
print('tfidf largeright C1 (neg?)', rcv(tfC(1,(L==1).astype(int)),R=3))
