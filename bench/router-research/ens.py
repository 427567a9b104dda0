exec(open('emb.py').read().split("for nm,M in")[0])
from scipy.stats import rankdata
def zs(x): return (x-x.mean())/(x.std()+1e-9)
def combo(fs,w=None):
    def f(tr,te):
        outs=[zs(g(tr,te)) for g in fs]; w2=w or [1]*len(outs)
        return sum(a*b for a,b in zip(w2,outs))
    return f
def dh(C):
    def f(tr,te):
        s=StandardScaler().fit(H[tr]); M=np.hstack([E, s.transform(H)*0.3])
        return embdiff(M,C)(tr,te)
    return f
lenf2=lambda tr,te: np.log(np.array([len(P[i]) for i in te],float))
print('dense+hand diff', rcv(dh(0.3),R=3))
print('dense diff + tfidf ridge', rcv(combo([embdiff(E,0.3), ridge(1)]),R=3))
print('dense diff + tfidf ridge + length', rcv(combo([embdiff(E,0.3), ridge(1), lenf2]),R=3))
print('dense diff + tfidf + knn + handgbr', rcv(combo([embdiff(E,0.3), ridge(1), knn(E,100), handgbr]),R=3))
