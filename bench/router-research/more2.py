exec(open('rep.py').read().split("if __name__")[0])
from sklearn.linear_model import Ridge
from sklearn.ensemble import HistGradientBoostingRegressor
B=L-S
def vec(tr,te):
    v=TfidfVectorizer(ngram_range=(1,2),min_df=2,sublinear_tf=True)
    return v.fit_transform([P[i] for i in tr]), v.transform([P[i] for i in te])
def diff(C):
    def f(tr,te):
        Xtr,Xte=vec(tr,te)
        pl=LogisticRegression(C=C,max_iter=3000).fit(Xtr,L[tr]).predict_proba(Xte)[:,1]
        ps=LogisticRegression(C=C,max_iter=3000).fit(Xtr,S[tr]).predict_proba(Xte)[:,1]
        return pl-ps
    return f
def ridge(a):
    def f(tr,te):
        Xtr,Xte=vec(tr,te); return Ridge(alpha=a).fit(Xtr,B[tr]).predict(Xte)
    return f
def handridge(tr,te):
    s=StandardScaler().fit(H[tr]); return Ridge(alpha=10).fit(s.transform(H[tr]),B[tr]).predict(s.transform(H[te]))
def handgbr(tr,te):
    return HistGradientBoostingRegressor(max_depth=3,learning_rate=0.05,max_iter=150,l2_regularization=1).fit(H[tr],B[tr]).predict(H[te])
for C in [0.3,1,3]: print('diff C',C, rcv(diff(C),R=3))
for a in [1,3,10]: print('ridge',a, rcv(ridge(a),R=3))
print('hand ridge', rcv(handridge,R=3))
print('hand gbr', rcv(handgbr,R=3))
