cv_multi('b1 LR(PV) -> GBM F15+lr', F, [('lrPV', PV, 'lr')])
cv_multi('b2 MLP(PV) -> GBM F15+mlp', F, [('mlpPV', PV, 'mlp')])

