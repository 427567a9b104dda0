B = bil()
cv_multi(f'd4 seed{SEED} GBM[F15 + extra21 + LR(BIL,PV,PVM,DC)]', FE, [('lrBIL', B, 'lr'), ('lrPV', PV, 'lr'), ('lrPVM', pv('maxpool'), 'lr'), ('lrDC', np.concatenate([sym3('unm_ctx'), CNT], 1), 'lr')])
cv(f'a seed{SEED} GBM F15', F, gbm)
