exec(open('rep.py').read().split("if __name__")[0])
ben=L-S
subm={g:ben[G==g].mean() for g in np.unique(G)}
needm={g:((S==0)&(L==1))[G==g].mean() for g in np.unique(G)}
print('oracle subject benefit', metrics(np.array([subm[g] for g in G]),S,L)['apgr'])
print('oracle subject need', metrics(np.array([needm[g] for g in G]),S,L)['apgr'])
print('oracle subject small-wrong', metrics(np.array([1-S[G==g].mean() for g in G]),S,L)['apgr'])
print('oracle row', metrics(ben+0.0,S,L)['apgr'])
# without hs math
m=G!='mmlu_high_school_mathematics'
print('length no hsmath', metrics(np.array([len(p) for p in P],float)[m],S[m],L[m])['apgr'])
