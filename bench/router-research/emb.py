exec(open('more2.py').read().split("for C in")[0])
E=np.fromfile('route.f32',dtype='<f4').reshape(-1,384); T=np.fromfile('route.static.f32',dtype='<f4').reshape(-1,384)
def embdiff(M,C):
    def f(tr,te):
        pl=LogisticRegression(C=C,max_iter=3000).fit(M[tr],L[tr]).predict_proba(M[te])[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(M[tr],S[tr]).predict_proba(M[te])[:,1]
        return pl-ps
    return f
def embridge(M,a):
    def f(tr,te): return Ridge(alpha=a).fit(M[tr],B[tr]).predict(M[te])
    return f
def knn(M,k):
    def f(tr,te):
        sims=M[te]@M[tr].T; idx=np.argsort(-sims,axis=1)[:,:k]; return B[tr][idx].mean(1)
    return f
for nm,M in [('dense',E),('static',T)]:
    for C in [0.3,1,3]: print(nm,'diff',C, rcv(embdiff(M,C),R=3))
    for a in [1,10]: print(nm,'ridge',a, rcv(embridge(M,a),R=3))
    for k in [25,100]: print(nm,'knn',k, rcv(knn(M,k),R=3))
